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

A configuration: the micro-batch count (the fewest whose tokens fit the units' memory and whose
long sequences fit side by side, and one more); the long sequences dealt, longest first, to the
micro-batch with the fewest long tokens; per micro-batch the width in nodes of each of its long
sequences. The short sequences then, most expensive first, go whole to a unit (or to a Ulysses group
inside a node where no unit holds them) of the micro-batch where they raise that micro-batch's
slowest unit least (ties: the least-loaded place, then the lowest), within each unit's memory. The
score, the family's own estimate of the step, is the sum over micro-batches of their slowest unit.
The widths are searched from a level shared by every micro-batch (each long sequence on the fewest
nodes where its time per unit is at most the level; the levels are the longest sequence's times at
each width): from the :data:`STARTS` best, one micro-batch's widths at a time (its long sequences
on ``B`` nodes split evenly, every ``B``) while that lowers the score. The best few are built and
ranked by the prediction (:func:`.common.ranked_by_prediction`).

A sequence is long when it fits no group inside a node, or on its best one it alone takes more than
:data:`LONG_SHARE` of the step's average load per unit. Steps without one get no candidate.
"""

from __future__ import annotations

import numpy as np

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.core.builder import StepBuilder
from zeppelin.planner.costmodel.predict import predict_step
from zeppelin.planner.zeppelin.families.common import (
    ceil_div,
    intra_types,
    ranked_by_prediction,
    token_slope,
    usp_row_sizes,
    usp_seq_time,
)
from zeppelin.planner.zeppelin.protocols import Candidate
from zeppelin.planner.zeppelin.routing import plan_routes
from zeppelin.schemas.plan import Sequence, SolverInfo

name = "long-blocks"
#: a sequence is long when on its best group inside a node it alone takes more than this share of
#: the step's average load per unit
LONG_SHARE = 0.5
#: the best shared levels from which each micro-batch's widths are searched on
STARTS = 2
_EPS = 1e-9


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
    longs = _long(L, intra, n)
    if not longs:
        return []
    shorts = [i for i in range(len(L)) if i not in set(longs)]
    best_intra = _cheapest(intra, shorts)
    shorts.sort(key=lambda i: (-best_intra[i], i))
    blocks = _block_times(ctx, L, longs, nodes)
    cap = ctx.cost.token_capacity
    m0 = max(1, int(ceil_div(int(L.sum()), max(n * cap, 1))))
    found: dict[tuple, tuple | None] = {}  # (micro-batches, widths per micro-batch) -> (score, layout)

    def score(key) -> float:
        if key not in found:
            found[key] = _layout(ctx, L, parts_of[key[0]], key[1], blocks, intra, shorts)
        return found[key][0] if found[key] is not None else float("inf")

    parts_of: dict[int, list] = {}
    for m in range(m0, max(m0, len(longs)) + 1):
        parts = _deal(L, longs, m)
        options = [_mb_options(part, blocks, nodes) for part in parts]
        if not all(options):
            continue  # a micro-batch's long sequences do not fit side by side: more micro-batches
        parts_of[m] = parts
        if len(parts_of) == 2:
            break
    for m, parts in parts_of.items():
        options = [_mb_options(part, blocks, nodes) for part in parts]
        starts = []
        for lv in sorted({t for t, _, _ in blocks[longs[0]].values()}):  # (the longest's widths)
            widths = _widths(parts, blocks, [lv] * m, nodes)
            if widths is not None:
                starts.append((score((m, widths)), (m, widths)))
        for _, key in sorted(starts, key=lambda x: (x[0], _order(x[1])))[:STARTS]:
            _descend(key, options, score)
    ok = sorted(((v[0], k) for k, v in found.items() if v is not None), key=lambda x: (x[0], _order(x[1])))
    if limit is not None:
        ok = [x for x in ok if x[0] <= limit]
    keep = ok[:top]
    return ranked_by_prediction(ctx, [(t, a, (lambda key=key: _build(ctx, step, sequences, found[key][1], routing)))
                                      for a, (t, key) in enumerate(keep)])


def _order(key: tuple) -> tuple:
    """A configuration's place among equal scores: fewer micro-batches, then narrower blocks."""
    m, widths = key
    return (m, tuple(w for mb in widths for w in mb))


def _long(L: np.ndarray, intra, n: int) -> list[int]:
    """Indices of the long sequences (module docstring), longest first."""
    sizes, cost, fits, _, _ = intra
    best = np.full(len(L), np.inf)
    area = np.full(len(L), np.inf)
    for s in sizes:
        best = np.minimum(best, np.where(fits[s], cost[s], np.inf))
        area = np.minimum(area, s * cost[s])  # (a sequence no group holds: its area as if one did)
    avg = float(area.sum()) / n
    out = [i for i in range(len(L)) if not np.isfinite(best[i]) or best[i] > LONG_SHARE * avg]
    return sorted(out, key=lambda i: (-int(L[i]), i))


