"""Ring attention: exact causal attention over a group of ranks that each hold part of the same
sequences (zigzag chunks, or any disjoint ranges), forward and backward.

K/V blocks travel around the ring (position p sends to p+1), the next exchange is posted before
the current block is computed (so communication overlaps compute), and partial results are merged
by log-sum-exp (:func:`.merge.merge_partial`) in float32 accumulators whatever the input dtype. In
backward dQ accumulates locally in float32 and the dK/dV accumulators travel with their K/V block,
in float32, returning to their owner after the last round. Transfers go through a
:class:`.transport.Transport` (inter-node routes, byte counters). A one-rank ring is local
attention of the rank's own sequences through the same code.

Nothing on this path reads a device value on the host (``.item()``, ``.tolist()``,
``int(tensor)``); see tests/test_kernels.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import kernels as _k
from .blocks import attention_block, attention_block_backward, block_kind
from .merge import merge_partial, new_accumulators, out_lse_function
from .transport import Transport

__all__ = ["RingSpec", "ring_attention", "ring_backward", "ring_forward", "ring_relay_backward",
           "ring_relay_forward"]


@dataclass
class RingSpec:
    """A ring group as seen by one rank.

    ``ranks``: global ranks in ring order; ``pos``: my position (None for a relay-only proxy);
    ``seqs``: per sequence of the group, its ``[start, end)`` ranges per ring position
    (``Placement.ranges``). A position's rows are its ranges of each sequence, sequences in the
    listed order, ranges in listed order."""

    ranks: list[int]
    pos: int | None
    seqs: list[list[list[list[int]]]]
    #: sliding-window attention (a query at q sees keys ``q - w < k <= q``); None: full causal
    window: int | None = None
    _rows: list[int] = field(default_factory=list, init=False, repr=False)
    _last: list[int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        g = len(self.ranks)
        for i, s in enumerate(self.seqs):
            if len(s) != g:
                raise ValueError(f"sequence {i} of the ring has ranges for {len(s)} positions, ring has {g}")
        self._rows = [sum(max(0, e - b) for s in self.seqs for b, e in s[j]) for j in range(g)]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rows(self, j: int) -> int:
        return self._rows[j]

    def segments(self, j: int) -> list[tuple[int, int, int, int]]:
        """``(seq_index, row_offset, start, end)`` of position j's rows."""
        out, off = [], 0
        for si, s in enumerate(self.seqs):
            for b, e in s[j]:
                if e > b:
                    out.append((si, off, b, e))
                    off += e - b
        return out

    def pairs(self, p: int, j: int) -> list[tuple[int, int, int, int, tuple[int, int], tuple[int, int]]]:
        """Chunk pairs (q rows of position p) x (k rows of position j) with visible keys:
        ``(q0, q1, k0, k1, q_range, k_range)``."""
        ks_by_seq: dict[int, list[tuple[int, int, int, int]]] = {}
        for seg in self.segments(j):
            ks_by_seq.setdefault(seg[0], []).append(seg)
        out = []
        for si, qo, qs, qe in self.segments(p):
            for _, ko, ks, ke in ks_by_seq.get(si, ()):
                if block_kind((qs, qe), (ks, ke), self.window) != "skip":
                    out.append((qo, qo + qe - qs, ko, ko + ke - ks, (qs, qe), (ks, ke)))
        return out

    def transfers(self, r: int) -> list[tuple[int, int, int]]:
        """Round r: position i sends the block it holds (owner (i - r) mod G) to position i+1."""
        g = self.size
        return [(self.ranks[i], self.ranks[(i + 1) % g], self._rows[(i - r) % g]) for i in range(g)]

    def last_round(self, owner: int) -> int:
        """The last round in which some position computes on ``owner``'s K/V block: G - 1 for full
        causal attention (the block goes all the way round); with a window, the block stops at
        the last position that still sees some of it (0: nobody else needs it)."""
        if self._last is None:
            g = self.size
            if self.window is None:
                self._last = [g - 1] * g
            else:
                self._last = [max((r for r in range(1, g) if self.pairs((o + r) % g, o)), default=0)
                              for o in range(g)]
        return self._last[owner]

    def kv_transfers(self, r: int) -> list[tuple[int, int, int]]:
        """The K/V blocks round r passes on: each while a later position still needs it."""
        g = self.size
        if self.window is None:
            return self.transfers(r)
        return [(self.ranks[i], self.ranks[(i + 1) % g], self._rows[(i - r) % g]) for i in range(g)
                if r < self.last_round((i - r) % g)]

    def dkv_transfers(self, r: int) -> list[tuple[int, int, int]]:
        """Backward, round r: the dK/dV accumulators that travel on with their block. Full causal
        attention: the owner's own share travels too and comes back after G rounds. With a window
        the owner keeps its share; the others' start at round 1 and come back from the block's
        last round (:meth:`return_transfers`)."""
        if r >= self.size - 1 or (self.window is not None and r == 0):
            return []
        return self.kv_transfers(r)

    def return_transfers(self, r: int) -> list[tuple[int, int, int]]:
        """Backward, round r: the dK/dV accumulators whose block's last round is r, sent back to
        their owner (full causal attention: round G - 1, to the next position, which is the owner)."""
        g = self.size
        out = []
        for i in range(g):
            o = (i - r) % g
            if r > 0 and r == self.last_round(o):
                out.append((self.ranks[i], self.ranks[o], self._rows[o]))
        return out


def _pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.stack([k, v], 1).contiguous()  # [T, 2, Hkv, D]


def _send_kv(transport: Transport, spec: RingSpec, r: int, kv):
    """Round ``r``'s K/V exchange, started (None after the last round, which sends nothing)."""
    if r >= spec.size - 1:
        return None
    return transport.exchange(spec.kv_transfers(r), kv, kv.shape[1:], kv.dtype, kv.device).start()


