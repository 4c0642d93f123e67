"""Rings on aligned power-of-two blocks of units, as the ``flop-share`` and ``wide-rings`` families
place them (shared code, not a family).

A sequence runs alone on one unit or as a zigzag ring over an aligned block of the power-of-two
size its sizing gives it (:func:`memory_ring_sizes`, :func:`ring_sizes`), priced per unit by
:func:`unit_time`. :func:`place` puts rings (widest work first) on the aligned block whose fullest
unit is least loaded, then local sequences on the least-loaded unit, and, where it may pay, evens
each placement out by a local search (:func:`settle_blocks`: moves, swaps, ring sizes halved or
doubled). :func:`build` micro-batches each placement by first fit and (up to
:data:`SEARCH_MAX_UNITS` units) for coupling, and builds the one whose time with ring partners'
waits charged (:func:`coupled_time`) is lowest.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from zeppelin.planner.core.base import PlanContext, pow2_sizes, zigzag_share
from zeppelin.planner.core.builder import StepBuilder
from zeppelin.planner.costmodel.predict import component_max, coupled_components, predict_step
from zeppelin.planner.zeppelin.routing import plan_routes
from zeppelin.schemas.plan import Sequence, SolverInfo

#: placements are evened out by the local search and micro-batched for coupling up to this many
#: units (beyond, for planning latency, the plain least-loaded placement, micro-batched by first fit)
SEARCH_MAX_UNITS = 256


def unit_time(ctx: PlanContext, Lf: np.ndarray, slope: float, G: int, nic_share: float = 1.0) -> np.ndarray:
    """Per-unit time of sequences of lengths ``Lf`` alone (``G`` = 1) or on a zigzag
    ring of ``G`` units: attention plus the linear modules at ``slope`` per token. An inter-node
    ring's hops between nodes get ``nic_share`` of a NIC's time each (routed: spread over every NIC
    of the node)."""
    cm, layers = ctx.cost, ctx.model.num_layers
    if G == 1:
        return layers * cm.attn_time(Lf) + slope * Lf
    tier, share = ("inter", nic_share) if G > ctx.units_per_node else ("intra", 1.0)
    return layers * cm.ring_attention_time(Lf, G, tier, share) + slope * Lf / G


def memory_ring_sizes(L: np.ndarray, cap: int, gmax: int) -> np.ndarray:
    """The least power-of-two ring whose zigzag share of each sequence fits a unit's memory
    (above ``gmax`` where none of the cluster does)."""
    g_mem = np.ones(len(L), dtype=np.int64)
    g = 1
    while g <= gmax:
        g_mem[(g_mem == g) & (zigzag_share(L, g) > cap)] = 2 * g
        g *= 2
    return g_mem


def ring_sizes(ctx: PlanContext, work: np.ndarray, g_mem: np.ndarray, gmax: int, frac: float) -> np.ndarray:
    """Ring size of each sequence: the least power of two whose share of it fits a unit and whose
    per-unit work is at most ``frac`` of a unit's share of the step (with ``frac`` < 1, past a
    node only as far as a whole share asks)."""
    share = float(work.sum()) / ctx.num_units
    per_node = ctx.units_per_node
    g_flop = np.ones(len(work), dtype=np.int64)
    grow = work > share * frac
    g = 1
    while g < gmax and grow.any():
        # (past a node only while one share is not enough: an inter-node ring costs more than
        # it evens out)
        grow &= (work > share * g * frac) & ~((g >= per_node) & (work <= share * g))
        g_flop[grow] = 2 * g
        g *= 2
    return np.minimum(np.maximum(g_mem, g_flop), gmax)


def place(ctx: PlanContext, L, Lf, slope, sizings, order, gmax: int, settle_rounds: int, nic_share: float):
    """Each sizing placed least-loaded (and, where it may pay, evened out by the local search):
    [(where, sizes, top load, how, per-unit time)]."""
    n = ctx.num_units
    layouts = []
    t_of = {1: unit_time(ctx, Lf, slope, 1)}  # per-unit time of every sequence at each ring size
    for sizes, label in sizings:
        t_unit = t_of[1].copy()
        per = L.copy()  # tokens on each unit of its ring
        for G in np.unique(sizes[sizes > 1]).tolist():
            sel = sizes == G
            if G not in t_of:
                t_of[G] = unit_time(ctx, Lf, slope, G, nic_share)
            t_unit[sel] = t_of[G][sel]
            per[sel] = zigzag_share(L[sel], G)
        where, load = least_loaded(n, L, sizes, t_unit, per, order)
        how = "least-loaded" + label
        best_top = min((x[2] for x in layouts), default=np.inf)  # the best placement's so far
        layouts.append((where, sizes, float(load.max()), how, t_unit))
        # evened out by local search, unless this sizing's mean load or its slowest sequence
        # already reaches the best top load found (moves of whole sequences and rings halved or
        # doubled seldom get below that: a finer sizing's rings cost more in all)
        if settle_rounds > 0 and max(float(load.mean()), float(t_unit.max())) < best_top:
            w2, s2, l2, t2 = list(where), sizes.copy(), load.copy(), t_unit.copy()
            if settle_blocks(ctx, L, Lf, slope, s2, t2, w2, l2, gmax, settle_rounds, nic_share, t_of):
                layouts.append((w2, s2, float(l2.max()), how + " + local search", t2))
    return layouts


def least_loaded(n: int, L, sizes, t_unit, per, order):
    """Rings (in ``order``) to the aligned block whose fullest unit is least loaded, then local
    sequences to the least-loaded unit (ties: the lowest). Returns (where, per-unit load)."""
    load = np.zeros(n)
    where: list[tuple[list[int], int]] = [([], 0)] * len(L)
    sz_l, t_l, per_l, L_l = sizes.tolist(), t_unit.tolist(), per.tolist(), L.tolist()
    for i in order:
        G = sz_l[i]
        if G == 1:
            continue
        s0 = G * int(np.argmin(load[:n // G * G].reshape(-1, G).max(axis=1)))
        where[i] = (list(range(s0, s0 + G)), per_l[i])
        load[s0:s0 + G] += t_l[i]
    ld = load.tolist()
    heap = [(x, u) for u, x in enumerate(ld)]  # (load, unit)
    heapq.heapify(heap)
    for i in order:
        if sz_l[i] == 1:
            _, u = heapq.heappop(heap)
            where[i] = ([u], L_l[i])
            ld[u] += t_l[i]
            heapq.heappush(heap, (ld[u], u))
    return where, np.array(ld)


def micro_batch_order(order: list[int], work: np.ndarray, sizes: np.ndarray) -> list[int]:
    """Micro-batches are filled with every ring before any local sequence (widest first), so that
    rings sit in the earliest micro-batches, whose start their units reach together."""
    order_o = np.array(order, dtype=np.int64)
    return order_o[np.lexsort((order_o, -work[order_o], -sizes[order_o]))].tolist()


def build(ctx: PlanContext, step: int, sequences: list[Sequence], layouts, order, work, routing: bool,
          family: str):
    """Of every placement, micro-batched by first fit and (where that takes more than one, up to
    SEARCH_MAX_UNITS units) for coupling, the one whose coupled time is lowest (ties: the earlier)
    is built. Coupling only adds waiting, so a placement's coupled time is at least its slowest
    unit's load: placements are visited by that load, and once it exceeds the best coupled time
    found the rest cannot win. The plan's notes name ``family`` and the placement."""
    n, cap = ctx.num_units, ctx.cost.token_capacity
    best = None  # ((coupled time, candidate), where, fit, how)
    for j in sorted(range(len(layouts)), key=lambda j: (layouts[j][2], j)):
        w, sz, w_top, how, t = layouts[j]
        if best is not None and w_top > best[0][0] * (1 + 1e-9):
            break
        seq_order = micro_batch_order(order, work, sz)
        f = first_fit(n, cap, seq_order, w)
        coupled = f[1] > 1 and n <= SEARCH_MAX_UNITS
        if len(layouts) == 1 and not coupled:
            return _build_one(ctx, step, sequences, routing, family, w, f[0], how)
        tl = t.tolist()
        key = (coupled_time(n, w, tl, *f), 2 * j)
        if best is None or key < best[0]:
            best = (key, w, f[0], how)
        if coupled and key[0] > w_top:  # (at its top load already, first fit waits for nothing)
            f = coupled_fit(n, cap, seq_order, w, tl, f[1])
            key = (coupled_time(n, w, tl, *f), 2 * j + 1)
            if key < best[0]:
                best = (key, w, f[0], how)
    return _build_one(ctx, step, sequences, routing, family, *best[1:])


