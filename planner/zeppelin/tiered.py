"""The tiered search for one micro-batch, as a pipeline of stages (docs/DESIGN.md, "Zeppelin"):

1. :func:`choose_spans` - each sequence's span (1 = local, 2..U = ring inside a node, whole nodes
   = ring across nodes) from memory and the cost crossovers;
2. :func:`assign_nodes` (level 1) - inter-node sequences take the least-loaded nodes, intra-node
   groups and local sequences fill node buckets so nodes carry equal cost within their tokens;
3. :func:`assign_units` (level 2) - inside each node, with the inter-node work as preload,
   intra-node groups take G units and local sequences fill the rest;
4. :func:`.groups.build_microbatch` - groups, placements, queues, then routes and the remap.

A unit's cost = ring attention incl. exposed communication (or L^2 attention when local) + linear
work per token - the same model :func:`.predict.predict_step` evaluates. The stages share one
:class:`.step_state.StepState` (the step's ILP budget and span tables); nothing is kept on the
planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from zeppelin.planner.costmodel.predict import (
    attention_tokens,
    layout_memory_tokens,
    microbatch_terms,
    placement_groups,
)
from zeppelin.planner.zeppelin.assign import EXCLUSIVE, LOCAL, SPLIT, PackInfeasible, PackResult, grouped_by_bin, pack
from zeppelin.planner.zeppelin.groups import as_usp, build_microbatch, finish_microbatch, ulysses_over_memory, usp_rings
from zeppelin.planner.zeppelin.step_state import StepState
from zeppelin.planner.zeppelin.tiering import Span, SpanTable, zigzag_max_tokens_array
from zeppelin.schemas.layout import ranges_tokens


#: up to this many units, a micro-batch whose sequences stage 1 marks for usp groups
#: (:func:`choose_spans`) span more than :data:`MARKS_CROWD_SHARE` of the nodes is also laid out
#: with rings alone (the rings left may not balance: on 2 nodes a step came out 5.6% slower with the
#: marks alone); beyond, the marked layout alone, and it goes to usp groups without its ring
#: layout's routes, remap and prediction being made first (for planning latency)
MARKS_ALONE_UNITS = 256
MARKS_CROWD_SHARE = 0.5
#: beyond :data:`MARKS_ALONE_UNITS` units, a micro-batch laid out with stage 1's usp marks and its
#: nodes filled to the last token whose slowest unit ends more than this share above the units'
#: mean (a node whose rings level 2 had to widen to the whole node, a marked sequence's ring left
#: no room for its usp copies) is laid out at the next node fill too, and the faster kept
CLIFF_SHARE = 0.1
#: a micro-batch whose tokens fill more than this share of what its units hold without recomputation
#: keeps stage 1's fine pieces (``thrifty`` False, :func:`choose_spans`): tokens spread evenly over
#: the units only in small pieces, and a unit left over its memory would pay its recomputation
THRIFT_FILL = 0.9


@dataclass
class MicroBatchStats:
    """How a micro-batch's layout was found (for the step's :class:`SolverInfo` and notes)."""

    results: list[PackResult] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=lambda: {"local": 0, "intra": 0, "inter": 0})
    unit_loads: np.ndarray | None = None
    level2_lb: float = 0.0


@dataclass
class Spans:
    """Stage 1's choice per sequence of the micro-batch (level 2 may widen a span to a whole node)."""

    lengths: np.ndarray  # tokens (float)
    table: SpanTable
    times: np.ndarray  # (spans, columns): per-unit time on each span, a column per length priced
    time_cols: np.ndarray  # each sequence's column of ``times`` (its own, or its length's)
    spans: list[Span]
    span_index: np.ndarray  # index into the tiering's spans
    unit_time: np.ndarray  # per-unit time on its span
    tokens_per_unit: np.ndarray  # tokens on the fullest unit of its span
    span_units: np.ndarray  # units of its span as first chosen
    is_inter: np.ndarray  # its span crosses nodes
    usp: np.ndarray | None = None  # its inter-node span is priced (and to be laid out) as a usp group
    bounded: bool = False  # a marked sequence's per-unit time is above the balanced load (it bounds)


