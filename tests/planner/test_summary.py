"""One count of a plan: `zeppelin plan`'s summary, `show --all` and `simulate` print the same
sequences by tier, groups by kind and span, and inter-node traffic (planner/sim/summary.py), for
plans of every shape; tiers follow the units a group spans, and traffic is what the simulator
puts on the NICs."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from typer.testing import CliRunner

from zeppelin.planner.cli import app
from zeppelin.planner.sim.simulate import Simulator, context_from_header
from zeppelin.planner.sim.summary import PlanSummary, step_summary, summary_lines
from zeppelin.planner.tools.compare import mix_dataset
from zeppelin.schemas.plan import Group, MicroBatch, Placement, Sequence, StepPlan, read_plan

# (cluster, tp, planner, extra flags): multi-node rings (routed), FLOP-share and Ulysses-group
# family plans (groups spanning nodes), and baselines of every group kind
CASES = [
    ("zeppelin-a:2", 1, "zeppelin", []),
    ("zeppelin-c:4", 2, "zeppelin", ["--families", "none"]),
    ("zeppelin-c:4", 2, "zeppelin", ["--families", "ulysses-groups"]),
    ("zeppelin-c:4", 2, "zeppelin", ["--families", "flop-share"]),
    # ZeRO-3: with ZeRO-1 a CP group of 16 cannot hold a 131K-token sequence (the loss's gradients)
    ("zeppelin-a:2", 1, "te-cp", ["--zero-stage", "3"]),
    ("zeppelin-c:4", 2, "ulysses", []),
    ("zeppelin-c:4", 2, "flexsp", []),
    ("zeppelin-c:4", 2, "hydraulis", []),
    ("zeppelin-a:2", 1, "llama3-cp", []),
]
STEPS = 2


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    path = tmp_path_factory.mktemp("summary") / "mixed.jsonl"
    path.write_text("".join(f'{{"length": {int(n)}}}\n' for n in mix_dataset("mixed", 4000).lengths))
    return path


def _run(args: list[str]) -> str:
    r = CliRunner().invoke(app, args, env={"COLUMNS": "240"})
    assert r.exit_code == 0, (args, r.output, r.exception)
    return r.output


def _block(text: str, after: str | None = None) -> list[str]:
    """The summary lines (from "sequences by tier" to the traffic lines) after the line ``after``."""
    lines = text.splitlines()
    if after is not None:
        lines = lines[next(i for i, ln in enumerate(lines) if ln.startswith(after)) + 1:]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("sequences by tier: "))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("inter-node traffic: "))
    if end + 1 < len(lines) and lines[end + 1].startswith("  NICs: "):
        end += 1
    return [ln.rstrip() for ln in lines[start:end + 1]]


def _span(cluster, reps, units) -> str:
    """Where a group's attention runs, worked out here from first principles (GPU ranks -> nodes)."""
    nodes = {cluster.node_of(r) for u in units for r in reps[u]}
    return "inter" if len(nodes) > 1 else "intra" if len(units) > 1 else "local"


@pytest.mark.parametrize("cluster,tp,planner,extra", CASES, ids=[f"{c[2]}-{c[0]}-{'-'.join(c[3]) or 'default'}"
                                                                 for c in CASES])
