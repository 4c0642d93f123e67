"""Static sequence / context parallelism with one group size.

``te-cp``        TransformerEngine / Megatron ring CP as real jobs run it: one CP size for the whole
                 run, the smallest power of two whose per-GPU share of the run's longest sequence
                 (``--max-seq-len``; :attr:`PlanContext.max_seq_len`) fits a GPU's activation memory;
                 DP = units / CP replicas of CP consecutive units; every sequence padded to a
                 multiple of 2*CP and cut into 2*CP zigzag chunks over its replica.
``te-cp-tuned``  the same layout with the CP size chosen per step: the best predicted one among
                 those that fit the step's longest sequence (a stronger baseline than what users run).
``llama3-cp``    the tuned layout with LLaMA-3 all-gather K/V attention.
``ulysses``      DeepSpeed-Ulysses all-to-all SP, tuned per step (the SP degree divides the heads per unit).

The ``cp``/``sp`` option forces the size."""

from __future__ import annotations

from dataclasses import dataclass

from zeppelin.planner.baselines.common import (
    StepBuilder,
    Timer,
    ceil_div,
    check_capacity,
    cp_padded,
    ffd,
    lpt,
    pow2_sizes,
    seq_label,
)
from zeppelin.planner.core.base import PlanContext, Planner, PlanningError, register
from zeppelin.planner.core.options import PlannerOptions, option
from zeppelin.schemas.plan import Sequence, SolverInfo, StepPlan


@dataclass(frozen=True)
class CPOptions(PlannerOptions):
    cp: int | None = option(int, None, "force this CP size (a power of two dividing the units; default: "
                            "the planner chooses)", minimum=1)


@dataclass(frozen=True)
class SPOptions(PlannerOptions):
    sp: int | None = option(int, None, "force this SP degree (a power of two dividing the units and the "
                            "heads per unit; default: the best per step)", minimum=1)


class _StaticSP(Planner):
    """One SP/CP size G for the whole step: DP = units / G replicas of G consecutive units."""

    kind = "ring"
    pad = True  # TE THD layout: pad every sequence to a multiple of 2*G
    option = "cp"  # the Options field that forces the size
    Options = CPOptions

    def sizes(self, ctx: PlanContext) -> list[int]:
        n = ctx.num_units
        return [g for g in pow2_sizes(n) if n % g == 0]

    def _limit_note(self, ctx: PlanContext) -> str:
        return ""

    def group_size(self, ctx: PlanContext, G: int) -> int:
        """Units of one group at size option ``G`` (the CP / SP size itself here)."""
        return G

    def shape(self, ctx: PlanContext, G: int) -> tuple[int, int] | None:
        """A usp group's (u, r) at size option ``G`` (None: not a usp planner)."""
        return None

    def build(self, ctx: PlanContext, sequences: list[Sequence], G: int, cap: int) -> StepBuilder | None:
        n = ctx.num_units
        shape = self.shape(ctx, G)
        G = self.group_size(ctx, G)
        D = n // G
        padded = [cp_padded(s.length, G) if self.pad else s.length for s in sequences]
        per_rank = [ceil_div(p, G) for p in padded]  # tokens the fullest ring position holds
        row = shape[0] if shape is not None else (G if self.kind == "ulysses" else 1)
        if row > 1:  # a Ulysses row's extra copies (replicated K/V heads where it exceeds them)
            cap = min(cap, ctx.cost.ulysses_capacity(row))
        if max(per_rank) > cap:
            return None
        owner = lpt(padded, D)  # token-balanced share of the step per DP replica
        b = StepBuilder(ctx, sequences, self.name)
        for d in range(D):
            units = list(range(d * G, (d + 1) * G))
            mine = [i for i in range(len(sequences)) if owner[i] == d]
            for k, bin_ in enumerate(ffd(mine, per_rank, cap)):
                for i in bin_:
                    b.place(k, self.kind, units, i, shape=shape,
                            padded_length=padded[i] if padded[i] != sequences[i].length else None)
        return b

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        t = Timer()
        cap = check_capacity(ctx, self.name)
        sizes = self.sizes(ctx)
        forced = getattr(self.opts, self.option)
        if forced is not None:
            if forced not in sizes:
                raise PlanningError(f"{self.name}: {self.option}={forced} is not usable here (choose one of "
                                    f"{', '.join(map(str, sizes))}){self._limit_note(ctx)}")
            sizes = [forced]
        best: StepPlan | None = None
        tried: dict[str, float] = {}
        for G in sizes:
            b = self.build(ctx, sequences, G, cap)
            if b is None:
                continue
            plan = b.finish(step, SolverInfo(name="greedy"),
                            notes={self.option: G, "dp": ctx.num_units // self.group_size(ctx, G),
                                   "microbatches": b.num_microbatches})
            tried[str(G)] = plan.prediction.step_time_s
            if best is None or plan.prediction.step_time_s < best.prediction.step_time_s:
                best = plan
        if best is None:
            G = sizes[-1]
            i = max(range(len(sequences)), key=lambda k: (sequences[k].length, -k))
            s = sequences[i]
            need = ceil_div(cp_padded(s.length, G) if self.pad else s.length, G)
            raise PlanningError(f"{seq_label(i, s)} does not fit {self.name} even with {self.option}={G} "
                                f"({need} tokens per GPU, capacity {cap}){self._limit_note(ctx)}")
        best.notes["candidates_step_time_s"] = tried
        best.solver = SolverInfo(name="greedy", time_s=t.elapsed)
        return best


