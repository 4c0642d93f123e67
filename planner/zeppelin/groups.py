"""The last stages of the tiered search for one micro-batch: groups and queues, then routes and
the remap.

One ring group per split sequence, cut into 2G zigzag chunks (:func:`zigzag_ranges`); ring order
follows the topology (units of a node contiguous, each node entered once, so a ring crosses the
network only ``k`` times; successive inter-node rings enter each node at a different unit so
their boundary hops use different NICs). Each unit's queue: inter groups, then intra, then its
local group - in one global group order, so no two units wait on each other in opposite orders.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, eq, itemgetter

import numpy as np

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.core.builder import local_records
from zeppelin.planner.core.builder import record as _record
from zeppelin.planner.costmodel.predict import (
    attention_tokens,
    coupled_components,
    placement_groups,
    ulysses_held_tokens,
    usp_row_sizes,
)
from zeppelin.planner.zeppelin.remap import plan_remap
from zeppelin.planner.zeppelin.routing import plan_routes
from zeppelin.schemas.invariants import kv_replication
from zeppelin.schemas.layout import contiguous_ranges, usp_ranges, zigzag_ranges
from zeppelin.schemas.plan import Group, MicroBatch, Placement, RemapInfo

_TIER = attrgetter("tier")
_FIRST = itemgetter(0)


def build_microbatch(search, idx: list[int], Ls: np.ndarray, spans, span_index, table, node_of, unit_of,
                     remap: bool, finish: bool = True) -> MicroBatch:
    """Groups, placements and queues of the micro-batch of sequences ``idx`` (lengths ``Ls``, spans,
    nodes and units as the earlier stages chose), then (``finish``; else :func:`finish_microbatch`
    later) its routes and (``remap``) its remap."""
    ctx = search.ctx
    tiers = list(map(_TIER, spans))
    inter_js, intra_js, local_js = (list(compress(range(len(tiers)), map(eq, tiers, repeat(t))))
                                    for t in ("inter", "intra", "local"))
    lengths = Ls.tolist() if isinstance(Ls, np.ndarray) else list(Ls)  # (plain numbers: numpy scalars cost more)
    groups: list[Group] = []
    placements: list[Placement] = []
    _inter_groups(ctx, idx, Ls, inter_js, node_of, groups, placements)
    ulysses = _ulysses_choice(ctx, intra_js, span_index, table, unit_of, node_of, inter_js)
    n_inter = len(groups)
    _intra_groups(ctx, idx, lengths, intra_js, unit_of, ulysses, groups, placements)
    _local_groups(idx, lengths, local_js, unit_of, groups, placements)
    over = ulysses_over_memory(ctx, groups, placements) if any(ulysses.values()) else set()
    if over:  # (the units were packed by their ring tokens: Ulysses rows' extra copies may not fit)
        ulysses = _ulysses_choice(ctx, intra_js, span_index, table, unit_of, node_of, inter_js, forbid=over)
        del groups[n_inter:], placements[n_inter:]
        _intra_groups(ctx, idx, lengths, intra_js, unit_of, ulysses, groups, placements)
        _local_groups(idx, lengths, local_js, unit_of, groups, placements)
    queues: list[list[int]] = [[] for _ in range(ctx.num_units)]
    for gi, g in enumerate(groups):  # global order: inter, intra, local
        for u in g.units:
            queues[u].append(gi)
    # built from validated parts; model_construct skips re-validating thousands of records
    mb = MicroBatch.model_construct(groups=groups, placements=placements, queues=queues, linear_layout=None,
                                    remap=RemapInfo(), routes=[])
    return finish_microbatch(search, mb, remap) if finish else mb


def finish_microbatch(search, mb: MicroBatch, remap: bool) -> MicroBatch:
    """``mb`` with its routes and (``remap``) its remap."""
    mb.routes = plan_routes(search.ctx, mb, enable=search.options.routing)
    mb.linear_layout, mb.remap = _remap(search.ctx, search.sequences, mb, search.options.remap, enable=remap)
    return mb


def usp_rings(ctx: PlanContext, mb: MicroBatch) -> list[int]:
    """The inter-node ring groups of ``mb`` that may run as usp groups instead: over whole nodes,
    one zigzag-cut sequence each, on units that run no other ring (the runtime runs one family of
    groups per unit and micro-batch), where the model's heads allow a usp row."""
    if not usp_row_sizes(ctx):
        return []
    upn = ctx.units_per_node
    ringed: dict[int, int] = {}  # unit -> ring / all-gather groups it runs
    for g in mb.groups:
        if g.kind in ("ring", "allgather"):
            for u in g.units:
                ringed[u] = ringed.get(u, 0) + 1
    inter = {gi for gi, g in enumerate(mb.groups) if g.kind == "ring" and g.tier == "inter"}
    count: dict[int, int] = {}
    zigzag: dict[int, bool] = {}
    for p in _placements_in(mb, inter):
        count[p.group] = count.get(p.group, 0) + 1
        zigzag[p.group] = p.scheme == "zigzag" and p.padded_length is None
    out = []
    for gi in sorted(inter):
        g = mb.groups[gi]
        if count.get(gi) != 1 or not zigzag.get(gi):
            continue
        nodes = {u // upn for u in g.units}
        if len(g.units) == len(nodes) * upn and all(ringed[u] == 1 for u in g.units):
            out.append(gi)
    return out


def as_usp(search, mb: MicroBatch, rings: list[int], remap: bool, at: list[int] | None = None) -> MicroBatch:
    """``mb`` with each of the inter-node ``rings`` (:func:`usp_rings`) run as a usp group over the
    same units instead: rows of the widest usp row size inside a node, the ring of rows across the
    nodes (each column ring crosses the network over its own units' NICs, where a ring's hop from
    node to node goes through one unit's, or its relays'), the same sequence cut as
    :func:`zeppelin.schemas.layout.usp_ranges`; then its routes and (``remap``) its remap again.
    ``at``: the rings' placements (indices, in order), where the caller knows them."""
    ctx = search.ctx
    u, m = max(usp_row_sizes(ctx)), ctx.model
    rep = kv_replication(m.num_heads, m.num_kv_heads, ctx.tp, u)
    groups, placements = list(mb.groups), list(mb.placements)
    for pi in _placement_indices(mb, set(rings)) if at is None else at:
        p = placements[pi]
        units = sorted(mb.groups[p.group].units)
        r = len(units) // u
        groups[p.group] = _record(Group, kind="usp", tier="inter", units=units, shape=[u, r], kv_replication=rep)
        placements[pi] = _record(Placement, seq=p.seq, group=p.group, scheme="zigzag", padded_length=None,
                                 ranges=usp_ranges(search.sequences[p.seq].length, u, r))
    queues = [list(q) for q in mb.queues]
    out = MicroBatch.model_construct(groups=groups, placements=placements, queues=queues, linear_layout=None,
                                     remap=RemapInfo(), routes=[], recompute=mb.recompute,
                                     recompute_units=mb.recompute_units)
    out.routes = plan_routes(ctx, out, enable=search.options.routing)
    out.linear_layout, out.remap = _remap(ctx, search.sequences, out, search.options.remap, enable=remap)
    return out


def _placement_indices(mb: MicroBatch, groups: set[int]) -> list[int]:
    """The indices of ``mb``'s placements in ``groups``, in order."""
    if not groups:
        return []
    return np.flatnonzero(np.isin(placement_groups(mb), list(groups))).tolist()


def _placements_in(mb: MicroBatch, groups: set[int]) -> list[Placement]:
    """``mb``'s placements in ``groups``, in order."""
    pls = mb.placements
    return [pls[i] for i in _placement_indices(mb, groups)]


def _inter_groups(ctx: PlanContext, idx, Ls, inter_js, node_of, groups, placements) -> None:
    """One ring per inter-node sequence (longest first); each enters its nodes at a different unit
    than the ring before it there, spreading the boundary hops over the NICs."""
    per_node = ctx.units_per_node
    entered = np.zeros(ctx.cluster.num_nodes, dtype=np.int64)
    gpus_per_nic = max(1, ctx.cluster.gpus_per_node // len(ctx.cluster.nics))
    for j in sorted(inter_js, key=lambda j: -Ls[j]):
        units: list[int] = []
        for nd in sorted(node_of[j]):
            rot = int(entered[nd]) * max(1, gpus_per_nic // ctx.tp) % per_node
            entered[nd] += 1
            base = list(range(nd * per_node, (nd + 1) * per_node))
            units += base[rot:] + base[:rot]
        groups.append(_record(Group, kind="ring", tier="inter", units=units))
        placements.append(_ring_placement(ctx, idx[j], len(groups) - 1, int(Ls[j]), len(units)))


def _ring_placement(ctx: PlanContext, seq: int, group: int, length: int, G: int,
                    contiguous: bool | None = None) -> Placement:
    """A ring's cut of one sequence: zigzag, or contiguous where the model's windows make a
    neighbour exchange enough (:meth:`CostModel.ring_contiguous`; ``contiguous``: its answer, asked
    before)."""
    if contiguous is None:
        contiguous = bool(ctx.cost.ring_contiguous(length, G))
    if contiguous:
        return _record(Placement, seq=seq, group=group, scheme="contiguous",
                       ranges=contiguous_ranges(length, G), padded_length=None)
    return _record(Placement, seq=seq, group=group, scheme="zigzag", ranges=zigzag_ranges(length, G),
                   padded_length=None)


def _ring_cuts(ctx: PlanContext, lengths: list[int], sizes: list[int]) -> list[bool]:
    """:meth:`CostModel.ring_contiguous` of each ring of ``sizes[i]`` units over a sequence of
    ``lengths[i]`` tokens, asked once per ring size."""
    out = [False] * len(lengths)
    at: dict[int, list[int]] = {}
    for i, G in enumerate(sizes):
        at.setdefault(G, []).append(i)
    for G, where in at.items():
        cut = ctx.cost.ring_contiguous(np.array([lengths[i] for i in where], dtype=np.float64), G).tolist()
        for i, c in zip(where, cut):
            out[i] = bool(c)
    return out


def _intra_groups(ctx: PlanContext, idx, lengths: list, intra_js: list[int], unit_of, ulysses: dict[int, bool],
                  groups, placements) -> None:
    """Intra-node splits on the same units share one group (one ring / one all-to-all per round for
    all of them: fewer, larger transfers, one latency); inter rings stay one per sequence.
    ``intra_js``: the intra-node splits, in micro-batch order."""
    shared: dict[tuple, int] = {}
    js = sorted(intra_js, key=lambda j: -lengths[j])
    units_of = [sorted(unit_of[j]) for j in js]
    tokens = [int(lengths[j]) for j in js]
    uly = [ulysses.get(j, False) for j in js]
    contiguous = _ring_cuts(ctx, tokens, [len(u) for u in units_of])
    for j, units, length, is_uly, cut in zip(js, units_of, tokens, uly, contiguous):
        key = ("ulysses" if is_uly else "ring", tuple(units))
        gi = shared.get(key)
        if gi is None:
            groups.append(_record(Group, kind=key[0], tier="intra", units=units))
            gi = shared[key] = len(groups) - 1
        if is_uly:
            placements.append(_record(Placement, seq=idx[j], group=gi, scheme="contiguous",
                                      ranges=contiguous_ranges(length, len(units)), padded_length=None))
        else:
            placements.append(_ring_placement(ctx, idx[j], gi, length, len(units), cut))


def _local_groups(idx, lengths: list, local_js: list[int], unit_of, groups, placements) -> None:
    """One local group per unit with local sequences (units in order; on each, longest first, equal
    lengths in micro-batch order). ``local_js``: the local sequences, in micro-batch order."""
    if not local_js:
        return
    units = np.fromiter(map(_FIRST, map(unit_of.__getitem__, local_js)), dtype=np.int64, count=len(local_js))
    L = np.array([lengths[j] for j in local_js])
    # by unit, then longest first, then micro-batch order (lexsort is stable)
    order = np.lexsort((-L, units))
    js = [local_js[i] for i in order.tolist()]
    new_groups, new_placements = local_records(list(map(idx.__getitem__, js)), units[order].tolist(),
                                               [int(x) for x in L[order].tolist()], len(groups))
    groups += new_groups
    placements += new_placements


def ulysses_over_memory(ctx: PlanContext, groups: list[Group], placements: list[Placement],
                        pg: np.ndarray | None = None, held: np.ndarray | None = None) -> set[int]:
    """The units whose memory the micro-batch's Ulysses rows' extra copies overrun (as ``validate``
    counts them, under the context's global recomputation); none where units may recompute on their
    own (``PlanContext.unit_recompute``: their choice is made afterwards). ``pg`` (the placements'
    groups) and ``held`` (:func:`.predict.attention_tokens`): where the caller knows them."""
    if ctx.unit_recompute:
        return set()
    mb = MicroBatch.model_construct(groups=groups, placements=placements, queues=[], linear_layout=None,
                                   remap=RemapInfo(), routes=[])
    n, cost = ctx.num_units, ctx.cost
    pg = placement_groups(mb) if pg is None else pg
    uly = ulysses_held_tokens(mb, n, cost, pg)
    if uly is None:
        return set()
    if held is None:
        held = attention_tokens(mb, n, pg)  # (recompute.held_tokens: no linear layout here)
    cap = cost.recompute_capacity(None)
    return {u for u in np.flatnonzero(uly > 0).tolist()
            if cost.recompute_layout_tokens(held[u], uly[u], None) >= cap + 1}


def _ulysses_choice(ctx: PlanContext, intra_js: list[int], span_index, table, unit_of, node_of, inter_js,
                    forbid: set[int] | None = None) -> dict[int, bool]:
    """Which intra-node splits run as Ulysses. The runtime runs one kind family per unit and
    micro-batch (Ulysses, or rings and local work), so units linked by split groups decide
    together: all their splits as Ulysses (only where every one can be, and no inter-node ring
    touches them, nor any unit of ``forbid``) or all as rings, whichever the span table prices
    lower in sum."""
    if table.U is None:
        return {}
    per_node = ctx.units_per_node
    members: dict[int, list[int]] = {}
    for j in inter_js:
        members[j] = [nd * per_node + b for nd in node_of[j] for b in range(per_node)]
    for j in intra_js:
        members[j] = list(unit_of[j])
    label = coupled_components(ctx.num_units, members.values())
    comp: dict[int, list[int]] = {}
    for j in intra_js:
        comp.setdefault(int(label[members[j][0]]), []).append(j)
    blocked = {int(label[members[j][0]]) for j in inter_js} | {int(label[u]) for u in (forbid or ())}
    out: dict[int, bool] = {}
    for root, js in comp.items():
        ring = sum(float(table.R[span_index[j], j]) for j in js)
        uly = sum(float(table.Q[span_index[j], j]) for j in js)
        choose = root not in blocked and np.isfinite(uly) and uly < ring
        for j in js:
            out[j] = bool(choose)
    return out


def _remap(ctx: PlanContext, sequences, mb: MicroBatch, remap_on: bool, enable: bool):
    """The micro-batch's linear layout and remap (:func:`.remap.plan_remap`; ``enable``: the layout
    was balanced on attention alone, so a remap may pay)."""
    if remap_on and not enable:
        return None, RemapInfo(enabled=False, reason="layout balanced on attention + linear cost; "
                                                     "a remap would not pay")
    return plan_remap(ctx, sequences, mb, enable=enable)
