"""Candidate family ``long-blocks``: per micro-batch, each long sequence on a usp group of whole
nodes - any number of them, as many as that micro-batch's level asks - and the short sequences
dealt over every unit of every micro-batch so that each micro-batch comes out even.

Micro-batches are coupled (docs/CONCEPTS.md, "Micro-batch coupling"): every unit of a shard group
waits for the slowest at every layer, so a step costs the sum over its micro-batches of the slowest
unit's time and a plan is as good as each of its micro-batches is even. The other families keep a
group's units for the whole step and give a long sequence a power-of-two block of nodes. On a step
whose long sequences do not divide evenly into its micro-batches (three 128K-token sequences and
some short ones, in two micro-batches because the step's tokens do not fit the units' memory at
once) that leaves a micro-batch with one long sequence on half the nodes and the short ones on the
other half: half the cluster waits. Here the lone long sequence takes five nodes of eight, say, and
the short sequences fill every unit to the same level.

A configuration: which long sequences go to which micro-batch, and the width in nodes of each of
them there. The micro-batch counts tried are the fewest whose tokens fit the units' memory and
whose long sequences fit side by side, and the next that does; the long sequences are spread
(longest first to the micro-batch with the fewest long tokens) or packed (as many to a
micro-batch as fit side by side, the later micro-batches left to the short sequences; or only
those at least half as long as the longest packed, the others dealt to the micro-batch with the
least long work) (:func:`_deals`). The short sequences then, most expensive first, go whole to a
unit (or to a Ulysses group inside a node, whichever raises the slowest unit least) of the
micro-batch where they raise that micro-batch's slowest unit least (ties: the smaller area, the
least-loaded place, then the lowest), within each unit's memory. The score, the family's own
estimate of the step, is the sum over micro-batches of their slowest unit; while configurations
are searched only the :data:`EXACT` most expensive short sequences are placed and the rest are
priced as a fluid (:func:`_fluid`), and the configurations kept are laid out in full. The widths
are searched from a level shared by every micro-batch (each long sequence on the fewest nodes
where its time per unit is at most the level; the levels are the longest sequence's times at each
width): from the :data:`STARTS` best, one micro-batch's widths at a time (``B`` nodes dealt one by
one to its long sequence that is slowest per unit; beyond :data:`SCAN_CHOICES` choices, from its
current ``B`` one node fewer or more at a time) while that lowers the score. The best few are built
and ranked by the prediction (:func:`.common.ranked_by_prediction`).

Under ``--recompute auto`` (the pass without recomputation, ``PlanContext.unit_recompute``) a unit
may hold more than its memory share, up to what it holds under ``selective``, paying the forward of
the fewest layers whose full recomputation fits it (:class:`_Headroom`): on long steps the units
beside the long sequences fill their memory with short ones while their compute is the lightest,
and a few layers recomputed there let them take short sequences off the slowest units. The plan's
units over their capacity then take that choice each (``recompute.assign``) before it is ranked.

A sequence is long when it fits no group inside a node, or on its best one it alone takes more than
:data:`LONG_SHARE` of the step's average load per unit; where the step needs several micro-batches,
the configurations are also searched with the sequences long against one micro-batch's average
load. Steps without a long sequence get no candidate (one pass over the lengths).
"""

from __future__ import annotations

import math

import numpy as np

from zeppelin.planner.core.base import PlanContext, PlanningError
from zeppelin.planner.core.builder import StepBuilder
from zeppelin.planner.costmodel.predict import usp_row_sizes
from zeppelin.planner.zeppelin.families.common import (
    ceil_div,
    finish_routed,
    intra_types,
    ranked_by_prediction,
    token_slope,
    usp_seq_time,
)
from zeppelin.planner.zeppelin.protocols import Candidate
from zeppelin.planner.zeppelin.recompute import assign
from zeppelin.schemas.layout import split_even
from zeppelin.schemas.plan import Sequence

