"""Attention kernels of the runtime: local varlen attention, chunk-pair blocks, exact ring attention.

Layouts (runtime contract): ``q: [T, Hq, D]``, ``k, v: [T, Hkv, D]`` (GQA: ``Hq % Hkv == 0``),
sequences packed along T, causal within each sequence by ABSOLUTE token position, softmax scale
``1/sqrt(D)``. Log-sum-exp tensors are ``[Hq, T]`` float32 (natural log).

Kernels: :mod:`zeppelin.runtime.kernels` picks one per (device, dtype, block kind) — its module
docstring holds the table. In short: CUDA bf16/fp16 diagonal and fully visible blocks and local
varlen attention run on fused kernels (flash-attn's varlen functions, else PyTorch's flash or
memory-efficient ops), local sequences of a rank as ONE varlen call; CPU blocks run on
``aten._scaled_dot_product_flash_attention_for_cpu`` (one call per sequence: the op is not varlen);
float32 math with an explicit mask is the reference and the path for partially visible pairs. Every
fused kernel returns the log-sum-exp and its backward recomputes the probabilities from a *given*
(global) log-sum-exp — what ring attention needs: a block's gradient computed with the merged
output and merged LSE is that block's exact share of the full gradient.

Ring attention (:func:`ring_forward` / :func:`ring_backward`, autograd: :func:`ring_attention`):
K/V blocks travel around the ring (position p sends to p+1), the next exchange is posted before
the current block is computed (so communication overlaps compute), partial results are merged by
log-sum-exp in float32 accumulators whatever the input dtype; in backward dQ accumulates locally
in float32 and the dK/dV accumulators travel with their K/V block, in float32, returning to their
owner after the last round. Transfers go through a :class:`Transport`, which follows inter-node
routes (dispatch to a proxy on the source node, proxy-to-proxy transfer, combine at the
destination) and counts bytes per link class.

Overlap without host syncs: every exchange is a ``batch_isend_irecv`` posted before the block
compute it overlaps. On NCCL the transfers run on the process group's own CUDA streams, which
wait on the compute stream only for the data they send; ``Work.wait()`` makes the compute stream
wait on the transfer's completion event and returns at once (no host block), and ``ready()``
polls that event. Relay stages of routed transfers are chained the same way (stream waits, no
host sync). Nothing on the ring, routing or local paths reads a device value on the host
(``.item()``, ``.tolist()``, ``int(tensor)``): index tensors are built from host ints and copied
through pinned memory without blocking (see tests/test_kernels.py). On gloo ``wait()`` blocks the
host, and queued local work fills the wait (``idle``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import kernels as _k

__all__ = [
    "Exchange",
    "LocalPack",
    "RingSpec",
    "Transport",
    "attention_block",
    "attention_block_backward",
    "flash_attn_available",
    "local_attention",
    "local_backward",
    "local_forward",
    "local_kernel",
    "merge_partial",
    "reference_attention",
    "ring_attention",
    "ring_backward",
    "ring_forward",
    "ring_relay_backward",
    "ring_relay_forward",
]

NEG_INF = float("-inf")


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def flash_attn_available(device: torch.device) -> bool:
    """True when flash-attn's varlen kernels (>= 2.6) serve this device (see :mod:`.kernels`)."""
    return device.type == "cuda" and _k.cuda_caps(device).flash_attn


# ---------------------------------------------------------------------------------------------
# kernels (dispatch by device / dtype / block kind: runtime/kernels.py)
# ---------------------------------------------------------------------------------------------

_expand_kv = _k._expand
_math_fwd = _k.math_forward
_math_bwd = _k.math_backward
_causal_mask = _k.causal_mask


def _kernel_fwd(q, k, v, causal: bool, scale: float):
    """One diagonal (``causal``) or fully visible block on the kernel :func:`kernels.choose` picks:
    out in q.dtype (fused kernels) or fp32 (math), lse [H, Tq] fp32."""
    kern = _k.choose(q.device, q.dtype, "diag" if causal else "full", q.shape[-1])
    return _k.block_forward(kern, q, k, v, causal, scale)