def choose_spans(search: StepState, idx: list[int], balance: str, floor: int | None, usp: bool = True,
                 thrifty: bool = True) -> Spans:
    """Stage 1: spans for a balanced per-unit load (target refined once with the chosen spans'
    costs). ``floor`` (node-CP): every sequence long enough to split spans at least that span.
    ``thrifty``: a split for balance wastes at most the option ``split_waste`` of the sequence's
    attention compute (:meth:`.Tiering.choose_span_index`); False: any split whose transfers hide.

    ``usp`` (with option ``inter=auto``, a model whose heads allow usp rows, no windowed layers): a
    span over whole nodes is priced as the cheaper of a ring and a usp group; a sequence whose
    chosen span is cheaper as a usp group is marked (:attr:`Spans.usp`): its nodes then take no
    ring beside it (:func:`assign_nodes`), so that the group can run as usp (the runtime runs one
    family of split groups per unit), and :func:`best_microbatch` lays it out so."""
    ctx, tiering = search.ctx, search.tiering
    cost, layers, units = ctx.cost, ctx.model.num_layers, ctx.num_units
    Ls = search.lengths[idx].astype(np.float64)
    T_avg = max(float(Ls.sum()) / units, 1.0)
    lin_rate = marginal_token_time(cost, layers, T_avg)
    if balance == "attention":
        lin_rate = 0.0
    # Ulysses is offered to the node-CP layout (whole-node splits, where its all-to-all replaces a
    # ring of small blocks); the tiered layout keeps rings, whose transfers local work can fill
    ulysses = search.options.intra == "auto" and floor is not None
    table = search.span_table(Ls, search.routed_nics(), ulysses)
    # every per-sequence choice below depends on the sequence's length alone (and on the target):
    # it is made once per distinct length where the table was priced so (``cols``: each sequence's
    # column), the sums over the sequences still taken over every one, in order
    base, cols = table.distinct if table.distinct is not None else (table, np.arange(len(Ls)))
    times = ring_times = base.times(lin_rate)
    V = tiering.usp_prices(base) if usp and _usp_spans(search) else None
    if V is not None:
        times = np.minimum(ring_times, V + lin_rate * base.L[None, :] / base.G[:, None])
    target = float(times[0][cols].sum()) / units
    for _ in range(2):
        k = tiering.choose_span_index(base, target, lin_rate, times=times,
                                      free_compute=search.options.split_waste if thrifty else math.inf)[cols]
        unit_time = times[k, cols]
        target = float((unit_time * table.G[k]).sum()) / units
    if floor is not None:
        splittable = Ls >= 2 * table.G[floor]
        k = np.where(base.F[floor][cols] & splittable, floor, np.maximum(k, floor * splittable))
        unit_time = times[k, cols]
    marked, bounded = None, False
    if V is not None:
        marked = times[k, cols] < ring_times[k, cols]
        if not marked.any():
            marked = None
        else:
            bounded = bool((unit_time[marked] > target).any())
    span_units = np.array([sp.G for sp in tiering.spans], dtype=np.int64)[k]
    return Spans(lengths=Ls, table=table, times=times, time_cols=cols, spans=[tiering.spans[x] for x in k],
                 span_index=np.array(k, dtype=np.int64), unit_time=unit_time,
                 tokens_per_unit=zigzag_max_tokens_array(Ls, span_units).astype(np.float64),
                 span_units=span_units,
                 is_inter=np.array([s.tier == "inter" for s in tiering.spans], dtype=bool)[k], usp=marked,
                 bounded=bounded)


def marginal_token_time(cost, layers: int, T: float) -> float:
    """Seconds per token of the linear modules and the LM head on a unit holding about ``T`` tokens,
    at the margin (the secant between T/2 and T): their fixed cost per call is paid by every unit
    alike, so per-unit loads priced at the margin balance as the units' real times do, where the
    average rate would price a unit of few tokens (a long sequence's group) short."""
    def f(x: float) -> float:
        return float(layers * cost.linear_time(x) + cost.head_time(x))

    return (f(T) - f(T / 2)) / (T / 2)


