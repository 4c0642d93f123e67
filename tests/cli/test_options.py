"""Typed options: planner options through their ``Options`` dataclass, ``zeppelin run``'s through
``RunConfig`` / ``LaunchConfig`` (conversion of strings, one-line refusals, the listing)."""

from __future__ import annotations

import pytest

from zeppelin.planner.core.base import get_planner
from zeppelin.schemas.common import InputError


def test_strings_from_a_command_line_become_typed_values():
    p = get_planner("hydraulis", tp_degrees="1, 2", cp="no", milp_solves="3", time_limit="2.5")
    assert (p.opts.tp_degrees, p.opts.cp, p.opts.milp_solves, p.opts.time_limit) == ((1, 2), False, 3, 2.5)
    assert p.options == {"tp_degrees": "1, 2", "cp": "no", "milp_solves": "3", "time_limit": "2.5"}  # as given
    z = get_planner("zeppelin", ilp_nodes="7", family_margin="0.1")
    assert (z.limits.nodes, z.family_margin, z.ilp, z.intra) == (7, 0.1, "auto", "auto")
    assert get_planner("te-cp", cp=4.0).opts.cp == 4


@pytest.mark.parametrize("planner,options,message", [
    ("flexsp", {"buckets": 0}, "planner 'flexsp': bad option (buckets=0 must be at least 1)"),
    ("flexsp", {"gap": "nan"}, "planner 'flexsp': bad option (gap='nan' is not a finite number)"),
    ("flexsp", {"time_limit": 0}, "planner 'flexsp': bad option (time_limit=0 must be greater than 0)"),
    ("flexsp", {"solver": "cplex"}, "solver option must be milp or greedy (got 'cplex')"),
    ("hydraulis", {"tp_degrees": "1,x"}, "planner 'hydraulis': bad option (tp_degrees='1,x' is not a list of "
                                         "integers)"),
    ("hydraulis", {"tp_degrees": "0,2"}, "planner 'hydraulis': bad option (tp_degrees='0,2' must be at least 1)"),
    ("hydraulis", {"cp": "maybe"}, "planner 'hydraulis': bad option (cp='maybe' is not a boolean (true/false, "
                                   "yes/no, 1/0))"),
    ("te-cp", {"cp": 2.5}, "planner 'te-cp': bad option (cp=2.5 is not an integer)"),
    ("ulysses", {"sp": True}, "planner 'ulysses': bad option (sp=True is not an integer)"),
    ("megatron-dcp", {"max_tokens_per_rank": "0"}, "planner 'megatron-dcp': bad option (max_tokens_per_rank='0' "
                                                   "must be at least 1)"),
    ("ulysses", {"cp": 2}, "planner 'ulysses': unknown option 'cp' (known: sp)"),
    ("zeppelin", {"ilp": "sometimes"}, "ilp option must be auto, always or never (got 'sometimes')"),
    ("zeppelin", {"solver": "glpk"}, "solver option must be highs or cbc (got 'glpk')"),
    ("zeppelin", {"ilp_iterations": -1}, "planner 'zeppelin': bad option (solver node and iteration limits must be "
                                         ">= 0)"),
    ("zeppelin", {"time_limit": 0}, "--time-limit must be positive (got 0)"),
])
def test_bad_options_are_refused_in_one_line(planner, options, message):
    with pytest.raises(InputError) as e:
        get_planner(planner, **options)
    assert str(e.value) == message


def test_zeppelin_plan_option_flag_and_listing(tmp_path, capsys):
    from zeppelin.planner.cli import main
    from zeppelin.schemas.plan import PlanReader

    out = tmp_path / "p.jsonl"
    args = ["plan", "-c", "local-cpu:1x2", "--model", "tiny", "--steps", "1", "--tokens-per-step", "1024",
            "--max-seq-len", "512", "-q", "--planner", "hydraulis"]
    with pytest.raises(SystemExit) as e:
        main([*args, "-O", "tp_degrees=1,2", "--option", "cp=no", "-o", str(out)])
    assert e.value.code == 0
    assert PlanReader(out).header.planner_options == {"tp_degrees": [1, 2], "cp": False}  # typed in the header
    for extra, message in ((["-O", "restarts=0"], "planner 'hydraulis': bad option (restarts='0' must be at least 1)"),
                           (["-O", "restarts"], "--option must be NAME=VALUE (got 'restarts')"),
                           (["-O", "time_limit=1"], "--option time_limit: use --time-limit"),
                           (["-O", "bogus=1"], "planner 'hydraulis': unknown option 'bogus' (known: cp, "
                                               "mb_search, milp_iterations, milp_nodes, milp_solves, restarts, "
                                               "time_limit, tp_degrees)")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main([*args, *extra, "-o", str(tmp_path / "bad.jsonl")])
        assert (e.value.code, capsys.readouterr().err) == (2, f"zeppelin: error: {message}\n")
        assert not (tmp_path / "bad.jsonl").exists()
    with pytest.raises(SystemExit) as e:
        main(["plan", "--list-options"])  # no --cluster / --model needed
    text = capsys.readouterr().out
    assert e.value.code == 0
    assert "zeppelin, zeppelin-no-remap, zeppelin-no-routing, zeppelin-tiers-only:\n" in text
    assert "  ilp (str; auto | always | never; default auto): " in text
    assert "  tp_degrees (int list; >= 1; default 1,2,4,8): " in text
    assert "hybrid-dp, packed-dp: no options\n" in text


def test_run_config_checks_its_options():
    from zeppelin.runtime.config import LaunchConfig, RunConfig

    for kw, message in (({"progress": "loud"}, "--progress must be auto, rich, plain or none (got 'loud')"),
                        ({"dp": "zero"}, "--dp must be fsdp or replicate (got 'zero')"),
                        ({"dtype": "fp16"}, "--dtype must be fp32 or bf16 (got 'fp16')"),
                        ({"zero_stage": 4}, "--zero-stage must be 0, 1, 2 or 3 (got 4)"),
                        ({"lr": float("nan")}, "--lr must be a finite number (got nan)"),
                        ({"threads": 0}, "--threads must be at least 1 (got 0)"),
                        ({"hsdp": 0}, "--hsdp must be at least 1 (got 0)"),
                        ({"resume": True}, "--checkpoint-every/--resume need --checkpoint-dir")):
        with pytest.raises(InputError) as e:
            RunConfig(plan="p.jsonl", **kw)
        assert str(e.value) == message
    with pytest.raises(InputError, match=r"^--node-rank must be at most 1 \(got 2\)$"):
        LaunchConfig(nnodes=2, node_rank=2)
    assert LaunchConfig(report_json="r.json").report  # --report-json implies --report


def test_worker_refuses_a_bad_option_in_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "zeppelin.runtime", "p.jsonl", "--dp", "zero"], capture_output=True,
                       text=True, cwd=tmp_path, timeout=120)
    assert (r.returncode, r.stderr) == (2, "zeppelin: error: [rank 0] --dp must be fsdp or replicate (got 'zero')\n")
