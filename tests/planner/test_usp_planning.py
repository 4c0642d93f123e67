"""usp groups in the planner: the cost model's replicated all-to-all and 1/u ring, the prediction
against the simulator on usp plans, the ``usp`` baseline and the ``usp-groups`` family."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from tests.support.zeppelin_steps import make_ctx, seqs_of, valid_plan
from zeppelin.planner.core.base import PlanningError, get_planner
from zeppelin.planner.costmodel.predict import predict_step, ulysses_held_tokens
from zeppelin.planner.sim.simulate import Simulator
from zeppelin.planner.zeppelin.families import usp_groups
from zeppelin.planner.zeppelin.routing import plan_routes

LONG = [60000, 9000, 7000, 5000, 4000, 3000, 2500, 2000, 1500, 1200, 1000, 800, 600, 500, 400, 300]


def test_replicated_all_to_all_and_the_ring_share():
    ctx = make_ctx("zeppelin-a:2", "qwen2.5-3b")  # 16 query heads over 2 KV heads
    cm = ctx.cost
    assert cm.kv_replication(2) == 1.0 and cm.kv_replication(8) == 4.0
    # up to the KV heads the all-to-all moves Q, K, V, O once; past them each position gets whole KV
    # heads, so K and V travel kv_replication times (every Ulysses group and usp row alike)
    m = ctx.model
    assert cm.ulysses_bytes_per_token(2) == (2 * m.hidden + 2 * m.kv_dim) * 2
    assert cm.ulysses_bytes_per_token(8) == (2 * m.hidden + 8 * m.kv_dim) * 2
    assert float(cm.ulysses_comm_time(4096.0, 8)) == pytest.approx(
        2 * float(cm.alltoall_time(4096.0 * cm.ulysses_bytes_per_token(8), 8, "intra")))
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


def test_replicated_heads_count_in_memory_where_ulysses_rows_are():
    ctx = make_ctx("zeppelin-a:2", "qwen2.5-3b")
    cm, m, c = ctx.cost, ctx.model, ctx.model.dtype_bytes
    # a row of 8 over 2 KV heads keeps 4 copies of each head's K/V in the head layout: 3 more than 1
    assert cm.ulysses_weight(2) == 1.0
    assert cm.ulysses_weight(8) == pytest.approx(1 + 3 * 2 * c * m.kv_dim / (2 * c * m.q_dim + 16))
    assert cm.ulysses_capacity(8) < cm.ulysses_capacity(2) == cm.ulysses_token_capacity
    # the usp baseline's rows of 8 (replicated) hold fewer tokens per unit than a row of 2 may
    plan = get_planner("usp", ulysses=8).plan_step(ctx, 0, seqs_of(LONG))
    valid_plan(ctx, plan)
    mb = plan.microbatches[0]
    held = ulysses_held_tokens(mb, ctx.num_units, cm)
    raw = ulysses_held_tokens(mb, ctx.num_units, _NoReplication(cm))
    assert held is not None and held.max() > 0
    assert held == pytest.approx(raw * cm.ulysses_weight(8))


class _NoReplication:
    def __init__(self, cm):
        self.cm = cm

    def ulysses_weight(self, G):
        return 1.0


def _column_rings(g):
    u = g.shape[0]
    return [g.units[j::u] for j in range(u)]


def _busiest_side(mb) -> int:
    """Tokens through the busiest NIC direction (sending or receiving) in a round."""
    side = defaultdict(int)
    for r in mb.routes:
        for p in r.paths:
            side["tx", p.nic_src] += p.tokens
            side["rx", p.nic_dst] += p.tokens
    return max(side.values())


def test_usp_column_rings_are_routed_inside_their_columns():
    """Rows of 4 on nodes of 8 (two GPUs per NIC): each column ring crosses nodes from one of its
    two rows on a node while the other row's NIC idles in that direction; routing sends crossings
    through that row's unit (the column ring's own member, which the runtime relays through), the
    busiest NIC lighter, the plan valid and priced as the simulator plays it."""
    ctx = make_ctx("zeppelin-a:2", "qwen2.5-3b")
    plan = get_planner("usp", ulysses=4, ring=4).plan_step(ctx, 0, seqs_of(LONG))
    valid_plan(ctx, plan)
    sim = Simulator(ctx)
    direct_time = sim.simulate_step(plan).step_time_s
    mb = next(mb for mb in plan.microbatches if mb.routes)
    g = mb.groups[mb.routes[0].group]
    assert g.kind == "usp" and tuple(g.shape) == (4, 4)
    # direct routes (the baseline's): every crossing hop of every column ring, none relayed
    crossings = {(a, b) for ring in _column_rings(g) for a, b in zip(ring, ring[1:] + ring[:1])
                 if a // 8 != b // 8}
    assert {(r.src, r.dst) for r in mb.routes} == crossings
    assert all(len(r.paths) == 1 and r.paths[0].via_src == r.src for r in mb.routes)
    # a position's ring block: its row's tokens on one KV head of the unit's 2
    assert mb.routes[0].bytes == int(ctx.cost.kv_bytes(mb.routes[0].tokens) * 2 / 4)
    direct = _busiest_side(mb)
    for m in plan.microbatches:
        m.routes = plan_routes(ctx, m)
    valid_plan(ctx, plan)
    routed = [r for m in plan.microbatches for r in m.routes
              if any((p.via_src, p.via_dst) != (r.src, r.dst) for p in r.paths)]
    assert routed
    for r in routed:
        ring = next(x for x in _column_rings(g) if r.src in x)
        assert {p.via_src for p in r.paths} | {p.via_dst for p in r.paths} <= set(ring)
    assert _busiest_side(mb) == direct / 2  # every direction of every NIC carries one crossing, not two
    plan.prediction = predict_step(ctx, plan)
    got = sim.simulate_step(plan).step_time_s
    assert plan.prediction.step_time_s == pytest.approx(got, rel=0.05)
    assert got <= direct_time * (1 + 1e-9)  # (this profile's NICs carry concurrent flows at full rate each)
