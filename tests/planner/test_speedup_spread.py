"""`zeppelin compare` and `demo`: every speedup with its spread over the sampled steps (p10-p90 of
the per-step ratios against the reference), and what is known of the prediction's error."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from zeppelin.planner.cli import app
from zeppelin.planner.tools.compare import PlannerRun, comparison, prediction_error, prediction_error_text
from zeppelin.schemas.profile import CostProfile, ModelFits, PolyFit, ProfileSource, default_profile

SMALL = ["-c", "local-cpu:2x2", "--model", "tiny", "-m", "mixed", "--steps", "5", "--tokens-per-step", "16384",
         "--max-seq-len", "4096", "-j", "1"]
PLANNERS = "te-cp,te-cp-tuned,ulysses,zeppelin"


def _run(args: list[str]) -> str:
    r = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert r.exit_code == 0, (args, r.output, r.exception)
    return r.output


def _independent(doc: dict, planner: str, reference: str) -> tuple[float, float, float]:
    """Mean-time speedup and p10 / p90 of the per-step ratios, from the JSON's step times alone."""
    by = {s["planner"]: s for s in doc["planners"]}
    ref, mine = np.array(by[reference]["step_times_s"]), np.array(by[planner]["step_times_s"])
    per = ref / mine
    return float(ref.mean() / mine.mean()), float(np.percentile(per, 10)), float(np.percentile(per, 90))


def _exposed_agrees(doc: dict, lines: list[str]) -> None:
    """One definition of exposed communication: per planner the table's cell (transfers, ``+`` the
    gradient sync below them) and the verdict's step breakdown show the same two parts, which add up
    to the simulator's mean exposed communication; the breakdown adds up to the step."""
    from zeppelin.planner.tools.compare import _ms

    by = {s["planner"]: s for s in doc["planners"]}
    where = doc["verdict"]["where"]
    assert sorted(where) == ["te-cp", "zeppelin"]
    for name, w in where.items():
        s = by[name]
        assert w["step_s"] == pytest.approx(w["compute_s"] + w["sync_s"] + w["exposed_transfers_s"] + w["imbalance_s"])
        assert (w["exposed_transfers_s"], w["sync_s"]) == (s["exposed_transfers_s"], s["exposed_sync_s"])
        assert s["exposed_transfers_s"] + s["exposed_sync_s"] == pytest.approx(s["exposed_comm_s"])
        assert s["exposed_sync_s"] > 0
        row = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [name])
        assert lines[row].split()[-2] == _ms(w["exposed_transfers_s"])
        assert lines[row + 1].split()[-1] == "+" + _ms(w["sync_s"])
        said = next(ln for ln in lines if ln.split()[:3] == [name, _ms(w["step_s"]), "="]).split()
        assert said[2:9] == ["=", _ms(w["compute_s"]), "+", _ms(w["sync_s"]), "+", _ms(w["exposed_transfers_s"]), "+"]


def test_compare_prints_each_speedup_with_the_spread_of_its_steps(tmp_path):
    out = tmp_path / "cmp.json"
    text = _run(["compare", *SMALL, "--planners", PLANNERS, "-o", str(out)])
    doc = json.loads(out.read_text())
    lines = text.splitlines()
    for name in PLANNERS.split(","):
        row = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [name])
        cells = lines[row].split()
        spreads = lines[row + 1].split()  # the second line of the row: p10-p90 under each speedup
        for col, ref in enumerate(("te-cp", "te-cp-tuned")):
            mean, lo, hi = _independent(doc, name, ref)
            assert cells[3 + col] == f"{mean:.2f}x"
            assert spreads[col] == f"{lo:.2f}-{hi:.2f}"
            key = "speedup_vs_" + ref.replace("-", "_")
            s = next(x for x in doc["planners"] if x["planner"] == name)
            assert s[key + "_p10"] == pytest.approx(lo) and s[key + "_p90"] == pytest.approx(hi)
            assert s[key + "_per_step"] == pytest.approx(
                [r / t for r, t in zip(next(x for x in doc["planners"] if x["planner"] == ref)["step_times_s"],
                                       s["step_times_s"])])
    # the verdict under the table: zeppelin over each baseline, the same numbers as the table's
    zrow = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["zeppelin"])
    table_mean = {ln.split()[0]: float(ln.split()[1]) for ln in lines[:zrow + 1] if ln.split()[:1] and
                  ln.split()[0] in PLANNERS.split(",")}
    start = next(i for i, ln in enumerate(lines) if ln.startswith("verdict: "))
    rows = {ln.split()[2]: ln.split() for ln in lines[start + 1:start + 4]}
    assert sorted(rows) == ["te-cp", "te-cp-tuned", "ulysses"]
    for col, ref in enumerate(("te-cp", "te-cp-tuned")):  # the table's speedup cells, verbatim
        assert rows[ref][:2] == [lines[zrow].split()[3 + col], lines[zrow + 1].split()[col]]
    for ref, cells in rows.items():
        mean, lo, hi = _independent(doc, "zeppelin", ref)
        assert cells[:2] == [f"{mean:.2f}x", f"{lo:.2f}-{hi:.2f}"]
        assert mean == pytest.approx(table_mean[ref] / table_mean["zeppelin"], abs=0.01)  # the table's means
        v = next(r for r in doc["verdict"]["rows"] if r["baseline"] == ref)
        assert (v["speedup"], v["p10"], v["p90"]) == pytest.approx((mean, lo, hi))
    assert "TransformerEngine / Megatron CP" in " ".join(rows["te-cp"]) and "DeepSpeed-Ulysses" in lines[start + 3]
    from zeppelin.planner.tools.compare import verdict_lines

    assert all(len(ln) <= 80 for ln in verdict_lines(doc["verdict"]))  # never wrapped in a terminal
    _exposed_agrees(doc, lines)
    mean, lo, hi = _independent(doc, "zeppelin", "te-cp")
    assert doc["zeppelin_speedup_vs_te_cp_p10"] == pytest.approx(lo)
    assert doc["zeppelin_speedup_vs_te_cp_p90"] == pytest.approx(hi)
    assert lo <= hi
    best = doc["best_baseline"]
    mean, lo, hi = _independent(doc, "zeppelin", best)
    assert doc["zeppelin_speedup_vs_best_baseline_p10"] == pytest.approx(lo)
    assert doc["zeppelin_speedup_vs_best_baseline_p90"] == pytest.approx(hi)
    # no --profile: the preset curves, and nothing is claimed about an error
    assert doc["prediction_error"] == {"profile": "preset curves", "given": False, "measured": False,
                                       "step_time_error": None, "step_time_error_worst": None,
                                       "step_time_error_steps": None, "kernel_fit_rel_error_median_worst": None}
    assert "prediction error" not in text