def test_plan_show_and_simulate_report_the_same_counts(manifest, tmp_path, cluster, tp, planner, extra):
    from zeppelin.schemas.cluster import cluster_preset

    world = cluster_preset(cluster).world_size
    out = tmp_path / "p.jsonl"
    planned = _run(["plan", "--manifest", str(manifest), "-c", cluster, "--model", "llama-7b", "--tp", str(tp),
                    "--planner", planner, "--steps", str(STEPS), "--tokens-per-step", str(16384 * world),
                    "--max-seq-len", "131072", *extra, "-o", str(out)])
    shown = _run(["show", str(out), "--all"])
    simulated = _run(["simulate", str(out)])
    a, b, c = _block(planned), _block(shown, after="all 2 steps"), _block(simulated)
    assert a == b == c

    # independently: tiers from the units' GPU ranks, traffic from the simulation itself
    header, steps = read_plan(out)
    sim = Simulator(context_from_header(header))
    tiers: Counter = Counter()
    nic_total: Counter = Counter()
    for st in steps:
        reps = ([r.ranks for r in st.replicas] if st.replicas is not None else
                [list(range(u * tp, (u + 1) * tp)) for u in range(world // tp)])
        for mb in st.microbatches:
            for p in mb.placements:
                tiers[_span(header.cluster, reps, mb.groups[p.group].units)] += 1
        res = sim.simulate_step(st)
        loaded = {k: v.bytes for k, v in res.nics.items() if v.bytes > 0}
        for k, v in loaded.items():
            nic_total[k] += v
        counts = step_summary(sim.ctx, st, sim)
        assert counts.nic_bytes() == pytest.approx(loaded)
        step_text = "\n".join(summary_lines(counts))
        if loaded:  # a step whose simulation loads a NIC is never reported without inter-node traffic
            assert "inter-node traffic: none" not in step_text
        else:
            assert "inter-node traffic: none" in step_text
    assert a[0] == (f"sequences by tier: local {tiers['local']:,}, intra {tiers['intra']:,}, "
                    f"inter {tiers['inter']:,}")
    doc = json.loads(_run(["simulate", str(out), "--json"]))
    assert doc["counts"]["sequences_by_tier"] == {t: tiers[t] for t in ("local", "intra", "inter")}
    assert doc["counts"]["nic_bytes_per_step"] == pytest.approx({k: v / STEPS for k, v in nic_total.items()})
    # the per-step show output: a step with NIC traffic has its table, never "no inter-node traffic"
    for k, st in enumerate(steps):
        one = _run(["show", str(out), "--step", str(k)])
        busy = any(v.bytes > 0 for v in sim.simulate_step(st).nics.values())
        assert ("no inter-node traffic" in one) == (not busy)


def test_cases_cover_groups_across_nodes_of_every_kind(manifest, tmp_path):
    """The cases above do exercise what the summary must not miss: rings, Ulysses groups and
    routed rings spanning nodes."""
    kinds = set()
    for cluster, tp, planner, extra in CASES:
        if planner not in ("ulysses", "te-cp") and "none" not in extra:
            continue
        from zeppelin.schemas.cluster import cluster_preset

        world = cluster_preset(cluster).world_size
        out = tmp_path / f"{planner}.jsonl"
        _run(["plan", "--manifest", str(manifest), "-c", cluster, "--model", "llama-7b", "--tp", str(tp),
              "--planner", planner, "--steps", str(STEPS), "--tokens-per-step", str(16384 * world),
              "--max-seq-len", "131072", *extra, "-o", str(out), "-q"])
        header, steps = read_plan(out)
        ctx = context_from_header(header)
        total = PlanSummary()
        for st in steps:
            total.add(step_summary(ctx, st))
        kinds |= {k for (k, span), n in total.groups.items() if span == "inter" and n}
        if any(mb.routes for st in steps for mb in st.microbatches):
            kinds.add("routed")
    assert {"ring", "ulysses", "routed"} <= kinds


def _hand_step(tier_label: str) -> tuple:
    """A Ulysses group over units of two nodes whose label says ``tier_label``, plus a local group."""
    from zeppelin.planner.core.base import PlanContext
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.profile import default_profile

    ctx = PlanContext(cluster_preset("zeppelin-a:2"), model_preset("llama-7b"), default_profile())
    n = ctx.num_units
    units = [6, 7, 8, 9]  # 8 GPUs per node: two units on each node
    groups = [Group(kind="ulysses", tier=tier_label, units=units), Group(kind="local", tier="local", units=[0])]
    pls = [Placement(seq=0, group=0, scheme="contiguous", ranges=[[[i * 1024, (i + 1) * 1024]] for i in range(4)]),
           Placement(seq=1, group=1, ranges=[[[0, 500]]])]
    queues = [[] for _ in range(n)]
    for gi, g in enumerate(groups):
        for u in g.units:
            queues[u].append(gi)
    st = StepPlan(step=0, sequences=[Sequence(sample_id=0, length=4096), Sequence(sample_id=1, length=500)],
                  microbatches=[MicroBatch(groups=groups, placements=pls, queues=queues)])
    return ctx, st


def test_tier_follows_the_units_not_the_label():
    ctx, st = _hand_step("intra")
    s = step_summary(ctx, st)
    assert s.sequences == {"local": 1, "intra": 0, "inter": 1}
    assert s.groups == {("ulysses", "inter"): 1, ("local", "local"): 1}
    assert s.mislabeled == 1
    res = Simulator(ctx).simulate_step(st)
    assert s.nic_bytes() == pytest.approx({k: v.bytes for k, v in res.nics.items()})
    assert set(s.traffic) == {"ulysses"} and s.inter_node_bytes > 0
    text = "\n".join(summary_lines(s))
    assert "ulysses inter 1" in text and "labelled with another tier" in text
    assert "inter-node traffic: none" not in text


def test_summaries_merge_over_steps():
    ctx, st = _hand_step("inter")
    one = step_summary(ctx, st)
    two = PlanSummary().add(one).add(step_summary(ctx, st))
    assert two.steps == 2 and two.sequences == {"local": 2, "intra": 0, "inter": 2}
    assert two.inter_node_bytes == pytest.approx(2 * one.inter_node_bytes)
    d = two.to_dict()
    assert d["inter_node_bytes_per_step"] == pytest.approx(one.inter_node_bytes)
    assert d["length_range_by_tier"] == {"inter": [4096, 4096], "local": [500, 500]}
    assert two.mislabeled == 0


def test_a_ring_across_nodes_labelled_intra_is_counted_and_shown_as_inter(tmp_path):
    """A ring over units of two nodes whose label says "intra" (so no route is asked of it): show and
    simulate count it where it runs, and its NIC traffic is reported, not "no inter-node traffic"."""
    from tests.planner.test_simulate import _header, cluster, ring_step

    from zeppelin.schemas.plan import write_plan

    cl = cluster(nodes=2, gpn=2, nics=1, nic=10.0)
    st = ring_step(4096, [0, 2], tier="intra", n=4, extra_groups=[(1, 1000), (3, 3000)])
    path = tmp_path / "mislabelled.plan"
    write_plan(path, _header(cl), [st])
    shown, simulated = _run(["show", str(path)]), _run(["simulate", str(path)])
    assert _block(shown) == _block(simulated)
    block = "\n".join(_block(shown))
    assert "sequences by tier: local 2, intra 0, inter 1" in block and "ring inter 1" in block
    assert "inter-node traffic: none" not in block and "no inter-node traffic" not in shown
    row = next(ln.split() for ln in shown.splitlines() if "#0:4096" in ln)
    assert row[1:3] == ["inter", "ring"]
    res = Simulator(context_from_header(_header(cl))).simulate_step(st)
    assert sum(n.bytes for n in res.nics.values()) > 0


@pytest.mark.parametrize("most,counted", [(2, -(-STEPS // 2)), (64, STEPS)])
def test_plan_samples_the_traffic_on_large_clusters_and_says_so(manifest, tmp_path, monkeypatch, most, counted):
    """Beyond ``TRAFFIC_ALL_MAX_UNITS`` units ``plan`` counts the traffic of one step in
    ``ceil(units / TRAFFIC_ALL_MAX_UNITS)`` (the same steps on every run) and labels the traffic
    line as sampled; tiers and groups still count every step."""
    from zeppelin.planner.cli import plan as plan_cli

    monkeypatch.setattr(plan_cli, "TRAFFIC_ALL_MAX_UNITS", most)  # 4 units: every 2nd step, or all
    args = ["plan", "--manifest", str(manifest), "-c", "local-cpu:2x2", "--model", "tiny", "--steps", str(STEPS),
            "--tokens-per-step", "16384", "--max-seq-len", "4096", "-o", str(tmp_path / "p.jsonl")]
    planned = _block(_run(args))
    full = _block(_run(["simulate", str(tmp_path / "p.jsonl")]))
    def head(block):
        return block[:next(i for i, ln in enumerate(block) if ln.startswith("inter-node traffic: "))]

    assert head(planned) == head(full)  # tiers, lengths, groups, units: every step
    if counted < STEPS:
        line = next(ln for ln in planned if ln.startswith("inter-node traffic: "))
        assert line.endswith(f"(sampled: the traffic of {counted} of {STEPS} steps)"), line
    else:  # every step counted: the full count, not labelled
        assert planned[-2:] == full[-2:]
    doc = json.loads(_run([*args, "--json"]))
    assert doc["counts"].get("steps_with_traffic_counted", STEPS) == counted
    assert _block(_run(args)) == planned  # the same summary on every run


def test_sampled_traffic_is_averaged_over_the_counted_steps_and_labelled():
    ctx, st = _hand_step("inter")
    one = step_summary(ctx, st)
    skipped = step_summary(ctx, st, traffic={})
    skipped.traffic_steps = 0
    two = PlanSummary().add(one).add(skipped)
    assert (two.steps, two.counted_steps) == (2, 1)
    assert two.to_dict()["inter_node_bytes_per_step"] == pytest.approx(one.inter_node_bytes)
    assert two.to_dict()["steps_with_traffic_counted"] == 1
    line = next(ln for ln in summary_lines(two) if ln.startswith("inter-node traffic: "))
    assert line.endswith("(sampled: the traffic of 1 of 2 steps)")
    assert "steps_with_traffic_counted" not in PlanSummary().add(one).add(one).to_dict()
