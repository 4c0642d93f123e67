"""Bucket assignment shared by both levels of the Zeppelin planner.

Both levels solve the same problem: *bins* (nodes at level 1, units of one node at level 2) with a
preload (work and tokens already there), and *items* that each occupy ``width`` distinct bins,
adding ``cost`` seconds and ``tokens`` tokens to each of them (a local sequence: width 1; a ring
group: width G, its per-unit share; an inter-node sequence at level 1: width = nodes spanned).
Minimise the most loaded bin subject to each bin's token capacity. Optionally (``kinds``), a bin
holding an *exclusive* item (a sequence laid out as a usp group, whose units the runtime lets run no
ring beside it) takes no *split* item (a ring's share), and the reverse; local items go anywhere.

* :func:`greedy_pack` - longest-processing-time first (wide items first, each onto its
  least-loaded bins with room), then a local search that moves / swaps width-1 items off the
  most loaded bin while that lowers the maximum. O(m log B) plus the search; used at every size.
* :func:`ilp_pack` - the exact formulation as a MILP in PuLP::

      min C   s.t.  sum_b x[i,b] = w_i                          (each item on w_i bins)
                    pre_b + sum_i c_i x[i,b] <= C               (makespan)
                    tok_b + sum_i k_i x[i,b] <= cap             (memory)
                    C <= C_greedy                               (greedy incumbent as cutoff)

  solved by HiGHS (CBC when HiGHS is unavailable or fails) under deterministic node / iteration
  limits (:mod:`zeppelin.planner.core.solver`); the greedy
  solution is the incumbent: the ILP result is kept only when it is feasible and no worse.
* :func:`pack` - greedy, then the ILP only where it pays: when greedy is not already within
  ``tol`` of the lower bound and the instance is small enough to pay.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from zeppelin.planner.core.solver import INFEASIBLE, WALL_CLOCK, SolveLimits, solve_pulp


@dataclass
class PackResult:
    bins: list[list[int]]  # per item, the bins it occupies (sorted)
    loads: np.ndarray  # per bin, final load (s)
    tokens: np.ndarray  # per bin, final tokens
    makespan: float
    lower_bound: float
    solver: str = "greedy"  # greedy | highs | cbc
    status: str = "ok"
    time_s: float = 0.0
    ilp_gap: float | None = None  # solver-reported relative MIP gap (None: no ILP ran)
    nodes: int = 0  # branch-and-bound nodes the ILP used
    ilp_runs: int = 0  # ILP solves behind this result (0: greedy alone)
    fallback_reason: str | None = None
    greedy_makespan: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def gap(self) -> float:
        """Relative gap to the lower bound: (makespan - LB) / makespan (0 = provably optimal)."""
        if self.makespan <= 0:
            return 0.0
        if self.ilp_gap is not None:
            return min(max(self.makespan - self.lower_bound, 0.0) / self.makespan, self.ilp_gap)
        return max(self.makespan - self.lower_bound, 0.0) / self.makespan


class PackInfeasible(Exception):
    """An item does not fit any set of bins with enough token room."""

    def __init__(self, item: int, message: str):
        self.item = item
        super().__init__(message)


def lower_bound(pre: np.ndarray, cost: np.ndarray, width: np.ndarray) -> float:
    """max(average load, heaviest item on the least preloaded bins)."""
    pre = np.asarray(pre, dtype=np.float64)
    cost = np.asarray(cost, dtype=np.float64)
    width = np.asarray(width, dtype=np.int64)
    return _bound(pre, pre.tolist(), cost, cost.tolist(), width, width.tolist())


def _bound(pre: np.ndarray, pre_l: list, cost: np.ndarray, cost_l: list, width: np.ndarray, width_l: list) -> float:
    """:func:`lower_bound` of the arrays and their lists: the sums on the arrays (numpy's summation
    order), the maxima and the sort on the lists where the items are few (exact either way)."""
    B = len(pre_l)
    avg = (float(pre.sum()) + float((cost * width).sum())) / B if B else 0.0
    lb = max(avg, max(pre_l) if B else 0.0)
    if len(cost_l) > 64:  # (many items: the same sums, on arrays)
        lb = max(lb, float((cost + np.sort(pre)[width - 1]).max()))
    elif cost_l:
        srt = sorted(pre_l)
        lb = max(lb, max([c + srt[w - 1] for c, w in zip(cost_l, width_l)]))
    return lb


#: ``kinds`` of items: placed anywhere; a share of a ring (no bin with an exclusive item); exclusive
#: (only bins with neither a split nor another exclusive item)
LOCAL, SPLIT, EXCLUSIVE = 0, 1, 2


def greedy_pack(pre: np.ndarray, pre_tok: np.ndarray, cost: np.ndarray, tokens: np.ndarray,
                width: np.ndarray, cap: float, search: bool = True, tol: float = 0.0,
                by_tokens: bool = False, kinds: np.ndarray | None = None) -> PackResult:
    """LPT, then (``search``) local search unless LPT is already within ``tol`` of the bound.

    ``by_tokens``: each item goes to the bins with the most token room (ties: least loaded) instead
    of the least-loaded ones with room - the fallback when token-blind LPT leaves no room for an
    item although the bins hold enough tokens in total (the local search then evens the loads).
    ``kinds`` (per item: :data:`LOCAL`, :data:`SPLIT`, :data:`EXCLUSIVE`; None: all local): which
    items may share a bin. Exclusive items must be wider than one bin (they are placed first)."""
    t0 = time.perf_counter()
    pre = np.asarray(pre, dtype=np.float64)
    costs = np.asarray(cost, dtype=np.float64)
    tok_a = np.asarray(tokens, dtype=np.float64)
    widths = np.asarray(width, dtype=np.int64)
    B, m = len(pre), len(costs)
    # plain Python floats in the loop (numpy scalar indexing costs more than the arithmetic);
    # the same IEEE operations in the same order as on arrays
    pre_l, toks = pre.tolist(), np.asarray(pre_tok, dtype=np.float64).tolist()
    loads = list(pre_l)
    cost_l, tok_l, width_l = costs.tolist(), tok_a.tolist(), widths.tolist()
    # wide items first (they constrain most), each group by cost descending (stable: ties by index)
    if by_tokens:
        order = np.lexsort((-costs, -tok_a, -widths)).tolist() if m else []
    else:
        order = np.lexsort((-costs, -widths)).tolist() if m else []
    kind_l = None if kinds is None else np.asarray(kinds, dtype=np.int64).tolist()
    state = [LOCAL] * B  # per bin: LOCAL (no split nor exclusive item yet), SPLIT or EXCLUSIVE
    out = _lpt(order, loads, toks, cost_l, tok_l, width_l, cap, state, kind_l, by_tokens)
    lb = _bound(pre, pre_l, costs, cost_l, widths, width_l)
    if search and m and B and max(loads) > lb * (1.0 + tol):
        _search(out, loads, toks, cost_l, tok_l, width_l, cap, 4 * B + 50,
                None if kind_l is None else _barred(kind_l, state))
    mk = max(loads) if B else 0.0
    return PackResult(out, np.array(loads, dtype=np.float64), np.array(toks, dtype=np.float64), mk, lb,
                      time_s=time.perf_counter() - t0, greedy_makespan=mk)


def _lpt(order: list[int], loads: list, toks: list, cost_l: list, tok_l: list, width_l: list, cap: float,
         state: list, kind_l: list | None, by_tokens: bool) -> list[list[int]]:
    """:func:`greedy_pack`'s longest-processing-time placement, items in ``order``: a wide item on
    its least-loaded bins with room (``by_tokens``: most token room), a width-1 one on the
    least-loaded bin with room, each of a kind it may share (``state``, per bin, updated). ``loads``
    and ``toks`` (lists) are updated in place. Returns each item's bins."""
    out: list = [None] * len(order)
    tail = []  # (width-1 items of one kind, least loaded first, over many bins: placed in runs)
    if kind_l is None and not by_tokens and len(loads) > RUNS_MIN_BINS and order and width_l[order[-1]] == 1:
        wide = next(t for t, i in enumerate(order) if width_l[i] == 1)  # (wide items come first)
        order, tail = order[:wide], order[wide:]
    _lpt_items(order, out, loads, toks, cost_l, tok_l, width_l, cap, state, kind_l, by_tokens)
    if tail:
        rest = _lpt_tail(tail, out, loads, toks, cost_l, tok_l, cap)
        _lpt_items(rest, out, loads, toks, cost_l, tok_l, width_l, cap, state, kind_l, by_tokens)
    return out


