"""Training before the whole plan exists: ``zeppelin plan --stream`` + ``zeppelin run --follow``.

The reader side in one process (a writer thread, slowed): every step comes back as soon as its
chained digest vouches for it, the wait is reported, an edit while streaming and a planner that
stops are refused in one line. End to end: a planner slowed artificially (its step function sleeps)
streams while ``zeppelin run --follow`` trains; the run waits for it saying so, the plan's bytes
equal the offline plan's, and a run stopped mid-stream resumes from its checkpoint to the same
losses as an uninterrupted run of the offline plan.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.runtime.test_fsdp import _plan
from tests.runtime.test_hf import ZEPPELIN
from zeppelin.schemas.common import InputError
from zeppelin.schemas.io.stream import FollowReader, StreamingPlanWriter, chain_path
from zeppelin.schemas.plan import plan_text


def _stream(path: Path, header, steps, delay: float, stop_after: int | None = None, edit=None) -> threading.Thread:
    """A writer thread: the steps one by one, ``delay`` s apart (``stop_after``: it fails then;
    ``edit(path)``: called after the second step)."""

    def run():
        try:
            with StreamingPlanWriter(path, header) as w:
                for k, st in enumerate(steps):
                    time.sleep(delay)
                    if stop_after is not None and k == stop_after:
                        raise RuntimeError("planner failed")
                    w.write(st)
                    if edit is not None and k == 1:
                        edit(path)
        except RuntimeError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return t


def test_follow_reader_waits_and_returns_verified_steps(tmp_path):
    header, steps = _plan("zeppelin")
    path = tmp_path / "p.jsonl"
    waits = []
    t = _stream(path, header, steps, delay=0.4)
    r = FollowReader(path, notice_s=0.1, on_wait=lambda k, s: waits.append(k))
    assert r.following and chain_path(path).exists()
    got = [r.step(k) for k in range(len(steps))]
    t.join(10)
    assert [s.model_dump() for s in got] == [s.model_dump() for s in steps]
    assert waits and set(waits) <= set(range(len(steps)))
    assert path.read_text() == plan_text(header, steps)  # the offline bytes; the chain file is gone
    assert not chain_path(path).exists()
    done = FollowReader(path)  # a finished stream reads like any plan
    assert not done.following and done.step(4).model_dump() == steps[4].model_dump()


def test_followed_steps_already_read_still_give_a_checkpoint_its_plan_prefix(tmp_path):
    """A checkpoint records the hash of the plan's steps so far; a followed plan is read once, in
    order, so those hashes are kept as steps pass (a checkpoint after step 3 needs steps 0-3)."""
    from zeppelin.runtime.checkpoint import plan_prefix
    from zeppelin.schemas.plan import PlanReader

    header, steps = _plan("zeppelin")
    path = tmp_path / "p.jsonl"
    t = _stream(path, header, steps, delay=0.05)
    r = FollowReader(path)
    assert r.following
    r.step(1)  # step 0 passes unread by the caller
    r.step(3)
    got = plan_prefix(r, 4)
    with pytest.raises(InputError):
        r.step(0)  # read in order: step 0 itself is gone
    t.join(10)
    assert got == plan_prefix(PlanReader(path), 4)


def test_follow_reader_refuses_an_edit_while_streaming(tmp_path):
    header, steps = _plan("zeppelin")
    path = tmp_path / "p.jsonl"

    edited = threading.Event()

    def edit(p):
        with open(p, "r+b") as fh:  # one digit of a sample id of step 0, in place
            data = fh.read()
            i = data.index(b'"sample_id":', data.index(b"\n")) + len(b'"sample_id":')
            fh.seek(i)
            fh.write(b"9" if data[i:i + 1] != b"9" else b"8")
        edited.set()

    t = _stream(path, header, steps, delay=0.5, edit=edit)
    assert edited.wait(30)  # while three steps are still to come
    r = FollowReader(path)
    with pytest.raises(InputError) as e:
        r.step(0)
    assert str(e.value) == f"{path}: step 0: the record does not match its chained digest (the plan was edited while it was written)"
    t.join(10)


def test_follow_reader_says_when_the_planner_stopped(tmp_path):
    header, steps = _plan("zeppelin")
    path = tmp_path / "p.jsonl"
    t = _stream(path, header, steps, delay=0.6, stop_after=2)
    r = FollowReader(path)
    assert r.step(0).step == 0 and r.step(1).step == 1
    with pytest.raises(InputError) as e:
        r.step(2)
    assert str(e.value) == f"{path}: step 2: the planner stopped before writing it (the plan stream holds 2 of 5 steps)"
    t.join(10)
    assert not path.exists() and not chain_path(path).exists()  # nothing half-written stays behind


SLOW_PLANNER = """
import os, sys, time
from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
plan_step = ZeppelinPlanner.plan_step
planned = []
def gated(self, *a, **k):
    # the first steps at once; the others only once the test says so (a file named 'release'), so the
    # run is sure to catch up with the planner and wait for it, whatever the machine's speed
    if len(planned) >= int(sys.argv[1]):
        while not os.path.exists("release"):
            time.sleep(0.05)
    planned.append(1)
    return plan_step(self, *a, **k)
