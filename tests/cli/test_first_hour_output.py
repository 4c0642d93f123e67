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
    assert out.startswith("planned (discarded: -o /dev/null): 2 steps planned by zeppelin for tiny on ")
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