#: the shares of a node's token capacity level 1 fills, in turn, until a layout fits: a node filled
#: to the last token can leave its units no room for rings of assorted widths (or node-major's cut
#: into micro-batches no room for its sequences)
NODE_FILLS = (1.0, 0.95, 0.9)


def _usp_spans(search: StepState) -> bool:
    """Whether stage 1 may price spans over whole nodes as usp groups: options ``inter=auto`` and
    ``usp_spans=on``, more than one node, and no windowed layers (their rings may be cut
    contiguously, which a usp group does not take over)."""
    ctx = search.ctx
    return (search.options.inter == "auto" and search.options.usp_spans == "on"
            and ctx.cluster.num_nodes > 1 and ctx.units_per_node > 1 and ctx.cost.window_mix is None)


def assign_nodes(search: StepState, idx: list[int], sp: Spans, carry: np.ndarray, node_fill: float,
                 fixed_nodes: list[int] | None, stats: MicroBatchStats) -> list[list[int]]:
    """Stage 2 (level 1): the nodes of each sequence. ``fixed_nodes``: the whole step's node
    assignment, made up front (node-major micro-batches)."""
    ctx, opts = search.ctx, search.options
    per_node, nodes = ctx.units_per_node, ctx.cluster.num_nodes
    if nodes > 1 and fixed_nodes is not None and not sp.is_inter.any():
        return [[fixed_nodes[i]] for i in idx]
    if nodes <= 1:
        return [[0] for _ in idx]
    inter = sp.is_inter
    width = np.where(inter, np.array([s.nodes for s in search.tiering.spans], dtype=np.int64)[sp.span_index], 1)
    on_node = np.where(inter, per_node, sp.span_units)
    kinds = None
    if sp.usp is not None:  # usp groups keep their nodes free of rings
        kinds = np.where(sp.usp, EXCLUSIVE, np.where(sp.span_units > 1, SPLIT, LOCAL))
    result = pack(carry.reshape(nodes, per_node).sum(axis=1), np.zeros(nodes), sp.unit_time * on_node,
                  sp.tokens_per_unit * on_node, width, float(search.tiering.cap * per_node) * node_fill,
                  ilp=search.ilp_mode(), limits=opts.limits, tol=opts.tol, solver=opts.solver,
                  max_ilp_vars=opts.max_ilp_vars_nodes, kinds=kinds)
    search.ilp_spent(result)
    stats.results.append(result)
    return result.bins


def _pack_node(search: StepState, sp: Spans, js: list[int], pre, pre_tok, **ilp) -> PackResult:
    return pack(pre, pre_tok, sp.unit_time[js], sp.tokens_per_unit[js],
                np.array([sp.spans[j].G for j in js], dtype=np.int64), float(search.tiering.cap), **ilp)


def _pack_node_widening(search: StepState, sp: Spans, js: list[int], pre, pre_tok) -> PackResult:
    """A node's units packed greedily. When the node's tokens fit (level 1 checked) but its rings
    of assorted widths leave no G units with room together, they are widened to the whole node
    (equal shares on every unit, like static CP inside the node) - first the rings, then every
    sequence long enough to split - before the caller falls back to more micro-batches."""
    try:
        return _pack_node(search, sp, js, pre, pre_tok, ilp="never")
    except PackInfeasible:
        pass
    per_node = search.ctx.units_per_node
    whole = per_node - 1  # index of Span(units_per_node, "intra") in the tiering's spans
    for min_len in (None, 2 * per_node):
        for j in js:
            if (sp.spans[j].G > 1 if min_len is None else sp.lengths[j] >= min_len) and per_node > 1:
                sp.spans[j] = search.tiering.spans[whole]
                sp.span_index[j] = whole
                sp.unit_time[j] = sp.times[whole, sp.time_cols[j]]
                sp.tokens_per_unit[j] = float(zigzag_max_tokens_array(sp.lengths[j:j + 1], [per_node])[0])
        try:
            return _pack_node(search, sp, js, pre, pre_tok, ilp="never")
        except PackInfeasible:
            if min_len is not None:
                raise
    raise AssertionError("unreachable")


