"""Event-driven simulator: hand-computed cases (round numbers, efficiency 1, no launch overheads).

Setup used throughout: 100 TFLOP/s GPUs, hidden 1024 with 8 heads (K/V width 1024), FFN 4096,
one layer, bf16, vocab 256. Then

* linear FLOPs per token (fwd)  = 2 * (1024*3072 + 1024^2 + 3*1024*4096) = 2^25
* a full c x c attention block  = 4 c^2 h FLOPs fwd, a causal diagonal block 2 c^2 h; fwd+bwd x3.5
* K/V bytes per token per layer = 2 * 1024 * 2 = 4096; a ring round moves 3x that (fwd K,V; bwd K,V,dK,dV)
* parameters = 16,779,264 per layer + 2 * 256 * 1024 (embedding, LM head) + 1024 (final norm)
"""

from __future__ import annotations

import json
import subprocess

import pytest

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.costmodel.predict import predict_step
from zeppelin.planner.sim.simulate import Engine, Simulator
from zeppelin.schemas.cluster import ClusterSpec, GPUSpec, LinkSpec, NICSpec
from zeppelin.schemas.common import content_hash
from zeppelin.schemas.layout import zigzag_ranges
from zeppelin.schemas.model import ModelSpec
from zeppelin.schemas.plan import (
    Group,
    InputHashes,
    MicroBatch,
    Placement,
    PlanHeader,
    Route,
    RoutePath,
    Sequence,
    StepPlan,
    write_plan,
)
from zeppelin.schemas.profile import CostProfile, KernelEfficiency

PEAK = 100e12
H = 1024
KV_BYTES_PER_TOKEN = 2 * 1024 * 2
LIN_FLOPS_PER_TOKEN = 2 ** 25
PARAMS = 16_779_264 + 2 * 256 * 1024 + 1024


def cluster(nodes=1, gpn=2, nics=1, intra=100.0, nic=10.0, intra_lat=0.0, nic_lat=0.0) -> ClusterSpec:
    return ClusterSpec(
        name="hand", num_nodes=nodes, gpus_per_node=gpn, gpu=GPUSpec(name="g", peak_tflops=100.0, memory_gb=1000.0),
        intra_link=LinkSpec(bandwidth_GBps=intra, latency_us=intra_lat),
        nics=[NICSpec(id=f"nic{i}", bandwidth_GBps=nic, latency_us=nic_lat) for i in range(nics)],
        gpu_nic=[f"nic{g * nics // gpn}" for g in range(gpn)])


MODEL = ModelSpec(name="hand", num_layers=1, hidden=H, num_heads=8, num_kv_heads=8, ffn_hidden=4096, vocab_size=256)
PROFILE = CostProfile(linear=KernelEfficiency(eff_max=1.0, n_half=0.0, overhead_s=0.0),
                      attention=KernelEfficiency(eff_max=1.0, n_half=0.0, overhead_s=0.0))


def ctx_for(cl: ClusterSpec, model: ModelSpec = MODEL) -> PlanContext:
    """ZeRO-0: one gradient all-reduce per step (:func:`allreduce`), so that the hand-priced
    transfers are the attention's alone (FSDP's per-micro-batch collectives: test_fsdp_bandwidth.py)."""
    return PlanContext(cl, model, PROFILE, zero_stage=0)


def full_block(c):  # fwd+bwd seconds of a c x c block
    return 3.5 * 4 * c * c * H / PEAK


def diag_block(c):
    return 3.5 * 2 * c * c * H / PEAK


def linear(tokens):
    return 3 * tokens * LIN_FLOPS_PER_TOKEN / PEAK


def head(tokens):
    return 3 * 2 * tokens * H * 256 / PEAK


def allreduce(n, bw_Bps, lat=0.0):
    return 2 * (n - 1) / n * PARAMS * 2 / bw_Bps + 2 * (n - 1) * lat


def ring_step(L, units, seqs=None, kind="ring", tier="intra", routes=(), extra_groups=(), queues=None, n=None):
    G = len(units)
    n = n or max(units) + 1
    groups = [Group(kind=kind, tier=tier, units=list(units))]
    pls = [Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(L, G))]
    sequences = [Sequence(sample_id=0, length=L)]
    for gi, (u, length) in enumerate(extra_groups, start=1):
        groups.append(Group(kind="local", tier="local", units=[u]))
        pls.append(Placement(seq=len(sequences), group=gi, ranges=[[[0, length]]]))
        sequences.append(Sequence(sample_id=len(sequences), length=length))
    if queues is None:
        queues = [[gi for gi, g in enumerate(groups) if u in g.units] for u in range(n)]
    return StepPlan(step=0, sequences=sequences,
                    microbatches=[MicroBatch(groups=groups, placements=pls, queues=queues, routes=list(routes))])


