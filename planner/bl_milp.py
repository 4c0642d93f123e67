"""Solving the baselines' (M)ILPs with PuLP: HiGHS when available, CBC otherwise; warm starts.

pulp is imported inside functions so that importing the planner registry stays fast.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass
class MilpResult:
    solver: str          # "highs" or "cbc"
    status: str          # "optimal", "time_limit" (feasible, not proven), "infeasible", "no_solution"
    gap: float | None    # relative gap of the returned solution (0 = proven optimal)
    time_s: float
    has_solution: bool


_AVAILABLE: list[str] | None = None


def available_solvers() -> list[str]:
    global _AVAILABLE
    if _AVAILABLE is None:
        import pulp

        _AVAILABLE = list(pulp.listSolvers(onlyAvailable=True))
    return _AVAILABLE


def solve(prob, time_limit: float, start: dict | None = None, gap_rel: float = 1e-4) -> MilpResult:
    """Solve ``prob`` (a ``pulp.LpProblem``) within ``time_limit`` seconds.

    ``start`` maps variables to a feasible assignment (a warm start): handed to HiGHS as its
    initial MIP solution, or to CBC through ``warmStart``.
    """
    import pulp

    t0 = time.perf_counter()
    avail = available_solvers()
    time_limit = max(float(time_limit), 0.05)
    if "HiGHS" in avail:
        import highspy

        class _WarmHiGHS(pulp.HiGHS):
            def callSolver(self, lp):
                if start:
                    values = [0.0] * lp.solverModel.getNumCol()
                    for var in lp.variables():
                        values[var.index] = float(start.get(var, 0.0))
                    sol = highspy.HighsSolution()
                    sol.col_value = values
                    lp.solverModel.setSolution(sol)
                lp.solverModel.run()

        solver = _WarmHiGHS(msg=False, timeLimit=time_limit, gapRel=gap_rel, threads=1)
        prob.solve(solver)
        h = prob.solverModel
        ms = h.getModelStatus()
        M = highspy.HighsModelStatus
        has = h.getInfo().primal_solution_status == 2  # kSolutionStatusFeasible
        gap = float(h.getInfo().mip_gap) if has else None
        if gap is not None and not math.isfinite(gap):
            gap = None
        if ms == M.kOptimal:
            status, gap = "optimal", (gap if gap is not None and gap > gap_rel else 0.0)
        elif ms == M.kInfeasible:
            status, has = "infeasible", False
        elif has:
            status = "time_limit"
        else:
            status = "no_solution"
        return MilpResult("highs", status, gap, time.perf_counter() - t0, has)
    if start:
        for var, val in start.items():
            var.setInitialValue(val)
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap_rel, warmStart=bool(start), threads=1)
    prob.solve(solver)
    st = pulp.LpStatus[prob.status]
    has = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if st == "Optimal" and prob.sol_status == pulp.LpSolutionOptimal:
        status, gap = "optimal", 0.0
    elif st == "Infeasible":
        status, gap, has = "infeasible", None, False
    elif has:
        status, gap = "time_limit", None
    else:
        status, gap = "no_solution", None
    return MilpResult("cbc", status, gap, time.perf_counter() - t0, has)


def value(var) -> float:
    v = var.varValue
    return 0.0 if v is None else float(v)


def new_var(prob, name: str, lowBound=None, upBound=None, cat: str = "Continuous"):
    """A variable attached to ``prob`` (PuLP >= 3.3 API; older PuLP: a free-standing LpVariable)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound, upBound, cat=cat)
    import pulp

    return pulp.LpVariable(name, lowBound, upBound, cat=cat)
