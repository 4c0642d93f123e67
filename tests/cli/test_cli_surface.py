"""The command line's surface is what was recorded, and every option is declared in one place.

* Every command of the ``zeppelin`` app, its arguments and flags (names, short aliases, switch or
  value, default) are compared with ``tests/data/cli_surface.json``, so that no flag appears,
  disappears or changes its default by accident. A change made on purpose re-records the file::

      .venv/bin/python tests/cli/test_cli_surface.py --record

* One vocabulary: a shared option (manifest, cluster, model, token budget, ...) has the same long
  and short names in every command that takes it (:data:`VOCABULARY`); a shared name never means
  something else; every command reading a manifest takes the field flags. Spellings of the previous
  release are listed in ``planner/cli/common.py`` (``DEPRECATED``).

* The flags of ``plan``, ``compare`` and ``demo`` are declared only in ``planner/tools/config.py``
  (the planning flags once, shared by the three) and generated from there (``planner/cli/common.py``);
  no module declares a planning flag by hand.

* Planner options are declared only by each planner's ``Options`` dataclass
  (``planner/core/options.py``), and ``zeppelin run``'s flags only by the fields of
  ``RunConfig`` / ``LaunchConfig`` (``runtime/config.py``): no module reads options with
  ``options.get(...)`` or lists ``option_names`` by hand, and the run command and the worker
  declare no flag of their own.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "tests" / "data" / "cli_surface.json"
HOW = "if the change is on purpose, re-record with: .venv/bin/python tests/cli/test_cli_surface.py --record"


def _default(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_default(v) for v in value]
    return repr(value)


def surface() -> dict[str, list[dict]]:
    """``{"zeppelin CMD [SUB]": [param, ...]}`` for every command of the app (groups included)."""
    import typer.main

    from zeppelin.planner.cli import app

    out: dict[str, list[dict]] = {}

    def walk(cmd, path: str) -> None:
        params = []
        for p in cmd.params:
            if p.name == "help":
                continue
            rec = {"name": p.name, "kind": "argument" if not p.opts[0].startswith("-") else "option",
                   "names": sorted(p.opts) + sorted(p.secondary_opts)}
            if rec["kind"] == "option":
                rec.update(flag=bool(getattr(p, "is_flag", False)), multiple=bool(p.multiple),
                           required=bool(p.required), default=_default(p.default))
            params.append(rec)
        out[path] = params
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "zeppelin")
    return out


def _describe(p: dict) -> str:
    return f"{'/'.join(p['names'])} " + json.dumps({k: v for k, v in p.items() if k not in ("names", "name")})


def test_cli_surface_matches_the_record():
    recorded = json.loads(RECORD.read_text())
    now = surface()
    problems = []
    for cmd in sorted(set(recorded) | set(now)):
        if cmd not in now:
            problems.append(f"command {cmd!r} is gone")
            continue
        if cmd not in recorded:
            problems.append(f"command {cmd!r} is new")
            continue
        was = {p["name"]: p for p in recorded[cmd]}
        new = {p["name"]: p for p in now[cmd]}
        for name in sorted(set(was) | set(new)):
            if name not in new:
                problems.append(f"{cmd}: {_describe(was[name])} is gone")
            elif name not in was:
                problems.append(f"{cmd}: {_describe(new[name])} is new")
            elif was[name] != new[name]:
                problems.append(f"{cmd}: {_describe(was[name])} is now {_describe(new[name])}")
    assert not problems, "the command line changed:\n  " + "\n  ".join(problems) + f"\n{HOW}"


def _calls(path: Path) -> list[tuple[str, str, int]]:
    """(enclosing function or '', dotted callee, line) of every call in a module."""
    tree = ast.parse(path.read_text())
    out = []

    def visit(node, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call):
                out.append((func, ast.unparse(child.func), child.lineno))
            visit(child, name)

    visit(tree, "")
    return out


def test_planner_options_are_declared_only_by_their_dataclass():
    found = []
    for f in sorted((ROOT / "planner").rglob("*.py")):
        rel = str(f.relative_to(ROOT))
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            # reading an option from the raw mapping instead of the typed ``self.opts``
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and ast.unparse(node.func.value).endswith("options")):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("self.options", "options") \
                    and "planner/cli/" not in rel:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            # option names listed by hand (base.py derives them from Options)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and rel != "planner/core/base.py":
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(ast.unparse(t).endswith("option_names") for t in targets):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "planner options read or listed outside their Options dataclass:\n  " + "\n  ".join(found)

    from zeppelin.planner.core import registry  # noqa: F401 (every planner registers)
    from zeppelin.planner.core.base import PLANNERS
    from zeppelin.planner.core.options import PlannerOptions

    for name, cls in PLANNERS.items():
        assert issubclass(cls.Options, PlannerOptions), name
        assert cls.option_names == cls.Options.names(), name
        for spec in cls.Options.specs():
            assert spec.help, f"{name}: option {spec.name} has no help"
            assert spec.convert(name, None) == spec.default


def test_zeppelin_plan_flags_come_from_zeppelin_options():
    from zeppelin.planner.zeppelin.options import ZeppelinOptions

    plan = {p["name"]: p for p in surface()["zeppelin plan"]}
    for flag, name in (("--ilp", "ilp"), ("--ilp-nodes", "ilp_nodes"), ("--solver", "solver"),
                       ("--intra", "intra"), ("--families", "families"), ("--time-limit", "time_limit")):
        assert flag in plan[name]["names"]
        assert plan[name]["default"] == ZeppelinOptions.spec(name).default, flag


# ------------------------------------------------------------------ plan, compare, demo: one declared source
#: the functions that turn a declared flag into a typer option (planner/cli/common.py for the
#: planning commands, planner/cli/run.py for `zeppelin run`): no other code may
GENERATORS = {("planner/cli/common.py", "option"), ("planner/cli/run.py", "_parameter")}


def hand_declared(source: str, rel: str, spellings: set[str]) -> list[str]:
    """The typer options and arguments of ``source`` (module ``rel``) declared outside the generators
    that name a planning flag, or whose names are not written out (only a generator reads them from
    a declaration)."""
    tree = ast.parse(source)
    found = []

    def visit(node, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if (isinstance(child, ast.Call) and ast.unparse(child.func) in ("typer.Option", "typer.Argument",
                                                                             "Option", "Argument")
                    and (rel, func) not in GENERATORS):
                names = [a.value for a in child.args[1:] if isinstance(a, ast.Constant)]
                where = f"{rel}:{child.lineno} in {func or 'the module'}"
                if any(not isinstance(a, ast.Constant) for a in child.args[1:]):
                    found.append(f"{where}: {ast.unparse(child.func)}(...) with names that are not written out")
                found.extend(f"{where}: {n} (a planning flag)" for n in names if n in spellings)
            visit(child, name)

    visit(tree, "")
    return found


def _planning_spellings() -> set[str]:
    from zeppelin.planner.tools.config import PLANNING

    return {n for f in PLANNING for n in f.flags}


def test_planning_flags_are_declared_only_in_the_planning_config():
    """Every flag of plan, compare and demo is declared in planner/tools/config.py and generated from
    there; no module of planner/cli/ declares a planning flag (--cluster, --zero-stage, -O, ...) by
    hand, whatever command it is for."""
    spellings = _planning_spellings()
    found = []
    for path in sorted((ROOT / "planner").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        found += hand_declared(path.read_text(), rel, spellings)
    assert not found, "planning flags declared outside planner/tools/config.py:\n  " + "\n  ".join(found)

    from zeppelin.planner.tools.config import COMMANDS, PLANNING

    surf = surface()
    for cmd, flags in COMMANDS.items():
        params = {p["name"]: p for p in surf[f"zeppelin {cmd}"]}
        assert list(params) == [f.name for f in flags], cmd  # exactly the declared flags, in their order
        for f in flags:
            assert params[f.name]["names"] == sorted(f.flags), (cmd, f.name)
            assert params[f.name]["flag"] == (f.kind is bool), (cmd, f.name)
            if f.default is not ...:
                assert params[f.name]["default"] == _default(f.default), (cmd, f.name)
        # the planning flags: all of them in each of the three, with the same names and kind
        shared = {f.name: f for f in PLANNING}
        assert all(name in params and params[name]["names"] == sorted(f.flags) for name, f in shared.items()), cmd


def test_a_hand_declared_planning_flag_is_caught():
    spellings = _planning_spellings()
    src = ("import typer\n"
           "def plan(zero: int = typer.Option(1, '--zero-stage', help='ZeRO stage'),\n"
           "         png: str = typer.Option(None, '--png')):\n    pass\n"
           "def other(x=typer.Option(None, *FLAGS)):\n    pass\n")
    assert hand_declared(src, "planner/cli/plan.py", spellings) == [
        "planner/cli/plan.py:2 in plan: --zero-stage (a planning flag)",
        "planner/cli/plan.py:5 in other: typer.Option(...) with names that are not written out"]
    assert hand_declared(src, "planner/cli/common.py", spellings)[:1] == [
        "planner/cli/common.py:2 in plan: --zero-stage (a planning flag)"]  # only the generator function may
    assert "--recompute" in spellings and "-O" in spellings and "--png" not in spellings


def test_run_flags_are_declared_only_by_the_config_dataclasses():
    # no flag declared by hand in the command or the worker: only the generator in cli/run.py
    # turns RunConfig / LaunchConfig fields into typer parameters, only config.py builds the parser
    declared = {"typer.Option", "typer.Argument", "Option", "Argument", "add_argument", "p.add_argument",
                "parser.add_argument"}
    found = []
    for rel, allowed in (("planner/cli/run.py", {"_parameter"}), ("runtime/__main__.py", set()),
                         ("runtime/executor.py", set()), ("runtime/launch.py", set()),
                         *((f"runtime/train/{f.name}", set()) for f in sorted((ROOT / "runtime" / "train").glob("*.py")))):
        for func, callee, line in _calls(ROOT / rel):
            if (callee in declared or callee.endswith(".add_argument")) and func not in allowed:
                found.append(f"{rel}:{line}: {callee}(...) in {func or 'the module'}")
    assert not found, "run flags declared outside runtime/config.py:\n  " + "\n  ".join(found)

    from zeppelin.runtime.config import LaunchConfig, RunConfig, build_parser, flag_specs

    run = {p["name"]: p for p in surface()["zeppelin run"]}
    specs = [*flag_specs(RunConfig), *flag_specs(LaunchConfig)]
    assert sorted(run) == sorted(s.name for s in specs)
    for s in specs:
        if s.flags:
            assert run[s.name]["names"] == sorted(s.flags) and run[s.name]["default"] == _default(s.default), s.name
            assert run[s.name]["flag"] == (s.kind is bool), s.name
    # the worker's parser has exactly RunConfig's options, and a config survives the trip through argv
    worker = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert worker == {s.name for s in flag_specs(RunConfig)}
    cfg = RunConfig(plan="p.jsonl", model="tiny", steps=3, lr=2e-4, seed=7, verify=True, verify_tol=1e-4,
                    checkpoint_every=2, checkpoint_dir="ck", resume=True, timeout_s=12.5, progress="plain",
                    device="cpu", threads=2, tp_overlap="slicing", dp="replicate", zero_stage=2, hsdp=2,
                    dtype="fp32", recompute="full", recompute_override=True, export="out")
    assert RunConfig(**vars(build_parser().parse_args(cfg.to_argv()))) == cfg
    assert RunConfig(plan="p.jsonl").to_argv() == ["p.jsonl"]


# ------------------------------------------------------------------ one vocabulary (planner/cli/common.py)
#: parameter name -> the option names it has wherever it appears
VOCABULARY = {
    "manifest": ["--manifest", "-m"], "cluster": ["--cluster", "-c"], "model": ["--model"],
    "tokens_per_step": ["--tokens-per-step"], "max_seq_len": ["--max-seq-len"], "steps": ["--steps"],
    "seed": ["--seed"], "profile": ["--profile"], "time_limit": ["--time-limit"], "output": ["--output", "-o"],
    "json_out": ["--json"], "as_json": ["--json"], "length_field": ["--length-field"], "ids_field": ["--ids-field"],
    "text_field": ["--text-field"], "tokenizer": ["--tokenizer"],
}
COMMANDS = ("plan", "compare", "demo", "simulate", "show", "data stats", "validate")
READS_MANIFEST = ("plan", "compare", "demo", "data stats", "validate")
FIELD_FLAGS = ("length_field", "ids_field", "text_field", "tokenizer")


def _surface():
    return {k.removeprefix("zeppelin "): v for k, v in surface().items()}


def _old_names() -> dict[str, set[str]]:
    from zeppelin.planner.cli.common import DEPRECATED

    out: dict[str, set[str]] = {}
    for (cmd, old) in DEPRECATED:
        out.setdefault(cmd, set()).add(old.split()[0])
    return out


def test_every_command_spells_a_shared_option_the_same_way():
    surf, old = _surface(), _old_names()
    problems = []
    for cmd in COMMANDS:
        for p in surf[cmd]:
            names = [n for n in p["names"] if n not in old.get(cmd, set()) or p["name"] in VOCABULARY]
            if p["name"] in VOCABULARY and sorted(names) != sorted(VOCABULARY[p["name"]]):
                problems.append(f"{cmd} {p['name']}: {names}, the vocabulary says {VOCABULARY[p['name']]}")
            # a shared short or long name never means something else
            for n in p["names"]:
                owner = [k for k, v in VOCABULARY.items() if n in v]
                if owner and p["name"] not in owner and n not in old.get(cmd, set()):
                    problems.append(f"{cmd}: {n} is {p['name']}, the vocabulary gives it to {owner[0]}")
    for cmd in READS_MANIFEST:
        have = {p["name"] for p in surf[cmd]}
        problems += [f"{cmd} reads a manifest but has no {f}" for f in FIELD_FLAGS if f not in have]
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: {sys.argv[0]} --record   (writes {RECORD.relative_to(ROOT)})")
    cmds = surface()
    RECORD.write_text("{\n" + ",\n".join(
        f" {json.dumps(cmd)}: [" + ",".join(f"\n  {json.dumps(p)}" for p in params) + ("\n ]" if params else "]")
        for cmd, params in cmds.items()) + "\n}\n")
    print(f"wrote {RECORD.relative_to(ROOT)}")