def _lpt_tail(items: list[int], out: list, loads: list, toks: list, cost_l: list, tok_l: list,
              cap: float) -> list[int]:
    """:func:`_lpt`'s width-1 items of one kind over many bins, in runs (:func:`lpt_runs`): ``out``,
    ``loads`` and ``toks`` updated. Returns the items left to place one at a time."""
    load, tok, it = np.array(loads, dtype=np.float64), np.array(toks, dtype=np.float64), np.array(items)
    bins, k, failed = lpt_runs(load, tok, cap, np.array(cost_l, dtype=np.float64)[it],
                               np.array(tok_l, dtype=np.float64)[it])
    if failed:
        i = items[k]
        raise PackInfeasible(i, f"item {i} ({int(tok_l[i])} tokens) does not fit any bin")
    for i, b in zip(items[:k], bins[:k].tolist()):
        out[i] = [b]
    loads[:], toks[:] = load.tolist(), tok.tolist()
    return items[k:]


def _lpt_items(order: list[int], out: list, loads: list, toks: list, cost_l: list, tok_l: list, width_l: list,
               cap: float, state: list, kind_l: list | None, by_tokens: bool) -> None:
    """:func:`_lpt`'s placement of the items ``order``, one at a time (``out``, ``loads``, ``toks``
    and ``state`` updated)."""
    B = len(loads)
    key = toks if by_tokens else loads
    heap = [(key[b], b) for b in range(B)]
    heapq.heapify(heap)
    # bins without token room for the current item wait aside (fewest tokens first) and return to the
    # heap once an item small enough for them comes: a nearly full cluster of hundreds of bins
    # would otherwise have every item pop (and push back) every full bin
    aside: list[tuple[float, int]] = []
    split_heap, split_aside = None, []  # width-1 splits': no exclusive bin (built after the wide items)
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for i in order:
        w, c, k = width_l[i], cost_l[i], tok_l[i]
        kind = LOCAL if kind_l is None else kind_l[i]
        if w != 1:
            out[i] = _place_wide(i, w, c, k, kind, heap, split_heap, loads, toks, key, state, cap, by_tokens)
            continue
        if kind == LOCAL:
            h, a = heap, aside
        else:
            if kind == EXCLUSIVE:
                raise (ValueError(f"item {i}: an exclusive item spans more than one bin") if B else
                       PackInfeasible(i, f"item {i} needs 1 bins, only 0 exist"))
            if split_heap is None:
                split_heap = [(key[b], b) for b in range(B) if state[b] != EXCLUSIVE]
                heapq.heapify(split_heap)
            h, a = split_heap, split_aside
        # the least-loaded bin of ``h`` with room; bins without room wait in ``a`` until an item
        # small enough comes; entries whose key is no longer the bin's are stale and dropped
        while a and toks[a[0][1]] + k <= cap:
            b = pop(a)[1]
            push(h, (key[b], b))
        while h:
            ld, b = h[0]
            if ld != key[b]:
                pop(h)
            elif toks[b] + k <= cap:
                break
            else:
                pop(h)
                push(a, (toks[b], b))
        else:
            raise PackInfeasible(i, f"item {i} needs 1 bins, only 0 exist" if not B else
                                    f"item {i} ({int(k)} tokens) does not fit any bin"
                                    f"{' without an exclusive item' if kind == SPLIT else ''}")
        loads[b] += c
        toks[b] += k
        # the chosen bin's entry, still on top of ``h``, replaced with its new key (the heap then
        # pops in the same order as after a pop and a push, for one sift instead of two)
        replace(h, (key[b], b))
        if split_heap is not None:
            push(split_heap if h is heap else heap, (key[b], b))
        out[i] = [b]