# ------------------------------------------------------------------------------------------ engine


def test_engine_max_min_fair_sharing():
    # A (10 B/s) carries f1 and f2; B (4 B/s) carries f2 and f3 -> B is the bottleneck: f2 = f3 = 2,
    # f1 gets the rest of A: 8. f2, f3 (4 bytes) end at t=2 together with f1's first 16 bytes;
    # then f1 runs alone at 10 B/s: 8 more bytes take 0.8 s.
    e = Engine({"A": 10.0, "B": 4.0})
    f1 = e.flow(24, ("A",), 0.0)
    f2 = e.flow(4, ("A", "B"), 0.0)
    f3 = e.flow(4, ("B",), 0.0)
    end = e.run()
    assert e.tasks[f2].end == pytest.approx(2.0)
    assert e.tasks[f3].end == pytest.approx(2.0)
    assert e.tasks[f1].end == pytest.approx(2.8)
    assert end == pytest.approx(2.8)


def test_engine_latency_then_bandwidth_and_priorities():
    e = Engine({"L": 100.0})
    f = e.flow(100, ("L",), 0.5)  # 0.5 s latency + 1 s of bytes
    c_hi = e.compute(0, 1.0, (0, 1), deps=[f])  # ready at 1.5
    c_lo = e.compute(0, 2.0, (5, 0))  # ready at 0, runs 0..2 (stream busy, c_hi waits)
    c_mid = e.compute(0, 1.0, (1, 0))  # ready at 0 but behind c_lo? no: picked first (lower prio)
    e.run()
    assert e.tasks[f].end == pytest.approx(1.5)
    assert e.tasks[c_mid].start == pytest.approx(0.0)  # lowest priority value among ready tasks at t=0
    assert e.tasks[c_lo].start == pytest.approx(1.0)
    assert e.tasks[c_hi].start == pytest.approx(3.0)  # non-preemptive: waits for c_lo


# ------------------------------------------------------------------------------------------ ring


def test_two_ranks_one_ring_round_hidden():
    """Two ranks, L = 4096 zigzag: chunks of c = 1024; round 0 = 2 diagonal + 1 full block per rank,
    round 1 = two full blocks; one transfer of 2048 tokens' K/V (x3) at 100 GB/s hides behind it."""
    L, c = 4096, 1024
    sim = Simulator(ctx_for(cluster(intra=100.0)))
    r = sim.simulate_step(ring_step(L, [0, 1]))
    comp_round = 2 * diag_block(c) + full_block(c)
    assert comp_round == pytest.approx(2 * full_block(c))  # zigzag balances the rounds
    transfer = 3 * 2048 * KV_BYTES_PER_TOKEN / 100e9
    assert transfer < comp_round
    ar = allreduce(2, 100e9)
    expected = 2 * comp_round + linear(2048) + head(2048) + ar
    for u in r.units:
        assert u.attention_s == pytest.approx(2 * comp_round, rel=1e-9)
        assert u.exposed_comm_s == pytest.approx(ar, rel=1e-9)  # only the all-reduce is exposed
        assert u.tokens == 2048
    assert r.step_time_s == pytest.approx(expected, rel=1e-9)
    assert r.allreduce_s == pytest.approx(ar, rel=1e-9)


def test_two_ranks_one_ring_round_exposed():
    """Same step at 25 GB/s: the transfer (1.0066 ms) outlasts the round's compute, the difference is exposed."""
    L, c = 4096, 1024
    sim = Simulator(ctx_for(cluster(intra=25.0)))
    r = sim.simulate_step(ring_step(L, [0, 1]))
    comp_round = 2 * full_block(c)
    transfer = 3 * 2048 * KV_BYTES_PER_TOKEN / 25e9
    assert transfer > comp_round
    ar = allreduce(2, 25e9)
    for u in r.units:
        assert u.attention_s == pytest.approx(2 * comp_round, rel=1e-9)
        assert u.exposed_comm_s == pytest.approx(transfer - comp_round + ar, rel=1e-9)
    # round 1 starts when the block has arrived (not when round 0's compute ended)
    assert r.step_time_s == pytest.approx(transfer + comp_round + linear(2048) + head(2048) + ar, rel=1e-9)


