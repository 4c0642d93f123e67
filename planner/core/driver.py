"""Planning driver shared by ``zeppelin plan`` and ``zeppelin compare``.

* :func:`make_header` - the plan header: planner and options, the inputs themselves and their
  content hashes (so a plan cannot be run or validated against different inputs), the manifest
  reference and the sampler settings.
* :func:`check_steps` - settings that make every plan infeasible, reported before any work.
* :func:`plan_steps` - plan steps in order, in this process or in ``workers`` processes (step k+1 is
  planned while step k is written), with a rich progress bar.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from zeppelin.planner.core.base import PlanContext, Planner, PlanningError
from zeppelin.schemas.common import content_hash
from zeppelin.schemas.plan import InputHashes, ManifestRef, PlanHeader, SamplerConfig, Sequence, StepPlan


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("zeppelin")
    except Exception:  # noqa: BLE001  (not installed as a distribution: source checkout)
        return "0+unknown"


def input_hashes(ctx: PlanContext, manifest_hash: str) -> InputHashes:
    return InputHashes(cluster=content_hash(ctx.cluster), model=content_hash(ctx.model),
                       profile=content_hash(ctx.profile), manifest=manifest_hash)


def make_header(ctx: PlanContext, planner: Planner, dataset: Any, sampler_cfg: SamplerConfig, num_steps: int,
                *, planner_options: dict[str, Any] | None = None, created_at: str = "") -> PlanHeader:
    """``dataset``: a :class:`zeppelin.schemas.io.datasets.Dataset` (or None for synthetic steps).

    ``created_at`` stays empty by default: the same inputs give the same plan bytes, whenever made."""
    if dataset is not None:
        ref = dataset.manifest_ref()
        mhash = dataset.content_hash
    else:
        ref = ManifestRef()
        mhash = "none"
    opts = dict(planner.options if planner_options is None else planner_options)
    return PlanHeader(
        planner=planner.name,
        planner_options=opts,
        zeppelin_version=_version(),
        created_at=created_at,
        seed=sampler_cfg.seed,
        num_steps=num_steps,
        world_size=ctx.cluster.world_size,
        tp=ctx.tp,
        tp_overlap=ctx.tp_overlap,
        zero_stage=ctx.zero_stage,
        recompute=planner.recompute_mode(ctx.recompute),
        cluster=ctx.cluster,
        model=ctx.model,
        profile=ctx.profile,
        hashes=input_hashes(ctx, mhash),
        manifest=ref,
        sampler=sampler_cfg,
    )


def check_steps(step_sequences: list[list[Sequence]], sampler_cfg: SamplerConfig | None = None) -> None:
    """Reject settings no planner can satisfy, naming the step, sequence and setting at fault."""
    budget = sampler_cfg.tokens_per_step if sampler_cfg is not None else None
    for k, seqs in enumerate(step_sequences):
        if not seqs:
            raise PlanningError(f"step {k} has no sequences")
        if budget is not None:
            for i, s in enumerate(seqs):
                if s.length > budget:
                    raise PlanningError(
                        f"--tokens-per-step {budget:,} is smaller than sequence {i} of step {k} (sample "
                        f"{s.sample_id}, {s.length:,} tokens); raise --tokens-per-step or set --max-seq-len")


# ------------------------------------------------------------------ worker processes
_W: dict[str, Any] = {}


def _init_worker(ctx: PlanContext, planner: Planner) -> None:
    _W["ctx"], _W["planner"] = ctx, planner


def _plan_one(arg: tuple[int, list[Sequence]]) -> StepPlan:
    k, seqs = arg
    return _W["planner"].plan_step(_W["ctx"], k, seqs)


def plan_steps(ctx: PlanContext, planner: Planner, step_sequences: Iterable[list[Sequence]], workers: int = 1,
               progress: bool = True, total: int | None = None, first_step: int = 0) -> Iterator[StepPlan]:
    """Yield one StepPlan per step, in order. ``workers > 1`` plans in a process pool."""
    if workers < 1:
        raise PlanningError(f"--workers must be at least 1 (got {workers})")
    items = ((first_step + k, seqs) for k, seqs in enumerate(step_sequences))
    if total is None and hasattr(step_sequences, "__len__"):
        total = len(step_sequences)  # type: ignore[arg-type]
    bar = _progress(progress, total, planner.name)
    try:
        if workers == 1:
            for k, seqs in items:
                plan = planner.plan_step(ctx, k, seqs)
                if bar:
                    bar[0].advance(bar[1])
                yield plan
            return
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        with ProcessPoolExecutor(max_workers=min(workers, os.cpu_count() or workers),
                                 mp_context=mp.get_context(method), initializer=_init_worker,
                                 initargs=(ctx, planner)) as ex:
            # at most 2 x workers steps in flight (Executor.map would submit every step at once and
            # hold all their sequences and plans): plan files stream with bounded memory
            from collections import deque

            window = deque()
            for item in items:
                window.append(ex.submit(_plan_one, item))
                if len(window) >= 2 * workers:
                    plan = window.popleft().result()
                    if bar:
                        bar[0].advance(bar[1])
                    yield plan
            while window:
                plan = window.popleft().result()
                if bar:
                    bar[0].advance(bar[1])
                yield plan
    finally:
        if bar:
            bar[0].stop()


def _progress(enabled: bool, total: int | None, name: str):
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    p = Progress(TextColumn(f"planning ({name})"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    p.start()
    task = p.add_task("plan", total=total)
    return p, task