def ring_forward(q, k, v, spec: RingSpec, transport: Transport, scale: float | None = None, idle=None):
    """No-autograd ring attention forward: ``(out in q.dtype, lse [Hq, T] fp32)``.

    ``idle``: optional filler called while a K/V exchange is still in flight (see
    :meth:`.transport.Exchange.finish`)."""
    sc = _k.default_scale(q, scale)
    g, p = spec.size, spec.pos
    if q.shape[0] != spec.rows(p) or k.shape[0] != spec.rows(p):
        raise ValueError(f"ring position {p} holds {spec.rows(p)} rows, got q {q.shape[0]} / k {k.shape[0]}")
    out, lse = new_accumulators(q)
    kv = _pack_kv(k, v)
    row_shape = kv.shape[1:]
    for r in range(g):
        j = (p - r) % g
        ex = _send_kv(transport, spec, r, kv)
        for q0, q1, k0, k1, qr, kr in spec.pairs(p, j):
            o_b, l_b = attention_block(q[q0:q1], kv[k0:k1, 0], kv[k0:k1, 1], qr, kr, sc, spec.window)
            merge_partial(out[q0:q1], lse[:, q0:q1], o_b, l_b)
        if ex is not None:
            nxt = ex.finish(idle)
            kv = nxt if nxt is not None else kv.new_zeros((0, *row_shape))
    return out.to(q.dtype), lse


def ring_backward(
    dout, q, k, v, out, lse, spec: RingSpec, transport: Transport, scale: float | None = None, idle=None
):
    """No-autograd ring attention backward from the merged ``out``/``lse``: ``(dq, dk, dv)``
    in the input dtype; accumulation in float32, dK/dV accumulators travel in float32."""
    sc = _k.default_scale(q, scale)
    g, p = spec.size, spec.pos
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = _pack_kv(k, v)
    row_shape = kv.shape[1:]
    exd = None
    dkv = None
    own = None  # this position's own block's accumulator when nobody else computes on it
    returns = []
    for r in range(g):
        j = (p - r) % g
        exkv = _send_kv(transport, spec, r, kv)
        dkv = torch.zeros((spec.rows(j), *row_shape), dtype=torch.float32, device=q.device)
        for q0, q1, k0, k1, qr, kr in spec.pairs(p, j):
            a, b, c = attention_block_backward(
                dout[q0:q1], q[q0:q1], kv[k0:k1, 0], kv[k0:k1, 1], out[q0:q1], lse[:, q0:q1], qr, kr, sc, spec.window
            )
            dq[q0:q1] += a.float()
            dkv[k0:k1, 0] += b.float()
            dkv[k0:k1, 1] += c.float()
        if exd is not None:
            got = exd.finish(idle)
            if got is not None:
                dkv += got
        if r == 0:
            own = dkv
        if g > 1:
            exd = transport.exchange(spec.dkv_transfers(r), dkv, row_shape, torch.float32, q.device).start()
            returns.append(transport.exchange(spec.return_transfers(r), dkv, row_shape, torch.float32,
                                              q.device).start())
        if exkv is not None:
            nxt = exkv.finish(idle)
            kv = nxt if nxt is not None else kv.new_zeros((0, *row_shape))
    if exd is not None:
        exd.finish(idle)
    back = None
    for ex in returns:
        got = ex.finish(idle)
        if got is not None:
            back = got
    if spec.window is not None:  # the owner's own share, plus the others' when they come back
        dkv = own if back is None else own + back
    elif back is not None:
        dkv = back
    elif g > 1:
        dkv = torch.zeros((0, *row_shape), dtype=torch.float32, device=q.device)
    return dq.to(q.dtype), dkv[:, 0].to(k.dtype), dkv[:, 1].to(v.dtype)


def ring_relay_forward(spec: RingSpec, transport: Transport, row_shape, dtype, device, idle=None) -> None:
    """A proxy that is not a ring member: take part in the forward exchanges of the ring (same
    call sequence as :func:`ring_forward`, no compute)."""
    for r in range(spec.size - 1):
        transport.exchange(spec.kv_transfers(r), None, row_shape, dtype, device).start().finish(idle)


def ring_relay_backward(spec: RingSpec, transport: Transport, row_shape, dtype, device, idle=None) -> None:
    """Relay-only counterpart of :func:`ring_backward` (same exchange call sequence)."""
    g = spec.size
    exd = None
    returns = []
    for r in range(g):
        exkv = (
            transport.exchange(spec.kv_transfers(r), None, row_shape, dtype, device).start()
            if r < g - 1
            else None
        )
        if exd is not None:
            exd.finish(idle)
        if g > 1:
            exd = transport.exchange(spec.dkv_transfers(r), None, row_shape, torch.float32, device).start()
            returns.append(transport.exchange(spec.return_transfers(r), None, row_shape, torch.float32,
                                              device).start())
        if exkv is not None:
            exkv.finish(idle)
    if exd is not None:
        exd.finish(idle)
    for ex in returns:
        ex.finish(idle)


_RingAttention = out_lse_function("_RingAttention", ring_forward, ring_backward)


def ring_attention(q, k, v, ring: RingSpec, transport: Transport | None = None, scale: float | None = None):
    """Exact ring attention over ``ring`` (autograd-capable). ``q/k/v`` are this rank's rows
    (see :class:`RingSpec`). All ring members must call it together."""
    if ring.pos is None:
        raise ValueError("ring_attention needs a ring member (pos is None)")
    return _RingAttention.apply(q, k, v, ring, transport or Transport(), scale)
