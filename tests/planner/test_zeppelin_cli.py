"""``zeppelin plan`` with the Zeppelin planner: plan and validate, bad inputs, the families option."""

from __future__ import annotations

import subprocess

import pytest


def test_cli_plan_and_validate(tmp_path, zeppelin_bin):
    out = tmp_path / "plan.jsonl"
    r = subprocess.run([zeppelin_bin, "plan", "--cluster", "zeppelin-a", "--model", "llama-7b", "--steps", "3",
                        "-o", str(out), "--explain"], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "one unit holds" in r.stdout and "predicted step / lower bound" in r.stdout
    from zeppelin.schemas.plan import read_plan

    hdr, steps = read_plan(out)
    assert hdr.planner == "zeppelin" and len(steps) == 3
    assert all(s.prediction is not None and s.solver is not None for s in steps)
    r = subprocess.run([zeppelin_bin, "validate", str(out)], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "valid - 3 steps" in r.stdout


def test_cli_bad_inputs(tmp_path, zeppelin_bin):
    out = tmp_path / "plan.jsonl"

    def run(*args):
        return subprocess.run([zeppelin_bin, "plan", *args, "-o", str(out)], check=False, capture_output=True, text=True,
                              timeout=120)

    r = run("--cluster", "zeppelin-a:0", "--model", "llama-7b")
    assert r.returncode == 2 and r.stderr.startswith("zeppelin: error: cluster preset 'zeppelin-a:0'")
    r = run("--cluster", "zeppelin-a", "--model", "llama-7b", "--tokens-per-step", "100", "--no-shuffle")
    assert r.returncode == 2
    assert r.stderr.startswith("zeppelin: error: --tokens-per-step 100 is smaller than sequence 0 of step 0")
    r = run("--cluster", "zeppelin-a", "--model", "llama-7b", "--tp", "3")
    assert r.returncode == 2 and "--tp 3 does not divide the 8 GPUs per node" in r.stderr
    r = run("--cluster", "zeppelin-a:1x2", "--model", "llama-7b", "--tokens-per-step", "200000")
    assert r.returncode == 2 and "more than the whole cluster can hold" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    r = run("--cluster", "zeppelin-a", "--model", "llama-7b", "--intra", "tree")
    assert r.returncode == 2 and r.stderr == "zeppelin: error: intra option must be auto or ring (got 'tree')\n"
    assert not out.exists()


def test_cli_families_option(tmp_path, capsys):
    from zeppelin.planner.cli import main

    args = ["plan", "-c", "local-cpu:2x2", "--model", "tiny", "--steps", "1", "--tokens-per-step", "8192", "-q"]
    with pytest.raises(SystemExit) as e:
        main([*args, "--families", "bogus", "-o", str(tmp_path / "bad.plan")])
    assert e.value.code == 2 and not (tmp_path / "bad.plan").exists()
    assert "zeppelin: error: families option: unknown family 'bogus'" in capsys.readouterr().err
    try:
        main([*args, "--families", "none", "-o", str(tmp_path / "tiered.plan")])
    except SystemExit as x:
        assert x.code in (0, None)
    from zeppelin.schemas.plan import PlanReader

    r = PlanReader(tmp_path / "tiered.plan")
    steps = list(r)
    assert r.header.planner_options["families"] == "none" and "tiers" in steps[0].notes
