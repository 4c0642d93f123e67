"""`zeppelin run --report`: measured vs predicted phases on a synthetic plan + metrics file
(hand-computed numbers), input errors, and profile -> plan -> run --report end to end."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from zeppelin.planner.sim.report import (
    build_report,
    error_summary,
    load_metrics,
    measured_phases,
    report_for_plan,
)
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.common import InputError, content_hash
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import (
    Group,
    InputHashes,
    MicroBatch,
    Placement,
    PlanHeader,
    Sequence,
    StepPlan,
    write_plan,
)
from zeppelin.schemas.profile import CostProfile, LinkCost, ModelFits, PolyFit

# A profile whose fits make every predicted time a hand calculation (seconds, per layer fwd+bwd):
#   attention t(L) = 1e-3 + 1e-6 L^2,  linear t(T) = 2e-3 + 1e-5 T,  head t(T) = 5e-3 + 2e-5 T,
#   AdamW step 0.04 s, gradient all-reduce over 2 units 0.03 s.
PROFILE = CostProfile(
    cluster="local-cpu",
    intra=LinkCost(alpha_s=1e-5, bandwidth_GBps=2.0),
    fits=[ModelFits(model="tiny", dtype="fp32", attention=PolyFit(coeffs=[1e-3, 0.0, 1e-6]),
                    linear=PolyFit(coeffs=[2e-3, 1e-5]), head=PolyFit(coeffs=[5e-3, 2e-5]),
                    optimizer_s=0.04, grad_allreduce_s={"2": 0.03})],
)


def _header(num_steps: int) -> PlanHeader:
    cluster, model = cluster_preset("local-cpu:1x2"), model_preset("tiny")
    hashes = InputHashes(cluster=content_hash(cluster), model=content_hash(model),
                         profile=content_hash(PROFILE), manifest="synthetic")
    # ZeRO-0 (``--dp replicate``): the one gradient all-reduce per step the profile measured (under
    # FSDP the plan would pay FSDP's collectives per micro-batch instead)
    return PlanHeader(planner="hand", num_steps=num_steps, world_size=2, cluster=cluster, model=model,
                      profile=PROFILE, hashes=hashes, zero_stage=0)


def _step(k: int) -> StepPlan:
    """Unit 0 runs sequences of 100 and 50 tokens locally, unit 1 one of 200 tokens."""
    seqs = [Sequence(sample_id=3 * k + i, length=L) for i, L in enumerate([100, 50, 200])]
    mb = MicroBatch(groups=[Group(kind="local", tier="local", units=[0]),
                            Group(kind="local", tier="local", units=[1])],
                    placements=[Placement(seq=0, group=0, ranges=[[[0, 100]]]),
                                Placement(seq=1, group=0, ranges=[[[0, 50]]]),
                                Placement(seq=2, group=1, ranges=[[[0, 200]]])],
                    queues=[[0], [1]])
    return StepPlan(step=k, sequences=seqs, microbatches=[mb])


def _record(k: int, step_times: list[float]) -> dict:
    return {"step": k, "loss": 5.0, "sequences": 3, "tokens": 350, "step_time_s": max(step_times),
            "phases_s": {"data": [0.001, 0.001], "forward": [0.05, 0.05], "backward": [0.1, 0.1],
                         "attention": [0.07, 0.09], "remap": [0.0, 0.0], "linear": [0.02, 0.018],
                         "grad_allreduce": [0.06, 0.025], "optimizer": [0.05, 0.045], "step": step_times}}


# Hand calculation (2 layers):
#   unit 0: attention 2 x [(1e-3 + 1e-2) + (1e-3 + 2.5e-3)] = 0.029
#           linear    2 x (2e-3 + 1.5e-3) + head (5e-3 + 3e-3) = 0.015
#   unit 1: attention 2 x (1e-3 + 4e-2) = 0.082
#           linear    2 x (2e-3 + 2e-3) + head (5e-3 + 4e-3) = 0.017
#   simulated step = max(0.029 + 0.015, 0.082 + 0.017) + all-reduce 0.03 = 0.129; + optimizer 0.04 = 0.169
EXPECTED = {"attention": 0.082, "remap": 0.0, "linear": 0.017, "grad_allreduce": 0.03, "optimizer": 0.04,
            "step": 0.169}


def test_report_matches_hand_calculation(tmp_path):
    plan = tmp_path / "plan.jsonl"
    write_plan(plan, _header(2), [_step(0), _step(1)])
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps(_record(0, [0.18, 0.2])) + "\n"
                       + json.dumps(_record(1, [0.16, 0.15])) + "\n")
    rep = report_for_plan(plan, metrics)
    assert rep["predictor"] == "simulator" and rep["tp_overlap"] == "none"
    assert [r["step"] for r in rep["steps"]] == [0, 1]
    assert rep["steps"][0]["first"] and not rep["steps"][1]["first"]
    for r in rep["steps"]:
        for ph, v in EXPECTED.items():
            assert r["predicted_s"][ph] == pytest.approx(v, abs=1e-12), ph
    # measured: slowest rank per phase, except the all-reduce (the rank that arrived last waited least)
    m0 = rep["steps"][0]["measured_s"]
    assert m0 == {"attention": 0.09, "remap": 0.0, "linear": 0.02, "grad_allreduce": 0.025, "optimizer": 0.05,
                  "step": 0.2}
    e0, e1 = (0.169 - 0.2) / 0.2, (0.169 - 0.16) / 0.16
    assert rep["steps"][0]["rel_error"]["step"] == pytest.approx(e0)
    assert rep["steps"][1]["rel_error"]["step"] == pytest.approx(e1)
    assert rep["steps"][0]["rel_error"]["attention"] == pytest.approx((0.082 - 0.09) / 0.09)
    assert rep["steps"][0]["rel_error"]["remap"] is None  # nothing measured: no relative error
    s = rep["summary"]["step"]
    assert s["steps"] == 2
    assert s["median_abs"] == pytest.approx((abs(e0) + abs(e1)) / 2)
    assert s["worst_abs"] == pytest.approx(abs(e0))
    assert s["mean"] == pytest.approx((e0 + e1) / 2)
    assert rep["summary"]["step_after_first"]["median_abs"] == pytest.approx(e1)
    assert rep["summary"]["phases"]["remap"]["steps"] == 0
    json.dumps(rep)  # serialisable as written by --report-json
    # printed in 80 columns: the step table, then the phases' medians (the per-step phases are in the JSON)
    import io

    from rich.console import Console

    from zeppelin.planner.sim.report import render

    con = Console(file=io.StringIO(), width=80, color_system=None)
    render(rep, con)
    text = con.file.getvalue()
    assert all(len(ln.rstrip()) <= 80 for ln in text.splitlines()), text
    step1 = next(ln.split() for ln in text.splitlines() if ln.split()[:1] == ["1"])
    assert step1 == ["1", "160.0", "169.0", f"{e1:+.1%}", "-"]  # (the synthetic plan carries no estimate)
    attn = next(ln.split() for ln in text.splitlines() if ln.split()[:1] == ["attention"])
    meas = sorted(r["measured_s"]["attention"] for r in rep["steps"])
    assert attn[1:3] == [f"{sum(meas) / 2 * 1e3:.1f}", "82.0"]  # medians of the measured and predicted attention
    remap = next(ln.split() for ln in text.splitlines() if ln.split()[:1] == ["remap"])
    assert remap[-1] == "(tiny)"  # a phase of ~0 ms: no relative error of a near-zero time
    assert "(tiny): the phase takes under 1% of the step; its relative error is not shown" in text


def test_resumed_metrics_skip_and_duplicates(tmp_path):
    metrics = tmp_path / "m.jsonl"
    lines = [_record(0, [0.3, 0.3]), _record(1, [0.2, 0.2]), _record(1, [0.25, 0.1])]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    recs = load_metrics(metrics)
    assert [r["step"] for r in recs] == [0, 1] and recs[1]["step_time_s"] == 0.25  # the later record wins
    recs = load_metrics(metrics, skip=2)
    assert len(recs) == 1 and measured_phases(recs[0])["step"] == 0.25


def test_error_summary_by_hand():
    s = error_summary([0.1, -0.3, 0.05, None])
    assert s == {"steps": 3, "median_abs": pytest.approx(0.1), "worst_abs": pytest.approx(0.3),
                 "mean": pytest.approx(-0.05)}
    assert error_summary([])["median_abs"] is None


def test_bad_metrics_and_mismatched_steps(tmp_path):
    plan = tmp_path / "plan.jsonl"
    write_plan(plan, _header(1), [_step(0)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_record(0, [0.1, 0.1])) + "\n{oops\n")
    with pytest.raises(InputError, match=r"line 2 is not JSON"):
        load_metrics(bad)
    other = tmp_path / "other.jsonl"
    other.write_text('{"step": 0}\n')
    with pytest.raises(InputError, match="line 1 is not a zeppelin run metrics record"):
        load_metrics(other)
    far = tmp_path / "far.jsonl"
    far.write_text(json.dumps(_record(5, [0.1, 0.1])) + "\n")
    with pytest.raises(InputError, match="metrics record for step 5, but the plan has 1 steps"):
        report_for_plan(plan, far)
    with pytest.raises(InputError, match="metrics file not found"):
        load_metrics(tmp_path / "missing.jsonl")
    with pytest.raises(InputError, match="metrics record for step 3, which the plan does not have"):
        build_report(_header(1), {0: _step(0)}, [_record(3, [0.1, 0.1])])


def test_run_cli_rejects_bad_report_options(zeppelin_bin, tmp_path):
    plan = tmp_path / "plan.jsonl"
    write_plan(plan, _header(1), [_step(0)])
    r = subprocess.run([zeppelin_bin, "run", str(plan), "--tp-overlap", "fast"], capture_output=True,
                       text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "zeppelin: error: --tp-overlap must be none, slicing or commfuse (got 'fast')"
    r = subprocess.run([zeppelin_bin, "run", str(plan), "--report-json", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "--report-json is a directory" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_profile_plan_run_report_end_to_end(zeppelin_bin, tmp_path):
    """A fresh machine: profile (2 gloo ranks, tiny model) -> plan with the profile -> run --report."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    prof = tmp_path / "prof.json"
    r = subprocess.run([zeppelin_bin, "profile", "--quick", "--nproc", "2", "--model", "tiny",
                        "-o", str(prof)], capture_output=True, text=True, timeout=200, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    man = tmp_path / "lens.jsonl"
    lens = [300, 40, 90, 16, 200, 60, 120, 30] * 4
    man.write_text("".join(json.dumps({"length": L}) + "\n" for L in lens))
    plan = tmp_path / "plan.jsonl"
    r = subprocess.run([zeppelin_bin, "plan", "--cluster", "local-cpu:1x2", "--model", "tiny",
                        "--profile", str(prof), "--manifest", str(man), "--tokens-per-step", "600",
                        "--steps", "2", "--families", "none", "-q", "-o", str(plan)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rep_json = tmp_path / "rep.json"
    r = subprocess.run([zeppelin_bin, "run", str(plan), "--progress", "none",
                        "--report-json", str(rep_json)],
                       capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "measured vs predicted (simulator)" in r.stdout
    assert "predicted step time: relative error median" in r.stdout
    rep = json.loads(rep_json.read_text())
    assert "measured on" in rep["profile"]  # the plan carries the measured profile
    assert [s["step"] for s in rep["steps"]] == [0, 1]
    for s in rep["steps"]:
        assert s["measured_s"]["step"] > 0 and s["predicted_s"]["step"] > 0
        assert s["predicted_s"]["optimizer"] > 0 and s["predicted_s"]["grad_allreduce"] > 0  # profiled terms
        assert s["rel_error"]["step"] == pytest.approx(
            (s["predicted_s"]["step"] - s["measured_s"]["step"]) / s["measured_s"]["step"])
    # the summary is the steps' own errors: worst |error|, median |error| and mean, recomputed here
    errs = [s["rel_error"]["step"] for s in rep["steps"]]
    summary = rep["summary"]["step"]
    assert summary["steps"] == 2
    assert summary["worst_abs"] == pytest.approx(max(abs(e) for e in errs), rel=1e-12)
    assert summary["median_abs"] == pytest.approx(sum(abs(e) for e in errs) / 2, rel=1e-12)
    assert summary["mean"] == pytest.approx(sum(errs) / 2, rel=1e-12)
    metrics = Path(str(plan).removesuffix(".jsonl") + ".metrics.jsonl")
    assert len(metrics.read_text().splitlines()) == 2


def test_measured_points_correct_the_polynomial():
    """Profiles keep their measurements: the cost model follows them exactly, uses the
    polynomial's shape between them (log-interpolated correction) and below them, and beyond the
    largest grows the last measurement as the kernel's work (``n`` or ``n^2``)."""
    from zeppelin.planner.costmodel.cost import CostModel, eval_fit

    # measured: 2x the polynomial at 100 tokens, exactly the polynomial at 200
    fit = PolyFit(coeffs=[1e-3, 0.0, 1e-6], points=[[100.0, 0.022], [200.0, 0.041]])
    n = [50.0, 100.0, 200.0 ** 0.5 * 100.0 ** 0.5, 200.0, 400.0]
    want = [2 * (1e-3 + 2.5e-3), 0.022, 1.5 * (1e-3 + 1e-6 * 20000.0), 0.041, 0.041 * 4.0]
    assert eval_fit(fit, n, 2) == pytest.approx(want, rel=1e-9)
    assert eval_fit(fit, [400.0, 800.0], 1) == pytest.approx([0.082, 0.164], rel=1e-9)
    assert eval_fit(fit.model_copy(update={"points": None}), 100.0, 2) == pytest.approx(0.011)
    prof = PROFILE.model_copy(update={"fits": [PROFILE.fits[0].model_copy(update={"attention": fit})]})
    cm = CostModel(cluster_preset("local-cpu:1x2"), model_preset("tiny"), prof)
    assert float(cm.attn_time(100)) == pytest.approx(0.022) and float(cm.attn_time(0)) == 0.0


def test_ring_blocks_use_the_measured_block_fit():
    """Off-diagonal ring blocks (every key visible) are timed with the profile's block fit at the
    block's geometric-mean size; causal blocks keep the whole-sequence attention fit."""
    from zeppelin.planner.costmodel.cost import CostModel

    block = PolyFit(coeffs=[2e-4, 0.0, 3e-7])
    prof = PROFILE.model_copy(update={"fits": [PROFILE.fits[0].model_copy(update={"attention_block": block})]})
    cm = CostModel(cluster_preset("local-cpu:1x2"), model_preset("tiny"), prof)
    assert float(cm.attn_block_time(100, 400, causal=False)) == pytest.approx(2e-4 + 3e-7 * 100 * 400)
    assert float(cm.attn_block_time(100, 100, causal=True)) == pytest.approx(1e-3 + 1e-6 * 100 * 100)
    assert float(cm.attn_block_time(0, 400, causal=False)) == 0.0


def test_memory_table_by_component_fits_80_columns():
    """The report's memory table: predicted vs measured per component (the plan's predicted total
    fixes the tokens held, the cost model splits it), the error's sign explained, 80 columns."""
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.planner.sim.report import memory_components, memory_table

    cost = CostModel(cluster_preset("local-cpu:1x4"), model_preset("small"), zero_stage=3, recompute="full")
    pred = {k: float(v) for k, v in cost.memory_components(1000).items()}
    total = sum(pred.values())
    mem = {"params_bytes": [int(pred["params"])], "grads_bytes": [int(pred["grads"])],
           "optimizer_bytes": [int(pred["optimizer"])], "unsharded_bytes": [int(pred["unsharded"])],
           "activation_bytes": [int(pred["activations"] * 1.25)], "recompute_bytes": [int(pred["recompute"])]}
    comp = memory_components(mem, 0, total, cost)
    assert comp["tokens"] == pytest.approx(1000)
    lines = memory_table(comp)
    assert all(len(line) <= 80 for line in lines)
    act = next(line for line in lines if line.strip().startswith("activations"))
    assert act.split()[-1] == "-20.0%"           # (p - m) / m with m = 1.25 p
    assert "+ over-predicts, - under" in lines[-1]
    assert memory_components(mem, 0, None, cost) is None