def test_latency_counts_once_per_transfer():
    L, c = 4096, 1024
    sim = Simulator(ctx_for(cluster(intra=25.0, intra_lat=100.0)))  # 100 us latency
    r = sim.simulate_step(ring_step(L, [0, 1]))
    transfer = 100e-6 + 3 * 2048 * KV_BYTES_PER_TOKEN / 25e9
    comp_round = 2 * full_block(c)
    assert r.units[0].exposed_comm_s - r.allreduce_s == pytest.approx(transfer - comp_round, rel=1e-9)


def test_ring_matches_closed_form_prediction_for_symmetric_rings():
    """On a symmetric 4-rank zigzag ring (and with efficiency 1) simulation and the analytic model agree."""
    ctx = ctx_for(cluster(gpn=4, intra=40.0))
    step = ring_step(8192, [0, 1, 2, 3])
    r = Simulator(ctx).simulate_step(step)
    p = predict_step(ctx, step)
    assert r.step_time_s == pytest.approx(p.step_time_s, rel=1e-9)
    assert [u.attention_s for u in r.units] == pytest.approx(p.per_unit.attention_s, rel=1e-9)


def test_ring_prediction_prices_blocks_at_their_size():
    """With size-dependent kernel efficiency and launch overheads, a ring round's blocks of L/(2G)
    tokens run less efficiently than one whole-sequence kernel: the analytic model prices the
    rounds exactly as the simulator does (round 0: two causal diagonals + one full block, later
    rounds two full blocks, one launch overhead per round), short sequences included."""
    prof = CostProfile(linear=KernelEfficiency(eff_max=1.0, n_half=0.0, overhead_s=0.0),
                       attention=KernelEfficiency(eff_max=0.5, n_half=512.0, overhead_s=50e-6))
    ctx = PlanContext(cluster(gpn=4, intra=40.0), MODEL, prof)
    c = ctx.cost
    for L in (256, 8192, 65536):
        step = ring_step(L, [0, 1, 2, 3])
        r = Simulator(ctx).simulate_step(step)
        p = predict_step(ctx, step)
        ch = L / 8

        def blk(q, k, causal):  # hand formula: overhead + flops x 3.5 / (peak x 0.5 x n / (n + 512))
            fl = (2.0 if causal else 4.0) * q * k * H * 3.5
            n = (q * k) ** 0.5
            return 50e-6 + fl / (PEAK * 0.5 * n / (n + 512.0))

        t0 = 2 * blk(ch, ch, True) + blk(ch, ch, False) - 2 * 50e-6
        tr = 2 * blk(ch, ch, False) - 50e-6
        assert c.ring_round_compute(L, 4)[0] == pytest.approx(t0, rel=1e-12)
        assert c.ring_round_compute(L, 4)[1] == pytest.approx(tr, rel=1e-12)
        assert r.units[0].attention_s == pytest.approx(t0 + 3 * tr, rel=1e-9)
        assert p.per_unit.attention_s[0] == pytest.approx(t0 + 3 * tr, rel=1e-9)
        assert r.step_time_s == pytest.approx(p.step_time_s, rel=1e-9)
        # blocks are less efficient than the whole sequence: the ring costs more than attn(L)/G
        assert t0 + 3 * tr > float(c.attn_time(L)) / 4


def test_local_work_fills_ring_gaps():
    """Unit 0 queues a slow ring first, then a local sequence: the local sequence runs while the K/V
    block is in flight, so the ring's exposed time shrinks by the local compute."""
    L, c, loc = 4096, 1024, 512
    sim = Simulator(ctx_for(cluster(intra=10.0)))
    r = sim.simulate_step(ring_step(L, [0, 1], extra_groups=[(0, loc)]))
    comp_round = 2 * full_block(c)
    transfer = 3 * 2048 * KV_BYTES_PER_TOKEN / 10e9
    local = diag_block(loc)
    assert transfer > comp_round + local
    u0 = r.units[0]
    assert u0.attention_s == pytest.approx(2 * comp_round + local, rel=1e-9)
    # layer finishes attention at transfer + comp_round (the local block was hidden in the gap)
    assert u0.exposed_comm_s - r.allreduce_s == pytest.approx(transfer + comp_round - 2 * comp_round - local,
                                                              rel=1e-9)


# ------------------------------------------------------------------------------------------ NICs


def _ring_inter_durations(r, unit):
    return sorted(iv.end - iv.start for mb in r.timeline for iv in mb.intervals
                  if iv.unit == unit and iv.cat == "ring-inter")


