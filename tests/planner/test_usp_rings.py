"""Inter-node rings over whole nodes run as usp groups where the prediction finds it faster.

On a large cluster the tiered search gives each of a step's longest sequences a ring over whole
nodes. A ring crosses from node to node through one unit's NIC, or relays its hop over the node's
others through one NVLink port each way, once per round: with many rounds of small blocks the
transfers outlast the compute and the ring's units become the slowest of their micro-batch. The
same units as a usp group (rows inside a node, a ring of rows) send every unit's head share over
its own NIC behind blocks u times as large. The planner builds both and keeps the faster
(:func:`zeppelin.planner.zeppelin.tiered.best_microbatch`)."""

from __future__ import annotations

import numpy as np

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.core.driver import make_header
from zeppelin.planner.sim.simulate import Simulator
from zeppelin.planner.tools.validate import step_problems
from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import SamplerConfig, Sequence
from zeppelin.schemas.profile import default_profile


def _mixed_step(n: int, seed: int) -> list[Sequence]:
    """``n`` sequences: a log-normal body (median ~1.1K tokens) and one in ten from a Pareto tail
    from 4K tokens, clipped to 16..128K."""
    rng = np.random.default_rng(seed)
    body = rng.lognormal(7.0, 1.0, n)
    tail = (rng.pareto(1.2, n) + 1.0) * 4096
    L = np.clip(np.where(rng.random(n) < 0.1, tail, body).astype(np.int64), 16, 128 * 1024)
    return [Sequence(sample_id=i, length=int(x)) for i, x in enumerate(L)]


def test_inter_rings_run_as_usp_where_faster():
    """1,024 GPUs (zeppelin-c, 8 NICs per node), LLaMA-7B, a mixed step of 8,192 sequences: the
    longest run as usp groups over whole nodes; the plan holds every invariant and its memory, and
    it is faster than the same search with rings only (``inter=ring``): by the prediction (which
    prices the rings' relayed hops a little high: ~3%) and by the simulator (~2%)."""
    cl = cluster_preset("zeppelin-c:128")
    ctx = PlanContext(cl, model_preset("llama-7b"), default_profile(cl.name))
    seqs = _mixed_step(8192, 1024)
    pl = ZeppelinPlanner()
    with_usp = pl.plan_step(ctx, 0, seqs)
    usp = [g for mb in with_usp.microbatches for g in mb.groups if g.kind == "usp"]
    assert usp and all(g.tier == "inter" and g.shape[0] == 8 and len(g.units) % 8 == 0 for g in usp)
    header = make_header(ctx, pl, None, SamplerConfig(tokens_per_step=sum(s.length for s in seqs)), 1)
    assert step_problems(ctx, header, with_usp) == []
    rings = ZeppelinPlanner(inter="ring").plan_step(ctx, 0, seqs)  # (the option keeps the rings)
    assert not [g for mb in rings.microbatches for g in mb.groups if g.kind == "usp"]
    assert with_usp.prediction.step_time_s < 0.97 * rings.prediction.step_time_s
    sim = Simulator(ctx)
    assert sim.simulate_step(with_usp).step_time_s < 0.99 * sim.simulate_step(rings).step_time_s