name = "long-blocks"
#: a sequence is long when on its best group inside a node it alone takes more than this share of
#: the step's average load per unit
LONG_SHARE = 0.5
#: short sequences placed one by one while configurations are scored (the most expensive; the rest
#: as a fluid, :func:`_layout`); the configurations kept are laid out in full
EXACT = 16
#: the best shared levels from which each micro-batch's widths are searched on
STARTS = 2
_EPS = 1e-9
#: a micro-batch with at most this many width choices has every one scored in the descent; one with
#: more (a cluster of more nodes) walks from its current choice (:func:`_walk`)
SCAN_CHOICES = 16
#: the walk stops this many choices past the best it has found
WALK_PATIENCE = 3


def candidates(ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
               routing: bool = True, top: int = 2) -> list[Candidate]:
    """The family's best ``top`` configurations (``limit``: none scored above it)."""
    return long_blocks(ctx, step, sequences, limit=limit, routing=routing, top=top)


def long_blocks(ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
                routing: bool = True, top: int = 2) -> list[Candidate]:
    n, upn = ctx.num_units, ctx.units_per_node
    nodes = n // upn if upn else 0
    if nodes < 2 or n % upn or not usp_row_sizes(ctx):
        return []
    L = np.array([s.length for s in sequences], dtype=np.int64)
    intra = intra_types(ctx, L)
    cap = ctx.cost.token_capacity
    m0 = max(1, int(ceil_div(int(L.sum()), max(n * cap, 1))))
    sets = [_long(L, intra, n, LONG_SHARE)]
    if not sets[0]:
        return []
    if m0 > 1:  # against a micro-batch's load, more sequences may be long
        more = _long(L, intra, n, LONG_SHARE / m0)
        if more != sets[0]:
            sets.append(more)
    cheapest = _cheapest(intra, range(len(L)))
    order = sorted(range(len(L)), key=lambda i: (-cheapest[i], i))
    groups = _Groups(intra, n, L, order)
    blocks = _block_times(ctx, L, sets[-1], nodes)
    keep = _search(ctx, L, sets, m0, nodes, blocks, groups, limit, top, None)
    headroom = _Headroom.of(ctx)
    if headroom is not None:  # (the layouts within the capacity stay candidates: the judge decides)
        keep += _search(ctx, L, sets, m0, nodes, blocks, groups, limit, top, headroom)

    def build(key, room):
        layout = _layout(ctx, key[0], key[1], blocks, groups, headroom=room)
        if layout is None:
            raise PlanningError(f"{name}: a short sequence fits nowhere beside the long ones")
        return _build(ctx, step, sequences, layout[1], routing, room)

    return ranked_by_prediction(ctx, [(t, a, (lambda key=key, room=room: build(key, room)))
                                      for a, (t, key, room) in enumerate(keep)])


def _search(ctx: PlanContext, L: np.ndarray, sets: list[list[int]], m0: int, nodes: int, blocks, groups: _Groups,
            limit: float | None, top: int, headroom: _Headroom | None) -> list[tuple]:
    """The ``top`` best configurations ``(score, key, headroom)`` (``limit``: none scored above it),
    laid out with ``headroom`` (None: within every unit's capacity)."""
    found: dict[tuple, tuple | None] = {}  # (long sequences per micro-batch, their widths) -> (score, layout)

    def score(key) -> float:
        if key not in found:
            found[key] = _layout(ctx, key[0], key[1], blocks, groups, EXACT, headroom)
        return found[key][0] if found[key] is not None else float("inf")

    for longs in sets:
        extra = [i for i in longs if i not in sets[0]]
        deals: list[tuple] = []
        for m in range(m0, max(m0, len(longs)) + 1):
            fit = [p for p in _deals(L, sets[0], extra, m, blocks, nodes)
                   if all(_mb_options(q, blocks, nodes) for q in p)]
            deals += [p for p in fit if p not in deals]  # (else its long sequences do not fit side by side)
            if len({len(p) for p in deals}) == 2:
                break
        for parts in deals:
            m = len(parts)
            choices = [_mb_options(part, blocks, nodes) for part in parts]
            starts = []
            for lv in sorted({t for t, _, _ in blocks[longs[0]].values()}):  # (the longest's widths)
                widths = _widths(parts, blocks, [lv] * m, nodes)
                if widths is not None:
                    starts.append((score((parts, widths)), (parts, widths)))
            for _, key in sorted(starts, key=lambda x: (x[0], _order(x[1])))[:STARTS]:
                _descend(key, choices, score)
    ok = sorted(((v[0], k) for k, v in found.items() if v is not None), key=lambda x: (x[0], _order(x[1])))
    if limit is not None:
        ok = [x for x in ok if x[0] <= limit]
    return [(t, key, headroom) for t, key in ok[:top]]