def assign_units(search: StepState, sp: Spans, node_of: list[list[int]], carry: np.ndarray,
                 polish: bool, stats: MicroBatchStats) -> list[list[int]]:
    """Stage 3 (level 2): the units of each sequence, node by node, on top of ``carry`` and the
    inter-node rings' work; ``polish``: the nodes that set the micro-batch's maximum are packed
    again by the ILP. Records the unit loads in ``stats``."""
    ctx = search.ctx
    units, per_node, nodes = ctx.num_units, ctx.units_per_node, ctx.cluster.num_nodes
    pre = np.array(carry, dtype=np.float64)
    pre_tok = np.zeros(units)
    for j in np.flatnonzero(sp.is_inter).tolist():  # (in sequence order: the same sums per unit)
        for nd in node_of[j]:
            pre[nd * per_node:(nd + 1) * per_node] += sp.unit_time[j]
            pre_tok[nd * per_node:(nd + 1) * per_node] += sp.tokens_per_unit[j]
    # each node's sequences in sequence order: the local ones grouped by node
    local = np.flatnonzero(~sp.is_inter)
    first = np.array([b[0] for b in node_of], dtype=np.int64)[local]
    grouped = local[grouped_by_bin(first, nodes)]
    counts = np.bincount(first, minlength=nodes)
    ends = np.cumsum(counts).tolist()
    flat = grouped.tolist()
    by_node = {nd: flat[ends[nd - 1] if nd else 0:ends[nd]] for nd in np.flatnonzero(counts).tolist()}
    # the fullest nodes first: a layout whose nodes leave some unit no room fails at once (the
    # caller then keeps more token slack per node); the results stay in node order
    held = pre_tok.reshape(nodes, per_node).sum(axis=1)
    for nd in by_node:
        ix = grouped[ends[nd] - len(by_node[nd]):ends[nd]]
        held[nd] += float(np.dot(sp.tokens_per_unit[ix], sp.span_units[ix]))
    packed: dict[int, PackResult] = {}
    for nd in np.argsort(-held, kind="stable").tolist():
        sl = slice(nd * per_node, (nd + 1) * per_node)
        packed[nd] = _pack_node_widening(search, sp, by_node.get(nd, []), pre[sl], pre_tok[sl])
    results = {nd: packed[nd] for nd in range(nodes)}
    if polish and results:
        _polish_hot_nodes(search, sp, by_node, results, pre, pre_tok)
    unit_of: list[list[int]] = [[] for _ in sp.spans]
    for nd, r in results.items():
        base = nd * per_node
        for j, bs in zip(by_node.get(nd, ()), r.bins):
            unit_of[j] = [base + bs[0]] if len(bs) == 1 else [base + b for b in bs]
        stats.results.append(r)
    stats.unit_loads = np.concatenate([r.loads for r in results.values()]) if results else np.zeros(units)
    tiers = [s.tier for s in sp.spans]
    for tier in stats.tiers:
        stats.tiers[tier] += tiers.count(tier)
    stats.level2_lb = max((r.lower_bound for r in results.values()), default=0.0)
    return unit_of


def _polish_hot_nodes(search: StepState, sp: Spans, by_node, results: dict[int, PackResult], pre, pre_tok):
    """The ILP on the nodes that set the micro-batch's maximum (within ``tol`` of it) and whose
    greedy packing is not provably close, where the step's ILP budget reaches every such node and
    each may still improve: else no solve could lower the maximum by more than ``tol``, and none
    runs (``ilp=always``: every node)."""
    opts, per_node = search.options, search.ctx.units_per_node
    lb = max(r.lower_bound for r in results.values())
    top = max(r.makespan for r in results.values())
    targets = list(results)
    if opts.ilp != "always":
        targets = [nd for nd in targets if results[nd].makespan >= top * (1 - opts.tol)]
        if len(targets) > search.ilp_left or any(results[nd].makespan <= (1 + opts.tol) * lb
                                                 or results[nd].gap <= opts.tol for nd in targets):
            return
    for nd in targets:
        if search.ilp_mode() != "never":
            sl = slice(nd * per_node, (nd + 1) * per_node)
            results[nd] = _pack_node(search, sp, by_node.get(nd, []), pre[sl], pre_tok[sl],
                                     ilp="always" if opts.ilp == "always" else "auto", limits=opts.limits,
                                     tol=opts.tol, solver=opts.solver, max_ilp_vars=opts.max_ilp_vars_units)
            search.ilp_spent(results[nd])


