"""Whole-step search ``node-cp``: node-CP without remap in every micro-batch (a te-cp-like layout
inside the planner's search space) - every sequence long enough to split takes a ring over a
whole node, so nodes never wait for each other, one micro-batch's hot node can be another's cold
one, and no unit waits on partners from rings of assorted widths."""

from __future__ import annotations

from zeppelin.planner.zeppelin.assign import PackInfeasible
from zeppelin.planner.zeppelin.protocols import Round
from zeppelin.planner.zeppelin.step_searches.common import coupling_waste, node_cp_floor, whole_step
from zeppelin.planner.zeppelin.step_state import StepState

name = "node-cp"
#: beyond this many units, node-CP is tried only where the best plan so far loses time to waits
#: (for planning latency: without waits it is unlikely to beat it)
ALWAYS_MAX_UNITS = 256


def search(state: StepState, parts: list[list[int]], found: Round) -> None:
    floor = node_cp_floor(state)
    if floor is None:
        return
    if (found.best_built is not None and state.ctx.num_units > ALWAYS_MAX_UNITS
            and not coupling_waste(state, found.best_built, found.best_t)):
        return
    try:
        built, t = whole_step(state, parts, [floor], ["total"])
    except PackInfeasible as e:
        state.last_error = str(e)
        return
    found.offer(built, t, [floor])