def test_nic_sharing_halves_bandwidth():
    """2 nodes x 2 GPUs, one 10 GB/s NIC per node. Ring (0,2) alone moves its block at 10 GB/s; with
    a second ring (1,3) crossing the same NICs at the same time each gets 5 GB/s."""
    L = 4096
    nbytes = 3 * 2048 * KV_BYTES_PER_TOKEN
    sim = Simulator(ctx_for(cluster(nodes=2, gpn=2, nics=1, nic=10.0)))
    alone = sim.simulate_step(ring_step(L, [0, 2], n=4), timeline=True)
    assert _ring_inter_durations(alone, 0) == pytest.approx([nbytes / 10e9] * 2, rel=1e-9)
    two = StepPlan(step=0, sequences=[Sequence(sample_id=0, length=L), Sequence(sample_id=1, length=L)],
                   microbatches=[MicroBatch(
                       groups=[Group(kind="ring", tier="inter", units=[0, 2]),
                               Group(kind="ring", tier="inter", units=[1, 3])],
                       placements=[Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(L, 2)),
                                   Placement(seq=1, group=1, scheme="zigzag", ranges=zigzag_ranges(L, 2))],
                       queues=[[0], [1], [0], [1]])])
    shared = sim.simulate_step(two, timeline=True)
    assert _ring_inter_durations(shared, 0) == pytest.approx([2 * nbytes / 10e9] * 2, rel=1e-9)
    # bytes through node0/nic0: two flows out and two in, each nbytes (one layer)
    assert shared.nics["node0/nic0"].bytes == pytest.approx(4 * nbytes)
    assert shared.nics["node0/nic0"].busy_s == pytest.approx(2 * nbytes / 10e9, rel=1e-9)
    assert alone.nics["node0/nic0"].bytes == pytest.approx(2 * nbytes)


def test_routing_spreads_load_over_idle_nics():
    """2 nodes x 2 GPUs, a NIC per GPU. Ring (0,2) unrouted uses one NIC per node; routed, half the
    block goes 0 -> 1 (NVLink) -> NIC1 -> 3 -> 2 (NVLink), so the round takes
    B/2 * (2/intra + 1/nic) instead of B/nic."""
    L = 4096
    B = 3 * 2048 * KV_BYTES_PER_TOKEN
    cl = cluster(nodes=2, gpn=2, nics=2, nic=10.0, intra=200.0)
    sim = Simulator(ctx_for(cl))
    plain = sim.simulate_step(ring_step(L, [0, 2], tier="inter", n=4), timeline=True)
    assert _ring_inter_durations(plain, 0) == pytest.approx([B / 10e9] * 2, rel=1e-9)

    def route(src, dst, psrc, pdst):
        return Route(group=0, src=src, dst=dst, tokens=2048, bytes=int(B), paths=[
            RoutePath(via_src=src, via_dst=dst, nic_src=cl.nic_of(src), nic_dst=cl.nic_of(dst), tokens=1024),
            RoutePath(via_src=psrc, via_dst=pdst, nic_src=cl.nic_of(psrc), nic_dst=cl.nic_of(pdst), tokens=1024)])

    routed_step = ring_step(L, [0, 2], tier="inter", n=4, routes=[route(0, 2, 1, 3), route(2, 0, 3, 1)])
    routed = sim.simulate_step(routed_step, timeline=True)
    round_routed = B / 2 * (2 / 200e9 + 1 / 10e9)
    comp_round = 2 * full_block(1024)
    assert round_routed > comp_round
    ar = routed.allreduce_s
    assert routed.units[0].exposed_comm_s - ar == pytest.approx(round_routed - comp_round, rel=1e-9)
    assert plain.units[0].exposed_comm_s - ar == pytest.approx(B / 10e9 - comp_round, rel=1e-9)
    # every NIC carries half the bytes of the unrouted busy one
    for nic in ("node0/nic0", "node0/nic1", "node1/nic0", "node1/nic1"):
        assert routed.nics[nic].bytes == pytest.approx(B)  # half out + half in
    assert plain.nics["node0/nic0"].bytes == pytest.approx(2 * B)
    assert "node0/nic1" not in plain.nics


# ------------------------------------------------------------------------------------------ others


