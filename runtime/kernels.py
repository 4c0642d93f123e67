"""Attention kernel dispatch: which kernel computes a block, by device, dtype and block kind.

Every kernel honours one contract (layouts of :mod:`zeppelin.runtime.attn`): ``q [Tq, Hq, D]``,
``k, v [Tk, Hkv, D]``; the forward returns ``(out [Tq, Hq, D], lse [Hq, Tq] float32)``; the backward
takes ``dout``, ``q``, ``k``, ``v`` and the FINAL ``out``/``lse`` of the query rows (merged over
every block of a ring) and returns ``(dq, dk, dv)`` — the block's exact share of the gradients,
because the backward recomputes the probabilities from the given log-sum-exp.

Block kinds: ``diag`` (a chunk against itself, causal), ``full`` (every key visible), ``varlen``
(whole causal sequences packed along T), ``mask`` (a partially visible chunk pair: never produced by
the zigzag/contiguous layouts).

=======  ==============================================  =====================  ==================  ======
device   dtype (and condition)                           diag / full block      varlen (local)      mask
=======  ==============================================  =====================  ==================  ======
cuda     bf16/fp16, D % 8 == 0, D <= 256, flash-attn    ``flash_attn``         ``flash_attn``      math
         >= 2.6 importable                               (varlen fwd/bwd)       one call per rank
cuda     bf16/fp16, D % 8 == 0, D <= 256, sm80+          ``aten_flash``         ``aten_flash``      math
                                                         (cum_seq fwd/bwd)      one call per rank
cuda     fp16 (sm50+) or bf16 (sm80+), D % 8 == 0,       ``aten_efficient``     ``aten_efficient``  math
         D <= 256, no flash kernel                                              one call per rank
cuda     float32 / float64, or shapes none of the above  ``math``               ``math`` per seq.   math
cpu      float32 / float64 / bf16 / fp16                 ``cpu_flash``          ``cpu_flash`` per   math
                                                                                sequence
other    any                                             ``math``               ``math`` per seq.   math
=======  ==============================================  =====================  ==================  ======

* ``flash_attn``: ``flash_attn.flash_attn_interface._flash_attn_varlen_forward`` / ``_backward``.
* ``aten_flash``: ``torch.ops.aten._flash_attention_forward`` / ``_backward`` with cumulative
  sequence lengths (the varlen form, log-sum-exp ``[H, total_q]``).
* ``aten_efficient``: ``torch.ops.aten._efficient_attention_forward`` / ``_backward`` with
  ``cu_seqlens`` (log-sum-exp per sequence, padded to 32 rows); K/V are expanded to the query
  heads (the kernel has no GQA form).
* ``cpu_flash``: ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` / ``_backward``. The
  CPU op has no varlen form: local sequences run as one call per sequence (a block-diagonal mask
  would cost the square of the pack instead of the sum of squares).
* ``math``: exact float32 einsum attention, tiled over query rows (the reference path; the only
  one for partial masks).

Blocks (``diag``/``full``) on the CUDA kernels go through the same varlen entry points with one
sequence (``cu = [0, T]``, built on the device, no host sync). Varlen ``cu_seqlens`` are copied to
the device once per distinct pack (pinned, non-blocking) and cached.

GQA (``Hkv < Hq``) in bf16/fp16: the CPU kernel accumulates dK/dV over a group's query heads in
the low precision when it gets the KV heads as they are; :func:`gqa_expand` says when K/V are
expanded to the query heads instead (each head's dK/dV rounded once, the group summed in float32).
``flash_attn`` and ``aten_flash`` take GQA natively (they compute per-query-head dK/dV internally
and sum the group once). Measured errors: docs/KERNELS.md.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from dataclasses import dataclass

import torch

__all__ = [
    "KERNELS",
    "CudaCaps",
    "block_backward",
    "block_forward",
    "choose",
    "cuda_caps",
    "gqa_expand",
    "has_varlen",
    "varlen_backward",
    "varlen_forward",
]

KERNELS = ("flash_attn", "aten_flash", "aten_efficient", "cpu_flash", "math")
VARLEN_KERNELS = ("flash_attn", "aten_flash", "aten_efficient")
NEG_INF = float("-inf")
LSE_ALIGN = 32  # rows the memory-efficient kernel pads each sequence's log-sum-exp to


# ---------------------------------------------------------------------------------------------
# capabilities and the dispatch decision
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaCaps:
    """What a CUDA device offers: compute capability, PyTorch's fused SDPA backends (as enabled by
    ``torch.backends.cuda``), and a usable flash-attn package (>= 2.6 varlen API)."""

    capability: tuple[int, int]
    flash_attn: bool
    aten_flash: bool
    aten_efficient: bool


def _params(fn) -> set[str] | None:
    """Parameter names of a function or of a ``torch.library.custom_op`` (flash-attn >= 2.7 wraps
    its entry points in one); None when they cannot be read."""
    for f in (getattr(fn, "_init_fn", None), fn):  # a custom op's own signature is (*args, **kwargs)
        if f is None:
            continue
        try:
            return set(inspect.signature(f).parameters)
        except (TypeError, ValueError):
            continue
    return None


@functools.lru_cache(maxsize=1)
def _flash_attn_fns():
    """``(forward, backward, backward takes softcap)`` of flash-attn's varlen API when the package
    (>= 2.6 keyword API) is importable; None otherwise. Looked up once."""
    try:
        from flash_attn import flash_attn_interface as fi  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return None
    fwd, bwd = getattr(fi, "_flash_attn_varlen_forward", None), getattr(fi, "_flash_attn_varlen_backward", None)
    if fwd is None or bwd is None:
        return None
    fp, bp = _params(fwd), _params(bwd)
    if fp is None or bp is None or "window_size_left" not in fp or "window_size_left" not in bp:
        return None
    return fwd, bwd, "softcap" in bp


@functools.lru_cache(maxsize=16)
def _cuda_caps_cached(index: int) -> CudaCaps:
    cap = tuple(torch.cuda.get_device_capability(index))
    b = torch.backends.cuda
    return CudaCaps(
        capability=cap,  # type: ignore[arg-type]
        flash_attn=cap >= (8, 0) and _flash_attn_fns() is not None,
        aten_flash=cap >= (8, 0) and b.flash_sdp_enabled(),
        aten_efficient=cap >= (5, 0) and b.mem_efficient_sdp_enabled(),
    )


def cuda_caps(device: torch.device) -> CudaCaps:
    """Capabilities of a CUDA device (cached per device index)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_caps_cached(idx)


