"""2-D sequence parallelism (``usp`` groups): Ulysses inside each row, a ring across the rows.

A usp group of shape ``(u, r)`` lists its ``u * r`` units row by row: position ``p = i*u + j`` is
row ``i`` (ring position ``i``), Ulysses position ``j``. Row ``i`` together holds ring position
``i``'s share of every sequence of the group (zigzag: chunks ``i`` and ``2r-1-i`` of ``2r``, or a
contiguous chunk; any disjoint cover works), each of its ``u`` positions a part of it
(:func:`zeppelin.schemas.layout.usp_ranges`). Attention of one rank:

1. the row's all-to-all (:mod:`.ulysses`: one collective on the row's process group) turns the
   row's sequence shards into head shards — position ``j`` then holds *all* of the row's tokens
   for its query heads and the KV heads they use (replicated when ``u`` exceeds the KV heads);
2. ring attention (:mod:`.ring`) over column ``j`` — the ``r`` ranks of Ulysses position ``j`` in
   every row, which hold the same heads — on the row's tokens in ring order (sequence, then
   token position), windowed layers exactly as rings handle them; only ``1/u`` of the heads'
   K/V travels per hop;
3. the row's all-to-all back to the sequence shards.

Backward runs the same three steps in reverse through autograd; the all-to-all's backward sums the
gradients of replicated KV heads back to the positions that own their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zeppelin.schemas.layout import merged_ranges

from .ring import RingSpec, ring_attention
from .transport import Transport
from .ulysses import _Ctx, _HeadToSeq, _SeqToHead, expand_kv

__all__ = ["UspSpec", "usp_attention"]


@dataclass
class _Row:
    """The part of a usp group one all-to-all serves (what :class:`.ulysses._Ctx` reads)."""

    ranks: list[int]
    pos: int
    seqs: list[list[list[list[int]]]]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rows(self, j: int) -> int:
        return sum(e - s for per_pos in self.seqs for s, e in per_pos[j])


@dataclass
class UspSpec:
    """One usp group as seen from one rank: ``ranks`` (row by row), ``shape = (u, r)``, ``pos``
    (mine), ``seqs``: per sequence of the group (placement order), per position, its ranges;
    ``window``: sliding window of the layers served (None: full causal)."""

    ranks: list[int]
    shape: tuple[int, int]
    pos: int
    seqs: list[list[list[list[int]]]]
    window: int | None = None
    row: _Row = field(init=False)
    ring: RingSpec = field(init=False)

    def __post_init__(self) -> None:
        u, r = self.shape
        if u * r != len(self.ranks) or not 0 <= self.pos < u * r:
            raise ValueError(f"usp position {self.pos} / shape {self.shape} does not fit {len(self.ranks)} ranks")
        for n, per_pos in enumerate(self.seqs):
            if len(per_pos) != u * r:
                raise ValueError(f"sequence {n} of the usp group has ranges for {len(per_pos)} positions, "
                                 f"group has {u * r}")
        i, j = divmod(self.pos, u)
        self.row = _Row(self.ranks[i * u:(i + 1) * u], j, [per_pos[i * u:(i + 1) * u] for per_pos in self.seqs])
        chunks = [[merged_ranges(rg for p in per_pos[a * u:(a + 1) * u] for rg in p) for a in range(r)]
                  for per_pos in self.seqs]
        self.ring = RingSpec(ranks=self.ranks[j::u], pos=i, seqs=chunks, window=self.window)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def peers(self) -> set[int]:
        """The ranks this position exchanges with: its row and its ring neighbours."""
        ring = self.ring.ranks
        near = {ring[(self.ring.pos + d) % len(ring)] for d in (-1, 1)} if len(ring) > 1 else set()
        return (set(self.row.ranks) | near) - {self.ranks[self.pos]}

    def rows(self, p: int) -> int:
        return sum(e - s for per_pos in self.seqs for s, e in per_pos[p])

    def ring_perm(self) -> torch.Tensor:
        """``perm`` with ``ring_rows = gathered[perm]``: the all-to-all's rows (by row position,
        sequence, range) in the ring's order (sequence, then token position)."""
        segs = {}
        for si, off, s, e in self.ring.segments(self.ring.pos):
            segs.setdefault(si, []).append((s, e, off))
        dest = []
        for jj in range(self.row.size):
            for si, per_pos in enumerate(self.row.seqs):
                for a, b in per_pos[jj]:
                    if b > a:
                        s, _, off = next(x for x in segs[si] if x[0] <= a < x[1])
                        dest.append(torch.arange(off + a - s, off + b - s))
        dest_t = torch.cat(dest) if dest else torch.empty(0, dtype=torch.long)
        perm = torch.empty_like(dest_t)
        perm[dest_t] = torch.arange(dest_t.numel())
        return perm


def usp_attention(q, k, v, spec: UspSpec, group=None, transport: Transport | None = None,
                  scale: float | None = None):
    """Causal attention of a usp group's sequences from this position's sequence shards ``q [T, Hq,
    D]``, ``k, v [T, Hkv, D]`` (``T = spec.rows(spec.pos)``, sequences in ``spec.seqs`` order, ranges
    in listed order); returns ``[T, Hq, D]``. Differentiable. ``group``: the process group of the
    row's ranks (looked up in the default GroupCache when omitted); ``transport``: the ring's."""
    T = spec.rows(spec.pos)
    if q.shape[0] != T or k.shape[0] != T or v.shape[0] != T:
        raise ValueError(f"usp position {spec.pos} holds {T} tokens, got q/k/v with "
                         f"{q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows")
    hq, hkv, D = q.shape[1], k.shape[1], q.shape[2]
    u = spec.shape[0]
    if hq % u:
        raise ValueError(f"a usp row of {u} positions needs query heads divisible by {u}, got {hq}")
    transport = transport or Transport()
    perm = spec.__dict__.setdefault("_perm", {}).get(str(q.device))
    if perm is None:
        perm = spec.ring_perm().to(q.device)
        spec.__dict__["_perm"][str(q.device)] = perm
    if u == 1:
        qf, kf, vf = q[perm], k[perm], v[perm]
        return ring_attention(qf, kf, vf, spec.ring, transport, scale)[torch.argsort(perm)]
    if group is None:
        from ..groups import get_group

        group = get_group(spec.row.ranks)
    ctx = _Ctx(spec.row, hq, hkv, D, group)
    qg, kg, vg = _SeqToHead.apply(q, k, v, ctx)
    qf, kf, vf = qg[perm], kg[perm], vg[perm]
    ke, ve = expand_kv(kf, vf, ctx)
    of = ring_attention(qf, ke, ve, spec.ring, transport, scale)
    return _HeadToSeq.apply(of[torch.argsort(perm)], ctx)
