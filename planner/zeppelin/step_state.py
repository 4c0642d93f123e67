"""The mutable state of planning one step with the tiered search, in one object.

Everything a step's candidate layouts share and change - the packing ILP's budget, whether an ILP
stopped at the wall-clock safety net, the span tables its micro-batches' candidate layouts reuse -
lives here, created afresh for each step and dropped when the step is planned, so that a step
never depends on the one before (and a long plan file streams with one step's memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.core.solver import WALL_CLOCK
from zeppelin.planner.zeppelin.tiering import SpanTable, Tiering
from zeppelin.schemas.plan import Sequence

#: span tables kept per step: one micro-batch's candidate layouts (each large on big clusters)
SPAN_TABLES_KEPT = 4


@dataclass
class StepState:
    """One step's search: its inputs, the planner's options (``options``: the planner, read only)
    and the state its candidate layouts share."""

    options: object
    ctx: PlanContext
    tiering: Tiering
    sequences: list[Sequence]
    lengths: np.ndarray
    ilp_left: int
    wall_hit: bool = False  # did a packing ILP of this step stop at the wall-clock safety net?
    span_tables: dict = field(default_factory=dict)
    # the last packing failure, for the error when nothing fits (its text: the exception itself would
    # keep the failed search's frames, and with them this state, alive)
    last_error: str | None = None
    #: node-major alone planned the step (:data:`.step_searches.NODE_MAJOR_FIRST_UNITS`)
    node_major_led: bool = False

    # ILP work per step: every candidate layout may call the packing ILP; together they share a
    # budget of ``ilp_budget_calls`` solves, each under the planner's limits (``ilp=always``: no
    # budget). Counted in solves, not seconds, so that the plan does not depend on the machine's load.
    def ilp_mode(self) -> str:
        ilp = self.options.ilp
        if ilp == "always":
            return "always"
        return ilp if self.ilp_left > 0 else "never"

    def ilp_spent(self, result) -> None:
        self.ilp_left -= getattr(result, "ilp_runs", 0)
        self.wall_hit = self.wall_hit or getattr(result, "status", "") == WALL_CLOCK

    def routed_nics(self) -> int:
        return len(self.ctx.cluster.nics) if self.options.routing else 1

    def span_table(self, Ls: np.ndarray, routed_nics: int, ulysses: bool) -> SpanTable:
        """The span table of a micro-batch's sequences (shared by its candidate layouts)."""
        key = (routed_nics, ulysses, Ls.tobytes())
        table = self.span_tables.get(key)
        if table is None:
            table = self.tiering.span_table(Ls, routed_nics, ulysses=ulysses)
            if len(self.span_tables) >= SPAN_TABLES_KEPT:
                self.span_tables.clear()
            self.span_tables[key] = table
        return table
