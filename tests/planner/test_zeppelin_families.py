"""The candidate families (families/): each wins a step where it should, the families option, and
what larger TP replicas do not hold."""

from __future__ import annotations

import pytest

from tests.support.zeppelin_steps import grid_step, make_ctx, seqs_of, valid_plan
from zeppelin.planner.core.base import PlanningError
from zeppelin.planner.costmodel.predict import predict_step
from zeppelin.planner.zeppelin.planner import ZeppelinPlanner


BEFORE_USP = "ulysses-groups,flop-share,tp-replicas,wide-rings"


@pytest.mark.parametrize("cell, family, families", [
    (("zeppelin-c", "llama-7b", 1, "long", 32, 0), "usp-groups", "all"),
    (("zeppelin-c", "llama-7b", 1, "long", 32, 0), "flop-share", BEFORE_USP),
    (("zeppelin-c", "llama-13b", 1, "long", 64, 0), "tp-replicas", BEFORE_USP),
])
def test_family_chosen_where_it_wins_by_the_cost_model(cell, family, families):
    """Each family wins a step of the RESULTS grid by the prediction: the planner returns it, the
    plan validates, and it is faster by the prediction than the tiered search alone (FLOP shares and
    TP replicas win their steps with usp groups left out, which win them now)."""
    from zeppelin.planner.costmodel.predict import predict_replicas

    ctx, seqs = grid_step(*cell)
    plan = ZeppelinPlanner(families=families).plan_step(ctx, 0, seqs)
    tiered = ZeppelinPlanner(families="none").plan_step(ctx, 0, seqs)
    assert plan.notes["family"] == family
    assert "family" not in tiered.notes and "tiers" in tiered.notes
    assert plan.prediction.step_time_s < tiered.prediction.step_time_s
    valid_plan(ctx, plan)
    again = (predict_replicas if plan.replicas is not None else predict_step)(ctx, plan)
    assert again.step_time_s == pytest.approx(plan.prediction.step_time_s, rel=1e-9)
    if family == "tp-replicas":
        assert max(r.tp for r in plan.replicas) > ctx.tp
        assert sorted(g for r in plan.replicas for g in r.ranks) == list(range(ctx.cluster.world_size))
    # same inputs, same plan
    again = ZeppelinPlanner(families=families).plan_step(ctx, 0, seqs)
    assert again.model_dump(exclude={"solver"}) == plan.model_dump(exclude={"solver"})
    if family == "usp-groups":
        usp = [g for mb in plan.microbatches for g in mb.groups if g.kind == "usp"]
        assert usp and all(g.tier == "inter" and g.shape[0] * g.shape[1] == len(g.units) for g in usp)


def test_ulysses_groups_do_not_win_by_decoupled_microbatches():
    """Ulysses groups that keep their units for the whole step gain where micro-batches run
    decoupled; under FSDP every unit waits for the slowest in each micro-batch, and on the long-mix
    step they won when that was not charged, the tiered plan is now at least as fast: the planner
    returns it."""
    ctx, seqs = grid_step("zeppelin-c", "llama-7b", 1, "long", 64, 0)
    assert ctx.microbatches_coupled
    plan = ZeppelinPlanner(families="ulysses-groups").plan_step(ctx, 0, seqs)
    tiered = ZeppelinPlanner(families="none").plan_step(ctx, 0, seqs)
    assert "family" not in plan.notes
    assert plan.prediction.step_time_s == pytest.approx(tiered.prediction.step_time_s, rel=1e-12)


def test_families_option_validated():
    with pytest.raises(PlanningError, match=r"^families option: unknown family 'megatron' \(known: ulysses-groups, "
                                            r"flop-share, tp-replicas, wide-rings, usp-groups, all, none\)$"):
        ZeppelinPlanner(families="ulysses-groups,megatron")


def test_larger_tp_replicas_do_not_hold_what_the_units_cannot():
    """LLaMA-13B at tp=2 on 16 A800s, ZeRO-1: a 90,000-token sequence exceeds what the 8 units hold
    together (8 x 6,447 tokens). Larger TP replicas hold less in all, not more: every TP rank keeps
    whole parameters (the runtime's TP multiplies slices of them), so TP divides only the
    activations (4 x 11,245 at tp=4, 2 x 17,906 at tp=8). The step is rejected with the memory
    message, families or not."""
    ctx = make_ctx("zeppelin-a:2", "llama-13b", tp=2)
    held = {tp: ctx.cost_for(tp).token_capacity * (16 // tp) for tp in (2, 4, 8)}
    assert held == {2: 8 * 6447, 4: 4 * 11245, 8: 2 * 17906}
    lengths = [90000, 6000, 3000, 2000, 1500, 1000, 800, 500]
    for families in ("all", "none"):
        with pytest.raises(PlanningError, match=r"^sequence 0 \(sample 0\) has 90,000 tokens, more than the whole "
                                                r"cluster can hold \(8 units x 6,447 tokens"):
            ZeppelinPlanner(families=families).plan_step(ctx, 0, seqs_of(lengths))