def _build_one(ctx: PlanContext, step: int, sequences: list[Sequence], routing: bool, family: str, where, fit,
               how):
    b = StepBuilder(ctx, sequences, "zeppelin")
    for i, k in fit:
        units = where[i][0]
        b.place(k, "ring" if len(units) > 1 else "local", units, i)
    route = routing and any(len(w[0]) > 1 and ctx.cost.node_of_unit(w[0][0]) != ctx.cost.node_of_unit(w[0][-1])
                            for w in where)
    # (with inter-node rings the prediction waits for their routes)
    plan = b.finish(step, SolverInfo(name="greedy"), notes={"family": family, "placement": how},
                    predict=(lambda c, p: None) if route else None, routes=not route)
    if route:
        # inter-node rings: their boundary hops routed over every NIC (routing.py), as in the
        # tiered plans
        for mb in plan.microbatches:
            mb.routes = plan_routes(ctx, mb, enable=True)
        plan.prediction = predict_step(ctx, plan)
    return plan


def first_fit(n: int, cap: int, order: list[int], where: list) -> tuple[list, int]:
    """Micro-batches by first fit: (micro-batch of each sequence, in ``order``; number of micro-
    batches). ``where[i]``: (units of sequence i, tokens it puts on each)."""
    held: list[list[int]] = []
    out = []
    for i in order:
        units, per = where[i]
        k = 0
        while k < len(held) and any(held[k][u] + per > cap for u in units):
            k += 1
        if k == len(held):
            held.append([0] * n)
        out.append((i, k))
        for u in units:
            held[k][u] += per
    return out, len(held)


