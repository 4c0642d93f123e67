"""Whole-step search ``node-major``: sequences are assigned to nodes for the whole step (each
node's whole step balanced), then each node's share is cut into micro-batches that fit its memory
and carry equal shares of the node's work, each laid out by the tiered pipeline with those nodes
fixed. Micro-batches are coupled (:attr:`~zeppelin.planner.costmodel.context.PlanContext.microbatches_coupled`:
under FSDP every unit waits for the slowest in each layer of each micro-batch), so the cut must
balance every micro-batch across the nodes too, which equal per-node shares of balanced node
loads approach; what they leave unbalanced the prediction and the simulator charge, and the
plans compete with the micro-batch-major ones on that."""

from __future__ import annotations

import heapq

import numpy as np

from zeppelin.planner.zeppelin.assign import RUNS_MIN_BINS, PackInfeasible, grouped_by_bin, lpt_runs
from zeppelin.planner.zeppelin.protocols import Round
from zeppelin.planner.zeppelin.step_searches.common import balances, node_cp_floor, whole_step
from zeppelin.planner.zeppelin.step_state import StepState
from zeppelin.planner.zeppelin.tiered import NODE_FILLS, marginal_token_time
from zeppelin.planner.zeppelin.tiering import zigzag_max_tokens_array

name = "node-major"
#: up to this many units every layout (tiered and node-CP, each objective) is tried node-major;
#: beyond, for planning latency, only the one that won the micro-batch count, balanced on total cost
ALL_LAYOUTS_MAX_UNITS = 32
#: beyond :data:`ALL_LAYOUTS_MAX_UNITS` units, where micro-batches are coupled (a step costs the sum
#: over micro-batches of the slowest unit), node-major's cut of the step into micro-batches is kept
#: but each micro-batch is laid out over every node afresh, balanced on its own: the whole-step node
#: assignment balances node totals, which leaves a node holding one very long sequence with little
#: in its other micro-batches while the others' halves set those micro-batches' maxima (laid out
#: with its nodes kept as well, node-major won few steps more, by little, for a whole-step layout
#: more each: docs/BENCHMARKS.md). Beyond this many units the cut is turned too
#: (:func:`node_major`'s ``turned``): each micro-batch takes the heaviest shares of 1/M of the nodes
#: rather than micro-batch 0 all of them (up to it, the heaviest shares together are what balances
#: each micro-batch)
TURNED_CUT_MIN_UNITS = 256


def search(state: StepState, parts: list[list[int]], found: Round) -> None:
    ctx = state.ctx
    if not (len(parts) > 1 and ctx.cluster.num_nodes > 1 and ctx.units_per_node > 1
            and ctx.num_units <= state.options.node_cp_max_units):
        return
    assigned = node_major(state, len(parts), turned=turned_cut(state, len(parts)))
    if assigned is None:
        return
    if ctx.num_units <= ALL_LAYOUTS_MAX_UNITS:
        floor = node_cp_floor(state)
        layouts = [([None], balances(state))] + ([([floor], ["total"])] if floor is not None else [])
    else:
        layouts = [(found.best_floors, ["total"])]
    fixed = kept_nodes(state, len(parts), assigned[1])
    for floors, objectives in layouts:
        try:
            built, t = whole_step(state, assigned[0], floors, objectives, fixed)
        except PackInfeasible as e:
            if state.last_error is None:
                state.last_error = str(e)
            continue
        found.offer(built, t)


def kept_nodes(state: StepState, M: int, nodes: list[int]) -> list[int] | None:
    """The node assignment node-major's micro-batches are laid out with: its own (``nodes``), or,
    where micro-batches are coupled on more than :data:`ALL_LAYOUTS_MAX_UNITS` units, none (each
    micro-batch over every node afresh)."""
    ctx = state.ctx
    if M > 1 and ctx.microbatches_coupled and ctx.num_units > ALL_LAYOUTS_MAX_UNITS:
        return None
    return nodes


