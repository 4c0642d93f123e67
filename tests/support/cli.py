"""Running the ``zeppelin`` command in this process (tests that read its output through capsys)."""

from __future__ import annotations

import pytest

from zeppelin.planner.cli import main


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``zeppelin ARGV`` in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err