def test_allgather_and_ulysses_hand_cases():
    L, c = 4096, 1024
    bw = 50e9
    sim = Simulator(ctx_for(cluster(intra=50.0)))
    # all-gather CP over 2 ranks: 3 x K/V of the other rank's 2048 tokens, then each rank computes
    # its queries against every key: 2 diagonal + 3 full blocks (half the causal square).
    ag = sim.simulate_step(ring_step(L, [0, 1], kind="allgather"))
    comm = 3 * 2048 * KV_BYTES_PER_TOKEN / bw
    comp = 2 * diag_block(c) + 3 * full_block(c)
    for u in ag.units:
        assert u.attention_s == pytest.approx(comp, rel=1e-9)
        assert u.exposed_comm_s - ag.allreduce_s == pytest.approx(comm, rel=1e-9)
    # Ulysses over 2 ranks: an all-to-all before and after attention, each moving half of
    # tokens_per_rank * (2h + 2 kv) * 2 bytes per rank; attention over half the heads of the whole sequence.
    ul = sim.simulate_step(ring_step(L, [0, 1], kind="ulysses"))
    per = 2048 * (2 * H + 2 * 1024) * 2
    a2a = per / 2 / bw
    for u in ul.units:
        assert u.attention_s == pytest.approx(3.5 * 2 * L * L * H / PEAK / 2, rel=1e-9)
        assert u.exposed_comm_s - ul.allreduce_s == pytest.approx(2 * a2a, rel=1e-9)


def test_fused_attention_calls_never_cost_less_than_their_largest_piece():
    # the per-call overhead comes from the whole-sequence attention fit, the pieces from the block
    # fit; a measured profile can make the overhead exceed small pieces. Subtracting it once per
    # fused piece must not drive a compute negative (an event before its cause stalls the loop).
    L, c = 4096, 1024
    sim = Simulator(ctx_for(cluster(intra=50.0)))
    sim.attn_overhead = 1.0  # far above any block of this step
    for kind in ("allgather", "ring"):
        r = sim.simulate_step(ring_step(L, [0, 1], kind=kind))
        assert all(full_block(c) <= u.attention_s < 1.0 for u in r.units), kind
    with pytest.raises(ValueError, match="durations must be >= 0"):
        Engine({}).compute(0, -1e-3, (0, 0))


def test_remap_moves_tokens_between_attention_and_linear():
    """Unit 0 holds a 3000-token sequence, unit 1 a 1000-token one; the linear layout gives each
    2000 tokens, so 1000 tokens' activations move 0 -> 1 before the linear modules and back after."""
    sim = Simulator(ctx_for(cluster(intra=100.0)))
    mb = MicroBatch(groups=[Group(kind="local", tier="local", units=[0]), Group(kind="local", tier="local", units=[1])],
                    placements=[Placement(seq=0, group=0, ranges=[[[0, 3000]]]),
                                Placement(seq=1, group=1, ranges=[[[0, 1000]]])],
                    queues=[[0], [1]], linear_layout=[[[0, 0, 2000]], [[0, 2000, 3000], [1, 0, 1000]]])
    step = StepPlan(step=0, sequences=[Sequence(sample_id=0, length=3000), Sequence(sample_id=1, length=1000)],
                    microbatches=[mb])
    r = sim.simulate_step(step)
    remap = 2 * 1000 * H * 2 / 100e9  # activations + gradients, bf16
    a0 = diag_block(3000)
    ar = allreduce(2, 100e9)
    expected = a0 + remap + linear(2000) + remap + head(2000) + ar
    assert r.step_time_s == pytest.approx(expected, rel=1e-9)
    assert r.units[0].exposed_comm_s == pytest.approx(2 * remap + ar, rel=1e-9)
    # unit 1 finished its attention early and waited for unit 0 before the all-to-all
    assert r.units[1].exposed_comm_s == pytest.approx(a0 - diag_block(1000) + 2 * remap + ar, rel=1e-9)
    assert [u.tokens for u in r.units] == [2000, 2000]


def test_coupled_units_share_layer_period_across_layers():
    """Units in one ring advance layer by layer together: with 4 layers a unit that also has local
    work makes its ring partner idle for that long in every layer."""
    model = MODEL.model_copy(update={"num_layers": 4})
    sim = Simulator(ctx_for(cluster(intra=100.0), model))
    r = sim.simulate_step(ring_step(4096, [0, 1], extra_groups=[(0, 2048)]))
    local = diag_block(2048)
    # unit 1 waits for unit 0's extra local work in each of the 4 layers (linear tokens differ too)
    extra_lin = linear(2048 + 2048) - linear(2048)
    extra_head = head(4096) - head(2048)
    assert r.units[1].idle_s == pytest.approx(4 * (local + extra_lin) + extra_head, rel=1e-9)
    assert r.units[0].idle_s == pytest.approx(0.0, abs=1e-12)


