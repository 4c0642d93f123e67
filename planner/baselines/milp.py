"""Solving the baselines' (M)ILPs: HiGHS when available, CBC otherwise; warm starts; the
deterministic work limits of :mod:`zeppelin.planner.core.solver`.

* :func:`solve` - a PuLP model (Hydraulis' packing ILP);
* :class:`SparseMilp` - a MILP given as arrays and handed to highspy directly (FlexSP: building a PuLP
  model of thousands of variables cost more than solving it).

pulp and highspy are imported inside functions so that importing the planner registry stays fast.
"""

from __future__ import annotations

import math
import time

import numpy as np

from zeppelin.planner.core.solver import (
    MilpResult,
    SolveLimits,
    configure_highs,
    highs_result,
    quiet_highs,
    solve_pulp,
)

__all__ = ["MilpResult", "SolveLimits", "SparseMilp", "new_var", "solve", "value"]


def solve(prob, limits: SolveLimits, start: dict | None = None) -> MilpResult:
    """Solve ``prob`` (a ``pulp.LpProblem``) under ``limits`` (deterministic work limits; see
    :mod:`zeppelin.planner.core.solver`). ``start`` maps variables to a feasible assignment."""
    return solve_pulp(prob, limits, start)


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

    def solve(self, limits: SolveLimits, start: np.ndarray | None = None) -> tuple[MilpResult, np.ndarray | None]:
        """(result, column values or None). ``start``: a feasible assignment handed to the solver."""
        t0 = time.perf_counter()
        try:
            import highspy
        except ImportError:  # pragma: no cover - highspy is a dependency; CBC through PuLP otherwise
            return self._solve_pulp(limits, start, t0)
        quiet_highs()
        h = highspy.Highs()
        configure_highs(h, limits)
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
        res = highs_result(h, limits, t0)
        values = np.array(h.getSolution().col_value) if res.has_solution else None
        return res, values

    def _solve_pulp(self, limits, start, t0):  # pragma: no cover - only without highspy
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
        res = solve(prob, limits, None if start is None else {v[i]: float(s) for i, s in enumerate(start)})
        res.time_s = time.perf_counter() - t0
        return res, (np.array([value(x) for x in v]) if res.has_solution else None)
