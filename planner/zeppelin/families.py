"""Whole-step candidate families of the Zeppelin planner beyond its tiered layouts.

The tiered search (:mod:`.planner`) gives each sequence a span and balances units per micro-batch.
Three other layouts win some steps by the cost model, so the planner builds them too and keeps
whichever candidate the prediction (or, on small clusters, the simulator) rates fastest:

* ``ulysses-groups`` - Ulysses groups that keep their units for the whole step (FlexSP's
  freedom): ``n / s`` groups of ``s`` units, or ``k`` groups of a larger size ``S`` (for the
  sequences that need it) and the rest of size ``s``; sequences dealt whole-step to the group where
  they finish earliest (cost-model time, most expensive first), each group's share cut into
  micro-batches first-fit-decreasing under the memory cap. Groups never wait for each other, so
  the step costs the slowest group's sum of micro-batch times.
* ``flop-share`` - a sequence whose work exceeds a unit's share of the step (or whose tokens do
  not fit one unit) runs as a zigzag ring over an aligned block of the power-of-two size it needs,
  the rest stay local (and, as further sizings, rings of at most 1/2, 1/4, 1/8 and 1/16 of a
  unit's share each); blocks and units are filled least-loaded first, each placement then evened
  out by a local search (moves, swaps, ring sizes halved or doubled), micro-batches by first fit
  and chosen for coupling; the layout whose time with ring partners' waits charged is lowest is
  built.
* ``tp-replicas`` - replicas of a larger tensor-parallel degree than the context's (Hydraulis'
  freedom): replicas of degree ``hi`` (or context-parallel replicas of ``cp`` of them where the
  step's longest sequence fits no replica) for the long sequences and of degree ``lo`` for the
  rest, each sequence to the replica where it finishes earliest, each replica's share cut into
  micro-batches longest-first under its memory.

Everything is deterministic (sorted orders, index tie-breaks, no clock). Each family scores its
configurations with its own per-sequence times first and builds only the best ``top`` of them as
plans (:class:`zeppelin.planner.core.builder.StepBuilder`), priced by the shared prediction.
"""

from __future__ import annotations

import heapq

import numpy as np

from zeppelin.planner.core.base import PlanContext, PlanningError, pow2_sizes
from zeppelin.planner.core.builder import StepBuilder
from zeppelin.planner.costmodel.predict import (
    component_max,
    coupled_components,
    predict_replicas,
    predict_step,
)
from zeppelin.planner.zeppelin.routing import plan_routes
from zeppelin.schemas.plan import Replica, Sequence, SolverInfo, StepPlan

FAMILIES = ("ulysses-groups", "flop-share", "tp-replicas")
#: FLOP-share tries its finer ring sizes, the local search of each placement and micro-batches
#: chosen for coupling up to this many units (beyond, for planning latency, its plain least-loaded
#: placement, micro-batched by first fit, alone)
SEARCH_MAX_UNITS = 256
SETTLE_ROUNDS = 32  # moves of the local search per placement (the first few do nearly all the good)
#: FLOP-share's finer ring sizings (up to SEARCH_MAX_UNITS units): each one's rings put at most
#: this fraction of a unit's share of the step on each of their units
FINE_SHARES = (0.5, 0.25, 0.125, 0.0625)


