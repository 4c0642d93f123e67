"""`zeppelin compare`: length mixes, per-planner statistics, speedups, failures, CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from zeppelin.planner.core.base import PlanContext, get_planner
from zeppelin.planner.sim.simulate import Simulator
from zeppelin.planner.tools.compare import comparison, mix_dataset, resolve_dataset, run_compare
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.common import InputError
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Sequence
from zeppelin.schemas.profile import default_profile

ROOT = Path(__file__).resolve().parents[2]


def test_mixes_are_deterministic_and_ordered():
    a, b = mix_dataset("short", 5000, seed=3), mix_dataset("short", 5000, seed=3)
    assert np.array_equal(a.lengths, b.lengths)
    med = {m: float(np.median(mix_dataset(m, 5000).lengths)) for m in ("short", "mixed", "long")}
    assert med["short"] < med["mixed"] < med["long"]
    assert resolve_dataset("mix:long").source == "mix:long"
    with pytest.raises(InputError, match=r"^unknown length mix 'huge' \(known: short, mixed, long, longtail\)$"):
        resolve_dataset("mix:huge")


def _ctx():
    return PlanContext(cluster_preset("zeppelin-a:2"), model_preset("llama-7b"), default_profile())


def _steps():
    rng = np.random.default_rng(5)
    return [[Sequence(sample_id=i, length=int(x)) for i, x in enumerate(rng.integers(200, 6000, 40))] for _ in range(2)]


def test_run_compare_matches_direct_planning_and_simulation():
    ctx, steps = _ctx(), _steps()
    runs = run_compare(ctx, steps, ["te-cp", "packed-dp"], workers=1)
    sim = Simulator(ctx)
    for run in runs:
        assert run.error is None
        want = [sim.simulate_step(get_planner(run.planner).plan_step(ctx, k, s)).step_time_s
                for k, s in enumerate(steps)]
        assert run.step_times == pytest.approx(want, rel=1e-12)
    doc = comparison(runs)
    te, pk = doc["planners"]
    assert te["speedup_vs_te_cp"] == pytest.approx(1.0)
    assert pk["speedup_vs_te_cp"] == pytest.approx(np.mean(runs[0].step_times) / np.mean(runs[1].step_times))
    assert pk["p90_s"] >= pk["p50_s"] > 0


def test_comparison_reports_against_faithful_and_tuned_te_cp():
    """compare's reference is the faithful te-cp (one CP size for the run); te-cp-tuned is shown beside it."""
    ctx, steps = _ctx(), _steps()
    ctx.max_seq_len = 32768
    runs = run_compare(ctx, steps, ["te-cp", "te-cp-tuned", "zeppelin"], workers=1)
    doc = comparison(runs)
    te, tuned, z = (np.mean(r.step_times) for r in runs)
    assert doc["reference"] == "te-cp" and doc["references"] == ["te-cp", "te-cp-tuned"]
    assert doc["zeppelin_speedup_vs_te_cp"] == pytest.approx(te / z)
    assert doc["zeppelin_speedup_vs_te_cp_tuned"] == pytest.approx(tuned / z)
    assert doc["planners"][1]["speedup_vs_te_cp"] == pytest.approx(te / tuned)
    assert tuned < te  # on these steps the per-step size (chosen by prediction) is also faster when simulated


def test_run_compare_reports_failing_planner():
    ctx = _ctx()
    cap = ctx.cost.token_capacity
    steps = [[Sequence(sample_id=0, length=cap * 3), Sequence(sample_id=1, length=100)]]
    runs = run_compare(ctx, steps, ["packed-dp", "te-cp"], workers=1)
    assert runs[0].error is not None and runs[0].error.startswith("step 0: ")
    assert "does not fit" in runs[0].error
    assert runs[1].error is None
    with pytest.raises(InputError, match="unknown planner 'nope'"):
        run_compare(ctx, steps, ["nope"])