def _kernel_bwd(dout, q, k, v, out, lse, causal: bool, scale: float):
    kern = _k.choose(q.device, q.dtype, "diag" if causal else "full", q.shape[-1])
    return _k.block_backward(kern, dout, q, k, v, out, lse, causal, scale)


def _classify(q_range: Sequence[int], k_range: Sequence[int]) -> str:
    """'full' (every key visible), 'diag' (same range, causal), 'skip' (nothing visible), 'mask'."""
    qs, qe = q_range
    ks, ke = k_range
    if qe <= qs or ke <= ks or ks >= qe:
        return "skip"
    if ke <= qs + 1:
        return "full"
    if qs == ks and qe == ke:
        return "diag"
    return "mask"


def attention_block(q, k, v, q_pos_range, k_pos_range, scale: float | None = None):
    """Attention of query rows at absolute positions ``q_pos_range`` over key rows at
    ``k_pos_range`` of the SAME sequence (causal by absolute position).

    Returns ``(out, lse)``: ``out [Tq, Hq, D]`` (q's dtype, or float32 on the math path),
    ``lse [Hq, Tq]`` float32; rows that see no key have ``lse = -inf`` and ``out = 0``.
    """
    sc = _scale(q, scale)
    mode = _classify(q_pos_range, k_pos_range)
    tq = q.shape[0]
    if mode == "skip":
        return (
            torch.zeros_like(q),
            torch.full((q.shape[1], tq), NEG_INF, dtype=torch.float32, device=q.device),
        )
    if mode == "mask":
        mask = _causal_mask(tq, k.shape[0], q_pos_range[0], k_pos_range[0], q.device)
        return _math_fwd(q, k, v, mask, sc)
    return _kernel_fwd(q, k, v, mode == "diag", sc)


def attention_block_backward(dout, q, k, v, out, lse, q_pos_range, k_pos_range, scale: float | None = None):
    """Gradients of one chunk pair given the FINAL (merged) ``out`` and ``lse`` of the query rows:
    returns ``(dq, dk, dv)`` — this block's exact share of the full gradients."""
    sc = _scale(q, scale)
    mode = _classify(q_pos_range, k_pos_range)
    if mode == "skip":
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if mode == "mask":
        mask = _causal_mask(q.shape[0], k.shape[0], q_pos_range[0], k_pos_range[0], q.device)
        return _math_bwd(dout, q, k, v, out, lse, mask, sc)
    return _kernel_bwd(dout, q, k, v, out, lse, mode == "diag", sc)


