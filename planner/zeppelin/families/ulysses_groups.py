"""Candidate family ``ulysses-groups``: Ulysses groups that keep their units for the whole step
(FlexSP's freedom).

``n / s`` groups of ``s`` units, or ``k`` groups of a larger size ``S`` (for the sequences that need
it) and the rest of size ``s``; sequences dealt whole-step to the group where they finish earliest
(cost-model time, most expensive first), each group's share cut into micro-batches
first-fit-decreasing under the memory cap. Groups never wait for each other, so the step costs the
slowest group's sum of micro-batch times.
"""

from __future__ import annotations

import numpy as np

from zeppelin.planner.core.base import PlanContext, pow2_sizes
from zeppelin.planner.zeppelin.families.common import (
    best_dispatches,
    build_groups,
    ceil_div,
    group_counts,
    group_dispatch,
    refine,
    token_slope,
)
from zeppelin.planner.zeppelin.protocols import Candidate
from zeppelin.schemas.plan import Sequence

name = "ulysses-groups"


def candidates(ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
               routing: bool = True, top: int = 2) -> list[Candidate]:
    """The family's best ``top`` configurations (``limit``: none scored above it)."""
    return ulysses_groups(ctx, step, sequences, top=top, limit=limit)


def ulysses_groups(ctx: PlanContext, step: int, sequences: list[Sequence], top: int = 2, limit: float | None = None):
    n = ctx.num_units
    L = np.array([s.length for s in sequences], dtype=np.int64)
    sizes, cost, fits, need = _group_prices(ctx, L)
    run, bound = group_dispatch(cost, fits)

    homo = [{s: n // s} for s in sizes]
    scored = best_dispatches(homo, run, bound, top + 1)
    if scored:
        # heterogeneous around the best homogeneous size s*: k groups of a larger size (one or two
        # steps up) for the long sequences, the rest of size s* or s*/2
        s_best = next(iter(scored[0][2]))
        near = [x for x in sizes if s_best // 2 <= x <= 4 * s_best]
        het = [{big: k, small: (n - k * big) // small} for big in near for small in [x for x in near if x < big]
               for k in group_counts(n // big) if k * big + small <= n]
        # (indices after the homogeneous ones: ties keep the homogeneous configuration)
        more = best_dispatches(het, run, bound, top + 1, limit)
        scored = sorted(scored + [(x[0], len(homo) + x[1], *x[2:]) for x in more], key=lambda x: (x[0], x[1]))
    # the best few dispatches refined by local search, then ranked again
    refined = []
    for _, a, cfg, owner, loads in scored[:top + 1]:
        if limit is not None and bound(cfg) > limit:
            continue  # (no refinement brings it under the caller's limit)
        span, owner = refine(cost, fits, owner, loads)
        refined.append((span, a, cfg, owner))
    scored = sorted(refined, key=lambda x: (x[0], x[1]))
    return [Candidate(span, a, (lambda cfg=cfg, owner=owner: _build(ctx, step, sequences, cost, need, cfg, owner)))
            for span, a, cfg, owner in scored[:top]]


def _group_prices(ctx: PlanContext, L: np.ndarray):
    """The group sizes a step can use (powers of two dividing the heads and the units) and, per
    size, each sequence's time on one group, whether it fits, and its tokens per unit."""
    n, per_node, cm = ctx.num_units, ctx.units_per_node, ctx.cost
    heads = max(1, ctx.model.num_heads // ctx.tp)
    Lf = L.astype(np.float64)
    sizes = [s for s in pow2_sizes(n) if heads % s == 0 and n % s == 0]
    cost, fits, need = {}, {}, {}
    T_avg = max(float(Lf.sum()) / n, 2.0)
    for s in sizes:
        link = "inter" if s > per_node else "intra"
        # a group's linear modules, LM head and all-to-alls run once per micro-batch on all its
        # tokens: priced per token by their slope around a unit's average share of the step (a
        # per-sequence price would charge every short sequence the fixed costs again)
        slope = token_slope(ctx, cm, T_avg, s, link)
        cost[s] = ctx.model.num_layers * cm.ulysses_attn_time(Lf, s) + slope * Lf / s
        need[s] = ceil_div(L, s)
        fits[s] = need[s] <= _cap(cm, s)
    return sizes, cost, fits, need


def _cap(cm, s: int) -> int:
    """Tokens a member of a group of ``s`` holds: a Ulysses member's extra copies (replicated K/V
    heads where ``s`` exceeds them) counted."""
    return cm.ulysses_capacity(s) if s > 1 else cm.token_capacity


def _build(ctx: PlanContext, step: int, sequences: list[Sequence], cost, need, cfg, owner):
    """The plan of a dispatch: Ulysses groups (one unit: whole sequences) on aligned blocks."""
    desc = " + ".join(f"{cfg[t]} x sp={t}" for t in sorted(cfg, reverse=True))
    return build_groups(ctx, step, sequences, cost, need, cfg, owner,
                        lambda t: ("ulysses" if t > 1 else "local", _cap(ctx.cost, t), None), name, desc)