def coupled_fit(n: int, cap: int, order: list[int], where: list, tl: list[float], m: int) -> tuple[list, int]:
    """Micro-batches chosen for coupling (returned as ``first_fit``'s; ``tl[i]``: sequence i's time
    on each of its units; ``m``: micro-batches to start with). Each sequence goes to the micro-batch,
    of those whose units have room for it, where the units it joins (its own and, in that
    micro-batch, every unit a ring links them to) end lowest, then where they wait least in all; to
    a new one only where none has room. First fit fills the first micro-batch with whatever fits:
    a two-unit ring inside a four-unit one there makes the other two wait for it, while their own
    sequences spill into the next micro-batch."""
    busy = [[0.0] * n for _ in range(m)]
    held = [[0] * n for _ in range(m)]
    # per micro-batch and unit: the aligned block of units coupled with it (start, size) and
    # that block's time; rings sit on aligned power-of-two blocks, so coupled sets nest
    c_start = [list(range(n)) for _ in range(m)]
    c_size = [[1] * n for _ in range(m)]
    c_time = [[0.0] * n for _ in range(m)]
    total = [0.0] * n  # per unit: its coupled time summed over the micro-batches
    out = []
    for i in order:
        units, per = where[i]
        s, G, ti = units[0], len(units), tl[i]
        best = None
        for k in range(m):
            hk = held[k]
            if max(hk[s:s + G]) + per > cap:
                continue
            if c_size[k][s] >= G:
                a, z = c_start[k][s], c_size[k][s]
            else:
                a, z = s, G
            bk, ck = busy[k], c_time[k]
            new = max(max(bk[a:s], default=0.0), max(bk[s + G:a + z], default=0.0),
                      max(bk[s:s + G]) + ti)
            top = max(total[u] - ck[u] for u in range(a, a + z)) + new
            wait = sum(new - ck[u] for u in range(a, a + z))
            if best is None or (top, wait) < best[0]:
                best = ((top, wait), k, a, z)
        if best is None:  # no micro-batch has room: a new one
            busy.append([0.0] * n)
            held.append([0] * n)
            c_start.append(list(range(n)))
            c_size.append([1] * n)
            c_time.append([0.0] * n)
            k, a, z = m, s, G
            m += 1
        else:
            _, k, a, z = best
        bk, hk, ck = busy[k], held[k], c_time[k]
        for u in range(s, s + G):
            bk[u] += ti
            hk[u] += per
        new = max(bk[a:a + z])
        for u in range(a, a + z):
            total[u] += new - ck[u]
            ck[u] = new
        if G > 1:
            c_start[k][a:a + z] = [a] * z
            c_size[k][a:a + z] = [z] * z
        out.append((i, k))
    return out, m


