"""``packed-dp``: data parallelism with token-balanced packing; every sequence stays on one unit.

Sequences go to units by longest-processing-time on their token counts, then into micro-batches by
first-fit decreasing under the unit's token capacity."""

from __future__ import annotations

from zeppelin.planner.baselines.common import (
    StepBuilder,
    Timer,
    check_capacity,
    ffd,
    lpt,
    seq_label,
    unit_word,
)
from zeppelin.planner.core.base import PlanContext, Planner, PlanningError, register
from zeppelin.schemas.plan import Sequence, SolverInfo, StepPlan


@register
class PackedDP(Planner):
    name = "packed-dp"
    description = "data parallelism with token-balanced sequence packing; every sequence stays on one unit"

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        t = Timer()
        cap = check_capacity(ctx, self.name)
        for i, s in enumerate(sequences):
            if s.length > cap:
                raise PlanningError(f"{seq_label(i, s)} does not fit {unit_word(ctx)} (capacity {cap} tokens); "
                                    f"packed-dp cannot split sequences")
        n = ctx.num_units
        lengths = [s.length for s in sequences]
        owner = lpt(lengths, n)
        b = StepBuilder(ctx, sequences, self.name)
        for u in range(n):
            mine = [i for i in range(len(sequences)) if owner[i] == u]
            for k, bin_ in enumerate(ffd(mine, lengths, cap)):
                for i in bin_:
                    b.place(k, "local", [u], i)
        return b.finish(step, SolverInfo(name="greedy", time_s=t.elapsed),
                        notes={"balance": "tokens", "microbatches": b.num_microbatches})