def choose(device: torch.device, dtype: torch.dtype, kind: str, head_dim: int) -> str:
    """The kernel for a block of ``kind`` (``diag`` | ``full`` | ``varlen`` | ``mask``) of tensors
    of ``dtype`` on ``device`` with head dimension ``head_dim`` (see the module table)."""
    if kind not in ("diag", "full", "varlen", "mask"):
        raise ValueError(f"unknown block kind {kind!r}")
    if kind == "mask":
        return "math"
    if device.type == "cpu":
        return "cpu_flash" if dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) else "math"
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "math"
    if head_dim % 8 or head_dim > 256:
        return "math"
    caps = cuda_caps(device)
    if caps.flash_attn:
        return "flash_attn"
    if caps.aten_flash:
        return "aten_flash"
    if caps.aten_efficient and (dtype == torch.float16 or caps.capability >= (8, 0)):
        return "aten_efficient"
    return "math"


def has_varlen(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """True when local sequences run as ONE varlen kernel call on this device/dtype."""
    return choose(device, dtype, "varlen", head_dim) in VARLEN_KERNELS


def gqa_expand(kernel: str, dtype: torch.dtype, hq: int, hkv: int) -> bool:
    """Whether K/V go into ``kernel`` expanded to the query heads (dK/dV then summed over each
    group in float32). CPU kernel in bf16/fp16: yes (its native GQA backward accumulates dK/dV
    in the low precision, about 3x the error); the memory-efficient kernel: always (no GQA form)."""
    if hq == hkv:
        return False
    if kernel == "aten_efficient":
        return True
    return kernel == "cpu_flash" and dtype in (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _bhld(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [1, H, T, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _thd(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> [T, H, D] (a view)."""
    return x.squeeze(0).transpose(0, 1)


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _expand(x: torch.Tensor, hq: int) -> torch.Tensor:
    rep = hq // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _fold(dx: torch.Tensor, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum per-query-head gradients over each KV group in float32 (result in ``dtype``)."""
    t, hq, d = dx.shape
    if hq == hkv:
        return dx
    return dx.float().view(t, hkv, hq // hkv, d).sum(2).to(dtype)


def _pair_cu(tq: int, tk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[0, tq]`` and ``[0, tk]`` as int32 device tensors, built on the device (no host copy)."""
    ar = torch.arange(2, dtype=torch.int32, device=device)
    return ar * tq, ar * tk


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; to CUDA through pinned memory, non-blocking (no host sync)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@functools.lru_cache(maxsize=256)
def _cu_cached(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(bounds, dtype=torch.int32), device)


def _cu_device(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` of a pack as an int32 device tensor (cached per pack)."""
    return _cu_cached(bounds, device)


def _ops():
    """The aten entry points (a function, so tests can substitute fakes)."""
    a = torch.ops.aten
    return {
        "flash_fwd": a._flash_attention_forward,
        "flash_bwd": a._flash_attention_backward,
        "eff_fwd": a._efficient_attention_forward,
        "eff_bwd": a._efficient_attention_backward,
        "cpu_fwd": a._scaled_dot_product_flash_attention_for_cpu,
        "cpu_bwd": a._scaled_dot_product_flash_attention_for_cpu_backward,
    }


# ---------------------------------------------------------------------------------------------
# float32 math kernels (exact reference path; explicit masks)
# ---------------------------------------------------------------------------------------------

# score-matrix elements per tile of the math path (bounds its memory: 2**25 fp32 = 128 MiB)
MATH_TILE_ELEMENTS = 1 << 25


def _q_tiles(tq: int, tk: int, h: int):
    step = max(1, MATH_TILE_ELEMENTS // max(1, tk * h))
    for a in range(0, tq, step):
        yield a, min(tq, a + step)


def causal_mask(tq: int, tk: int, q0: int, k0: int, device, window: int | None = None) -> torch.Tensor:
    """Visible keys of queries at absolute positions ``q0..`` over keys at ``k0..``: causal, and
    with a window ``w`` only the ``w`` keys ending at the query (``q - w < k <= q``)."""
    qp = torch.arange(q0, q0 + tq, device=device).unsqueeze(1)
    kp = torch.arange(k0, k0 + tk, device=device).unsqueeze(0)
    if window is None:
        return kp <= qp
    return (kp <= qp) & (kp > qp - window)


def _band_tiles(tq: int, tk: int, q0: int, k0: int, window: int):
    """Query tiles of a windowed block and the key rows each can see: ``(a, b, ka, kb)``. A tile
    of ``t`` queries sees at most ``t + w - 1`` keys, so work and memory grow with ``L * w``."""
    step = max(64, window)
    for a in range(0, tq, step):
        b = min(tq, a + step)
        ka = max(0, q0 + a - window + 1 - k0)
        kb = min(tk, q0 + b - k0)
        yield a, b, ka, max(ka, kb)


def band_forward(q, k, v, q0: int, k0: int, window: int, scale: float):
    """Exact float32 windowed attention of queries at ``q0..`` over keys at ``k0..`` (the math
    path, tiled so that each query tile touches only the keys of its window)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), NEG_INF, dtype=torch.float32, device=q.device)
    for a, b, ka, kb in _band_tiles(q.shape[0], k.shape[0], q0, k0, window):
        if kb <= ka:
            continue
        mask = causal_mask(b - a, kb - ka, q0 + a, k0 + ka, q.device, window)
        out[a:b], lse[:, a:b] = math_forward(q[a:b], k[ka:kb], v[ka:kb], mask, scale)
    return out, lse


def band_backward(dout, q, k, v, out, lse, q0: int, k0: int, window: int, scale: float):
    """Gradients of :func:`band_forward` from a given (merged) ``out``/``lse``."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for a, b, ka, kb in _band_tiles(q.shape[0], k.shape[0], q0, k0, window):
        if kb <= ka:
            continue
        mask = causal_mask(b - a, kb - ka, q0 + a, k0 + ka, q.device, window)
        x, y, z = math_backward(dout[a:b], q[a:b], k[ka:kb], v[ka:kb], out[a:b], lse[:, a:b], mask, scale)
        dq[a:b] = x
        dk[ka:kb] += y
        dv[ka:kb] += z
    return dq, dk, dv


def math_forward(q, k, v, mask, scale):
    """Exact float32 attention, tiled over query rows so the score matrix stays bounded.

    mask: [Tq, Tk] bool (True = visible) or None. Returns out (fp32), lse [H, Tq] fp32."""
    hq = q.shape[1]
    kf, vf = _expand(k.float(), hq), _expand(v.float(), hq)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty((hq, q.shape[0]), dtype=torch.float32, device=q.device)
    for a, b in _q_tiles(q.shape[0], k.shape[0], hq):
        s = torch.einsum("qhd,khd->hqk", q[a:b].float(), kf) * scale
        if mask is not None:
            s = s.masked_fill(~mask[a:b], NEG_INF)
        l_ = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(l_), torch.zeros_like(l_), l_).unsqueeze(-1))
        out[a:b] = torch.einsum("hqk,khd->qhd", p, vf)
        lse[:, a:b] = l_
    return out, lse


def math_backward(dout, q, k, v, out, lse, mask, scale):
    """Gradients of :func:`math_forward` from a given (merged) ``out``/``lse``, tiled like it."""
    hq, hkv = q.shape[1], k.shape[1]
    kf, vf = _expand(k.float(), hq), _expand(v.float(), hq)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kf.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(kf.shape, dtype=torch.float32, device=q.device)
    for a, b in _q_tiles(q.shape[0], k.shape[0], hq):
        qf, do, o = q[a:b].float(), dout[a:b].float(), out[a:b].float()
        s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
        if mask is not None:
            s = s.masked_fill(~mask[a:b], NEG_INF)
        l_ = lse[:, a:b]
        p = torch.exp(s - torch.where(torch.isinf(l_), torch.zeros_like(l_), l_).unsqueeze(-1))
        dv += torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, vf)
        delta = (do * o).sum(-1).transpose(0, 1)  # [H, tile]
        ds = p * (dp - delta.unsqueeze(-1))
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, kf) * scale
        dk += torch.einsum("hqk,qhd->khd", ds, qf) * scale
    return dq, _fold(dk, hkv, torch.float32), _fold(dv, hkv, torch.float32)


# ---------------------------------------------------------------------------------------------
# per-kernel forward / backward of one (q rows) x (k rows) problem given as a varlen pack
# ---------------------------------------------------------------------------------------------


def _left(window: int | None) -> int:
    """flash-attn's left window (keys ``q - left .. q``; -1: unbounded) of a window of ``w`` keys."""
    return -1 if window is None else window - 1


def _flash_attn_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    fwd = _flash_attn_fns()[0]  # type: ignore[index]
    res = fwd(
        _last_contig(q), _last_contig(k), _last_contig(v), cu_q, cu_k, max_q, max_k,
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=_left(window),
        window_size_right=-1 if window is None else 0,
    )
    return res[0], res[1]


def _flash_attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    _, bwd, softcap = _flash_attn_fns()  # type: ignore[misc]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kw = {"window_size_left": _left(window), "window_size_right": -1 if window is None else 0, "alibi_slopes": None, "deterministic": False,
          "rng_state": None}
    if softcap:
        kw["softcap"] = 0.0
    bwd(
        _last_contig(dout), _last_contig(q), _last_contig(k), _last_contig(v), _last_contig(out),
        lse.contiguous(), dq, dk, dv, cu_q, cu_k, max_q, max_k, 0.0, scale, causal, **kw,
    )
    return dq, dk, dv


def _aten_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    kw = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
    out, lse = _ops()["flash_fwd"](
        _last_contig(q), _last_contig(k), _last_contig(v), cu_q, cu_k, max_q, max_k, 0.0, causal, False,
        scale=scale, **kw,
    )[:2]
    return out, lse


def _aten_flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    # dropout 0: the kernel never reads the RNG state (PyTorch's own varlen_attn passes zeros)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    kw = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
    dq, dk, dv = _ops()["flash_bwd"](
        _last_contig(dout), _last_contig(q), _last_contig(k), _last_contig(v), _last_contig(out),
        lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale, **kw,
    )
    return dq, dk, dv


def _eff_lse_index(cu: torch.Tensor, total: int, pad: int) -> torch.Tensor:
    """Flat positions ``seq * pad + row`` of every packed token in the kernel's padded LSE
    (computed on the device from ``cu``: no host sync)."""
    cu = cu.long()
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1],
                                  output_size=total)
    return seq * pad + torch.arange(total, device=cu.device) - cu[seq]


def _eff_pad(max_q: int) -> int:
    return max(LSE_ALIGN, -(-max_q // LSE_ALIGN) * LSE_ALIGN)


def _aten_eff_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    hq = q.shape[1]
    out, lse = _ops()["eff_fwd"](
        q.unsqueeze(0).contiguous(), _expand(k, hq).unsqueeze(0).contiguous(),
        _expand(v, hq).unsqueeze(0).contiguous(), None, cu_q, cu_k, max_q, max_k, 0.0,
        1 if causal else 0, True, scale=scale,
    )[:2]
    flat = lse.transpose(0, 1).reshape(hq, -1)  # [H, nseq * pad]
    return out.squeeze(0), flat.index_select(1, _eff_lse_index(cu_q, q.shape[0], lse.shape[-1]))


def _aten_eff_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    hq, hkv = q.shape[1], k.shape[1]
    nseq, pad = cu_q.numel() - 1, _eff_pad(max_q)
    lp = torch.zeros((hq, nseq * pad), dtype=torch.float32, device=q.device)
    lp.index_copy_(1, _eff_lse_index(cu_q, q.shape[0], pad), lse.float())
    lp = lp.view(hq, nseq, pad).transpose(0, 1).contiguous()
    seed = torch.empty((), dtype=torch.int64)
    offset = torch.empty((), dtype=torch.int64)
    dq, dk, dv = _ops()["eff_bwd"](
        dout.unsqueeze(0).contiguous(), q.unsqueeze(0).contiguous(), _expand(k, hq).unsqueeze(0).contiguous(),
        _expand(v, hq).unsqueeze(0).contiguous(), None, out.unsqueeze(0).contiguous(), cu_q, cu_k,
        max_q, max_k, lp, 0.0, seed, offset, 1 if causal else 0, False, scale=scale,
    )[:3]
    dq, dk, dv = dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)
    return dq, _fold(dk, hkv, torch.float32), _fold(dv, hkv, torch.float32)


def _cpu_fwd(q, k, v, causal, scale):
    # GQA as is: the forward is as accurate with K/V expanded or not (only the backward differs)
    o, lse = _ops()["cpu_fwd"](_bhld(q), _bhld(k), _bhld(v), 0.0, causal, scale=scale)
    return _thd(o), lse.squeeze(0).float()


def _cpu_bwd(dout, q, k, v, out, lse, causal, scale):
    dt, hq, hkv = q.dtype, q.shape[1], k.shape[1]
    expand = gqa_expand("cpu_flash", dt, hq, hkv)
    if expand:
        k, v = _expand(k, hq), _expand(v, hq)
    dq, dk, dv = _ops()["cpu_bwd"](
        _bhld(dout.to(dt)), _bhld(q), _bhld(k), _bhld(v), _bhld(out.to(dt)), lse.unsqueeze(0).contiguous(),
        0.0, causal, scale=scale,
    )
    dq, dk, dv = _thd(dq), _thd(dk), _thd(dv)
    if expand:  # float32 group sums: callers accumulate in float32 and round once
        dk, dv = _fold(dk, hkv, torch.float32), _fold(dv, hkv, torch.float32)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------


def block_forward(kernel: str, q, k, v, causal: bool, scale: float):
    """One chunk pair (``causal``: diagonal block, else fully visible) on ``kernel``:
    ``(out [Tq, Hq, D] in q.dtype, or float32 on the math path; lse [Hq, Tq] float32)``."""
    if kernel == "math":
        mask = causal_mask(q.shape[0], k.shape[0], 0, 0, q.device) if causal else None
        return math_forward(q, k, v, mask, scale)
    if kernel == "cpu_flash":
        return _cpu_fwd(q, k, v, causal, scale)
    tq, tk = q.shape[0], k.shape[0]
    cu_q, cu_k = _pair_cu(tq, tk, q.device)
    if kernel == "flash_attn":
        return _flash_attn_fwd(q, k, v, cu_q, cu_k, tq, tk, causal, scale)
    if kernel == "aten_flash":
        return _aten_flash_fwd(q, k, v, cu_q, cu_k, tq, tk, causal, scale)
    if kernel == "aten_efficient":
        return _aten_eff_fwd(q, k, v, cu_q, cu_k, tq, tk, causal, scale)
    raise ValueError(f"unknown attention kernel {kernel!r}")


def block_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of one chunk pair from the FINAL ``out``/``lse`` of its query rows."""
    if kernel == "math":
        mask = causal_mask(q.shape[0], k.shape[0], 0, 0, q.device) if causal else None
        return math_backward(dout, q, k, v, out, lse, mask, scale)
    if kernel == "cpu_flash":
        return _cpu_bwd(dout, q, k, v, out, lse, causal, scale)
    dt = q.dtype
    tq, tk = q.shape[0], k.shape[0]
    cu_q, cu_k = _pair_cu(tq, tk, q.device)
    args = (dout.to(dt), q, k, v, out.to(dt), lse, cu_q, cu_k, tq, tk, causal, scale)
    if kernel == "flash_attn":
        return _flash_attn_bwd(*args)
    if kernel == "aten_flash":
        return _aten_flash_bwd(*args)
    if kernel == "aten_efficient":
        return _aten_eff_bwd(*args)
    raise ValueError(f"unknown attention kernel {kernel!r}")


def _nonempty(bounds: tuple[int, ...]) -> tuple[int, ...]:
    """``bounds`` without empty sequences (the flash kernels' single-query GQA path assumes none)."""
    out = [bounds[0]]
    for x in bounds[1:]:
        if x != out[-1]:
            out.append(x)
    return tuple(out)


def _spans(bounds: tuple[int, ...]):
    return [(s, e) for s, e in itertools.pairwise(bounds) if e > s]


#: varlen kernels with a sliding-window argument
WINDOW_KERNELS = ("flash_attn", "aten_flash")


def varlen_forward(kernel: str, q, k, v, bounds: tuple[int, ...], scale: float, window: int | None = None):
    """Causal attention of whole sequences packed along T (``bounds``: cumulative starts):
    ``(out in q.dtype, lse [Hq, T] float32)``. ONE kernel call on the varlen kernels; one call per
    sequence on ``cpu_flash`` / ``math``. ``window``: sliding-window attention (the kernel's window
    arguments where it has them, else the banded float32 path per sequence)."""
    if window is not None and kernel not in WINDOW_KERNELS:
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        for s, e in _spans(bounds):
            o, l_ = band_forward(q[s:e], k[s:e], v[s:e], 0, 0, window, scale)
            out[s:e] = o.to(q.dtype)
            lse[:, s:e] = l_
        return out, lse
    if window is not None:
        bounds = _nonempty(bounds)
        cu = _cu_device(bounds, q.device)
        mx = max((e - s for s, e in itertools.pairwise(bounds)), default=0)
        fn = _flash_attn_fwd if kernel == "flash_attn" else _aten_flash_fwd
        return fn(q, k, v, cu, cu, mx, mx, True, scale, window)
    if kernel in VARLEN_KERNELS:
        bounds = _nonempty(bounds)
        cu = _cu_device(bounds, q.device)
        mx = max((e - s for s, e in itertools.pairwise(bounds)), default=0)
        if kernel == "flash_attn":
            return _flash_attn_fwd(q, k, v, cu, cu, mx, mx, True, scale)
        if kernel == "aten_flash":
            return _aten_flash_fwd(q, k, v, cu, cu, mx, mx, True, scale)
        return _aten_eff_fwd(q, k, v, cu, cu, mx, mx, True, scale)
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    for s, e in _spans(bounds):
        o, l_ = block_forward(kernel, q[s:e], k[s:e], v[s:e], True, scale)
        out[s:e] = o
        lse[:, s:e] = l_
    return out, lse


def varlen_backward(kernel: str, dout, q, k, v, out, lse, bounds: tuple[int, ...], scale: float,
                    window: int | None = None):
    """Gradients of :func:`varlen_forward` (same call structure): ``(dq, dk, dv)`` in the input dtype."""
    if window is not None and kernel not in WINDOW_KERNELS:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for s, e in _spans(bounds):
            a, b, c = band_backward(dout[s:e], q[s:e], k[s:e], v[s:e], out[s:e], lse[:, s:e], 0, 0, window, scale)
            dq[s:e], dk[s:e], dv[s:e] = a.to(q.dtype), b.to(k.dtype), c.to(v.dtype)
        return dq, dk, dv
    if window is not None:
        bounds = _nonempty(bounds)
        cu = _cu_device(bounds, q.device)
        mx = max((e - s for s, e in itertools.pairwise(bounds)), default=0)
        fn = _flash_attn_bwd if kernel == "flash_attn" else _aten_flash_bwd
        return fn(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, cu, cu, mx, mx, True, scale, window)
    if kernel in VARLEN_KERNELS:
        bounds = _nonempty(bounds)
        cu = _cu_device(bounds, q.device)
        mx = max((e - s for s, e in itertools.pairwise(bounds)), default=0)
        args = (dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, cu, cu, mx, mx, True, scale)
        if kernel == "flash_attn":
            return _flash_attn_bwd(*args)
        if kernel == "aten_flash":
            return _aten_flash_bwd(*args)
        return _aten_eff_bwd(*args)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s, e in _spans(bounds):
        a, b, c = block_backward(kernel, dout[s:e], q[s:e], k[s:e], v[s:e], out[s:e], lse[:, s:e], True, scale)
        dq[s:e], dk[s:e], dv[s:e] = a, b, c
    return dq, dk, dv


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
