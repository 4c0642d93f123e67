"""FSDP2's per-micro-batch collectives priced from the links' bandwidth when the profile has no
measured ``fsdp_microbatch_s`` fit (CostModel.fsdp_terms / fsdp_exposed_s / step_collectives_time),
and the saved measurement of benchmarks/bench_fsdp_microbatch.py priced again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeppelin.planner.costmodel.context import PlanContext
from zeppelin.schemas.cluster import ClusterSpec, GPUSpec, LinkSpec, NICSpec
from zeppelin.schemas.model import ModelSpec
from zeppelin.schemas.profile import CostProfile, KernelEfficiency, ModelFits

MODEL = ModelSpec(name="hand", num_layers=4, hidden=256, num_heads=8, num_kv_heads=8, ffn_hidden=1024, vocab_size=512)
PROFILE = CostProfile(linear=KernelEfficiency(eff_max=1.0, n_half=0.0, overhead_s=0.0),
                      attention=KernelEfficiency(eff_max=1.0, n_half=0.0, overhead_s=0.0))
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
DATA = BENCH / "data" / "fsdp_microbatch"


def cluster(nodes=1, gpn=2, intra=100.0, nic=10.0, nics=1, device="cuda") -> ClusterSpec:
    return ClusterSpec(
        name="hand", device=device, num_nodes=nodes, gpus_per_node=gpn,
        gpu=GPUSpec(name="g", peak_tflops=100.0, memory_gb=1000.0),
        intra_link=LinkSpec(bandwidth_GBps=intra, latency_us=0.0),
        nics=[NICSpec(id=f"nic{i}", bandwidth_GBps=nic, latency_us=0.0) for i in range(nics)],
        gpu_nic=[f"nic{g * nics // gpn}" for g in range(gpn)])


def cost(cl, zero=3, profile=PROFILE):
    return PlanContext(cl, MODEL, profile, zero_stage=zero).cost


def test_one_node_moves_each_block_whole_less_its_own_shard_per_collective():
    """Two GPUs of one node: each all-gather / reduce-scatter moves (W-1)/W of the tensor over the
    intra-node link; ZeRO-3 gathers the blocks again for the backward, ZeRO-1/2 do not."""
    c3, c1 = cost(cluster()), cost(cluster(), zero=1)
    P, block, L = MODEL.num_params(), MODEL.params_per_layer(), MODEL.num_layers
    b = c3.compute_bytes
    half = 0.5 / 100e9
    assert sum(c3.fsdp_terms) == pytest.approx(half * (b * P + 4 * P + b * L * block), rel=1e-12)
    assert sum(c1.fsdp_terms) == pytest.approx(half * (b * P + 4 * P), rel=1e-12)
    exposed, fwd, bwd = c3.fsdp_terms
    assert fwd == pytest.approx((L - 1) * half * b * block, rel=1e-12)  # the blocks after the first
    assert bwd == pytest.approx((L - 1) * half * (b + 4) * block, rel=1e-12)


def test_across_nodes_the_nodes_nics_carry_the_other_nodes_share():
    """Two nodes of two GPUs: inside the node (g-1)/g of the bytes per GPU, across nodes (N-1)/N
    of them through the node's NICs (both NICs of a node at once)."""
    c = cost(cluster(nodes=2, gpn=2, intra=100.0, nic=10.0, nics=2))
    nbytes = 1e9
    assert c.fsdp_collective_time(nbytes) == pytest.approx(0.5 * nbytes / 100e9 + 0.5 * nbytes / 20e9, rel=1e-12)
    one = cost(cluster(nodes=1, gpn=4))
    assert one.fsdp_collective_time(nbytes) == pytest.approx(0.75 * nbytes / 100e9, rel=1e-12)


def test_prefetched_collectives_hide_behind_compute_on_a_gpu_not_on_the_cpu():
    gpu, cpu = cost(cluster()), cost(cluster(device="cpu"))
    exposed, fwd, bwd = gpu.fsdp_terms
    assert gpu.fsdp_exposed_s(None) == pytest.approx(exposed + fwd + bwd)
    assert gpu.fsdp_exposed_s(1e3) == pytest.approx(exposed)  # long layers hide every prefetched one
    assert gpu.fsdp_exposed_s(0.0) == pytest.approx(exposed + fwd + bwd)
    assert exposed < gpu.fsdp_exposed_s(3 * fwd) < exposed + fwd + bwd
    assert cpu.fsdp_exposed_s(1e3) == pytest.approx(sum(cpu.fsdp_terms))
    # per micro-batch: each micro-batch's own compute hides its own collectives
    assert gpu.step_collectives_time(2, 2, [1e3, 0.0]) == pytest.approx(2 * exposed + fwd + bwd)
    assert gpu.step_collectives_time(3, 2) == pytest.approx(3 * (exposed + fwd + bwd))


