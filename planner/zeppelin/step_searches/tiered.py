"""Whole-step search ``tiered``: spans from the tiers in every micro-batch, each micro-batch the
better of balancing total cost or attention with a remap."""

from __future__ import annotations

from zeppelin.planner.zeppelin.assign import PackInfeasible
from zeppelin.planner.zeppelin.protocols import Round
from zeppelin.planner.zeppelin.step_searches.common import balances, whole_step
from zeppelin.planner.zeppelin.step_state import StepState

name = "tiered"


def search(state: StepState, parts: list[list[int]], found: Round) -> None:
    try:
        built, t = whole_step(state, parts, [None], balances(state))
    except PackInfeasible as e:
        state.last_error = str(e)
        return
    found.offer(built, t, [None])
