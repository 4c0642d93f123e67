"""Candidate family ``wide-rings``: the step's longest sequences on rings of several whole nodes.

A step far above its lower bound because a few sequences are very long is set by those sequences:
on one node (or on the fewest units that hold them) each takes most of the step by itself, and
FLOP-share sizes their rings by the step's work (past a node only as far as a whole share asks),
so the width that the bound needs - each long sequence on an aligned block of 2, 4, ... whole
nodes, its hops between nodes routed over every NIC of the nodes it spans - is never built. This
family tries those widths: for each, every long sequence gets a ring of that many units (or more,
where its memory asks) while they all fit side by side, the rest are sized and placed as FLOP-share places them (least-loaded on
aligned blocks, evened out by its local search, micro-batched by first fit or for coupling), and
the placement whose slowest unit is lowest is built.

The search is driven by the gap to the bound: it runs only where the plan the caller already has
is more than :data:`GAP` times the step's lower bound (:func:`predict.lower_bounds`) and some
sequence alone takes at least :data:`LONG_SHARE` of the bound on one node, so planning steps that
are already near their bound costs nothing more.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from zeppelin.planner.core.base import PlanContext, pow2_sizes
from zeppelin.planner.costmodel.predict import lower_bounds
from zeppelin.planner.zeppelin.families import flop_share as fs
from zeppelin.planner.zeppelin.families.common import token_slope
from zeppelin.planner.zeppelin.protocols import Candidate
from zeppelin.schemas.plan import Sequence

name = "wide-rings"
#: the family searches only where the caller's plan is above this multiple of the step's lower bound
GAP = 1.1
#: a sequence is long when on one node (or on the fewest units holding it) it alone takes at least
#: this share of the step's lower bound: such a sequence sets the step unless its ring is widened
LONG_SHARE = 0.5


def candidates(ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
               routing: bool = True, top: int = 2) -> list[Candidate]:
    """The family's best ``top`` widths, or none where the step is near its bound, has
    no long sequence, or the cluster is a single node."""
    return wide_rings(ctx, step, sequences, limit=limit, routing=routing, top=top)


def wide_rings(ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
               routing: bool = True, top: int = 2, settle_rounds: int | None = None) -> list[Candidate]:
    n, upn, cm = ctx.num_units, ctx.units_per_node, ctx.cost
    if n < 2 * upn:
        return []
    L = np.array([s.length for s in sequences], dtype=np.int64)
    Lf = L.astype(np.float64)
    bound = max(lower_bounds(ctx, Lf))
    if not far_from_bound(limit, bound):
        return []
    gmax = pow2_sizes(n)[-1]
    g_mem = fs._memory_ring_sizes(L, cm.token_capacity, gmax)
    if g_mem.max() > gmax:
        return []
    slope = token_slope(ctx, cm, max(float(Lf.sum()) / n, 2.0))
    nic_share = 1.0 / max(len(ctx.cluster.nics), 1) if routing else 1.0
    long = _long(ctx, Lf, slope, g_mem, bound, nic_share)
    if not long.any():
        return []
    work = cm.work(Lf)
    base = fs._ring_sizes(ctx, work, g_mem, gmax, 1.0)
    order = sorted(range(len(L)), key=lambda i: (-work[i], i))
    if settle_rounds is None:
        settle_rounds = min(4 * len(L), fs.SETTLE_ROUNDS) if n <= fs.SEARCH_MAX_UNITS else 0
    out, seen = [], []
    for G in _widths(upn, gmax):
        sizes = base.copy()
        sizes[long] = np.maximum(G, g_mem[long])
        if int(sizes[long].sum()) > n:
            break  # the long rings no longer fit side by side: rings sharing nodes wait on each other
        if any(np.array_equal(sizes, s) for s in seen):
            continue
        seen.append(sizes)
        # each width placed (and built) on its own: the family's per-unit score prices a ring's
        # hops, not how rings sharing nodes meet, so the judge compares the widths' plans
        layouts = fs._placements(ctx, L, Lf, slope, [(sizes, f" (long sequences on rings of {G // upn} nodes)")],
                                 order, gmax, settle_rounds, nic_share)
        score = min(_coupled(ctx, lay, order, work) for lay in layouts)
        if limit is None or score <= limit:
            out.append(Candidate(score, len(out), partial(_build, ctx, step, sequences, layouts, order, work, routing)))
    return sorted(out, key=lambda c: (c.score, c.index))[:top]


def far_from_bound(limit: float | None, bound: float) -> bool:
    """Whether the wide search runs: the caller would build a plan up to ``limit`` (its own plan's
    time with a margin; None: it has none), and where that is within GAP of the step's lower
    bound no wider ring can gain enough to pay for its search."""
    return limit is None or limit > GAP * bound


def _build(ctx, step, sequences, layouts, order, work, routing):
    plan = fs._build(ctx, step, sequences, layouts, order, work, routing)
    plan.notes["family"] = name
    return plan


def _coupled(ctx: PlanContext, layout, order: list[int], work: np.ndarray) -> float:
    """A placement's slowest unit once ring partners' waits are charged, micro-batched by first
    fit (FLOP-share's own measure when it chooses among its placements): rings of several nodes
    often share units, and their top load alone misses the waits."""
    where, sizes, _, _, t = layout
    fit = fs._first_fit(ctx.num_units, ctx.cost.token_capacity, fs._micro_batch_order(order, work, sizes), where)
    return fs._coupled_time(ctx.num_units, where, t.tolist(), *fit)


def _widths(upn: int, gmax: int) -> list[int]:
    """Ring widths of 2, 4, ... whole nodes (aligned power-of-two blocks of units)."""
    return [G for G in pow2_sizes(gmax) if G >= 2 * upn]


def _long(ctx: PlanContext, Lf: np.ndarray, slope: float, g_mem: np.ndarray, bound: float,
          nic_share: float) -> np.ndarray:
    """The sequences that alone take at least LONG_SHARE of the bound on one node (on a ring of
    the node's units, or of the fewest units that hold them where a node does not)."""
    upn = ctx.units_per_node
    out = np.zeros(len(Lf), dtype=bool)
    for G in sorted(set(np.maximum(g_mem, upn).tolist())):
        sel = np.maximum(g_mem, upn) == G
        t = fs._unit_time(ctx, Lf[sel], slope, G, nic_share)
        out[sel] = t >= LONG_SHARE * bound
    return out
