"""The systems zeppelin is compared with, as planners writing the standard plan format.

Every planner here is registered with :func:`zeppelin.planner.base.register` and follows its
published description (DESIGN.md section 5) with its best-known setting:

``packed-dp``     token-balanced packing per unit, every sequence local (no splitting).
``te-cp``         TransformerEngine / Megatron static ring context parallelism: one CP size for the
                  step, every sequence padded to a multiple of 2*CP and cut into 2*CP zigzag chunks;
                  the CP size is the best predicted one among those that fit the longest sequence.
``llama3-cp``     the same layout with LLaMA-3 all-gather K/V attention.
``ulysses``       DeepSpeed-Ulysses static all-to-all sequence parallelism (SP degree divides heads).
``hybrid-dp``     FLOP-based Hybrid DP: short sequences local (balanced by FLOPs), sequences whose
                  FLOPs or memory exceed a unit's share on ring CP groups of the size they need.
``megatron-dcp``  Megatron-Core dynamic CP (``BalancedCPScheduler``).
``flexsp``        FlexSP's MILP over heterogeneous Ulysses groups (:mod:`.bl_flexsp`).
``hydraulis``     Hydraulis' heterogeneous replicas + two-stage assignment (:mod:`.bl_hydraulis`).
"""

from __future__ import annotations

import numpy as np
from zeppelin.schemas.plan import Sequence, SolverInfo, StepPlan

from .base import PlanContext, Planner, PlanningError, register
from .bl_common import (
    StepBuilder,
    Timer,
    aligned_blocks,
    ceil_div,
    check_capacity,
    cp_padded,
    ffd,
    lpt,
    next_pow2,
    opt,
    pow2_sizes,
    seq_label,
    unit_word,
)

# ---------------------------------------------------------------------------------------------
# packed-dp
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# static context / sequence parallelism: te-cp, llama3-cp, ulysses
# ---------------------------------------------------------------------------------------------


