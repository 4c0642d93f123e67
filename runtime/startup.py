"""Where a job's seconds before its first step go, and one progress line while it starts.

``zeppelin run`` records when it started (``ZEPPELIN_RUN_T0``); every rank marks the end of each
start-up phase (imports, start-up checks, rendezvous, plan scan and process groups, model build) and
of its first steps. Rank 0 prints one line on stderr once the model is built, and writes the marks
as JSON to ``ZEPPELIN_STARTUP_TRACE`` when that is set (``benchmarks/bench_startup.py`` reads it).
Torch-free: the entry point imports it first and marks its own start before importing torch.
"""

from __future__ import annotations

import json
import os
import sys
import time

T0_ENV = "ZEPPELIN_RUN_T0"
TRACE_ENV = "ZEPPELIN_STARTUP_TRACE"
PHASES = ("launch", "imports", "checks", "rendezvous", "groups", "model")

_marks: dict[str, float] = {}


def mark(name: str) -> None:
    """The phase ``name`` ends now (the first mark of a name counts)."""
    _marks.setdefault(name, time.time())


def phases() -> dict[str, float]:
    """Seconds per start-up phase, each from the end of the one before (launch: from ``zeppelin run``
    to this process's first line, i.e. torchrun and the interpreter's start)."""
    t0 = os.environ.get(T0_ENV)
    points = [("t0", float(t0) if t0 else None)] + [(p, _marks.get(p)) for p in PHASES]
    out, prev = {}, None
    for name, t in points:
        if t is not None and prev is not None:
            out[name] = max(t - prev, 0.0)
        if t is not None:
            prev = t
    return out


def line() -> str:
    ph = phases()
    total = sum(ph.values())
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in ph.items())
    from zeppelin.schemas.common import fit_width

    return fit_width(f"zeppelin run: ranks ready after {total:.1f} s ({parts}); first step next (it includes "
                     f"warm-up)")


def report(rank: int, show: bool) -> None:
    """Rank 0, once the model is built: the progress line (``show``)."""
    mark("model")
    if rank == 0 and show:
        print(line(), file=sys.stderr, flush=True)


def write_trace(rank: int) -> None:
    """Rank 0: the marks as JSON to ``ZEPPELIN_STARTUP_TRACE`` (when set)."""
    path = os.environ.get(TRACE_ENV)
    if rank != 0 or not path:
        return
    t0 = os.environ.get(T0_ENV)
    doc = {"t0": float(t0) if t0 else None, "marks": dict(_marks),
           "phases_s": phases()}
    from zeppelin.schemas.io.safefiles import atomic_write_text

    atomic_write_text(path, json.dumps(doc))


def one_line_warnings(rank: int) -> None:
    """Library warnings (torch's FutureWarning, ...) as one line each, once per process and only from
    rank 0, instead of a multi-line block between the step lines of every rank."""
    import warnings

    seen: set[tuple] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if rank != 0 or key in seen:
            return
        seen.add(key)
        text = " ".join(str(message).split())
        print(f"zeppelin run: library warning ({category.__name__}, {os.path.basename(filename)}:{lineno}): "
              f"{text[:300]}", file=sys.stderr, flush=True)

    warnings.showwarning = show
