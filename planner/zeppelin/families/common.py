"""Helpers the candidate families share: whole-step dispatch of sequences over groups (with its
lower bound, pruned search and local search), micro-batching a group's share and per-token prices.
(A zigzag ring's token share is :func:`zeppelin.planner.core.base.zigzag_share`, shared with the
baselines.)"""

from __future__ import annotations

import heapq

import numpy as np

from zeppelin.planner.core.base import PlanContext, PlanningError, pow2_sizes
from zeppelin.planner.core.builder import StepBuilder
from zeppelin.planner.costmodel.predict import predict_step
from zeppelin.planner.zeppelin.protocols import Candidate
from zeppelin.planner.zeppelin.routing import plan_routes
from zeppelin.schemas.plan import SolverInfo


def ceil_div(a, b):
    return -(-np.asarray(a) // b)


def group_dispatch(cost: dict[int, np.ndarray], fits: dict[int, np.ndarray]):
    """``(run, bound)`` of a family whose group type is its size in units: ``run(cfg)``:
    :func:`dispatch` over the counts ``cfg``; ``bound(cfg)``: :func:`dispatch_bound` of it."""

    def run(cfg):
        return dispatch({t: cost[t] for t in cfg}, {t: fits[t] for t in cfg}, cfg)

    def bound(cfg):
        return dispatch_bound(cost, fits, cfg, {t: t for t in cfg})

    return run, bound


def build_groups(ctx: PlanContext, step: int, sequences, cost, need, cfg, owner, place, family: str, desc: str,
                 routing: bool = False):
    """The plan of a whole-step dispatch over groups whose type is their size: groups on aligned
    blocks of units (largest first), each group's sequences cut into micro-batches under its
    memory cap (:func:`pack_bins`). ``place(t)``: a type's ``(kind, cap, shape)``; ``routing``:
    node-crossing ring hops routed over the NICs (:func:`zeppelin.planner.zeppelin.routing.plan_routes`;
    else direct)."""
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
        kind, cap, shape = place(t)
        for k, bin_ in enumerate(pack_bins(members[key], need[t], cost[t], cap)):
            for i in sorted(bin_, key=lambda i: (-sequences[i].length, i)):
                b.place(k, kind, blocks[key], i, shape=shape)
    return finish_routed(ctx, b, step, {"family": family, "groups": desc}, routing)


def finish_routed(ctx: PlanContext, b: StepBuilder, step: int, notes: dict, routing: bool):
    """A family's built step: node-crossing ring hops routed (``routing``) over the NICs of their
    groups' units (:func:`zeppelin.planner.zeppelin.routing.plan_routes`; else direct), then
    predicted."""
    plan = b.finish(step, SolverInfo(name="greedy"), notes=notes, predict=lambda c, p: None,
                    routes=False)  # (predicted once routed)
    for mb in plan.microbatches:
        mb.routes = plan_routes(ctx, mb, enable=routing)
    plan.prediction = predict_step(ctx, plan)
    return plan


def group_counts(m: int) -> list[int]:
    """How many groups of the larger kind a heterogeneous configuration tries (at most ``m``): every
    count up to 8 (a step's few long sequences each get one), past it powers of two and three
    times them (the number of configurations stays logarithmic on large clusters)."""
    return sorted(set(range(1, min(m, 8) + 1)) | set(pow2_sizes(m)) | {3 * q for q in pow2_sizes(m // 3)})


def dispatch(cost: dict[int, np.ndarray], fits: dict[int, np.ndarray], counts: dict[int, int],
              fixed: dict[int, float] | None = None, improve: bool = False):
    """Whole-step dispatch over group types: ``counts[t]`` groups of type ``t``, ``cost[t][i]`` the
    time of sequence ``i`` on one group of type ``t``. Most expensive sequence first (its cheapest
    type's time), each to the group where it finishes earliest (ties: lower type, lower group);
    ``improve``: then the local search of :func:`improve_dispatch`. Returns (makespan, [(type, group
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
        type_a, type_b = types
        ha, hb = heaps[type_a], heaps[type_b]
        ca = np.where(fits[type_a], cost[type_a], np.inf).tolist()
        cb = np.where(fits[type_b], cost[type_b], np.inf).tolist()
        replace = heapq.heapreplace
        for i in order:
            la, ga = ha[0]
            lb, gb = hb[0]
            fa, fb = la + ca[i], lb + cb[i]
            if fa <= fb:
                replace(ha, (fa, ga))
                out[i] = (type_a, ga)
            else:
                replace(hb, (fb, gb))
                out[i] = (type_b, gb)
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
        improve_dispatch(cost, fits, out, loads)
    span = max(float(loads[t].max()) for t in types)
    return span, out, loads


def dispatch_bound(cost: dict[int, np.ndarray], fits: dict[int, np.ndarray], counts: dict[int, int],
                    width: dict[int, int]) -> float:
    """A lower bound on :func:`dispatch`'s makespan (inf where a sequence fits no type): no
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


def best_dispatches(configs: list, run, bound, keep: int, limit: float | None = None) -> list:
    """The ``keep`` best dispatches of ``configs`` (``run(cfg)``: :func:`dispatch`'s result or
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


def refine(cost, fits, owner: list, loads: dict) -> tuple[float, list]:
    """:func:`improve_dispatch` on a copy of a dispatch: (makespan, owner)."""
    owner, loads = list(owner), {t: v.copy() for t, v in loads.items()}
    improve_dispatch(cost, fits, owner, loads)
    return max(float(v.max()) for v in loads.values()), owner


def improve_dispatch(cost, fits, out, loads, rounds: int = 24, cold_groups: int = 3) -> None:
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
            if not repartition(cost, fits, out, members, loads, hot, top, keys, lv, cold_groups):
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


def repartition(cost, fits, out, members, loads, hot, top, keys, lv, cold_groups) -> bool:
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
        # (row sums, not matrix products: BLAS adds in an order of its CPU kernel's choosing, and
        # near-equal splits must rank alike on every machine)
        val = np.where(bad > 0, np.inf, np.maximum((m * ch).sum(axis=1), ((1 - m) * cc).sum(axis=1)))
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


def pack_bins(items: list[int], need: np.ndarray, w: np.ndarray, cap: int) -> list[list[int]]:
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
            return ffd(items, need, cap)
        b = min(ok, key=lambda b: (load[b], b))
        bins[b].append(i)
        load[b] += float(w[i])
        held[b] += int(need[i])
    return [b for b in bins if b]


def ffd(items, need, cap):
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


def token_slope(ctx: PlanContext, cm, T: float, s: int = 1, link: str = "intra") -> float:
    """Marginal time per token (linear modules, LM head, TP and - for ``s`` > 1 - Ulysses
    all-to-alls) of a unit holding about ``T`` tokens: the secant between T/2 and T."""

    def f(x):  # (a Ulysses row past the KV heads sends their replicas: CostModel.ulysses_comm_time)
        comm = cm.ulysses_comm_time(x, s, link) if s > 1 else 0.0
        tp = cm.tp_exposed_comm(x) if cm.tp > 1 else 0.0
        return float(ctx.model.num_layers * (cm.linear_time(x) + comm + tp) + cm.head_time(x))

    return (f(T) - f(T / 2)) / (T / 2)


def ranked_by_prediction(ctx: PlanContext, found: list) -> list[Candidate]:
    """A family's configurations ``(score, index, build)`` built and ranked by their predicted step
    time, for the families whose own score ranks configurations only roughly (usp groups' prices
    each sequence alone on its group type and its groups as if they never waited for each other,
    which ranks usp sizes wrongly where one group of many rows hides its rings' rounds behind all
    of the step's sequences and several groups' micro-batches wait for each other; long blocks'
    prices each long sequence's ring alone). The best-predicted keeps the family's best score
    (what the other families' scores are compared with); the others' scores are scaled by their
    predictions. A configuration that does not fit is dropped."""
    built = []
    for score, a, build in found:
        try:
            built.append((score, a, build()))
        except PlanningError:
            continue
    if not built:
        return []
    best = min(score for score, _, _ in built)
    low = min(p.prediction.step_time_s for _, _, p in built)
    ranked = sorted(((best * p.prediction.step_time_s / low, a, p) for _, a, p in built), key=lambda x: (x[0], x[1]))
    return [Candidate(score, a, (lambda p=p: p)) for score, a, p in ranked]


def usp_seq_time(cm, L: np.ndarray, u: int, r: int) -> np.ndarray:
    """Per sequence, its per-layer time on a usp group of u x r beside the step's other sequences:
    its rounds' compute on 1/u of the heads, and a share by tokens of the exposed ring transfers of
    all of them in one group (a ring round moves every sequence's blocks at once and hides behind
    all of their compute: priced alone, a short sequence would pay a round's latency unhidden)."""
    t0, tr = cm.ring_round_compute(L, r)
    if r <= 1:
        return t0 / u
    _, _, exposed = cm.usp_terms(L, u, r, "intra", "inter")
    a2a = float(cm.ulysses_comm_time(float(L.sum()) / (u * r), u, "intra")) if u > 1 else 0.0
    return (t0 + (r - 1) * tr) / u + max(exposed - a2a, 0.0) * L / max(float(L.sum()), 1.0)


def intra_types(ctx: PlanContext, L: np.ndarray):
    """The group types inside a node, by size in units (1: a whole sequence on one unit; else a
    Ulysses group, the sizes the heads per unit divide): ``(sizes, cost, fits, need, cap)``, per
    size each sequence's time on one group (attention, and the linear modules at the step's
    marginal price per token), whether it fits, its tokens per unit, and the tokens a unit of
    such a group holds."""
    n, upn, cm, layers = ctx.num_units, ctx.units_per_node, ctx.cost, ctx.model.num_layers
    heads = max(1, ctx.model.num_heads // ctx.tp)
    Lf = L.astype(np.float64)
    T_avg = max(float(Lf.sum()) / n, 2.0)
    sizes = [s for s in pow2_sizes(upn) if heads % s == 0]
    cost, fits, need, cap = {}, {}, {}, {}
    for s in sizes:
        cost[s] = layers * cm.ulysses_attn_time(Lf, s) + token_slope(ctx, cm, T_avg, s, "intra") * Lf / s
        need[s] = ceil_div(L, s)
        cap[s] = cm.ulysses_capacity(s) if s > 1 else cm.token_capacity
        fits[s] = need[s] <= cap[s]
    return sizes, cost, fits, need, cap
