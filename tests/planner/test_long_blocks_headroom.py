"""Long blocks under ``--recompute auto``: units may hold more than their capacity without
recomputation, each then recomputing alone (``PlanContext.unit_recompute``, the family's
``_Headroom``), priced as the choice per unit the plan then gets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.runtime.test_runtime_dist import make_header
from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.zeppelin.families import long_blocks
from zeppelin.planner.zeppelin.recompute import _fewest_full, held_tokens, mode_context
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.invariants import plan_problems
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Sequence
from zeppelin.schemas.profile import default_profile


def _ctx(recompute: str = "auto") -> PlanContext:
    cl = cluster_preset("zeppelin-a:8")  # 4 NICs per node: long sequences span nodes in usp groups
    return PlanContext(cl, model_preset("llama-13b"), default_profile(cl.name), tp=2, zero_stage=3,
                       recompute=recompute)


def _long_step(total: int = 524288) -> list[Sequence]:
    """Two 131,072-token sequences, three of 30-70K and short ones (seeded), ``total`` tokens."""
    rng = np.random.default_rng(0)
    lens = [131072, 131072, 70964, 52698, 29749]
    while sum(lens) < total:
        lens.append(int(np.clip(rng.lognormal(8.0, 1.0), 64, 16384)))
    lens[-1] -= sum(lens) - total
    return [Sequence(sample_id=i, length=n) for i, n in enumerate(lens)]


def test_the_price_of_holding_more_is_the_fewest_full_layers_the_choice_takes():
    """``overshoot_layers``: for a unit holding up to what ``selective`` allows, the layers the
    choice per unit recomputes in full (within one layer: capacities are whole tokens), none at or
    below the capacity."""
    ctx = mode_context(_ctx(), "none")
    cm, L = ctx.cost, ctx.model.num_layers
    cap = cm.token_capacity
    assert float(cm.overshoot_layers(1.0)) == 0.0 and float(cm.overshoot_layers(0.5)) == 0.0
    worst = 0
    for held in np.linspace(cap + 1, cm.recompute_capacity("selective"), 60).astype(int):
        (choice,) = _fewest_full(ctx, lambda m, t=held: cm.recompute_layout_tokens(t, 0, m) < cm.recompute_capacity(m) + 1)
        k = L if choice == "full" else int(choice.split(":")[1])
        worst = max(worst, abs(round(float(cm.overshoot_layers(held / cap)) * L) - k))
    assert worst <= 1


def test_only_the_pass_without_recomputation_of_auto_may_hold_more():
    auto = _ctx()
    assert mode_context(auto, "none").unit_recompute
    assert not mode_context(auto, "selective").unit_recompute and not mode_context(auto, "full").unit_recompute
    assert not _ctx("none").unit_recompute


def test_units_over_their_capacity_recompute_alone_and_the_plan_is_faster():
    """On a long step whose micro-batches leave memory-full units idle, the layout that lets them
    hold more (each recomputing alone) is predicted faster than the one that may not; every unit
    over its capacity runs a choice under which it fits, every other unit none, and the plan is
    well-formed; without ``unit_recompute`` no unit holds more than its capacity."""
    from zeppelin.planner.tools.validate import memory_problems

    auto = _ctx()
    none = mode_context(auto, "none")
    seqs = _long_step()
    cands = [c.build() for c in long_blocks.candidates(none, 0, seqs)]
    free = cands[0]  # (the best-predicted)
    # the layouts within every unit's capacity stay candidates beside them: the judge decides
    within = [p for p in cands if all(not mb.recomputes() for mb in p.microbatches)]
    assert within and len(within) < len(cands)
    kept = long_blocks.candidates(dataclasses.replace(none, unit_recompute=False), 0, seqs)[0].build()
    cap, n = none.cost.token_capacity, none.num_units
    over = [(k, u) for k, mb in enumerate(free.microbatches) for u in np.flatnonzero(held_tokens(mb, n) > cap)]
    assert over, "the step should need units over their capacity"
    for k, mb in enumerate(free.microbatches):
        held = held_tokens(mb, n)
        for u in range(n):
            assert (mb.recompute_of(u) not in (None, "none")) == bool(held[u] > cap)
        assert memory_problems(none, free, k, mb) == []
    header = make_header(none.cluster, none.model, 1, "zeppelin").model_copy(
        update={"tp": 2, "zero_stage": 3, "recompute": "per-microbatch"})
    assert plan_problems(header, free) == []
    assert free.prediction.step_time_s < kept.prediction.step_time_s * 0.99
    for mb in kept.microbatches:
        assert held_tokens(mb, n).max() <= cap and not mb.recomputes()


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_a_global_mode_never_lays_units_out_over_its_capacity(recompute):
    ctx = _ctx(recompute)
    plans = [c.build() for c in long_blocks.candidates(ctx, 0, _long_step())]
    assert plans
    for p in plans:
        for mb in p.microbatches:
            assert held_tokens(mb, ctx.num_units).max() <= ctx.cost.token_capacity and not mb.recomputes()


def test_a_single_micro_batch_with_units_recomputing_does_not_end_the_modes():
    """``auto`` stops after its pass without recomputation when that gives one micro-batch in which
    no unit recomputes; where units of it recompute (laid out beyond their capacity), the other
    modes are planned too and the judge decides. It plans under ``full`` only where ``selective``'s
    plan needs more than one micro-batch (``full``'s capacity can only make fewer)."""
    from zeppelin.planner.zeppelin import recompute

    auto = _ctx()
    seqs = _long_step()
    base = long_blocks.candidates(mode_context(auto, "none"), 0, seqs)[0].build()
    assert len(base.microbatches) == 2
    alone = []  # the plan cut to one micro-batch: one in which no unit recomputes, one in which some do
    for want in (False, True):
        cut = base.model_copy(deep=True)
        cut.microbatches = [next(mb for mb in cut.microbatches if mb.recomputes() == want)]
        alone.append(cut)
    plain, marked = alone
    for made, modes in (({"none": plain}, ["none"]),
                        ({"none": marked, "selective": marked}, ["none", "selective"]),
                        ({"none": marked, "selective": base}, ["none", "selective", "full"]),
                        ({"none": base, "selective": base}, ["none", "selective", "full"])):
        asked = []

        def plan_one(mctx, step, sequences, made=made, asked=asked):
            asked.append(mctx.recompute)
            return made.get(mctx.recompute, base).model_copy(deep=True)

        recompute.plan_step(auto, 0, seqs, plan_one, score=lambda p: 1.0)
        assert asked == modes
