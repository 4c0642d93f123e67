"""``--config JOB.toml``: one job file for ``plan``, ``compare``, ``demo`` and ``run``.

A job file is TOML with a table per command; its keys are the commands' own options, named as
their config fields (``tokens_per_step``, ``max_seq_len``, ``lr``, ...), from the same declarations
the flags come from (:data:`zeppelin.planner.tools.config.COMMANDS` for the planning commands,
:class:`zeppelin.runtime.config.RunConfig` and ``LaunchConfig`` for ``run``)::

    [plan]
    cluster = "local-cpu:1x2"
    model = "tiny"
    steps = 20
    output = "job.plan.jsonl"

    [run]
    lr = 3e-3

``compare`` and ``demo`` also take ``[plan]``'s planning keys (the same problem), then their own
table. ``run`` runs ``[run]``'s ``plan``, else ``[plan]``'s ``output``, unless the command line
names a plan first. The file's values become flags placed before the command line's, so a flag
given on the command line wins. ``zeppelin config --dump`` writes every key at its default.
Paths are read from the current directory, as on the command line.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from zeppelin.schemas.common import InputError

__all__ = ["dump", "expand", "keys_of"]

SECTIONS = ("plan", "compare", "demo", "run")


def keys_of(section: str) -> dict[str, tuple[str, type, Any, str]]:
    """``section``'s keys: name -> (flag, kind, default, help); ``...``: required."""
    if section == "run":
        from zeppelin.runtime.config import LaunchConfig, RunConfig, flag_specs

        return {s.name: (s.flags[0] if s.flags else "", s.kind, s.default, s.help)
                for s in (*flag_specs(RunConfig), *flag_specs(LaunchConfig))}
    from zeppelin.planner.tools.config import COMMANDS

    return {f.name: (f.flag, list if f.multiple else f.kind, f.default, f.help)
            for f in COMMANDS[section] if not f.eager and not f.hidden}


def _read(path: str) -> dict[str, Any]:
    import tomllib

    from zeppelin.schemas.io.safefiles import read_input_bytes

    try:
        doc = tomllib.loads(read_input_bytes(path, "job file").decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"not a TOML job file: {e}", source=path) from None
    for name, table in doc.items():
        if name not in SECTIONS or not isinstance(table, dict):
            raise InputError(f"[{name}] is not a table of the job file (tables: {', '.join(SECTIONS)})", source=path)
    return doc


def _argv(section: str, table: dict[str, Any], path: str) -> list[str]:
    """The flags of ``table``'s keys (checked against ``section``'s options)."""
    keys = keys_of(section)
    out: list[str] = []
    for key, value in table.items():
        if key not in keys or not keys[key][0]:
            raise InputError(f"[{section}] has no key {key!r} (`zeppelin config --dump` lists them)", source=path)
        flag, kind, default, _ = keys[key]
        if kind is bool:
            if not isinstance(value, bool):
                raise InputError(f"[{section}] {key} must be true or false (got {value!r})", source=path)
            if value != default:
                if default is True:
                    raise InputError(f"[{section}] {key}: leave it out for its default", source=path)
                out.append(flag)
        elif kind is list:
            values = value if isinstance(value, list) else [value]
            for v in values:
                out += [flag, str(v)]
        elif isinstance(value, (dict, list)):
            raise InputError(f"[{section}] {key} must be a single value (got {value!r})", source=path)
        else:
            out += [flag, _text(value)]
    return out


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _take_config(rest: list[str]) -> tuple[str | None, list[str]]:
    """``--config FILE`` (or ``--config=FILE``) out of ``rest``."""
    for i, a in enumerate(rest):
        if a == "--config":
            if i + 1 >= len(rest):
                raise InputError("--config needs a job file (TOML)")
            return rest[i + 1], rest[:i] + rest[i + 2:]
        if a.startswith("--config="):
            return a.split("=", 1)[1], rest[:i] + rest[i + 1:]
    return None, rest


def expand(args: list[str]) -> list[str]:
    """``args`` with a job file's flags placed after the command name, before the command line's."""
    if not args or args[0] not in SECTIONS:
        return args
    command = args[0]
    path, rest = _take_config(args[1:])
    if path is None:
        return args
    doc = _read(path)
    if command not in doc and not (command != "run" and "plan" in doc):
        raise InputError(f"no [{command}] table in the job file", source=path)
    if command == "run":
        table = dict(doc.get("run", {}))
        plan = table.pop("plan", None) or doc.get("plan", {}).get("output")
        lead = [] if plan is None or (rest and not rest[0].startswith("-")) else [str(plan)]
        return [command, *lead, *_argv("run", table, path), *rest]
    flags: list[str] = []
    if command != "plan":
        from zeppelin.planner.tools.config import PLANNING

        planning = {f.name for f in PLANNING}
        flags = _argv(command, {k: v for k, v in doc.get("plan", {}).items() if k in planning}, path)
    return [command, *flags, *_argv(command, doc.get(command, {}), path), *rest]


def dump() -> str:
    """Every key of every table at its default (a key without one is commented out), with its help."""
    lines = ["# zeppelin job file: `zeppelin plan|compare|demo|run --config FILE`; a flag",
             "# on the command line wins over the file. Keys commented out: their defaults."]
    for section in SECTIONS:
        lines += ["", f"[{section}]"]
        for key, (flag, kind, default, help_text) in keys_of(section).items():
            if not flag:  # the plan positional of run
                lines += ["# the plan to run (default: [plan]'s output)", '# plan = "PLAN"']
                continue
            lines += textwrap.wrap(help_text, 78, initial_indent="# ", subsequent_indent="# ",
                                   break_on_hyphens=False)
            if default is ... or default is None or default == []:
                lines.append(f"# {key} =")
            else:
                value = str(default) if isinstance(default, Path) else default
                lines.append(f"{key} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = json.dumps(str(value))
    if len(text) <= 60 or "," not in text:
        return text
    # a long list of names: a multi-line string whose line-ending backslashes join the lines again
    parts = [p + "," for p in str(value).split(",")]
    parts[-1] = parts[-1][:-1]
    return '"""\\\n' + "\\\n".join(_lines(parts)) + '"""'


def _lines(parts: list[str], width: int = 70) -> list[str]:
    """``parts`` joined into lines of at most ``width`` characters (no part split)."""
    lines = [""]
    for p in parts:
        if lines[-1] and len(lines[-1]) + len(p) > width:
            lines.append("")
        lines[-1] += p
    return lines
