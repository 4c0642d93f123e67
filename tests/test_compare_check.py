"""`zeppelin compare`: length mixes, per-planner statistics, speedups, failures, CLI."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from zeppelin.planner.base import PlanContext, get_planner
from zeppelin.planner.compare import comparison, mix_dataset, resolve_dataset, run_compare
from zeppelin.planner.simulate import Simulator
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.common import InputError
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Sequence
from zeppelin.schemas.profile import default_profile


def test_mixes_are_deterministic_and_ordered():
    a, b = mix_dataset("short", 5000, seed=3), mix_dataset("short", 5000, seed=3)
    assert np.array_equal(a.lengths, b.lengths)
    med = {m: float(np.median(mix_dataset(m, 5000).lengths)) for m in ("short", "mixed", "long")}
    assert med["short"] < med["mixed"] < med["long"]
    assert resolve_dataset("mix:long").source == "mix:long"
    with pytest.raises(InputError, match=r"^unknown length mix 'huge' \(known: short, mixed, long\)$"):
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
                          "--dataset", "short", "--tokens-per-gpu", "4096", "--max-seq-len", "8192", "--json", "--png", str(png), "-j", "2"],
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
