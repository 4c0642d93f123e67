"""The per-layer attention engine: runs one rank's attention queue of a plan's micro-batch.

``AttentionEngine(header, step, mb_index, rank, groups=None)`` compiles the rank's schedule once
(:func:`zeppelin.runtime.attn.schedule.compile_schedule`: tasks in the global order every rank
derives from the plan, which keeps the P2P schedule free of deadlocks); ``engine(q, k, v) -> out``
then runs it on the rows of this rank's attention buffer (``MicroBatch.attention_segments(unit)``:
the unit's groups in queue order, each group's sequences in placement order, each sequence's
ranges in listed order):

* ``ring`` groups (and ``allgather`` groups, which are executed with the same exact ring
  schedule — K/V blocks pass around the group, partial results merge by log-sum-exp) through
  :func:`zeppelin.runtime.attn.ring.ring_forward` / ``ring_backward``;
* ``local`` groups: one-rank rings (whole sequences, no communication);
* ``ulysses`` groups: delegated to :func:`zeppelin.runtime.attn.ulysses.ulysses_attention`;
* ``usp`` groups (Ulysses rows x a ring across them): delegated to
  :func:`zeppelin.runtime.attn.usp.usp_attention`.

Communication-free work (sequences of one-rank groups) fills the waits: while a ring exchange is
still in flight, the engine runs queued local sequences — all of them as ONE varlen kernel call
where the device has a varlen kernel (:class:`zeppelin.runtime.attn.local.LocalPack`), else
one task per sequence — and whatever is left runs after the rings (``engine.filled`` counts the
fills). The ring/local/allgather work of a call is ONE autograd node (:class:`_EngineFunction`), so
backward runs the same global order (not whatever order autograd would pick for separate nodes).

Routing. ``MicroBatch.routes`` split an inter-node ring transfer over NIC paths: the K/V block (and,
in backward, the dK/dV accumulators) is cut by rows in proportion to the paths' tokens; each part
goes src -> via_src (dispatch) -> via_dst (transfer) -> dst (combine)
(:mod:`zeppelin.runtime.attn.transport`). A proxy that is not a member of the ring relays
inside its own engine call, at the ring's place in the global order.

``engine.stats``: bytes this rank sent, ``{"intra": ..., "inter": ..., "messages": ...}``,
accumulated over all calls (forward and backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeppelin.schemas.plan import PlanHeader, StepPlan

from .attn.local import LocalPack
from .attn.ring import RingSpec, ring_backward, ring_forward, ring_relay_backward, ring_relay_forward
from .attn.schedule import PHASES, Schedule, compile_schedule
from .attn.transport import Transport
from .attn.usp import UspSpec

__all__ = ["PHASES", "AttentionEngine", "local_sequences"]


@dataclass
class _Item:
    group: int
    kind: str  # "ring" (ring/allgather/local) | "relay" | "ulysses" | "usp"
    spec: object
    row0: int  # rows of this group in the attention buffer (members only)
    row1: int
    transport: Transport | None = None


class AttentionEngine:
    """One rank's attention work for one micro-batch of one step (see module docstring)."""

    def __init__(
        self,
        header: PlanHeader,
        step: StepPlan,
        mb_index: int,
        rank: int,
        groups=None,
        scale: float | None = None,
        window: int | None = None,
    ) -> None:
        compiled = compile_schedule(header, step, mb_index, rank)
        #: sliding-window attention of the layers this engine serves (None: full causal)
        self.window = window
        self.header, self.step, self.mb_index, self.rank = header, step, mb_index, rank
        self.groups = groups
        self.scale = scale
        self.compiled: Schedule = compiled
        self.unit, self.rows = compiled.unit, compiled.rows
        self.stats: dict[str, int] = {"intra": 0, "inter": 0, "messages": 0}
        # local sequences run while a ring exchange was in flight (forward / backward)
        self.filled: dict[str, int] = {"forward": 0, "backward": 0}
        node_of = header.cluster.node_of
        self.items = [
            _Item(t.group, t.kind, _windowed(t.spec, window), t.row0, t.row1,
                  None if t.kind == "ulysses" else Transport(rank=rank, node_of=node_of, routes=t.routes,
                                                             stats=self.stats))
            for t in compiled.tasks
        ]

    # ------------------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[str, int]]:
        """``(kind, group)`` in execution order (``kind``: ring | relay | ulysses)."""
        return self.compiled.order()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self.rows or k.shape[0] != self.rows or v.shape[0] != self.rows:
            raise ValueError(
                f"step {self.step.step} microbatch {self.mb_index}: rank {self.rank} holds "
                f"{self.rows} attention rows, got q/k/v with {q.shape[0]}/{k.shape[0]}/{v.shape[0]}"
            )
        ring_items = [it for it in self.items if it.kind in ("ring", "relay")]
        uly_items = [it for it in self.items if it.kind in ("ulysses", "usp")]
        if not uly_items:
            return _EngineFunction.apply(q, k, v, self, ring_items)
        # Ulysses groups (collectives on their own process groups, autograd through ulysses.py);
        # a unit never mixes them with ring groups (the ``kinds`` invariant, checked at construction), so the only other
        # work is communication-free local attention and relays are impossible.
        from .attn.ulysses import ulysses_attention

        pieces: list[tuple[int, torch.Tensor]] = []
        if ring_items:
            pieces.append((-1, _EngineFunction.apply(q, k, v, self, ring_items)))
        for it in uly_items:
            if it.kind == "usp":
                pieces.append((it.group, self._usp(it, q, k, v)))
                continue
            pg = self.groups.get(it.spec.ranks) if self.groups is not None else None
            o = ulysses_attention(
                q[it.row0 : it.row1],
                k[it.row0 : it.row1],
                v[it.row0 : it.row1],
                it.spec,
                group=pg,
                scale=self.scale,
                window=self.window,
            )
            pieces.append((it.group, o))
        out = torch.zeros_like(q) if not ring_items else pieces[0][1]
        # place each Ulysses group's rows (the ring output holds zeros there)
        idx_parts, vals = [], []
        for it, (_, o) in zip(uly_items, pieces[1:] if ring_items else pieces):
            idx_parts.append(torch.arange(it.row0, it.row1, device=q.device))
            vals.append(o)
        if idx_parts:
            idx = torch.cat(idx_parts)
            out = out.index_copy(0, idx, torch.cat(vals, 0))
        return out

    def _usp(self, it: _Item, q, k, v) -> torch.Tensor:
        from .attn.usp import usp_attention

        row = it.spec.row.ranks
        pg = self.groups.get(row) if self.groups is not None and len(row) > 1 else None
        return usp_attention(q[it.row0:it.row1], k[it.row0:it.row1], v[it.row0:it.row1], it.spec, group=pg,
                             transport=it.transport, scale=self.scale)


