"""The typed configs of plan, compare and demo (planner/tools/config.py): one-line checks, the
options each planner gets from the flags (by its ``Options`` class, not its name) and from
``-O``, and compare / demo planning for the user's memory setting and baseline options."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli
from zeppelin.planner.tools.config import CompareConfig, DemoConfig, PlanConfig
from zeppelin.schemas.common import InputError

SMALL = ["-c", "local-cpu:2x2", "--model", "tiny", "--tokens-per-step", "16384", "--max-seq-len", "4096",
         "--steps", "1"]
ZEPPELIN_FLAGS = {"ilp": "auto", "ilp_nodes": 10, "solver": "highs", "intra": "auto"}


@pytest.mark.parametrize("cls,values,message", [
    (PlanConfig, {"zero_stage": 4}, "--zero-stage must be 0, 1, 2 or 3 (got 4)"),
    (CompareConfig, {"zero_stage": -1}, "--zero-stage must be 0, 1, 2 or 3 (got -1)"),
    (DemoConfig, {"recompute": "some"}, "--recompute must be auto, none, selective or full (got 'some')"),
    (CompareConfig, {"overflow": "wrap"}, "--overflow must be truncate, reject or skip (got 'wrap')"),
    (PlanConfig, {"ilp_nodes": -1}, "--ilp-nodes must be >= 0 (got -1)"),
    (PlanConfig, {"fmt": "yaml"}, "--format must be jsonl or pretty (got 'yaml')"),
    (PlanConfig, {"workers": 0}, "--workers must be at least 1 (got 0)"),
    (CompareConfig, {"workers": -1}, "--workers must be at least 0 (got -1)"),
    (DemoConfig, {"steps": 10_001}, "--steps must be at most 10,000 (got 10,001)"),
    (CompareConfig, {"steps": 10_001}, None),
    (DemoConfig, {"time_limit": 0.0}, "--time-limit must be greater than 0 (got 0)"),
])
def test_each_flag_is_checked_by_its_declaration(cls, values, message):
    base = {"cluster": "local-cpu:2x2", "model": "tiny"} if cls is PlanConfig else {}
    if message is None:
        assert cls.from_flags({**base, **values}).steps == values["steps"]
        return
    with pytest.raises(InputError) as e:
        cls.from_flags({**base, **values})
    assert str(e.value) == message


def test_each_planner_gets_the_options_its_own_options_class_declares(monkeypatch):
    from zeppelin.planner.core import registry  # noqa: F401 (every planner registers)
    from zeppelin.planner.core.base import PLANNERS, Planner

    class Renamed(PLANNERS["zeppelin"]):  # a Zeppelin planner under another name: the same flags reach it
        name = "my-planner"

    class NamedLikeZeppelin(Planner):  # named like one, without its options: none reach it
        name = "zeppelin-lookalike"

    monkeypatch.setitem(PLANNERS, "my-planner", Renamed)
    monkeypatch.setitem(PLANNERS, "zeppelin-lookalike", NamedLikeZeppelin)
    cfg = CompareConfig.from_flags({"option": ["te-cp.cp=2", "hydraulis.tp_degrees=1,2", "my-planner.tol=0.5"],
                                    "time_limit": 5.0, "families": "none"})
    names = ["zeppelin", "my-planner", "zeppelin-lookalike", "te-cp", "flexsp", "hydraulis", "packed-dp"]
    zeppelin = {**ZEPPELIN_FLAGS, "families": "none", "time_limit": 5.0}
    assert cfg.options_by_planner(names, "the compared planners") == {
        "zeppelin": zeppelin, "my-planner": {**zeppelin, "tol": 0.5}, "te-cp": {"cp": 2},
        "flexsp": {"time_limit": 5.0}, "hydraulis": {"time_limit": 5.0, "tp_degrees": (1, 2)}}
    # plan: the options in the order a plan header has always recorded them
    plan = PlanConfig.from_flags({"cluster": "c", "model": "m", "option": ["family_margin=0.1"], "time_limit": 2.0})
    assert list(plan.planner_options("zeppelin").items()) == [*ZEPPELIN_FLAGS.items(), ("time_limit", 2.0),
                                                              ("family_margin", 0.1)]
    assert PlanConfig.from_flags({"cluster": "c", "model": "m", "time_limit": 2.0}).planner_options("te-cp") == {}


@pytest.mark.parametrize("option,message", [
    ("te-cp", "--option must be PLANNER.NAME=VALUE (got 'te-cp')"),
    ("cp=2", "--option must be PLANNER.NAME=VALUE (got 'cp=2')"),
    ("flexsp.buckets=8", "--option flexsp.buckets: 'flexsp' is not among the compared planners (te-cp, zeppelin)"),
    ("zeppelin.time_limit=3", "--option zeppelin.time_limit: use --time-limit"),
    ("zeppelin.ilp=never", "--option zeppelin.ilp: use --ilp"),
    ("te-cp.bogus=1", "planner 'te-cp': unknown option 'bogus' (known: cp)"),
    ("te-cp.cp=x", "planner 'te-cp': bad option (invalid literal for int() with base 10: 'x')"),
])
def test_compare_refuses_a_bad_planner_option_in_one_line(option, message, capsys):
    code, _, err = run_cli(["compare", *SMALL, "--planners", "te-cp,zeppelin", "-O", option], capsys)
    assert (code, err) == (2, f"zeppelin: error: {message}\n")


def test_compare_plans_for_the_users_memory_setting_and_baseline(capsys):
    """--zero-stage and --recompute reach every planner's cost model; -O te-cp.cp=2 the te-cp baseline,
    whose configuration the verdict prints."""
    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile

    code, out, err = run_cli(["compare", *SMALL, "--planners", "te-cp,zeppelin", "-j", "1", "--json",
                              "--zero-stage", "2", "--recompute", "selective", "-O", "te-cp.cp=2"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    cl = resolve_cluster("local-cpu:2x2")
    want = PlanContext(cl, resolve_model("tiny"), resolve_profile(None, cl), zero_stage=2, recompute="selective")
    assert (doc["zero_stage"], doc["recompute"]) == (2, "selective")
    assert doc["verdict"]["memory"]["tokens_per_gpu"] == want.cost.token_capacity
    te = next(p for p in doc["planners"] if p["planner"] == "te-cp")
    assert (te["options"], te["layout"]) == ({"cp": 2}, {"ring": [2, 2]})
    assert doc["verdict"]["rows"][0]["layout"] == "CP 2" and doc["verdict"]["rows"][0]["options"] == {"cp": 2}
    lines = err.splitlines()
    assert "local-cpu (4 GPUs), tiny, tp=1, ZeRO-2, recompute selective" in " ".join(" ".join(lines[:3]).split())
    assert "as run (tp=1, ZeRO-2, recompute selective; sizes in units): te-cp CP 2 (cp=2)" in lines
    assert all(len(ln) <= 80 for ln in lines if ln.startswith(("as run", "  ")))


def test_demo_takes_the_planning_flags(capsys):
    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile

    code, out, err = run_cli(["demo", *SMALL, "--stages", "cost", "--zero-stage", "3", "--recompute", "full"],
                             capsys)
    assert code == 0, err
    cl = resolve_cluster("local-cpu:2x2")
    want = PlanContext(cl, resolve_model("tiny"), resolve_profile(None, cl), zero_stage=3, recompute="full")
    assert f"(ZeRO-3, 4-way DP): {want.cost.token_capacity:,} tokens" in out
    code, out, err = run_cli(["demo", *SMALL, "-O", "nope.x=1"], capsys)
    assert (code, err) == (2, ("zeppelin: error: --option nope.x: 'nope' is not among the demo's planners "
                               "(zeppelin, te-cp, te-cp-tuned, ulysses, hybrid-dp, megatron-dcp, flexsp, hydraulis)\n"))