def coupled_time(n: int, where: list, tl: list[float], fit: list, m: int) -> float:
    """A micro-batched placement's slowest unit once coupling is charged: per micro-batch, every
    unit of a set joined by rings waits for the set's busiest member (as the prediction charges it)."""
    rings: list[list[range]] = [[] for _ in range(m)]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, k in fit:
        units = where[i][0]
        if len(units) == 1:
            rows.append(k)
            cols.append(units[0])
            vals.append(tl[i])
        else:
            span = range(units[0], units[-1] + 1)
            rows += [k] * len(span)
            cols += span
            vals += [tl[i]] * len(span)
            rings[k].append(span)
    # (np.add.at adds in the order given: each unit's sum is the one a loop over ``fit`` makes)
    busy = np.zeros((m, n))
    np.add.at(busy, (np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64)), np.array(vals))
    total = np.zeros(n)
    for k in range(m):
        total += component_max(coupled_components(n, rings[k]), busy[k]) if rings[k] else busy[k]
    return float(total.max())


def coupled_score(ctx: PlanContext, layout, order: list[int], work: np.ndarray) -> float:
    """A placement's slowest unit once ring partners' waits are charged, micro-batched by first
    fit (what :func:`build` compares placements by): where rings share their units with shorter
    sequences, a top load alone misses the waits."""
    where, sizes, _, _, t = layout
    fit = first_fit(ctx.num_units, ctx.cost.token_capacity, micro_batch_order(order, work, sizes), where)
    return coupled_time(ctx.num_units, where, t.tolist(), *fit)


def _least(vals: np.ndarray, ids: np.ndarray) -> int:
    """The row of the least value (ties: of the least id): of one kind of move, the one the local
    search's order (value, sequence, kind) would take first."""
    r = np.flatnonzero(vals == vals.min())
    return int(r[np.argmin(ids[r])])


def settle_blocks(ctx: PlanContext, L, Lf, slope, sizes, t_unit, where, load, gmax: int, rounds: int,
                   nic_share: float = 1.0, t_of: dict[int, np.ndarray] | None = None) -> bool:
    """Local search on a placement (in place): take the most loaded unit and move one of
    its sequences - a local one, or a ring with its aligned block - to the block of its size (or of
    half / twice it, where memory allows) whose fullest unit ends lowest, or swap it with a
    sequence of the same size elsewhere, whichever lowers the pair's larger load most, while that
    lowers the top load. LPT on aligned power-of-two blocks leaves steps of long sequences lumpy
    (every ring a large share of a unit's time); this evens them out. Returns whether anything
    moved."""
    n = len(load)
    gsz = [1] + pow2_sizes(gmax)[1:]
    # per-unit time of every sequence at each size (``t_of``: the caller's, filled as needed)
    t_of = {} if t_of is None else t_of

    def t_at(G: int) -> np.ndarray:
        if G not in t_of:
            t_of[G] = unit_time(ctx, Lf, slope, G, nic_share)
        return t_of[G]

    pl = _Placement(cap=ctx.cost.token_capacity, gmax=gmax, t_at=t_at,
                    share_at={G: zigzag_share(L, G) for G in gsz},
                    start=np.array([w[0][0] for w in where], dtype=np.int64),
                    size=sizes.astype(np.int64).copy(), t=t_unit.astype(np.float64).copy(),
                    on=[set() for _ in range(n)], load=load)
    for i in range(len(L)):
        for u in range(pl.start[i], pl.start[i] + pl.size[i]):
            pl.on[u].add(i)
    moved = False
    for _ in range(rounds):
        hot = int(np.argmax(load))
        top = float(load[hot])
        mine = sorted(pl.on[hot])
        cands = _ring_moves(pl, mine, top) + _local_moves(pl, mine, hot, top)
        best = min(cands, key=lambda c: (c[0], c[1], c[2])) if cands else None
        if best is None or not best[0] < top * (1 - 1e-9):
            return moved
        moved = True
        _apply_move(pl, best, sizes, t_unit, where)
    return moved


@dataclass
class _Placement:
    """The local search's view of a placement: each sequence's block (start, size) and per-unit
    time, the sequences on each unit, and the per-unit load (the caller's array, updated)."""

    cap: int
    gmax: int
    t_at: object  # ring size -> per-unit time of every sequence at that size
    share_at: dict  # ring size -> tokens of every sequence on each unit of such a ring
    start: np.ndarray
    size: np.ndarray
    t: np.ndarray
    on: list
    load: np.ndarray


