"""Remap: autograd-aware variable-size all-to-all between the attention and the linear layout.

A micro-batch with a ``linear_layout`` holds its tokens in two layouts (``zeppelin.schemas.plan``):
the *attention buffer* of unit ``u`` is ``mb.attention_segments(u)`` (cost-balanced, ∝ L²) and its
*linear buffer* is ``mb.linear_segments(u)`` (token-balanced). Both cover every token of the
micro-batch exactly once, so converting one into the other is a permutation of rows across units.

:class:`Remapper` computes that permutation from the plan alone — the same computation on every
rank, so both sides of every transfer agree on what moves without exchanging metadata:

* the two layouts are cut into *pieces* (maximal token runs of one sequence that sit in one unit's
  attention buffer and one unit's linear buffer);
* for each (source unit, destination unit) pair the pieces are ordered by their row in the
  destination buffer; the sender packs them in that order into one message, the receiver unpacks
  them in the same order;
* messages travel point-to-point on GLOBAL ranks (``dist.batch_isend_irecv``, peers in ascending
  rank order, send before receive), only between pairs that exchange tokens; rows that stay on the
  unit are copied locally. Every work handle is waited on; receive buffers are fresh tensors.

The backward of a remap is the inverse permutation (gradients travel back the way the rows came),
so ``to_linear`` and ``to_attention`` are one autograd Function with the two directions swapped.

Tensor parallelism: a unit of ``tp`` ranks holds its buffers replicated on each of them; TP rank
``t`` of a unit exchanges with TP rank ``t`` of the other units. Remapping between units of
different TP degree is refused (Hydraulis plans carry no linear layout).

Byte counters (``Remapper.stats``): bytes *sent* by this rank per link class — ``intra`` (same node
of the plan's cluster) or ``inter`` — forward and backward together, plus ``tokens_sent``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeppelin.schemas.common import InputError
from zeppelin.schemas.plan import PlanHeader, StepPlan

__all__ = ["Remapper", "remap_pieces", "RemapPiece"]


@dataclass(frozen=True)
class RemapPiece:
    """Tokens ``start..end-1`` of sequence ``seq``: rows ``src_row..`` of unit ``src``'s attention
    buffer and rows ``dst_row..`` of unit ``dst``'s linear buffer."""

    seq: int
    start: int
    end: int
    src: int
    src_row: int
    dst: int
    dst_row: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


Runs = dict[int, list[tuple[int, int, int, int]]]


def _layout_runs(segments_per_unit: list[list[list[int]]]) -> tuple[Runs, list[int]]:
    """Per sequence: sorted runs (start, end, unit, row); and the buffer size of each unit."""
    runs: dict[int, list[tuple[int, int, int, int]]] = {}
    sizes = []
    for u, segs in enumerate(segments_per_unit):
        row = 0
        for seq, s, e in segs:
            if e > s:
                runs.setdefault(seq, []).append((s, e, u, row))
                row += e - s
        sizes.append(row)
    for v in runs.values():
        v.sort()
    return runs, sizes


def remap_pieces(attention: list[list[list[int]]], linear: list[list[list[int]]],
                 where: str = "") -> list[RemapPiece]:
    """Intersect two layouts (per unit lists of ``[seq, start, end]``) into pieces.

    Raises :class:`InputError` when the layouts do not hold the same tokens.
    """
    a_runs, a_sizes = _layout_runs(attention)
    l_runs, l_sizes = _layout_runs(linear)
    if sorted(a_runs) != sorted(l_runs):
        only = sorted(set(a_runs) ^ set(l_runs))
        raise InputError(f"{where}remap: sequence {only[0]} is in only one of the attention and "
                         "linear layouts")
    pieces: list[RemapPiece] = []
    for seq in sorted(a_runs):
        A, L = a_runs[seq], l_runs[seq]
        i = j = 0
        pos = None
        while i < len(A) and j < len(L):
            a, l_ = A[i], L[j]
            s = max(a[0], l_[0])
            e = min(a[1], l_[1])
            if s >= e or (pos is not None and s != pos):
                raise InputError(
                    f"{where}remap: attention and linear layouts of sequence {seq} cover different tokens "
                    f"(attention {a[0]}..{a[1] - 1}, linear {l_[0]}..{l_[1] - 1})")
            pieces.append(RemapPiece(seq, s, e, a[2], a[3] + s - a[0], l_[2], l_[3] + s - l_[0]))
            pos = e
            if a[1] == e:
                i += 1
            if l_[1] == e:
                j += 1
        if i != len(A) or j != len(L) or A[0][0] != L[0][0]:
            raise InputError(f"{where}remap: attention and linear layouts of sequence {seq} cover "
                             "different tokens")
        for runs in (A, L):
            for x, y in zip(runs, runs[1:]):
                if x[1] != y[0]:
                    raise InputError(f"{where}remap: sequence {seq} is not covered contiguously "
                                     f"(tokens {x[1]}..{y[0] - 1} missing or repeated)")
    if sum(a_sizes) != sum(l_sizes):
        raise InputError(f"{where}remap: the attention layout holds {sum(a_sizes)} tokens, the linear layout "
                         f"{sum(l_sizes)}")
    return pieces


