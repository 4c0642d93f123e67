"""Tensor + sequence parallel linears with three communication/compute overlap modes.

TP-SP (Megatron sequence parallelism): between the tensor-parallel regions activations are
*sequence-sharded* — TP rank ``t`` of a unit holds ``rows[t]`` consecutive tokens of the unit's
buffer, ``[rows[t], hidden]``. A column-parallel linear all-gathers the tokens and multiplies by its
column shard of the weight (``[T, out/tp]``); a row-parallel linear multiplies by its row shard
(partial sums ``[T, out]``) and reduce-scatters them back to sequence shards.

``overlap`` decides how the collectives meet the GEMMs (all three give the same numbers):

* ``none``     — the collective, then the GEMM (or the GEMM, then the collective);
* ``slicing``  — every rank's rows are cut into ``chunks`` slices; the all-gather of slice ``i+1``
  runs while slice ``i`` is multiplied (GEMM+reduce-scatter: slice ``i`` is reduce-scattered while
  slice ``i+1`` is multiplied). One slice's communication is always exposed (the first all-gather,
  the last reduce-scatter);
* ``commfuse`` — decomposed ring, P2P with ``batch_isend_irecv`` (CommFuse, arXiv 2604.24013):
  *all-gather + GEMM*: at step ``s`` rank ``r`` multiplies the shard it holds (that of TP rank
  ``r - s``) while passing it to ``r + 1`` and receiving the next one from ``r - 1``;
  *GEMM + reduce-scatter* as a ring-accumulate: at step ``s`` rank ``r`` computes the partial
  product for chunk ``(r - s - 1) mod N``, adds the accumulator received from ``r - 1`` and sends
  the sum on; at the last step it computes its own chunk — no trailing send, no final reduce.

Backward uses the mirrored decompositions: the input gradient of all-gather+GEMM is a
GEMM+reduce-scatter and that of GEMM+reduce-scatter is an all-gather+GEMM, in the same mode; the
weight gradient is one GEMM against the gathered activations (kept from the forward for the
column-parallel linear, gathered during the backward ring for the row-parallel one).

Weights have no bias (Llama style). ``TPGroup`` carries the GLOBAL ranks of the unit in TP order
(``Replica.ranks``), this rank's position and the process group used by the collective modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeppelin.schemas.layout import split_even

__all__ = [
    "OVERLAP_MODES",
    "TPMLP",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPAttentionProjections",
    "TPGroup",
    "ag_gemm",
    "column_parallel",
    "gemm_rs",
    "row_parallel",
    "shard_sizes",
]

OVERLAP_MODES = ("none", "slicing", "commfuse")


def shard_sizes(n: int, tp: int) -> list[int]:
    """Near-equal split of ``n`` features (or tokens) over ``tp`` ranks."""
    return split_even(n, tp)


@dataclass
class TPGroup:
    """The tensor-parallel ranks of one unit. ``ranks``: global ranks in TP order; ``rank``: mine;
    ``pg``: process group of those ranks (``None`` is looked up in the default GroupCache)."""

    ranks: list[int]
    rank: int
    pg: object = None

    def __post_init__(self) -> None:
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not in the TP group {self.ranks}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"TP group lists a rank twice: {self.ranks}")
        self.size = len(self.ranks)
        self.pos = self.ranks.index(self.rank)
        if self.size > 1 and self.pg is None:
            from .groups import get_group

            self.pg = get_group(self.ranks)
        # collectives order chunks by group rank (= ascending global rank): TP index of each
        self.group_order = [self.ranks.index(r) for r in sorted(self.ranks)]

    @property
    def next(self) -> int:
        return self.ranks[(self.pos + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.pos - 1) % self.size]


def _mm(a, w):
    """``a @ w.T`` (``w`` is ``[out, in]``, like ``nn.Linear.weight``)."""
    return a @ w.t()


def _offsets(rows: Sequence[int]) -> list[int]:
    off = [0]
    for r in rows:
        off.append(off[-1] + r)
    return off


# ---------------------------------------------------------------------------------------------
# collectives with uneven row counts (gloo's all_gather needs equal sizes: pad to the maximum)
# ---------------------------------------------------------------------------------------------


def _all_gather_rows(x, rows: Sequence[int], g: TPGroup, async_op: bool = False):
    """Start/do an all-gather of ``x`` (``[rows[pos], ...]``) over the TP group.

    Returns ``finish()`` producing the gathered ``[sum(rows), ...]`` tensor in TP order."""
    import torch
    import torch.distributed as dist

    m = max(rows)
    tail = x.shape[1:]
    src = x if x.shape[0] == m else torch.cat([x, x.new_zeros((m - x.shape[0], *tail))])
    out = x.new_empty((g.size * m, *tail))
    work = dist.all_gather_into_tensor(out, src.contiguous(), group=g.pg, async_op=async_op)

    def finish():
        if work is not None:
            work.wait()
        parts = [None] * g.size
        for j, t in enumerate(g.group_order):
            parts[t] = out[j * m: j * m + rows[t]]
        return torch.cat(parts)

    return finish


def _reduce_scatter_rows(p, rows: Sequence[int], g: TPGroup, async_op: bool = False):
    """Start/do a sum reduce-scatter of ``p`` (``[sum(rows), ...]``, TP order); ``finish()``
    returns this rank's ``[rows[pos], ...]`` share."""
    import torch.distributed as dist

    m = max(rows)
    tail = p.shape[1:]
    off = _offsets(rows)
    if all(r == m for r in rows) and g.group_order == list(range(g.size)):
        src = p.contiguous()
    else:
        src = p.new_zeros((g.size * m, *tail))
        for j, t in enumerate(g.group_order):
            src[j * m: j * m + rows[t]] = p[off[t]: off[t + 1]]
    out = p.new_empty((m, *tail))
    work = dist.reduce_scatter_tensor(out, src, group=g.pg, async_op=async_op)

    def finish():
        if work is not None:
            work.wait()
        return out[: rows[g.pos]]

    return finish


