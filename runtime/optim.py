"""The optimizer side of ``zeppelin run``: the learning-rate schedule and global gradient clipping.

:class:`LRSchedule` is a pure function of the step (no state to checkpoint: a resumed run computes
the same rate for the same step). Its shapes are the ones of ``torch.optim.lr_scheduler``, so a
reference built from them agrees step for step:

* warmup (``warmup_steps`` W > 0): step ``k < W`` runs at ``lr * (k + 1) / W``
  (``LinearLR(start_factor=1/W, end_factor=1, total_iters=W-1)``);
* then over the remaining ``D = total - W`` steps (``t = k - W``):
  ``constant``: ``lr``; ``linear``: ``lr + (min_lr - lr) * t / D``
  (``LinearLR(start_factor=1, end_factor=min_lr/lr, total_iters=D)``); ``cosine``:
  ``min_lr + (lr - min_lr) * (1 + cos(pi * t / D)) / 2`` (``CosineAnnealingLR(T_max=D, eta_min=min_lr)``).

``total`` is the plan's number of steps (not ``--steps``): running a prefix of a plan, or resuming
it, follows the schedule of the whole plan.

:func:`clip_gradients` computes the global L2 norm of the gradients of every parameter however
they are held - whole on every rank (replicated, tensor parallel: the runtime keeps whole
gradients), or as FSDP2 shards (the squares of the local shards summed over the shard group; with
hybrid sharding the replica groups hold identical shards and are not summed again) - so the norm
equals the single-process ``clip_grad_norm_`` norm, and scales every gradient by
``min(1, max_norm / (norm + 1e-6))`` as ``clip_grad_norm_`` does.

This module's top imports nothing heavy (the command line imports :class:`LRSchedule`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LR_SCHEDULES", "LRSchedule", "clip_gradients", "grad_norm"]

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    total: int
    kind: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0

    def __call__(self, k: int) -> float:
        w = self.warmup_steps
        if k < w:
            return self.lr * (k + 1) / w
        if self.kind == "constant":
            return self.lr
        d = max(self.total - w, 1)
        t = min(k - w, d)
        if self.kind == "linear":
            return self.lr + (self.min_lr - self.lr) * t / d
        return self.min_lr + (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * t / d)) / 2.0


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_grad_sq(params):
    """Sum of squares (float64 tensor) of this rank's gradients of ``params``, the local shards of
    sharded ones: accumulated on the gradients' device, one transfer rather than one per parameter."""
    import torch

    sq = None
    for p in params:
        if p.grad is not None:
            part = _local(p.grad).detach().double().pow(2).sum()
            sq = part if sq is None else sq + part.to(sq.device)
    return torch.zeros((), dtype=torch.float64) if sq is None else sq


def grad_norm(params, shard_group=None, local_sq=None):
    """Global L2 norm (float64 tensor) of the gradients of ``params``; ``shard_group``: the
    process group over which FSDP shards are summed (None: gradients are whole on this rank);
    ``local_sq``: :func:`local_grad_sq` of the same gradients when already computed."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p.grad, DTensor) for p in params if p.grad is not None)
    sq = local_grad_sq(params) if local_sq is None else local_sq
    if sharded and shard_group is not None and dist.get_world_size(shard_group) > 1:
        dev = "cuda" if dist.get_backend(shard_group) == "nccl" else "cpu"
        box = sq.to(dev)
        dist.all_reduce(box, group=shard_group)
        sq = box
    return sq.cpu().sqrt()


def clip_gradients(params, max_norm: float | None, shard_group=None, local_sq=None) -> float:
    """The global gradient norm (before clipping); with ``max_norm`` the gradients are scaled so
    that it is at most ``max_norm`` (``clip_grad_norm_``'s rule). ``local_sq``: see :func:`grad_norm`."""
    import torch

    norm = grad_norm(params, shard_group, local_sq)
    if max_norm:
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        _local(p.grad).mul_(coef)
    return float(norm)
