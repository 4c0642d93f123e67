"""A rank's job (:func:`run_job`, what ``python -m zeppelin.runtime`` runs) and its training loop
(:func:`train`): every step through the executor, and what each component does after it (the NaN
policy, ``--verify``, the metrics sinks, checkpoints).

Steps are numbered from 0, as in the plan, everywhere a step is named: the metrics' ``step``, the
progress line (``step 3 (4 of 8)``), errors (``step 3: the loss is nan``) and the step a
checkpoint resumes at (docs/RUNTIME.md, "Step numbers").
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zeppelin.schemas.common import InputError

from .. import startup
from ..config import RunConfig
from ..executor import StepResult
from .checkpointing import Checkpointing
from .checks import startup_checks, step_checks
from .job import Job, agree, device_of, prepare, store, teardown
from .metrics import Sinks, open_sinks, step_record

__all__ = ["NonFiniteError", "PeerStopped", "run", "run_job", "train"]


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is not finite and ``--nan-policy stop`` ends the run (raised on
    the rank where it appeared; the other ranks raise :class:`PeerStopped`)."""


class PeerStopped(RuntimeError):
    """Another rank is reporting why the job ends (this rank leaves without a report)."""


def run_job(cfg: RunConfig) -> dict[str, Any]:
    """Run a job on this rank (called by ``python -m zeppelin.runtime`` under torchrun).

    Returns a summary on rank 0 (``{}`` elsewhere). Raises InputError / VerifyError / runtime errors.
    """
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    store_ = store(world)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    local_err: str | None = None
    try:
        reader, source, start, end = startup_checks(cfg, world, rank)
    except InputError as e:
        local_err = str(e)
        reader = source = None
        start = end = 0
    startup.mark("checks")
    device, local_err = device_of(cfg, reader.header if reader is not None else None, local_err)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.timeout_s),
                            **({"store": store_} if store_ is not None else {}),
                            **({"device_id": device} if device.type == "cuda" else {}))
    startup.mark("rendezvous")
    try:
        return run(cfg, rank, world, device, local_err, reader, source, start, end)
    finally:
        teardown()


def run(cfg, rank: int, world: int, device: torch.device, local_err: str | None, reader, source,
        start: int, end: int) -> dict[str, Any]:
    """The job once the process group is up: agree to start, prepare, train, finish."""
    ckpt = Checkpointing(cfg, rank, world)
    if local_err is None:
        local_err = ckpt.open(reader.header, end, reader)
    agree(world, local_err)
    job = prepare(cfg, rank, world, device, reader, source, start, end, ckpt)
    train(job, open_sinks(cfg, job.header, rank, job.start, end, resumed=ckpt.state is not None))
    return finish(job)


def train(job: Job, sinks: Sinks) -> None:
    """Run steps ``job.start`` to ``job.end - 1``; rank 0 hands each step's record to ``sinks``."""
    from ..lifecycle import Heartbeat, maybe_fault
    from ..memory import StepMemory

    cfg, ex, header = job.cfg, job.ex, job.header
    heartbeat = Heartbeat(os.environ.get("ZEPPELIN_ERROR_DIR"), job.rank)
    memory = StepMemory(ex.device)
    if job.verifier is not None:
        job.verifier.bound_memory(job.rank, ex.device)
    try:
        for k in range(job.start, job.end):
            step = job.reader.step(k)
            if cfg.follow:  # the step just arrived: its checks, then its process groups (collective)
                step_checks(cfg, job.reader, job.source, step, following=True)
                job.groups.add_steps([step])
            job.used_tp = job.used_tp or any(rep.tp > 1 for rep in header.replicas(step))
            heartbeat.step(k)
            maybe_fault(job.rank, k)
            memory.reset()
            t0 = time.perf_counter()
            res = ex.forward_backward(step, keep_hidden=job.verifier is not None)
            bad = nonfinite(job, res, k)
            report, t_verify = (None, 0.0) if job.verifier is None else job.verifier.check(ex, step, res, heartbeat)
            res.phases["optimizer"] = ex.optimizer_step(k) if bad is None else ex.drop_gradients()
            res.phases["step"] = time.perf_counter() - t0 - t_verify
            per_rank = gather_step(job, res, memory, t_verify)
            if bad is None:
                job.losses.append(res.loss)
            else:
                job.skipped += 1
            if job.rank == 0:
                sinks.write(step_record(step, header, res.loss, per_rank, report, lr=ex.lr_at(k),
                                        grad_norm=ex.last_grad_norm if bad is None else None,
                                        skipped=None if bad is None else f"non-finite {bad[1]} on rank {bad[0]}"))
            if k - job.start < 3:  # the first steps' ends: the warm-up in the start-up trace
                startup.mark(f"step{k - job.start + 1}")
            if job.losses:  # --nan-policy skip: no checkpoint of a model this run has not trained
                job.ckpt.after_step(k, job.end, ex.model, ex.optimizer, job.settings.hparams)
        if job.skipped and job.skipped == job.end - job.start:
            if job.rank != 0:
                raise PeerStopped()
            raise NonFiniteError(f"every step of the run ({job.skipped}) had a non-finite loss or gradient norm and "
                                 "was skipped (--nan-policy skip): nothing was trained and no checkpoint was written")
    finally:
        heartbeat.close()
        startup.write_trace(job.rank)
        sinks.close()


def nonfinite(job: Job, res: StepResult, k: int) -> tuple[int, str, float] | None:
    """The rank and value of a non-finite loss or gradient norm in step ``k`` (None: all finite).
    ``--nan-policy stop`` ends the run on the rank where it appeared; ``skip`` returns it."""
    bad = job.ex.nonfinite(res)
    if bad is not None and job.cfg.nan_policy == "stop":
        r, what, v = bad
        if r != job.rank:
            raise PeerStopped()
        raise NonFiniteError(f"step {k}: the {what} is {v} (not finite); the run stopped "
                             "(--nan-policy stop; --nan-policy skip leaves such steps out)")
    return bad


def gather_step(job: Job, res: StepResult, memory, t_verify: float) -> list:
    """Every rank's ``(phases, bytes, tokens, memory)`` of the step (collective)."""
    mem = job.ex.measured_memory(res)
    mem["process_peak"] = int(memory.peak())
    res.phases["peak_memory_bytes"] = float(mem["process_peak"])
    res.phases["verify"] = t_verify
    per_rank = [None] * job.world
    dist.all_gather_object(per_rank, (res.phases, res.bytes, res.tokens, mem))
    return per_rank


def finish(job: Job) -> dict[str, Any]:
    """After the last step: the export (collective under FSDP), the barrier every rank passes before
    any tears its groups down, the lock released; rank 0's summary (``{}`` elsewhere)."""
    exported = None
    if job.cfg.export:
        from ..hf import export_model

        done = export_model(job.ex.model, job.header.model, job.cfg.export)  # each rank writes its share
        exported = str(done) if done is not None else None
    dist.barrier()
    job.ckpt.release()
    if job.rank != 0:
        return {}
    summary: dict[str, Any] = {"steps_run": job.end - job.start, "first_step": job.start, "losses": job.losses,
                               "metrics": str(job.cfg.metrics_path)}
    if job.skipped:
        summary["skipped"] = job.skipped
    if job.used_tp:
        summary["tp_overlap"] = job.ex.tp_overlap
    if job.verifier is not None:
        summary["verify"] = job.verifier.summary()
    if exported is not None:
        summary["export"] = exported
    return summary