def _p2p(send, send_to: int, recv_shape, recv_from: int, like):
    """Post one send and one receive (ring step); returns the handles and the receive buffer."""
    import torch
    import torch.distributed as dist

    rb = torch.empty(recv_shape, dtype=like.dtype, device=like.device)
    ops = []
    # both sides know every shard's size: empty shards are not sent at all
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send.contiguous(), send_to))
    if rb.numel():
        ops.append(dist.P2POp(dist.irecv, rb, recv_from))
    return (dist.batch_isend_irecv(ops) if ops else []), rb


# ---------------------------------------------------------------------------------------------
# the two fused kernels (no autograd)
# ---------------------------------------------------------------------------------------------


def ag_gemm(x, w, g: TPGroup, rows: Sequence[int], mode: str = "none", chunks: int = 4):
    """All-gather ``x`` (my ``[rows[pos], in]``) over the TP group and multiply: ``X_full @ w.T``.

    Returns ``(y [sum(rows), out], x_full [sum(rows), in])``."""
    rows = list(rows)
    if x.shape[0] != rows[g.pos]:
        raise ValueError(f"TP rank {g.pos} holds {x.shape[0]} rows, expected {rows[g.pos]}")
    T = sum(rows)
    if g.size == 1 or T == 0:  # every TP rank knows ``rows``: an empty buffer communicates nothing
        return _mm(x, w), x
    off = _offsets(rows)
    if mode == "none":
        xf = _all_gather_rows(x, rows, g)()
        return _mm(xf, w), xf
    if mode == "slicing":
        k = max(1, min(chunks, max(rows)))
        pieces = [split_even(r, k) for r in rows]          # per TP rank, its slice sizes
        poff = [_offsets(p) for p in pieces]
        y = x.new_empty((T, w.shape[0]))
        xf = x.new_empty((T, x.shape[1]))
        mine = poff[g.pos]

        def start(i):
            return _all_gather_rows(x[mine[i]: mine[i + 1]], [p[i] for p in pieces], g, async_op=True)

        pending = start(0)
        for i in range(k):
            xi = pending()
            if i + 1 < k:
                pending = start(i + 1)
            yi = _mm(xi, w)
            o = 0
            for t in range(g.size):
                n = pieces[t][i]
                dst = off[t] + poff[t][i]
                y[dst: dst + n] = yi[o: o + n]
                xf[dst: dst + n] = xi[o: o + n]
                o += n
        return y, xf
    if mode == "commfuse":
        N = g.size
        y = x.new_empty((T, w.shape[0]))
        xf = x.new_empty((T, x.shape[1]))
        cur = x.contiguous()
        for s in range(N):
            c = (g.pos - s) % N
            works, nxt = [], None
            if s < N - 1:
                works, nxt = _p2p(cur, g.next, (rows[(g.pos - s - 1) % N], x.shape[1]), g.prev, x)
            y[off[c]: off[c + 1]] = _mm(cur, w)
            xf[off[c]: off[c + 1]] = cur
            for wk in works:
                wk.wait()
            cur = nxt
        return y, xf
    raise ValueError(f"unknown TP overlap mode {mode!r} (choose from {', '.join(OVERLAP_MODES)})")