def turned_cut(state: StepState, M: int) -> bool:
    """Whether node-major's cut into ``M`` micro-batches is turned (beyond
    :data:`TURNED_CUT_MIN_UNITS` units, coupled micro-batches)."""
    ctx = state.ctx
    return M > 1 and ctx.microbatches_coupled and ctx.num_units > TURNED_CUT_MIN_UNITS


def node_major(state: StepState, M: int, turned: bool = False):
    """Whole-step node assignment: sequences to nodes by work (LPT, each node holding at most
    ``M`` micro-batches of tokens), then each node's share cut into ``M`` micro-batches that fit
    its units' memory (work-balanced); where a node so filled cannot be cut, the nodes are assigned
    again holding at most the next share of :data:`.tiered.NODE_FILLS` of that. Returns
    (micro-batches, node of each sequence), or None where a sequence needs more than one node or
    nothing fits.

    ``turned``: node ``n``'s ``k``-th share goes to micro-batch ``(k + n) mod M`` (its first, the
    heaviest, to micro-batch ``n mod M``). Left in place, micro-batch 0 holds every node's heaviest
    share: the step's long sequences together, with too few denser short ones beside them - on
    clusters of many nodes those without a long sequence fill their memory before their time;
    turned, every micro-batch holds a like mix (:data:`TURNED_CUT_MIN_UNITS`)."""
    ctx, lengths = state.ctx, state.lengths
    nodes, per_node, cap = ctx.cluster.num_nodes, ctx.units_per_node, state.tiering.cap
    per_tok = zigzag_max_tokens_array(lengths, per_node).astype(np.float64)  # tokens per unit, node-wide split
    if per_tok.max() > cap:
        return None
    # weight: a sequence's per-unit time on a node when split over all of it (the span table's
    # ring / Ulysses price: small blocks and all-to-alls included) - what node loads add up to
    Ls = np.asarray(lengths, dtype=np.float64)
    c, layers = ctx.cost, ctx.model.num_layers
    ring, exp, uly = state.tiering.split_prices(Ls, per_node, "intra", ulysses=state.options.intra == "auto")
    att = ring + exp if uly is None else np.minimum(ring + exp, uly[0] + uly[1])
    T_avg = max(float(Ls.sum()) / ctx.num_units, 1.0)
    lin_rate = marginal_token_time(c, layers, T_avg)
    w = layers * att + lin_rate * Ls / per_node
    wl, pt = w.tolist(), per_tok.tolist()
    order = np.argsort(-w, kind="stable").tolist()
    # a node filled to its last token can leave its cut into micro-batches no room for a sequence:
    # then the nodes are assigned again with some token slack each
    for fill in NODE_FILLS:
        node = lpt_with_room(order, nodes, M * cap * fill, wl, pt)
        if node is None:
            return None
        # each node's sequences, heaviest first (``order`` grouped by node, a stable sort)
        node_arr = np.array(node, dtype=np.int64)
        grouped_arr = np.array(order, dtype=np.int64)[grouped_by_bin(node_arr, nodes)]
        counts = np.bincount(node_arr, minlength=nodes)
        mb_arr = lpt_each(grouped_arr, counts, M, cap, w, per_tok)
        if mb_arr is not None:
            break
    else:
        return None
    if turned:
        mb_arr = (mb_arr + np.repeat(np.arange(nodes), counts)) % M  # (grouped_arr's nodes, in order)
    parts = [np.sort(grouped_arr[mb_arr == k]).tolist() for k in range(M)]
    node_of = np.empty(len(lengths), dtype=np.int64)
    node_of[order] = node_arr
    return [p for p in parts if p], node_of.tolist()