@dataclass
class _Direction:
    """What one rank sends and receives for one direction of the remap (index tensors on rows)."""

    in_rows: int
    out_rows: int
    sends: list[tuple[int, object]] = field(default_factory=list)   # (peer rank, row index of input)
    recvs: list[tuple[int, object]] = field(default_factory=list)   # (peer rank, row index of output)
    local_src: object = None
    local_dst: object = None
    peer_class: dict[int, str] = field(default_factory=dict)

    def run(self, x, stats: dict):
        import torch
        import torch.distributed as dist

        if x.shape[0] != self.in_rows:
            raise RuntimeError(f"remap: input has {x.shape[0]} rows, the plan's layout has {self.in_rows}")
        x = x.contiguous()
        out = x.new_empty((self.out_rows, *x.shape[1:]))
        ops, recv_bufs = [], []
        sends = dict(self.sends)
        recvs = dict(self.recvs)
        for peer in sorted(set(sends) | set(recvs)):
            if peer in sends:
                buf = x.index_select(0, sends[peer])
                ops.append(dist.P2POp(dist.isend, buf, peer))
                nb = buf.numel() * buf.element_size()
                stats[self.peer_class[peer]] = stats.get(self.peer_class[peer], 0) + nb
                stats["tokens_sent"] = stats.get("tokens_sent", 0) + buf.shape[0]
            if peer in recvs:
                rb = torch.empty((recvs[peer].numel(), *x.shape[1:]), dtype=x.dtype, device=x.device)
                ops.append(dist.P2POp(dist.irecv, rb, peer))
                recv_bufs.append((recvs[peer], rb))
        works = dist.batch_isend_irecv(ops) if ops else []
        if self.local_src is not None:
            out.index_copy_(0, self.local_dst, x.index_select(0, self.local_src))
        for w in works:
            w.wait()
        for idx, rb in recv_bufs:
            out.index_copy_(0, idx, rb)
        return out


def _make_fn():
    import torch

    class _RemapFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fwd: _Direction, bwd: _Direction, stats: dict):
            ctx.bwd, ctx.stats = bwd, stats
            return fwd.run(x, stats)

        @staticmethod
        def backward(ctx, g):
            return ctx.bwd.run(g, ctx.stats), None, None, None

    return _RemapFn


_FN = None