#: beyond this many bins, width-1 items placed least loaded first take their bins in runs
#: (:func:`lpt_runs`); after :data:`RUNS_CHECK` runs of fewer than :data:`RUNS_MIN_MEAN` items
#: on average the caller places the rest item by item (a run costs a sort of the bins)
RUNS_MIN_BINS = 64
RUNS_CHECK = 64
RUNS_MIN_MEAN = 8


def lpt_runs(load: np.ndarray, tok: np.ndarray, room: float, cost: np.ndarray,
             tokens: np.ndarray) -> tuple[np.ndarray, int, bool]:
    """Items in order, each on the least loaded bin (by ``load``, ties: the lowest bin) with room
    for its ``tokens`` within ``room``, placed in runs: with the bins in (load, bin) order, the
    next items take the first bins in turn for as long as each next bin is still, strictly, the
    least loaded with room - its load below every load the run has made (an equal one stops the
    run: its tie would go to the lower bin) and room for its item. The same choices and additions
    as one item at a time. ``load`` and ``tok`` (arrays) are updated in place. Returns (each item's
    bin, ``k``, failed): ``k`` items placed; failed: item ``k`` fits no bin; else where ``k`` falls
    short of the items, runs stayed short and the caller places the rest."""
    n, B = len(cost), len(load)
    out = np.empty(n, dtype=np.int64)
    k = runs = 0
    while k < n:
        runs += 1
        if runs > RUNS_CHECK and k < RUNS_MIN_MEAN * runs:
            return out, k, False
        by_load = np.argsort(load, kind="stable")[:min(B, n - k)]
        lo, sz = load[by_load], tokens[k:k + len(by_load)]
        new = lo + cost[k:k + len(by_load)]
        ok = tok[by_load] + sz <= room
        ok[1:] &= lo[1:] < np.minimum.accumulate(new)[:-1]
        j = len(ok) if ok.all() else int(np.argmin(ok))
        if j == 0:  # (the least loaded bin has no room for it: the least loaded with room)
            fits = tok + tokens[k] <= room
            if not fits.any():
                return out, k, True
            j, by_load = 1, np.array([int(np.argmin(np.where(fits, load, np.inf)))])
            new, sz = load[by_load] + cost[k], tokens[k:k + 1]
        out[k:k + j] = by_load[:j]
        load[by_load[:j]] = new[:j]
        tok[by_load[:j]] += sz[:j]
        k += j
    return out, k, False


