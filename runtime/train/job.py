"""A job on one rank, up to its first step: the process group's store and device, the start-up
verdicts every rank agrees on, the model, the executor and the components the loop delegates to
(:class:`Job`). :func:`zeppelin.runtime.train.loop.run_job` puts them in order.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zeppelin.schemas.common import InputError
from zeppelin.schemas.plan import PlanHeader, PlanReader

from .. import startup
from ..config import RunConfig
from ..data import TokenSource
from ..executor import Executor
from ..model import LlamaModel
from .checkpointing import Checkpointing
from .settings import Settings, resolve
from .verify import Verifier

__all__ = ["Job", "agree", "build_model", "device_of", "prepare", "random_init_note", "store", "teardown"]


@dataclass
class Job:
    """What the training loop works with on one rank, and what it counts."""

    cfg: RunConfig
    rank: int
    world: int
    reader: PlanReader
    source: TokenSource
    start: int
    end: int
    settings: Settings
    ex: Executor
    groups: Any
    ckpt: Checkpointing
    verifier: Verifier | None
    losses: list[float] = field(default_factory=list)
    skipped: int = 0
    used_tp: bool = False

    @property
    def header(self) -> PlanHeader:
        return self.reader.header


def store(world: int):
    """The rendezvous store when no launcher gives one: zeppelin-local's file, or a one-rank job's."""
    if os.environ.get("ZEPPELIN_STORE_FILE"):  # zeppelin-local: ranks meet through a file, no TCP store
        return dist.FileStore(os.environ["ZEPPELIN_STORE_FILE"], world)
    if "MASTER_ADDR" not in os.environ and world == 1:  # a single process without a launcher
        import tempfile

        return dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="zeppelin-store-"), "store"), 1)
    return None


def device_of(cfg: RunConfig, header: PlanHeader | None, local_err: str | None) -> tuple[torch.device, str | None]:
    """This rank's device (``--device``, else CUDA for a CUDA plan where there is one) and the
    start-up error, if any."""
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()
                                         and (header is None or header.cluster.device == "cuda"))
    if want_cuda and not torch.cuda.is_available():
        return torch.device("cpu"), local_err or "--device cuda: CUDA is not available on this machine"
    if not want_cuda:
        return torch.device("cpu"), local_err
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device()), local_err


def teardown() -> None:
    """Destroy every process group while the interpreter is fully alive.

    The group cache (and anything else holding a process group or a finished work handle) is
    dropped and collected *before* ``destroy_process_group``: a gloo group that survives into
    interpreter finalisation can abort the process at exit ("terminate called without an active
    exception") after the job itself succeeded."""
    import gc

    from ..groups import set_default_cache

    set_default_cache(None)
    gc.collect()
    with contextlib.suppress(Exception):  # best effort at exit
        dist.destroy_process_group()
    gc.collect()


def agree(world: int, err: str | None) -> None:
    """Exchange start-up verdicts; every rank raises the first error any rank found."""
    errs = [None] * world
    dist.all_gather_object(errs, err)
    for r, e in enumerate(errs):
        if e is not None:
            raise InputError(e if r == dist.get_rank() or e == err else f"rank {r}: {e}")


def prepare(cfg: RunConfig, rank: int, world: int, device: torch.device, reader: PlanReader,
            source: TokenSource, start: int, end: int, ckpt: Checkpointing) -> Job:
    """Everything up to the first step, once every rank has agreed to start: the settings, the
    run's first lines, the process groups, the model and executor, the resumed state."""
    from ..groups import GroupCache, set_default_cache

    header = reader.header
    settings = resolve(cfg, header, device.type)
    if rank == 0:  # the run's first lines: where its weights and its token ids come from
        for line in (random_init_note(cfg.model, settings.seed), source.describe(), ckpt.resume_line()):
            if line:
                print(f"zeppelin run: {line}", flush=True)
    start = ckpt.start(start)
    verifier = Verifier(settings.verify_tol, settings.verify_timeout_s, rank, world) if cfg.verify else None
    # one scan of the steps to run: validates every record (a corrupt line is reported with its
    # step number here, on every rank) and collects the process groups the steps need (a followed
    # plan's steps bring their groups as they arrive)
    groups = GroupCache(world, header=header, steps=() if cfg.follow else (reader.step(k) for k in range(start, end)))
    set_default_cache(groups)
    startup.mark("groups")
    model = build_model(cfg.model, header, settings.seed, device)
    ex = Executor(header, model, source, rank=rank, world_size=world, device=device, groups=groups,
                  lr=cfg.lr, weight_decay=cfg.weight_decay, tp_overlap=settings.tp_overlap, tp_chunks=cfg.tp_chunks,
                  dp=cfg.dp, zero_stage=settings.zero_stage, dtype=settings.dtype, recompute=settings.recompute,
                  hsdp=cfg.hsdp, betas=cfg.betas_pair, eps=cfg.eps, grad_clip=cfg.grad_clip,
                  lr_schedule=settings.lr_schedule(cfg, header.num_steps))
    ckpt.restore(model, ex.optimizer)
    startup.report(rank, show=cfg.progress in ("rich", "plain") or (cfg.progress == "auto" and sys.stderr.isatty()))
    return Job(cfg=cfg, rank=rank, world=world, reader=reader, source=source, start=start, end=end,
               settings=settings, ex=ex, groups=groups, ckpt=ckpt, verifier=verifier)


def build_model(ref: str | None, header: PlanHeader, seed: int, device: torch.device):
    """The model a job trains, on the meta device (the executor shards it, then each rank fills its
    own rows: :func:`zeppelin.runtime.fsdp.materialize`): the transformers model of ``hf:DIR``
    (:mod:`zeppelin.runtime.hf`) or the runtime's own Llama built from the plan's ModelSpec."""
    from zeppelin.schemas.hf import is_hf_ref

    if is_hf_ref(ref):
        from ..hf import build_hf_model

        return build_hf_model(ref, seed=seed, spec=header.model)
    return LlamaModel(header.model, seed=seed, meta=True)


def random_init_note(ref: str | None, seed: int) -> str | None:
    """The line announcing random initial weights of an ``hf:DIR`` without weight files (None when
    the directory has weights; the runtime's own models always start from their seeded init)."""
    from zeppelin.schemas.hf import hf_dir, hf_weight_files, is_hf_ref

    if not is_hf_ref(ref) or hf_weight_files(hf_dir(ref)):
        return None
    return f"{ref} holds no weight file: the model starts from random initialisation (seed {seed})"