def _order(key: tuple) -> tuple:
    """A configuration's place among equal scores: fewer micro-batches, then narrower blocks, then
    the long sequences' micro-batches."""
    parts, widths = key
    return (len(parts), tuple(w for mb in widths for w in mb), parts)


def _long(L: np.ndarray, intra, n: int, share: float) -> list[int]:
    """Indices of the sequences that fit no group inside a node or on their best one alone take
    more than ``share`` of the step's average load per unit, longest first."""
    sizes, cost, fits, _, _ = intra
    best = np.full(len(L), np.inf)
    area = np.full(len(L), np.inf)
    for s in sizes:
        best = np.minimum(best, np.where(fits[s], cost[s], np.inf))
        area = np.minimum(area, s * cost[s])  # (a sequence no group holds: its area as if one did)
    avg = float(area.sum()) / n
    out = [i for i in range(len(L)) if not np.isfinite(best[i]) or best[i] > share * avg]
    return sorted(out, key=lambda i: (-int(L[i]), i))


def _cheapest(intra, idx) -> dict[int, float]:
    """Per sequence of ``idx``, its time on its cheapest group type inside a node that holds it."""
    sizes, cost, fits, _, _ = intra
    return {i: min((float(cost[s][i]) for s in sizes if fits[s][i]), default=float("inf")) for i in idx}


