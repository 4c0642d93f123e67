"""The prediction's micro-batch terms (costmodel/predict.py) on hand-built micro-batches: per-unit
attention, exposed communication and linear work, and the waits of coupled partners."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.zeppelin_steps import make_ctx
from zeppelin.schemas.layout import zigzag_ranges


def test_microbatch_terms_hand_computed():
    """One local group of two sequences and one intra-node ring of one sequence, no remap."""
    from zeppelin.planner.costmodel.predict import microbatch_terms
    from zeppelin.schemas.plan import Group, MicroBatch, Placement

    ctx = make_ctx("zeppelin-a", "llama-7b")
    c, layers, n = ctx.cost, ctx.model.num_layers, ctx.num_units
    lengths = [3000, 1000, 8000]
    mb = MicroBatch(
        groups=[Group(kind="ring", tier="intra", units=[2, 3]), Group(kind="local", tier="local", units=[0])],
        placements=[Placement(seq=2, group=0, scheme="zigzag", ranges=zigzag_ranges(8000, 2)),
                    Placement(seq=0, group=1, ranges=[[[0, 3000]]]),
                    Placement(seq=1, group=1, ranges=[[[0, 1000]]])],
        queues=[[1], [], [0], [0]] + [[] for _ in range(n - 4)])
    t = microbatch_terms(ctx, lengths, mb)
    local = layers * float(c.attn_time(3000.0) + c.attn_time(1000.0))
    # zigzag over 2: chunks of 2000; round 0 = two causal diagonals + one full block, round 1 =
    # two full blocks, one launch overhead per round; the one transfer hides behind round 0
    ov = c.profile.attention.overhead_s
    r0 = 2 * float(c.attn_block_time(2000, 2000, causal=True)) + float(c.attn_block_time(2000, 2000)) - 2 * ov
    r1 = 2 * float(c.attn_block_time(2000, 2000)) - ov
    comm_round = float(c.p2p_time(c.ring_round_bytes(4000.0), "intra"))
    assert t.attn[0] == pytest.approx(local, rel=1e-12)
    assert t.attn[2] == t.attn[3] == pytest.approx(layers * (r0 + r1), rel=1e-12)
    assert t.exposed[2] == pytest.approx(layers * max(comm_round - r0, 0.0), rel=1e-12, abs=1e-15)
    assert t.comm[3] == pytest.approx(layers * comm_round, rel=1e-12)
    assert t.tokens.tolist() == [4000, 0, 4000, 4000] + [0] * (n - 4)
    assert t.attn[1] == 0.0 and t.attn[4:].sum() == 0.0
    lin = layers * float(c.linear_time(4000.0)) + float(c.head_time(4000.0))
    assert t.lin[0] == pytest.approx(lin, rel=1e-12)
    assert t.busy[2] == pytest.approx(t.attn[2] + t.lin[2] + t.exposed[2])


def test_prediction_charges_waits_for_coupled_partners():
    """With replicated weights (ZeRO-0) units that share a ring wait for each other every layer: a
    micro-batch's period on a unit is the slowest busy time of its coupled set (chained through
    shared rings) plus its own LM head; an uncoupled unit keeps its own busy time, and the step is
    the largest summed period. Under FSDP (ZeRO 1-3) every unit waits for the slowest."""
    from zeppelin.planner.costmodel.predict import microbatch_terms, predict_from_terms
    from zeppelin.schemas.plan import Group, MicroBatch, Placement

    ctx = make_ctx("zeppelin-a", "llama-7b", zero_stage=0)
    c, n = ctx.cost, ctx.num_units
    lengths = [8000, 2000, 500]
    mb = MicroBatch(
        groups=[Group(kind="ring", tier="intra", units=[0, 1]), Group(kind="ring", tier="intra", units=[1, 2]),
                Group(kind="local", tier="local", units=[3])],
        placements=[Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(8000, 2)),
                    Placement(seq=1, group=1, scheme="zigzag", ranges=zigzag_ranges(2000, 2)),
                    Placement(seq=2, group=2, ranges=[[[0, 500]]])],
        queues=[[0], [0, 1], [1], [2]] + [[] for _ in range(n - 4)])
    t = microbatch_terms(ctx, lengths, mb)
    head = np.array([float(c.head_time(x)) for x in t.tokens])
    slowest = float((t.busy - head)[:3].max())
    assert slowest == pytest.approx(float(t.busy[1] - head[1]), rel=1e-12)  # unit 1 runs both rings
    assert t.period[:3] == pytest.approx(slowest + head[:3], rel=1e-12)
    assert t.period[2] > t.busy[2] + 0.5 * (slowest - (t.busy[2] - head[2]))  # unit 2 waits for unit 1
    assert t.period[3] == pytest.approx(t.busy[3], rel=1e-12)  # local: no partner
    assert t.period[4:].tolist() == t.busy[4:].tolist()
    pred = predict_from_terms(ctx, lengths, [t, t])
    ar = float(c.step_collectives_time(2, n, [float(t.period.max())] * 2))  # FSDP2's, per micro-batch
    assert pred.step_time_s == pytest.approx(float((2 * t.period).max()) + ar, rel=1e-12)
    assert pred.per_unit.total_s[2] == pytest.approx(2 * float(t.busy[2]) + ar, rel=1e-12)  # its own work
    fsdp = microbatch_terms(make_ctx("zeppelin-a", "llama-7b", zero_stage=1), lengths, mb)
    assert fsdp.period == pytest.approx(slowest + head, rel=1e-12)  # idle units wait too