ZeppelinPlanner.plan_step = gated
from zeppelin.planner.cli import main
main(sys.argv[2:])
"""
PLAN = ["plan", "-m", "m.jsonl", "-c", "local-cpu:1x2", "--model", "tiny", "--steps", "8", "--tokens-per-step", "2048",
        "--max-seq-len", "1024", "-q"]
RUN = ["--progress", "plain", "--checkpoint-dir", "ck", "--checkpoint-every", "1"]


def _losses(path: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_run_follows_a_slow_planner_and_resumes_mid_stream(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in
                                              [300, 500, 700, 900, 120, 60, 33, 1000] * 8))
    (tmp_path / "slow.py").write_text(SLOW_PLANNER)

    def z(*args):
        return subprocess.Popen([ZEPPELIN, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    off = z(*PLAN, "-o", "off.jsonl")
    assert off.wait(120) == 0, off.stderr.read()
    ref = z("run", "off.jsonl", "--progress", "none", "--metrics", "ref.jsonl")
    assert ref.wait(200) == 0, ref.stderr.read()
    planner = subprocess.Popen([sys.executable, "slow.py", "4", *PLAN, "-o", "st.jsonl", "--stream"], cwd=tmp_path,
                               env=env, stderr=subprocess.PIPE, text=True)
    with open(tmp_path / "out.txt", "w") as fh:
        run = subprocess.Popen([ZEPPELIN, "run", "st.jsonl", "--follow", *RUN, "--metrics", "m.jsonl"], cwd=tmp_path,
                               env=env, stdout=fh, stderr=subprocess.PIPE, text=True)
    # stop the run mid-stream: once it has checkpointed two steps and waits for the (held) planner;
    # the deadline only guards against a hang
    deadline = time.monotonic() + 200
    while not ((tmp_path / "ck" / "ckpt-000002").exists() and "waiting for the planner to write step"
               in (tmp_path / "out.txt").read_text()):
        assert run.poll() is None, run.stderr.read()
        assert time.monotonic() < deadline, (tmp_path / "out.txt").read_text()
        time.sleep(0.1)
    assert planner.poll() is None  # the plan is still being written
    run.send_signal(signal.SIGTERM)
    err = run.communicate(timeout=60)[1]
    assert run.returncode == 128 + signal.SIGTERM, err
    (tmp_path / "release").write_text("")  # the planner goes on; the resumed run follows it to the end
    assert re.search(r"^zeppelin run: waiting for the planner to write step \d+ \(\d+ s so far\)$",
                     (tmp_path / "out.txt").read_text(), re.MULTILINE)
    again = z("run", "st.jsonl", "--follow", "--resume", *RUN, "--metrics", "m.jsonl")
    err2 = again.communicate(timeout=200)[1]
    assert again.returncode == 0, err2
    assert planner.wait(60) == 0, planner.stderr.read()
    assert (tmp_path / "st.jsonl").read_bytes() == (tmp_path / "off.jsonl").read_bytes()
    assert not chain_path(tmp_path / "st.jsonl").exists()
    done = _losses(tmp_path / "m.jsonl")
    want = _losses(tmp_path / "ref.jsonl")
    assert len(want) == 8 and done[-4:] == want[-4:] and set(done) <= set(want), (done, want)
