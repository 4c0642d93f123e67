"""One vocabulary of flags, run: plan, compare, demo, simulate, show and data stats with the shared
flags and short options (their names are held by tests/cli/test_cli_surface.py), one default token
budget, the manifest field flags and the missing-column error naming its flag, the spellings of the
previous release working with one note each, and compare's progress on stderr."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.cli import run_cli

SMALL = ["-c", "local-cpu:2x2", "--model", "tiny", "--tokens-per-step", "16384", "--max-seq-len", "4096",
         "--steps", "1", "--seed", "1"]


def test_the_six_commands_take_the_shared_flags(tmp_path, capsys):
    from zeppelin.schemas.io.datasets import default_manifest_path

    sample = str(default_manifest_path())
    plan, sim_json, stats_json = tmp_path / "p.plan", tmp_path / "s.json", tmp_path / "d.json"
    code, out, err = run_cli(["plan", "-m", sample, *SMALL, "-o", str(plan), "--time-limit", "30", "--json"], capsys)
    assert code == 0, err
    planned = json.loads(out)
    assert planned["tokens_per_step"] == 16384 and planned["steps"] == 1
    code, out, err = run_cli(["simulate", str(plan), "--json", "-o", str(sim_json)], capsys)
    assert code == 0 and json.loads(sim_json.read_text())["steps"][0]["step"] == 0
    code, out, err = run_cli(["show", str(plan), "--step", "0"], capsys)
    assert code == 0 and "step 0" in out
    code, out, err = run_cli(["compare", *SMALL, "-m", "mixed", "--time-limit", "30", "--planners", "te-cp,zeppelin",
                           "-j", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["tokens_per_step"] == 16384
    assert "verdict: zeppelin" in err  # the table and the verdict still reach the terminal
    code, out, err = run_cli(["demo", "-m", sample, *SMALL, "--time-limit", "30", "--stages", "plan", "--planners", "te-cp,zeppelin",
                           "--png", str(tmp_path / "d.png"), "-j", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["comparison"]["verdict"]["rows"][0]["baseline"] == "te-cp"
    code, out, err = run_cli(["data", "stats", "-m", sample, "--json", "-o", str(stats_json)], capsys)
    assert code == 0 and json.loads(stats_json.read_text())["num_samples"] > 0


def test_one_default_token_budget(tmp_path, capsys):
    """Without --tokens-per-step, plan, compare and demo sample steps of the same size."""
    from zeppelin.planner.cli.common import default_tokens_per_step
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
    from zeppelin.planner.costmodel.context import PlanContext

    cl = resolve_cluster("local-cpu:2x2")
    ctx = PlanContext(cl, resolve_model("tiny"), resolve_profile(None, cl))
    want = default_tokens_per_step(ctx.cost.token_capacity, ctx.num_units)
    base = ["-c", "local-cpu:2x2", "--model", "tiny", "--steps", "1", "--max-seq-len", "2048"]
    code, out, err = run_cli(["plan", *base, "-o", str(tmp_path / "p.plan"), "--json"], capsys)
    assert code == 0 and json.loads(out)["tokens_per_step"] == want
    code, out, err = run_cli(["compare", *base, "--planners", "packed-dp,zeppelin", "-j", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["tokens_per_step"] == want
    code, out, err = run_cli(["demo", *base, "--stages", "cost", "--json"], capsys)
    assert code == 0 and f"tokens_per_step={want:,}" in err


def test_deprecated_spellings_work_with_one_note_each(tmp_path, capsys, monkeypatch):
    from zeppelin.planner.cli import common

    monkeypatch.setattr(common, "_noted", set())  # once per process: this test's commands start afresh
    new = ["compare", "-c", "local-cpu:2x2", "--model", "tiny", "-m", "mixed", "--steps", "2",
           "--tokens-per-step", "16384", "--time-limit", "30", "--planners", "te-cp,zeppelin", "-j", "1", "--json"]
    old = ["compare", "-c", "local-cpu:2x2", "-m", "tiny", "-d", "mixed", "-n", "2", "--tokens-per-gpu", "4096",
           "--solver-time-limit", "30", "--planners", "te-cp,zeppelin", "-j", "1", "--json"]
    code, out_new, err_new = run_cli(new, capsys)
    assert code == 0 and "note:" not in err_new
    code, out_old, err_old = run_cli(old, capsys)
    assert code == 0
    notes = [ln for ln in err_old.splitlines() if ln.startswith("zeppelin: note:")]
    assert notes == [
        "zeppelin: note: `compare -m MODEL` is deprecated and goes in the next release; use --model MODEL",
        "zeppelin: note: `compare --dataset` is deprecated and goes in the next release; use -m/--manifest",
        "zeppelin: note: `compare -n` is deprecated and goes in the next release; use --steps",
        "zeppelin: note: `compare --solver-time-limit` is deprecated and goes in the next release; use --time-limit",
        "zeppelin: note: `compare --tokens-per-gpu` is deprecated and goes in the next release; use "
        "--tokens-per-step"]
    a, b = json.loads(out_new), json.loads(out_old)
    assert [s["step_times_s"] for s in a["planners"]] == [s["step_times_s"] for s in b["planners"]]
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"ids": [1, 2, 3]}\n{"ids": [4]}\n')
    code, out, err = run_cli(["data", "stats", str(ids), "--tokens-field", "ids", "--json"], capsys)
    assert code == 0 and json.loads(out)["num_tokens"] == 4
    assert err == ("zeppelin: note: `data stats --tokens-field` is deprecated and goes in the next release; use "
                   "--ids-field\n")


def test_field_flags_and_the_missing_column_error_names_the_flag(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"doc_id": list(range(400)), "num_tokens": [64 + 37 * (i % 50) for i in range(400)]}),
                   path)
    base = ["-c", "local-cpu:2x2", "--model", "tiny", "--steps", "1", "--tokens-per-step", "16384"]
    for argv in (["compare", *base, "-m", str(path), "--planners", "te-cp,zeppelin", "-j", "1"],
                 ["plan", *base, "-m", str(path), "-o", str(tmp_path / "p.plan")],
                 ["demo", *base, "-m", str(path), "--stages", "data"],
                 ["data", "stats", str(path)]):
        code, out, err = run_cli(argv, capsys)
        assert (code, err) == (2, f"zeppelin: error: {path}: column 'length' not found (columns: doc_id, "
                                  f"num_tokens); name the column to use with --length-field NAME\n"), argv
        code, out, err = run_cli([*argv, "--length-field", "num_tokens"], capsys)
        assert code == 0, (argv, err)
        if argv[0] == "compare":  # the verdict: te-cp's speedup with its p10-p90, as in the table
            lines = out.splitlines()
            z = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["zeppelin"])
            v = next(ln.split() for ln in lines if ln.split()[2:4] == ["te-cp", "TransformerEngine"])
            assert v[:2] == [lines[z].split()[3], lines[z + 1].split()[0]]
            assert re.fullmatch(r"\d+\.\d\dx", v[0]) and re.fullmatch(r"\d+\.\d\d-\d+\.\d\d", v[1])


def test_compare_reports_progress_on_stderr(capsys, monkeypatch):
    """Past the quiet first seconds (here: none), progress lines on stderr; stdout keeps the JSON."""
    from zeppelin.planner.tools import compare as cmp

    monkeypatch.setattr(cmp.Progress, "QUIET_S", 0.0)
    monkeypatch.setattr(cmp.time, "perf_counter", iter(range(0, 10_000, 10)).__next__)  # 10 s per call
    code, out, err = run_cli(["compare", *SMALL, "-m", "mixed", "--planners", "te-cp,zeppelin", "-j", "1", "--json"],
                          capsys)
    assert code == 0 and json.loads(out)["steps"] == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("compare: ")]
    assert lines[-1].startswith("compare: 2/2 steps done (last: ")  # planner steps: a step per planner
    assert all(len(ln) <= 80 for ln in lines)
