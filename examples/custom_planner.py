"""A planner in ~30 lines: every sequence on one GPU, longest first onto the least-busy GPU.

Import this module (it registers ``example-longest-first``), then plan with it like any other:
``get_planner("example-longest-first").plan_step(ctx, step, sequences)``.
"""

from zeppelin.planner.core.base import PlanContext, Planner, PlanningError, register
from zeppelin.planner.core.builder import StepBuilder, seq_label
from zeppelin.schemas.plan import Sequence, SolverInfo, StepPlan


@register
class LongestFirstLocal(Planner):
    name = "example-longest-first"
    description = "every sequence local; longest first onto the unit with the least predicted compute"

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        cap = ctx.cost.token_capacity  # tokens a unit holds at once (the cost model's memory rule)
        busy = [0.0] * ctx.num_units  # predicted compute seconds per unit
        b = StepBuilder(ctx, sequences, self.name)
        for i in sorted(range(len(sequences)), key=lambda i: -sequences[i].length):
            length = sequences[i].length
            if length > cap:
                raise PlanningError(f"{seq_label(i, sequences[i])} does not fit one unit (capacity {cap} tokens)")
            unit = min(range(ctx.num_units), key=busy.__getitem__)
            mb = 0
            while not b.fits(mb, [unit], [length]):  # next micro-batch with room on that unit
                mb += 1
            b.place(mb, "local", [unit], i)
            busy[unit] += float(ctx.cost.seq_compute_time(length))
        return b.finish(step, SolverInfo(name="greedy"), notes={"microbatches": b.num_microbatches})
