"""Ulysses sequence parallelism over heterogeneous groups (FlexSP plans).

A ``ulysses`` group of ``G`` ranks holds its sequences *sequence-sharded*: ring position ``j`` holds
``Placement.ranges[j]`` of every sequence of the group (contiguous slices, scheme ``contiguous``;
any disjoint cover works), sequences in placement order. Attention runs *head-sharded*:

1. one all-to-all scatters Q, K and V by heads and gathers the sequence — afterwards position ``j``
   holds every token of every sequence of the group for its heads;
2. local causal varlen attention over those whole sequences (:func:`.local.local_attention`);
3. one all-to-all sends O back to the sequence shards.

Head split: query heads are split near-evenly and contiguously over the positions (``Hq`` need not
be a multiple of ``G``; when ``Hq < G`` some positions get no head and only relay). Each position
receives exactly the KV heads its query heads use (GQA); KV heads are *replicated* to several
positions when ``Hkv < G`` or when a split cuts through a KV group — their gradients are summed
back in the backward all-to-all. Q, K and V travel in one all-to-all (one collective per direction,
so every rank issues the same collectives in the same order, forward and backward); the exchange
uses ``all_to_all_single`` with per-peer split sizes on the group's process group (supported by
gloo and NCCL). Groups of different sizes in one step run concurrently on disjoint ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zeppelin.schemas.layout import split_even

from .local import local_attention

__all__ = ["UlyssesSpec", "expand_kv", "ulysses_attention", "head_split"]


def head_split(hq: int, hkv: int, G: int) -> list[tuple[int, int, int, int]]:
    """Per position ``(q0, q1, kv0, kv1)``: its query heads ``[q0, q1)`` and the KV heads they use."""
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    r = hq // hkv
    out, a = [], 0
    for n in split_even(hq, G):
        b = a + n
        out.append((a, b, a // r, (b - 1) // r + 1) if n else (a, a, 0, 0))
        a = b
    return out


@dataclass
class UlyssesSpec:
    """One Ulysses group as seen from one rank.

    ``ranks``: global ranks in ring-position order; ``pos``: mine; ``seqs``: per sequence of the
    group (placement order), per position, the ``[start, end)`` token ranges held there."""

    ranks: list[int]
    pos: int
    seqs: list[list[list[list[int]]]]
    lengths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        G = len(self.ranks)
        if not 0 <= self.pos < G:
            raise ValueError(f"position {self.pos} outside a group of {G}")
        self.lengths = []
        for i, per_pos in enumerate(self.seqs):
            if len(per_pos) != G:
                raise ValueError(f"sequence {i} of the Ulysses group has ranges for {len(per_pos)} "
                                 "positions, "
                                 f"group has {G}")
            spans = sorted((s, e) for rs in per_pos for s, e in rs if e > s)
            pos = 0
            for s, e in spans:
                if s != pos:
                    raise ValueError(f"sequence {i} of the Ulysses group is not covered contiguously from 0 "
                                     f"(gap or overlap at token {min(s, pos)})")
                pos = e
            self.lengths.append(pos)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rows(self, j: int) -> int:
        """Tokens held at position ``j`` (its local buffer rows for this group)."""
        return sum(e - s for per_pos in self.seqs for s, e in per_pos[j])

    def cu_seqlens(self) -> list[int]:
        cu = [0]
        for L in self.lengths:
            cu.append(cu[-1] + L)
        return cu

    def gather_perm(self) -> torch.Tensor:
        """Index ``perm`` with ``full = gathered[perm]``: gathered rows are ordered by position, then
        sequence, then range; full rows by sequence, then absolute token position."""
        cu = self.cu_seqlens()
        dest = []
        for j in range(self.size):
            for i, per_pos in enumerate(self.seqs):
                for s, e in per_pos[j]:
                    if e > s:
                        dest.append(torch.arange(cu[i] + s, cu[i] + e))
        dest_t = torch.cat(dest) if dest else torch.empty(0, dtype=torch.long)
        perm = torch.empty_like(dest_t)
        perm[dest_t] = torch.arange(dest_t.numel())
        return perm


def _perms(spec: UlyssesSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, inverse)`` of :meth:`UlyssesSpec.gather_perm` on ``device``, computed once per spec
    and device (every layer reuses them; a CUDA copy is pinned and non-blocking, no host sync)."""
    cache = spec.__dict__.setdefault("_perm_cache", {})
    key = str(device)
    if key not in cache:
        perm = spec.gather_perm()
        inv = torch.argsort(perm)
        if device.type == "cuda":
            perm, inv = (x.pin_memory().to(device, non_blocking=True) for x in (perm, inv))
        else:
            perm, inv = perm.to(device), inv.to(device)
        cache[key] = (perm, inv)
    return cache[key]