def test_stage_one_prices_whole_node_spans_as_usp_groups():
    """The same step: stage 1 prices a span over whole nodes as the cheaper of a ring and a usp
    group, so the sequences that bound their micro-batch on one node's ring (66-67K tokens) take
    two nodes as usp groups, whose nodes take no other ring. Every sequence over 60K tokens runs as
    a usp group (two ran as rings of 8 before), the plan holds every invariant, and it is >= 4%
    faster than stage 1 pricing rings alone (``usp_spans=off``), by the prediction and by the
    simulator (6-7%)."""
    cl = cluster_preset("zeppelin-c:128")
    ctx = PlanContext(cl, model_preset("llama-7b"), default_profile(cl.name))
    seqs = _mixed_step(8192, 1024)
    pl = ZeppelinPlanner()
    plan = pl.plan_step(ctx, 0, seqs)
    header = make_header(ctx, pl, None, SamplerConfig(tokens_per_step=sum(s.length for s in seqs)), 1)
    assert step_problems(ctx, header, plan) == []
    long_kinds = {mb.groups[p.group].kind for mb in plan.microbatches for p in mb.placements
                  if seqs[p.seq].length > 60_000}
    assert long_kinds == {"usp"}
    rings_priced = ZeppelinPlanner(usp_spans="off").plan_step(ctx, 0, seqs)
    assert {mb.groups[p.group].kind for mb in rings_priced.microbatches for p in mb.placements
            if seqs[p.seq].length > 60_000} == {"usp", "ring"}
    assert plan.prediction.step_time_s < 0.96 * rings_priced.prediction.step_time_s
    sim = Simulator(ctx)
    assert sim.simulate_step(plan).step_time_s < 0.96 * sim.simulate_step(rings_priced).step_time_s


