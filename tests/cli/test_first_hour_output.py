"""Outputs and help as a new user meets them: ``-o /dev/null`` plans and discards (the null device
only, never a symlink to it), booleans show as flags in help, and the top-level help wraps at word
boundaries."""

from __future__ import annotations

import os

from tests.support.cli import run_cli

PLAN = ["plan", "-c", "local-cpu:1x2", "--model", "tiny", "--steps", "2", "--tokens-per-step", "2048",
        "--max-seq-len", "1024"]


def test_output_dev_null_plans_and_discards(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli([*PLAN, "-o", os.devnull], capsys)
    assert (code, err) == (0, ""), err
    assert out.startswith("planned (discarded: -o /dev/null): 2 steps planned by zeppelin for tiny on\n")
    assert sorted(os.listdir(tmp_path)) == []  # no temporary file left beside anything
    code, out, err = run_cli([*PLAN, "-o", os.devnull, "--stream"], capsys)
    assert (code, err) == (2, "zeppelin: error: --stream writes the plan as it goes: drop it with -o /dev/null "
                              "(plan and discard)\n")


def test_only_the_null_device_itself_is_discard(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.symlink(os.devnull, "null.plan")  # a link to the null device is still a character device: refused
    code, out, err = run_cli([*PLAN, "-o", "null.plan"], capsys)
    assert (code, err) == (2, "zeppelin: error: null.plan: output path is a character device, not a regular file\n")
    code, out, err = run_cli([*PLAN, "-o", "/dev/zero"], capsys)
    assert (code, err) == (2, "zeppelin: error: /dev/zero: output path is a character device, not a regular file\n")


def _helps() -> list[list[str]]:
    from zeppelin.planner.cli import app, data_app

    names = [[c.name] for c in app.registered_commands] + [["data", c.name] for c in data_app.registered_commands]
    return [[*n, "--help"] for n in names] + [["--help"], ["data", "--help"]]


def test_help_shows_switches_as_flags_without_a_type(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    for argv in _helps():
        code, out, err = run_cli(argv, capsys)
        assert code == 0, (argv, err)
        assert "<bool>" not in out, argv
    code, out, err = run_cli(["plan", "--help"], capsys)
    row = next(ln for ln in out.splitlines() if "--force-profile" in ln)
    assert row.split("--force-profile")[1].split()[0] == "use"  # the help text follows the flag directly
    row = next(ln for ln in out.splitlines() if "--steps" in ln)
    assert "<int>" in row  # an option taking a value still shows its type


def test_top_level_help_breaks_lines_only_where_the_width_does(monkeypatch, capsys):
    """Each command's line in the command list is one paragraph wrapped at 80 columns: a line ends
    early only when the next word would not fit on it."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_cli(["--help"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    first = next(i for i, ln in enumerate(lines) if "Commands" in ln) + 1
    rows = [ln[1:-1] for ln in lines[first:] if ln.startswith("│")]
    indent = len(rows[0]) - len(rows[0][1:].lstrip().split(" ", 1)[1].lstrip()) - 1
    width = len(rows[0]) - 1  # the panel's text ends one column before its border
    checked = 0
    for prev, nxt in zip(rows, rows[1:]):
        if nxt[:indent].strip():  # the next row starts another command
            continue
        word = nxt.split()[0]
        assert len(prev.rstrip()) + 1 + len(word) > width, (prev, nxt)
        checked += 1
    assert checked >= 8  # demo, config, validate, compare, show ... wrap over several lines
    demo = " ".join(ln.strip() for ln in rows[:4])
    assert "defaults (shipped sample manifest, preset cluster and model): data statistics, the cost" in demo
