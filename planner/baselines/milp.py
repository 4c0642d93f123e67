"""Solving the baselines' (M)ILPs: HiGHS when available, CBC otherwise; warm starts.

* :func:`solve` - a PuLP model (Hydraulis' packing ILP);
* :class:`SparseMilp` - a MILP given as arrays and handed to highspy directly (FlexSP: building a PuLP
  model of thousands of variables cost more than solving it).

pulp and highspy are imported inside functions so that importing the planner registry stays fast.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np


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


def _highs_result(h, gap_rel: float, t0: float) -> MilpResult:
    """Status, gap and solution flag of a finished ``highspy.Highs`` run."""
    import highspy

    M = highspy.HighsModelStatus
    ms = h.getModelStatus()
    info = h.getInfo()
    has = info.primal_solution_status == 2  # kSolutionStatusFeasible
    gap = float(info.mip_gap) if has else None
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
        return _highs_result(prob.solverModel, gap_rel, t0)
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


class SparseMilp:
    """A minimisation MILP given as arrays, solved by highspy directly (no PuLP model building).

    Building a PuLP model costs far more than solving small MILPs (tens of thousands of Python
    expression objects per solve); here columns and rows are appended as numpy arrays and handed to
    HiGHS in one call each. Without highspy the same arrays are turned into a PuLP model (CBC).
    """

    def __init__(self):
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.cost: list[float] = []
        self.integer: list[bool] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []
        self.row_idx: list[np.ndarray] = []
        self.row_val: list[np.ndarray] = []

    @property
    def num_cols(self) -> int:
        return len(self.lb)

    def add_cols(self, n: int, lb, ub, cost=0.0, integer: bool = False) -> np.ndarray:
        """Append ``n`` columns; returns their indices."""
        first = len(self.lb)
        self.lb += list(np.broadcast_to(np.asarray(lb, dtype=np.float64), (n,)))
        self.ub += list(np.broadcast_to(np.asarray(ub, dtype=np.float64), (n,)))
        self.cost += list(np.broadcast_to(np.asarray(cost, dtype=np.float64), (n,)))
        self.integer += [integer] * n
        return np.arange(first, first + n)

    def add_row(self, idx, val, lo: float = -math.inf, hi: float = math.inf) -> None:
        idx = np.asarray(idx, dtype=np.int32)
        val = np.broadcast_to(np.asarray(val, dtype=np.float64), idx.shape)
        self.row_idx.append(idx)
        self.row_val.append(np.array(val))
        self.row_lo.append(lo)
        self.row_hi.append(hi)

    def solve(self, time_limit: float, start: np.ndarray | None = None,
              gap_rel: float = 1e-4) -> tuple[MilpResult, np.ndarray | None]:
        """(result, column values or None). ``start``: a feasible assignment handed to the solver."""
        t0 = time.perf_counter()
        time_limit = max(float(time_limit), 0.01)
        try:
            import highspy
        except ImportError:  # pragma: no cover - highspy is a dependency; CBC through PuLP otherwise
            return self._solve_pulp(time_limit, start, gap_rel, t0)
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", time_limit)
        h.setOptionValue("mip_rel_gap", gap_rel)
        h.setOptionValue("threads", 1)
        inf = highspy.kHighsInf
        n = self.num_cols
        lb = np.array(self.lb)
        ub = np.array(self.ub)
        h.addVars(n, np.where(np.isinf(lb), -inf, lb), np.where(np.isinf(ub), inf, ub))
        h.changeColsCost(n, np.arange(n, dtype=np.int32), np.array(self.cost))
        ints = np.flatnonzero(self.integer).astype(np.int32)
        if len(ints):
            h.changeColsIntegrality(len(ints), ints,
                                    np.full(len(ints), highspy.HighsVarType.kInteger, dtype=np.uint8))
        if self.row_idx:
            lens = np.array([len(i) for i in self.row_idx])
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
            lo = np.array(self.row_lo)
            hi = np.array(self.row_hi)
            h.addRows(len(lens), np.where(np.isinf(lo), -inf, lo), np.where(np.isinf(hi), inf, hi),
                      int(lens.sum()), starts, np.concatenate(self.row_idx).astype(np.int32),
                      np.concatenate(self.row_val))
        if start is not None:
            sol = highspy.HighsSolution()
            sol.col_value = [float(v) for v in start]
            h.setSolution(sol)
        h.run()
        res = _highs_result(h, gap_rel, t0)
        values = np.array(h.getSolution().col_value) if res.has_solution else None
        return res, values

    def _solve_pulp(self, time_limit, start, gap_rel, t0):  # pragma: no cover - only without highspy
        import pulp

        prob = pulp.LpProblem("milp", pulp.LpMinimize)
        v = [new_var(prob, f"c{i}", None if math.isinf(lo) else lo, None if math.isinf(hi) else hi,
                     cat="Integer" if it else "Continuous")
             for i, (lo, hi, it) in enumerate(zip(self.lb, self.ub, self.integer))]
        prob += pulp.lpSum(c * v[i] for i, c in enumerate(self.cost) if c)
        for idx, val, lo, hi in zip(self.row_idx, self.row_val, self.row_lo, self.row_hi):
            e = pulp.lpSum(float(a) * v[i] for i, a in zip(idx, val))
            if lo == hi:
                prob += e == lo
            else:
                if not math.isinf(lo):
                    prob += e >= lo
                if not math.isinf(hi):
                    prob += e <= hi
        res = solve(prob, time_limit, None if start is None else {v[i]: float(s) for i, s in enumerate(start)},
                    gap_rel)
        res.time_s = time.perf_counter() - t0
        return res, (np.array([value(x) for x in v]) if res.has_solution else None)
