"""Same inputs, same plan bytes: under CPU stress, run after run, with any number of workers.

Every solver stops at node / iteration limits (``zeppelin.planner.core.solver``), never at a clock;
a wall-clock limit is only an optional safety net, and a step that hits it says so in its solver
info and makes ``zeppelin check`` report it as non-reproducible.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from zeppelin.planner.cli import main
from zeppelin.planner.core.solver import SolveLimits
from zeppelin.planner.zeppelin.assign import pack

# 2 "nodes" x 2 CPU ranks, tiny model, the shipped sample: every solver runs in a fraction of a second
SETTING = ["-c", "local-cpu:2x2", "--model", "tiny", "--tokens-per-step", "16384", "--max-seq-len", "4096",
           "--steps", "4", "--seed", "0"]
# zeppelin with its packing ILP on every step (some stop at the node limit), FlexSP's MILP, Hydraulis' ILP
PLANNERS = {"zeppelin": ["--ilp", "always", "--ilp-nodes", "30"], "flexsp": [], "hydraulis": []}


def _plan(path, planner: str, extra: list[str], workers: int) -> bytes:
    try:
        main(["plan", *SETTING, "--planner", planner, *extra, "-j", str(workers), "-q", "-o", str(path)])
    except SystemExit as e:
        assert e.code in (0, None)
    return path.read_bytes()


def _records(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_identical_bytes_under_cpu_stress_and_with_1_or_2_workers(tmp_path):
    # two busy processes compete with the planner for this machine's cores the whole time
    stress = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for planner, extra in PLANNERS.items():
            first = _plan(tmp_path / f"{planner}-1.plan", planner, extra, workers=1)
            second = _plan(tmp_path / f"{planner}-2.plan", planner, extra, workers=1)
            pooled = _plan(tmp_path / f"{planner}-3.plan", planner, extra, workers=2)
            assert first == second, f"{planner}: two runs under load gave different plans"
            assert first == pooled, f"{planner}: --workers 2 changed the plan"
            header, *steps, end = _records(first)
            assert header["created_at"] == "" and len(steps) == 4 and end["kind"] == "end"
            solvers = [s["solver"] for s in steps]
            assert all("time_s" not in s for s in solvers)  # no wall-clock field in the plan
            assert all(s["status"] != "wall_clock_limit" for s in solvers)
            if planner == "zeppelin":  # the ILP's plan won on some steps
                assert "highs" in {s["name"] for s in solvers}
        # a packing ILP that stops at its node limit (the search is cut, not finished): the same
        # assignment every time, whatever the load
        rng = np.random.default_rng(0)
        cost = rng.uniform(1.0, 10.0, 24)
        args = (np.zeros(6), np.zeros(6), cost, np.ones(24), np.ones(24, dtype=np.int64), 100.0)
        runs = [pack(*args, ilp="always", limits=SolveLimits(nodes=20)) for _ in range(3)]
        assert {(r.solver, r.status, r.nodes) for r in runs} == {("highs", "work_limit", 20)}
        assert all(r.bins == runs[0].bins and r.makespan == runs[0].makespan for r in runs)
    finally:
        for p in stress:
            p.kill()
        for p in stress:
            p.wait()


def test_wall_clock_safety_net_is_recorded_and_check_reports_the_step(tmp_path, capsys):
    """A safety net too short for any solve: every step records it, `zeppelin plan` warns, and
    `zeppelin check` fails the case as non-reproducible."""
    out = tmp_path / "net.plan"
    with pytest.raises(SystemExit) as e:
        main(["plan", *SETTING, "--steps", "2", "--ilp", "always", "--time-limit", "1e-9", "-o", str(out)])
    assert e.value.code in (0, None)
    err = capsys.readouterr().err
    assert ("warning: step(s) 0, 1 hit the --time-limit wall-clock safety net: their plans depend on this "
            "machine's load and are not reproducible") in err
    _, *steps, _end = _records(out.read_bytes())
    assert [s["solver"]["status"] for s in steps] == ["wall_clock_limit"] * 2

    from zeppelin.planner.tools.check import run_check

    case = {"cluster": "local-cpu:2x2", "model": "tiny", "dataset": "sample", "planner": "zeppelin",
            "options": {"ilp": "always", "time_limit": 1e-9}, "steps": 1, "seed": 0, "tokens_per_step": 16384,
            "max_seq_len": 4096, "tolerance": 0.03}
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "net.json").write_text(json.dumps(case))
    rep = run_check(tmp_path / "cases", update=True)
    assert rep.failures[0].startswith("net: step 0 ")
    assert rep.failures[0].endswith(" of the new plan hit the solver's wall-clock safety net: not reproducible "
                                    "(its plan depends on the machine's load; remove the case's time_limit or "
                                    "raise it)")


def test_check_exact_fails_on_any_byte_difference(tmp_path, monkeypatch):
    """`zeppelin check --exact`: a plan that differs from its golden in any byte fails, even within
    the step-time tolerance."""
    from zeppelin.planner.baselines.static_sp import TECPTuned
    from zeppelin.planner.tools.check import run_check

    case = {"cluster": "local-cpu:2x2", "model": "tiny", "dataset": "sample", "planner": "te-cp-tuned",
            "steps": 2, "seed": 0, "tokens_per_step": 16384, "max_seq_len": 4096, "tolerance": 10.0}
    (tmp_path / "c.json").write_text(json.dumps(case))
    assert run_check(tmp_path, update=True).failures == []
    assert run_check(tmp_path, exact=True).failures == []
    # the golden names its dataset as the case does, not by this checkout's path: any clone matches it
    header = json.loads((tmp_path / "c.plan").read_text().split("\n}\n")[0] + "\n}")
    assert header["manifest"]["path"] == "sample" and header["created_at"] == ""
    real = TECPTuned.plan_step

    def relabelled(self, ctx, step, seqs):
        plan = real(self, ctx, step, seqs)
        if step == 1:
            plan.notes["extra"] = 1
        return plan

    monkeypatch.setattr(TECPTuned, "plan_step", relabelled)
    assert run_check(tmp_path).failures == []  # the same step times: within tolerance
    assert run_check(tmp_path, exact=True).failures == [
        ("c: the new plan is not byte-identical to the golden (steps 1 differ); plans are deterministic, so the "
         "planner changed: review and run `zeppelin check --update`")]


def test_solver_prints_nothing_on_stdout(tmp_path, zeppelin_bin):
    """HiGHS' banner (printed when a process builds its first solver) never reaches stdout: `-q` plans
    print nothing and `--json` output stays JSON."""
    out = subprocess.run([zeppelin_bin, "plan", *SETTING, "--steps", "1", "--ilp", "always", "-q", "-o",
                          str(tmp_path / "p.plan")], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr
    out = subprocess.run([zeppelin_bin, "compare", "-c", "local-cpu:2x2", "-m", "tiny", "-n", "1", "-j", "1",
                          "--tokens-per-gpu", "4096", "--planners", "flexsp,zeppelin", "--json"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0 and [p["planner"] for p in json.loads(out.stdout)["planners"]] == ["flexsp", "zeppelin"]
