"""How a tiered plan was found, recorded on the plan once it wins: its :class:`SolverInfo` (which
solver packed it, how close the unit assignment is to its bound, why a fallback ran) and notes."""

from __future__ import annotations

from zeppelin.planner.core.solver import WALL_CLOCK, merge_status
from zeppelin.schemas.plan import SolverInfo, StepPlan


def solver_info(stats: list, elapsed: float, wall_hit: bool) -> SolverInfo:
    """``stats``: the micro-batches' :class:`.tiered.MicroBatchStats`; ``wall_hit``: whether a
    packing ILP of the step stopped at the wall-clock safety net."""
    results = [r for st in stats for r in st.results]
    names = {r.solver for r in results}
    name = "highs" if "highs" in names else "cbc" if "cbc" in names else "greedy"
    ilp_runs = [r for r in results if r.solver in ("highs", "cbc")]
    status = merge_status([r.status for r in ilp_runs])
    if wall_hit or any(r.status == WALL_CLOCK for r in results):
        status = WALL_CLOCK  # a greedy fallback after the safety net fired: the step depends on the load
    # gap of the unit assignment: the hottest unit vs the best any assignment could do
    gaps = []
    for st in stats:
        if st.unit_loads is not None and len(st.unit_loads):
            mk = float(st.unit_loads.max())
            gaps.append(max(mk - st.level2_lb, 0.0) / mk if mk > 0 else 0.0)
    reasons = []
    for r in results:
        if r.fallback_reason and r.fallback_reason not in reasons:
            reasons.append(r.fallback_reason)
    return SolverInfo(name=name, status=status, gap=max(gaps) if gaps else 0.0, time_s=elapsed,
                      fallback_reason="; ".join(reasons[:3]) if reasons else None)


def tiered_finisher(state, stats: list):
    """The function :func:`.select.select` calls on a tiered plan that won: its solver record and
    notes (tiers used, micro-batches)."""

    def finish(plan: StepPlan, elapsed: float) -> None:
        plan.solver = solver_info(stats, elapsed, state.wall_hit)
        tiers = {"local": 0, "intra": 0, "inter": 0}
        for st in stats:
            for k, v in st.tiers.items():
                tiers[k] += v
        plan.notes = {"tiers": tiers, "microbatches": len(plan.microbatches)}

    return finish
