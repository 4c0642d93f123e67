"""Candidate family ``wide-rings``: the step's longest sequences on rings of several whole nodes.

A step far above its lower bound because a few sequences are very long is set by those sequences:
on one node (or on the fewest units that hold them) each takes most of the step by itself, and
FLOP-share sizes their rings by the step's work (past a node only as far as a whole share asks),
so the width that the bound needs - each long sequence on an aligned block of 2, 4, ... whole
nodes, its hops between nodes routed over every NIC of the nodes it spans - is never built. This
family tries those widths: for each, every long sequence gets a ring of that many units (or more,
where its memory asks) while they all fit side by side, and the rest are sized and placed as
FLOP-share places them (least-loaded on aligned blocks, micro-batched by first fit or for
coupling). Each width is one candidate, judged by select.

The search is driven by the gap to the bound (:func:`predict.lower_bounds`): it runs only where
some sequence on the narrowest ring that holds it, at least a node, takes more than 1/:data:`GAP`
of the step's lower bound by itself - that ring's units have almost no room left for the rest of
the step, so plans that keep it there tend to end well above the bound - and planning a step
without such a sequence costs one pass over its lengths. The gate is the step's, not the caller's
``limit``: beyond 32 units that is lowered to other families' scores, and a search skipped on it
would build other plans than the full search. The placement and pricing are FLOP-share's
(:mod:`.aligned_rings`, shared by both), so the two families' scores and plans stay alike.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from zeppelin.planner.core.base import PlanContext, pow2_sizes
from zeppelin.planner.costmodel.predict import lower_bounds
from zeppelin.planner.zeppelin.families import aligned_rings as rings
from zeppelin.planner.zeppelin.families.common import token_slope
from zeppelin.planner.zeppelin.protocols import Candidate
from zeppelin.schemas.plan import Sequence

name = "wide-rings"
#: the family searches only where a sequence on its narrowest ring (at least a node) takes more than
#: 1/GAP of the step's lower bound: plans that keep it there leave no room to come within GAP of it
GAP = 1.1
#: a sequence is long when on one node (or on the fewest units holding it) it alone takes at least
#: this share of the step's lower bound: such a sequence sets the step unless its ring is widened
LONG_SHARE = 0.5


def candidates(ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
               routing: bool = True, top: int = 2) -> list[Candidate]:
    """The family's best ``top`` widths (none scored above ``limit``), or none where no sequence
    keeps the step far from its bound or the cluster is a single node."""
    return wide_rings(ctx, step, sequences, limit=limit, routing=routing, top=top)


def wide_rings(ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
               routing: bool = True, top: int = 2, settle_rounds: int | None = None) -> list[Candidate]:
    n, upn, cm = ctx.num_units, ctx.units_per_node, ctx.cost
    if n < 2 * upn:
        return []
    L = np.array([s.length for s in sequences], dtype=np.int64)
    Lf = L.astype(np.float64)
    gmax = pow2_sizes(n)[-1]
    g_mem = rings.memory_ring_sizes(L, cm.token_capacity, gmax)
    if g_mem.max() > gmax:
        return []
    slope = token_slope(ctx, cm, max(float(Lf.sum()) / n, 2.0))
    nic_share = 1.0 / max(len(ctx.cluster.nics), 1) if routing else 1.0
    t_narrow = _narrow_times(ctx, Lf, slope, g_mem, nic_share)
    bound = max(lower_bounds(ctx, Lf, microbatches=1))  # (the gate reads the step's work in one pass)
    if not far_from_bound(t_narrow, bound):
        return []
    return _search(ctx, step, sequences, L, slope, g_mem, t_narrow >= LONG_SHARE * bound, limit, routing, top,
                   settle_rounds, nic_share)


def _search(ctx: PlanContext, step: int, sequences: list[Sequence], L: np.ndarray, slope: float, g_mem: np.ndarray,
            long: np.ndarray, limit: float | None, routing: bool, top: int, settle_rounds: int | None,
            nic_share: float) -> list[Candidate]:
    """One candidate per width of 2, 4, ... nodes for the ``long`` sequences (side by side), the
    rest sized by FLOP-share's whole shares; the ``top`` best-scored."""
    n, upn, cm = ctx.num_units, ctx.units_per_node, ctx.cost
    Lf = L.astype(np.float64)
    gmax = pow2_sizes(n)[-1]
    work = cm.work(Lf)
    base = rings.ring_sizes(ctx, work, g_mem, gmax, 1.0)
    order = sorted(range(len(L)), key=lambda i: (-work[i], i))
    if settle_rounds is None:
        # (FLOP-share's local search, off by default: it moves the long rings off their widths
        # for little gain, and the search runs on many steps that are near their bound)
        settle_rounds = 0
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
        layouts = rings.place(ctx, L, Lf, slope, [(sizes, f" (long sequences on rings of {G // upn} nodes)")],
                              order, gmax, settle_rounds, nic_share)
        score = min(rings.coupled_score(ctx, lay, order, work) for lay in layouts)
        if limit is None or score <= limit:
            out.append(Candidate(score, len(out),
                                 partial(rings.build, ctx, step, sequences, layouts, order, work, routing, name)))
    return sorted(out, key=lambda c: (c.score, c.index))[:top]


def far_from_bound(t_narrow: np.ndarray, bound: float) -> bool:
    """Whether the wide search runs: some sequence on its narrowest ring (``t_narrow``, at least a
    node) takes more than 1/GAP of the step's lower bound."""
    return bool(len(t_narrow)) and float(t_narrow.max()) * GAP > bound


def _widths(upn: int, gmax: int) -> list[int]:
    """Ring widths of 2, 4, ... whole nodes (aligned power-of-two blocks of units)."""
    return [G for G in pow2_sizes(gmax) if G >= 2 * upn]


def _narrow_times(ctx: PlanContext, Lf: np.ndarray, slope: float, g_mem: np.ndarray, nic_share: float) -> np.ndarray:
    """Per sequence, its per-unit time on its narrowest ring of at least a node: the node's units,
    or the fewest units that hold it where a node does not (FLOP-share's pricing)."""
    sizes = np.maximum(g_mem, ctx.units_per_node)
    out = np.zeros(len(Lf))
    for G in np.unique(sizes).tolist():
        sel = sizes == G
        out[sel] = rings.unit_time(ctx, Lf[sel], slope, G, nic_share)
    return out