class _StaticSP(Planner):
    """One SP/CP size G for the whole step: DP = units / G replicas of G consecutive units."""

    kind = "ring"
    pad = True  # TE THD layout: pad every sequence to a multiple of 2*G
    option = "cp"

    def sizes(self, ctx: PlanContext) -> list[int]:
        n = ctx.num_units
        return [g for g in pow2_sizes(n) if n % g == 0]

    def _limit_note(self, ctx: PlanContext) -> str:
        return ""

    def build(self, ctx: PlanContext, sequences: list[Sequence], G: int, cap: int) -> StepBuilder | None:
        n = ctx.num_units
        D = n // G
        padded = [cp_padded(s.length, G) if self.pad else s.length for s in sequences]
        per_rank = [ceil_div(p, G) for p in padded]  # tokens the fullest ring position holds
        if max(per_rank) > cap:
            return None
        owner = lpt(padded, D)  # token-balanced share of the step per DP replica
        b = StepBuilder(ctx, sequences, self.name)
        for d in range(D):
            units = list(range(d * G, (d + 1) * G))
            mine = [i for i in range(len(sequences)) if owner[i] == d]
            for k, bin_ in enumerate(ffd(mine, per_rank, cap)):
                for i in bin_:
                    b.place(k, self.kind, units, i,
                            padded_length=padded[i] if padded[i] != sequences[i].length else None)
        return b

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        t = Timer()
        cap = check_capacity(ctx, self.name)
        sizes = self.sizes(ctx)
        forced = opt(self.options, self.option, int, None, self.name, minimum=1)
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
                            notes={self.option: G, "dp": ctx.num_units // G, "microbatches": b.num_microbatches})
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


@register
class TECP(_StaticSP):
    name = "te-cp"
    description = ("TransformerEngine/Megatron static ring context parallelism: one CP size, every sequence "
                   "padded to a multiple of 2*CP and split into 2*CP zigzag chunks")


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
    description = "DeepSpeed-Ulysses static all-to-all sequence parallelism (SP degree divides the head count)"

    def sizes(self, ctx: PlanContext) -> list[int]:
        heads = ctx.model.num_heads // ctx.tp
        return [g for g in super().sizes(ctx) if heads % g == 0]

    def _limit_note(self, ctx: PlanContext) -> str:
        return f"; the SP degree must divide the {ctx.model.num_heads // ctx.tp} attention heads per unit"


# ---------------------------------------------------------------------------------------------
# hybrid-dp (FLOP-based assignment)
# ---------------------------------------------------------------------------------------------


def _largest_pow2_block(n: int) -> int:
    return pow2_sizes(n)[-1]


def _fitting_cp(length: int, cap: int, start: int = 1) -> int:
    """Smallest power-of-two CP size >= start whose padded per-rank share fits ``cap``."""
    G = next_pow2(max(start, ceil_div(length, cap)))
    while cp_padded(length, G) // G > cap:
        G *= 2
    return G


def _first_fit_mb(b: StepBuilder, units: list[int], per_unit: int) -> int:
    k = 0
    while not b.fits(k, units, [per_unit] * len(units)):
        k += 1
    return k


@register
class HybridDP(Planner):
    name = "hybrid-dp"
    description = ("Hybrid DP (FLOP-based assignment): short sequences kept local and balanced by FLOPs, "
                   "sequences whose FLOPs or memory exceed a unit's share on ring CP groups of the size they need")

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        t = Timer()
        cap = check_capacity(ctx, self.name)
        n = ctx.num_units
        gmax = _largest_pow2_block(n)
        L = np.array([s.length for s in sequences], dtype=np.float64)
        work = ctx.cost.work(L)
        share = float(work.sum()) / n
        sizes = []
        for i, s in enumerate(sequences):
            g_mem = _fitting_cp(s.length, cap)
            if g_mem > gmax:
                raise PlanningError(f"{seq_label(i, s)} does not fit hybrid-dp: it needs a CP group of {g_mem} "
                                    f"units (capacity {cap} tokens per GPU), the largest aligned group has {gmax}")
            g_flop = next_pow2(int(np.ceil(work[i] / share))) if work[i] > share else 1
            sizes.append(min(max(g_mem, g_flop), gmax))
        load = np.zeros(n)
        b = StepBuilder(ctx, sequences, self.name)
        order = sorted(range(len(sequences)), key=lambda i: (-work[i], i))
        for i in order:  # long (CP) sequences first, then the local ones, each to the least-loaded place
            G = sizes[i]
            if G == 1:
                continue
            P = cp_padded(sequences[i].length, G)
            block = min(aligned_blocks(n, G), key=lambda blk: (load[blk].max(), blk[0]))
            k = _first_fit_mb(b, block, P // G)
            b.place(k, "ring", block, i, padded_length=P if P != sequences[i].length else None)
            load[block] += work[i] / G
        for i in order:
            if sizes[i] != 1:
                continue
            u = int(np.argmin(load))
            k = _first_fit_mb(b, [u], sequences[i].length)
            b.place(k, "local", [u], i)
            load[u] += work[i]
        n_cp = sum(1 for g in sizes if g > 1)
        return b.finish(step, SolverInfo(name="greedy", time_s=t.elapsed),
                        notes={"cp_sequences": n_cp, "local_sequences": len(sequences) - n_cp,
                               "microbatches": b.num_microbatches})


# ---------------------------------------------------------------------------------------------
# megatron-dcp (Megatron-Core dynamic context parallelism, BalancedCPScheduler)
# ---------------------------------------------------------------------------------------------


class _DCPGroup:
    __slots__ = ("held", "load", "seqs", "size", "start")

    def __init__(self, start: int, size: int):
        self.start, self.size, self.seqs, self.held, self.load = start, size, [], 0, 0.0

    @property
    def units(self) -> list[int]:
        return list(range(self.start, self.start + self.size))


@register
class MegatronDCP(Planner):
    name = "megatron-dcp"
    description = ("Megatron-Core dynamic context parallelism: each sample gets next_pow2(ceil(L / max tokens "
                   "per rank)) ranks, greedy placement into the least-loaded groups until loads are within 5%")

    DELTA = 0.05

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        t = Timer()
        cap = check_capacity(ctx, self.name)
        maxtok = opt(self.options, "max_tokens_per_rank", int, cap, self.name, minimum=1)
        if maxtok > cap:
            raise PlanningError(f"megatron-dcp: max_tokens_per_rank={maxtok} exceeds the memory capacity of "
                                f"{cap} tokens per GPU")
        n = ctx.num_units
        gmax = _largest_pow2_block(n)
        need = []
        for i, s in enumerate(sequences):
            g = _fitting_cp(s.length, maxtok)
            if g > gmax:
                raise PlanningError(f"{seq_label(i, s)} does not fit megatron-dcp: it needs next_pow2(ceil("
                                    f"{s.length} / {maxtok})) = {g} ranks, the largest aligned group has {gmax} units")
            need.append(g)
        L = [s.length for s in sequences]

        def per_rank(i: int, g: int) -> int:
            return cp_padded(L[i], g) // g

        b = StepBuilder(ctx, sequences, self.name)
        remaining = sorted(range(len(sequences)), key=lambda i: (-L[i], i))
        k = 0
        while remaining:
            groups, leftover = self._wave(n, remaining, need, L, maxtok, per_rank)
            for grp in groups:
                for i in grp.seqs:
                    P = cp_padded(L[i], grp.size)
                    b.place(k, "ring", grp.units, i, padded_length=P if P != L[i] else None)
            remaining = sorted(leftover, key=lambda i: (-L[i], i))
            k += 1
        return b.finish(step, SolverInfo(name="greedy", time_s=t.elapsed),
                        notes={"max_tokens_per_rank": maxtok, "microbatches": b.num_microbatches})

    def _wave(self, n, remaining, need, L, maxtok, per_rank):
        """One execution group (micro-batch) of the scheduler; returns its groups and the unplaced samples."""
        by_size: dict[int, list[int]] = {}
        for i in remaining:
            by_size.setdefault(need[i], []).append(i)
        groups: list[_DCPGroup] = []
        owner: list[_DCPGroup | None] = [None] * n
        load = np.zeros(n)
        prev = None
        check = False
        while True:
            chosen = None
            for g in sorted(by_size, reverse=True):
                if not by_size[g]:
                    continue
                i = by_size[g][0]
                free = next((blk for blk in aligned_blocks(n, g) if all(owner[u] is None for u in blk)), None)
                if free is not None:  # a fresh group starts at load 0: always the least loaded
                    grp = _DCPGroup(free[0], g)
                    groups.append(grp)
                    for u in free:
                        owner[u] = grp
                    chosen = (g, i, grp)
                    break
                fitting = [grp for grp in groups if grp.size == g and grp.held + per_rank(i, g) <= maxtok]
                if fitting:
                    chosen = (g, i, min(fitting, key=lambda grp: (grp.load, grp.start)))
                    break
            if chosen is None:
                break
            g, i, grp = chosen
            by_size[g].pop(0)
            grp.seqs.append(i)
            grp.held += per_rank(i, g)
            w = L[i] * L[i] / g
            grp.load += w
            load[grp.start:grp.start + g] += w
            if prev is not None and g < prev:
                check = True
            prev = g
            if check and any(by_size.values()) and load.max() - load.min() <= self.DELTA * load.max():
                break
        leftover = [i for lst in by_size.values() for i in lst]
        # trim: move the last sample of the most loaded group out while that narrows the spread
        while True:
            mx, mn = load.max(), load.min()
            if mx - mn <= self.DELTA * mx or mn == 0:
                break
            grp = owner[int(np.argmax(load))]
            if grp is None or len(grp.seqs) <= 1:
                break
            i = grp.seqs[-1]
            w = L[i] * L[i] / grp.size
            proj = load.copy()
            proj[grp.start:grp.start + grp.size] -= w
            if proj.max() - proj.min() >= mx - mn:
                break
            grp.seqs.pop()
            grp.held -= per_rank(i, grp.size)
            grp.load -= w
            load = proj
            leftover.append(i)
        # fill idle units: double the smallest group whose aligned buddy block is idle
        while any(o is None for o in owner):
            for grp in sorted(groups, key=lambda gr: (gr.size, gr.start)):
                g2 = 2 * grp.size
                start = grp.start - grp.start % g2
                if start + g2 > n or any(owner[u] is not None for u in range(start, start + g2) if u not in grp.units):
                    continue
                grp.start, grp.size = start, g2
                grp.held = sum(per_rank(i, g2) for i in grp.seqs)
                grp.load = sum(L[i] * L[i] / g2 for i in grp.seqs)
                for u in grp.units:
                    owner[u] = grp
                    load[u] = grp.load
                break
            else:
                break
        return groups, leftover


# the MILP-based systems live in their own modules; importing them registers them
from . import bl_flexsp, bl_hydraulis  # noqa: F401
