"""Local attention: causal attention over whole sequences packed along the rows (a rank's
one-rank groups, and the head-sharded step of Ulysses).

Kernel by device and dtype: :mod:`zeppelin.runtime.kernels` (one varlen call forward and one
backward on CUDA bf16/fp16; one call per sequence on the CPU kernel and the math path).
:class:`LocalPack` runs the local sequences of an engine call as ONE varlen call where the device
has a varlen kernel, at whatever rows of the attention buffer they sit.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .. import kernels as _k
from .merge import out_lse_function

__all__ = ["LocalPack", "flash_attn_available", "local_attention", "local_backward", "local_forward",
           "local_kernel"]


def flash_attn_available(device: torch.device) -> bool:
    """True when flash-attn's varlen kernels (>= 2.6) serve this device (see :mod:`..kernels`)."""
    return device.type == "cuda" and _k.cuda_caps(device).flash_attn


def bounds(cu_seqlens) -> tuple[int, ...]:
    """Cumulative sequence starts as host ints. A device tensor costs a host sync: the runtime
    passes lists (engine, Ulysses); tensors are accepted for callers off the hot path."""
    if isinstance(cu_seqlens, torch.Tensor):
        return tuple(int(x) for x in cu_seqlens.tolist())
    return tuple(int(x) for x in cu_seqlens)


def local_kernel(q: torch.Tensor) -> str:
    """The kernel local varlen attention runs on for ``q``'s device and dtype."""
    return _k.choose(q.device, q.dtype, "varlen", q.shape[-1])


def local_forward(q, k, v, cu_seqlens, scale: float | None = None, window: int | None = None):
    """No-autograd causal varlen attention: ``(out [T,Hq,D] in q.dtype, lse [Hq,T] fp32)``.

    One varlen kernel call for the whole pack where the device has a varlen kernel (CUDA,
    bf16/fp16); one call per sequence on the CPU kernel and the math path."""
    if q.shape[0] == 0:
        return torch.empty_like(q), torch.empty((q.shape[1], 0), dtype=torch.float32, device=q.device)
    out, lse = _k.varlen_forward(local_kernel(q), q, k, v, bounds(cu_seqlens), _k.default_scale(q, scale), window)
    return out.to(q.dtype), lse


def local_backward(dout, q, k, v, out, lse, cu_seqlens, scale: float | None = None, window: int | None = None):
    """Gradients of :func:`local_forward` (same kernel, same call structure), in the input dtype."""
    if q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = _k.varlen_backward(local_kernel(q), dout, q, k, v, out, lse, bounds(cu_seqlens),
                                    _k.default_scale(q, scale), window)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_LocalAttention = out_lse_function("_LocalAttention", local_forward, local_backward)


def local_attention(q, k, v, cu_seqlens, scale: float | None = None, window: int | None = None):
    """Causal attention over packed whole sequences (autograd-capable).

    ``cu_seqlens``: cumulative sequence starts ``[0, L0, L0+L1, ...]`` (list, or tensor at the
    cost of a host sync)."""
    b = bounds(cu_seqlens)
    if not b or b[0] != 0 or b[-1] != q.shape[0] or any(y < x for x, y in itertools.pairwise(b)):
        raise ValueError(f"cu_seqlens {list(b[:8])}... does not partition {q.shape[0]} rows")
    return _LocalAttention.apply(q, k, v, b, scale, window)


class LocalPack:
    """Whole sequences at row ``spans`` of an attention buffer, run as ONE varlen kernel call
    forward and one backward (a rank's local, one-rank-group sequences on a device with a varlen
    kernel: see :func:`LocalPack.of`)."""

    def __init__(self, spans: Sequence[tuple[int, int]], device: torch.device, window: int | None = None) -> None:
        self.window = window
        self.spans = [(int(a), int(b)) for a, b in spans]
        cu = [0]
        for a, b in self.spans:
            cu.append(cu[-1] + b - a)
        self.bounds = tuple(cu)
        adjacent = all(b0 == a1 for (_, b0), (a1, _) in itertools.pairwise(self.spans))
        if adjacent:
            self.rows: slice | torch.Tensor = slice(self.spans[0][0], self.spans[-1][1])
        else:
            idx = torch.cat([torch.arange(a, b) for a, b in self.spans])
            self.rows = _k.to_device(idx, device)

    @classmethod
    def of(cls, tasks, q: torch.Tensor, window: int | None = None) -> LocalPack | None:
        """A pack of ``tasks`` ``(row0, row1, spec)`` (one sequence each, one-rank ring specs) when
        ``q``'s device/dtype has a varlen kernel and every sequence's ranges tile it in order;
        None otherwise (the caller then runs a task per sequence)."""
        tasks = list(tasks)
        if not tasks or not _k.has_varlen(q.device, q.dtype, q.shape[-1]):
            return None
        if window is not None and local_kernel(q) not in _k.WINDOW_KERNELS:
            return None
        for a, b, spec in tasks:
            if len(spec.seqs) != 1:
                return None
            rs = [(s, e) for s, e in spec.seqs[0][0] if e > s]
            pos = 0
            for s, e in rs:
                if s != pos:
                    return None
                pos = e
            if pos != b - a:
                return None
        return cls([(a, b) for a, b, _ in tasks], q.device, window)

    def forward(self, q, k, v, out, lse, scale: float | None) -> None:
        """Fill ``out``/``lse`` at the pack's rows."""
        r = self.rows
        if isinstance(r, slice):
            o, l_ = local_forward(q[r], k[r], v[r], self.bounds, scale, self.window)
            out[r], lse[:, r] = o, l_
        else:
            o, l_ = local_forward(q.index_select(0, r), k.index_select(0, r), v.index_select(0, r),
                                  self.bounds, scale, self.window)
            out.index_copy_(0, r, o.to(out.dtype))
            lse.index_copy_(1, r, l_)

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, scale: float | None) -> None:
        """Fill ``dq``/``dk``/``dv`` at the pack's rows from the final ``out``/``lse``."""
        r = self.rows
        if isinstance(r, slice):
            dq[r], dk[r], dv[r] = local_backward(dout[r], q[r], k[r], v[r], out[r], lse[:, r], self.bounds, scale,
                                                 self.window)
        else:
            sel = [x.index_select(0, r) for x in (dout, q, k, v, out)]
            a, b, c = local_backward(*sel, lse.index_select(1, r), self.bounds, scale, self.window)
            dq.index_copy_(0, r, a)
            dk.index_copy_(0, r, b)
            dv.index_copy_(0, r, c)