def _ceil_div(a, b):
    return -(-np.asarray(a) // b)


def _zigzag_share(L: np.ndarray, G: int) -> np.ndarray:
    """Tokens the fullest unit of a zigzag ring of ``G`` holds (schemas.layout.zigzag_ranges' cut)."""
    L = np.asarray(L, dtype=np.int64)
    if G <= 1:
        return L
    q, r = np.divmod(L, 2 * G)
    return 2 * q + (r > 0) + (r > G)


def _group_counts(m: int) -> list[int]:
    """How many groups of the larger kind a heterogeneous configuration tries (at most ``m``): every
    count up to 8 (a step's few long sequences each get one), past it powers of two and three
    times them (the number of configurations stays logarithmic on large clusters)."""
    return sorted(set(range(1, min(m, 8) + 1)) | set(pow2_sizes(m)) | {3 * q for q in pow2_sizes(m // 3)})


def _dispatch(cost: dict[int, np.ndarray], fits: dict[int, np.ndarray], counts: dict[int, int],
              fixed: dict[int, float] | None = None, improve: bool = False):
    """Whole-step dispatch over group types: ``counts[t]`` groups of type ``t``, ``cost[t][i]`` the
    time of sequence ``i`` on one group of type ``t``. Most expensive sequence first (its cheapest
    type's time), each to the group where it finishes earliest (ties: lower type, lower group);
    ``improve``: then the local search of :func:`_improve`. Returns (makespan, [(type, group
    index)] per sequence) or None when a sequence fits no type."""
    types = sorted(t for t in counts if counts[t] > 0)
    n_seq = len(next(iter(cost.values())))
    base = np.full(n_seq, np.inf)
    for t in types:
        base = np.minimum(base, np.where(fits[t], cost[t], np.inf))
    if not np.isfinite(base).all():
        return None
    heaps = {t: [((fixed or {}).get(t, 0.0), g) for g in range(counts[t])] for t in types}
    order = np.lexsort((np.arange(n_seq), -base)).tolist()
    out: list[tuple[int, int]] = [(0, 0)] * n_seq
    if len(types) == 1:
        t = types[0]
        h, c = heaps[t], cost[t].tolist()
        for i in order:
            load, g = h[0]
            heapq.heapreplace(h, (load + c[i], g))
            out[i] = (t, g)
    elif len(types) == 2:  # (the heterogeneous configurations: the loop below, unrolled)
        ta, tb = types
        ha, hb = heaps[ta], heaps[tb]
        ca = np.where(fits[ta], cost[ta], np.inf).tolist()
        cb = np.where(fits[tb], cost[tb], np.inf).tolist()
        replace = heapq.heapreplace
        for i in order:
            la, ga = ha[0]
            lb, gb = hb[0]
            fa, fb = la + ca[i], lb + cb[i]
            if fa <= fb:
                replace(ha, (fa, ga))
                out[i] = (ta, ga)
            else:
                replace(hb, (fb, gb))
                out[i] = (tb, gb)
    else:
        cl = {t: cost[t].tolist() for t in types}
        fl = {t: fits[t].tolist() for t in types}
        for i in order:
            best = None
            for t in types:
                if fl[t][i]:
                    fin = heaps[t][0][0] + cl[t][i]
                    if best is None or fin < best[0]:
                        best = (fin, t)
            fin, t = best
            g = heaps[t][0][1]
            heapq.heapreplace(heaps[t], (fin, g))
            out[i] = (t, g)
    loads = {t: np.array(sorted((g, load) for load, g in heaps[t]))[:, 1].astype(np.float64) for t in types}
    if improve:
        _improve(cost, fits, out, loads)
    span = max(float(loads[t].max()) for t in types)
    return span, out, loads


def _dispatch_bound(cost: dict[int, np.ndarray], fits: dict[int, np.ndarray], counts: dict[int, int],
                    width: dict[int, int]) -> float:
    """A lower bound on :func:`_dispatch`'s makespan (inf where a sequence fits no type): no
    sequence runs faster than on its cheapest type, and the groups' resource-time (``width[t]``
    units per group of type ``t`` times its load) is at most the makespan times their total width."""
    types = [t for t in counts if counts[t] > 0]
    fastest = area = None
    for t in types:
        c = np.where(fits[t], cost[t], np.inf)
        fastest = c if fastest is None else np.minimum(fastest, c)
        area = width[t] * c if area is None else np.minimum(area, width[t] * c)
    if fastest is None or not np.isfinite(fastest).all():
        return float("inf")
    return max(float(fastest.max()), float(area.sum()) / sum(width[t] * counts[t] for t in types))


def _best_dispatches(configs: list, run, bound, keep: int, limit: float | None = None) -> list:
    """The ``keep`` best dispatches of ``configs`` (``run(cfg)``: :func:`_dispatch`'s result or
    None; ``bound(cfg)``: a lower bound on it), as (makespan, index, cfg, owner, loads) sorted by
    (makespan, index). Configurations are tried in order of their bound; one whose bound is above
    the ``keep``-th best makespan found so far is skipped (it could not be among the best), so the
    result is what trying them all gives; so is one whose bound is above ``limit`` (the caller
    would not build it)."""
    bounds = [bound(cfg) for cfg in configs]
    best: list = []
    for a in sorted(range(len(configs)), key=lambda a: (bounds[a], a)):
        if (len(best) >= keep and bounds[a] > best[keep - 1][0]) or (limit is not None and bounds[a] > limit):
            break
        r = run(configs[a])
        if r is not None:
            best.append((r[0], a, configs[a], r[1], r[2]))
            best.sort(key=lambda x: (x[0], x[1]))
    return best[:keep]


def _refine(cost, fits, owner: list, loads: dict) -> tuple[float, list]:
    """:func:`_improve` on a copy of a dispatch: (makespan, owner)."""
    owner, loads = list(owner), {t: v.copy() for t, v in loads.items()}
    _improve(cost, fits, owner, loads)
    return max(float(v.max()) for v in loads.values()), owner


def _improve(cost, fits, out, loads, rounds: int = 24, cold_groups: int = 3) -> None:
    """Local search on a dispatch (in place): move a sequence off the slowest group, or swap one
    of its sequences with one of a fast group's, whichever lowers the pair's larger time most,
    while that lowers the slowest group's time (vectorised over the sequences of the pair)."""
    members: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(out):
        members.setdefault(key, []).append(i)
    keys = [(t, g) for t in sorted(loads) for g in range(len(loads[t]))]
    for _ in range(rounds):
        lv = np.array([loads[t][g] for t, g in keys])
        hot = keys[int(np.argmax(lv))]
        top = float(lv.max())
        mine = np.array(sorted(members.get(hot, [])), dtype=np.int64)
        if len(mine) == 0:
            return
        c_out = cost[hot[0]][mine]
        best = None  # (value, kind, i, j, cold)
        for x in np.argsort(lv, kind="stable")[:cold_groups]:
            cold = keys[int(x)]
            if cold == hot:
                continue
            lc = loads[cold[0]][cold[1]]
            c_in = cost[cold[0]][mine]
            ok = fits[cold[0]][mine]
            val = np.where(ok, np.maximum(top - c_out, lc + c_in), np.inf)
            a = int(np.argmin(val))
            if best is None or val[a] < best[0]:
                best = (float(val[a]), "move", int(mine[a]), -1, cold)
            theirs = np.array(sorted(members.get(cold, [])), dtype=np.int64)
            if len(theirs):
                nh = top - c_out[:, None] + cost[hot[0]][theirs][None, :]
                nc = lc - cost[cold[0]][theirs][None, :] + c_in[:, None]
                okm = ok[:, None] & fits[hot[0]][theirs][None, :]
                v = np.where(okm, np.maximum(nh, nc), np.inf)
                f = int(np.argmin(v))
                r, c = divmod(f, len(theirs))
                if v[r, c] < best[0]:
                    best = (float(v[r, c]), "swap", int(mine[r]), int(theirs[c]), cold)
        if best is None or not best[0] < top * (1 - 1e-9):
            # no single move or swap helps: deal the slowest group's and a fast group's sequences
            # anew between the two, every split tried (pairs of few sequences: the coarse steps
            # where one-for-one exchanges stall)
            if not _repartition(cost, fits, out, members, loads, hot, top, keys, lv, cold_groups):
                return
            continue
        _, kind, i, j, cold = best
        loads[hot[0]][hot[1]] -= float(cost[hot[0]][i])
        loads[cold[0]][cold[1]] += float(cost[cold[0]][i])
        members[hot].remove(i)
        members.setdefault(cold, []).append(i)
        out[i] = cold
        if kind == "swap":
            loads[cold[0]][cold[1]] -= float(cost[cold[0]][j])
            loads[hot[0]][hot[1]] += float(cost[hot[0]][j])
            members[cold].remove(j)
            members[hot].append(j)
            out[j] = hot


_SPLITS: dict[int, np.ndarray] = {}
REPARTITION_MAX = 12  # sequences of a pair of groups split exhaustively (2^n splits)


def _repartition(cost, fits, out, members, loads, hot, top, keys, lv, cold_groups) -> bool:
    """The best split of the slowest group's and one fast group's sequences between the two (of
    the ``cold_groups`` fastest, pairs of at most :data:`REPARTITION_MAX` sequences); applied (in
    place) when it lowers the pair's larger time below ``top``. Returns whether it did."""
    best = None  # (value, cold, union, mask)
    for x in np.argsort(lv, kind="stable")[:cold_groups]:
        cold = keys[int(x)]
        if cold == hot:
            continue
        union = np.array(sorted(members.get(hot, []) + members.get(cold, [])), dtype=np.int64)
        k = len(union)
        if k < 2 or k > REPARTITION_MAX:
            continue
        if k not in _SPLITS:
            _SPLITS[k] = ((np.arange(1 << k)[:, None] >> np.arange(k)[None, :]) & 1).astype(np.float64)
        m = _SPLITS[k]  # 1: on the slow group's type
        ch, cc = cost[hot[0]][union], cost[cold[0]][union]
        bad = m @ (~fits[hot[0]][union]).astype(np.float64) + (1 - m) @ (~fits[cold[0]][union]).astype(np.float64)
        val = np.where(bad > 0, np.inf, np.maximum(m @ ch, (1 - m) @ cc))
        a = int(np.argmin(val))
        if best is None or val[a] < best[0]:
            best = (float(val[a]), cold, union, m[a] > 0)
    if best is None or not best[0] < top * (1 - 1e-9):
        return False
    _, cold, union, on_hot = best
    members[hot] = union[on_hot].tolist()
    members[cold] = union[~on_hot].tolist()
    for i in members[hot]:
        out[i] = hot
    for i in members[cold]:
        out[i] = cold
    loads[hot[0]][hot[1]] = float(cost[hot[0]][union[on_hot]].sum())
    loads[cold[0]][cold[1]] = float(cost[cold[0]][union[~on_hot]].sum())
    return True


def _pack_bins(items: list[int], need: np.ndarray, w: np.ndarray, cap: int) -> list[list[int]]:
    """A group's sequences into micro-batches: the fewest bins by first-fit decreasing on tokens,
    then work-balanced (heaviest first to the lightest bin with room)."""
    order = sorted(items, key=lambda i: (-int(need[i]), i))
    room: list[int] = []
    for i in order:  # first fit decreasing: how many bins
        for b in range(len(room)):
            if need[i] <= room[b]:
                room[b] -= int(need[i])
                break
        else:
            room.append(cap - int(need[i]))
    v = max(1, len(room))
    bins: list[list[int]] = [[] for _ in range(v)]
    load, held = [0.0] * v, [0] * v
    for i in sorted(items, key=lambda i: (-float(w[i]), i)):
        ok = [b for b in range(v) if held[b] + need[i] <= cap]
        if not ok:  # the balanced pass failed to fit: keep first fit
            return _ffd(items, need, cap)
        b = min(ok, key=lambda b: (load[b], b))
        bins[b].append(i)
        load[b] += float(w[i])
        held[b] += int(need[i])
    return [b for b in bins if b]


def _ffd(items, need, cap):
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(items, key=lambda i: (-int(need[i]), i)):
        for b in range(len(room)):
            if need[i] <= room[b]:
                bins[b].append(i)
                room[b] -= int(need[i])
                break
        else:
            bins.append([i])
            room.append(cap - int(need[i]))
    return bins


def _token_slope(ctx: PlanContext, cm, T: float, s: int = 1, link: str = "intra") -> float:
    """Marginal time per token (linear modules, LM head, TP and - for ``s`` > 1 - Ulysses
    all-to-alls) of a unit holding about ``T`` tokens: the secant between T/2 and T."""

    def f(x):
        comm = cm.ulysses_comm_time(x, s, link) if s > 1 else 0.0
        tp = cm.tp_exposed_comm(x) if cm.tp > 1 else 0.0
        return float(ctx.model.num_layers * (cm.linear_time(x) + comm + tp) + cm.head_time(x))

    return (f(T) - f(T / 2)) / (T / 2)


# ---------------------------------------------------------------------------------------------
def ulysses_groups(ctx: PlanContext, step: int, sequences: list[Sequence], top: int = 2, limit: float | None = None):
    n, upn, cm = ctx.num_units, ctx.units_per_node, ctx.cost
    heads = max(1, ctx.model.num_heads // ctx.tp)
    cap = cm.token_capacity
    L = np.array([s.length for s in sequences], dtype=np.int64)
    Lf = L.astype(np.float64)
    sizes = [s for s in pow2_sizes(n) if heads % s == 0 and n % s == 0]
    cost, fits, need = {}, {}, {}
    T_avg = max(float(Lf.sum()) / n, 2.0)
    for s in sizes:
        link = "inter" if s > upn else "intra"
        # a group's linear modules, LM head and all-to-alls run once per micro-batch on all its
        # tokens: priced per token by their slope around a unit's average share of the step (a
        # per-sequence price would charge every short sequence the fixed costs again)
        slope = _token_slope(ctx, cm, T_avg, s, link)
        cost[s] = ctx.model.num_layers * cm.ulysses_attn_time(Lf, s) + slope * Lf / s
        need[s] = _ceil_div(L, s)
        fits[s] = need[s] <= cap
    def run(cfg):
        return _dispatch({t: cost[t] for t in cfg}, {t: fits[t] for t in cfg}, cfg)

    def bound(cfg):
        return _dispatch_bound(cost, fits, cfg, {t: t for t in cfg})

    homo = [{s: n // s} for s in sizes]
    scored = _best_dispatches(homo, run, bound, top + 1)
    if scored:
        # heterogeneous around the best homogeneous size s*: k groups of a larger size (one or two
        # steps up) for the long sequences, the rest of size s* or s*/2
        s_best = next(iter(scored[0][2]))
        near = [x for x in sizes if s_best // 2 <= x <= 4 * s_best]
        het = [{big: k, small: (n - k * big) // small} for big in near for small in [x for x in near if x < big]
               for k in _group_counts(n // big) if k * big + small <= n]
        # (indices after the homogeneous ones: ties keep the homogeneous configuration)
        more = _best_dispatches(het, run, bound, top + 1, limit)
        scored = sorted(scored + [(x[0], len(homo) + x[1], *x[2:]) for x in more], key=lambda x: (x[0], x[1]))
    # the best few dispatches refined by local search, then ranked again
    refined = []
    for _, a, cfg, owner, loads in scored[:top + 1]:
        if limit is not None and bound(cfg) > limit:
            continue  # (no refinement brings it under the caller's limit)
        span, owner = _refine(cost, fits, owner, loads)
        refined.append((span, a, cfg, owner))
    scored = sorted(refined, key=lambda x: (x[0], x[1]))
    def build(cfg, owner):
        # groups: aligned blocks, largest size first
        blocks: dict[tuple[int, int], list[int]] = {}
        u0 = 0
        for t in sorted(cfg, reverse=True):
            for g in range(cfg[t]):
                blocks[(t, g)] = list(range(u0, u0 + t))
                u0 += t
        b = StepBuilder(ctx, sequences, "zeppelin")
        members: dict[tuple[int, int], list[int]] = {}
        for i, key in enumerate(owner):
            members.setdefault(key, []).append(i)
        for key in sorted(members):
            t = key[0]
            for k, bin_ in enumerate(_pack_bins(members[key], need[t], cost[t], cap)):
                for i in sorted(bin_, key=lambda i: (-L[i], i)):
                    b.place(k, "ulysses" if t > 1 else "local", blocks[key], i)
        desc = " + ".join(f"{cfg[t]} x sp={t}" for t in sorted(cfg, reverse=True))
        return b.finish(step, SolverInfo(name="greedy"), notes={"family": "ulysses-groups", "groups": desc})

    return [(span, a, (lambda cfg=cfg, owner=owner: build(cfg, owner))) for span, a, cfg, owner in scored[:top]]


def _unit_time(ctx: PlanContext, Lf: np.ndarray, slope: float, G: int, nic_share: float = 1.0) -> np.ndarray:
    """FLOP-share's per-unit time of sequences of lengths ``Lf`` alone (``G`` = 1) or on a zigzag
    ring of ``G`` units: attention plus the linear modules at ``slope`` per token. An inter-node
    ring's hops between nodes get ``nic_share`` of a NIC's time each (routed: spread over every NIC
    of the node)."""
    cm, layers = ctx.cost, ctx.model.num_layers
    if G == 1:
        return layers * cm.attn_time(Lf) + slope * Lf
    tier, share = ("inter", nic_share) if G > ctx.units_per_node else ("intra", 1.0)
    return layers * cm.ring_attention_time(Lf, G, tier, share) + slope * Lf / G


# ---------------------------------------------------------------------------------------------
def flop_share(ctx: PlanContext, step: int, sequences: list[Sequence], top: int = 1, routing: bool = True,
               settle_rounds: int | None = None):
    n, cm = ctx.num_units, ctx.cost
    cap = cm.token_capacity
    L = np.array([s.length for s in sequences], dtype=np.int64)
    Lf = L.astype(np.float64)
    work = cm.work(Lf)
    share = float(work.sum()) / n
    gmax = pow2_sizes(n)[-1]
    upn = ctx.units_per_node

    # the least power-of-two ring whose zigzag share of each sequence fits a unit's memory
    g_mem = np.ones(len(L), dtype=np.int64)
    g = 1
    while g <= gmax:
        g_mem[(g_mem == g) & (_zigzag_share(L, g) > cap)] = 2 * g
        g *= 2
    if g_mem.max() > gmax:
        return []  # a sequence fits no ring of the cluster

    def ring_sizes(frac: float) -> np.ndarray:
        """Ring size of each sequence: the least power of two whose share of it fits a unit and
        whose per-unit work is at most ``frac`` of a unit's share of the step (with ``frac`` < 1,
        past a node only as far as a whole share asks)."""
        g_flop = np.ones(len(L), dtype=np.int64)
        grow = work > share * frac
        g = 1
        while g < gmax and grow.any():
            # (past a node only while one share is not enough: an inter-node ring costs more than
            # it evens out)
            grow &= (work > share * g * frac) & ~((g >= upn) & (work <= share * g))
            g_flop[grow] = 2 * g
            g *= 2
        return np.minimum(np.maximum(g_mem, g_flop), gmax)

    sizings = [(ring_sizes(1.0), "")]
    if n <= SEARCH_MAX_UNITS:
        # finer rings (each at most a half, a quarter, ... of a unit's share): nearly free inside a
        # node under the cost model, they pack more evenly where a step's sequences are a large
        # share each; which fraction packs best depends on the step's mix, so each is placed
        for frac in FINE_SHARES:
            fine = ring_sizes(frac)
            if not any(np.array_equal(fine, sz) for sz, _ in sizings):
                sizings.append((fine, f" (rings <= 1/{round(1 / frac)} share)"))
    # per-unit time of each sequence on its ring / alone (the score; placement balances on it)
    slope = _token_slope(ctx, cm, max(float(Lf.sum()) / n, 2.0))
    t_alone = _unit_time(ctx, Lf, slope, 1)
    # an inter-node ring's boundary hops are routed over every NIC of its nodes (build_one); rings
    # sit on aligned blocks, so two that share a node share units too and run one after the other
    nic_share = 1.0 / max(len(ctx.cluster.nics), 1) if routing else 1.0
    order = sorted(range(len(L)), key=lambda i: (-work[i], i))
    if settle_rounds is None:
        # (past SEARCH_MAX_UNITS units, for planning latency, the plain placement alone)
        settle_rounds = min(4 * len(L), SETTLE_ROUNDS) if n <= SEARCH_MAX_UNITS else 0
    layouts = []
    L_l = L.tolist()
    t_of = {1: t_alone}  # per-unit time of every sequence at each ring size (the local search's too)
    for sizes, label in sizings:
        t_unit = t_alone.copy()
        per = L.copy()  # tokens on each unit of its ring
        for G in np.unique(sizes[sizes > 1]).tolist():
            sel = sizes == G
            if G not in t_of:
                t_of[G] = _unit_time(ctx, Lf, slope, G, nic_share)
            t_unit[sel] = t_of[G][sel]
            per[sel] = _zigzag_share(L[sel], G)
        load = np.zeros(n)
        where: list[tuple[list[int], int]] = [([], 0)] * len(L)
        sz_l, t_l, per_l = sizes.tolist(), t_unit.tolist(), per.tolist()
        for i in order:
            G = sz_l[i]
            if G == 1:
                continue
            # the aligned block whose fullest unit is least loaded
            s0 = G * int(np.argmin(load[:n // G * G].reshape(-1, G).max(axis=1)))
            where[i] = (list(range(s0, s0 + G)), per_l[i])
            load[s0:s0 + G] += t_l[i]
        # local sequences to the least-loaded unit (ties: the lowest; a heap of (load, unit))
        ld = load.tolist()
        heap = [(x, u) for u, x in enumerate(ld)]
        heapq.heapify(heap)
        for i in order:
            if sz_l[i] == 1:
                _, u = heapq.heappop(heap)
                where[i] = ([u], L_l[i])
                ld[u] += t_l[i]
                heapq.heappush(heap, (ld[u], u))
        load = np.array(ld)
        how = "least-loaded" + label
        best_top = min((x[2] for x in layouts), default=np.inf)  # the best placement's so far
        layouts.append((where, sizes, float(load.max()), how, t_unit))
        # evened out by local search, unless this sizing's mean load or its slowest sequence
        # already reaches the best top load found (moves of whole sequences and rings halved or
        # doubled seldom get below that: a finer sizing's rings cost more in all)
        if settle_rounds > 0 and max(float(load.mean()), float(t_unit.max())) < best_top:
            w2, s2, l2, t2 = list(where), sizes.copy(), load.copy(), t_unit.copy()
            if _settle_blocks(ctx, L, Lf, slope, s2, t2, w2, l2, gmax, settle_rounds, nic_share, t_of):
                layouts.append((w2, s2, float(l2.max()), how + " + local search", t2))

    def mb_order(sz):
        # micro-batches: first fit, every ring before any local sequence (widest first), so that
        # rings sit in the earliest micro-batches, whose start their units reach together
        order_o = np.array(order, dtype=np.int64)
        return order_o[np.lexsort((order_o, -work[order_o], -sz[order_o]))].tolist()

    def build():
        # of every placement, micro-batched by first fit and (where that takes more than one, up
        # to SEARCH_MAX_UNITS units) for coupling, the one whose coupled time is lowest (ties: the
        # earlier) is built. Coupling only adds waiting, so a placement's coupled time is at least
        # its slowest unit's load: placements are visited by that load, and once it exceeds the
        # best coupled time found the rest cannot win
        best = None  # ((coupled time, candidate), where, fit, how)
        for j in sorted(range(len(layouts)), key=lambda j: (layouts[j][2], j)):
            w, sz, w_top, how, t = layouts[j]
            if best is not None and w_top > best[0][0] * (1 + 1e-9):
                break
            seq_order = mb_order(sz)
            f = _first_fit(n, cap, seq_order, w)
            coupled = f[1] > 1 and n <= SEARCH_MAX_UNITS
            if len(layouts) == 1 and not coupled:
                return build_one(w, f[0], how)
            tl = t.tolist()
            key = (_coupled_time(n, w, tl, *f), 2 * j)
            if best is None or key < best[0]:
                best = (key, w, f[0], how)
            if coupled and key[0] > w_top:  # (at its top load already, first fit waits for nothing)
                f = _coupled_fit(n, cap, seq_order, w, tl, f[1])
                key = (_coupled_time(n, w, tl, *f), 2 * j + 1)
                if key < best[0]:
                    best = (key, w, f[0], how)
        return build_one(*best[1:])

    def build_one(where, fit, how):
        b = StepBuilder(ctx, sequences, "zeppelin")
        for i, k in fit:
            units = where[i][0]
            b.place(k, "ring" if len(units) > 1 else "local", units, i)
        route = routing and any(len(w[0]) > 1 and ctx.cost.node_of_unit(w[0][0]) != ctx.cost.node_of_unit(w[0][-1])
                                for w in where)
        # (with inter-node rings the prediction waits for their routes)
        plan = b.finish(step, SolverInfo(name="greedy"), notes={"family": "flop-share", "placement": how},
                        predict=(lambda c, p: None) if route else None, routes=not route)
        if route:
            # inter-node rings: their boundary hops routed over every NIC (routing.py), as in
            # the tiered plans
            for mb in plan.microbatches:
                mb.routes = plan_routes(ctx, mb, enable=True)
            plan.prediction = predict_step(ctx, plan)
        return plan

    return [(min(x[2] for x in layouts), 0, build)]


def _first_fit(n: int, cap: int, order: list[int], where: list) -> tuple[list, int]:
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


def _coupled_fit(n: int, cap: int, order: list[int], where: list, tl: list[float], m: int) -> tuple[list, int]:
    """Micro-batches chosen for coupling (returned as ``_first_fit``'s; ``tl[i]``: sequence i's time
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


def _coupled_time(n: int, where: list, tl: list[float], fit: list, m: int) -> float:
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


def _least(vals: np.ndarray, ids: np.ndarray) -> int:
    """The row of the least value (ties: of the least id): of one kind of move, the one the local
    search's order (value, sequence, kind) would take first."""
    r = np.flatnonzero(vals == vals.min())
    return int(r[np.argmin(ids[r])])


def _settle_blocks(ctx: PlanContext, L, Lf, slope, sizes, t_unit, where, load, gmax: int, rounds: int,
                   nic_share: float = 1.0, t_of: dict[int, np.ndarray] | None = None) -> bool:
    """Local search on a FLOP-share placement (in place): take the most loaded unit and move one of
    its sequences - a local one, or a ring with its aligned block - to the block of its size (or of
    half / twice it, where memory allows) whose fullest unit ends lowest, or swap it with a
    sequence of the same size elsewhere, whichever lowers the pair's larger load most, while that
    lowers the top load. LPT on aligned power-of-two blocks leaves steps of long sequences lumpy
    (every ring a large share of a unit's time); this evens them out. Returns whether anything
    moved."""
    n, cap = len(load), ctx.cost.token_capacity
    gsz = [1] + pow2_sizes(gmax)[1:]
    # per-unit time of every sequence at each size (``t_of``: the caller's, filled as needed)
    t_of = {} if t_of is None else t_of

    def t_at(G: int) -> np.ndarray:
        if G not in t_of:
            t_of[G] = _unit_time(ctx, Lf, slope, G, nic_share)
        return t_of[G]

    share_at: dict[int, np.ndarray] = {G: _zigzag_share(L, G) for G in gsz}
    start = np.array([w[0][0] for w in where], dtype=np.int64)
    size = sizes.astype(np.int64).copy()
    t = t_unit.astype(np.float64).copy()
    on: list[set[int]] = [set() for _ in range(n)]
    for i in range(len(L)):
        for u in range(start[i], start[i] + size[i]):
            on[u].add(i)
    moved = False
    for _ in range(rounds):
        hot = int(np.argmax(load))
        top = float(load[hot])
        mine = sorted(on[hot])
        cands: list[tuple] = []  # (value, sequence, option, size, new start, swap partner or -1)
        for i in (i for i in mine if size[i] > 1):  # rings (few): one block scan per size
            G0, s0, t0 = int(size[i]), int(start[i]), float(t[i])
            base = load.copy()
            base[s0:s0 + G0] -= t0
            for opt, G in enumerate((G0 // 2, G0, 2 * G0)):
                if G < 1 or G > gmax or (G not in share_at) or share_at[G][i] > cap:
                    continue
                nb = n // G
                bm = base[:nb * G].reshape(nb, G).max(axis=1) + float(t_at(G)[i])
                if G == G0:
                    bm[s0 // G0] = np.inf  # staying put is no move
                b = int(np.argmin(bm))
                cands.append((float(bm[b]), i, opt, G, b * G, -1))
            # swap with a sequence of the same size in another block
            oj = np.flatnonzero((size == G0) & (start // G0 != s0 // G0) & (t < t0))
            if len(oj):
                nb = n // G0
                bmax = load[:nb * G0].reshape(nb, G0).max(axis=1)
                val = np.maximum(top - t0 + t[oj], bmax[start[oj] // G0] + t0 - t[oj])
                a = int(np.argmin(val))
                cands.append((float(val[a]), i, 3, G0, int(start[oj[a]]), int(oj[a])))
        locs = np.array([i for i in mine if size[i] == 1], dtype=np.int64)
        if len(locs):  # the hot unit's local sequences, all at once
            k = len(locs)
            rows = np.arange(k)
            tl = t[locs]
            # alone on another unit
            M = load[None, :] + tl[:, None]
            M[:, hot] = np.inf
            u = M.argmin(axis=1)
            r = _least(M[rows, u], locs)
            cands.append((float(M[r, u[r]]), int(locs[r]), 1, 1, int(u[r]), -1))
            # as a ring of two on an aligned pair
            nb = n // 2
            if gmax >= 2 and nb:
                P = np.repeat((load[:2 * nb].reshape(nb, 2).max(axis=1))[None, :], k, axis=0)
                hb = hot // 2
                if hb < nb:
                    P[:, hb] = np.maximum(load[hot] - tl, load[hot ^ 1])
                P += t_at(2)[locs][:, None]
                P[share_at[2][locs] > cap] = np.inf
                b = P.argmin(axis=1)
                r = _least(P[rows, b], locs)
                cands.append((float(P[r, b[r]]), int(locs[r]), 2, 2, 2 * int(b[r]), -1))
            # swapped with a lighter local sequence of another unit
            oj = np.flatnonzero((size == 1) & (start != hot))
            if len(oj):
                tj, uj = t[oj], start[oj]
                V = np.maximum(top - tl[:, None] + tj[None, :], load[uj][None, :] + tl[:, None] - tj[None, :])
                V[tj[None, :] >= tl[:, None]] = np.inf
                c = V.argmin(axis=1)
                r = _least(V[rows, c], locs)
                cands.append((float(V[r, c[r]]), int(locs[r]), 3, 1, int(uj[c[r]]), int(oj[c[r]])))
        best = min(cands, key=lambda c: (c[0], c[1], c[2])) if cands else None
        if best is None or not best[0] < top * (1 - 1e-9):
            return moved
        moved = True
        _, i, opt, G, s_new, j = best
        kind = "swap" if opt == 3 else "move"
        G0, s0 = int(size[i]), int(start[i])
        load[s0:s0 + G0] -= t[i]
        for u in range(s0, s0 + G0):
            on[u].discard(i)
        if kind == "swap":
            load[s_new:s_new + G] -= t[j]
            for u in range(s_new, s_new + G):
                on[u].discard(j)
            load[s0:s0 + G0] += t[j]
            for u in range(s0, s0 + G0):
                on[u].add(j)
            start[j] = s0
            where[j] = (list(range(s0, s0 + G0)), int(share_at[G0][j]))
        if G != G0:
            size[i], t[i] = G, float(t_at(G)[i])
            sizes[i] = G
        start[i] = s_new
        load[s_new:s_new + G] += t[i]
        for u in range(s_new, s_new + G):
            on[u].add(i)
        where[i] = (list(range(s_new, s_new + G)), int(share_at[G][i]))
        t_unit[i] = t[i]
    return moved


# ---------------------------------------------------------------------------------------------
def _tp_comm(ctx: PlanContext, cm, tokens: np.ndarray) -> np.ndarray:
    if cm.tp <= 1:
        return np.zeros_like(tokens)
    return ctx.model.num_layers * cm.tp_exposed_comm(tokens)


def tp_replicas(ctx: PlanContext, step: int, sequences: list[Sequence], top: int = 2, limit: float | None = None):
    cl = ctx.cluster
    degrees = _replica_degrees(ctx)
    if len(degrees) < 2:
        return []
    world = cl.world_size
    cms = {d: ctx.cost_for(d) for d in degrees}
    caps = {d: cms[d].token_capacity for d in degrees}
    L = np.array([s.length for s in sequences], dtype=np.int64)
    Lf = L.astype(np.float64)
    D = degrees[-1]
    Lmax = int(L.max())
    cp = 1
    if caps[D] < Lmax:
        cp = next((g for g in pow2_sizes(world // D) if g > 1 and _zigzag_share(L[L.argmax():][:1], g)[0] <= caps[D]), 0)
        if not cp:
            return []
    types: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, int]] = {}  # (degree, cp): cost, tokens/unit, cap
    for d in degrees:
        types[(d, 1)] = (cms[d].seq_compute_time(Lf) + _tp_comm(ctx, cms[d], Lf), L, caps[d])
    if cp > 1:
        last = cp * D - 1
        tier = "inter" if cl.node_of(0) != cl.node_of(last) else "intra"
        sharers = 1.0
        if tier == "inter":
            nics: dict[str, int] = {}
            for g in range(D):
                nics[cl.nic_of(g)] = nics.get(cl.nic_of(g), 0) + 1
            sharers = float(max(nics.values()))
        cm = cms[D]
        sh = Lf / cp
        c = ctx.model.num_layers * (cm.ring_attention_time(Lf, cp, tier, sharers) + cm.linear_time(sh)) \
            + cm.head_time(sh) + _tp_comm(ctx, cm, sh)
        types[(D, cp)] = (c, _zigzag_share(L, cp), caps[D])
        his = [(D, cp)]
    else:
        his = [(d, 1) for d in degrees if caps[d] >= Lmax]
    configs = []
    for hi in his:
        gpus_hi = hi[0] * hi[1]
        for lo in [d for d in degrees if d <= hi[0]]:
            for k in _group_counts(world // gpus_hi):
                rest = world - k * gpus_hi
                if rest % lo:
                    continue
                cfg = {hi: k}
                if rest:
                    cfg[(lo, 1)] = cfg.get((lo, 1), 0) + rest // lo
                if cfg == {(ctx.tp, 1): world // ctx.tp}:
                    continue  # the context's own units: the tiered search's space
                if cfg not in configs:
                    configs.append(cfg)
    def keyed(cfg):  # group types in build order, indexed: (keys, cost, fits, counts)
        keys = sorted(cfg, key=lambda t: (-t[0] * t[1], -t[1]))
        return (keys, {x: types[t][0] for x, t in enumerate(keys)},
                {x: types[t][1] <= types[t][2] for x, t in enumerate(keys)}, {x: cfg[t] for x, t in enumerate(keys)})

    kc = [keyed(cfg) for cfg in configs]

    def run(a):
        return _dispatch(*kc[a][1:])

    def bound(a):
        keys, c, f, cnt = kc[a]
        return _dispatch_bound(c, f, cnt, {x: t[0] * t[1] for x, t in enumerate(keys)})

    refined = []
    for _, a, _, owner, loads in _best_dispatches(list(range(len(configs))), run, bound, top + 1, limit):
        keys, c, f, _ = kc[a]
        span, owner = _refine(c, f, owner, loads)
        refined.append((span, a, keys, configs[a], owner))
    scored = sorted(refined, key=lambda x: (x[0], x[1]))
    def build(keys, cfg, owner):
        replicas: list[Replica] = []
        units_of: dict[tuple[int, int], list[int]] = {}
        r0 = 0
        for x, (d, c) in enumerate(keys):
            for g in range(cfg[(d, c)]):
                units_of[(x, g)] = list(range(len(replicas), len(replicas) + c))
                for _ in range(c):
                    replicas.append(Replica(ranks=list(range(r0, r0 + d)), tp=d))
                    r0 += d
        members: dict[tuple[int, int], list[int]] = {}
        for i, key in enumerate(owner):
            members.setdefault(key, []).append(i)
        b = StepBuilder(ctx, sequences, "zeppelin", n_units=len(replicas), capacity=[caps[r.tp] for r in replicas],
                        replicas=replicas)
        for key in sorted(members):
            t = keys[key[0]]
            c_t, tok, cap_t = types[t]
            units = units_of[key]
            for k, bin_ in enumerate(_pack_bins(members[key], tok, c_t, cap_t)):
                for i in sorted(bin_, key=lambda i: (-L[i], i)):
                    b.place(k, "ring" if len(units) > 1 else "local", units, i)
        desc = " + ".join(f"{cfg[t]} x tp={t[0]}" + (f" cp={t[1]}" if t[1] > 1 else "") for t in keys)
        return b.finish(step, SolverInfo(name="greedy"), predict=predict_replicas, replicas=replicas,
                        notes={"family": "tp-replicas", "replicas": desc})

    return [(span, a, (lambda keys=keys, cfg=cfg, owner=owner: build(keys, cfg, owner)))
            for span, a, keys, cfg, owner in scored[:top]]


def _replica_degrees(ctx: PlanContext) -> list[int]:
    cl = ctx.cluster
    return [d for d in pow2_sizes(cl.gpus_per_node) if d >= ctx.tp and d % ctx.tp == 0
            and cl.gpus_per_node % d == 0 and ctx.model.num_heads % d == 0]


def replicas_hold(ctx: PlanContext, length: int) -> bool:
    """Whether replicas of the largest TP degree, context-parallel over as many of them as the
    cluster has, hold a sequence of ``length`` tokens (what :func:`tp_replicas` can plan)."""
    degrees = _replica_degrees(ctx)
    if len(degrees) < 2:
        return False
    D = degrees[-1]
    cap = ctx.cost_for(D).token_capacity
    return any(_zigzag_share(np.array([length]), g)[0] <= cap for g in pow2_sizes(ctx.cluster.world_size // D))


def family_plans(ctx: PlanContext, step: int, sequences: list[Sequence], families=FAMILIES,
                 bound: float | None = None, routing: bool = True) -> list[StepPlan]:
    """The families' best plans for the step (a family that cannot plan it contributes none).

    Each family scores its configurations by its own estimate of the slowest unit's time (no
    gradient all-reduce); only the best-scored ones become plans: two per family on clusters of at
    most 32 units, else the best of each of the two best-scored families. ``bound``: a
    configuration scored above it is not built - it cannot beat the plan the caller already has."""
    small = ctx.num_units <= 32
    fns = {"ulysses-groups": ulysses_groups, "flop-share": flop_share, "tp-replicas": tp_replicas}
    cands = []
    firsts: dict[int, tuple] = {}  # each family's best candidate
    for f, name in enumerate(families):
        limit = bound
        if not small and len(firsts) >= 2:
            # only the two best-scored families are built: a configuration scored above the
            # second-best family's best cannot be among them
            second = sorted(c[0] for c in firsts.values())[1]
            limit = second if limit is None else min(limit, second)
        try:
            # (a configuration whose lower bound is above ``limit`` is not even dispatched)
            kw = {"routing": routing} if name == "flop-share" else {"limit": limit}
            got = fns[name](ctx, step, sequences, top=2, **kw)
        except PlanningError:
            continue
        mine = [(score, f, a, build) for score, a, build in got]
        cands += mine
        if mine:
            firsts[f] = min(mine, key=lambda c: (c[0], c[2]))
    cands.sort(key=lambda c: (c[0], c[1], c[2]))
    if not small:
        # each family's best, the two best-scored families: the families' own scores do not
        # compare across families (FLOP-share's is coarse), so the prediction judges between them
        cands = sorted(firsts.values(), key=lambda c: (c[0], c[1], c[2]))[:2]
    out: list[StepPlan] = []
    for score, _, _, build in cands:
        if bound is not None and score > bound:
            continue
        try:
            out.append(build())
        except PlanningError:
            continue
    return out