def _place_wide(i: int, w: int, c: float, k: float, kind: int, heap: list, split_heap: list | None,
                loads: list, toks: list, key: list, state: list, cap: float, by_tokens: bool) -> list[int]:
    """:func:`_lpt`'s placement of item ``i`` over ``w`` bins (:func:`_wide_bins`): ``loads``,
    ``toks``, ``state`` and the heaps updated. Returns its bins."""
    B = len(loads)
    if w > B:
        raise PackInfeasible(i, f"item {i} needs {w} bins, only {B} exist")
    sel = (_wide_bins_heap(i, w, k, kind, heap, toks, state, cap) if B > WIDE_HEAP_MIN_BINS
           and not by_tokens else _wide_bins(i, w, k, kind, loads, toks, state, cap, by_tokens))
    for b in sel:
        loads[b] += c
        toks[b] += k
        heapq.heappush(heap, (key[b], b))
        if kind != LOCAL:
            state[b] = kind
        if split_heap is not None:
            heapq.heappush(split_heap, (key[b], b))
    return sel


def _wide_bins(i: int, w: int, k: float, kind: int, loads: list, toks: list, state: list, cap: float,
               by_tokens: bool) -> list[int]:
    """The ``w`` bins (ascending) item ``i`` of :func:`greedy_pack` takes: the least loaded (or,
    ``by_tokens``, those with the most token room) with room for its ``k`` tokens and, by its kind,
    no exclusive item (a split) or neither kind (an exclusive item); ties: lowest bin."""
    if kind == LOCAL:
        cand = [b for b in range(len(toks)) if toks[b] + k <= cap]
    else:
        bar = EXCLUSIVE if kind == SPLIT else SPLIT
        cand = [b for b in range(len(toks)) if toks[b] + k <= cap and state[b] < bar]
    if len(cand) < w:
        raise _too_few_bins(i, w, k, kind, len(cand))
    if by_tokens:
        return sorted(sorted(cand, key=lambda b: (toks[b], loads[b]))[:w])
    return sorted(sorted(cand, key=loads.__getitem__)[:w])  # least loaded; ties: lowest bin


#: beyond this many bins (0: at every size), :func:`greedy_pack` takes a wide item's bins from its
#: heap (:func:`_wide_bins_heap`) instead of scanning every bin for each item; the scan remains for
#: ``by_tokens`` and as the reference the heap's choice is tested against
WIDE_HEAP_MIN_BINS = 0


