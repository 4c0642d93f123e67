"""``plan --explain``: its ring thresholds against the simulator, one sequence per tier; the plan's
units by TP degree; whole-step families named where they split short sequences; MoE limits."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.zeppelin_steps import make_ctx
from zeppelin.planner.sim.simulate import Simulator
from zeppelin.planner.tools.explain import HIDDEN, explain_text, one_sequence_step, ring_crossover

# (G, tier, routed) per tier on a 2-node cluster of 8 GPUs per node
_TIERS = ((2, "intra", False), (8, "intra", False), (16, "inter", False), (16, "inter", True))


def _simulated_exposure(ctx, sim, L: int, G: int, tier: str, routed: bool) -> float:
    """The simulator's exposed ring communication of one sequence over its attention time."""
    r = sim.simulate_step(one_sequence_step(ctx, L, G, tier, routed))
    exposed = max(u.exposed_comm_s - r.allreduce_s for u in r.units)
    return exposed / max(u.attention_s for u in r.units)


@pytest.mark.parametrize("model", ["llama-7b", "llama3-8b"])
def test_thresholds_match_the_simulated_crossover(model):
    """Each tier's threshold (and the start of its exposed window) is the simulator's crossover of
    one sequence on that span within 10%; a tier said to hide at every length hides in the
    simulator at lengths from 2G to 1M tokens."""
    ctx = make_ctx("h100:2", model)
    sim = Simulator(ctx)
    seen = set()
    for G, tier, routed in _TIERS:
        x = ring_crossover(ctx, G, tier, routed)

        def ex(L, G=G, tier=tier, routed=routed):
            return _simulated_exposure(ctx, sim, int(L), G, tier, routed)

        if x.exposed_from is None:
            assert all(ex(L) <= HIDDEN for L in np.geomspace(2 * G, 1 << 20, 6)), (model, G, tier, routed)
            seen.add("every length")
            continue
        assert x.threshold is not None
        assert ex(0.9 * x.threshold) > HIDDEN and ex(1.1 * x.threshold) <= HIDDEN, (model, G, tier, routed, x)
        assert ex(2 * x.threshold) <= HIDDEN
        assert ex(1.1 * x.exposed_from) > HIDDEN and ex(0.9 * x.exposed_from) <= HIDDEN, (model, G, tier, routed, x)
        seen.add("window")
    assert seen == {"every length", "window"}  # both cases occur on these two models


def test_grouped_query_attention_hides_where_full_kv_does_not():
    """llama-7b (32 K/V heads) exposes a ring of 8 over NVLink between ~4K and ~8.4K tokens, where
    llama3-8b (8 K/V heads: a quarter of the bytes) hides at every length: below the kernels'
    efficiency knee a round's compute grows linearly with L, like its transfer, so the K/V bytes
    per token decide, not L. The explanation says so."""
    a = ring_crossover(make_ctx("h100:2", "llama-7b"), 8, "intra")
    b = ring_crossover(make_ctx("h100:2", "llama3-8b"), 8, "intra")
    assert 3_000 < a.exposed_from < a.threshold < 10_000 and a.worst < 0.05
    assert b.exposed_from is None and b.worst <= HIDDEN
    text = explain_text(make_ctx("h100:2", "llama-7b"))
    assert f"inside a node, 8 units, nvswitch 450 GB/s:   from {a.threshold:,} tokens" in text
    assert f"exposed {a.exposed_from:,} to {a.threshold - 1:,} tokens, up to 3% of attention time" in text
    flat = " ".join(text.split())
    assert "30 us launch cost per call, efficiency n/(n+1,024) of its peak" in flat
    assert "a model with fewer K/V heads (grouped-query attention) may hide at every length" in flat
    assert max(len(line) for line in text.splitlines()) <= 80