def test_cli_compare_json(zeppelin_bin, tmp_path):
    png = tmp_path / "c.png"
    out = subprocess.run([zeppelin_bin, "compare", "--steps", "2", "--planners", "te-cp,packed-dp,hybrid-dp",
                          "--dataset", "short", "--tokens-per-gpu", "4096", "--max-seq-len", "7680", "--json", "--png", str(png), "-j", "2"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [p["planner"] for p in doc["planners"]] == ["te-cp", "packed-dp", "hybrid-dp"]
    assert doc["world_size"] == 16 and doc["tokens_per_step"] == 16 * 4096
    for p in doc["planners"]:
        assert p["error"] is None and len(p["step_times_s"]) == 2
    assert png.read_bytes()[:4] == b"\x89PNG"
    out = subprocess.run([zeppelin_bin, "compare", "--planners", "te-cp,bogus"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 2
    assert out.stderr.startswith("zeppelin: error: unknown planner 'bogus' (known: ")
    out = subprocess.run([zeppelin_bin, "compare", "--steps", "0"], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == "zeppelin: error: --steps must be at least 1 (got 0)"


# ------------------------------------------------------------------ zeppelin check
REPO_PLANS = ROOT / "plans"
CPU = "cpu2x2-tiny-sample"


def _copy_cases(dst, names, goldens=True):
    import shutil

    for n in names:
        shutil.copy(REPO_PLANS / f"{n}.json", dst / f"{n}.json")
        if goldens:
            shutil.copy(REPO_PLANS / f"{n}.plan", dst / f"{n}.plan")


def _golden_mean(path):
    from zeppelin.planner.sim.simulate import simulate_plan

    _, res = simulate_plan(path)
    return float(np.mean([r.step_time_s for r in res]))


@pytest.mark.timeout(120)
def test_check_passes_on_repo_plans(zeppelin_bin):
    """The test command runs the CI regression check over the repository's golden plans."""
    out = subprocess.run([zeppelin_bin, "check", str(REPO_PLANS), "-j", "2"], capture_output=True, text=True,
                         check=False, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    cases = sorted(REPO_PLANS.glob("*.json"))
    assert len(cases) >= 8
    assert out.stdout.rstrip().splitlines()[-1].startswith(f"{len(cases)} case(s) checked in ")
    assert out.stdout.rstrip().endswith(": passed")
    # every setting with a zeppelin case compares it with each of its baselines
    zcases = [c.stem for c in cases if c.stem.endswith("--zeppelin")]
    assert zcases and all(f"ok: {z} " in out.stdout for z in zcases)
    assert "FAIL" not in out.stdout


def test_check_fails_when_zeppelin_is_made_worse(tmp_path, monkeypatch, capsys):
    """Zeppelin replaced by plain token packing: the golden comparison and the baseline check fail."""
    from zeppelin.planner.cli import main
    from zeppelin.planner.core.base import get_planner
    from zeppelin.planner.tools.check import run_check
    from zeppelin.planner.zeppelin.planner import ZeppelinPlanner

    names = [f"{CPU}--{p}" for p in ("zeppelin", "te-cp-tuned", "hybrid-dp", "packed-dp")]
    _copy_cases(tmp_path, names)
    assert run_check(tmp_path).failures == []  # the copy passes as is

    def worse(self, ctx, step, seqs):
        return get_planner("packed-dp").plan_step(ctx, step, seqs)

    monkeypatch.setattr(ZeppelinPlanner, "plan_step", worse)
    rep = run_check(tmp_path, workers=1)
    golden = _golden_mean(tmp_path / f"{CPU}--zeppelin.plan")
    now = _golden_mean(tmp_path / f"{CPU}--packed-dp.plan")  # what the worse planner now produces
    assert now > golden * 1.03
    zc = f"{CPU}--zeppelin"
    assert rep.failures[0].startswith(f"{zc}: zeppelin mean step time {now * 1e3:.2f} ms is "
                                      f"{(now / golden - 1) * 100:+.2f}% against the golden {golden * 1e3:.2f} ms "
                                      f"(tolerance 3%); worst step ")
    assert rep.failures[0].endswith("; same inputs and options: the planner's code changed")
    te = _golden_mean(tmp_path / f"{CPU}--te-cp-tuned.plan")
    assert (f"{zc}: zeppelin ({now * 1e3:.2f} ms) no longer beats te-cp-tuned ({te * 1e3:.2f} ms, case "
            f"{CPU}--te-cp-tuned)") in rep.failures
    assert not any("packed-dp (" in f for f in rep.failures)  # equal to packed-dp still counts as beating it
    assert len(rep.failures) == 3  # golden, te-cp-tuned, hybrid-dp
    # the CLI exits 1 and names the case
    with pytest.raises(SystemExit) as e:
        main(["check", str(tmp_path), "-j", "1"])
    assert e.value.code == 1
    out = capsys.readouterr().out
    assert " ".join(f"FAIL {rep.failures[0]}".split()) in " ".join(out.split())  # (wrapped at 80 columns)
    assert out.rstrip().endswith("4 case(s) checked in " + out.rstrip().split("checked in ")[1].split(":")[0]
                                 + ": 3 failure(s)")


def test_check_reports_invalid_plan(tmp_path, monkeypatch):
    from zeppelin.planner.core.base import get_planner
    from zeppelin.planner.tools.check import run_check
    from zeppelin.planner.zeppelin.planner import ZeppelinPlanner

    _copy_cases(tmp_path, [f"{CPU}--zeppelin"])

    def broken(self, ctx, step, seqs):
        sp = get_planner("packed-dp").plan_step(ctx, step, seqs)
        sp.microbatches[0].placements.pop()  # one sequence is no longer computed anywhere
        return sp

    monkeypatch.setattr(ZeppelinPlanner, "plan_step", broken)
    rep = run_check(tmp_path)
    assert len(rep.failures) == 1
    assert rep.failures[0].startswith(f"{CPU}--zeppelin: invalid plan: coverage: step 0: sequence ")
    assert rep.failures[0].endswith(" has no attention placement")
    golden = (tmp_path / f"{CPU}--zeppelin.plan").read_bytes()
    rep = run_check(tmp_path, update=True)  # an invalid plan is never written as a golden
    assert len(rep.failures) == 1 and not rep.results[0].written
    assert (tmp_path / f"{CPU}--zeppelin.plan").read_bytes() == golden


def test_check_update_writes_goldens_and_detects_stale(tmp_path, zeppelin_bin):
    names = [f"{CPU}--te-cp", f"{CPU}--packed-dp"]
    _copy_cases(tmp_path, names, goldens=False)
    run = lambda *a: subprocess.run([zeppelin_bin, "check", str(tmp_path), "-j", "1", *a],
                                    capture_output=True, text=True, check=False)
    out = run()
    assert out.returncode == 1
    assert (f"FAIL {CPU}--te-cp: no golden plan {CPU}--te-cp.plan (create it with `zeppelin check --update`)"
            in " ".join(out.stdout.split()))
    out = run("--update")
    assert out.returncode == 0, out.stdout + out.stderr
    for n in names:
        g = tmp_path / f"{n}.plan"
        mean = _golden_mean(g)
        assert f"updated {n}.plan: step time none -> {mean * 1e3:.2f} ms" in out.stdout
        assert g.read_text().startswith("{\n")  # pretty format
    before = {n: (tmp_path / f"{n}.plan").read_bytes() for n in names}
    out = run("--update")
    assert out.returncode == 0 and "updated " not in out.stdout and out.stdout.count("unchanged") == 2
    assert {n: (tmp_path / f"{n}.plan").read_bytes() for n in names} == before
    out = run("--json")
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["passed"] is True
    assert [c["change"] for c in doc["cases"]] == [0.0, 0.0]
    # the setting changes (another seed): the golden no longer matches and must be reviewed
    case = tmp_path / f"{CPU}--te-cp.json"
    spec = json.loads(case.read_text())
    spec["seed"] = 7
    case.write_text(json.dumps(spec))
    out = run()
    assert out.returncode == 1
    assert (f"FAIL {CPU}--te-cp: golden plan {CPU}--te-cp.plan is stale (made with other sampler settings); "
            f"review the change and run `zeppelin check --update`") in " ".join(out.stdout.split())
    out = run("--update", "-k", f"{CPU}--te-cp")
    assert out.returncode == 0
    assert f"updated {CPU}--te-cp.plan: step time none -> " in out.stdout


def test_check_bad_input(tmp_path, zeppelin_bin):
    def run(*a):
        return subprocess.run([zeppelin_bin, "check", *a], capture_output=True, text=True, check=False)

    out = run(str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip() == f"zeppelin: error: {tmp_path}: no check cases (*.json) in this directory"
    out = run(str(tmp_path / "nope"))
    assert out.returncode == 2 and out.stderr.strip() == f"zeppelin: error: {tmp_path / 'nope'}: directory not found"
    bad = tmp_path / "x.json"
    bad.write_text("{")
    out = run(str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"zeppelin: error: {bad}: malformed JSON at line 1 column 2: "
                                  "Expecting property name enclosed in double quotes")
    spec = json.loads((REPO_PLANS / f"{CPU}--te-cp.json").read_text())
    bad.write_text(json.dumps({**spec, "tolerance": -1}))
    out = run(str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"zeppelin: error: {bad}: invalid check case: tolerance: "
                                  "Input should be greater than or equal to 0")
    bad.write_text(json.dumps({**spec, "planner": "bogus"}))
    out = run(str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.startswith(f"zeppelin: error: {bad}: unknown planner 'bogus' (known: ")
    bad.write_text(json.dumps({**spec, "cluster": "nosuch"}))
    out = run(str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.startswith("zeppelin: error: x: bad input: ")
    assert "nosuch" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    bad.write_text(json.dumps(spec))
    out = run(str(tmp_path), "-k", "y")
    assert out.returncode == 2 and out.stderr.strip() == f"zeppelin: error: no case 'y' in {tmp_path} (cases: x)"
    assert not list(tmp_path.glob("*.plan"))


def test_regressed_threshold():
    from zeppelin.planner.tools.check import regressed

    assert not regressed(1.0, 1.03, 0.03)
    assert regressed(1.0, 1.0301, 0.03)
    assert not regressed(2.0, 1.5, 0.0)
    assert regressed(2.0, 2.000001, 0.0)


def test_check_golden_from_another_profile_is_compared_not_stale(tmp_path):
    """A changed cost profile (e.g. a new optional field) re-simulates both plans with the current one."""
    from zeppelin.planner.tools.check import run_check
    from zeppelin.schemas.common import content_hash
    from zeppelin.schemas.plan import read_plan, write_plan

    name = f"{CPU}--te-cp"
    _copy_cases(tmp_path, [name])
    g = tmp_path / f"{name}.plan"
    h, steps = read_plan(g)
    prof = h.profile.model_copy(update={"memory_reserved_gb": h.profile.memory_reserved_gb + 1.0})
    h = h.model_copy(update={"profile": prof, "hashes": h.hashes.model_copy(update={"profile": content_hash(prof)})})
    write_plan(g, h, steps, fmt="pretty")
    rep = run_check(tmp_path)
    assert rep.failures == []
    assert rep.results[0].notes == [(f"{name}: the golden plan was made with another cost profile; both plans are "
                                    f"simulated with the current one")]
    assert rep.results[0].change == 0.0


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "benchmarks" / "bench_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_page_findings_from_cells():
    """The RESULTS.md statements are computed from the cells: hand-made cells with known answers."""
    bc = _bench_module()

    def cell(cluster, mix, gpus, te, z, fl, ul, te_exposed, te_spans):
        def st(name, mean, exposed=0.0, spans=0):
            return {"planner": name, "error": None, "mean_s": mean, "exposed_comm_s": exposed,
                    "speedup_vs_te_cp": te / mean, "predicted_mean_s": mean, "steps_spanning_nodes": spans,
                    "lower_bound_mean_s": 2.0}
        planners = [st("te-cp", te, te_exposed, te_spans), st("zeppelin", z), st("flexsp", fl), st("ulysses", ul)]
        best = min(planners[2:], key=lambda s: s["mean_s"])
        return {"cluster": cluster, "mix": mix, "gpus": gpus, "planners": planners,
                "zeppelin_speedup_vs_te_cp": te / z, "best_baseline": best["planner"],
                "zeppelin_speedup_vs_best_baseline": best["mean_s"] / z}

    cells = []
    # A: NICs slower relative to compute (the lower compute-to-network time ratio), the larger advantage;
    # te-cp spans nodes on A (exposed 6 of 10 s), stays inside a node on C (exposed 1 s)
    for cl, k, exp, spans in (("zeppelin-a", 1.5, 6.0, 2), ("zeppelin-c", 1.0, 1.0, 0)):
        for mix, m in (("short", 3.0), ("mixed", 2.0), ("long", 1.2)):
            for g in bc.GPUS:
                cells.append(cell(cl, mix, g, te=10.0, z=10.0 / (k * m), fl=8.0, ul=9.0, te_exposed=exp,
                                  te_spans=spans))
    summ, lines = bc.findings(cells)
    assert summ["zeppelin_vs_te_cp_by_mix"]["short"] == pytest.approx(3.0 * np.sqrt(1.5))
    ratio = summ["compute_to_network_tflops_per_GBps"]
    assert ratio["A"] == pytest.approx(4 * 25.0 / (8 * 312.0)) and ratio["A"] < ratio["C"]
    assert lines[0].endswith("-> **holds** in this run.")
    assert "lower: A," in lines[1] and lines[1].endswith("-> **holds** in this run.")
    assert summ["flexsp_vs_ulysses"] == {"cells": 24, "flexsp_not_slower": 24, "geomean_speedup": pytest.approx(9 / 8)}
    # zeppelin (10 / 1.2 = 8.33 s) is behind flexsp (8 s) in C's long cells only: each listed with its numbers
    assert summ["zeppelin_fastest_or_tied_cells"] == 20
    assert summ["zeppelin_exceptions"] == [
        f"zeppelin-c long {g} GPUs: flexsp 8.000 s vs zeppelin 8.333 s (4.2% slower by the simulator; predicted "
        f"8.000 vs 8.333 s)" for g in bc.GPUS]
    assert "**holds**" in lines[2]
    # te-cp loses 10 - 2 = 8 s over the bound: 6 s exposed where it spans nodes, 1 s inside a node
    assert summ["te_cp_loss_from_exposed_comm_by_gpus_when_spanning_nodes"][128] == pytest.approx(0.75)
    assert summ["te_cp_loss_from_exposed_comm_by_gpus_inside_a_node"][16] == pytest.approx(0.125)
    assert summ["te_cp_exposed_fraction_of_step_by_gpus_when_spanning_nodes"][16] == pytest.approx(0.6)
    assert summ["te_cp_exposed_comm_fraction_by_gpus"][128] == pytest.approx(0.35)
    assert "16 GPUs 75% (3 cells; 60% of the step)" in lines[3]
    assert lines[3].endswith("where it spans nodes: **holds**.")
    zs = [10.0 / (k * m) for k in (1.5, 1.0) for m in (3.0, 2.0, 1.2) for _ in bc.GPUS]
    assert summ["zeppelin_vs_best_baseline_mean"] == pytest.approx(np.mean([8.0 / z for z in zs]))
    # reversed: flexsp behind ulysses, C's advantage larger, te-cp's spanning exposure below half
    for c in cells:
        c["planners"][2]["mean_s"] = 9.5
        if c["cluster"] == "zeppelin-c":
            c["zeppelin_speedup_vs_te_cp"] *= 4
        c["planners"][0]["exposed_comm_s"] = 3.0
    summ, lines = bc.findings(cells)
    assert "**does not hold** as stated" in lines[2] and summ["flexsp_vs_ulysses"]["flexsp_not_slower"] == 0
    assert lines[1].endswith("-> **does not hold** in this run.")
    assert lines[3].endswith("where it spans nodes: **does not hold**.")
    # what a 1.10x geometric-mean lead takes: zeppelin 1.3x the bound and the best other 1.43x in half
    # the cells, 1.02x and 1.05x in the other half (there the best other is within 1.10x of the bound)
    for a, c in enumerate(cells):
        zb, bb = (1.3, 1.43) if a % 2 else (1.02, 1.05)
        for s in c["planners"]:
            s["lower_bound_mean_s"] = 2.0
        c["planners"][1]["mean_s"], c["planners"][2]["mean_s"], c["planners"][3]["mean_s"] = 2 * zb, 2 * bb, 3 * bb
    summ, _ = bc.findings(cells)
    cap = summ["cap_for_1_10_lead"]
    assert 1.02 < cap < 1.3
    assert np.exp(np.mean([np.log(b / min(z, cap)) for z, b in ((1.3, 1.43), (1.02, 1.05))])) == pytest.approx(1.10)
    assert summ["cells_best_other_within_1_10_of_bound"] == len(cells) // 2


def test_results_page_auto_partial_and_kept_sections(tmp_path):
    """The grid's own statements on zeppelin's ``--recompute auto`` (cells it alone plans, peak memory over
    capacity), the sections of the page a full run keeps, the long-tail cells of ``--recompute-only``
    and a run resumed from ``--partial``: hand-made inputs with known answers."""
    import argparse

    bc = _bench_module()

    def cell(gpus, others_fail, mem):
        st = [{"planner": "zeppelin", "error": None, "mean_s": 2.0, "lower_bound_mean_s": 1.0,
               "speedup_vs_te_cp": 1.5, "predicted_mean_s": 2.0}]
        st.append({"planner": "te-cp", "error": "sequence too long" if others_fail else None, "mean_s": 3.0,
                   "predicted_mean_s": 3.0, "lower_bound_mean_s": 1.0, "exposed_comm_s": 0.5})
        return {"cluster": "zeppelin-a", "model": "llama-13b", "mix": "long", "gpus": gpus, "planners": st,
                "zeppelin_auto": {"mean_s": 2.0, "memory_over_capacity": mem,
                                  "microbatches": {"none": 3, "full:k": 1}}}

    summ, _ = bc.findings([cell(16, True, 0.999), cell(32, False, 0.9)])
    assert summ["cells_only_zeppelin_can_plan"] == ["zeppelin-a llama-13b long 16 GPUs"]
    assert summ["zeppelin_wins_cells"] == 1 and summ["zeppelin_fastest_or_tied_cells"] == 2
    assert (summ["auto_planned_cells"], summ["auto_over_capacity_cells"]) == (2, [])
    assert summ["auto_memory_over_capacity_max_cell"] == "zeppelin-a llama-13b long 16 GPUs"
    assert summ["auto_microbatches"] == {"full:k": 2, "none": 6}
    assert bc.auto_summary([cell(16, True, 1.02)])["auto_over_capacity_cells"] == ["zeppelin-a llama-13b long 16 GPUs"]
    # auto against the global modes: a faster global mode counts only where its plans fit
    def rc(mix, auto, sel, sel_mem):
        m = {"none": (2.5, 0.9), "selective": (sel, sel_mem), "full": (3.0, 0.3), "auto": (auto, 0.99)}
        return {"cluster": "zeppelin-a", "model": "llama-13b", "mix": mix, "gpus": 64,
                "recompute": {k: {"mean_s": t, "memory_over_capacity": mem} for k, (t, mem) in m.items()}}

    rs = bc.recompute_summary([rc("longtail", 2.0, 1.98, 1.1), rc("short", 2.0, 1.98, 0.95)])
    assert rs["auto_slower_than_best_global"] == ["zeppelin-a llama-13b short 64 GPUs (selective)"]
    assert rs["faster_global_over_capacity"] == [
        "zeppelin-a llama-13b longtail 64 GPUs (selective 0.990x auto's time, peak 1.10 of capacity)"]
    assert (rs["long_tailed_cells"], rs["auto_faster_than_selective_long_tailed"]) == (1, 0)
    assert rs["auto_not_faster_than_selective"] == [
        "zeppelin-a llama-13b longtail 64 GPUs (selective's peak 1.10 of capacity)"]
    assert rs["auto_over_best_global_geomean"] == pytest.approx(np.sqrt(2.0 / 2.5 * 2.0 / 1.98))
    # a full run keeps the usp cells' section and the marked sections (its own recomputation one replaces the old)
    rc = "\n".join([bc.RECOMPUTE_MARKERS[0], "## old recompute", bc.RECOMPUTE_MARKERS[1]])
    ls = "<!-- long-steps section: generated by x.py -->\n## steps\n<!-- end of the long-steps section -->"
    page = f"# R\n\n## Cluster A\n\n{bc.USP_HEADING}\n\nusp table\n\n{rc}\n\n{ls}\n"
    assert bc.kept_sections(page, recompute=True) == [f"{bc.USP_HEADING}\n\nusp table", rc, ls]
    assert bc.kept_sections(page, recompute=False) == [f"{bc.USP_HEADING}\n\nusp table", ls]
    # --recompute-only's cells: the grid's, then the long-tail cells among those asked for
    args = argparse.Namespace(clusters="A", models="llama-13b", mixes="long,longtail", gpus="64")
    assert bc.grid_todo(args) == [("zeppelin-a", "llama-13b", "long", 64), ("zeppelin-a", "llama-13b", "longtail", 64)]
    args.mixes = "long"
    assert bc.grid_todo(args) == [("zeppelin-a", "llama-13b", "long", 64)]
    # --partial: each finished cell appended, read back by key; another --steps' lines left out
    part = tmp_path / "partial.jsonl"
    assert bc.load_partial(part, 4) == {} and bc.load_partial(None, 4) == {}
    doc = {"steps": 4, "mean_s": 1.5}
    assert bc.save_partial(part, ("grid", "zeppelin-a", "llama-13b", "long", 64), doc) is doc
    bc.save_partial(part, ("grid", "zeppelin-c", "llama-7b", "short", 16), {"steps": 2})
    assert bc.load_partial(part, 4) == {("grid", "zeppelin-a", "llama-13b", "long", 64): doc}


def test_run_compare_pool_order_and_first_failure():
    """Heavy planners are queued first; a planner's report names its first failing step, with or
    without worker processes (later steps of a failed planner are dropped, not reported)."""
    from zeppelin.planner.tools.compare import job_order

    assert job_order(["te-cp", "zeppelin", "packed-dp", "flexsp"], 2) == [
        ("flexsp", 0), ("flexsp", 1), ("zeppelin", 0), ("zeppelin", 1),
        ("te-cp", 0), ("te-cp", 1), ("packed-dp", 0), ("packed-dp", 1)]
    ctx = _ctx()
    cap = ctx.cost.token_capacity
    ok = [Sequence(sample_id=0, length=cap // 2), Sequence(sample_id=1, length=100)]
    bad = [Sequence(sample_id=2, length=cap * 3), Sequence(sample_id=3, length=100)]
    steps = [ok, ok, bad, ok, bad, ok]
    serial = run_compare(ctx, steps, ["packed-dp", "te-cp"], workers=1)
    pooled = run_compare(ctx, steps, ["packed-dp", "te-cp"], workers=2)
    for runs in (serial, pooled):
        pk, te = runs
        assert pk.error is not None and pk.error.startswith("step 2: ") and "does not fit" in pk.error
        assert len(pk.step_times) == 2
        assert te.error is None and len(te.step_times) == 6
    assert pooled[1].step_times == pytest.approx(serial[1].step_times, rel=1e-12)
    assert pooled[0].error == serial[0].error
