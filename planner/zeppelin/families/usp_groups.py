"""Candidate family ``usp-groups``: 2-D sequence parallelism (Ulysses x ring, ``usp`` groups) for
the sequences long enough to be split across nodes.

A sequence too long for one node's units - by memory, or because alone on a node it takes more than
half the step's average load per unit - must cross nodes. A ring over its units sends all of its
K/V through the NICs; a Ulysses group cannot grow past the heads (nor, without replication, past
the KV heads); a usp group of ``u x r`` runs Ulysses over ``u`` units inside a node and a ring over
``r`` such rows, so only ``1/u`` of the K/V (one KV head where ``u`` exceeds them) crosses the NICs
per hop. The family tries ``k`` usp groups of a size ``S`` spanning nodes (per size, the ``u`` whose
groups price cheapest for the step's sequences) for the long sequences, and the rest of the units
as Ulysses groups of a size ``s`` inside a node (or whole-sequence units), sequences dealt
whole-step to the group where they finish earliest (cost-model time), each group's share cut into
micro-batches first-fit-decreasing under the memory cap; also every unit in usp groups of one
size. The few configurations kept are built and ranked by the prediction (the score prices
sequences alone and groups as independent). Steps without a long sequence get no candidate (one
pass over the lengths).
"""

from __future__ import annotations

import numpy as np

from zeppelin.planner.core.base import PlanContext, pow2_sizes
from zeppelin.planner.costmodel.predict import usp_row_sizes
from zeppelin.planner.zeppelin.families.common import (
    best_dispatches,
    build_groups,
    ceil_div,
    group_counts,
    group_dispatch,
    intra_types,
    ranked_by_prediction,
    refine,
    token_slope,
    usp_seq_time,
)
from zeppelin.planner.zeppelin.protocols import Candidate
from zeppelin.schemas.plan import Sequence

name = "usp-groups"


def candidates(ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
               routing: bool = True, top: int = 2) -> list[Candidate]:
    """The family's best ``top`` configurations (``limit``: none scored above it)."""
    return usp_groups(ctx, step, sequences, top=top, limit=limit, routing=routing)


def usp_groups(ctx: PlanContext, step: int, sequences: list[Sequence], top: int = 2, limit: float | None = None,
               routing: bool = True):
    n, upn = ctx.num_units, ctx.units_per_node
    if n < 2 * upn or not usp_row_sizes(ctx):
        return []
    L = np.array([s.length for s in sequences], dtype=np.int64)
    small, big, shape, cost, fits, need = _prices(ctx, L)
    if not big or not _has_long(L, small, cost, fits, n):
        return []
    run, bound = group_dispatch(cost, fits)

    homo = [{S: n // S} for S in big]
    mixed = [{S: k, s: (n - k * S) // s} for S in big for s in small for k in group_counts(n // S)
             if k * S < n and (n - k * S) // s > 0]
    # every homogeneous shape (few: one per usp size) and the best few mixed configurations: the
    # family's score ranks usp sizes only roughly (it prices each sequence alone), the prediction decides
    found = best_dispatches(homo, run, bound, len(homo), limit)
    found += [(x[0], len(homo) + x[1], *x[2:]) for x in best_dispatches(mixed, run, bound, top + 1, limit)]
    refined = []
    for _, a, cfg, owner, loads in found:
        span, owner = refine(cost, fits, owner, loads)
        refined.append((span, a, cfg, owner))
    refined.sort(key=lambda x: (x[0], x[1]))
    keep = [x for x in refined if x[1] < len(homo)] + [x for x in refined if x[1] >= len(homo)][:top]
    return ranked_by_prediction(ctx, [(span, a, (lambda cfg=cfg, owner=owner: _build(
        ctx, step, sequences, shape, cost, need, cfg, owner, routing))) for span, a, cfg, owner in keep])


def _prices(ctx: PlanContext, L: np.ndarray):
    """Group types: ``small`` sizes inside a node (1: whole sequences; else Ulysses), ``big`` usp
    sizes spanning nodes with their best ``shape[S] = (u, r)``; per type each sequence's time on
    one group, whether it fits, and its tokens per unit."""
    n, upn, cm, layers = ctx.num_units, ctx.units_per_node, ctx.cost, ctx.model.num_layers
    Lf = L.astype(np.float64)
    T_avg = max(float(Lf.sum()) / n, 2.0)
    small, cost, fits, need, _ = intra_types(ctx, L)
    shape: dict = {}
    big = []
    for S in (x for x in pow2_sizes(n) if x > upn and n % x == 0):
        best = None
        for u in usp_row_sizes(ctx):
            c = layers * usp_seq_time(cm, Lf, u, S // u) + token_slope(ctx, cm, T_avg, u, "intra") * Lf / S
            if best is None or float(c.sum()) < float(best[1].sum()):
                best = (u, c)
        if best is None:
            continue
        big.append(S)
        shape[S], cost[S] = (best[0], S // best[0]), best[1]
        need[S] = ceil_div(L, S)
        fits[S] = need[S] <= cm.ulysses_capacity(best[0])
    return small, big, shape, cost, fits, need


#: a sequence is long when on its best group inside a node it alone takes more than this share of
#: the step's average load per unit (a node's units then have little room left for the rest)
LONG_SHARE = 0.5


def _has_long(L: np.ndarray, small: list[int], cost, fits, n: int) -> bool:
    """Whether some sequence must cross nodes: it fits no group inside a node, or on its best one
    it alone takes more than :data:`LONG_SHARE` of the step's average load per unit."""
    best = np.full(len(L), np.inf)
    area = np.full(len(L), np.inf)
    for s in small:
        c = np.where(fits[s], cost[s], np.inf)
        best, area = np.minimum(best, c), np.minimum(area, s * c)
    if not np.isfinite(best).all():
        return True
    return bool(best.max() > LONG_SHARE * area.sum() / n)


def _build(ctx: PlanContext, step: int, sequences: list[Sequence], shape, cost, need, cfg, owner, routing: bool):
    """The plan of a dispatch: groups on aligned blocks (largest first; a usp group's rows are u
    consecutive units), the column rings' hops between nodes routed (``routing``) over the NICs of
    their rings' units."""
    cm = ctx.cost

    def place(t):
        if t in shape:
            return "usp", cm.ulysses_capacity(shape[t][0]), shape[t]
        return ("ulysses", cm.ulysses_capacity(t), None) if t > 1 else ("local", cm.token_capacity, None)

    desc = " + ".join(f"{cfg[t]} x usp={shape[t][0]}x{shape[t][1]}" if t in shape else f"{cfg[t]} x sp={t}"
                      for t in sorted(cfg, reverse=True))
    return build_groups(ctx, step, sequences, cost, need, cfg, owner, place, name, desc, routing)