def _windowed(spec, window: int | None):
    """A ring or usp spec with the layers' window (Ulysses specs carry none: the engine passes it)."""
    if window is None:
        return spec
    if isinstance(spec, UspSpec):
        return UspSpec(ranks=spec.ranks, shape=spec.shape, pos=spec.pos, seqs=spec.seqs, window=window)
    if not isinstance(spec, RingSpec):
        return spec
    return RingSpec(ranks=spec.ranks, pos=spec.pos, seqs=spec.seqs, window=window)


class _LocalOnly:
    """What :class:`_EngineFunction` reads of an engine, for :func:`local_sequences`."""

    def __init__(self, scale: float | None) -> None:
        self.scale = scale
        self.window = None
        self.filled = {"forward": 0, "backward": 0}


def local_sequences(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, rank: int = 0,
                    scale: float | None = None) -> torch.Tensor:
    """Causal attention of whole sequences packed along the rows of ``q/k/v`` (``lengths`` in row
    order), through exactly the path an engine takes for a rank's one-rank (``local``) group: one
    autograd node, one one-rank ring task per sequence, forward and backward. It is what the
    profiler times, so that the measured cost of a local sequence includes everything the engine
    pays per sequence (task set-up, slicing, accumulators, the autograd node), not only the kernel."""
    lengths = [int(x) for x in lengths]
    if any(n <= 0 for n in lengths) or sum(lengths) != q.shape[0]:
        raise ValueError(f"lengths {lengths[:8]}... do not partition {q.shape[0]} rows into sequences")
    spec = RingSpec(ranks=[rank], pos=0, seqs=[[[[0, n]]] for n in lengths])
    item = _Item(group=0, kind="ring", spec=spec, row0=0, row1=q.shape[0], transport=Transport(rank=rank))
    return _EngineFunction.apply(q, k, v, _LocalOnly(scale), [item])