def _ring_moves(pl: _Placement, mine: list[int], top: float) -> list[tuple]:
    """Moves of the hot unit's rings (few: one block scan per size): to the best block of half,
    the same or twice its size, or swapped with a cheaper ring of its size in another block.
    Each (value, sequence, option, size, new start, swap partner or -1)."""
    n, load, size, start, t = len(pl.load), pl.load, pl.size, pl.start, pl.t
    cands: list[tuple] = []
    for i in (i for i in mine if size[i] > 1):
        G0, s0, t0 = int(size[i]), int(start[i]), float(t[i])
        base = load.copy()
        base[s0:s0 + G0] -= t0
        for opt, G in enumerate((G0 // 2, G0, 2 * G0)):
            if G < 1 or G > pl.gmax or (G not in pl.share_at) or pl.share_at[G][i] > pl.cap:
                continue
            nb = n // G
            bm = base[:nb * G].reshape(nb, G).max(axis=1) + float(pl.t_at(G)[i])
            if G == G0:
                bm[s0 // G0] = np.inf  # staying put is no move
            b = int(np.argmin(bm))
            cands.append((float(bm[b]), i, opt, G, b * G, -1))
        oj = np.flatnonzero((size == G0) & (start // G0 != s0 // G0) & (t < t0))
        if len(oj):
            nb = n // G0
            bmax = load[:nb * G0].reshape(nb, G0).max(axis=1)
            val = np.maximum(top - t0 + t[oj], bmax[start[oj] // G0] + t0 - t[oj])
            a = int(np.argmin(val))
            cands.append((float(val[a]), i, 3, G0, int(start[oj[a]]), int(oj[a])))
    return cands


def _local_moves(pl: _Placement, mine: list[int], hot: int, top: float) -> list[tuple]:
    """Moves of the hot unit's local sequences, all at once: alone to another unit, as a ring of
    two on an aligned pair, or swapped with a lighter local sequence of another unit."""
    n, load, size, start, t = len(pl.load), pl.load, pl.size, pl.start, pl.t
    locs = np.array([i for i in mine if size[i] == 1], dtype=np.int64)
    if not len(locs):
        return []
    cands: list[tuple] = []
    k = len(locs)
    rows = np.arange(k)
    tl = t[locs]
    M = load[None, :] + tl[:, None]
    M[:, hot] = np.inf
    u = M.argmin(axis=1)
    r = _least(M[rows, u], locs)
    cands.append((float(M[r, u[r]]), int(locs[r]), 1, 1, int(u[r]), -1))
    nb = n // 2
    if pl.gmax >= 2 and nb:
        P = np.repeat((load[:2 * nb].reshape(nb, 2).max(axis=1))[None, :], k, axis=0)
        hb = hot // 2
        if hb < nb:
            P[:, hb] = np.maximum(load[hot] - tl, load[hot ^ 1])
        P += pl.t_at(2)[locs][:, None]
        P[pl.share_at[2][locs] > pl.cap] = np.inf
        b = P.argmin(axis=1)
        r = _least(P[rows, b], locs)
        cands.append((float(P[r, b[r]]), int(locs[r]), 2, 2, 2 * int(b[r]), -1))
    oj = np.flatnonzero((size == 1) & (start != hot))
    if len(oj):
        tj, uj = t[oj], start[oj]
        V = np.maximum(top - tl[:, None] + tj[None, :], load[uj][None, :] + tl[:, None] - tj[None, :])
        V[tj[None, :] >= tl[:, None]] = np.inf
        c = V.argmin(axis=1)
        r = _least(V[rows, c], locs)
        cands.append((float(V[r, c[r]]), int(locs[r]), 3, 1, int(uj[c[r]]), int(oj[c[r]])))
    return cands


def _apply_move(pl: _Placement, move: tuple, sizes, t_unit, where) -> None:
    """Applies a move or swap to the placement (and to the caller's ``sizes``, ``t_unit``, ``where``)."""
    load, size, start, t, on = pl.load, pl.size, pl.start, pl.t, pl.on
    _, i, opt, G, s_new, j = move
    G0, s0 = int(size[i]), int(start[i])
    load[s0:s0 + G0] -= t[i]
    for u in range(s0, s0 + G0):
        on[u].discard(i)
    if opt == 3:  # a swap
        load[s_new:s_new + G] -= t[j]
        for u in range(s_new, s_new + G):
            on[u].discard(j)
        load[s0:s0 + G0] += t[j]
        for u in range(s0, s0 + G0):
            on[u].add(j)
        start[j] = s0
        where[j] = (list(range(s0, s0 + G0)), int(pl.share_at[G0][j]))
    if G != G0:
        size[i], t[i] = G, float(pl.t_at(G)[i])
        sizes[i] = G
    start[i] = s_new
    load[s_new:s_new + G] += t[i]
    for u in range(s_new, s_new + G):
        on[u].add(i)
    where[i] = (list(range(s_new, s_new + G)), int(pl.share_at[G][i]))
    t_unit[i] = t[i]