def gemm_rs(x, w, g: TPGroup, rows: Sequence[int], mode: str = "none", chunks: int = 4):
    """Multiply the full ``x`` (``[sum(rows), in_shard]``) by ``w.T`` and reduce-scatter the partial
    sums over the TP group; returns my ``[rows[pos], out]`` share of the summed product."""
    import torch

    rows = list(rows)
    T = sum(rows)
    if x.shape[0] != T:
        raise ValueError(f"row-parallel input has {x.shape[0]} rows, the TP row split sums to {T}")
    if g.size == 1 or T == 0:
        return _mm(x, w)
    off = _offsets(rows)
    if mode == "none":
        return _reduce_scatter_rows(_mm(x, w), rows, g)()
    if mode == "slicing":
        k = max(1, min(chunks, max(rows)))
        pieces = [split_even(r, k) for r in rows]
        poff = [_offsets(p) for p in pieces]
        finishers = []
        for i in range(k):
            xi = torch.cat([x[off[t] + poff[t][i]: off[t] + poff[t][i + 1]] for t in range(g.size)])
            finishers.append(_reduce_scatter_rows(_mm(xi, w), [p[i] for p in pieces], g, async_op=True))
        return torch.cat([f() for f in finishers])
    if mode == "commfuse":
        N = g.size
        works, acc = [], None
        for s in range(N):
            c = (g.pos - s - 1) % N
            part = _mm(x[off[c]: off[c + 1]], w)
            if s > 0:
                for wk in works:
                    wk.wait()
                part = part + acc
            if s == N - 1:
                return part
            works, acc = _p2p(part, g.next, (rows[(g.pos - s - 2) % N], w.shape[0]), g.prev, part)
    raise ValueError(f"unknown TP overlap mode {mode!r} (choose from {', '.join(OVERLAP_MODES)})")


# ---------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------

_FNS: dict[str, type] = {}


def _fns():
    if _FNS:
        return _FNS
    import torch

    class _ColumnFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, g, rows, mode, chunks, dtype, *ws):
            y, xf = ag_gemm(x, _joined(ws, dtype), g, rows, mode, chunks)
            # the weight's pieces as given (views of the parameters): no copy kept for the backward
            ctx.save_for_backward(xf, *ws)
            ctx.cfg = (g, rows, mode, chunks, dtype)
            return y

        @staticmethod
        def backward(ctx, dy):
            xf, *ws = ctx.saved_tensors
            g, rows, mode, chunks, dtype = ctx.cfg
            w = _joined(ws, dtype)
            dy = dy.contiguous()
            dx = gemm_rs(dy, w.t(), g, rows, mode, chunks) if ctx.needs_input_grad[0] else None
            dws = [None] * len(ws)
            if any(ctx.needs_input_grad[6:]):
                dw = dy.t() @ xf
                dws = [d.to(p.dtype) for d, p in zip(dw.split([p.shape[0] for p in ws]), ws)]
            return (dx, None, None, None, None, None, *dws)

    class _RowFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, g, rows, mode, chunks, dtype):
            ctx.save_for_backward(x, w)
            ctx.cfg = (g, rows, mode, chunks, dtype)
            return gemm_rs(x, _joined((w,), dtype), g, rows, mode, chunks)

        @staticmethod
        def backward(ctx, dz):
            x, w = ctx.saved_tensors
            g, rows, mode, chunks, dtype = ctx.cfg
            dx, dzf = ag_gemm(dz.contiguous(), _joined((w,), dtype).t(), g, rows, mode, chunks)
            dw = (dzf.t() @ x).to(w.dtype) if ctx.needs_input_grad[1] else None
            return (dx if ctx.needs_input_grad[0] else None), dw, None, None, None, None, None

    _FNS["column"] = _ColumnFn
    _FNS["row"] = _RowFn
    return _FNS


def _check_mode(mode: str) -> None:
    if mode not in OVERLAP_MODES:
        raise ValueError(f"unknown TP overlap mode {mode!r} (choose from {', '.join(OVERLAP_MODES)})")