def _cheapest(intra, idx: list[int]) -> dict[int, float]:
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
                    cap_u = cm.ulysses_capacity(u)
                    held = -(-length // S)
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


def _deal(L: np.ndarray, longs: list[int], m: int) -> list[list[int]]:
    """The long sequences over ``m`` micro-batches, longest first to the one with the fewest long
    tokens (ties: the lower)."""
    parts: list[list[int]] = [[] for _ in range(m)]
    tok = [0] * m
    for i in longs:
        k = min(range(m), key=lambda k: (tok[k], k))
        parts[k].append(i)
        tok[k] += int(L[i])
    return parts


def _mb_options(part: list[int], blocks, nodes: int) -> list[tuple]:
    """A micro-batch's width choices for its long sequences (longest first): ``B`` nodes split as
    evenly as may be (the longer the wider), for every ``B`` from the fewest that fit to all."""
    if not part:
        return [()]
    q = len(part)
    lo = max(min(blocks[i]) if blocks[i] else nodes + 1 for i in part)
    out = []
    for B in range(q * lo, nodes + 1):
        ws = tuple(B // q + (1 if j < B % q else 0) for j in range(q))
        if all(w in blocks[i] for i, w in zip(part, ws)):
            out.append(ws)
    return out


def _descend(key: tuple, options: list[list[tuple]], score) -> None:
    """Coordinate descent from ``key`` over the micro-batches' width choices: per micro-batch in
    turn, its best choice with the others fixed, while one improves the score."""
    m, widths = key
    best = score(key)
    improved = True
    while improved:
        improved = False
        for k in range(m):
            for ws in options[k]:
                cand = (m, widths[:k] + (ws,) + widths[k + 1:])
                t = score(cand)
                if t < best * (1 - _EPS):
                    best, widths, improved = t, cand[1], True


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


def _layout(ctx: PlanContext, L: np.ndarray, parts, widths, blocks, intra, shorts: list[int]):
    """``(score, layout)`` of one configuration (module docstring), or None where a short sequence
    fits nowhere. ``layout``: per unit and micro-batch its load (``loads``), and the placements
    (micro-batch, kind, units, sequence, usp shape)."""
    n, upn = ctx.num_units, ctx.units_per_node
    m = len(parts)
    sizes, cost, fits, need, cap = intra
    loads = np.zeros((m, n))
    mem = np.zeros((m, n))  # share of a unit's activation memory in use
    places = []
    for k, (part, ws) in enumerate(zip(parts, widths)):
        node = 0
        for i, w in zip(part, ws):
            t, u, share = blocks[i][w]
            units = list(range(node * upn, (node + w) * upn))
            node += w
            loads[k, units] += t
            mem[k, units] += share
            places.append((k, "usp", units, i, (u, w * upn // u)))
    mx = loads.max(axis=1)
    for i in shorts:
        for s in sizes:
            if not fits[s][i]:
                continue
            c, sh = float(cost[s][i]), float(need[s][i]) / max(cap[s], 1)
            if s == 1:
                bl, bm = loads, mem
            else:
                bl, bm = loads.reshape(m, n // s, s).max(axis=2), mem.reshape(m, n // s, s).max(axis=2)
            new = bl + c
            new[bm + sh > 1 + _EPS] = np.inf
            inc = np.maximum(new - mx[:, None], 0.0).ravel()
            a = int(np.argmin(inc))
            if not np.isfinite(inc[a]):
                continue
            tied = np.flatnonzero(inc <= inc[a])
            a = int(tied[np.argmin(new.ravel()[tied])])  # (first of equals: the lowest)
            k, blk = divmod(a, new.shape[1])
            units = list(range(blk * s, (blk + 1) * s))
            loads[k, blk * s:(blk + 1) * s] += c
            mem[k, blk * s:(blk + 1) * s] += sh
            mx[k] = max(mx[k], float(new[k, blk]))
            places.append((k, "ulysses" if s > 1 else "local", units, i, None))
            break
        else:
            return None
    return float(loads.max(axis=1).sum()), {"loads": loads, "places": places, "widths": widths}


def _build(ctx: PlanContext, step: int, sequences: list[Sequence], layout: dict, routing: bool):
    """The plan of a layout; node-crossing ring hops routed (``routing``) over the NICs of their
    groups' units."""
    b = StepBuilder(ctx, sequences, "zeppelin")
    for k, kind, units, i, shape in layout["places"]:
        b.place(k, kind, units, i, shape=shape)
    desc = "; ".join("+".join(f"{w}n" for w in ws) or "-" for ws in layout["widths"])
    plan = b.finish(step, SolverInfo(name="greedy"), notes={"family": name, "groups": f"long blocks {desc}"},
                    predict=lambda c, p: None, routes=False)  # (predicted once routed)
    for mb in plan.microbatches:
        mb.routes = plan_routes(ctx, mb, enable=routing)
    plan.prediction = predict_step(ctx, plan)
    return plan
