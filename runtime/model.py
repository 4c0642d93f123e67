"""A Llama-style decoder whose layers run on a plan's layouts (and its single-process reference).

Each layer::

    x_lin (linear layout, residual stream)
      -> RMSNorm -> layout.to_attention -> Q/K/V projections -> RoPE (absolute positions)
      -> layout.attention (the plan's engine: rings, routes, local) -> O projection
      -> layout.to_linear -> + residual
      -> RMSNorm -> SwiGLU MLP -> + residual

Embedding, final norm, LM head and the loss run in the linear layout. With tensor parallelism
(``layout.tp``, :class:`TPContext`) the layer runs TP-SP: the residual stream, norms, embedding and
loss on sequence shards of the unit's linear buffer, Q/K/V and gate/up as column-parallel and O and
down as row-parallel linears (overlap none / slicing / CommFuse), attention on the rank's heads. The model never
communicates itself: a *layout* object supplies the remaps and the attention. The distributed
layout (:class:`PlanLayout`) wraps a micro-batch's context of the public API (``attention``,
``to_attention_layout``, ``to_linear_layout`` of :mod:`zeppelin.runtime.api`); the reference
layout (:class:`ReferenceLayout`) holds whole sequences and runs plain causal attention, so the
same parameters give the single-process reference that ``--verify`` and the tests compare with.

Parameters are kept in fp32; with a bf16/fp16 ``ModelSpec`` the matmuls and attention run in that
dtype (weights cast on use) and norms, RoPE tables, softmax statistics and the loss in fp32.
"""

from __future__ import annotations

import contextlib

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeppelin.schemas.model import ModelSpec