class Remapper:
    """Converts activations of one micro-batch between its attention and its linear layout.

    ``to_linear(x_attn) -> x_linear`` and ``to_attention(x_linear) -> x_attn`` take ``[T, ...]``
    tensors (rows = tokens of this unit's buffer) and are differentiable. When the micro-batch has
    no linear layout both are the identity (``enabled`` is False).
    """

    def __init__(self, header: PlanHeader, step: StepPlan, mb_index: int, rank: int, device=None):
        import torch

        if not 0 <= mb_index < len(step.microbatches):
            raise InputError(f"step {step.step}: micro-batch {mb_index} does not exist "
                             f"(step has {len(step.microbatches)})")
        mb = step.microbatches[mb_index]
        reps = header.replicas(step)
        where = f"step {step.step} microbatch {mb_index}: "
        me = [(u, rep.ranks.index(rank)) for u, rep in enumerate(reps) if rank in rep.ranks]
        if not me:
            raise InputError(f"{where}rank {rank} belongs to no replica of the plan")
        self.unit, self.tp_index = me[0]
        self.rank = rank
        self.stats: dict[str, int] = {"intra": 0, "inter": 0, "tokens_sent": 0}
        self.enabled = mb.linear_layout is not None
        att = [mb.attention_segments(u) for u in range(len(reps))]
        lin = [mb.linear_segments(u) for u in range(len(reps))]
        self.attention_rows = sum(e - s for _, s, e in att[self.unit])
        self.linear_rows = sum(e - s for _, s, e in lin[self.unit])
        self.pieces: list[RemapPiece] = []
        if not self.enabled:
            return
        self.pieces = remap_pieces(att, lin, where)
        my_tp = reps[self.unit].tp
        cluster = header.cluster
        for p in self.pieces:
            if p.src != p.dst and (self.unit in (p.src, p.dst)) and reps[p.src].tp != reps[p.dst].tp:
                raise InputError(f"{where}remap between units {p.src} and {p.dst} of different "
                                 f"tensor-parallel degree ({reps[p.src].tp} and {reps[p.dst].tp}) "
                                 "is not supported")

        def peer_rank(u: int) -> int:
            return reps[u].ranks[self.tp_index] if reps[u].tp == my_tp else reps[u].ranks[0]

        def cls(peer: int) -> str:
            return "intra" if cluster.node_of(peer) == cluster.node_of(rank) else "inter"

        dev = device if device is not None else "cpu"

        def idx(rows: list[tuple[int, int]]):
            if not rows:
                return torch.empty(0, dtype=torch.long, device=dev)
            return torch.cat([torch.arange(s, s + n, dtype=torch.long) for s, n in rows]).to(dev)

        def direction(src_of, src_row_of, dst_of, dst_row_of, in_rows, out_rows) -> _Direction:
            d = _Direction(in_rows=in_rows, out_rows=out_rows)
            send: dict[int, list[tuple[int, int, int]]] = {}
            recv: dict[int, list[tuple[int, int]]] = {}
            loc: list[tuple[int, int, int]] = []
            for p in self.pieces:
                s, t = src_of(p), dst_of(p)
                if s == self.unit and t == self.unit:
                    loc.append((dst_row_of(p), src_row_of(p), p.tokens))
                elif s == self.unit:
                    send.setdefault(t, []).append((dst_row_of(p), src_row_of(p), p.tokens))
                elif t == self.unit:
                    recv.setdefault(s, []).append((dst_row_of(p), p.tokens))
            for t, lst in sorted(send.items()):
                lst.sort()
                pr = peer_rank(t)
                d.sends.append((pr, idx([(sr, n) for _, sr, n in lst])))
                d.peer_class[pr] = cls(pr)
            for s, lst in sorted(recv.items()):
                lst.sort()
                pr = peer_rank(s)
                d.recvs.append((pr, idx(lst)))
                d.peer_class[pr] = cls(pr)
            if loc:
                loc.sort()
                d.local_dst = idx([(dr, n) for dr, _, n in loc])
                d.local_src = idx([(sr, n) for _, sr, n in loc])
            return d

        self._a2l = direction(lambda p: p.src, lambda p: p.src_row, lambda p: p.dst, lambda p: p.dst_row,
                              self.attention_rows, self.linear_rows)
        self._l2a = direction(lambda p: p.dst, lambda p: p.dst_row, lambda p: p.src, lambda p: p.src_row,
                              self.linear_rows, self.attention_rows)

    @property
    def tokens_moved(self) -> int:
        """Tokens of the whole micro-batch that change unit (one direction)."""
        return sum(p.tokens for p in self.pieces if p.src != p.dst)

    def _apply(self, x, fwd: _Direction, bwd: _Direction):
        global _FN
        if _FN is None:
            _FN = _make_fn()
        return _FN.apply(x, fwd, bwd, self.stats)

    def to_linear(self, x_attn):
        """Attention-layout rows of this unit -> its linear-layout rows."""
        if not self.enabled:
            return x_attn
        return self._apply(x_attn, self._a2l, self._l2a)

    def to_attention(self, x_linear):
        """Linear-layout rows of this unit -> its attention-layout rows."""
        if not self.enabled:
            return x_linear
        return self._apply(x_linear, self._l2a, self._a2l)