def test_compare_states_that_a_measured_profiles_error_is_unknown(tmp_path):
    prof = default_profile("local-cpu", "cpu").model_copy(update={
        "source": ProfileSource(kind="measured", machine="box", created_at="2026-01-01"),
        "fits": [ModelFits(model="tiny", dtype="bfloat16",
                           attention=PolyFit(coeffs=[0.0, 1e-6], rel_error_median=0.04, rel_error_max=0.2),
                           linear=PolyFit(coeffs=[0.0, 1e-7], rel_error_median=0.07, rel_error_max=0.1))]})
    path = tmp_path / "measured.json"
    path.write_text(prof.model_dump_json())
    text = _run(["compare", *SMALL, "--planners", "te-cp,zeppelin", "--profile", str(path), "-o",
                 str(tmp_path / "c.json")])
    doc = json.loads((tmp_path / "c.json").read_text())
    err = doc["prediction_error"]
    assert err["step_time_error"] is None and err["measured"] and err["given"]
    assert err["kernel_fit_rel_error_median_worst"] == pytest.approx(0.07)
    flat = " ".join(text.split())
    assert ("prediction error of these step times: unknown for this profile (measured on box at 2026-01-01): it "
            "records no measured step-time error; its kernel curves fit their measurements within 7.0%") in flat
    assert "run --report" in flat


def test_prediction_error_of_a_profile_without_fits():
    err = prediction_error(CostProfile(source=ProfileSource(kind="measured", machine="m")), given=True)
    assert err["kernel_fit_rel_error_median_worst"] is None
    assert prediction_error_text(err) == ("prediction error of these step times: unknown for this profile (measured "
                                          "on m): it records no measured step-time error; `zeppelin profile` "
                                          "measures it, `zeppelin run --report` measures it for a plan")


def test_prediction_error_of_a_checked_profile():
    """A profile whose step-time check ran (``zeppelin profile``) states the measured error."""
    from zeppelin.schemas.profile import StepTimeCheck

    chk = StepTimeCheck(steps=3, median_error=0.124, worst_error=0.31, plan="x")
    err = prediction_error(CostProfile(source=ProfileSource(kind="measured", machine="m", step_time_check=chk)),
                           given=True)
    assert (err["step_time_error"], err["step_time_error_worst"], err["step_time_error_steps"]) == (0.124, 0.31, 3)
    assert prediction_error_text(err) == ("prediction error of these step times: measured +12.4% (median of measured "
                                          "/ predicted - 1 over 3 steps run when the profile was taken, worst 31.0%; "
                                          "profile measured on m)")


def test_comparison_spread_is_over_the_same_steps():
    runs = [PlannerRun("te-cp", step_times=[4.0, 2.0, 6.0, 8.0], lower_bounds=[1.0] * 4),
            PlannerRun("zeppelin", step_times=[2.0, 2.0, 2.0, 2.0], lower_bounds=[1.0] * 4)]
    for r in runs:
        r.exposed = r.span_nodes = r.latencies = r.predicted = [0.0] * 4
    doc = comparison(runs)
    z = doc["planners"][1]
    assert z["speedup_vs_te_cp_per_step"] == [2.0, 1.0, 3.0, 4.0]
    assert z["speedup_vs_te_cp"] == pytest.approx(5.0 / 2.0)
    assert z["speedup_vs_te_cp_p10"] == pytest.approx(np.percentile([2, 1, 3, 4], 10))
    assert z["speedup_vs_te_cp_p90"] == pytest.approx(np.percentile([2, 1, 3, 4], 90))


@pytest.mark.timeout(180)
def test_demo_prints_the_spread(tmp_path):
    text = _run(["demo", "--cluster", "local-cpu:2x2", "--model", "tiny", "--steps", "3", "--planners",
                 "zeppelin,te-cp", "--stages", "plan", "--png", str(tmp_path / "d.png"), "-j", "1"])
    flat = " ".join(text.split())
    assert re.search(r"verdict: zeppelin's speedup .* \d+\.\d\dx \d+\.\d\d-\d+\.\d\d te-cp TransformerEngine", flat), flat
    assert "prediction error" not in flat