def _joined(ws, dtype):
    """The weight the GEMM multiplies: the pieces (stacked along the output features) in ``dtype``
    (``None``: their own). Built again in the backward, so only the pieces (views of the
    parameters) are kept between forward and backward."""
    ws = [w if dtype is None else w.to(dtype) for w in ws]
    return ws[0] if len(ws) == 1 else torch.cat(ws)


def column_parallel(x, w, g: TPGroup, rows: Sequence[int], mode: str = "none", chunks: int = 4, dtype=None):
    """Differentiable all-gather + GEMM: ``[rows[pos], in]`` -> ``[sum(rows), out_shard]``.

    ``w``: the ``[out_shard, in]`` weight, or a sequence of pieces that stack to it along the
    output features (e.g. this rank's slices of Q, K and V); ``dtype``: the GEMM's, the pieces are
    cast inside (the backward casts them again rather than keeping a copy)."""
    _check_mode(mode)
    ws = (w,) if isinstance(w, torch.Tensor) else tuple(w)
    return _fns()["column"].apply(x, g, list(rows), mode, chunks, dtype, *ws)


def row_parallel(x, w, g: TPGroup, rows: Sequence[int], mode: str = "none", chunks: int = 4, dtype=None):
    """Differentiable GEMM + reduce-scatter: ``[sum(rows), in_shard]`` -> ``[rows[pos], out]``;
    ``dtype`` as for :func:`column_parallel`."""
    _check_mode(mode)
    return _fns()["row"].apply(x, w, g, list(rows), mode, chunks, dtype)


# ---------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------


class _ShardedLinear(nn.Module):
    """A linear layer whose weight ``[out, in]`` is split over the TP group along dimension
    ``split_dim`` (0: output features, column-parallel; 1: input features, row-parallel)."""

    split_dim: int
    kind: str

    def __init__(self, in_features: int, out_features: int, group: TPGroup, overlap: str = "none",
                 chunks: int = 4, sizes: Sequence[int] | None = None, dtype=None, device=None):
        super().__init__()
        _check_mode(overlap)
        self.group, self.overlap, self.chunks = group, overlap, chunks
        split = (out_features, in_features)[self.split_dim]
        self.sizes = list(sizes) if sizes is not None else shard_sizes(split, group.size)
        if len(self.sizes) != group.size or sum(self.sizes) != split:
            raise ValueError(f"{self.kind} shard sizes {self.sizes} do not split {split} "
                             f"over {group.size} ranks")
        self.in_features, self.out_features = in_features, out_features
        shape = [out_features, in_features]
        shape[self.split_dim] = self.sizes[group.pos]
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=in_features ** -0.5)

    @classmethod
    def from_full(cls, weight, group: TPGroup, overlap="none", chunks=4, sizes=None):
        m = cls(weight.shape[1], weight.shape[0], group, overlap, chunks, sizes, weight.dtype, weight.device)
        o = _offsets(m.sizes)
        with torch.no_grad():
            m.weight.copy_(weight.narrow(cls.split_dim, o[group.pos], o[group.pos + 1] - o[group.pos]))
        return m


class ColumnParallelLinear(_ShardedLinear):
    """``y = AllGather(x) @ W[shard].T``: input sequence-sharded ``[rows[pos], in]``, output
    ``[sum(rows), out_shard]``. ``sizes``: output features per TP rank (default near-equal)."""

    split_dim, kind = 0, "column"

    def forward(self, x, rows: Sequence[int] | None = None):
        rows = list(rows) if rows is not None else [x.shape[0]] * self.group.size
        return column_parallel(x, self.weight, self.group, rows, self.overlap, self.chunks)


class RowParallelLinear(_ShardedLinear):
    """``z = ReduceScatter(x @ W[:, shard].T)``: input ``[sum(rows), in_shard]``, output
    sequence-sharded ``[rows[pos], out]``. ``sizes``: input features per TP rank."""

    split_dim, kind = 1, "row"

    def forward(self, x, rows: Sequence[int] | None = None):
        if rows is None:
            rows = shard_sizes(x.shape[0], self.group.size)
        return row_parallel(x, self.weight, self.group, list(rows), self.overlap, self.chunks)