def _order(ranks: list[int]) -> list[int]:
    """Ring position of each group rank (process groups order ranks ascending)."""
    return [ranks.index(r) for r in sorted(ranks)]


def _a2a(pieces: list[torch.Tensor], recv_numel: list[int], order: list[int], pg) -> list[torch.Tensor]:
    """All-to-all of flat pieces indexed by ring position; returns the received flat pieces."""
    import torch.distributed as dist

    send = torch.cat([pieces[j].reshape(-1) for j in order])
    recv = send.new_empty(sum(recv_numel[j] for j in order))
    dist.all_to_all_single(recv, send, [recv_numel[j] for j in order], [pieces[j].numel() for j in order],
                           group=pg)
    out: list[torch.Tensor] = [None] * len(order)  # type: ignore[list-item]
    o = 0
    for j in order:
        out[j] = recv[o: o + recv_numel[j]]
        o += recv_numel[j]
    return out


class _Ctx:
    """Everything both all-to-all directions need (shapes per position)."""

    def __init__(self, spec: UlyssesSpec, hq: int, hkv: int, D: int, pg) -> None:
        self.spec, self.pg, self.D = spec, pg, D
        self.heads = head_split(hq, hkv, spec.size)
        self.order = _order(spec.ranks)
        self.rows = [spec.rows(j) for j in range(spec.size)]
        self.hq, self.hkv = hq, hkv


def _s2h(ctx: _Ctx, q, k, v):
    """Sequence-sharded q/k/v -> this position's heads of every row of the group (by position)."""
    p, D = ctx.spec.pos, ctx.D
    q0, q1, k0, k1 = ctx.heads[p]
    pieces, numel = [], []
    for j, (a, b, c, d) in enumerate(ctx.heads):
        pieces.append(torch.cat([q[:, a:b].reshape(-1), k[:, c:d].reshape(-1), v[:, c:d].reshape(-1)]))
        numel.append(ctx.rows[j] * ((q1 - q0) + 2 * (k1 - k0)) * D)
    got = _a2a(pieces, numel, ctx.order, ctx.pg)
    qs, ks, vs = [], [], []
    for j, flat in enumerate(got):
        n = ctx.rows[j]
        a, b = n * (q1 - q0) * D, n * (k1 - k0) * D
        qs.append(flat[:a].view(n, q1 - q0, D))
        ks.append(flat[a:a + b].view(n, k1 - k0, D))
        vs.append(flat[a + b:].view(n, k1 - k0, D))
    return torch.cat(qs), torch.cat(ks), torch.cat(vs)


def _s2h_backward(ctx: _Ctx, dq, dk, dv):
    """Gradients of :func:`_s2h`: send each position's head gradients back, sum replicated KV heads."""
    p, D = ctx.spec.pos, ctx.D
    q0, q1, k0, k1 = ctx.heads[p]
    off = [0]
    for n in ctx.rows:
        off.append(off[-1] + n)
    pieces, numel = [], []
    for j, (a, b, c, d) in enumerate(ctx.heads):
        s, e = off[j], off[j + 1]
        pieces.append(torch.cat([dq[s:e].reshape(-1), dk[s:e].reshape(-1), dv[s:e].reshape(-1)]))
        numel.append(ctx.rows[p] * ((b - a) + 2 * (d - c)) * D)
    got = _a2a(pieces, numel, ctx.order, ctx.pg)
    n = ctx.rows[p]
    gq = dq.new_zeros((n, ctx.hq, D))
    gk = dq.new_zeros((n, ctx.hkv, D))
    gv = dq.new_zeros((n, ctx.hkv, D))
    for j, flat in enumerate(got):
        a, b, c, d = ctx.heads[j]
        x, y = n * (b - a) * D, n * (d - c) * D
        gq[:, a:b] += flat[:x].view(n, b - a, D)
        gk[:, c:d] += flat[x:x + y].view(n, d - c, D)
        gv[:, c:d] += flat[x + y:].view(n, d - c, D)
    return gq, gk, gv


