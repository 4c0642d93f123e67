"""Hostile inputs, round three, item 8: blame and signals.

The rank that failed first is named - on rank 0 as on rank 1, whether it was killed, exited without a
word, stalled or was stopped by a signal from outside the job during a checkpoint save - never a
peer that then lost its connection to it; a SIGTERM that lands while a writer swaps its signal
handlers is taken, not dropped; a stop signal that lands in a finalizer ends the rank quietly.
docs/RELIABILITY.md maps each guarantee to these tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.runtime.test_faults import Job, _errors, _plan
from zeppelin.runtime import launch

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def plan2(tmp_path_factory):
    return _plan(tmp_path_factory.mktemp("blame-plans"), 2)


def _record(d: Path, name: str, **rec) -> None:
    (d / name).write_text(json.dumps(rec))


# ---------------------------------------------------------------------------------------------
# the launcher's verdict from the records (cheap: no process)
# ---------------------------------------------------------------------------------------------


def test_a_signal_from_outside_is_the_cause_ahead_of_later_reports(tmp_path):
    t = time.time()
    # SIGTERM to rank 0 during a save: rank 1 reports the broken save first, rank 0 its own error later
    _record(tmp_path, "signal-rank0.json", rank=0, time=t, signal=int(signal.SIGTERM))
    _record(tmp_path, "rank1.json", rank=1, time=t + 0.1, message="CheckpointError: rank 0 failed", code=1)
    _record(tmp_path, "rank0.json", rank=0, time=t + 0.2, message="CheckpointError: interrupted", code=1)
    failures = {0: SimpleNamespace(exitcode=1), 1: SimpleNamespace(exitcode=1)}
    msg, code = launch.classify_failure(tmp_path, failures, alive=[], stopped=frozenset({75}))
    assert code == 1
    assert msg == "rank 0 was stopped by SIGTERM from outside the job (then rank 1: CheckpointError: rank 0 failed)"


def test_a_lost_peer_is_never_the_cause_of_its_own_loss(tmp_path):
    t = time.time()
    _record(tmp_path, "rank1.json", rank=1, time=t, code=1,
            message="RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40110")
    _record(tmp_path, "rank0.json", rank=0, time=t + 0.5, message="ValueError: bad shard", code=1)
    failures = {0: SimpleNamespace(exitcode=1), 1: SimpleNamespace(exitcode=1)}
    assert launch.classify_failure(tmp_path, failures, alive=[]) == ("rank 0: ValueError: bad shard", 1)
    (tmp_path / "rank0.json").unlink()  # only the lost peer reported: it is all there is to say
    failures = {1: SimpleNamespace(exitcode=1)}
    msg, _ = launch.classify_failure(tmp_path, failures, alive=[])
    assert msg.startswith("rank 1: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer")


# ---------------------------------------------------------------------------------------------
# end to end: a fault on rank 0 names rank 0
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fault, want", [
    ("kill:0:1", "zeppelin: error: job failed: rank 0 was killed by SIGKILL"),
    ("exit:0:1", "zeppelin: error: job failed: rank 0 exited with code 3 without an error message"),
    ("oom:0:1", "zeppelin: error: job failed: rank 0 exited with code 137 (128 + SIGKILL: killed, e.g. out of memory)"),
    ("stall:0:1", "zeppelin: error: job failed: rank 0 is slow (in step 1, no progress for "),
])
def test_a_fault_on_rank_0_names_rank_0(plan2, tmp_path, fault, want):
    # a peer notices a dead rank at once; only the stall needs the timeout (a long one elsewhere: a slow
    # start on a loaded machine is not taken for the fault)
    timeout = "4" if fault.startswith("stall") else "60"
    job = Job([plan2, "--timeout", timeout, "--progress", "none", "--metrics", tmp_path / "m.jsonl"], tmp_path,
              fault=fault)
    rc, _, err = job.finish()
    assert rc == 1, err
    lines = _errors(err)
    assert lines[-1].startswith(want), err
    assert sum("job failed" in ln for ln in lines) == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert job.leftovers() == [], err


def _rank_pid(job: Job, rank: int) -> int:
    """A rank's process: by its name where the launcher forked it, else by its environment."""
    for pid in job.seen:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if name == f"zeppelin-rank{rank}":
            return pid
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    raise AssertionError(f"rank {rank} not found among {sorted(job.seen)}")