class TPMLP(nn.Module):
    """SwiGLU MLP under TP-SP: column-parallel gate+up (one fused GEMM, each rank's gate and up
    shards side by side), row-parallel down. ``[rows[pos], h]`` -> ``[rows[pos], h]``."""

    def __init__(self, hidden: int, ffn: int, group: TPGroup, overlap: str = "none", chunks: int = 4,
                 dtype=None, device=None):
        super().__init__()
        self.ffn_sizes = shard_sizes(ffn, group.size)
        f = self.ffn_sizes[group.pos]
        self.gate_up = ColumnParallelLinear(hidden, 2 * ffn, group, overlap, chunks,
                                            sizes=[2 * s for s in self.ffn_sizes], dtype=dtype, device=device)
        self.down = RowParallelLinear(ffn, hidden, group, overlap, chunks, sizes=self.ffn_sizes,
                                      dtype=dtype, device=device)
        self.local_ffn = f

    @classmethod
    def from_full(cls, w_gate, w_up, w_down, group: TPGroup, overlap="none", chunks=4):
        ffn, hidden = w_gate.shape
        m = cls(hidden, ffn, group, overlap, chunks, dtype=w_gate.dtype, device=w_gate.device)
        o = _offsets(m.ffn_sizes)
        a, b = o[group.pos], o[group.pos + 1]
        with torch.no_grad():
            m.gate_up.weight.copy_(torch.cat([w_gate[a:b], w_up[a:b]]))
            m.down.weight.copy_(w_down[:, a:b])
        return m

    def forward(self, x, rows: Sequence[int] | None = None):
        rows = list(rows) if rows is not None else [x.shape[0]] * self.gate_up.group.size
        gu = self.gate_up(x, rows)
        gate, up = gu[:, : self.local_ffn], gu[:, self.local_ffn:]
        return self.down(torch.nn.functional.silu(gate) * up, rows)

class TPAttentionProjections(nn.Module):
    """Attention projections under TP-SP, heads sharded over the TP group: ``qkv(x)`` (column-
    parallel, one fused GEMM) -> ``q [T, Hq/tp, D]``, ``k, v [T, Hkv/tp, D]`` for the full
    sequence; ``out(o)`` (row-parallel) -> ``[rows[pos], hidden]``. Needs ``Hq`` and ``Hkv``
    divisible by the TP degree."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, group: TPGroup,
                 overlap: str = "none", chunks: int = 4, dtype=None, device=None):
        super().__init__()
        tp = group.size
        if n_heads % tp or n_kv_heads % tp:
            raise ValueError(f"tensor parallelism over {tp} ranks needs the head counts ({n_heads} query, "
                             f"{n_kv_heads} KV) to be multiples of {tp}")
        self.hq, self.hkv, self.d = n_heads // tp, n_kv_heads // tp, head_dim
        per = (self.hq + 2 * self.hkv) * head_dim
        self.qkv = ColumnParallelLinear(hidden, per * tp, group, overlap, chunks, sizes=[per] * tp,
                                        dtype=dtype, device=device)
        self.o = RowParallelLinear(n_heads * head_dim, hidden, group, overlap, chunks,
                                   sizes=[self.hq * head_dim] * tp, dtype=dtype, device=device)

    @classmethod
    def from_full(cls, wq, wk, wv, wo, n_heads: int, n_kv_heads: int, group: TPGroup, overlap="none",
                  chunks=4):
        d = wq.shape[0] // n_heads
        m = cls(wq.shape[1], n_heads, n_kv_heads, d, group, overlap, chunks, wq.dtype, wq.device)
        p = group.pos
        qa, qb = p * m.hq * d, (p + 1) * m.hq * d
        ka, kb = p * m.hkv * d, (p + 1) * m.hkv * d
        with torch.no_grad():
            m.qkv.weight.copy_(torch.cat([wq[qa:qb], wk[ka:kb], wv[ka:kb]]))
            m.o.weight.copy_(wo[:, qa:qb])
        return m

    def qkv_heads(self, x, rows: Sequence[int] | None = None):
        y = self.qkv(x, rows)
        T, d = y.shape[0], self.d
        q = y[:, : self.hq * d].reshape(T, self.hq, d)
        k = y[:, self.hq * d: (self.hq + self.hkv) * d].reshape(T, self.hkv, d)
        v = y[:, (self.hq + self.hkv) * d:].reshape(T, self.hkv, d)
        return q, k, v

    def out(self, o, rows: Sequence[int] | None = None):
        return self.o(o.reshape(o.shape[0], -1), rows)
