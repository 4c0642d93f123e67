"""Every line every command prints fits 80 columns when ``COLUMNS=80`` (a terminal of 80 columns,
or a pipe: 80 is also the default there): each command's help, and the output of the commands a
user runs (plan, its options, explain, validate, simulate, show, compare, check, presets, data
stats, the job file's dump, and run's per-step lines). Machine output (``--json``, ``schema``,
plan files) is not for reading and is left out."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["plan", "-c", "local-cpu:1x2", "--model", "tiny", "--steps", "2", "--tokens-per-step", "2048",
        "--max-seq-len", "1024"]


def _long(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if len(ln) > 80]


def _commands() -> list[list[str]]:
    from zeppelin.planner.cli import app, data_app

    names = [[c.name] for c in app.registered_commands] + [["data", c.name] for c in data_app.registered_commands]
    return [[*n, "--help"] for n in names] + [["--help"]]


@pytest.fixture
def cols80(monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_help_fits_80_columns(cols80, capsys):
    for argv in _commands():
        code, out, err = run_cli(argv, capsys)
        assert code == 0, (argv, err)
        assert not _long(out + err), (argv, _long(out + err))


def test_every_command_output_fits_80_columns(cols80, capsys):
    case = cols80 / "cases"
    case.mkdir()
    for suffix in (".json", ".plan"):
        shutil.copy(ROOT / "plans" / f"cpu2x2-tiny-sample--zeppelin{suffix}", case / f"c{suffix}")
    runs = [
        [*PLAN, "-o", "p.jsonl"], [*PLAN, "--explain"], ["plan", "--list-options"], ["validate", "p.jsonl"],
        ["simulate", "p.jsonl"], ["show", "p.jsonl"], ["show", "p.jsonl", "--all"], ["presets"], ["data", "stats"],
        ["compare", "-c", "local-cpu:2x2", "--model", "tiny", "-m", "mixed", "--steps", "2", "--tokens-per-step",
         "16384", "--planners", "zeppelin,te-cp", "--baseline", "te-cp", "-j", "1"],
        ["check", str(case), "-j", "1"], ["config", "--dump"],
    ]
    for argv in runs:
        code, out, err = run_cli(argv, capsys)
        assert code == 0, (argv, err)
        assert not _long(out + err), (argv, _long(out + err))


def test_run_lines_fit_80_columns(zeppelin_bin, tmp_path):
    import os

    env = dict(os.environ, COLUMNS="80", OMP_NUM_THREADS="1")
    r = subprocess.run([zeppelin_bin, *PLAN, "-q", "-o", "p.jsonl"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([zeppelin_bin, "run", "p.jsonl", "--progress", "plain", "--steps", "1", "--lr", "3e-3"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step 0 (1 of 1)" in r.stdout
    assert not _long(r.stdout + r.stderr), _long(r.stdout + r.stderr)