# ------------------------------------------------------------------------------------------ CLI


def _header(cl, model=MODEL, num_steps=1) -> PlanHeader:
    return PlanHeader(planner="hand", num_steps=num_steps, world_size=cl.world_size, cluster=cl, model=model,
                      profile=PROFILE, hashes=InputHashes(cluster=content_hash(cl), model=content_hash(model),
                                                          profile=content_hash(PROFILE), manifest="sha256:none"))


@pytest.fixture
def plan_file(tmp_path):
    cl = cluster(nodes=2, gpn=2, nics=1, nic=10.0)
    steps = [ring_step(4096, [0, 2], tier="inter", n=4, extra_groups=[(1, 1000), (3, 3000)])]
    steps.append(steps[0].model_copy(update={"step": 1}))
    path = tmp_path / "p.plan"
    write_plan(path, _header(cl, num_steps=2), steps)
    return path


def test_cli_simulate_json_matches_library(plan_file, zeppelin_bin, tmp_path):
    out = subprocess.run([zeppelin_bin, "simulate", str(plan_file), "--json"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    from zeppelin.planner.sim.simulate import simulate_plan

    _, res = simulate_plan(plan_file)
    assert [s["step_time_s"] for s in doc["steps"]] == pytest.approx([x.step_time_s for x in res])
    assert doc["summary"]["steps"] == 2
    assert set(doc["steps"][0]["nics"]) == {"node0/nic0", "node1/nic0"}
    assert doc["steps"][0]["per_unit"]["tokens"] == [2048, 1000, 2048, 3000]
    # table output, one step per unit
    out = subprocess.run([zeppelin_bin, "simulate", str(plan_file), "--step", "1"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "step 1" in out.stdout and "node1/nic0" in out.stdout
    # JSON to a file, atomically
    dest = tmp_path / "sim.json"
    out = subprocess.run([zeppelin_bin, "simulate", str(plan_file), "-o", str(dest), "--timeline"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "timeline" in json.loads(dest.read_text())["steps"][0]


def test_cli_simulate_errors(plan_file, zeppelin_bin, tmp_path):
    out = subprocess.run([zeppelin_bin, "simulate", str(tmp_path / "nope.plan")], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == f"zeppelin: error: {tmp_path / 'nope.plan'}: plan file not found"
    out = subprocess.run([zeppelin_bin, "simulate", str(plan_file), "--step", "7"], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == f"zeppelin: error: {plan_file}: step 7 out of range (plan has 2 steps)"
    bad = tmp_path / "trunc.plan"
    bad.write_text("\n".join(plan_file.read_text().splitlines()[:1]) + "\n")
    out = subprocess.run([zeppelin_bin, "simulate", str(bad)], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert "plan is truncated" in out.stderr and "Traceback" not in out.stderr


def test_vectorised_max_min_rates_match_the_loop(monkeypatch):
    """Large contended flow sets take the numpy path; it must give the loop's max-min rates."""
    import random

    import zeppelin.planner.sim.engine as S

    rng = random.Random(3)
    cap = {f"r{i}": rng.choice([1e9, 2e9, 5e9, 2.5e10]) for i in range(12)}
    eng = S.Engine(cap)
    for _ in range(150):
        res = tuple(rng.sample(sorted(cap), rng.choice([1, 2, 2, 3])))
        eng.flow(1e6, res, 0.0, cap=rng.choice([S._INF, S._INF, 3e9]))
    flows = eng.tasks
    monkeypatch.setattr(S, "_VECTOR_FLOWS", 10**9)
    loop = eng._rates(flows)
    monkeypatch.setattr(S, "_VECTOR_FLOWS", 1)
    vec = eng._rates(flows)
    assert vec == pytest.approx(loop, rel=1e-9)
    # max-min: every resource is within capacity and every flow is capped or crosses a full resource
    used = {r: 0.0 for r in cap}
    for f, x in zip(flows, vec):
        for r in f.res:
            used[r] += x
    assert all(used[r] <= cap[r] * (1 + 1e-9) for r in cap)
    full = {r for r in cap if used[r] >= cap[r] * (1 - 1e-9)}
    assert all(x >= f.cap * (1 - 1e-9) or full & set(f.res) for f, x in zip(flows, vec))