def _wide_bins_heap(i: int, w: int, k: float, kind: int, heap: list, toks: list, state: list,
                    cap: float) -> list[int]:
    """:func:`_wide_bins` (not ``by_tokens``) from :func:`greedy_pack`'s heap of ``(load, bin)``:
    entries pop in the order the scan sorts its candidates (load, then bin), so the first ``w``
    bins with room and of an allowed kind are its choice, without visiting the others. Valid while
    the heap holds exactly one entry per bin, its load: the wide items come first (before any bin
    is set aside), the bins passed over go back as they were, and the caller pushes the chosen ones
    back with their new loads."""
    bar = None if kind == LOCAL else EXCLUSIVE if kind == SPLIT else SPLIT
    sel: list[int] = []
    passed: list[tuple[float, int]] = []
    while heap and len(sel) < w:
        entry = heapq.heappop(heap)
        b = entry[1]
        if toks[b] + k <= cap and (bar is None or state[b] < bar):
            sel.append(b)
        else:
            passed.append(entry)
    for e in passed:
        heapq.heappush(heap, e)
    if len(sel) < w:  # (the heap is spent: every bin was seen, ``sel`` is all that have room)
        raise _too_few_bins(i, w, k, kind, len(sel))
    return sorted(sel)


def _too_few_bins(i: int, w: int, k: float, kind: int, have: int) -> PackInfeasible:
    """The error of a wide item ``i`` for which only ``have`` bins have room (and allow its kind)."""
    return PackInfeasible(i, f"item {i} needs {w} bins with {int(k)} tokens of room"
                             f"{('', ' and no exclusive item', ' and no split item')[kind]}, {have} have it")


def grouped_by_bin(bin_of: np.ndarray, bins: int) -> np.ndarray:
    """The positions of ``bin_of`` (a bin in ``0..bins-1`` per item) grouped by bin, each bin's in
    item order: a stable sort, by radix on 16-bit bin numbers."""
    return np.argsort(bin_of.astype(np.uint16) if bins <= 1 << 16 else bin_of, kind="stable")


def _barred(kinds: list[int], state: list[int]):
    """``(item, bin)`` -> whether the item may not move to the bin (:func:`_search`): split items
    stay off exclusive bins."""
    excl = {b for b, s in enumerate(state) if s == EXCLUSIVE}
    if not excl:
        return None
    return lambda i, b: kinds[i] == SPLIT and b in excl


def _search(out: list, ld: list, tk: list, cost: list, tokens: list, width: list, cap: float, max_iter: int,
            barred) -> None:
    """Move or swap width-1 items off the most loaded bin while the maximum drops (at most
    ``max_iter`` times): ``ld``, ``tk`` (the bins' loads and tokens, plain floats: numpy scalar
    indexing costs more than the arithmetic) and ``out`` updated in place; ``barred(item, bin)``:
    moves not allowed."""
    B = len(ld)
    if B < 2:
        return
    members = _members(out, width, B)

    def shift(i: int, a: int, b: int) -> None:  # item i from bin a to bin b
        members[a].remove(i)
        members[b].append(i)
        out[i] = [b]
        ld[a] -= cost[i]
        ld[b] += cost[i]
        tk[a] -= tokens[i]
        tk[b] += tokens[i]

    by_load = ld.__getitem__
    for _ in range(max_iter):
        # the most loaded bin (the first of equal maxima) and the 8 least loaded, equal loads in bin
        # order: a stable order (numpy's default argsort orders ties by whatever sorting network
        # the CPU's vector units select, so plans would differ from one machine to another)
        if B <= 64:
            hi = max(range(B), key=by_load)
            # (what heapq.nsmallest does when it is asked for all of them: a stable sort)
            lows = sorted(range(B), key=by_load) if B <= 8 else heapq.nsmallest(8, range(B), key=by_load)
        else:
            arr = np.array(ld)
            hi = int(np.argmax(arr))
            lows = np.argsort(arr, kind="stable")[:8].tolist()
        best = _best_exchange(hi, lows, members, ld, tk, cost, tokens, cap, barred)
        if best is None:
            break
        i, j, lo = best
        shift(i, hi, lo)
        if j is not None:
            shift(j, lo, hi)