@pytest.mark.slow
def test_sigterm_to_rank_0_during_a_save_names_rank_0(plan2, tmp_path):
    # rank 1 enters the save after step 0 late (a 15 s sleep), rank 0 waits inside the save: SIGTERM it
    ck = tmp_path / "ck"
    job = Job([plan2, "--timeout", "60", "--progress", "none", "--metrics", tmp_path / "m.jsonl", "--checkpoint-dir", ck,
               "--checkpoint-every", "1"], tmp_path, fault="slowsave:1:0", env={"ZEPPELIN_TEST_FAULT_SLEEP": "15"})
    job.wait_for(lambda: job.log.exists() and job.all_started())
    os.kill(_rank_pid(job, 0), signal.SIGTERM)
    rc, _, err = job.finish()
    assert rc == 1, err
    assert _errors(err)[-1].startswith("zeppelin: error: job failed: rank 0 was stopped by SIGTERM from outside the "
                                       "job"), err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert sorted(os.listdir(ck)) == [".zeppelin.lock"]  # no save was completed, none half-written
    assert job.leftovers() == [], err


# ---------------------------------------------------------------------------------------------
# signals while handlers are swapped; a stop inside a finalizer
# ---------------------------------------------------------------------------------------------

_SWAP = r"""
import os, signal, sys
from zeppelin.schemas.io.safefiles import atomic_write
from zeppelin.schemas.io.signals import Terminated

real, when = signal.signal, sys.argv[2]
def swap(sig, h):
    old = real(sig, h)
    # SIGTERM the moment a handler is installed (before the writer has recorded the old one) or the
    # moment the default is back (before the writer's final check)
    if sig == signal.SIGTERM and (h is signal.SIG_DFL) == (when == "restore"):
        os.kill(os.getpid(), signal.SIGTERM)
    return old
signal.signal = swap
try:
    with atomic_write(sys.argv[1]) as fh:
        fh.write("new\n")
except Terminated as e:
    print("terminated", e.signum, real(signal.SIGTERM, signal.SIG_DFL) is signal.SIG_DFL)
"""


@pytest.mark.parametrize("when", ["install", "restore"])
def test_a_sigterm_while_the_write_handlers_are_swapped_is_taken(tmp_path, when):
    out = tmp_path / "o.txt"
    out.write_text("old\n")
    p = subprocess.run([sys.executable, "-c", _SWAP, str(out), when], capture_output=True, text=True, timeout=60,
                       check=False)
    # taken as Terminated, the previous (default) handler restored; never the process dying mid-write
    assert (p.returncode, p.stdout) == (0, f"terminated {int(signal.SIGTERM)} True\n"), p.stderr
    assert sorted(os.listdir(tmp_path)) == ["o.txt"]  # no temporary file left
    # a signal before the rename leaves the output untouched; one while the default comes back, after it
    assert out.read_text() == ("old\n" if when == "install" else "new\n")


_FINALIZER = r"""
import os, signal, sys, time
from zeppelin.runtime import __main__ as worker

sys.unraisablehook = worker._unraisable(sys.unraisablehook)
signal.signal(signal.SIGTERM, worker._on_stop_signal)

class Closing:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the stop lands here, inside a finalizer

Closing()
print("ran on")
"""


def test_a_stop_inside_a_finalizer_ends_the_rank_quietly(tmp_path):
    env = dict(os.environ, ZEPPELIN_ERROR_DIR=str(tmp_path), RANK="1")
    p = subprocess.run([sys.executable, "-c", _FINALIZER], capture_output=True, text=True, timeout=60, env=env,
                       check=False)
    assert (p.returncode, p.stdout, p.stderr) == (128 + signal.SIGTERM, "", "")
    rec = json.loads((tmp_path / "signal-rank1.json").read_text())  # the stop's moment is recorded
    assert (rec["rank"], rec["signal"]) == (1, int(signal.SIGTERM))