def test_usp_prices_only_spans_over_whole_nodes():
    """:meth:`Tiering.usp_prices`: finite on the inter-node spans only, the rows' all-to-alls and the
    ring of rows of one sequence alone (``usp_seq_time`` + ``ulysses_comm_time``), and None for a
    model whose heads allow no usp row."""
    from zeppelin.planner.zeppelin.tiering import Tiering

    cl = cluster_preset("zeppelin-c:4")
    ctx = PlanContext(cl, model_preset("llama-7b"), default_profile(cl.name))
    t = Tiering(ctx)
    L = np.array([40_000.0, 90_000.0])
    table = t.span_table(L, len(cl.nics))
    V = t.usp_prices(table)
    inter = [k for k, s in enumerate(t.spans) if s.tier == "inter"]
    assert inter and np.isfinite(V[inter]).all() and np.isinf(np.delete(V, inter, axis=0)).all()
    k = inter[0]
    G, c = t.spans[k].G, ctx.cost
    want = ctx.model.num_layers * (c.usp_seq_time(L, 8, G // 8, "inter") + c.ulysses_comm_time(L / G, 8, "intra"))
    assert np.allclose(V[k], want, rtol=1e-12)
    assert t.usp_prices(table) is V  # kept on the table


def test_small_clusters_lay_marked_microbatches_out_with_rings_too(monkeypatch):
    """On 2 nodes a usp group over both leaves no unit for a ring: a micro-batch whose marked
    sequences span more than half the nodes of a cluster of at most ``tiered.MARKS_ALONE_UNITS``
    units is laid out with rings alone too (``tiered.MARKS_CROWD_SHARE``), and the faster layout
    kept. The RESULTS grid's step 3 of cluster A, LLaMA-7B, short mix, 16 GPUs (``--recompute
    auto``): its micro-batches are crowded (no marked sequence bounds them), so both layouts are
    built; the plan is no slower than with stage 1 pricing rings alone or with the marks alone. (Under
    the memory model without the loss's gradients the marks alone made this step 5.6% slower;
    with them both layouts tie here.)"""
    import importlib.util
    import types
    from pathlib import Path

    from zeppelin.planner.zeppelin import tiered

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compare.py"
    spec = importlib.util.spec_from_file_location("bench_compare", path)
    bc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bc)
    args = types.SimpleNamespace(seed=0, tokens_per_gpu=16384, max_seq_len=131072, steps=4)
    ctx, _, steps = bc.cell_steps("zeppelin-a", "llama-7b", 1, "short", 16, args, 1)
    assert ctx.num_units <= tiered.MARKS_ALONE_UNITS
    real, seen = tiered._rings_alone_too, []

    def spy(c, spans):
        seen.append((real(c, spans), any(sp.bounded for sp in spans.values()),
                     any(tiered._crowded(c, sp) for sp in spans.values())))
        return seen[-1][0]

    with monkeypatch.context() as m:
        m.setattr(tiered, "_rings_alone_too", spy)
        plan = ZeppelinPlanner().plan_step(ctx, 3, steps[3])
    assert seen and all(s == (True, False, True) for s in seen)   # crowded, not bounded: both layouts
    rings = ZeppelinPlanner(usp_spans="off").plan_step(ctx, 3, steps[3])
    sim = Simulator(ctx)
    with monkeypatch.context() as m:
        m.setattr(tiered, "MARKS_ALONE_UNITS", 0)
        alone = ZeppelinPlanner().plan_step(ctx, 3, steps[3])
        seen.clear()
        m.setattr(tiered, "_rings_alone_too", spy)
        ZeppelinPlanner().plan_step(ctx, 3, steps[3])
        assert seen and not any(s[0] for s in seen)                 # the rule off: the marks alone
    t = sim.simulate_step(plan).step_time_s
    assert t <= sim.simulate_step(rings).step_time_s * (1 + 1e-9)
    assert t <= sim.simulate_step(alone).step_time_s * (1 + 1e-9)


def test_a_marked_sequence_that_bounds_its_microbatch_competes_with_rings_alone():
    """512 GPUs, a light step (2 sequences per GPU, one micro-batch) whose 131K-token sequence bounds
    it: usp prices keep falling with the span, so stage 1's refined target and the span it chooses
    for that sequence are least sure there (a usp group of 64 units: the step 11% slower than with
    rings alone). A marked sequence above the balanced load makes the micro-batch be laid out with
    rings alone too: the step is planned as fast as stage 1 pricing rings alone plans it."""
    from zeppelin.planner.zeppelin import tiered

    cl = cluster_preset("zeppelin-c:64")
    ctx = PlanContext(cl, model_preset("llama-7b"), default_profile(cl.name))
    rng = np.random.default_rng(7)
    for _ in range(2):  # the second of two draws
        body = rng.lognormal(7.0, 1.0, 1024)
        tail = (rng.pareto(1.2, 1024) + 1.0) * 4096
        L = np.clip(np.where(rng.random(1024) < 0.1, tail, body).astype(np.int64), 16, 128 * 1024)
    seqs = [Sequence(sample_id=i, length=int(x)) for i, x in enumerate(L)]
    assert ctx.num_units > tiered.MARKS_ALONE_UNITS and max(L) == 131072
    plan = ZeppelinPlanner().plan_step(ctx, 1, seqs)
    rings = ZeppelinPlanner(usp_spans="off").plan_step(ctx, 1, seqs)
    sim = Simulator(ctx)
    assert sim.simulate_step(plan).step_time_s <= sim.simulate_step(rings).step_time_s * (1 + 1e-9)


def test_a_usp_layout_is_priced_from_its_ring_layouts_tokens(monkeypatch):
    """A usp layout's attention tokens per unit are its ring layout's, changed where its rings
    became usp groups alone: the tokens (and placements' groups) the conversion hands the memory
    check and the prediction equal those counted afresh, bit for bit - on a cluster whose ring
    layout is priced first (128 GPUs) and on one where it is not (320 GPUs: beyond
    ``MARKS_ALONE_UNITS`` units)."""
    from zeppelin.planner.costmodel.predict import attention_tokens, placement_groups
    from zeppelin.planner.zeppelin import tiered

    real = tiered.microbatch_terms
    seen = []

    def spy(ctx, lengths, mb, routed=True, pg=None, held=None):
        if held is not None:
            seen.append(np.array_equal(pg, placement_groups(mb))
                        and np.array_equal(held, attention_tokens(mb, ctx.num_units)))
        return real(ctx, lengths, mb, routed, pg=pg, held=held)

    monkeypatch.setattr(tiered, "microbatch_terms", spy)
    for nodes in (16, 40):
        cl = cluster_preset(f"zeppelin-c:{nodes}")
        ctx = PlanContext(cl, model_preset("llama-7b"), default_profile(cl.name))
        seen.clear()
        plan = ZeppelinPlanner().plan_step(ctx, 0, _mixed_step(8 * ctx.num_units, nodes))
        assert seen and all(seen), nodes
        assert any(g.kind == "usp" for mb in plan.microbatches for g in mb.groups), nodes
