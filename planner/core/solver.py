"""Deterministic (M)ILP solving shared by every planner.

The same inputs must give the same plan bytes on any machine and under any load, so no solve is cut
short by the clock. A solve is bounded by *work* limits that every run counts alike:

* ``nodes``      - branch-and-bound nodes (HiGHS ``mip_max_nodes``, CBC ``maxNodes``);
* ``iterations`` - simplex iterations (HiGHS ``simplex_iteration_limit``: bounds the LP work of the
  root and of every node together);

with one thread and a fixed random seed (HiGHS ``random_seed``; CBC's default seed), so the search
and its tie-breaking are the same everywhere. A wall-clock limit (``wall_s``) exists only as an
optional safety net, off by default: a solve that hits it is reported with status
:data:`WALL_CLOCK` - the planner records it in the step's solver info and ``zeppelin check`` reports
that step as non-reproducible rather than silently different.

* :class:`SolveLimits` - the limits of one solve;
* :func:`configure_highs` / :func:`highs_result` - a ``highspy.Highs`` instance set up / read back;
* :func:`solve_pulp` - a PuLP model solved by HiGHS (CBC when HiGHS is missing or crashes);
* :func:`merge_status` - the status of a step from the statuses of its solves.

pulp and highspy are imported inside functions so that importing the planners stays fast.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

OPTIMAL = "optimal"            # proven optimal within the relative gap
LIMIT = "work_limit"           # a feasible solution, search stopped by the node / iteration limit
WALL_CLOCK = "wall_clock_limit"  # stopped by the wall-clock safety net: the result depends on the load
INFEASIBLE = "infeasible"
NO_SOLUTION = "no_solution"    # no feasible solution within the limits


@dataclass(frozen=True)
class SolveLimits:
    """Limits of one MILP solve. ``wall_s``: optional wall-clock safety net (None: off)."""

    nodes: int = 200
    iterations: int = 20000
    gap_rel: float = 1e-4
    wall_s: float | None = None

    def __post_init__(self):
        if self.nodes < 0 or self.iterations < 0:
            raise ValueError("solver node and iteration limits must be >= 0")
        if self.wall_s is not None and not self.wall_s > 0:
            raise ValueError(f"a wall-clock safety net must be positive (got {self.wall_s:g})")


@dataclass
class MilpResult:
    solver: str          # "highs" or "cbc"
    status: str          # OPTIMAL, LIMIT, WALL_CLOCK, INFEASIBLE, NO_SOLUTION
    gap: float | None    # relative gap of the returned solution (0 = proven optimal)
    time_s: float        # wall time of the solve (informational: never written to a plan)
    has_solution: bool
    nodes: int = 0       # branch-and-bound nodes the solve used (deterministic)

    @property
    def wall_clock_hit(self) -> bool:
        return self.status == WALL_CLOCK


_BANNER_SHOWN = False


def quiet_highs() -> None:
    """HiGHS prints a copyright banner on stdout when the first ``Highs`` object of a process is
    built, before any option can silence it (it would corrupt ``--json`` output): build that first one with
    the stdout file descriptor pointed at /dev/null."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        return
    import os
    import sys

    import highspy

    _BANNER_SHOWN = True
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def configure_highs(h, limits: SolveLimits) -> None:
    """Quiet, one thread, fixed seed, the work limits and (only when set) the wall-clock net."""
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_rel_gap", float(limits.gap_rel))
    h.setOptionValue("mip_max_nodes", int(limits.nodes))
    h.setOptionValue("simplex_iteration_limit", int(limits.iterations))
    if limits.wall_s is not None:
        h.setOptionValue("time_limit", float(limits.wall_s))


def highs_result(h, limits: SolveLimits, t0: float) -> MilpResult:
    """Status, gap and solution flag of a finished ``highspy.Highs`` run."""
    import highspy

    M = highspy.HighsModelStatus
    ms = h.getModelStatus()
    info = h.getInfo()
    has = info.primal_solution_status == 2  # kSolutionStatusFeasible
    gap = float(info.mip_gap) if has else None
    if gap is not None and not math.isfinite(gap):
        gap = None
    nodes = int(getattr(info, "mip_node_count", 0) or 0)
    if ms == M.kOptimal:
        status, gap = OPTIMAL, (gap if gap is not None and gap > limits.gap_rel else 0.0)
    elif ms == M.kInfeasible:
        status, has = INFEASIBLE, False
    elif ms == M.kTimeLimit:
        status = WALL_CLOCK
    elif has:
        status = LIMIT
    else:
        status = NO_SOLUTION
    return MilpResult("highs", status, gap, time.perf_counter() - t0, has, nodes)