def lpt_each(items: np.ndarray, counts: np.ndarray, bins: int, room: float, weight: np.ndarray,
             size: np.ndarray) -> np.ndarray | None:
    """:func:`lpt_with_room` of every node at once: ``items`` holds each node's items in turn (its
    ``counts`` of them, in order); returns the bin of each item, or None when an item of some node
    fits none of its bins. The nodes' k-th items are placed together, each by the same comparisons
    and additions as its node's own loop makes."""
    nodes = len(counts)
    if not len(items):
        return np.zeros(0, dtype=np.int64)
    width = int(counts.max())
    starts = np.cumsum(counts) - counts
    node_of = np.repeat(np.arange(nodes), counts)
    col = np.arange(len(items)) - starts[node_of]
    W = np.zeros((nodes, width))
    S = np.zeros((nodes, width))
    W[node_of, col] = weight[items]
    S[node_of, col] = size[items]
    load = np.zeros((nodes, bins))
    tok = np.zeros((nodes, bins))
    chosen = np.zeros((nodes, width), dtype=np.int64)
    rows = np.arange(nodes)
    for k in range(width):
        live = rows[counts > k]
        s = S[live, k]
        fits = tok[live] + s[:, None] <= room
        if not fits.any(axis=1).all():
            return None
        b = np.where(fits, load[live], np.inf).argmin(axis=1)  # (least loaded with room; ties: lowest bin)
        load[live, b] += W[live, k]
        tok[live, b] += s
        chosen[live, k] = b
    return chosen[node_of, col]


def lpt_with_room(items: list[int], bins: int, room: float, weight: list[float], size: list[float]):
    """Each item in the given order to the least-loaded bin (by ``weight``) whose ``size`` total
    stays within ``room`` (ties: lowest bin). Returns the bin of each item (in ``items`` order), or
    None when an item fits no bin."""
    if bins == 2:
        return _lpt_two(items, room, weight, size)
    if bins < 1:
        return [] if not items else None
    if bins > RUNS_MIN_BINS:
        return _lpt_runs(items, bins, room, weight, size)
    return _lpt_heap(items, [0.0] * bins, [0.0] * bins, room, weight, size)


def _lpt_runs(items: list[int], bins: int, room: float, weight: list[float], size: list[float]):
    """:func:`lpt_with_room` placing runs of items at once (:func:`.assign.lpt_runs`), the rest
    through the heap where runs stay short."""
    it = np.asarray(items, dtype=np.int64)
    load, tok = np.zeros(bins), np.zeros(bins)
    out, k, failed = lpt_runs(load, tok, room, np.asarray(weight, dtype=np.float64)[it],
                              np.asarray(size, dtype=np.float64)[it])
    if failed:
        return None
    if k == len(it):
        return out.tolist()
    rest = _lpt_heap(items[k:], load.tolist(), tok.tolist(), room, weight, size)
    return None if rest is None else out[:k].tolist() + rest


def _lpt_heap(items: list[int], load: list[float], tok: list[float], room: float, weight: list[float],
              size: list[float]):
    """:func:`lpt_with_room` by a heap of the bins, from loads ``load`` and tokens ``tok`` (updated)."""
    heap = [(ld, b) for b, ld in enumerate(load)]
    heapq.heapify(heap)
    out = []
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for i in items:
        s = size[i]
        ld, b = heap[0]
        if tok[b] + s > room:  # bins without room wait aside while this item takes its bin
            aside = []
            while heap and tok[heap[0][1]] + s > room:
                aside.append(pop(heap))
            if not heap:
                return None
            ld, b = heap[0]
            out.append(b)
            tok[b] += s
            replace(heap, (ld + weight[i], b))
            for e in aside:
                push(heap, e)
        else:
            out.append(b)
            tok[b] += s
            # (one sift where a pop and a push take two: the heap pops in the same order)
            replace(heap, (ld + weight[i], b))
    return out


def _lpt_two(items: list[int], room: float, weight: list[float], size: list[float]):
    """:func:`lpt_with_room` over two bins without a heap (a step's two micro-batches of a node:
    thousands of nodes each cut in two)."""
    l0 = l1 = t0 = t1 = 0.0
    out = []
    for i in items:
        s = size[i]
        if t0 + s <= room and (l0 <= l1 or t1 + s > room):
            out.append(0)
            l0 += weight[i]
            t0 += s
        elif t1 + s <= room:
            out.append(1)
            l1 += weight[i]
            t1 += s
        else:
            return None
    return out