def _block_times(ctx: PlanContext, L: np.ndarray, longs: list[int], nodes: int) -> dict[int, dict]:
    """Per long sequence, per width in nodes (2 and up) on which its share fits: ``(time per unit,
    u, memory share per unit)`` on its cheapest usp group of that many nodes (rows of u units)."""
    cm, upn, layers = ctx.cost, ctx.units_per_node, ctx.model.num_layers
    T_avg = max(float(L.sum()) / ctx.num_units, 2.0)
    rows = usp_row_sizes(ctx)
    slopes = {u: token_slope(ctx, cm, T_avg, u, "intra") for u in rows}
    caps = {u: cm.ulysses_capacity(u) for u in rows}
    memo: dict[int, dict] = {}
    out = {}
    for i in longs:
        length = int(L[i])
        if length not in memo:
            per = {}
            for w in range(2, nodes + 1):
                S = w * upn
                best = None
                for u in rows:
                    cap_u = caps[u]
                    held = _usp_max_tokens(length, u, S // u)
                    if held > cap_u:
                        continue
                    t = layers * float(usp_seq_time(cm, np.array([float(length)]), u, S // u)[0]) + slopes[u] * length / S
                    if best is None or t < best[0]:
                        best = (t, u, held / max(cap_u, 1))
                if best is not None:
                    per[w] = best
            memo[length] = per
        out[i] = memo[length]
    return out


def _usp_max_tokens(length: int, u: int, r: int) -> int:
    """The most tokens a unit of a usp group of u x r holds of a sequence (``usp_ranges``' zigzag cut:
    row i holds chunks i and 2r-1-i of 2r near-equal ones, unit j the j-th of u near-equal parts of
    each; the first unit of a row gets the larger part of both)."""
    if r == 1:
        return -(-length // u)
    chunks = split_even(length, 2 * r)
    return max(-(-chunks[i] // u) + -(-chunks[2 * r - 1 - i] // u) for i in range(r))


def _deals(L: np.ndarray, base: list[int], extra: list[int], m: int, blocks, nodes: int) -> list[tuple]:
    """Ways to put the long sequences in ``m`` micro-batches. The ``base`` ones spread (longest first
    to the micro-batch with the fewest long tokens; ties: the lower), or packed (in order, as many to
    a micro-batch as fit side by side on their narrowest blocks, the micro-batches left holding
    short sequences only), or those at least half as long as the longest packed and the rest of
    them taken with ``extra``; then each of ``extra`` to the micro-batch whose long sequences take
    the least time on their narrowest blocks where it fits beside them (a deal where it fits nowhere
    is dropped)."""
    spread: list[list[int]] = [[] for _ in range(m)]
    tok = [0] * m
    for i in base:
        k = min(range(m), key=lambda k: (tok[k], k))
        spread[k].append(i)
        tok[k] += int(L[i])
    variants = [(spread, extra)]
    top = int(L[base[0]])
    for heavy in (base, [i for i in base if 2 * int(L[i]) >= top]):
        packed: list[list[int]] = [[] for _ in range(m)]
        k, used = 0, 0
        for i in heavy:
            w = min(blocks[i]) if blocks[i] else nodes + 1
            if used + w > nodes and packed[k] and k + 1 < m:
                k, used = k + 1, 0
            packed[k].append(i)
            used += w
        variants.append((packed, [i for i in base if i not in heavy] + extra))
    out: list[tuple] = []
    for parts, later in variants:
        narrow = [[min(blocks[i]) if blocks[i] else nodes + 1 for i in p] for p in parts]
        work = [sum(blocks[i][w][0] * w for i, w in zip(p, ws) if blocks[i]) for p, ws in zip(parts, narrow)]
        parts = [list(p) for p in parts]
        for i in later:
            w = min(blocks[i]) if blocks[i] else nodes + 1
            room = [k for k in range(m) if sum(narrow[k]) + w <= nodes]
            if not room:
                break
            k = min(room, key=lambda k: (work[k], k))
            parts[k].append(i)
            narrow[k].append(w)
            work[k] += blocks[i][w][0] * w
        else:
            deal = tuple(tuple(p) for p in parts)
            if deal not in out:
                out.append(deal)
    return out


def _mb_options(part, blocks, nodes: int) -> list[tuple]:
    """A micro-batch's width choices for its long sequences: for every ``B`` from the fewest nodes
    that hold them side by side to all, ``B`` nodes dealt one at a time to the sequence that is
    slowest per unit on its width so far (the widths whose slowest is fastest)."""
    if not part:
        return [()]
    if not all(blocks[i] for i in part):
        return []
    ws = [min(blocks[i]) for i in part]
    if sum(ws) > nodes:
        return []
    out = [tuple(ws)]
    while sum(ws) < nodes:
        grow = [j for j, i in enumerate(part) if ws[j] + 1 in blocks[i]]
        if not grow:
            break
        j = max(grow, key=lambda j: (blocks[part[j]][ws[j]][0], -j))
        ws[j] += 1
        out.append(tuple(ws))
    return out


def _descend(key: tuple, choices: list[list[tuple]], score) -> None:
    """Coordinate descent from ``key`` over the micro-batches' width choices: per micro-batch in
    turn, its best choice with the others fixed, while one improves the score. A micro-batch's
    choices give its long sequences one node more each; up to :data:`SCAN_CHOICES` of them every
    one is scored. Beyond (clusters of more nodes), the score mostly falls while the long sequences
    gain more than the short ones lose, then rises, so the descent walks from the current choice
    down or up (:func:`_walk`); a current choice not among them (a start from a shared level) is
    compared with all of them."""
    parts, widths = key
    best = score(key)
    improved = True
    while improved:
        improved = False
        for k, opts in enumerate(choices):
            if len(opts) > SCAN_CHOICES and widths[k] in opts:
                t, widths = _walk(parts, widths, k, opts, best, score)
            else:
                t = best
                for ws in opts:
                    cand = (parts, widths[:k] + (ws,) + widths[k + 1:])
                    s = score(cand)
                    if s < t * (1 - _EPS):
                        t, widths = s, cand[1]
            if t < best:
                best, improved = t, True


def _walk(parts, widths, k: int, opts: list[tuple], best: float, score) -> tuple[float, tuple]:
    """From micro-batch ``k``'s current choice in ``opts``, the choices down, else up, one at a
    time: the best of them, the walk stopping :data:`WALK_PATIENCE` choices past it (the score is
    not smooth: the short sequences are placed whole): ``(score, widths)``."""
    here = opts.index(widths[k])
    for step in (-1, 1):
        q, moved, misses = here + step, False, 0
        while 0 <= q < len(opts):
            cand = (parts, widths[:k] + (opts[q],) + widths[k + 1:])
            t = score(cand)
            if t < best * (1 - _EPS):
                best, widths, moved, misses = t, cand[1], True, 0
            else:
                misses += 1
                if misses >= WALK_PATIENCE:
                    break
            q += step
        if moved:
            break
    return best, widths


def _widths(parts, blocks, levels: list[float], nodes: int):
    """Per micro-batch the width (nodes) of each long sequence: the fewest on which its time per
    unit is at most the micro-batch's level (the widest it fits where none is); None where a
    micro-batch's blocks exceed the nodes or a sequence fits no width."""
    out = []
    for part, lv in zip(parts, levels):
        ws = []
        for i in part:
            per = blocks[i]
            if not per:
                return None
            ok = [w for w in sorted(per) if per[w][0] <= lv * (1 + _EPS)]
            ws.append(ok[0] if ok else max(per))
        if sum(ws) > nodes:
            return None
        out.append(tuple(ws))
    return tuple(out)


def _layout(ctx: PlanContext, parts, widths, blocks, groups: "_Groups", exact: int | None = None,
            headroom: _Headroom | None = None):
    """``(score, layout)`` of one configuration (module docstring), or None where a short sequence
    fits nowhere. ``layout``: the placements (micro-batch, kind, units, sequence, usp shape) and the
    long sequences' ``widths``; ``groups``: the short sequences and the places they may take
    (:class:`_Groups`). ``exact``: place only that many short sequences (the most expensive) and
    score the rest as a fluid - their cheapest time fills the micro-batches' room below their
    slowest units first, then raises them all evenly - where their tokens fit the units' room (else
    None); the layout then places only those. ``headroom``: units may hold more than their
    memory share, each paying its recomputation (:class:`_Headroom`; None: they may not)."""
    upn = ctx.units_per_node
    m = len(parts)
    sizes = groups.sizes
    tops, fulls, top, full, off, size_of, mb_of = groups.empty(m)
    loads, mem = tops[1], fulls[1]
    places = []
    for k, (part, ws) in enumerate(zip(parts, widths)):
        node = 0
        for i, w in zip(part, ws):
            t, u, share = blocks[i][w]
            lo, hi = node * upn, (node + w) * upn
            node += w
            loads[k, lo:hi] += t
            mem[k, lo:hi] += share
            places.append((k, "usp", list(range(lo, hi)), i, (u, w * upn // u)))
    for s in sizes[1:]:
        tops[s][:] = loads.reshape(m, -1, s).max(axis=2)
        fulls[s][:] = mem.reshape(m, -1, s).max(axis=2)
    mx = loads.max(axis=1)
    placed, fluid = groups.short(frozenset(i for part in parts for i in part), exact)
    times, shares, areas = groups.times, groups.shares, groups.areas
    count = [tops[q].shape[1] for q in sizes]  # groups per micro-batch, per size
    at_mx = mx[mb_of]  # per group, its micro-batch's slowest unit
    for i in placed:
        # the place where it raises its micro-batch's slowest unit least; ties: the smaller area (time
        # x units), the lower load there, the smaller group, the first group
        t_i, sh_i = groups.spread(m, i)
        new = top + t_i
        if headroom is None:
            new[full + sh_i > 1 + _EPS] = np.inf
        else:  # (a unit over its capacity pays its recomputation)
            new = headroom.load(new, full + sh_i)
        inc = np.maximum(new - at_mx, 0.0)
        least = float(inc.min())
        if not math.isfinite(least):
            return None
        tied = np.flatnonzero(inc <= least)
        if len(tied) > 1:
            area_t = areas[:, i][size_of[tied]]
            tied = tied[area_t <= area_t.min()]
            tied = tied[new[tied] <= new[tied].min()]
        g = int(tied[0])
        j = int(size_of[g])
        s, c, sh, load = sizes[j], float(times[j, i]), float(shares[j, i]), float(new[g])
        k, blk = divmod(g - int(off[j]), count[j])
        lo, hi = blk * s, (blk + 1) * s
        held = full[g] + sh
        for jq, q in enumerate(sizes):  # a group inside the new one gains as much; one holding it, at most its load
            base = int(off[jq]) + k * count[jq]
            if q <= s:
                top[base + lo // q:base + hi // q] += c
                full[base + lo // q:base + hi // q] += sh
            else:
                top[base + lo // q] = max(top[base + lo // q], load)
                full[base + lo // q] = max(full[base + lo // q], held)
        if load > mx[k]:
            mx[k] = load
            at_mx[mb_of == k] = load
        places.append((k, "ulysses" if s > 1 else "local", list(range(lo, hi)), i, None))
    score = float((loads if headroom is None else headroom.load(loads, mem)).max(axis=1).sum())
    if fluid:
        score += _fluid(*fluid, groups.unit_capacity, loads, mem, mx)
        if not np.isfinite(score):
            return None
    return score, {"places": places, "widths": widths}


class _Groups:
    """The short sequences (``order``: most expensive first) and the group types inside a node
    (:func:`.common.intra_types`) as arrays, sizes ascending: per size, each sequence's time on one
    group (inf where it does not fit), its share of a unit's memory and its area (time x units);
    and per micro-batch count, every group of every size in one array (:meth:`empty`), so that a
    short sequence's best place is found in one pass and placing it updates only the groups that
    hold its units."""

    def __init__(self, intra, n: int, L: np.ndarray, order: list[int]):
        sizes, cost, fits, need, cap = intra
        self.sizes, self.n, self.L, self.order = sorted(sizes), n, L, order
        self.times = np.array([np.where(fits[s], cost[s], np.inf) for s in self.sizes])
        self.shares = np.array([need[s] / max(cap[s], 1) for s in self.sizes])
        self.areas = np.array(self.sizes, dtype=float)[:, None] * self.times
        self.area = self.areas.min(axis=0)  # per sequence, its cheapest area (inf where no group holds it)
        self._short: dict[tuple, tuple] = {}
        self.unit_capacity = cap[1]
        self._shape: dict[int, tuple] = {}
        self._spread: dict[tuple[int, int], tuple] = {}

    def short(self, longs: frozenset, exact: int | None):
        """The sequences not in ``longs`` placed one by one (most expensive first; all, or the
        ``exact`` first) and the rest as a fluid: ``(work, tokens)``, their cheapest areas and
        tokens in all, or None where there is no rest."""
        if (longs, exact) not in self._short:
            rest = [i for i in self.order if i not in longs]
            fluid = rest[exact:] if exact is not None else []
            idx = np.asarray(fluid)
            totals = (float(self.area[idx].sum()), float(self.L[idx].sum())) if fluid else None
            self._short[(longs, exact)] = (rest[:exact] if exact is not None else rest, totals)
        return self._short[(longs, exact)]

    def spread(self, m: int, i: int):
        """Sequence ``i``'s time and memory share on every group of ``m`` micro-batches (the order of
        :meth:`empty`)."""
        if (m, i) not in self._spread:
            size_of = self._geometry(m)[1]
            self._spread[(m, i)] = (self.times[:, i][size_of], self.shares[:, i][size_of])
        return self._spread[(m, i)]

    def empty(self, m: int):
        """Per group of every size in ``m`` micro-batches, smallest size first and per size row-major
        (micro-batch, group): its slowest unit's load and fullest unit's memory share, zero, as one
        array each (``top``, ``full``) and per size as views ``(m, groups)`` (``tops``, ``fulls``; the
        size-1 groups are the units); ``off``, where each size starts; ``size_of`` and ``mb_of``, per
        group its size's position and its micro-batch."""
        off, size_of, mb_of = self._geometry(m)
        top, full = np.zeros(off[-1]), np.zeros(off[-1])
        tops = {s: top[off[j]:off[j + 1]].reshape(m, -1) for j, s in enumerate(self.sizes)}
        fulls = {s: full[off[j]:off[j + 1]].reshape(m, -1) for j, s in enumerate(self.sizes)}
        return tops, fulls, top, full, off, size_of, mb_of

    def _geometry(self, m: int) -> tuple:
        """``(off, size_of, mb_of)`` of :meth:`empty` for ``m`` micro-batches (made once)."""
        if m not in self._shape:
            span = [m * (self.n // s) for s in self.sizes]
            off = np.concatenate([[0], np.cumsum(span)]).astype(int)
            size_of = np.repeat(np.arange(len(self.sizes)), span)
            mb_of = np.concatenate([np.repeat(np.arange(m), self.n // s) for s in self.sizes])
            self._shape[m] = (off, size_of, mb_of)
        return self._shape[m]


class _Headroom:
    """Memory beyond a unit's capacity, paid by recomputation (``PlanContext.unit_recompute``: the
    choice is made per unit once the plan is built): a unit may hold up to what it holds under
    ``selective``; holding ``x`` times its memory share it runs again the forward of the fewest
    layers whose full recomputation fits it (``CostModel.overshoot_layers``), priced as that share
    of its load's forward (the linear modules' forward share)."""

    def __init__(self, ctx: PlanContext):
        self.cm = ctx.cost
        self.forward = 1.0 / (1.0 + ctx.profile.backward_linear_factor)
        #: tokens a unit may hold (the builder's capacity), and that over its capacity
        self.tokens = int(self.cm.recompute_capacity("selective"))
        self.ratio = self.tokens / max(self.cm.token_capacity, 1)

    @classmethod
    def of(cls, ctx: PlanContext) -> _Headroom | None:
        if not ctx.unit_recompute or ctx.cost.token_capacity <= 0:
            return None
        room = cls(ctx)
        return room if room.ratio > 1 else None

    def load(self, load: np.ndarray, share: np.ndarray) -> np.ndarray:
        """Units' ``load`` with the forward their recomputation runs again at memory ``share`` (inf
        beyond the headroom)."""
        out = load * (1.0 + self.forward * self.cm.overshoot_layers(share))
        return np.where(share > self.ratio * (1 + _EPS), np.inf, out)


def _fluid(work: float, tokens: float, unit_capacity: float, loads: np.ndarray, mem: np.ndarray,
           mx: np.ndarray) -> float:
    """What short sequences of ``tokens`` tokens and ``work`` cheapest area in all add to the step,
    as a fluid of their mean time per token: it fills, within each unit's memory room, the units'
    load below their micro-batch's slowest first; what is left raises one micro-batch, spread over
    its units that still have room (inf where the units' room does not hold it)."""
    rho = work / max(tokens, 1.0)
    room = ((1 - mem) * unit_capacity).clip(min=0)
    free = np.minimum(room, (mx[:, None] - loads) / max(rho, 1e-30))
    extra = tokens - float(free.sum())
    if extra <= 0:
        return 0.0
    left = room - free
    if float(left.sum()) < extra:
        return float("inf")
    units = int((left > 0).sum(axis=1).max())
    return extra * rho / max(units, 1)


def _build(ctx: PlanContext, step: int, sequences: list[Sequence], layout: dict, routing: bool,
           headroom: _Headroom | None = None):
    """The plan of a layout; node-crossing ring hops routed (``routing``) over the NICs of their
    groups' units. With ``headroom``, the units over their capacity take their recomputation
    (:func:`zeppelin.planner.zeppelin.recompute.assign`) before the plan is ranked."""
    b = StepBuilder(ctx, sequences, "zeppelin", capacity=None if headroom is None else headroom.tokens)
    for k, kind, units, i, shape in layout["places"]:
        b.place(k, kind, units, i, shape=shape)
    desc = "; ".join("+".join(f"{w}n" for w in ws) or "-" for ws in layout["widths"])
    plan = finish_routed(ctx, b, step, {"family": name, "groups": f"long blocks {desc}"}, routing)
    return assign(ctx, plan) if headroom is not None else plan
