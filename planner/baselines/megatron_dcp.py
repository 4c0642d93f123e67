"""``megatron-dcp``: Megatron-Core dynamic context parallelism (``BalancedCPScheduler``).

Each sample needs next_pow2(ceil(L / max tokens per rank)) units; samples are placed greedily into the
least-loaded groups until the loads are within 5%."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zeppelin.planner.baselines.common import (
    StepBuilder,
    Timer,
    aligned_blocks,
    check_capacity,
    cp_padded,
    cp_sizes,
    largest_pow2_block,
    seq_label,
)
from zeppelin.planner.core.base import PlanContext, Planner, PlanningError, register
from zeppelin.planner.core.options import PlannerOptions, option
from zeppelin.schemas.plan import Sequence, SolverInfo, StepPlan


class _DCPGroup:
    __slots__ = ("held", "load", "seqs", "size", "start")

    def __init__(self, start: int, size: int):
        self.start, self.size, self.seqs, self.held, self.load = start, size, [], 0, 0.0

    @property
    def units(self) -> list[int]:
        return list(range(self.start, self.start + self.size))


@dataclass(frozen=True)
class MegatronDCPOptions(PlannerOptions):
    max_tokens_per_rank: int | None = option(int, None, "tokens a rank holds at most, which sizes each sample's "
                                             "CP group (default: the memory capacity)", minimum=1)


@register
class MegatronDCP(Planner):
    name = "megatron-dcp"
    Options = MegatronDCPOptions
    description = ("Megatron-Core dynamic context parallelism: each sample gets next_pow2(ceil(L / max tokens "
                   "per rank)) ranks, greedy placement into the least-loaded groups until loads are within 5%")

    DELTA = 0.05

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        t = Timer()
        cap = check_capacity(ctx, self.name)
        maxtok = cap if self.opts.max_tokens_per_rank is None else self.opts.max_tokens_per_rank
        if maxtok > cap:
            raise PlanningError(f"megatron-dcp: max_tokens_per_rank={maxtok} exceeds the memory capacity of "
                                f"{cap} tokens per GPU")
        n = ctx.num_units
        gmax = largest_pow2_block(n)
        need = cp_sizes(sequences, maxtok, gmax, lambda i, s, g: (
            f"{seq_label(i, s)} does not fit megatron-dcp: it needs next_pow2(ceil({s.length} / {maxtok})) = {g} "
            f"ranks, the largest aligned group has {gmax} units"))
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