def test_units_of_larger_tp_degree_are_shown_with_their_gpus(tmp_path, zeppelin_bin):
    """A plan whose units are replicas of TP-8 and TP-4 (hydraulis): --explain and show print each
    unit's TP degree and GPUs, and compare a local sequence with the capacity of its own unit's
    degree (15,000 tokens whole on a TP-8 unit is no memory violation of a TP-1 unit)."""
    import json
    import subprocess

    from zeppelin.planner.core.base import PlanContext
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.profile import default_profile

    man = tmp_path / "m.jsonl"
    man.write_text("".join(json.dumps({"length": n}) + "\n" for n in (15_000, 3_000, 1_200, 900) * 4))
    plan = tmp_path / "p.jsonl"
    r = subprocess.run([zeppelin_bin, "plan", "-m", str(man), "-c", "zeppelin-a:2", "--model", "llama-13b",
                        "--planner", "hydraulis", "--steps", "1", "--tokens-per-step", "20100", "-o", str(plan),
                        "--explain"], capture_output=True, text=True, check=False, timeout=120,
                       env={"COLUMNS": "100", "PATH": ""})
    assert r.returncode == 0, r.stderr
    cl = cluster_preset("zeppelin-a:2")
    ctx = PlanContext(cl, model_preset("llama-13b"), default_profile(cl.name, cl.device))
    cap8 = int(ctx.cost_for(8).token_capacity)
    assert 15_000 < cap8 and int(ctx.cost.token_capacity) < 15_000
    assert "units of TP-1, 1 GPU each" in r.stdout  # the context's default unit
    assert "units: 1 TP-8 (8 GPUs each), 8 TP-1 (1 GPU each)" in r.stdout
    cap1 = int(ctx.cost.token_capacity)
    assert "whole on one unit: 5 sequences, up to 15,000\n" in r.stdout
    assert f"on TP-8 units: 1, up to 15,000 (one holds {cap8:,})" in r.stdout
    assert f"on TP-1 units: 4, up to 1,200 (one holds {cap1:,})" in r.stdout
    s = subprocess.run([zeppelin_bin, "show", str(plan)], capture_output=True, text=True, check=False, timeout=120,
                       env={"COLUMNS": "100", "PATH": ""})
    assert s.returncode == 0, s.stderr
    assert "--tp 1)" in s.stdout and "units: 1 TP-8 (8 GPUs each), 8 TP-1 (1 GPU each)" in s.stdout
    assert "GPUs  tokens" in s.stdout and "0  8 (TP-8)   15000" in s.stdout and "1  1 (TP-1)    1200" in s.stdout


def test_moe_limits_are_said_where_decisions_are_shown():
    """--explain, compare's verdict and the presets table state the MoE assumptions (no expert
    parallelism, experts evenly loaded) with the experts, top-k and active parameters."""
    from typer.testing import CliRunner

    from zeppelin.planner.cli import app
    from zeppelin.planner.tools.compare import verdict, verdict_lines
    from zeppelin.schemas.model import model_preset

    ctx = make_ctx("h100:1", "qwen3-30b-a3b")
    text = " ".join(explain_text(ctx).split())
    assert "MoE (128 experts, top-8): planned without expert parallelism" in text
    assert "experts evenly loaded" in text
    assert "MoE" not in explain_text(make_ctx("h100:1", "llama3-8b"))
    z = {"planner": "zeppelin", "error": None, "mean_s": 1.0, "lower_bound_mean_s": 0.9, "exposed_comm_s": 0.1,
         "exposed_sync_s": 0.05, "exposed_transfers_s": 0.05, "step_times_s": [1.0]}
    v = verdict({"planners": [z]}, ctx, [])
    flat = " ".join(" ".join(verdict_lines(v)).split())
    assert "MoE (128 experts, top-8): planned without expert parallelism" in flat
    assert all(len(ln) <= 80 for ln in verdict_lines(v))
    assert "MoE" not in " ".join(verdict_lines(verdict({"planners": [z]}, make_ctx("h100:1", "llama3-8b"), [])))
    m = model_preset("qwen3-30b-a3b")
    assert m.num_params() == pytest.approx(30.5e9, rel=0.01) and m.active_params() == pytest.approx(3.35e9, rel=0.01)
    assert model_preset("llama3-8b").active_params() == model_preset("llama3-8b").num_params()
    out = CliRunner().invoke(app, ["presets"], env={"COLUMNS": "80"}).output
    assert "qwen3-30b-a3b 128 experts, top-8, 3.35B of 30.53B parameters active per token" in " ".join(out.split())
    assert "planned without expert parallelism, experts evenly loaded" in " ".join(out.split())