class _LazyMembers(dict):
    """Per bin, its width-1 items in item order, each bin's found (``np.flatnonzero`` over the items'
    first bins) when the search first looks at it: over many bins it looks at few. A bin's list,
    once found, is kept up to date by the search's moves; a bin not looked at yet has had none."""

    def __init__(self, first: np.ndarray):
        super().__init__()
        self.first = first

    def __missing__(self, b: int) -> list[int]:
        got = self[b] = np.flatnonzero(self.first == b).tolist()
        return got


def _members(out: list, width: list, B: int):
    """Per bin, the width-1 items on it in item order (what :func:`_search` moves): a list of
    lists, or over more than 64 bins a :class:`_LazyMembers`."""
    if B > 64 and 0 not in width:
        first = np.array([bs[0] for bs in out], dtype=np.int64)
        first[np.asarray(width, dtype=np.int64) != 1] = -1
        return _LazyMembers(first)
    members: list[list[int]] = [[] for _ in range(B)]
    for i, bs in enumerate(out):
        if width[i] == 1:
            members[bs[0]].append(i)
    return members


def _best_exchange(hi: int, lows: list[int], members: list, ld: list, tk: list, cost: list, tokens: list,
                   cap: float, barred):
    """:func:`_search`'s step: for the first of ``lows`` (in order) where one helps, the move of an
    item off ``hi`` or the swap of one there with one on it that lowers the pair's maximum most,
    as ``(item, swapped item or None, low bin)``; None: none helps."""
    top = ld[hi]
    for lo in lows:
        if lo == hi:
            continue
        diff = top - ld[lo]
        if diff <= 1e-12:
            break
        # best single move: item with cost closest to diff/2, not exceeding diff
        best, best_gain = None, 1e-12
        t_lo = tk[lo]
        for i in members[hi]:
            c = cost[i]
            if c < diff and t_lo + tokens[i] <= cap:
                gain = min(c, diff - c)
                if gain > best_gain and not (barred is not None and barred(i, lo)):
                    best, best_gain = (i, None, lo), gain
        # best swap: i from hi, j from lo with 0 < c_i - c_j < diff
        if len(members[hi]) * len(members[lo]) <= 4096:
            for i in members[hi]:
                ci = cost[i]
                for j in members[lo]:
                    d = ci - cost[j]
                    if 0 < d < diff:
                        gain = min(d, diff - d)
                        if gain > best_gain and tk[lo] - tokens[j] + tokens[i] <= cap \
                                and tk[hi] - tokens[i] + tokens[j] <= cap \
                                and not (barred is not None and (barred(i, lo) or barred(j, hi))):
                            best, best_gain = (i, j, lo), gain
        if best is not None:
            return best
    return None


