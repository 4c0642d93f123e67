"""Candidate family ``flop-share``: rings sized by each sequence's share of the step's work.

A sequence whose work exceeds a unit's share of the step (or whose tokens do not fit one unit)
runs as a zigzag ring over an aligned block of the power-of-two size it needs, the rest stay local
(and, as further sizings, rings of at most 1/2, 1/4, 1/8 and 1/16 of a unit's share each); blocks
and units are filled least-loaded first, each placement then evened out by a local search (moves,
swaps, ring sizes halved or doubled), micro-batches by first fit and chosen for coupling; the
layout whose time with ring partners' waits charged is lowest is built. The placement, local search,
micro-batching and build are :mod:`.aligned_rings`' (shared with ``wide-rings``).
"""

from __future__ import annotations

import numpy as np

from zeppelin.planner.core.base import PlanContext, pow2_sizes
from zeppelin.planner.zeppelin.families import aligned_rings as rings
from zeppelin.planner.zeppelin.families.common import token_slope
from zeppelin.planner.zeppelin.protocols import Candidate
from zeppelin.schemas.plan import Sequence

name = "flop-share"
SETTLE_ROUNDS = 32  # moves of the local search per placement (the first few do nearly all the good)
#: FLOP-share's finer ring sizings (up to rings.SEARCH_MAX_UNITS units): each one's rings put at most
#: this fraction of a unit's share of the step on each of their units
FINE_SHARES = (0.5, 0.25, 0.125, 0.0625)


def candidates(ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
               routing: bool = True, top: int = 2) -> list[Candidate]:
    """The family's one candidate: its best placement, built on demand (its score does not prune
    by ``limit``)."""
    return flop_share(ctx, step, sequences, top=top, routing=routing)


def flop_share(ctx: PlanContext, step: int, sequences: list[Sequence], top: int = 1, routing: bool = True,
               settle_rounds: int | None = None):
    n, cm = ctx.num_units, ctx.cost
    L = np.array([s.length for s in sequences], dtype=np.int64)
    Lf = L.astype(np.float64)
    work = cm.work(Lf)
    gmax = pow2_sizes(n)[-1]
    g_mem = rings.memory_ring_sizes(L, cm.token_capacity, gmax)
    if g_mem.max() > gmax:
        return []  # a sequence fits no ring of the cluster
    sizings = _sizings(ctx, work, g_mem, gmax)
    # per-unit time of each sequence on its ring / alone (the score; placement balances on it)
    slope = token_slope(ctx, cm, max(float(Lf.sum()) / n, 2.0))
    # an inter-node ring's boundary hops are routed over every NIC of its nodes (rings.build); rings
    # sit on aligned blocks, so two that share a node share units too and run one after the other
    nic_share = 1.0 / max(len(ctx.cluster.nics), 1) if routing else 1.0
    order = sorted(range(len(L)), key=lambda i: (-work[i], i))
    if settle_rounds is None:
        # (past rings.SEARCH_MAX_UNITS units, for planning latency, the plain placement alone)
        settle_rounds = min(4 * len(L), SETTLE_ROUNDS) if n <= rings.SEARCH_MAX_UNITS else 0
    layouts = rings.place(ctx, L, Lf, slope, sizings, order, gmax, settle_rounds, nic_share)
    return [Candidate(min(x[2] for x in layouts), 0,
                      lambda: rings.build(ctx, step, sequences, layouts, order, work, routing, name))]


def _sizings(ctx: PlanContext, work: np.ndarray, g_mem: np.ndarray, gmax: int) -> list[tuple[np.ndarray, str]]:
    """The ring sizings placed: whole-share rings, and (up to rings.SEARCH_MAX_UNITS units) finer rings,
    each at most a half, a quarter, ... of a unit's share - nearly free inside a node under the
    cost model, they pack more evenly where a step's sequences are a large share each; which
    fraction packs best depends on the step's mix, so each is placed."""
    sizings = [(rings.ring_sizes(ctx, work, g_mem, gmax, 1.0), "")]
    if ctx.num_units <= rings.SEARCH_MAX_UNITS:
        for frac in FINE_SHARES:
            fine = rings.ring_sizes(ctx, work, g_mem, gmax, frac)
            if not any(np.array_equal(fine, sz) for sz, _ in sizings):
                sizings.append((fine, f" (rings <= 1/{round(1 / frac)} share)"))
    return sizings
