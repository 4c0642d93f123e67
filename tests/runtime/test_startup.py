"""`zeppelin run`'s start-up accounting (runtime/startup.py): phases are consecutive intervals from the
command's start, and library warnings reach the terminal as one line, once, from rank 0."""

from __future__ import annotations

import warnings

import pytest

from zeppelin.runtime import startup


def test_phases_are_consecutive_from_the_command_start(monkeypatch):
    monkeypatch.setenv(startup.T0_ENV, "100.0")
    monkeypatch.setattr(startup, "_marks", {"launch": 100.5, "imports": 103.0, "checks": 103.1,
                                            "rendezvous": 103.4, "groups": 103.5, "model": 105.0})
    ph = startup.phases()
    assert ph == pytest.approx({"launch": 0.5, "imports": 2.5, "checks": 0.1, "rendezvous": 0.3, "groups": 0.1,
                                "model": 1.5})
    assert startup.line().startswith("zeppelin run: ranks ready after 5.0 s (launch 0.5 s, imports 2.5 s, ")


@pytest.mark.parametrize("rank,lines", [(0, 1), (1, 0)])
def test_library_warnings_one_line_once_from_rank_0(capsys, monkeypatch, rank, lines):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    startup.one_line_warnings(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for _ in range(3):
            warnings.warn("`torch.x` is deprecated.\n  Use y.", FutureWarning, stacklevel=1)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == lines
    if lines:
        assert err[0].startswith("zeppelin run: library warning (FutureWarning, test_startup.py:")
        assert err[0].endswith("): `torch.x` is deprecated. Use y.")