def ilp_pack(pre: np.ndarray, pre_tok: np.ndarray, cost: np.ndarray, tokens: np.ndarray, width: np.ndarray,
             cap: float, incumbent: PackResult, limits: SolveLimits | None = None, solver: str = "highs") -> PackResult:
    """Solve the packing MILP; return the better of its solution and ``incumbent``.

    ``limits``: deterministic work limits per solve (:mod:`zeppelin.planner.core.solver`).
    ``solver``: ``highs`` (falls back to CBC when HiGHS is missing or crashes; hitting a limit keeps
    the greedy incumbent) or ``cbc``. The result records which solver produced it, the solver
    status, its MIP gap, the branch-and-bound nodes used and any fallback.
    """
    import pulp

    limits = limits or SolveLimits()
    t0 = time.perf_counter()
    B, m = len(pre), len(cost)
    prob = pulp.LpProblem("zeppelin_pack", pulp.LpMinimize)
    C = prob.add_variable("C", lowBound=0, upBound=float(incumbent.makespan))
    x = {(i, b): prob.add_variable(f"x_{i}_{b}", cat="Binary") for i in range(m) for b in range(B)}
    prob += C
    for i in range(m):
        prob += pulp.lpSum(x[i, b] for b in range(B)) == int(width[i])
    for b in range(B):
        prob += float(pre[b]) + pulp.lpSum(float(cost[i]) * x[i, b] for i in range(m)) <= C
        prob += pulp.lpSum(float(tokens[i]) * x[i, b] for i in range(m)) <= float(cap) - float(pre_tok[b])
    # symmetry breaking is unsafe with unequal preloads; the greedy solution is the warm start
    start = {x[i, b]: (1.0 if b in bs else 0.0) for i, bs in enumerate(incumbent.bins) for b in range(B)}
    start[C] = float(incumbent.makespan)

    tried: list[str] = []
    res = None
    nodes = 0
    wall = False
    try:
        r = solve_pulp(prob, limits, start, solver=solver)
    except RuntimeError as e:  # no solver could run
        r = None
        tried.append(str(e))
    if r is not None:
        nodes, wall = r.nodes, r.wall_clock_hit
        if r.has_solution:
            bins = [[b for b in range(B) if (x[i, b].value() or 0) > 0.5] for i in range(m)]
            ok = all(len(bins[i]) == int(width[i]) for i in range(m))
            if ok:
                loads = np.array(pre, dtype=np.float64)
                toks = np.array(pre_tok, dtype=np.float64)
                for i, bs in enumerate(bins):
                    for b in bs:
                        loads[b] += cost[i]
                        toks[b] += tokens[i]
                if (toks <= cap + 1e-6).all():
                    res = PackResult(bins, loads, toks, float(loads.max()), incumbent.lower_bound, solver=r.solver,
                                     status=r.status, ilp_gap=r.gap, greedy_makespan=incumbent.greedy_makespan,
                                     nodes=nodes, ilp_runs=1)
            if res is None:
                tried.append(f"{r.solver} returned an inconsistent solution ({r.status})")
        elif r.status == INFEASIBLE:
            # the cutoff C <= greedy makespan plus optimality: greedy is optimal up to tolerance
            tried.append(f"{r.solver}: no solution better than greedy ({r.status})")
        else:
            tried.append(f"{r.solver}: {r.status} without a feasible solution")
    elapsed = time.perf_counter() - t0
    if res is None or res.makespan > incumbent.makespan * (1 + 1e-9):
        inc = PackResult(incumbent.bins, incumbent.loads, incumbent.tokens, incumbent.makespan,
                         incumbent.lower_bound, solver="greedy", status=WALL_CLOCK if wall else "ok",
                         time_s=incumbent.time_s + elapsed, greedy_makespan=incumbent.greedy_makespan,
                         fallback_reason="; ".join(tried) or "ILP did not improve on greedy", nodes=nodes,
                         ilp_runs=1)
        return inc
    res.time_s = incumbent.time_s + elapsed
    if tried:
        res.fallback_reason = "; ".join(tried)
    return res


def pack(pre, pre_tok, cost, tokens, width, cap: float, *, ilp: str = "auto", limits: SolveLimits | None = None,
         tol: float = 0.01, max_ilp_vars: int = 1200, solver: str = "highs", kinds=None) -> PackResult:
    """Greedy, then the ILP where it pays.

    ``ilp``: ``auto`` (ILP when greedy's gap to the lower bound exceeds ``tol`` and the model has
    at most ``max_ilp_vars`` binaries), ``always`` (any size), ``never``. ``kinds``: which items
    may share a bin (:func:`greedy_pack`); the ILP does not model them, so it does not run then.
    """
    pre = np.asarray(pre, dtype=np.float64)
    pre_tok = np.asarray(pre_tok, dtype=np.float64)
    cost = np.asarray(cost, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    width = np.asarray(width, dtype=np.int64)
    try:
        g = greedy_pack(pre, pre_tok, cost, tokens, width, cap, tol=tol / 4, kinds=kinds)
    except PackInfeasible as e:
        # token-blind LPT filled some bins unevenly: place by token room instead
        g = greedy_pack(pre, pre_tok, cost, tokens, width, cap, tol=tol / 4, by_tokens=True, kinds=kinds)
        g.notes.append(f"placed by token room ({e})")
    if ilp == "never" or len(cost) == 0 or kinds is not None:
        return g
    nvars = len(cost) * len(pre)
    if ilp == "auto":
        if g.gap <= tol:
            return g
        if nvars > max_ilp_vars:
            g.fallback_reason = f"ILP skipped: {nvars} binaries > {max_ilp_vars} (greedy used)"
            return g
    return ilp_pack(pre, pre_tok, cost, tokens, width, cap, g, limits=limits, solver=solver)