def merge_partial(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> None:
    """In place: merge a partial result (out_b, lse_b) into float32 accumulators.

    ``out_acc [T, H, D]`` fp32, ``lse_acc [H, T]`` fp32. Handles ``-inf`` (no visible key) on
    either side."""
    new = torch.logaddexp(lse_acc, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    wa = torch.exp(lse_acc - safe).transpose(0, 1).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).transpose(0, 1).unsqueeze(-1)
    out_acc.mul_(wa).add_(out_b.float() * wb)
    lse_acc.copy_(new)


# ---------------------------------------------------------------------------------------------
# local varlen attention (whole sequences)
# ---------------------------------------------------------------------------------------------


def _bounds(cu_seqlens) -> tuple[int, ...]:
    """Cumulative sequence starts as host ints. A device tensor costs a host sync: the runtime
    passes lists (engine, Ulysses); tensors are accepted for callers off the hot path."""
    if isinstance(cu_seqlens, torch.Tensor):
        return tuple(int(x) for x in cu_seqlens.tolist())
    return tuple(int(x) for x in cu_seqlens)


def local_kernel(q: torch.Tensor) -> str:
    """The kernel local varlen attention runs on for ``q``'s device and dtype."""
    return _k.choose(q.device, q.dtype, "varlen", q.shape[-1])


def local_forward(q, k, v, cu_seqlens, scale: float | None = None):
    """No-autograd causal varlen attention: ``(out [T,Hq,D] in q.dtype, lse [Hq,T] fp32)``.

    One varlen kernel call for the whole pack where the device has a varlen kernel (CUDA,
    bf16/fp16); one call per sequence on the CPU kernel and the math path."""
    if q.shape[0] == 0:
        return torch.empty_like(q), torch.empty((q.shape[1], 0), dtype=torch.float32, device=q.device)
    out, lse = _k.varlen_forward(local_kernel(q), q, k, v, _bounds(cu_seqlens), _scale(q, scale))
    return out.to(q.dtype), lse


def local_backward(dout, q, k, v, out, lse, cu_seqlens, scale: float | None = None):
    """Gradients of :func:`local_forward` (same kernel, same call structure), in the input dtype."""
    if q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = _k.varlen_backward(local_kernel(q), dout, q, k, v, out, lse, _bounds(cu_seqlens), _scale(q, scale))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bounds, scale):
        out, lse = local_forward(q, k, v, bounds, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bounds, ctx.scale = bounds, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = local_backward(dout.contiguous(), q, k, v, out, lse, ctx.bounds, ctx.scale)
        return dq, dk, dv, None, None


def local_attention(q, k, v, cu_seqlens, scale: float | None = None):
    """Causal attention over packed whole sequences (autograd-capable).

    ``cu_seqlens``: cumulative sequence starts ``[0, L0, L0+L1, ...]`` (list, or tensor at the
    cost of a host sync). Kernel by device and dtype: :mod:`.kernels` (one varlen call forward and
    one backward on CUDA bf16/fp16)."""
    b = _bounds(cu_seqlens)
    if not b or b[0] != 0 or b[-1] != q.shape[0] or any(y < x for x, y in itertools.pairwise(b)):
        raise ValueError(f"cu_seqlens {list(b[:8])}... does not partition {q.shape[0]} rows")
    return _LocalAttention.apply(q, k, v, b, scale)


class LocalPack:
    """Whole sequences at row ``spans`` of an attention buffer, run as ONE varlen kernel call
    forward and one backward (a rank's local, one-rank-group sequences on a device with a varlen
    kernel: see :func:`LocalPack.of`)."""

    def __init__(self, spans: Sequence[tuple[int, int]], device: torch.device) -> None:
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
    def of(cls, tasks, q: torch.Tensor) -> LocalPack | None:
        """A pack of ``tasks`` ``(row0, row1, spec)`` (one sequence each, one-rank ring specs) when
        ``q``'s device/dtype has a varlen kernel and every sequence's ranges tile it in order;
        None otherwise (the caller then runs a task per sequence)."""
        tasks = list(tasks)
        if not tasks or not _k.has_varlen(q.device, q.dtype, q.shape[-1]):
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
        return cls([(a, b) for a, b, _ in tasks], q.device)

    def forward(self, q, k, v, out, lse, scale: float | None) -> None:
        """Fill ``out``/``lse`` at the pack's rows."""
        r = self.rows
        if isinstance(r, slice):
            o, l_ = local_forward(q[r], k[r], v[r], self.bounds, scale)
            out[r], lse[:, r] = o, l_
        else:
            o, l_ = local_forward(q.index_select(0, r), k.index_select(0, r), v.index_select(0, r),
                                  self.bounds, scale)
            out.index_copy_(0, r, o.to(out.dtype))
            lse.index_copy_(1, r, l_)

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, scale: float | None) -> None:
        """Fill ``dq``/``dk``/``dv`` at the pack's rows from the final ``out``/``lse``."""
        r = self.rows
        if isinstance(r, slice):
            dq[r], dk[r], dv[r] = local_backward(dout[r], q[r], k[r], v[r], out[r], lse[:, r], self.bounds, scale)
        else:
            sel = [x.index_select(0, r) for x in (dout, q, k, v, out)]
            a, b, c = local_backward(*sel, lse.index_select(1, r), self.bounds, scale)
            dq.index_copy_(0, r, a)
            dk.index_copy_(0, r, b)
            dv.index_copy_(0, r, c)


