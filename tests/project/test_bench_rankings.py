"""benchmarks/bench_rankings.py without torch runs: planning the same steps with every candidate,
picking the best other baseline by prediction, the ratio arithmetic and the JSON it prints, with
``zeppelin profile`` / ``zeppelin run`` replaced by fakes that write what those commands write."""

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLANNERS = ["zeppelin", "te-cp", "packed-dp", "ulysses"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_rankings", ROOT / "benchmarks" / "bench_rankings.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ratios_winner_and_target(bench):
    names = ["zeppelin", "te-cp", "packed-dp"]
    pred = {"zeppelin": [9.0, 1.0, 1.0, 1.0], "te-cp": [9.0, 1.2, 1.2, 1.2], "packed-dp": [9.0, 1.1, 1.1, 1.1]}
    # measured: te-cp 1.25x and packed-dp 1.05x zeppelin's time in every round, whatever the round's load
    rounds = [{"zeppelin": [z] * 3, "te-cp": [1.25 * z] * 3, "packed-dp": [1.05 * z] * 3} for z in (1.0, 2.0, 1.5)]
    s = bench.summarize(names, "packed-dp", pred, rounds)
    z = s["plans"]["zeppelin"]
    assert z["predicted_step_s"] == pytest.approx(1.0)  # step 0 left out
    assert z["measured_step_s"] == pytest.approx(1.5)
    assert z["measured_rounds_s"] == [1.0, 2.0, 1.5]
    assert z["round_spread"] == pytest.approx(1.0 / 1.5)
    assert z["ratios"]["te-cp"]["measured"] == pytest.approx(1.25)
    assert z["ratios"]["te-cp"]["predicted"] == pytest.approx(1.2)
    assert z["ratios"]["te-cp"]["agreement"] == pytest.approx(1.25 / 1.2 - 1)
    assert z["fastest_round_s"] == 1.0 and z["ratios"]["te-cp"]["measured_of_fastest_rounds"] == pytest.approx(1.25)
    assert z["ratios"]["packed-dp"]["measured"] == pytest.approx(1.05)
    assert z["ratios"]["packed-dp"]["agreement"] == pytest.approx(1.05 / 1.1 - 1)
    assert "te-cp" not in s["plans"]["te-cp"]["ratios"]
    assert s["plans"]["te-cp"]["ratios"]["packed-dp"]["predicted"] == pytest.approx(1.1 / 1.2)
    assert s["predicted_winner"] == s["measured_winner"] == "zeppelin"
    assert s["winner_holds"] and s["target"]["holds"]
    assert s["zeppelin_worst_agreement"] == pytest.approx(abs(1.05 / 1.1 - 1))

    flipped = [{"zeppelin": [1.3], "te-cp": [1.0], "packed-dp": [1.2]} for _ in range(3)]
    s = bench.summarize(names, "packed-dp", pred, flipped)
    assert s["measured_winner"] == "te-cp" and not s["winner_holds"] and not s["target"]["holds"]


def test_run_step_times_leave_out_the_first_step(bench):
    rep = {"steps": [{"first": i == 0, "measured_s": {"step": 5.0 + i}, "predicted_s": {"step": 1.0 + i}}
                     for i in range(3)]}
    assert bench.run_step_times(rep) == ([6.0, 7.0], [2.0, 3.0])
    assert bench.run_step_times({"steps": rep["steps"][:1]}) == ([5.0], [1.0])


def test_main_plans_picks_runs_interleaved_and_reports(bench, tmp_path, monkeypatch, capsys):
    from zeppelin.planner.sim.report import Predictor
    from zeppelin.schemas.plan import read_plan
    from zeppelin.schemas.profile import default_profile

    prof = tmp_path / "profile.json"
    prof.write_text(default_profile("local-cpu:1x4", "cpu").model_dump_json())
    order = []

    def fake_run(cmd, log, env):
        # `zeppelin run PLAN ... --report-json R`: a report predicting as `zeppelin run --report`
        # does, with measured times 10% slower than that
        assert cmd[1] == "run", cmd
        header, steps = read_plan(cmd[2])
        order.append(header.planner)
        rep = cmd[cmd.index("--report-json") + 1]
        pred = [Predictor(header).phases(st)["step"] for st in steps]
        rows = [{"first": k == 0, "measured_s": {"step": 1.1 * p}, "predicted_s": {"step": p}}
                for k, p in enumerate(pred)]
        Path(rep).write_text(json.dumps({"steps": rows}))
        return 0.1

    monkeypatch.setattr(bench, "_run", fake_run)
    out = tmp_path / "out.json"
    assert bench.main(["--profile", str(prof), "--model", "tiny", "--tokens-per-rank", "256", "--max-seq-len", "512",
                       "--steps", "2", "--rounds", "2", "--planners", *PLANNERS, "--workdir", str(tmp_path / "w"),
                       "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    best = doc["best_other"]
    assert best in ("packed-dp", "ulysses")
    cands = doc["candidates_predicted_step_s"]
    assert sorted(cands) == sorted(PLANNERS)
    assert cands[best] == min(v for k, v in cands.items() if k not in ("zeppelin", "te-cp"))
    assert order == ["zeppelin", "te-cp", best] * 2
    assert doc["cluster"] == "local-cpu:1x4" and doc["ranks"] == 4 and doc["rounds"] == 2
    assert len(doc["runs"]) == 6 and {"load_avg_before", "load_avg_after"} <= set(doc["runs"][0])
    s = doc["summary"]
    assert sorted(s["plans"]) == sorted(["zeppelin", "te-cp", best])
    for row in s["plans"].values():
        # what was run is what was planned: the runs' times are 1.1x the planning-time predictions
        assert row["measured_step_s"] == pytest.approx(1.1 * row["predicted_step_s"], rel=1e-6)
        assert row["prediction_rel_error"] == pytest.approx(1 / 1.1 - 1)
        for r in row["ratios"].values():
            assert r["agreement"] == pytest.approx(0.0, abs=1e-9)
    assert s["target"]["holds"] == s["winner_holds"] is True
    assert s["predicted_winner"] == min(s["plans"], key=lambda n: s["plans"][n]["predicted_step_s"])
    assert statistics.median(doc["step_lengths"][0]) > 0
    assert "predicted winner" in capsys.readouterr().err
    assert bench.main(["--markdown", str(out)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert len(table) == 2 + 3 and all(line.startswith("| 4 | ") for line in table[2:])