def plan_microbatch(search: StepState, idx: list[int], carry: np.ndarray, balance: str = "total",
                    floor: int | None = None, node_fill: float = 1.0, fixed_nodes: list[int] | None = None,
                    spans: Spans | None = None, finish: bool = True):
    """One candidate layout of the micro-batch of sequences ``idx``: the stages in order.
    ``node_fill``: the share of a node's token capacity level 1 may fill (below 1 when a node
    filled to the last token left its units no room for its rings); ``spans``: stage 1's choice
    for these arguments, made before (level 2 widens a copy); ``finish``: the micro-batch gets its
    routes and remap (else :func:`.groups.finish_microbatch` later). Returns (micro-batch, stats);
    raises :class:`PackInfeasible`."""
    stats = MicroBatchStats()
    sp = _copy_spans(spans) if spans is not None else choose_spans(search, idx, balance, floor)
    node_of = assign_nodes(search, idx, sp, carry, node_fill, fixed_nodes, stats)
    # (node-CP: rings take whole nodes, so the units of a node carry near-equal loads already)
    unit_of = assign_units(search, sp, node_of, carry, search.options.ilp != "never" and floor is None, stats)
    mb = build_microbatch(search, idx, sp.lengths, sp.spans, sp.span_index, sp.table, node_of, unit_of,
                          remap=search.options.remap and balance == "attention", finish=finish)
    return mb, stats


def _copy_spans(sp: Spans) -> Spans:
    """``sp`` with its own copies of what level 2 may widen."""
    return replace(sp, spans=list(sp.spans), span_index=sp.span_index.copy(), unit_time=sp.unit_time.copy(),
                   tokens_per_unit=sp.tokens_per_unit.copy(), usp=None if sp.usp is None else sp.usp.copy())


def best_microbatch(search: StepState, idx: list[int], carry: np.ndarray, floors: list | None = None,
                    balances: list[str] | None = None, fixed_nodes: list[int] | None = None):
    """Candidate layouts, the faster by the prediction (``carry`` + the period) wins:

    * spans from the tiers (``floor`` None) or node-CP (``floor``: every splittable sequence
      that fits on one node takes a ring over the whole node, sequences balanced over nodes);
    * balance the total per-unit cost (attention + linear work in the attention layout), no
      remap - the linear modules run where attention ran;
    * (remap layer on) balance attention alone and let the remap even out the linear tokens
      (the remap layer itself drops the remap when it does not pay).

    Sequences stage 1 marks for usp groups (:func:`choose_spans`) are laid out as rings first, then
    as usp groups (:func:`_usp_alternative`; beyond :data:`MARKS_ALONE_UNITS` units the ring layout
    is not priced, only the usp one); the spans are chosen again with rings alone, and laid out
    beside them, on clusters of at most :data:`MARKS_ALONE_UNITS` units where the marked sequences
    span more than :data:`MARKS_CROWD_SHARE` of the nodes, wherever a marked sequence bounds the
    micro-batch (its per-unit time above the balanced load: usp prices keep falling with the span, so
    the span chosen for it and the load it leaves the others are least sure), and wherever no layout
    with the marks fits.

    Returns the micro-batch, its stats and its prediction terms (:func:`.predict.microbatch_terms`;
    their ``period`` is the predicted per-unit time without the step's gradient all-reduce,
    waits for coupled units included)."""
    ctx = search.ctx
    cands = []
    err = None
    # nodes filled to the last token can leave their units no room for rings of assorted
    # widths: then level 1 keeps some token slack per node (before the caller falls back to
    # one more micro-batch, which costs far more); at scale, so it does beside a full-fill layout
    # with the usp marks that came out far out of balance (_cliff)
    lengths = search.lengths.tolist()
    # stage 1's splits for balance are thrifty where the micro-batch has a sequence per unit to spare
    # (fewer, and splits are what occupies the units) and does not nearly fill their memory (THRIFT_FILL)
    thrifty = (len(idx) >= ctx.num_units
               and sum(lengths[i] for i in idx) <= THRIFT_FILL * ctx.num_units * ctx.cost.recompute_capacity("none"))
    for usp in (True, False):
        spans: dict[tuple, Spans] = {}  # stage 1 does not depend on the fill: chosen once per (floor, balance)
        found = len(cands)
        for fill in NODE_FILLS if ctx.cluster.num_nodes > 1 else (1.0,):
            for floor in floors if floors is not None else [None]:
                for bal in balances if balances is not None else ["total"]:
                    if (floor, bal) not in spans:
                        spans[floor, bal] = choose_spans(search, idx, bal, floor, usp=usp, thrifty=thrifty)
                    try:
                        cands += _layouts(search, idx, carry, spans[floor, bal], bal, floor, fill, fixed_nodes,
                                          lengths)
                    except PackInfeasible as e:
                        err = err or e
            if len(cands) > found and not (fill == 1.0 and usp and _cliff(ctx, cands[found:])):
                break
        if not (any(sp.usp is not None for sp in spans.values()) and (not cands or _rings_alone_too(ctx, spans))):
            break
    if not cands:
        raise err
    best = None
    for mb, st, terms in cands:
        t = float((carry + terms.period).max())
        if best is None or t < best[0]:
            best = (t, mb, st, terms)
    return best[1], best[2], best[3]


