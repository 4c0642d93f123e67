"""``hybrid-dp``: FLOP-based Hybrid DP.

Short sequences stay local and are balanced by FLOPs; a sequence whose FLOPs or memory exceed a unit's
share runs on a ring CP group of the power-of-two size it needs."""

from __future__ import annotations

import numpy as np

from zeppelin.planner.baselines.common import (
    StepBuilder,
    Timer,
    aligned_blocks,
    check_capacity,
    cp_padded,
    cp_sizes,
    largest_pow2_block,
    next_pow2,
    seq_label,
)
from zeppelin.planner.core.base import PlanContext, Planner, register
from zeppelin.schemas.plan import Sequence, SolverInfo, StepPlan


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
        gmax = largest_pow2_block(n)
        L = np.array([s.length for s in sequences], dtype=np.float64)
        work = ctx.cost.work(L)
        share = float(work.sum()) / n
        g_mem = cp_sizes(sequences, cap, gmax, lambda i, s, g: (
            f"{seq_label(i, s)} does not fit hybrid-dp: it needs a CP group of {g} units (capacity {cap} tokens "
            f"per GPU), the largest aligned group has {gmax}"))
        sizes = []
        for i in range(len(sequences)):
            g_flop = next_pow2(int(np.ceil(work[i] / share))) if work[i] > share else 1
            sizes.append(min(max(g_mem[i], g_flop), gmax))
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