def _h2s(ctx: _Ctx, o):
    """This position's heads of O for every row (by position) -> all heads of my rows."""
    p, D = ctx.spec.pos, ctx.D
    off = [0]
    for n in ctx.rows:
        off.append(off[-1] + n)
    pieces = [o[off[j]:off[j + 1]].reshape(-1) for j in range(ctx.spec.size)]
    n = ctx.rows[p]
    numel = [n * (b - a) * D for a, b, _, _ in ctx.heads]
    got = _a2a(pieces, numel, ctx.order, ctx.pg)
    out = o.new_empty((n, ctx.hq, D))
    for j, flat in enumerate(got):
        a, b = ctx.heads[j][:2]
        out[:, a:b] = flat.view(n, b - a, D)
    return out


def _h2s_backward(ctx: _Ctx, dout):
    p, D = ctx.spec.pos, ctx.D
    q0, q1 = ctx.heads[p][:2]
    pieces = [dout[:, a:b].reshape(-1) for a, b, _, _ in ctx.heads]
    numel = [ctx.rows[j] * (q1 - q0) * D for j in range(ctx.spec.size)]
    got = _a2a(pieces, numel, ctx.order, ctx.pg)
    return torch.cat([flat.view(ctx.rows[j], q1 - q0, D) for j, flat in enumerate(got)])


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, ctx: _Ctx):
        fctx.c = ctx
        return _s2h(ctx, q.contiguous(), k.contiguous(), v.contiguous())

    @staticmethod
    def backward(fctx, dq, dk, dv):
        gq, gk, gv = _s2h_backward(fctx.c, dq.contiguous(), dk.contiguous(), dv.contiguous())
        return gq, gk, gv, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, o, ctx: _Ctx):
        fctx.c = ctx
        return _h2s(ctx, o.contiguous())

    @staticmethod
    def backward(fctx, dout):
        return _h2s_backward(fctx.c, dout.contiguous()), None


def expand_kv(kf, vf, ctx: _Ctx):
    """This position's K/V heads for its query heads: as received when the query heads cover whole
    KV groups or all use one KV head (GQA as is: a replicated KV head stays one head, so a usp
    ring moves and the attention keeps one head's K/V), else one KV head per query head (a split
    through several KV groups)."""
    q0, q1, k0, k1 = ctx.heads[ctx.spec.pos]
    r = ctx.hq // ctx.hkv
    if (q0 % r == 0 and q1 % r == 0) or k1 - k0 == 1:
        return kf, vf
    idx = torch.arange(q0, q1, device=kf.device) // r - k0
    return kf.index_select(1, idx), vf.index_select(1, idx)


def ulysses_attention(q, k, v, spec: UlyssesSpec, group=None, scale: float | None = None,
                      window: int | None = None):
    """Causal attention of a Ulysses group's sequences from sequence-sharded ``q [T, Hq, D]``,
    ``k, v [T, Hkv, D]`` (``T = spec.rows(spec.pos)``, sequences in ``spec.seqs`` order, ranges in
    listed order); returns ``[T, Hq, D]``. Differentiable; ``group``: the process group of
    ``spec.ranks`` (looked up in the default GroupCache when omitted)."""
    G = spec.size
    T = spec.rows(spec.pos)
    if q.shape[0] != T or k.shape[0] != T or v.shape[0] != T:
        raise ValueError(f"Ulysses position {spec.pos} holds {T} tokens, got q/k/v with "
                         f"{q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows")
    hq, hkv, D = q.shape[1], k.shape[1], q.shape[2]
    if G == 1:
        perm, inv = _perms(spec, q.device)
        o = local_attention(q[perm], k[perm], v[perm], spec.cu_seqlens(), scale, window)
        return o[inv]
    if group is None:
        from ..groups import get_group

        group = get_group(spec.ranks)
    ctx = _Ctx(spec, hq, hkv, D, group)
    qg, kg, vg = _SeqToHead.apply(q, k, v, ctx)
    perm, inv = _perms(spec, q.device)
    qf, kf, vf = qg[perm], kg[perm], vg[perm]
    q0, q1, k0, k1 = ctx.heads[spec.pos]
    if q1 == q0:
        # no query head here: relay only, but keep k/v in the graph so the backward all-to-all runs
        of = qf + (kf.sum() + vf.sum()) * 0
    else:
        ke, ve = expand_kv(kf, vf, ctx)
        of = local_attention(qf, ke, ve, spec.cu_seqlens(), scale, window)
    og = of[inv]
    return _HeadToSeq.apply(og, ctx)