def _cliff(ctx, cands: list) -> bool:
    """Whether, beyond :data:`MARKS_ALONE_UNITS` units, every layout of ``cands`` ((micro-batch,
    stats, terms)) has a unit more than :data:`CLIFF_SHARE` above the units' mean busy time."""
    return ctx.num_units > MARKS_ALONE_UNITS and all(
        float(t.period.max()) > (1 + CLIFF_SHARE) * float(t.busy.mean()) for _, _, t in cands)


def _layouts(search: StepState, idx: list[int], carry: np.ndarray, sp: Spans, bal: str, floor, fill: float,
             fixed_nodes, lengths: list[int]) -> list:
    """One layout of the micro-batch (:func:`plan_microbatch`) and, where its rings over whole nodes
    may run as usp groups, that one too: ``[(micro-batch, stats, terms)]``. Beyond
    :data:`MARKS_ALONE_UNITS` units, a layout with marked sequences is priced as usp groups alone
    where they fit (its ring layout is left unrouted); ``lengths``: the step's sequences' lengths.
    Raises :class:`PackInfeasible`."""
    ctx = search.ctx
    remap = search.options.remap and bal == "attention"
    marked = None if sp.usp is None else {idx[j] for j in np.flatnonzero(sp.usp).tolist()}
    draft = marked is not None and ctx.num_units > MARKS_ALONE_UNITS and search.options.inter != "ring"
    mb, st = plan_microbatch(search, idx, carry, balance=bal, floor=floor, node_fill=fill,
                             fixed_nodes=fixed_nodes, spans=sp, finish=not draft)
    if draft:
        alt = _usp_alternative(search, mb, None, lengths, remap, marked)
        if alt is not None:
            return [(alt[0], st, alt[1])]
        mb = finish_microbatch(search, mb, remap)
    terms = microbatch_terms(ctx, lengths, mb)
    out = [(mb, st, terms)]
    alt = None if search.options.inter == "ring" else _usp_alternative(search, mb, terms, lengths, remap, marked)
    if alt is not None:
        out.append((alt[0], st, alt[1]))
    return out


def _ring_placements(mb, rings: list[int]) -> tuple[np.ndarray, dict[int, int]]:
    """``mb``'s placements' groups (a usp layout of it has the same, in the same order) and the
    placement of each of the ``rings`` (one sequence each)."""
    pg = placement_groups(mb)
    return pg, {int(pg[i]): i for i in np.flatnonzero(np.isin(pg, rings)).tolist()}


