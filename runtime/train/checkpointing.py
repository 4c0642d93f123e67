"""A run's checkpoints: the directory's lock, the checkpoint ``--resume`` continues from, the saves.

The files themselves (DCP shards in safetensors, the JSON state) are :mod:`zeppelin.runtime.checkpoint`'s;
the directory's lock and the resume point's checks are :mod:`zeppelin.runtime.lifecycle`'s. A
checkpoint is named by the step a resumed run starts at (``ckpt-000002``: steps 0 and 1 are done,
step 2 runs next), in the numbering of the plan, the metrics and the progress lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from zeppelin.schemas.common import InputError

__all__ = ["Checkpointing"]


class Checkpointing:
    """The checkpoint side of one rank's run (every method but :meth:`open` is collective or
    rank-local as its docstring says)."""

    def __init__(self, cfg, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.lock = None
        self.path: Path | None = None       # the checkpoint resumed from
        self.state: dict[str, Any] | None = None
        self.plan_hash: str | None = None
        self.reader = None                  # the plan (a checkpoint records the hash of its steps so far)

    def open(self, header, end: int, reader=None) -> str | None:
        """Lock the directory (rank 0; held until the run ends) and find the checkpoint to resume
        (every rank reads it: a node's ranks share rank 0's view). Returns this rank's error line."""
        from ..checkpoint import plan_hash, plan_prefix
        from ..lifecycle import prepare_checkpoint_dir, resume_point

        cfg = self.cfg
        self.reader = reader
        try:
            if cfg.checkpoint_dir and self.rank == 0:
                self.lock = prepare_checkpoint_dir(cfg.checkpoint_dir)
            self.plan_hash = plan_hash(header)
            if cfg.resume:
                found = resume_point(cfg.checkpoint_dir, plan_hash=self.plan_hash, world_size=self.world, end=end,
                                     hparams=cfg.hyperparameters(header.seed),
                                     prefix=None if reader is None else lambda n: plan_prefix(reader, n))
                if found is not None:
                    self.path, self.state = found
        except InputError as e:
            return str(e)
        return None

    def start(self, default: int) -> int:
        """The first step this run executes."""
        return default if self.state is None else self.state["next_step"]

    def resume_line(self) -> str | None:
        """What rank 0 says when the run continues a checkpoint."""
        if self.state is None:
            return None
        return f"resuming at step {self.state['next_step']} from {self.path}"

    def restore(self, model, optimizer) -> None:
        """Load the checkpoint's tensors into this rank's shards, and its RNG state."""
        from ..checkpoint import load_checkpoint_tensors, set_rng_state

        if self.state is None:
            return
        load_checkpoint_tensors(self.path, model, optimizer)
        if self.rank < len(self.state["rng"]):
            set_rng_state(self.state["rng"][self.rank])

    def after_step(self, k: int, end: int, model, optimizer, hparams: dict[str, Any]) -> None:
        """Save after step ``k`` every ``--checkpoint-every`` steps and after the run's last step
        (collective: every rank's RNG state and shards)."""
        from ..checkpoint import plan_prefix, rng_state, save_checkpoint
        from ..lifecycle import maybe_fault

        cfg = self.cfg
        every = cfg.checkpoint_every and (k + 1) % cfg.checkpoint_every == 0
        if not cfg.checkpoint_dir or not (every or k + 1 == end):
            return
        maybe_fault(self.rank, k, "save")
        rngs = [None] * self.world
        dist.all_gather_object(rngs, rng_state())
        save_checkpoint(cfg.checkpoint_dir, next_step=k + 1, model=model, optimizer=optimizer, rng_states=rngs,
                        plan_hash=self.plan_hash, world_size=self.world, rank=self.rank,
                        extra={"hyperparameters": hparams,
                               **({} if self.reader is None else {"plan_prefix": plan_prefix(self.reader, k + 1)})})

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