def run_cp_size(max_seq_len: int, cap: int, sizes: list[int]) -> int | None:
    """The CP size of a whole TE run: the smallest of ``sizes`` (powers of two dividing the unit
    count) at which the fullest rank's share of a ``max_seq_len`` sequence, padded to a multiple
    of 2*CP, fits ``cap`` tokens; None when none does."""
    for G in sizes:
        if ceil_div(cp_padded(max_seq_len, G), G) <= cap:
            return G
    return None


@register
class TECP(_StaticSP):
    name = "te-cp"
    description = ("TransformerEngine/Megatron ring context parallelism as run: one CP size for the whole run (the "
                   "smallest power of two whose share of --max-seq-len fits memory), every sequence padded to a "
                   "multiple of 2*CP and split into 2*CP zigzag chunks over its DP group")

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        t = Timer()
        cap = check_capacity(ctx, self.name)
        sizes = self.sizes(ctx)
        forced = getattr(self.opts, self.option)
        longest = max(s.length for s in sequences)
        if ctx.max_seq_len is not None:
            basis, L = "max_seq_len", max(int(ctx.max_seq_len), longest)
        else:  # no run-level maximum known (a bare API call): size for this step's longest sequence
            basis, L = "step", longest
        if forced is not None:
            if forced not in sizes:
                raise PlanningError(f"{self.name}: {self.option}={forced} is not usable here (choose one of "
                                    f"{', '.join(map(str, sizes))})")
            G = forced
        else:
            G = run_cp_size(L, cap, sizes)
        b = None if G is None else self.build(ctx, sequences, G, cap)
        if b is None:
            G = G or sizes[-1]
            need = ceil_div(cp_padded(L, G), G)
            if basis == "max_seq_len" and L > longest:
                raise PlanningError(f"te-cp: --max-seq-len {L} does not fit even with {self.option}={G} "
                                    f"({need} tokens per GPU, capacity {cap})")
            i = max(range(len(sequences)), key=lambda k: (sequences[k].length, -k))
            s = sequences[i]
            need = ceil_div(cp_padded(s.length, G), G)
            raise PlanningError(f"{seq_label(i, s)} does not fit {self.name} even with {self.option}={G} "
                                f"({need} tokens per GPU, capacity {cap})")
        plan = b.finish(step, SolverInfo(name="greedy"),
                        notes={self.option: G, "dp": ctx.num_units // G, "microbatches": b.num_microbatches,
                               "cp_sized_for": L, "cp_basis": basis})
        plan.solver = SolverInfo(name="greedy", time_s=t.elapsed)
        return plan


@register
class TECPTuned(_StaticSP):
    name = "te-cp-tuned"
    description = ("TransformerEngine/Megatron ring context parallelism with the CP size tuned per step (the best "
                   "predicted size that fits the step's longest sequence): stronger than what users run")


@register
class Llama3CP(_StaticSP):
    name = "llama3-cp"
    kind = "allgather"
    description = "LLaMA-3 context parallelism: all-gather of K/V over one static CP group size, zigzag chunks"


@register
class Ulysses(_StaticSP):
    name = "ulysses"
    kind = "ulysses"
    pad = False
    option = "sp"
    Options = SPOptions
    description = "DeepSpeed-Ulysses static all-to-all sequence parallelism (SP degree divides the head count)"

    def sizes(self, ctx: PlanContext) -> list[int]:
        heads = ctx.model.num_heads // ctx.tp
        return [g for g in super().sizes(ctx) if heads % g == 0]

    def _limit_note(self, ctx: PlanContext) -> str:
        return f"; the SP degree must divide the {ctx.model.num_heads // ctx.tp} attention heads per unit"
