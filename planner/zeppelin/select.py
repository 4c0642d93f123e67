"""Choosing a step's plan: the one place where candidates are pruned, judged and recorded.

The planner's own whole-step searches hand in their candidates (scored by their prediction
already); the families (:mod:`.families`) hand in candidates scored by their own estimates, of
which only those that could win are built; both as :class:`.protocols.Candidate`.
Every built plan is then judged the same way - on small clusters by the event-driven simulator,
which sees ring pipeline waits and NIC contention the prediction approximates; beyond, by the
analytic prediction, whose few best (beyond 32 units: the near ties) are confirmed by the simulator -
and the fastest wins; ties
keep the earlier candidate (the planner's own plans come first, then the families in registry
order).
"""

from __future__ import annotations

import time

from zeppelin.planner.core.base import PlanContext, PlanningError
from zeppelin.planner.core.solver import WALL_CLOCK
from zeppelin.planner.zeppelin.families import REGISTRY
from zeppelin.planner.zeppelin.protocols import Candidate
from zeppelin.schemas.plan import Sequence, SolverInfo, StepPlan

#: beyond ``simulate_max_units`` units the plans are ranked by the prediction and this many of the
#: best-predicted are confirmed by the simulator (the reference where the two disagree: overlapping
#: rings, routed crossings and shared NICs are played out there, approximated here)
CONFIRM_TOP = 3
#: ... on clusters of at most this many units (the simulator's work grows with the cluster)
CONFIRM_MAX_UNITS = 32
#: ``--recompute auto`` confirms by the simulator its close whole-step plans (one per global mode
#: tried, at most three a step) on clusters of at most this many units: a few simulations a step,
#: where the prediction misprices one micro-batch with recomputation against two without
MODE_CONFIRM_MAX_UNITS = 256

#: beyond :data:`CONFIRM_MAX_UNITS` units (up to :data:`MODE_CONFIRM_MAX_UNITS`), the plans predicted
#: within this share of the best are confirmed by the simulator: the prediction must not decide a
#: near tie (a family's plan can be predicted a few percent short where rings of its shape wait on
#: each other)
CLOSE_MARGIN = 0.01

#: up to this many units every family builds its two best configurations; beyond, only the best
#: of each of the two best-scored families is built
BUILD_ALL_MAX_UNITS = 32



def family_plans(ctx: PlanContext, step: int, sequences: list[Sequence], families, bound: float | None = None,
                 routing: bool = True) -> list[StepPlan]:
    """The families' plans worth judging (a family that cannot plan the step contributes none).

    Each family scores its configurations by its own estimate of the slowest unit's time (no
    gradient all-reduce); only the best-scored ones become plans: two per family on clusters of at
    most :data:`BUILD_ALL_MAX_UNITS` units, else the best of each of the two best-scored families
    (their own scores do not compare across families, so the judge decides between them).
    ``bound``: a configuration scored above it is not built - it cannot beat the plan the caller
    already has."""
    small = ctx.num_units <= BUILD_ALL_MAX_UNITS
    cands = []
    firsts: dict[int, tuple] = {}  # each family's best candidate
    for f, name in enumerate(families):
        limit = bound
        if not small and len(firsts) >= 2:
            # only the two best-scored families are built: a configuration scored above the
            # second-best family's best cannot be among them
            second = sorted(c.score for _, c in firsts.values())[1]
            limit = second if limit is None else min(limit, second)
        try:
            got = REGISTRY[name].candidates(ctx, step, sequences, limit=limit, routing=routing, top=2)
        except PlanningError:
            continue
        mine = [(f, c) for c in got]
        cands += mine
        if mine:
            firsts[f] = min(mine, key=lambda fc: (fc[1].score, fc[1].index))
    cands.sort(key=_ranked)
    if not small:
        cands = sorted(firsts.values(), key=_ranked)[:2]
    out: list[StepPlan] = []
    for _, c in cands:
        if bound is not None and c.score > bound:
            continue
        try:
            out.append(c.build())
        except PlanningError:
            continue
    return out


