"""`zeppelin profile --quick` on this machine (2 gloo processes)."""

import json
import subprocess

import pytest

from zeppelin.schemas.io.documents import load_doc
from zeppelin.schemas.profile import CostProfile


@pytest.mark.timeout(240)
def test_profile_quick_two_ranks(zeppelin_bin, tmp_path):
    out = tmp_path / "prof.json"
    r = subprocess.run([zeppelin_bin, "profile", "--quick", "--nproc", "2", "--model", "tiny", "-o", str(out)],
                       capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    prof = load_doc(CostProfile, out)
    assert prof.source.kind == "measured"
    fit = prof.fits_for("tiny", "fp32")
    assert fit is not None and fit.attention is not None and fit.linear is not None
    assert prof.intra is not None and prof.intra.bandwidth_GBps > 0
    # the TP layer measured at the TP degree 2 ranks allow: its compute and each overlap mode
    tp2 = prof.fits_for("tiny", "fp32", 2)
    assert tp2 is not None and tp2.linear is not None and tp2.linear.points
    assert set(tp2.linear_tp_comm) == {"none", "slicing", "commfuse"}
    raw = json.loads((tmp_path / "prof.json.raw.json").read_text())
    assert len(raw["attention_s"]) == len(raw["attention_lengths"]) and all(t > 0 for t in raw["attention_s"])
    assert "fit_report" in raw and len(raw["fit_report"]["linear"]["rel_errors"]) == len(raw["linear_tokens"])
    assert "cost-model fit" in r.stdout
    # the remap exchange measured beside compute, and the step-time check run with the profile
    assert fit.remap_exchange is not None and all(x >= 0 for x in fit.remap_exchange)
    assert len(raw["remap_exchange_s"]) == 4
    assert set(fit.fsdp_microbatch_s) == {"1", "3"} and all(v >= 0 for v in fit.fsdp_microbatch_s.values())
    chk = prof.source.step_time_check
    assert chk is not None and chk.steps == 3 and chk.worst_error >= abs(chk.median_error)
    assert "measured / predicted step time - 1: median" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prof.json", "prof.json.raw.json"]


def test_profile_bad_input(zeppelin_bin, tmp_path):
    r = subprocess.run([zeppelin_bin, "profile", "--nproc", "3", "--nodes", "2", "-o", str(tmp_path / "p.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "zeppelin: error: --nodes 2 must divide --nproc 3"
    r = subprocess.run([zeppelin_bin, "profile", "--model", "nope", "-o", str(tmp_path / "p.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown model preset 'nope'" in r.stderr
    assert not (tmp_path / "p.json").exists()