def test_zero0_and_one_unit_keep_the_all_reduce_and_a_measurement_replaces_the_pricing():
    assert cost(cluster(), zero=0).step_collectives_time(3) == cost(cluster(), zero=0).grad_allreduce_time()
    assert cost(cluster(gpn=1)).step_collectives_time(3) == 0.0
    fits = CostProfile(**{**PROFILE.model_dump(), "fits": [ModelFits(model=MODEL.name, dtype=MODEL.dtype,
                                                                     fsdp_microbatch_s={"1": 0.01, "3": 0.02})]})
    measured = cost(cluster(), profile=fits)
    assert measured.step_collectives_time(3, 2, [1e3] * 3) == pytest.approx(0.06)  # measured: waits included


def test_more_micro_batches_cost_more_under_fsdp():
    """The same sequences in two micro-batches pay FSDP's collectives twice: the prediction and the
    simulator both charge it (with preset curves the plan no longer looks cheaper than one)."""
    from zeppelin.planner.costmodel.predict import predict_step
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.schemas.plan import Group, MicroBatch, Placement, Sequence, StepPlan

    ctx = PlanContext(cluster(intra=1.0), MODEL, PROFILE, zero_stage=3)
    seqs = [Sequence(sample_id=i, length=256) for i in range(4)]

    def mb(ids):
        return MicroBatch(groups=[Group(kind="local", tier="local", units=[u]) for u in range(2)],
                          placements=[Placement(seq=s, group=k, ranges=[[[0, 256]]]) for k, s in enumerate(ids)],
                          queues=[[0], [1]])

    one = StepPlan(step=0, sequences=seqs[:2], microbatches=[mb([0, 1])])
    two = StepPlan(step=0, sequences=seqs, microbatches=[mb([0, 1]), mb([2, 3])])
    p1, p2 = predict_step(ctx, one), predict_step(ctx, two)
    s1, s2 = Simulator(ctx).simulate_step(one), Simulator(ctx).simulate_step(two)
    assert s2.allreduce_s == pytest.approx(2 * s1.allreduce_s, rel=1e-9) and s1.allreduce_s > 0
    assert p2.step_time_s == pytest.approx(2 * p1.step_time_s, rel=1e-9)
    assert p2.step_time_s == pytest.approx(s2.step_time_s, rel=0.02)


def _bench(name: str):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    sys.path.insert(0, str(BENCH))
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


def test_the_saved_measurement_priced_by_the_current_code():
    """benchmarks/bench_fsdp_microbatch.py's saved run (2 gloo ranks, preset curves of
    local-cpu:1x2, `zeppelin run --report-json`): the figure docs/BENCHMARKS.md shows is what the
    current code predicts for the saved ZeRO-3 plan under the current preset, the measured figure
    is the saved runs' (FSDP's forward + backward over the replicated run's, per micro-batch), and
    the prediction is within 25% of it."""
    bench = _bench("bench_fsdp_microbatch")
    doc = json.loads((DATA / "meas.json").read_text())
    pred = bench.predicted_per_microbatch(DATA / doc["plans"]["zero3"])
    doc["predicted_per_microbatch_s"] = pred
    summary = bench.summarize(doc)
    assert summary == doc["summary"]  # the saved summary is the current code's
    assert abs(summary["error"]) <= 0.25, summary


def test_the_local_cpu_preset_carries_the_measured_gloo_links():
    """The local-cpu preset's links are benchmarks/bench_gloo_links.py's saved fit of what FSDP2's
    collectives cost on 2 gloo ranks (fits.fsdp, within rounding), and that fit is what the saved
    timings give."""
    from zeppelin.schemas.cluster import cluster_preset

    bench = _bench("bench_gloo_links")
    doc = json.loads((BENCH / "data" / "gloo_links" / "meas.json").read_text())
    assert bench.fits(doc["timings"]) == doc["fits"]
    fit = doc["fits"]["fsdp"]
    assert fit["worst_rel_error"] <= 0.25
    cl = cluster_preset("local-cpu:2x2")
    for link in (cl.intra_link, cl.nics[0]):
        assert link.latency_us == pytest.approx(fit["latency_us"], rel=0.02)
        assert link.bandwidth_GBps == pytest.approx(fit["bandwidth_GBps"], rel=0.02)
    # the raw calls cost less than FSDP2 makes of them, and the model counted calls and bytes as priced
    assert doc["fits"]["collectives"]["latency_us"] < fit["latency_us"]
    small = next(r for r in doc["timings"] if r.get("model") == "small-h256-l4")
    model = next(m for m in bench.fsdp_models() if m.name == "small-h256-l4")
    assert (small["calls"], small["recv_bytes"]) == pytest.approx(bench.fsdp_calls_bytes(model), rel=1e-9)