from .data import IGNORE_INDEX

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(spec: ModelSpec) -> torch.dtype:
    return COMPUTE_DTYPES[spec.dtype]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape ``[T, head_dim/2]`` for absolute ``positions`` (computed in float64)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) of ``x: [T, H, D]`` (Llama's rotate-half form)."""
    d2 = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :d2], xf[..., d2:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


REFERENCE_TILE_SCORES = 1 << 22  # attention scores per tile of the reference (16 MiB in fp32)


def _tile_rows(heads: int, length: int, budget: int) -> int:
    return max(1, min(length, budget // max(heads * length, 1)))


class _TiledCausalAttention(torch.autograd.Function):
    """Exact causal attention over packed whole sequences, one tile of query rows at a time.

    A tile of ``tq`` query rows sees its causal prefix of keys in one explicit softmax (full rows,
    so no online rescaling), with at most ``REFERENCE_TILE_SCORES`` scores alive; the forward keeps
    only the output and the log-sum-exp of each row, and the backward recomputes each tile's
    probabilities from them. Working precision: float32, float64 for float64 inputs. K/V with fewer
    heads (GQA) are expanded per sequence and their gradients summed over each group."""

    @staticmethod
    def forward(ctx, q, k, v, lengths, budget):
        wdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        T, hq, d = q.shape
        hkv = k.shape[1]
        rep = hq // hkv
        scale = 1.0 / math.sqrt(d)
        out = torch.zeros((T, hq, d), dtype=wdt, device=q.device)
        lse = torch.zeros((hq, T), dtype=wdt, device=q.device)
        pos = 0
        for L in lengths:
            qs = q[pos:pos + L].to(wdt).transpose(0, 1)                          # [Hq, L, D]
            ks = k[pos:pos + L].to(wdt).repeat_interleave(rep, dim=1).transpose(0, 1)
            vs = v[pos:pos + L].to(wdt).repeat_interleave(rep, dim=1).transpose(0, 1)
            tq = _tile_rows(hq, L, budget)
            for a in range(0, L, tq):
                b = min(L, a + tq)
                s = torch.matmul(qs[:, a:b], ks[:, :b].transpose(1, 2)) * scale   # [Hq, b-a, b]
                rows = torch.arange(a, b, device=q.device)[:, None]
                s = s.masked_fill(torch.arange(b, device=q.device)[None, :] > rows, float("-inf"))
                m = s.amax(-1, keepdim=True)
                p = torch.exp(s - m)
                den = p.sum(-1, keepdim=True)
                out[pos + a:pos + b] = (torch.matmul(p, vs[:, :b]) / den).transpose(0, 1)
                lse[:, pos + a:pos + b] = (m + torch.log(den)).squeeze(-1)
                del s, p
            pos += L
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.lengths, ctx.budget, ctx.wdt = lengths, budget, wdt
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        wdt, budget = ctx.wdt, ctx.budget
        T, hq, d = q.shape
        hkv = k.shape[1]
        rep = hq // hkv
        scale = 1.0 / math.sqrt(d)
        dq = torch.zeros((T, hq, d), dtype=wdt, device=q.device)
        dk = torch.zeros((T, hkv, d), dtype=wdt, device=q.device)
        dv = torch.zeros((T, hkv, d), dtype=wdt, device=q.device)
        pos = 0
        for L in ctx.lengths:
            qs = q[pos:pos + L].to(wdt).transpose(0, 1)
            ks = k[pos:pos + L].to(wdt).repeat_interleave(rep, dim=1).transpose(0, 1)
            vs = v[pos:pos + L].to(wdt).repeat_interleave(rep, dim=1).transpose(0, 1)
            dos = do[pos:pos + L].to(wdt).transpose(0, 1)
            delta = (dos * out[pos:pos + L].transpose(0, 1)).sum(-1)             # [Hq, L]
            dks = torch.zeros((hq, L, d), dtype=wdt, device=q.device)
            dvs = torch.zeros((hq, L, d), dtype=wdt, device=q.device)
            tq = _tile_rows(hq, L, budget)
            for a in range(0, L, tq):
                b = min(L, a + tq)
                s = torch.matmul(qs[:, a:b], ks[:, :b].transpose(1, 2)) * scale
                rows = torch.arange(a, b, device=q.device)[:, None]
                s = s.masked_fill(torch.arange(b, device=q.device)[None, :] > rows, float("-inf"))
                p = torch.exp(s - lse[:, pos + a:pos + b, None])
                del s
                dvs[:, :b] += torch.matmul(p.transpose(1, 2), dos[:, a:b])
                dp = torch.matmul(dos[:, a:b], vs[:, :b].transpose(1, 2))
                ds = p * (dp - delta[:, a:b, None])
                del p, dp
                dq[pos + a:pos + b] = (torch.matmul(ds, ks[:, :b]) * scale).transpose(0, 1)
                dks[:, :b] += torch.matmul(ds.transpose(1, 2), qs[:, a:b]) * scale
                del ds
            dk[pos:pos + L] = dks.view(hkv, rep, L, d).sum(1).transpose(0, 1)
            dv[pos:pos + L] = dvs.view(hkv, rep, L, d).sum(1).transpose(0, 1)
            pos += L
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lengths: list[int],
                        tile_scores: int = REFERENCE_TILE_SCORES, tiled: bool = False) -> torch.Tensor:
    """Exact causal attention over packed whole sequences, memory-bounded.

    ``q: [T, Hq, D]``, ``k, v: [T, Hkv, D]``; the test oracle for every distributed path: each
    whole sequence through PyTorch's own fused attention (``scaled_dot_product_attention`` limited
    to its flash and memory-efficient kernels, which hold a block of scores at a time), computed in
    float32 (float64 for float64 inputs). Where neither kernel takes the inputs (float64 on a GPU),
    or with ``tiled``, the explicit-softmax tiles of :class:`_TiledCausalAttention`, never more than
    ``tile_scores`` scores at once. Either way the reference of a long sequence costs memory linear
    in its length, like the distributed kernels."""
    lengths = tuple(int(L) for L in seq_lengths)
    if sum(lengths) != q.shape[0]:
        raise ValueError(f"sequence lengths sum to {sum(lengths)}, the tensors hold {q.shape[0]} tokens")
    if not lengths:
        return q.new_zeros(q.shape)
    if not tiled:
        try:
            return _fused_causal(q, k, v, lengths)
        except RuntimeError as e:
            if "No available kernel" not in str(e):
                raise
    return _TiledCausalAttention.apply(q, k, v, lengths, int(tile_scores))


def _fused_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """:func:`reference_attention` by the fused kernels, one sequence at a time (K/V heads repeated
    for grouped queries; autograd sums their gradients back)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    wdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[1] // k.shape[1]
    outs, pos = [], 0
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        for L in lengths:
            qs, ks, vs = (t[pos:pos + L].to(wdt) for t in (q, k, v))
            if rep > 1:
                ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                               vs.transpose(0, 1)[None], is_causal=True)
            outs.append(o[0].transpose(0, 1))
            pos += L
    return torch.cat(outs).to(q.dtype)


class TPContext:
    """Tensor + sequence parallelism of one unit for one micro-batch (TP-SP, Megatron style).

    The unit's linear buffer of ``sum(rows)`` tokens is *sequence-sharded* over its TP ranks for
    the embedding, norms, residual stream, final norm, LM head and loss (TP rank ``t`` holds
    ``rows[t]`` consecutive tokens). The projections are column-parallel (all-gather + GEMM:
    Q/K/V, SwiGLU gate/up) and row-parallel (GEMM + reduce-scatter: O, down) over slices of the
    full parameters, with the ``mode`` overlap of :mod:`zeppelin.runtime.tp`; attention heads are
    split over the TP ranks (:func:`zeppelin.runtime.attn.ulysses.head_split`: query heads near-evenly,
    each rank with the KV heads its query heads use — KV heads are replicated when ``Hkv < tp``).

    Parameters stay whole on every rank (the canonical layout): a TP rank's gradient is non-zero
    only on its shard, so summing gradients over every rank of every replica gives the full
    gradient whatever each replica's TP degree (Hydraulis mixes them).
    """

    def __init__(self, group, rows, mode: str = "none", chunks: int = 4) -> None:
        from .tp import OVERLAP_MODES

        if mode not in OVERLAP_MODES:
            raise ValueError(f"unknown TP overlap mode {mode!r} (choose from {', '.join(OVERLAP_MODES)})")
        self.group = group
        self.rows = [int(r) for r in rows]
        if len(self.rows) != group.size:
            raise ValueError(f"TP row split {self.rows} does not have one entry per TP rank ({group.size})")
        self.mode = mode
        self.chunks = chunks

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def pos(self) -> int:
        return self.group.pos

    def heads(self, hq: int, hkv: int) -> tuple[int, int, int, int]:
        """``(q0, q1, kv0, kv1)``: the query heads of this TP rank and the KV heads they use."""
        from .attn.ulysses import head_split

        return head_split(hq, hkv, self.size)[self.pos]

    def features(self, n: int) -> tuple[int, int]:
        """This rank's ``[a, b)`` slice of ``n`` features (near-equal split)."""
        from zeppelin.schemas.layout import split_even

        sizes = split_even(n, self.size)
        a = sum(sizes[: self.pos])
        return a, a + sizes[self.pos]


class Layout:
    """How a model call sees its tokens. Subclasses supply the attention-layout positions,
    the remaps between the linear and attention layouts, and the attention itself. ``tp``: the
    unit's tensor parallelism (None: the rank holds its whole linear buffer)."""

    attn_positions: torch.Tensor
    linear_positions: torch.Tensor | None = None  # positions of the linear-layout tokens (HF models)
    tp: TPContext | None = None

    def to_attention(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def to_linear(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ReferenceLayout(Layout):
    """Single process, whole sequences packed one after the other: no remap, plain attention."""

    def __init__(self, seq_lengths: list[int], device: torch.device | str = "cpu",
                 microbatches: list[list[int]] | None = None) -> None:
        self.seq_lengths = list(seq_lengths)
        #: the sequences (indices) of each of the step's micro-batches, for per-micro-batch terms
        #: of the loss (a mixture of experts' router loss); None: the step as one micro-batch
        self.microbatches = microbatches
        self.attn_positions = torch.cat(
            [torch.arange(L, dtype=torch.int64) for L in self.seq_lengths]
        ).to(device) if self.seq_lengths else torch.zeros(0, dtype=torch.int64, device=device)
        self.linear_positions = self.attn_positions

    def attention(self, q, k, v):
        return reference_attention(q, k, v, self.seq_lengths, tile_scores=REFERENCE_TILE_SCORES)


class _Mark(torch.autograd.Function):
    """Identity that records a timestamp when its backward runs (per-phase backward timing)."""

    @staticmethod
    def forward(ctx, timer, name, edge, *xs):
        ctx.timer, ctx.name, ctx.edge = timer, name, edge
        outs = tuple(x.view_as(x) for x in xs)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.timer.backward_mark(ctx.name, ctx.edge)
        return (None, None, None, *grads)


class PhaseTimer:
    """Wall time of the attention and remap regions, forward and backward.

    Forward time is measured directly; backward time as the span between the region's output
    and input marks in the autograd pass (autograd runs a rank's graph in one thread, so the
    nodes between the two marks are the region's own). On CUDA each mark synchronises the device.
    """

    def __init__(self, enabled: bool = True, cuda: bool = False) -> None:
        self.enabled = enabled
        self.cuda = cuda
        self.totals: dict[str, float] = {}
        self._open: dict[str, list[float]] = {}

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, name: str, dt: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + dt

    def region(self, name: str, fn, *xs):
        """Run ``fn(*xs)``, timing it forward, and mark its backward span."""
        if not self.enabled or not torch.is_grad_enabled():
            return fn(*xs)
        xs = _Mark.apply(self, name, "in", *xs)
        if not isinstance(xs, tuple):
            xs = (xs,)
        t0 = self._now()
        out = fn(*xs)
        self.add(name, self._now() - t0)
        return _Mark.apply(self, name, "out", out)

    def backward_mark(self, name: str, edge: str) -> None:
        t = self._now()
        if edge == "out":
            self._open.setdefault(name, []).append(t)
        else:
            starts = self._open.get(name)
            if starts:
                self.add(name, t - starts.pop())


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_dim
        self.hq, self.hkv, self.d = spec.num_heads, spec.num_kv_heads, d
        self.theta = spec.rope_theta
        self.wq = nn.Parameter(torch.empty(self.hq * d, h))
        self.wk = nn.Parameter(torch.empty(self.hkv * d, h))
        self.wv = nn.Parameter(torch.empty(self.hkv * d, h))
        self.wo = nn.Parameter(torch.empty(h, self.hq * d))

    def forward(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: Layout,
                timer: PhaseTimer | None) -> torch.Tensor:
        dt = a.dtype
        T = a.shape[0]
        q = F.linear(a, self.wq.to(dt)).view(T, self.hq, self.d)
        k = F.linear(a, self.wk.to(dt)).view(T, self.hkv, self.d)
        v = F.linear(a, self.wv.to(dt)).view(T, self.hkv, self.d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if timer is not None:
            o = timer.region("attention", layout.attention, q, k, v)
        else:
            o = layout.attention(q, k, v)
        return F.linear(o.reshape(T, self.hq * self.d), self.wo.to(dt))

    def forward_tp(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: Layout,
                   timer: PhaseTimer | None) -> torch.Tensor:
        """TP-SP: sequence-sharded ``a [rows[pos], h]`` -> sequence-sharded ``[rows[pos], h]``.

        column-parallel Q/K/V (one fused GEMM over this rank's heads, whole linear buffer) ->
        remap to the attention layout -> RoPE -> the plan's attention on this rank's heads ->
        remap back -> row-parallel O (partial sums reduce-scattered to the sequence shards)."""
        from .tp import column_parallel, row_parallel

        tp = layout.tp
        dt, d = a.dtype, self.d
        q0, q1, k0, k1 = tp.heads(self.hq, self.hkv)
        nq, nk = q1 - q0, k1 - k0
        w = (self.wq[q0 * d:q1 * d], self.wk[k0 * d:k1 * d], self.wv[k0 * d:k1 * d])
        y = column_parallel(a, w, tp.group, tp.rows, tp.mode, tp.chunks, dtype=dt)
        y = timer.region("remap", layout.to_attention, y) if timer is not None else layout.to_attention(y)
        T = y.shape[0]
        q = y[:, : nq * d].reshape(T, nq, d)
        k = y[:, nq * d:(nq + nk) * d].reshape(T, nk, d)
        # V copied out of the fused output: the attention keeps V for its backward, and a view would
        # keep the whole output alive (the pre-rotary Q and K beside their rotated copies)
        v = y[:, (nq + nk) * d:].reshape(T, nk, d).contiguous()
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        r = self.hq // self.hkv
        kv_of = [(q0 + i) // r - k0 for i in range(nq)]
        if not (nq % nk == 0 and kv_of == [i // (nq // nk) for i in range(nq)]):
            # this rank's query heads do not map onto its KV heads as GQA groups: one KV per query head
            idx = torch.tensor(kv_of, dtype=torch.long, device=k.device)
            k, v = k.index_select(1, idx), v.index_select(1, idx)
        if timer is not None:
            o = timer.region("attention", layout.attention, q, k, v)
        else:
            o = layout.attention(q, k, v)
        o = o.reshape(T, nq * d)
        o = timer.region("remap", layout.to_linear, o) if timer is not None else layout.to_linear(o)
        return row_parallel(o, self.wo[:, q0 * d:q1 * d], tp.group, tp.rows, tp.mode, tp.chunks, dtype=dt)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, f = spec.hidden, spec.ffn_hidden
        self.gelu = spec.mlp == "gelu"
        self.w1 = nn.Parameter(torch.empty(f, h))
        self.w2 = nn.Parameter(torch.empty(h, f))
        self.w3 = None if self.gelu else nn.Parameter(torch.empty(f, h))

    def forward(self, x: torch.Tensor, tp: TPContext | None = None) -> torch.Tensor:
        """``tp``: the unit's TP-SP context (:meth:`forward_tp`); through the module's call, so
        that a recomputation wrapper around the MLP (``selective``) wraps the TP path too."""
        if tp is not None and tp.size > 1:
            return self.forward_tp(x, tp)
        dt = x.dtype
        if self.gelu:
            return F.linear(F.gelu(F.linear(x, self.w1.to(dt))), self.w2.to(dt))
        return F.linear(F.silu(F.linear(x, self.w1.to(dt))) * F.linear(x, self.w3.to(dt)), self.w2.to(dt))

    def forward_tp(self, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        """TP-SP: column-parallel gate/up (one fused GEMM over this rank's FFN slice), row-parallel
        down; ``[rows[pos], h]`` -> ``[rows[pos], h]``."""
        from .tp import column_parallel, row_parallel

        dt = x.dtype
        a, b = tp.features(self.w1.shape[0])
        if self.gelu:
            hmid = F.gelu(column_parallel(x, self.w1[a:b], tp.group, tp.rows, tp.mode, tp.chunks, dtype=dt))
        else:
            gu = column_parallel(x, (self.w1[a:b], self.w3[a:b]), tp.group, tp.rows, tp.mode, tp.chunks, dtype=dt)
            hmid = F.silu(gu[:, : b - a]) * gu[:, b - a:]
        return row_parallel(hmid, self.w2[:, a:b], tp.group, tp.rows, tp.mode, tp.chunks, dtype=dt)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, cos, sin, layout: Layout, timer: PhaseTimer | None):
        tp = getattr(layout, "tp", None)
        if tp is not None and tp.size > 1:
            x = x + self.attn.forward_tp(self.attn_norm(x), cos, sin, layout, timer)
            return x + self.mlp(self.mlp_norm(x), tp)
        h = self.attn_norm(x)
        if timer is not None:
            a = timer.region("remap", layout.to_attention, h)
            o = self.attn(a, cos, sin, layout, timer)
            o = timer.region("remap", layout.to_linear, o)
        else:
            o = layout.to_linear(self.attn(layout.to_attention(h), cos, sin, layout, None))
        x = x + o
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    """Decoder-only transformer from a :class:`ModelSpec` (Llama: RMSNorm, RoPE, GQA, SwiGLU)."""

    def __init__(self, spec: ModelSpec, seed: int = 0, meta: bool = False) -> None:
        """``meta``: parameters on the meta device (no storage, no values) until
        :func:`zeppelin.runtime.fsdp.materialize` gives each rank its shards of the seeded values."""
        super().__init__()
        self.spec = spec
        self.dtype = compute_dtype(spec)
        self.seed = seed
        with torch.device("meta") if meta else contextlib.nullcontext():
            self.embed = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden))
            self.layers = nn.ModuleList(Block(spec) for _ in range(spec.num_layers))
            self.norm = RMSNorm(spec.hidden, spec.norm_eps)
            self.lm_head = None if spec.tie_embeddings else nn.Parameter(torch.empty(spec.vocab_size, spec.hidden))
        #: the parameters in the order the seeded initialisation draws them
        self.init_order = [(n, tuple(p.shape)) for n, p in self.named_parameters()]
        if not meta:
            self.reset_parameters(seed)

    def _seeded_values(self, seed: int):
        """``(name, whole value)`` of every parameter in turn, one tensor alive at a time: N(0, 0.02)
        for matrices, output projections scaled by 1/sqrt(2*layers), ones for norms (drawing nothing)."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * self.spec.num_layers)
        for name, shape in self.init_order:
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape)
            else:
                s = out_std if name.endswith(("wo", "w2")) else std
                yield name, torch.randn(shape, generator=g, dtype=torch.float32) * s

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from ``seed`` (independent of the global RNG)."""
        params = dict(self.named_parameters())
        for name, value in self._seeded_values(seed):
            params[name].copy_(value)

    @torch.no_grad()
    def fill_shards(self, targets: dict[str, tuple[torch.Tensor, int, int]], device) -> None:
        """Each parameter's rows ``[a, b)`` of the seeded values into its local tensor (the values of
        :meth:`reset_parameters`, each whole tensor drawn in turn and dropped)."""
        for name, value in self._seeded_values(self.seed):
            local, a, b = targets[name]
            local.copy_(value[a:b])

    def hidden_states(self, tokens: torch.Tensor, layout: Layout, timer: PhaseTimer | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden]`` of the linear-layout ``tokens``."""
        x = F.embedding(tokens, self.embed).to(self.dtype)
        cos, sin = rope_tables(layout.attn_positions, self.spec.head_dim, self.spec.rope_theta)
        for blk in self.layers:
            x = blk(x, cos, sin, layout, timer)
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.embed if self.lm_head is None else self.lm_head
        return F.linear(h, w.to(h.dtype)).float()

    def loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies (labels == IGNORE_INDEX contribute nothing)."""
        return F.cross_entropy(self.logits(h), labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def forward(self, tokens, labels, layout: Layout, timer: PhaseTimer | None = None):
        h = self.hidden_states(tokens, layout, timer)
        return self.loss_sum(h, labels), h


REFERENCE_LOSS_ROWS = 4096  # tokens per chunk of the reference's LM head + loss, and of its MLPs


def _reference_block(blk: Block, x: torch.Tensor, cos, sin, layout: Layout) -> torch.Tensor:
    """:meth:`Block.forward` on the reference layout (whole sequences, no remap), recomputed in the
    backward pass: the step keeps only each layer's input; while one layer's backward runs, its
    pieces are recomputed — everything that acts on each token alone (norms, Q/K/V with RoPE, O, the
    MLP) in chunks of ``REFERENCE_LOSS_ROWS`` tokens keeping only each chunk's input, the attention
    core over the whole step (fused kernels, :func:`reference_attention`). Same arithmetic as
    :meth:`Attention.forward` / :meth:`Block.forward`."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_reference_block_pieces, blk, x, cos, sin, layout, use_reentrant=False)


def _reference_block_pieces(blk: Block, x: torch.Tensor, cos, sin, layout: Layout) -> torch.Tensor:
    from torch.utils.checkpoint import checkpoint

    att = blk.attn
    T = x.shape[0]
    spans = [(a, min(T, a + REFERENCE_LOSS_ROWS)) for a in range(0, T, REFERENCE_LOSS_ROWS)]

    def qkv(xx, c, s):
        h = blk.attn_norm(xx)
        dt, n = h.dtype, h.shape[0]
        q = F.linear(h, att.wq.to(dt)).view(n, att.hq, att.d)
        k = F.linear(h, att.wk.to(dt)).view(n, att.hkv, att.d)
        v = F.linear(h, att.wv.to(dt)).view(n, att.hkv, att.d)
        return apply_rope(q, c, s), apply_rope(k, c, s), v

    def out_proj(o):
        return F.linear(o, att.wo.to(o.dtype))

    def mlp(xx):
        return blk.mlp(blk.mlp_norm(xx))

    parts = [checkpoint(qkv, x[a:b], cos[a:b], sin[a:b], use_reentrant=False) for a, b in spans]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    del parts
    o = layout.attention(q, k, v).reshape(T, att.hq * att.d)
    del q, k, v
    x = x + torch.cat([checkpoint(out_proj, o[a:b], use_reentrant=False) for a, b in spans])
    del o
    return x + torch.cat([checkpoint(mlp, x[a:b], use_reentrant=False) for a, b in spans])


def reference_step(model: LlamaModel, sequences, source, device: torch.device | str = "cpu",
                   normaliser: int | None = None, microbatches: list[list[int]] | None = None) -> dict[str, Any]:
    """Single-process reference of one step: every sequence whole, exact causal attention.

    Returns ``loss`` (sum of cross-entropies / predicted tokens), the final hidden states of each
    sequence (``hidden[seq] -> [L, hidden]``) and the gradient of every parameter (``grads``).
    The model's existing ``.grad`` fields are left untouched.

    Memory is bounded like the runtime's: attention runs in fused kernels (:func:`reference_attention`), and
    everything else is recomputed in the backward pass in chunks of ``REFERENCE_LOSS_ROWS`` tokens
    (norms, projections, MLPs, the LM head and the loss: :func:`_reference_block`), so besides the
    attention core's Q/K/V/output only the chunks' inputs are kept. The arithmetic is the same as
    an un-checkpointed pass.
    """
    from torch.utils.checkpoint import checkpoint

    from .data import predicted_tokens

    lengths = [s.length for s in sequences]
    segs = [[i, 0, L] for i, L in enumerate(lengths)]
    batch = source.segments(sequences, segs)
    tokens = torch.from_numpy(batch.tokens).to(device)
    labels = torch.from_numpy(batch.labels).to(device)
    layout = ReferenceLayout(lengths, device, microbatches)
    n = normaliser if normaliser is not None else max(predicted_tokens(sequences), 1)
    params = [p for p in model.parameters()]
    if not isinstance(model, LlamaModel):
        # another model behind the same interface (zeppelin.runtime.hf: transformers' own attention,
        # one whole sequence at a time, for a ReferenceLayout)
        loss_sum, h = model(tokens, labels, layout)
    else:
        x = F.embedding(tokens, model.embed).to(model.dtype)
        cos, sin = rope_tables(layout.attn_positions, model.spec.head_dim, model.spec.rope_theta)
        for blk in model.layers:
            x = _reference_block(blk, x, cos, sin, layout)
        h = model.norm(x)
        del x
        loss_sum = None
        for a in range(0, h.shape[0], REFERENCE_LOSS_ROWS):
            part = checkpoint(model.loss_sum, h[a:a + REFERENCE_LOSS_ROWS], labels[a:a + REFERENCE_LOSS_ROWS],
                              use_reentrant=False)
            loss_sum = part if loss_sum is None else loss_sum + part
        if loss_sum is None:
            loss_sum = h.sum() * 0.0
    loss = loss_sum / n
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    names = [name for name, _ in model.named_parameters()]
    hidden = {}
    pos = 0
    hd = h.detach()
    for i, L in enumerate(lengths):
        hidden[i] = hd[pos:pos + L]
        pos += L
    return {
        "loss": float(loss.detach()),
        "hidden": hidden,
        "grads": {nm: (g if g is not None else torch.zeros_like(p)) for nm, g, p in zip(names, grads, params)},
    }