def _ranked(fc: tuple[int, Candidate]) -> tuple:
    """The order families' candidates are built in: by score, then the family's place in the
    list, then the candidate's index."""
    f, c = fc
    return c.score, f, c.index


def _judge(ctx: PlanContext, entries: list, simulator, simulate_all: bool):
    """The fastest entry ``(plan, finish)``: by the simulator (every entry where ``simulate_all``,
    else the best-predicted few) or by the prediction alone; ties keep the earlier entry."""
    scored = [(e[0].prediction.step_time_s, a, e) for a, e in enumerate(entries)]
    if len(entries) > 1 and simulator is not None:
        if simulate_all:
            keep = scored
        elif ctx.num_units <= CONFIRM_MAX_UNITS:
            keep = sorted(scored, key=lambda x: (x[0], x[1]))[:CONFIRM_TOP]
        elif ctx.num_units <= MODE_CONFIRM_MAX_UNITS:
            best = min(x[0] for x in scored)
            keep = [x for x in sorted(scored, key=lambda x: (x[0], x[1]))
                    if x[0] <= best * (1 + CLOSE_MARGIN)][:CONFIRM_TOP]
            keep = keep if len(keep) > 1 else []
        else:
            keep = []
        if keep:
            sim = simulator()
            scored = [(sim.simulate_step(e[0]).step_time_s, a, e) for _, a, e in keep]
    return min(scored, key=lambda x: (x[0], x[1]))[2]


def select(ctx: PlanContext, step: int, sequences: list[Sequence], own: list[Candidate], families, *,
           margin: float | None, routing: bool, simulator=None, simulate_all: bool = True, t0: float,
           wall_hit: bool = False, collector=None) -> StepPlan | None:
    """The step's plan: the fastest of the planner's ``own`` candidates and the plans of
    ``families`` (names), judged by ``simulator`` where one is given and more than one plan
    competes, else by the prediction; ties keep the earlier. Judged by the prediction, only the
    first of the fastest own candidates is built (their times are the prediction's already).
    Records the winner's :class:`SolverInfo` (``t0``: when the step's planning began;
    ``wall_hit``: whether a packing ILP of the step stopped at the wall-clock safety net). None
    when there is no plan at all. ``collector``: called with every plan built (None: none).

    ``simulator``: a function returning the simulator (made only when it is used), which judges
    every plan where ``simulate_all``, else confirms the
    :data:`CONFIRM_TOP` best-predicted on clusters of at most :data:`CONFIRM_MAX_UNITS` units, and
    up to :data:`MODE_CONFIRM_MAX_UNITS` units those predicted within :data:`CLOSE_MARGIN` of the best.
    ``margin``: a family configuration whose own score is more than this share above the fastest
    own candidate is not built - it would not win (None: every family's best are built, as
    :func:`family_plans` prunes them)."""
    bound = min(c.score for c in own) * (1 + margin) if margin is not None and own else None
    if not (simulator is not None and simulate_all) and own:
        own = [min(own, key=lambda c: c.score)]
    entries = [(c.build(), c.finish) for c in own]
    fams = family_plans(ctx, step, sequences, families, bound, routing=routing) if families else []
    entries += [(f, None) for f in fams]
    if not entries:
        return None
    if collector is not None:
        for e in entries:
            collector(e[0])
    plan, finish = _judge(ctx, entries, simulator, simulate_all)
    elapsed = time.perf_counter() - t0
    if finish is not None:
        finish(plan, elapsed)
        return plan
    plan.solver = SolverInfo(name="greedy", status="ok", gap=None, time_s=elapsed)
    if wall_hit:  # it won against candidates shaped by a load-dependent ILP
        plan.solver.status = WALL_CLOCK
        plan.solver.fallback_reason = "a packing ILP of a losing candidate hit the wall-clock safety net"
    return plan