def _usp_token_change(n: int, mb, alt, changed: list[int]) -> np.ndarray:
    """Per unit of ``n``, the attention-layout tokens ``alt`` holds beyond ``mb``, which differ in
    the placements ``changed`` alone (whole numbers: ``attention_tokens(mb) +`` this is
    ``attention_tokens(alt)`` exactly)."""
    d = np.zeros(n)
    for i in changed:
        for layout, sign in ((mb, -1), (alt, 1)):
            p = layout.placements[i]
            for u, rs in zip(layout.groups[p.group].units, p.ranges):
                d[u] += sign * ranges_tokens(rs)
    return d


def _rings_alone_too(ctx, spans: dict) -> bool:
    """Whether a micro-batch laid out with marked sequences (stage 1's ``spans``) is laid out with
    rings alone too: a marked sequence bounds it, or (up to :data:`MARKS_ALONE_UNITS` units) the
    marked sequences crowd the nodes."""
    return any(sp.bounded for sp in spans.values()) or (
        ctx.num_units <= MARKS_ALONE_UNITS and any(_crowded(ctx, sp) for sp in spans.values()))


def _crowded(ctx, sp: Spans) -> bool:
    """Whether the sequences ``sp`` marks for usp groups span more than :data:`MARKS_CROWD_SHARE` of
    the nodes."""
    if sp.usp is None:
        return False
    nodes = sum(sp.spans[j].nodes for j in np.flatnonzero(sp.usp).tolist())
    return nodes > MARKS_CROWD_SHARE * ctx.cluster.num_nodes


def _usp_alternative(search: StepState, mb, terms, lengths, remap: bool, marked: set[int] | None = None):
    """``mb`` with its inter-node rings over whole nodes run as usp groups (:func:`.groups.as_usp`)
    where each one's units stay within their memory, and its terms; None where no ring may. A
    ring's hop from node to node crosses the network through one unit's NIC (or relays over the
    node's others through one NVLink port each way); a usp group's column rings cross through every
    unit's own, with blocks u times as large to hide behind - at the price of its rows'
    all-to-alls. The caller keeps whichever layout the prediction finds faster. ``marked``: the
    sequences stage 1 priced as usp groups (their rings are converted wherever they run);
    ``terms`` None: ``mb`` is not routed nor priced (its memory is its attention layout's)."""
    ctx = search.ctx
    rings = usp_rings(ctx, mb)
    if not rings:
        return None
    pg = at = None
    if marked:
        pg, at = _ring_placements(mb, rings)
    if not (marked and any(mb.placements[i].seq in marked for i in at.values())):
        if terms is None:
            return None
        busy = terms.busy
        slowest = set(np.flatnonzero(busy >= busy.max()).tolist())
        if not any(slowest.intersection(mb.groups[g].units) for g in rings):
            return None  # (the micro-batch's slowest unit runs none of them: the layout would not be faster)
    if pg is None:
        pg, at = _ring_placements(mb, rings)
    att = attention_tokens(mb, ctx.num_units, pg)
    held = terms.mem_tokens if terms is not None else layout_memory_tokens(ctx.cost, mb, att, att.copy(), pg)
    room = np.maximum(held, ctx.cost.token_capacity)
    while rings:
        alt = as_usp(search, mb, rings, remap, sorted(at[g] for g in rings))
        alt_att = att + _usp_token_change(ctx.num_units, mb, alt, [at[g] for g in rings])
        # (each unit's attention layout with its rows' extra copies within memory as validate counts
        # it - every token at its whole bytes -, stricter than the prediction of a remapped one)
        strict = ulysses_over_memory(ctx, alt.groups, alt.placements, pg, alt_att)
        over = {g for g in rings if strict.intersection(mb.groups[g].units)}
        if not over:
            alt_terms = microbatch_terms(ctx, lengths, alt, pg=pg, held=alt_att)
            over = {g for g in rings if (alt_terms.mem_tokens[mb.groups[g].units] > room[mb.groups[g].units]).any()}
            if not over:
                return alt, alt_terms
        rings = [g for g in rings if g not in over]
    return None
