"""Transport: P2P exchanges of ring blocks, following the plan's inter-node routes.

A route splits one ring transfer ``src -> dst`` over NIC paths ``(via_src, via_dst, tokens)``: the
block is cut by rows in proportion to the paths' tokens and each part goes src -> via_src
(dispatch, intra-node) -> via_dst (NIC transfer) -> dst (combine), skipping the hops where a proxy
is an endpoint itself (:func:`split_rows`, :func:`hop_chain`). Every rank derives the same hop
schedule from the same route table, so proxies relay in lock-step (stage by stage) with the ring
members.

Overlap without host syncs: every exchange is a ``batch_isend_irecv`` posted before the block
compute it overlaps. On NCCL the transfers run on the process group's own CUDA streams, which wait
on the compute stream only for the data they send; ``Work.wait()`` makes the compute stream wait on
the transfer's completion event and returns at once (no host block), and ``ready()`` polls that
event. Relay stages are chained the same way. On gloo ``wait()`` blocks the host, and queued local
work fills the wait (``idle``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["Exchange", "Transport", "hop_chain", "split_rows"]

#: ``(src_rank, dst_rank) -> [(via_src_rank, via_dst_rank, tokens), ...]``
RouteTable = dict[tuple[int, int], list[tuple[int, int, int]]]


def hop_chain(src: int, via_src: int, via_dst: int, dst: int) -> list[int]:
    """The ranks one part of a routed block visits, endpoints included, without repeats."""
    chain = [src]
    for hop in (via_src, via_dst, dst):
        if hop != chain[-1]:
            chain.append(hop)
    return chain


def split_rows(src: int, dst: int, rows: int, paths: Sequence[tuple[int, int, int]] | None
               ) -> list[tuple[int, int, list[int]]]:
    """``[(row0, row1, chain)]``: the row slices of a ``rows``-row block sent ``src -> dst`` over
    ``paths`` (in proportion to their tokens; the last path takes the rounding) and their hop chains.
    Without paths the block goes direct."""
    if not paths:
        return [(0, rows, [src, dst])]
    total = sum(w for _, _, w in paths)
    out, acc, prev = [], 0, 0
    for i, (via_src, via_dst, w) in enumerate(paths):
        acc += w
        end = rows if i == len(paths) - 1 else (rows * acc // total if total > 0 else 0)
        out.append((prev, end, hop_chain(src, via_src, via_dst, dst)))
        prev = end
    return out


class Transport:
    """Moves ring blocks with P2P ops on the default process group (global ranks).

    ``node_of(rank)`` classifies links (intra/inter) for the byte counters; ``routes`` maps a
    ``(src_rank, dst_rank)`` transfer to its paths ``[(via_src_rank, via_dst_rank, tokens), ...]``.
    ``stats`` (optional, shared between transports) accumulates what this rank sends:
    ``{"intra": bytes, "inter": bytes, "messages": count}``.
    """

    def __init__(
        self,
        rank: int | None = None,
        node_of: Callable[[int], int] | None = None,
        routes: RouteTable | None = None,
        stats: dict[str, int] | None = None,
    ) -> None:
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank()
        self.rank = rank
        self.node_of = node_of or (lambda r: 0)
        self.routes: RouteTable = {k: [(int(a), int(b), int(w)) for a, b, w in v] for k, v in (routes or {}).items()}
        self.stats: dict[str, int] = stats if stats is not None else {}
        for key in ("intra", "inter", "messages"):
            self.stats.setdefault(key, 0)

    def parts(self, src: int, dst: int, rows: int) -> list[tuple[int, int, list[int]]]:
        """``[(row0, row1, chain)]``: the row slices of a ``rows``-row block and their hop chains."""
        return split_rows(src, dst, rows, self.routes.get((src, dst)))

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
        self.stages: list[list[tuple]] = []  # per stage: (op, peer, key, row0, row1, first or last hop)
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
