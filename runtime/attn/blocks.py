"""Chunk-pair blocks: attention of one chunk of query rows over one chunk of key rows of the same
sequence, causal by ABSOLUTE token position, on the kernel :func:`zeppelin.runtime.kernels.choose`
picks for the block's kind (diagonal, fully visible; a partially visible pair runs the float32 math
path with an explicit mask). Ring attention (:mod:`.ring`) is built from these blocks; the profiler
times them.

Every kernel returns the block's log-sum-exp, and its backward recomputes the probabilities from a
*given* (merged, global) log-sum-exp: a block's gradient computed with the merged output and merged
log-sum-exp is that block's exact share of the full gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import kernels as _k

__all__ = ["attention_block", "attention_block_backward", "block_kind"]


def block_kind(q_range: Sequence[int], k_range: Sequence[int], window: int | None = None) -> str:
    """'full' (every key visible), 'diag' (same range, causal), 'skip' (nothing visible), 'mask'.

    ``window``: sliding-window attention (a query at q sees keys ``q - w < k <= q``): a pair whose
    every key lies before every query's window is 'skip' (neither computed nor, in a ring, sent);
    a pair the window cuts is 'mask'."""
    qs, qe = q_range
    ks, ke = k_range
    if qe <= qs or ke <= ks or ks >= qe:
        return "skip"
    if window is not None and ke - 1 <= qs - window:
        return "skip"
    inside = window is None or ks > qe - 1 - window  # no key of the pair is outside any query's window
    if ke <= qs + 1 and inside:
        return "full"
    if qs == ks and qe == ke and (window is None or qe - qs <= window):
        return "diag"
    return "mask"


def _kernel_fwd(q, k, v, causal: bool, scale: float):
    """One diagonal (``causal``) or fully visible block on the kernel :func:`kernels.choose` picks:
    out in q.dtype (fused kernels) or fp32 (math), lse [H, Tq] fp32."""
    kern = _k.choose(q.device, q.dtype, "diag" if causal else "full", q.shape[-1])
    return _k.block_forward(kern, q, k, v, causal, scale)


def _kernel_bwd(dout, q, k, v, out, lse, causal: bool, scale: float):
    kern = _k.choose(q.device, q.dtype, "diag" if causal else "full", q.shape[-1])
    return _k.block_backward(kern, dout, q, k, v, out, lse, causal, scale)


def _window_diag_kernel(q, q_pos_range, k_pos_range, window):
    """The fused kernel with a window argument for a windowed diagonal pair (same range), or None."""
    if window is None or tuple(q_pos_range) != tuple(k_pos_range):
        return None
    kern = _k.choose(q.device, q.dtype, "varlen", q.shape[-1])
    return kern if kern in _k.WINDOW_KERNELS else None


def attention_block(q, k, v, q_pos_range, k_pos_range, scale: float | None = None, window: int | None = None):
    """Attention of query rows at absolute positions ``q_pos_range`` over key rows at
    ``k_pos_range`` of the SAME sequence (causal by absolute position).

    Returns ``(out, lse)``: ``out [Tq, Hq, D]`` (q's dtype, or float32 on the math path),
    ``lse [Hq, Tq]`` float32; rows that see no key have ``lse = -inf`` and ``out = 0``.
    """
    sc = _k.default_scale(q, scale)
    mode = block_kind(q_pos_range, k_pos_range, window)
    tq = q.shape[0]
    if mode == "skip":
        return (
            torch.zeros_like(q),
            torch.full((q.shape[1], tq), _k.NEG_INF, dtype=torch.float32, device=q.device),
        )
    if mode == "mask":
        kern = _window_diag_kernel(q, q_pos_range, k_pos_range, window)
        if kern is not None:
            return _k.varlen_forward(kern, q, k, v, (0, tq), sc, window)
        if window is not None:
            return _k.band_forward(q, k, v, q_pos_range[0], k_pos_range[0], window, sc)
        mask = _k.causal_mask(tq, k.shape[0], q_pos_range[0], k_pos_range[0], q.device)
        return _k.math_forward(q, k, v, mask, sc)
    return _kernel_fwd(q, k, v, mode == "diag", sc)


def attention_block_backward(dout, q, k, v, out, lse, q_pos_range, k_pos_range, scale: float | None = None,
                             window: int | None = None):
    """Gradients of one chunk pair given the FINAL (merged) ``out`` and ``lse`` of the query rows:
    returns ``(dq, dk, dv)`` — this block's exact share of the full gradients."""
    sc = _k.default_scale(q, scale)
    mode = block_kind(q_pos_range, k_pos_range, window)
    if mode == "skip":
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if mode == "mask" and window is not None:
        kern = _window_diag_kernel(q, q_pos_range, k_pos_range, window)
        if kern is not None:
            return _k.varlen_backward(kern, dout, q, k, v, out, lse, (0, q.shape[0]), sc, window)
        return _k.band_backward(dout, q, k, v, out, lse, q_pos_range[0], k_pos_range[0], window, sc)
    if mode == "mask":
        mask = _k.causal_mask(q.shape[0], k.shape[0], q_pos_range[0], k_pos_range[0], q.device)
        return _k.math_backward(dout, q, k, v, out, lse, mask, sc)
    return _kernel_bwd(dout, q, k, v, out, lse, mode == "diag", sc)
