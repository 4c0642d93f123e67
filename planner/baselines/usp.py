"""``usp``: unified sequence parallelism (the long-context-attention library's USP) with one fixed
shape for every sequence: Ulysses over ``u`` units inside a node x a zigzag ring over ``r`` such
rows, DP = units / (u*r) replicas of u*r consecutive units (rows: u consecutive units).

As the library is run: ``u`` fixed for the run (default: the largest power of two that fits in a
node and divides the heads per unit, the library's advice to keep the all-to-all on NVLink; K/V
heads replicated where u exceeds them), ``r`` the best per step among those at which the step's
longest sequence fits, every sequence padded to a multiple of 2*u*r and cut into 2r zigzag chunks,
each split over its row's u units. The ``ulysses`` / ``ring`` options force the degrees."""

from __future__ import annotations

from dataclasses import dataclass

from zeppelin.planner.baselines.common import pow2_sizes
from zeppelin.planner.baselines.static_sp import _StaticSP
from zeppelin.planner.core.base import PlanContext, PlanningError, register
from zeppelin.planner.core.options import PlannerOptions, option
from zeppelin.schemas.invariants import kv_replication


@dataclass(frozen=True)
class USPOptions(PlannerOptions):
    ulysses: int | None = option(int, None, "force the Ulysses degree u (a power of two dividing a node's units "
                                 "and the heads per unit; default: the largest such)", minimum=1)
    ring: int | None = option(int, None, "force the ring degree r (default: the best per step)", minimum=1)


@register
class USP(_StaticSP):
    name = "usp"
    kind = "usp"
    option = "ring"
    Options = USPOptions
    description = "unified sequence parallelism (long-context-attention USP): fixed Ulysses u x ring r groups"

    def degree(self, ctx: PlanContext) -> int:
        """The Ulysses degree u of the run."""
        m = ctx.model
        ok = [u for u in pow2_sizes(ctx.units_per_node) if ctx.units_per_node % u == 0
              and kv_replication(m.num_heads, m.num_kv_heads, ctx.tp, u) is not None]
        if self.opts.ulysses is not None:
            if self.opts.ulysses not in ok:
                raise PlanningError(f"usp: ulysses={self.opts.ulysses} is not usable here (choose one of "
                                    f"{', '.join(map(str, ok))}: powers of two dividing a node's "
                                    f"{ctx.units_per_node} units and the {m.num_heads // ctx.tp} heads per unit)")
            return self.opts.ulysses
        return max(ok)

    def sizes(self, ctx: PlanContext) -> list[int]:
        n, u = ctx.num_units, self.degree(ctx)
        return [r for r in pow2_sizes(n // u) if n % (u * r) == 0]

    def group_size(self, ctx: PlanContext, G: int) -> int:
        return self.degree(ctx) * G

    def shape(self, ctx: PlanContext, G: int) -> tuple[int, int]:
        return self.degree(ctx), G
