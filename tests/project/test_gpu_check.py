"""benchmarks/gpu_check.py: its --dry-run walks every section on CPU (so the one GPU run cannot fail
on a typo or a missing import), and one section's failure is recorded while the others still run."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True, text=True,
                       timeout=1500, check=False)
    return r, out


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_dry_run_reports_every_section_ok(dry_run):
    r, out = dry_run
    doc = json.loads((out / "gpu_check.json").read_text())
    failed = {k: v.get("error") or v.get("skipped") for k, v in doc["sections"].items() if not v["ok"]}
    assert failed == {}, (failed, r.stderr[-3000:])
    assert r.returncode == 0
    assert doc["dry_run"] is True
    assert list(doc["sections"]) == list(gpu_check.SECTIONS)
    assert (out / "gpu_check.txt").read_text() == r.stdout


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_dry_run_kernels_cover_packs_blocks_and_every_block_kind(dry_run):
    _, out = dry_run
    k = json.loads((out / "gpu_check.json").read_text())["sections"]["kernels"]
    for pack in ("short-heavy", "long"):
        row = k["local"][pack]
        assert row["runtime_tflops"] > 0 and row["sdpa_flash_tflops"] > 0 and row["kernel"] == "cpu_flash"
        assert "tflops" in row["torch_varlen"] or "error" in row["torch_varlen"]
    for row in k["ring_blocks"].values():
        assert row["full"]["vs_local"] > 0 and row["diag"]["vs_local"] > 0
    errs = k["errors"]
    assert set(errs) == {"varlen", "diag", "full", "mask", "varlen_window", "diag_window", "mask_window"}
    # the kernels that ran, as recorded at the dispatch's entry points (CPU: cpu_flash, math, band)
    assert "block_forward:cpu_flash" in errs["diag"]["kernel_bf16"]
    assert errs["mask"]["kernel_bf16"] == ["math_forward:math"]
    assert "band_forward:band" in errs["varlen_window"]["kernel_bf16"]
    for kind, row in errs.items():
        assert 0 < row["worst_rel"] < 2e-2, (kind, row)


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_dry_run_step_profile_and_two_ranks(dry_run):
    _, out = dry_run
    s = json.loads((out / "gpu_check.json").read_text())["sections"]
    step = s["whole_step"]
    assert step["tokens_per_s"] > 0 and step["peak_memory_bytes"] > 0 and step["predicted_memory_bytes"] > 0
    assert set(step["phases"]) >= {"attention", "linear", "optimizer", "step"}
    cost = s["cost_model"]
    from zeppelin.schemas.io.documents import load_doc
    from zeppelin.schemas.profile import CostProfile

    load_doc(CostProfile, out / cost["profile"])  # the saved profile is a valid one
    assert (out / cost["profile_raw"]).is_file()
    assert cost["with_profile"]["step_error"]["steps"] >= 1 and cost["with_preset"]["step_error"]["steps"] >= 1
    two = s["two_ranks"]
    assert two["runtime"]["ok"] and two["runtime"]["verify"]["ok"]
    assert two["runtime"]["bytes_sent"]["intra"] > 0  # the ring exchanged K/V blocks
    probe = two["gloo_cuda_probe"]["ops"]
    assert probe.pop("backend") == "cpu:gloo,cuda:gloo"  # the sitecustomize replaced the asked-for NCCL
    assert probe == dict.fromkeys(("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
                                   "send_recv"), "ok")


def test_a_failing_section_is_recorded_and_the_next_runs(tmp_path):
    args = types.SimpleNamespace(dry_run=True, budget_s=100.0, out=str(tmp_path))
    chk = gpu_check.Check(args)

    def broken(_):
        raise ValueError("a typo")

    gpu_check.run_section(chk, "kernels", broken)
    gpu_check.run_section(chk, "environment", lambda _: {"device": "x"})
    assert chk.results["kernels"]["ok"] is False
    assert chk.results["kernels"]["error"] == "ValueError: a typo"
    assert chk.results["environment"]["ok"] is True
    chk.budget = 0.0
    gpu_check.run_section(chk, "whole_step", lambda c: c.need(10, "whole step") or {})
    assert chk.results["whole_step"]["ok"] is False and chk.results["whole_step"]["skipped"].startswith("whole step: ")
    assert "kernels      FAILED" in gpu_check.table(chk.results)
    chk.log.close()


def test_unknown_section_is_refused(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--sections", "kernels,gpu"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "zeppelin: error: unknown section 'gpu' (known: environment, kernels, whole_step, cost_model, two_ranks)")
