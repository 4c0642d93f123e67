"""The shipped measured profile (``--profile h200-measured``): what it is, that plans use its
measurements, and how its fits extend past the measured sizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.cli import run_cli
from zeppelin.planner.core.inputs import profile_mismatch, resolve_profile
from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.model import model_preset, resolve_model_ref
from zeppelin.schemas.plan import PlanReader

ROOT = Path(__file__).resolve().parents[2]


def _profile():
    return resolve_profile("h200-measured", cluster_preset("zeppelin-c:1x1"))


def test_the_shipped_profile_says_where_and_when_it_was_measured():
    prof = _profile()
    assert prof.source.kind == "measured" and "H200" in prof.source.machine and "(cuda" in prof.source.machine
    assert prof.source.created_at.startswith("2026-11-29")
    assert "driver 580.159.04" in prof.source.notes and "torch 2.11.0+cu130" in prof.source.notes
    (fits,) = prof.fits
    assert (fits.model, fits.dtype, fits.tp) == ("llama3.2-1b", "bf16", 1)
    # measured up to the GPU grid's largest sizes: 32K-token sequences and linear layouts
    assert fits.attention.points[-1][0] == 32768 and fits.linear.points[-1][0] == 32768


def test_its_model_preset_is_the_model_it_measured(tmp_path):
    """The fits are named by the preset of the shapes benchmarks/gpu_check.py profiled (a Hugging
    Face config of Llama-3.2-1B's shapes): the same model but for its name and its modules' origin."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    (tmp_path / "config.json").write_text(json.dumps(gpu_check.LLAMA_1B))
    measured = resolve_model_ref(f"hf:{tmp_path}").model_dump(exclude={"name", "remap_payload"})
    assert model_preset("llama3.2-1b").model_dump(exclude={"name", "remap_payload"}) == measured


def test_plans_use_its_measurements_and_grow_them_past_the_largest_point():
    prof = _profile()
    fits = prof.fits[0]
    cost = CostModel(cluster_preset("zeppelin-c:1x1"), model_preset("llama3.2-1b"), prof)
    L, t = fits.attention.points[-1]
    assert float(cost.attn_time(L)) == pytest.approx(t)
    assert float(cost.attn_time(2 * L)) == pytest.approx(4 * t)          # attention: the work grows as L^2
    T, t = fits.linear.points[-1]
    assert float(cost.linear_time(T)) == pytest.approx(t)
    assert float(cost.linear_time(2 * T)) == pytest.approx(2 * t)        # linear modules: as T
    # other models are priced by its measured efficiency curves, without --force-profile
    llama7 = model_preset("llama-7b")
    assert profile_mismatch(prof, "h200-measured", cluster_preset("zeppelin-c:2"), "zeppelin-c:2", llama7,
                            "llama-7b") is None
    assert CostModel(cluster_preset("zeppelin-c:2"), llama7, prof).peak_flops == pytest.approx(prof.peak_tflops * 1e12)


def test_zeppelin_plan_takes_it_by_name(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "p.jsonl"
    code, _, err = run_cli(["plan", "-c", "zeppelin-c:1x1", "--model", "llama3.2-1b", "--profile", "h200-measured",
                            "--steps", "1", "--tokens-per-step", "32768", "--max-seq-len", "16384", "-q", "-o",
                            str(out)], capsys)
    assert code == 0, err
    header = PlanReader(out).header
    assert header.profile.source.machine == _profile().source.machine
    assert header.profile.fits[0].model == "llama3.2-1b"
    # on CPUs it is refused as any GPU profile is
    code, _, err = run_cli(["plan", "-c", "local-cpu:1x2", "--model", "tiny", "--profile", "h200-measured",
                            "--steps", "1", "-q", "-o", str(tmp_path / "q.jsonl")], capsys)
    assert code != 0 and "was measured on GPUs" in err


def test_presets_lists_it(capsys):
    code, out, _ = run_cli(["presets"], capsys)
    assert code in (0, None)
    assert "measured profile (--profile h200-measured): NVIDIA H200 SXM 141 GB (cuda, 1 ranks), 2026-11-29" in \
        " ".join(out.split())