def _split_local(items: list[_Item]) -> tuple[list[_Item], list[tuple[int, int, RingSpec, Transport]]]:
    """Communicating items (rings of >= 2 ranks, relays) and the communication-free work of
    one-rank groups, cut per sequence: ``(row0, row1, spec, transport)`` filler tasks."""
    comm, local = [], []
    for it in items:
        if it.kind == "ring" and it.spec.size == 1:
            spans: dict[int, list[int]] = {}
            for si, off, s, e in it.spec.segments(0):
                sp = spans.setdefault(si, [off, off])
                sp[1] = off + (e - s)
            for si, (o0, o1) in spans.items():
                sub = RingSpec(ranks=it.spec.ranks, pos=0, seqs=[it.spec.seqs[si]], window=it.spec.window)
                local.append((it.row0 + o0, it.row0 + o1, sub, it.transport))
        else:
            comm.append(it)
    return comm, local


class _Filler:
    """Runs queued communication-free tasks while a ring exchange is in flight (Zeppelin's local
    queue filling the gaps of the inter/intra queues); the rest runs after the rings."""

    def __init__(self, tasks) -> None:
        self.tasks = list(tasks)
        self.filled = 0

    def __call__(self, ready) -> None:
        while self.tasks and not ready():
            self.tasks.pop(0)()
            self.filled += 1

    def drain(self) -> None:
        while self.tasks:
            self.tasks.pop(0)()


class _EngineFunction(torch.autograd.Function):
    """All ring / local / relay work of one engine call as one autograd node.

    Order: the communicating items in the engine's global order; local (one-rank) sequences fill
    the waits of those items' exchanges and whatever is left runs at the end. Results do not
    depend on when a local sequence runs (it touches only its own rows)."""

    @staticmethod
    def forward(ctx, q, k, v, engine: AttentionEngine, items: list[_Item]):
        out = torch.zeros_like(q)
        lse = torch.zeros((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)

        def ring(a, b, spec, tr, idle=None):
            out[a:b], lse[:, a:b] = ring_forward(q[a:b], k[a:b], v[a:b], spec, tr, engine.scale, idle=idle)

        engine.filled["forward"] += _run_items(items, q, k, engine.window, ring, ring_relay_forward,
                                               lambda pack: pack.forward(q, k, v, out, lse, engine.scale))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.engine, ctx.items = engine, items
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        scale = ctx.engine.scale

        def ring(a, b, spec, tr, idle=None):
            dq[a:b], dk[a:b], dv[a:b] = ring_backward(dout[a:b], q[a:b], k[a:b], v[a:b], out[a:b], lse[:, a:b],
                                                      spec, tr, scale, idle=idle)

        ctx.engine.filled["backward"] += _run_items(
            ctx.items, q, k, ctx.engine.window, ring, ring_relay_backward,
            lambda pack: pack.backward(dout, q, k, v, out, lse, dq, dk, dv, scale))
        return dq, dk, dv, None, None


def _run_items(items: list[_Item], q, k, window, ring, relay, packed) -> int:
    """One engine call's work, forward or backward: the communicating items in the engine's global
    order (``ring(a, b, spec, transport, idle)`` for a ring's rows, ``relay(spec, transport,
    row_shape, dtype, device, idle)`` for a relay), the local sequences filling the waits of their
    exchanges - as ONE varlen call (``packed(pack)``) where the device has one, else ``ring`` per
    sequence - and whatever is left at the end. Returns how many local tasks filled a wait."""
    comm, local = _split_local(items)
    pack = LocalPack.of(((a, b, spec) for a, b, spec, _ in local), q, window)
    if pack is not None:
        filler = _Filler([lambda: packed(pack)])
    else:
        filler = _Filler((lambda t=t: ring(*t)) for t in local)
    row_shape = (2, k.shape[1], k.shape[2])
    for it in comm:
        if it.kind == "relay":
            relay(it.spec, it.transport, row_shape, k.dtype, k.device, idle=filler)
        else:
            ring(it.row0, it.row1, it.spec, it.transport, idle=filler)
    filler.drain()
    return filler.filled