def solve_pulp(prob, limits: SolveLimits, start: dict | None = None, solver: str = "highs") -> MilpResult:
    """Solve ``prob`` (a ``pulp.LpProblem``) under ``limits``.

    ``solver``: ``highs`` (CBC when HiGHS is missing or crashes) or ``cbc``. ``start`` maps
    variables to a feasible assignment (a warm start): HiGHS' initial MIP solution, CBC's
    ``warmStart``. Raises ``RuntimeError`` when no solver could run.
    """
    names = [solver] + (["cbc"] if solver == "highs" else [])
    errors = []
    if solver == "highs":
        try:
            quiet_highs()
        except ImportError:  # pragma: no cover - highspy is a dependency
            pass
    for name in names:
        t0 = time.perf_counter()
        try:
            if name == "highs":
                return _solve_pulp_highs(prob, limits, start, t0)
            return _solve_pulp_cbc(prob, limits, start, t0)
        except Exception as e:  # noqa: BLE001  (solver missing or crashed: try the next one)
            errors.append(f"{name} failed ({e.__class__.__name__}: {str(e).splitlines()[0][:80] if str(e) else ''})")
    raise RuntimeError("; ".join(errors))


def _solve_pulp_highs(prob, limits: SolveLimits, start: dict | None, t0: float) -> MilpResult:
    import highspy
    import pulp

    if "HiGHS" not in available_solvers():
        raise RuntimeError("HiGHS is not available")

    class _Deterministic(pulp.HiGHS):
        def callSolver(self, lp):
            configure_highs(lp.solverModel, limits)
            if start:
                values = [0.0] * lp.solverModel.getNumCol()
                for var in lp.variables():
                    values[var.index] = float(start.get(var, 0.0))
                sol = highspy.HighsSolution()
                sol.col_value = values
                lp.solverModel.setSolution(sol)
            lp.solverModel.run()

        def findSolutionValues(self, lp):
            # PuLP maps no status for a node / solution limit (kSolutionLimit): the variable values
            # are assigned before its lookup fails; the status is read from HiGHS below anyway
            try:
                return super().findSolutionValues(lp)
            except KeyError:
                feasible = lp.solverModel.getInfo().primal_solution_status == 2
                return (pulp.LpStatusNotSolved,
                        pulp.LpSolutionIntegerFeasible if feasible else pulp.LpSolutionNoSolutionFound)

    prob.solve(_Deterministic(msg=False, gapRel=limits.gap_rel, threads=1))
    return highs_result(prob.solverModel, limits, t0)


def _solve_pulp_cbc(prob, limits: SolveLimits, start: dict | None, t0: float) -> MilpResult:
    import warnings

    import pulp

    if start:
        for var, val in start.items():
            var.setInitialValue(val)
    with warnings.catch_warnings():  # PuLP 3.x deprecates the bundled-CBC class name
        warnings.simplefilter("ignore", DeprecationWarning)
        s = pulp.PULP_CBC_CMD(msg=False, gapRel=limits.gap_rel, warmStart=bool(start), threads=1,
                              maxNodes=int(limits.nodes),
                              timeLimit=None if limits.wall_s is None else max(1, math.ceil(limits.wall_s)))
    prob.solve(s)
    elapsed = time.perf_counter() - t0
    st = pulp.LpStatus[prob.status]
    has = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if st == "Optimal" and prob.sol_status == pulp.LpSolutionOptimal:
        status, gap = OPTIMAL, 0.0
    elif st == "Infeasible":
        status, gap, has = INFEASIBLE, None, False
    elif limits.wall_s is not None and elapsed >= 0.95 * max(1, math.ceil(limits.wall_s)):
        status, gap = WALL_CLOCK, None  # CBC does not say which limit stopped it: the clock did
    elif has:
        status, gap = LIMIT, None
    else:
        status, gap = NO_SOLUTION, None
    return MilpResult("cbc", status, gap, elapsed, has)


_AVAILABLE: list[str] | None = None


def available_solvers() -> list[str]:
    global _AVAILABLE
    if _AVAILABLE is None:
        import pulp

        _AVAILABLE = list(pulp.listSolvers(onlyAvailable=True))
    return _AVAILABLE


def merge_status(statuses: list[str]) -> str:
    """A step's status from its solves: the wall-clock net wins (the step is not reproducible),
    then a work limit, else optimal."""
    if WALL_CLOCK in statuses:
        return WALL_CLOCK
    if statuses and all(s == OPTIMAL for s in statuses):
        return OPTIMAL
    return LIMIT if statuses else "ok"