def test_short_sequences_split_by_a_family_are_explained():
    """A 4,096-token sequence in a Ulysses group over two nodes and a 70,000-token one on a ring
    across nodes: --explain's plan lines break "split across nodes" down by group kind and say that a
    whole-step family split the short one (not a contradiction of the thresholds above it)."""
    from tests.planner.test_summary import _hand_step
    from zeppelin.planner.sim.summary import step_summary
    from zeppelin.planner.tools.explain import plan_against_thresholds
    from zeppelin.schemas.layout import zigzag_ranges
    from zeppelin.schemas.plan import Group, Placement, Sequence

    ctx, st = _hand_step("inter")
    mb = st.microbatches[0]
    ring = list(range(10, 16)) + [1, 2]  # two units of node 0 and six of node 1
    groups = [*mb.groups, Group(kind="ring", tier="inter", units=ring)]
    pls = [*mb.placements, Placement(seq=2, group=2, scheme="zigzag", ranges=zigzag_ranges(70_000, len(ring)))]
    queues = [q + ([2] if u in ring else []) for u, q in enumerate(mb.queues)]
    st = st.model_copy(update={"sequences": [*st.sequences, Sequence(sample_id=2, length=70_000)],
                               "microbatches": [mb.model_copy(update={"groups": groups, "placements": pls,
                                                                      "queues": queues})]})
    counts = step_summary(ctx, st)
    assert counts.by_kind == {("inter", "ulysses"): [1, 4096, 4096], ("inter", "ring"): [1, 70_000, 70_000],
                              ("local", "local"): [1, 500, 500]}
    lines = plan_against_thresholds(ctx, counts)
    text = "\n".join(lines)
    assert "  units: 16 TP-1 (1 GPU each)" in lines
    assert "  split across nodes: 2 sequences, 4,096 to 70,000" in lines
    assert "    in rings: 1, 70,000 to 70,000" in lines
    assert "    in Ulysses groups (heads split over the group): 1, 4,096 to 4,096" in lines
    assert "because a step took a whole-step family (Ulysses groups)" in " ".join(text.split())
    assert all(len(line) <= 80 for line in lines)


def test_verdict_says_when_the_baseline_named_could_not_plan():
    """`compare --baseline NAME` where NAME fails (a CP size that cannot hold the run's longest
    sequence): the verdict says so under the rows, in lines of at most 80 columns, and breaks the
    step down against the first baseline that planned (it used to fail on the missing figures)."""
    from zeppelin.planner.tools.compare import verdict, verdict_lines

    ctx = make_ctx("zeppelin-a:2", "llama-7b")
    z = {"planner": "zeppelin", "error": None, "mean_s": 1.0, "lower_bound_mean_s": 0.9, "exposed_comm_s": 0.1,
         "exposed_sync_s": 0.05, "exposed_transfers_s": 0.05, "step_times_s": [1.0]}
    u = dict(z, planner="ulysses", mean_s=1.5, step_times_s=[1.5])
    err = "step 0: te-cp: --max-seq-len 131072 does not fit even with cp=16 (8192 tokens per GPU, capacity 7967)"
    te = {"planner": "te-cp", "error": err}
    v = verdict({"planners": [te, u, z]}, ctx, [], baseline="te-cp")
    assert v["baseline_error"] == err and list(v["where"]) == ["zeppelin", "ulysses"]
    lines = verdict_lines(v)
    assert all(len(ln) <= 80 for ln in lines)
    assert f"te-cp (yours) could not plan these steps: {err}" in " ".join(" ".join(lines).split())


def test_explain_states_the_split_waste_the_planner_uses():
    """--explain states stage 1's compute-waste limit as the planner is set (-O split_waste), not
    the default."""
    from typer.testing import CliRunner

    from zeppelin.planner.cli import app

    def said(args):
        out = CliRunner().invoke(app, ["plan", "-c", "zeppelin-c", "--model", "llama-7b", "--explain", *args],
                                 env={"COLUMNS": "80"})
        assert out.exit_code == 0, out.output
        return " ".join(out.output.split())

    assert "together compute at most 15% more than one unit would; option split_waste" in said([])
    assert "together compute at most 30% more than one unit would; option split_waste" in said(
        ["-O", "split_waste=0.3"])
