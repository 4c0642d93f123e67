"""Every value a run takes either from its plan or from a flag, resolved once.

The rule (docs/RUNTIME.md, "Plan or flag: one rule"): a flag left out takes the plan's value. A flag
that changes a setting the plan's figures were computed for (:data:`PLANNED`: ``--zero-stage``, the
model-state memory; ``--recompute``, the activation memory) must equal the plan's value, or the
run is refused with one line of one shape, naming the flag that accepts it::

    the plan was made for --zero-stage 1 (its model-state memory per GPU), not 3; re-plan with
    `zeppelin plan --zero-stage 3` or pass --zero-stage-override

Execution choices the plan does not price (``--tp-overlap``, whose prediction ``--report`` redoes
for the run's mode; ``--dtype``; ``--seed``, the model's initialisation) take the flag's value.

This module imports nothing heavy (the command line checks the rule before any process starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeppelin.schemas.common import InputError

__all__ = ["PLANNED", "Planned", "Settings", "check_planned", "resolve"]


@dataclass(frozen=True)
class Planned:
    """A setting the plan's figures were computed for: the run may change it only with ``override``."""

    name: str        # the RunConfig field, and the plan header's field
    flag: str        # the flag of zeppelin run and zeppelin plan
    sizes: str       # what the plan computed with it
    override: str    # the RunConfig field of the flag that accepts another value

    def planned(self, header: Any) -> Any:
        return getattr(header, self.name)

    @property
    def override_flag(self) -> str:
        return "--" + self.override.replace("_", "-")


PLANNED = (
    Planned("zero_stage", "--zero-stage", "its model-state memory per GPU", "zero_stage_override"),
    Planned("recompute", "--recompute", "its activation memory per token", "recompute_override"),
)


def check_planned(cfg: Any, header: Any) -> None:
    """Refuse a flag of :data:`PLANNED` that differs from the plan without its override."""
    for p in PLANNED:
        given, planned = getattr(cfg, p.name), p.planned(header)
        if given is not None and given != planned and not getattr(cfg, p.override):
            # a plan whose micro-batches each chose their recomputation was made with --recompute auto
            planned = "auto" if planned == "per-microbatch" else planned
            raise InputError(f"the plan was made for {p.flag} {planned} ({p.sizes}), not {given}; re-plan with "
                             f"`zeppelin plan {p.flag} {given}` or pass {p.override_flag}")


@dataclass(frozen=True)
class Settings:
    """What a rank runs with, each value from the flag or else the plan (or the device)."""

    seed: int
    dtype: str
    zero_stage: int
    recompute: str
    tp_overlap: str
    verify_tol: float
    verify_timeout_s: float
    hparams: dict[str, Any]

    def lr_schedule(self, cfg: Any, num_steps: int):
        """The learning rate of every step: the whole plan's schedule (``num_steps``: the plan's steps)."""
        from zeppelin.runtime.optim import LRSchedule

        return LRSchedule(cfg.lr, num_steps, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr)


def resolve(cfg: Any, header: Any, device_type: str) -> Settings:
    """The run's settings (``check_planned`` has been applied by the start-up checks)."""
    check_planned(cfg, header)
    dtype = cfg.dtype or ("bf16" if device_type == "cuda" else "fp32")
    return Settings(
        seed=header.seed if cfg.seed is None else cfg.seed,
        dtype=dtype,
        zero_stage=header.zero_stage if cfg.zero_stage is None else cfg.zero_stage,
        recompute=header.recompute if cfg.recompute is None else cfg.recompute,
        tp_overlap=header.tp_overlap if cfg.tp_overlap is None else cfg.tp_overlap,
        verify_tol=cfg.verify_tol if cfg.verify_tol is not None else (1e-5 if dtype == "fp32" else 2e-2),
        verify_timeout_s=cfg.verify_timeout_s or max(600.0, 4 * cfg.timeout_s),
        hparams=cfg.hyperparameters(header.seed),
    )