def reference_attention(q, k, v, cu_seqlens, scale: float | None = None):
    """Plain autograd reference (float64-capable): causal attention per sequence by explicit
    softmax — used by tests as the independent ground truth."""
    sc = _scale(q, scale)
    b = _bounds(cu_seqlens)
    hq = q.shape[1]
    outs = []
    for s, e in itertools.pairwise(b):
        qs, ks, vs = q[s:e], _expand_kv(k[s:e], hq), _expand_kv(v[s:e], hq)
        sco = torch.einsum("qhd,khd->hqk", qs, ks) * sc
        m = _causal_mask(e - s, e - s, 0, 0, q.device)
        p = torch.softmax(sco.masked_fill(~m, NEG_INF), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
    return torch.cat(outs, 0) if outs else q.new_zeros(q.shape)


# ---------------------------------------------------------------------------------------------
# transport: P2P exchanges with optional inter-node routing
# ---------------------------------------------------------------------------------------------


@dataclass
class _Path:
    via_src: int
    via_dst: int
    weight: int


class Transport:
    """Moves ring blocks with P2P ops on the default process group (global ranks).

    ``node_of(rank)`` classifies links (intra/inter) for the byte counters; ``routes`` maps a
    ``(src_rank, dst_rank)`` transfer to its paths ``[(via_src_rank, via_dst_rank, tokens), ...]``:
    a block is split by rows in proportion to the paths' tokens; each part goes
    src -> via_src (dispatch, intra-node) -> via_dst (NIC transfer) -> dst (combine), skipping the
    hops where a proxy is the endpoint itself. Every rank derives the same hop schedule from the
    same route table, so proxies relay in lock-step (stage by stage) with the ring members.
    ``stats`` (optional, shared between transports) accumulates what this rank sends:
    ``{"intra": bytes, "inter": bytes, "messages": count}``.
    """

    def __init__(
        self,
        rank: int | None = None,
        node_of: Callable[[int], int] | None = None,
        routes: dict[tuple[int, int], list[tuple[int, int, int]]] | None = None,
        stats: dict[str, int] | None = None,
    ) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank() if rank is None else rank
        self.node_of = node_of or (lambda r: 0)
        self.routes = {k: [_Path(*p) for p in v] for k, v in (routes or {}).items()}
        self.stats: dict[str, int] = stats if stats is not None else {}
        for key in ("intra", "inter", "messages"):
            self.stats.setdefault(key, 0)

    def parts(self, src: int, dst: int, rows: int) -> list[tuple[int, int, list[int]]]:
        """``[(row0, row1, chain)]``: the row slices of a ``rows``-row block and their hop chains."""
        paths = self.routes.get((src, dst))
        if not paths:
            return [(0, rows, [src, dst])]
        total = sum(p.weight for p in paths)
        out, acc, prev = [], 0, 0
        for i, p in enumerate(paths):
            acc += p.weight
            end = rows if i == len(paths) - 1 else (rows * acc // total if total > 0 else 0)
            chain = [src]
            for hop in (p.via_src, p.via_dst, dst):
                if hop != chain[-1]:
                    chain.append(hop)
            out.append((prev, end, chain))
            prev = end
        return out

    def exchange(
        self,
        transfers: Sequence[tuple[int, int, int]],
        payload: torch.Tensor | None,
        row_shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> Exchange:
        """An exchange of one block per transfer ``(src, dst, rows)``; ``payload`` is what this
        rank sends (it is src of at most one transfer)."""
        return Exchange(self, transfers, payload, tuple(row_shape), dtype, device)


class Exchange:
    """One lock-step exchange: ``start()`` posts stage 0 (before compute), ``finish()`` runs the
    remaining relay stages and returns the block this rank received (or None)."""

    def __init__(self, tr: Transport, transfers, payload, row_shape, dtype, device) -> None:
        self.tr = tr
        me = tr.rank
        self.stages: list[list[tuple[str, int, tuple]]] = []  # (op, peer, key)
        self.recv_parts: list[tuple[int, int, tuple]] = []  # (row0, row1, key) of my incoming block
        self.row_shape, self.dtype, self.device = row_shape, dtype, device
        self.payload = payload
        self.sizes: dict[tuple, int] = {}
        for ti, (src, dst, rows) in enumerate(transfers):
            if rows <= 0 or src == dst:
                continue
            for pi, (r0, r1, chain) in enumerate(tr.parts(src, dst, rows)):
                if r1 <= r0:
                    continue
                key = (ti, pi)
                self.sizes[key] = r1 - r0
                for h in range(len(chain) - 1):
                    a, b = chain[h], chain[h + 1]
                    while len(self.stages) <= h:
                        self.stages.append([])
                    if a == me:
                        self.stages[h].append(("send", b, key, r0, r1, h == 0))
                    if b == me:
                        self.stages[h].append(("recv", a, key, r0, r1, h == len(chain) - 2))
                        if h == len(chain) - 2:
                            self.recv_parts.append((r0, r1, key))
        self.bufs: dict[tuple, torch.Tensor] = {}
        self.works: list = []
        self.stage = 0
        self.total_rows = max([r1 for r0, r1, _ in self.recv_parts], default=0)

    def _post(self, h: int) -> None:
        import torch.distributed as dist

        ops = []
        for op, peer, key, r0, r1, first in self.stages[h]:
            if op == "send":
                t = self.payload[r0:r1] if first else self.bufs[key]
                t = t.contiguous()
                ops.append(dist.P2POp(dist.isend, t, peer))
                cls = "intra" if self.tr.node_of(peer) == self.tr.node_of(self.tr.rank) else "inter"
                self.tr.stats[cls] += t.numel() * t.element_size()
                self.tr.stats["messages"] += 1
            else:
                buf = torch.empty((r1 - r0, *self.row_shape), dtype=self.dtype, device=self.device)
                self.bufs[key] = buf
                ops.append(dist.P2POp(dist.irecv, buf, peer))
        self.works = dist.batch_isend_irecv(ops) if ops else []

    def ready(self) -> bool:
        """True when the posted stage's transfers have completed (wait() would not block)."""
        return all(w.is_completed() for w in self.works)

    def _wait(self, idle: Callable[[Callable[[], bool]], None] | None = None) -> None:
        if idle is not None and self.works:
            idle(self.ready)  # fill the wait with communication-free work
        for w in self.works:
            w.wait()
        self.works = []

    def start(self) -> Exchange:
        if self.stages:
            self._post(0)
        self.stage = 1
        return self

    def finish(self, idle: Callable[[Callable[[], bool]], None] | None = None) -> torch.Tensor | None:
        """Complete the exchange. ``idle(ready)``, when given, is called before each blocking wait
        and may run communication-free work until ``ready()`` (see the engine's local queue)."""
        if self.stage == 0:
            self.start()
        self._wait(idle)
        while self.stage < len(self.stages):
            self._post(self.stage)
            self._wait(idle)
            self.stage += 1
        if not self.recv_parts:
            return None
        parts = sorted(self.recv_parts)
        if len(parts) == 1:
            return self.bufs[parts[0][2]]
        return torch.cat([self.bufs[k] for _, _, k in parts], 0)


# ---------------------------------------------------------------------------------------------
# ring attention
# ---------------------------------------------------------------------------------------------


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
    _rows: list[int] = field(default_factory=list, init=False, repr=False)

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
                if _classify((qs, qe), (ks, ke)) != "skip":
                    out.append((qo, qo + qe - qs, ko, ko + ke - ks, (qs, qe), (ks, ke)))
        return out

    def transfers(self, r: int) -> list[tuple[int, int, int]]:
        """Round r: position i sends the block it holds (owner (i - r) mod G) to position i+1."""
        g = self.size
        return [(self.ranks[i], self.ranks[(i + 1) % g], self._rows[(i - r) % g]) for i in range(g)]


def _pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.stack([k, v], 1).contiguous()  # [T, 2, Hkv, D]


def ring_forward(q, k, v, spec: RingSpec, transport: Transport, scale: float | None = None, idle=None):
    """No-autograd ring attention forward: ``(out in q.dtype, lse [Hq, T] fp32)``.

    ``idle``: optional filler called while a K/V exchange is still in flight (see
    :meth:`Exchange.finish`)."""
    sc = _scale(q, scale)
    g, p = spec.size, spec.pos
    if q.shape[0] != spec.rows(p) or k.shape[0] != spec.rows(p):
        raise ValueError(f"ring position {p} holds {spec.rows(p)} rows, got q {q.shape[0]} / k {k.shape[0]}")
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), NEG_INF, dtype=torch.float32, device=q.device)
    kv = _pack_kv(k, v)
    row_shape = kv.shape[1:]
    for r in range(g):
        j = (p - r) % g
        ex = (
            transport.exchange(spec.transfers(r), kv, row_shape, kv.dtype, kv.device).start()
            if r < g - 1
            else None
        )
        for q0, q1, k0, k1, qr, kr in spec.pairs(p, j):
            o_b, l_b = attention_block(q[q0:q1], kv[k0:k1, 0], kv[k0:k1, 1], qr, kr, sc)
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
    sc = _scale(q, scale)
    g, p = spec.size, spec.pos
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = _pack_kv(k, v)
    row_shape = kv.shape[1:]
    exd = None
    dkv = None
    for r in range(g):
        j = (p - r) % g
        exkv = (
            transport.exchange(spec.transfers(r), kv, row_shape, kv.dtype, kv.device).start()
            if r < g - 1
            else None
        )
        dkv = torch.zeros((spec.rows(j), *row_shape), dtype=torch.float32, device=q.device)
        for q0, q1, k0, k1, qr, kr in spec.pairs(p, j):
            a, b, c = attention_block_backward(
                dout[q0:q1], q[q0:q1], kv[k0:k1, 0], kv[k0:k1, 1], out[q0:q1], lse[:, q0:q1], qr, kr, sc
            )
            dq[q0:q1] += a.float()
            dkv[k0:k1, 0] += b.float()
            dkv[k0:k1, 1] += c.float()
        if exd is not None:
            got = exd.finish(idle)
            if got is not None:
                dkv += got
        if g > 1:
            exd = transport.exchange(spec.transfers(r), dkv, row_shape, torch.float32, q.device).start()
        if exkv is not None:
            nxt = exkv.finish(idle)
            kv = nxt if nxt is not None else kv.new_zeros((0, *row_shape))
    if exd is not None:
        got = exd.finish(idle)
        dkv = got if got is not None else torch.zeros((0, *row_shape), dtype=torch.float32, device=q.device)
    return dq.to(q.dtype), dkv[:, 0].to(k.dtype), dkv[:, 1].to(v.dtype)


def ring_relay_forward(spec: RingSpec, transport: Transport, row_shape, dtype, device, idle=None) -> None:
    """A proxy that is not a ring member: take part in the forward exchanges of the ring (same
    call sequence as :func:`ring_forward`, no compute)."""
    for r in range(spec.size - 1):
        transport.exchange(spec.transfers(r), None, row_shape, dtype, device).start().finish(idle)


def ring_relay_backward(spec: RingSpec, transport: Transport, row_shape, dtype, device, idle=None) -> None:
    """Relay-only counterpart of :func:`ring_backward` (same exchange call sequence)."""
    g = spec.size
    exd = None
    for r in range(g):
        exkv = (
            transport.exchange(spec.transfers(r), None, row_shape, dtype, device).start()
            if r < g - 1
            else None
        )
        if exd is not None:
            exd.finish(idle)
        if g > 1:
            exd = transport.exchange(spec.transfers(r), None, row_shape, torch.float32, device).start()
        if exkv is not None:
            exkv.finish(idle)
    if exd is not None:
        exd.finish(idle)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec, transport, scale):
        out, lse = ring_forward(q, k, v, spec, transport, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.transport, ctx.scale = spec, transport, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.spec, ctx.transport, ctx.scale)
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, ring: RingSpec, transport: Transport | None = None, scale: float | None = None):
    """Exact ring attention over ``ring`` (autograd-capable). ``q/k/v`` are this rank's rows
    (see :class:`RingSpec`). All ring members must call it together."""
    if ring.pos is None:
        raise ValueError("ring_attention needs a ring member (pos is None)")
    return _RingAttention.apply(q, k, v, ring, transport or Transport(), scale)
