"""usp groups in the planner: the cost model's replicated all-to-all and 1/u ring, the prediction
against the simulator on usp plans, the ``usp`` baseline and the ``usp-groups`` family."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.zeppelin_steps import make_ctx, seqs_of, valid_plan
from zeppelin.planner.core.base import PlanningError, get_planner
from zeppelin.planner.sim.simulate import Simulator
from zeppelin.planner.zeppelin.families import usp_groups

LONG = [60000, 9000, 7000, 5000, 4000, 3000, 2500, 2000, 1500, 1200, 1000, 800, 600, 500, 400, 300]


def test_replicated_all_to_all_and_the_ring_share():
    ctx = make_ctx("zeppelin-a:2", "qwen2.5-3b")  # 16 query heads over 2 KV heads
    cm = ctx.cost
    assert cm.kv_replication(2) == 1.0 and cm.kv_replication(8) == 4.0
    # up to the KV heads the all-to-all is the Ulysses one; past them each position gets whole KV heads
    assert float(cm.ulysses_rep_comm_time(4096.0, 2)) == pytest.approx(float(cm.ulysses_comm_time(4096.0, 2)))
    assert float(cm.ulysses_rep_comm_time(4096.0, 8)) > float(cm.ulysses_comm_time(4096.0, 8))
    L = np.array([32768.0])
    # u x r = 8 x 2 computes 1/8 of a 2-ring's attention; a 1-row usp group is attention on 1/u of the heads
    t0, tr = cm.ring_round_compute(L, 2)
    assert cm.usp_terms(L, 8, 2, "intra", "inter")[0] == pytest.approx(float(t0[0] + tr[0]) / 8)
    assert float(cm.usp_seq_time(L, 4, 1, "inter")[0]) == pytest.approx(float(cm.ring_round_compute(L, 1)[0][0]) / 4)


def test_usp_baseline_plans_fixed_shapes_priced_as_simulated():
    ctx = make_ctx("zeppelin-a:2", "llama3-8b")
    ctx.max_seq_len = 65536
    plan = get_planner("usp").plan_step(ctx, 0, seqs_of(LONG))
    valid_plan(ctx, plan)
    shapes = {tuple(g.shape) for mb in plan.microbatches for g in mb.groups}
    assert shapes == {(8, plan.notes["ring"])} and plan.notes["dp"] == 2 // plan.notes["ring"]
    for mb in plan.microbatches:
        for p in mb.placements:
            assert (p.padded_length or plan.sequences[p.seq].length) % (2 * 8 * plan.notes["ring"]) == 0
    assert plan.prediction.step_time_s == pytest.approx(Simulator(ctx).simulate_step(plan).step_time_s, rel=0.05)
    with pytest.raises(PlanningError, match=r"^usp: ulysses=3 is not usable here \(choose one of 1, 2, 4, 8: powers "
                                            r"of two dividing a node's 8 units and the 32 heads per unit\)$"):
        get_planner("usp", ulysses=3).plan_step(ctx, 0, seqs_of(LONG))


def test_family_offers_usp_shapes_only_for_sequences_that_must_cross_nodes():
    ctx = make_ctx("zeppelin-a:2", "qwen2.5-3b")
    cands = usp_groups.candidates(ctx, 0, seqs_of(LONG))
    assert cands
    sim = Simulator(ctx)
    for c in cands:
        plan = c.build()
        valid_plan(ctx, plan)
        usp = [g for mb in plan.microbatches for g in mb.groups if g.kind == "usp"]
        assert usp and all(g.shape[0] * g.shape[1] > 8 and g.kv_replication == max(1, g.shape[0] // 2) for g in usp)
        assert plan.prediction.step_time_s == pytest.approx(sim.simulate_step(plan).step_time_s, rel=0.05)
    assert usp_groups.candidates(ctx, 0, seqs_of([2000] * 64)) == []  # nothing must cross nodes
    assert usp_groups.candidates(make_ctx("zeppelin-a:1", "qwen2.5-3b"), 0, seqs_of(LONG)) == []  # one node
