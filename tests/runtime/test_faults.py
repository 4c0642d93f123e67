"""Faults and signals during `zeppelin run`: the first failure is named, every rank ends, nothing is left.

Each job is watched from outside: the test samples the process tree under ``zeppelin run`` while
it runs (launcher and ranks), and after the job asserts that none of those processes is still
alive. A rank fails on purpose through ``ZEPPELIN_TEST_FAULT=KIND:RANK:STEP`` and logs the moment of
the fault (``ZEPPELIN_TEST_FAULT_LOG``). The tests wait on events and process state (the fault log, the
process table, the job's exit and its one error line), never on a fixed sleep or a wall-clock bound:
``HANG_GUARD_S`` only stops a test that would otherwise hang, and a loaded machine only makes the
tests slower, not red.
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
from types import SimpleNamespace

import pytest

from zeppelin.runtime import launch, lifecycle
from zeppelin.schemas.common import InputError

pytestmark = [pytest.mark.timeout(180)]

ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")
HANG_GUARD_S = 150.0  # the longest any wait below may take; reached only by a hung job


def _plan(tmp: Path, ranks: int, steps: int = 3) -> Path:
    out = tmp / f"p{ranks}.jsonl"
    subprocess.run([ZEPPELIN, "plan", "-c", f"local-cpu:1x{ranks}", "--model", "tiny", "--steps", str(steps),
                    "--tokens-per-step", "256", "--max-seq-len", "64", "--planner", "packed-dp", "--seed", "0",
                    "-o", str(out), "-q"], check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fault-plans")
    return {2: _plan(tmp, 2), 4: _plan(tmp, 4)}


# ---------------------------------------------------------------------------------------------
# the process tree, read from /proc
# ---------------------------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, start time) of every process."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        out[int(d)] = (int(f[1]), f[0], f[19])
    return out


def _descendants(root: int, table) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    seen, todo = set(), [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def _listeners(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that ``pids`` hold (from /proc/net)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                addr, port = f[1].split(":")
                raw = bytes.fromhex(addr)
                if name == "tcp":
                    ip = ".".join(str(b) for b in raw[::-1])
                else:  # four little-endian 32-bit words
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    import ipaddress

                    ip = str(ipaddress.IPv6Address(words))
                out.append(f"{ip}:{int(port, 16)}")
    return out


class Job:
    """`zeppelin run ...` in the background, its process tree sampled while it runs."""

    def __init__(self, args, tmp: Path, fault: str | None = None, nproc: int = 2, env: dict | None = None) -> None:
        self.log = tmp / f"fault-{time.monotonic_ns()}.log"
        extra_env = env
        env = dict(os.environ, OMP_NUM_THREADS="1", ZEPPELIN_TEST_FAULT_LOG=str(self.log))
        env.pop(lifecycle.FAULT_ENV, None)
        if fault:
            env[lifecycle.FAULT_ENV] = fault
        env.update(extra_env or {})
        self.nproc = nproc
        self.p = subprocess.Popen([ZEPPELIN, "run", *map(str, args)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        self.seen: dict[int, str] = {}  # pid -> start time
        self.launcher: int | None = None
        self._stop = threading.Event()
        self._passes = 0  # complete samples of the process table so far
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            table = _proc_table()
            for pid in _descendants(self.p.pid, table):
                self.seen.setdefault(pid, table[pid][2])
                if table[pid][0] == self.p.pid:
                    self.launcher = pid
            self._passes += 1
            self._stop.wait(0.05)

    def wait_for(self, cond, timeout: float = HANG_GUARD_S) -> None:
        t0 = time.monotonic()
        while not cond():
            assert self.p.poll() is None, f"job ended early: {self.p.communicate()}"
            assert time.monotonic() - t0 < timeout, "condition not reached"
            time.sleep(0.05)

    def all_started(self) -> bool:
        return self.launcher is not None and len(self.seen) >= self.nproc + 1

    def fault_time(self) -> float:
        return float(self.log.read_text().split()[3])

    def finish(self, timeout: float = HANG_GUARD_S):
        out, err = self.p.communicate(timeout=timeout)
        self.t_exit = time.time()
        # let the sampler complete one whole pass that began after the exit, then stop it
        first = self._passes + 2
        deadline = time.monotonic() + HANG_GUARD_S
        while self._passes < first and self._t.is_alive():
            assert time.monotonic() < deadline, "the process-table sampler stopped sampling"
            time.sleep(0.01)
        self._stop.set()
        self._t.join()
        return self.p.returncode, out, err

    def leftovers(self, wait_s: float = HANG_GUARD_S) -> list[int]:
        """Processes of the job still alive (zombies awaiting their reaper do not count), polled until
        none is left; ``wait_s`` only bounds a job whose processes never end."""
        deadline = time.monotonic() + wait_s
        while True:
            table = _proc_table()
            alive = [pid for pid, st in self.seen.items() if pid in table and table[pid][2] == st
                     and table[pid][1] != "Z"]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("zeppelin:")]


# ---------------------------------------------------------------------------------------------
# a failing rank: named at once, the others stopped, nothing left
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fault, nproc, want", [
    ("kill:1:1", 2, "zeppelin: error: job failed: rank 1 was killed by SIGKILL"),
    ("raise:0:1", 2, "zeppelin: error: job failed: rank 0: RuntimeError: injected fault at step 1"),
    ("oom:1:1", 2, ("zeppelin: error: job failed: rank 1 exited with code 137 (128 + SIGKILL: killed, e.g. out of "
                    "memory)")),
    ("stall:1:1", 2, "zeppelin: error: job failed: rank 1 is slow (in step 1, no progress for "),
    ("kill:2:1", 4, "zeppelin: error: job failed: rank 2 was killed by SIGKILL"),
])
def test_failing_rank_is_named_and_every_rank_ends(plans, tmp_path, fault, nproc, want):
    job = Job([plans[nproc], "--timeout", "3", "--progress", "none", "--metrics", tmp_path / "m.jsonl"], tmp_path,
              fault=fault, nproc=nproc)
    rc, _, err = job.finish()
    assert rc == 1, err
    lines = _errors(err)
    assert lines[-1].startswith(want), err
    assert sum("job failed" in ln for ln in lines) == 1 and not any("interrupted" in ln for ln in lines), err
    if fault.startswith("stall"):
        assert "rank 0 gave up waiting for it: RuntimeError: " in lines[-1] and "Timed out" in lines[-1], err
    assert "Traceback" not in err
    assert job.fault_time() <= job.t_exit, err  # the fault logged its moment, then the job ended
    assert len(job.seen) >= nproc + 1, (job.seen, err)  # the launcher and every rank were seen
    assert job.leftovers() == [], err


# ---------------------------------------------------------------------------------------------
# signals to zeppelin run, the launcher killed, zeppelin run killed
# ---------------------------------------------------------------------------------------------


def _stalled_job(plans, tmp_path) -> Job:
    """A 2-rank job whose rank 1 sleeps in step 1 while rank 0 waits in a collective (60 s timeout)."""
    job = Job([plans[2], "--timeout", "60", "--progress", "none", "--metrics", tmp_path / "m.jsonl"], tmp_path,
              fault="stall:1:1")
    job.wait_for(lambda: job.log.exists() and job.all_started())
    return job


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_to_zeppelin_run_ends_every_rank(plans, tmp_path, sig):
    job = _stalled_job(plans, tmp_path)
    if sig == signal.SIGTERM:  # while the job runs: every listening socket is on the loopback interface
        listening = _listeners(set(job.seen))
        assert listening, "the ranks hold listening sockets (gloo)"
        assert all(a.startswith(("127.", "::1:")) for a in listening), listening
    job.p.send_signal(sig)
    rc, _, err = job.finish()
    assert rc == 128 + sig, err
    # the signal ended the job (its line says so), not the stalled collective's 60 s timeout
    assert _errors(err) == [f"zeppelin: error: job stopped: received {sig.name}; every rank ended"], err
    assert job.leftovers() == []


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["fork", "exec"])
def test_local_ranks_forked_or_fresh_interpreters(plans, tmp_path, launch):
    """A local launch on a CPU build of torch forks its ranks from the launcher, each named
    zeppelin-rankR; ZEPPELIN_LAUNCH=exec (what a CUDA build gets) starts each rank as an interpreter
    of its own. Either way a signal to zeppelin run ends every rank."""
    job = Job([plans[2], "--timeout", "60", "--progress", "none", "--metrics", tmp_path / "m.jsonl"], tmp_path,
              fault="stall:1:1", env={"ZEPPELIN_LAUNCH": launch})
    job.wait_for(lambda: job.log.exists() and job.all_started())
    table = _proc_table()
    ranks = [pid for pid in job.seen if pid in table and table[pid][0] == job.launcher]
    names = sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in ranks)
    if launch == "fork":
        assert names == ["zeppelin-rank0", "zeppelin-rank1"], names
    else:
        assert len(names) == 2 and not any(n.startswith("zeppelin-rank") for n in names), names
    job.p.send_signal(signal.SIGTERM)
    rc, _, err = job.finish()
    assert rc == 128 + signal.SIGTERM, err
    assert _errors(err) == ["zeppelin: error: job stopped: received SIGTERM; every rank ended"], err
    assert job.leftovers() == []


@pytest.mark.slow
def test_killing_the_launcher_ends_every_rank(plans, tmp_path):
    job = _stalled_job(plans, tmp_path)
    os.kill(job.launcher, signal.SIGKILL)
    rc, _, err = job.finish()
    assert rc == 1
    want = f"zeppelin: error: the launcher (pid {job.launcher}) was killed by SIGKILL; every rank was stopped"
    assert _errors(err) == [want], err
    assert job.leftovers() == []


@pytest.mark.slow
def test_killing_zeppelin_run_ends_the_launcher_and_every_rank(plans, tmp_path):
    # nothing is left to report; the launcher dies with zeppelin run, the ranks with the launcher
    job = _stalled_job(plans, tmp_path)
    job.p.send_signal(signal.SIGKILL)
    job.finish()
    assert job.leftovers() == []


# ---------------------------------------------------------------------------------------------
# --verify: waiting for the verdict is not a communication timeout
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_verify_waits_for_the_reference_beyond_the_communication_timeout(plans, tmp_path):
    # rank 0's reference of step 0 takes 6 s longer than usual; the communication timeout is 3 s
    args = [plans[2], "--steps", "1", "--verify", "--timeout", "3", "--progress", "none", "--metrics",
            tmp_path / "m.jsonl"]
    job = Job(args, tmp_path, fault="slowverify:0:0", env={"ZEPPELIN_TEST_FAULT_SLEEP": "6"})
    rc, out, err = job.finish()
    assert rc == 0, err
    assert " - ok" in out
    # with a verification timeout shorter than the reference, the ranks say what they waited for
    job = Job([*args, "--verify-timeout", "1.5"], tmp_path, fault="slowverify:0:0", env={"ZEPPELIN_TEST_FAULT_SLEEP": "6"})
    rc, _, err = job.finish()
    assert rc == 1
    last = _errors(err)[-1]
    assert last.startswith("zeppelin: error: job failed: rank 0 is slow (in verify of step 0, no progress for "), err
    assert last.endswith("rank 1 gave up waiting for it: step 0: --verify: no verdict from rank 0 within "
                         "--verify-timeout 1.5 s (its single-process reference did not finish; raise "
                         "--verify-timeout)"), err
    assert job.leftovers() == []


# ---------------------------------------------------------------------------------------------
# checkpoint directory: one run at a time, writable, same hyperparameters on --resume
# ---------------------------------------------------------------------------------------------


def test_checkpoint_dir_lock_and_writability(tmp_path):
    d = tmp_path / "ck"
    lock = lifecycle.prepare_checkpoint_dir(d)
    with pytest.raises(InputError, match=r"--checkpoint-dir is in use by another run \(pid \d+\); one run at a "
                                         r"time may write a checkpoint directory"):
        lifecycle.prepare_checkpoint_dir(d)
    lock.release()
    lifecycle.prepare_checkpoint_dir(d).release()  # free again
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(InputError, match="--checkpoint-dir is not a directory"):
        lifecycle.prepare_checkpoint_dir(f)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(InputError, match=r"--checkpoint-dir is not writable \(Permission denied\)"):
                lifecycle.prepare_checkpoint_dir(ro)
        finally:
            ro.chmod(0o700)
    assert sorted(p.name for p in d.iterdir()) == [lifecycle.LOCK_NAME]  # the write probe is gone


def test_resume_hyperparameter_check():
    saved = {"lr": 0.001, "weight_decay": 0.0, "seed": 0}
    lifecycle.check_resume_hyperparameters(saved, dict(saved))
    lifecycle.check_resume_hyperparameters(None, dict(saved))  # a checkpoint without a record
    with pytest.raises(InputError) as e:
        lifecycle.check_resume_hyperparameters(saved, {"lr": 0.002, "weight_decay": 0.1, "seed": 0})
    assert str(e.value) == ("--resume with other hyperparameters than the checkpoint was trained with: --lr 0.002 "
                            "(checkpoint: 0.001), --weight-decay 0.1 (checkpoint: 0.0); pass the checkpoint's "
                            "values, or start a new --checkpoint-dir")


@pytest.mark.slow
def test_checkpoint_dir_locked_and_resume_hyperparameters_end_to_end(plans, tmp_path):
    d = tmp_path / "ck"
    base = [plans[2], "--progress", "none", "--metrics", tmp_path / "m.jsonl", "--checkpoint-dir", d]
    rc, _, err = Job([*base, "--steps", "1"], tmp_path).finish()
    assert rc == 0, err
    assert not list(d.glob(".zeppelin-write-test-*"))
    rc, _, err = Job([*base, "--steps", "2", "--resume", "--lr", "0.002"], tmp_path).finish()
    assert rc == 2  # refused by the command line, before any rank starts
    assert _errors(err) == [
        f"zeppelin: error: {d / 'ckpt-000001'}: --resume with other hyperparameters than the checkpoint was trained "
        "with: --lr 0.002 (checkpoint: 0.001); pass the checkpoint's values, or start a new --checkpoint-dir"], err
    lock = lifecycle.prepare_checkpoint_dir(d)  # another run holds the directory
    try:
        rc, _, err = Job([*base, "--steps", "2", "--resume"], tmp_path).finish()
    finally:
        lock.release()
    assert rc == 2
    assert re.fullmatch(r"zeppelin: error: job failed: rank [01]: (rank 0: )?" + re.escape(
        f"{d}: --checkpoint-dir is in use by another run (pid {os.getpid()}); one run at a time may write a checkpoint "
        "directory"), _errors(err)[-1]), err


# ---------------------------------------------------------------------------------------------
# rendezvous, launcher decisions
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rendezvous_that_cannot_form_fails_within_the_timeout(plans, tmp_path):
    # node 0 of a two-machine job whose second machine never starts: the rendezvous timeout given
    # (2 s) ends it, as its error line says; finish()'s hang guard only stops a job that never ends
    rc, _, err = Job([plans[2], "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "0", "--master-addr",
                      "127.0.0.1", "--master-port", "29761", "--timeout", "2", "--progress", "none"],
                     tmp_path).finish()
    assert rc == 1
    want = ("zeppelin: error: job failed to start: DistStoreError: Timed out after 3 seconds waiting for clients. "
            "1/2 clients joined. (rendezvous timeout 2 s)")
    assert _errors(err) == [want], err


def test_fault_specs():
    assert lifecycle.parse_fault("kill:1:2") == ("kill", 1, 2)
    assert lifecycle.parse_fault("1:2:exit") == ("exit", 1, 2)
    assert lifecycle.parse_fault("nope:1:2") is None
    assert lifecycle.parse_fault("kill:x:2") is None
    assert lifecycle.parse_fault("") is None


def test_local_launch_only_for_one_machine_options():
    assert launch._local_plan(["--nproc-per-node=4", "--nnodes=1", "--standalone"]) == 4
    assert launch._local_plan(["--nproc-per-node", "2"]) == 2
    assert launch._local_plan(["--nproc-per-node=2", "--nnodes=2", "--master-addr=h"]) is None
    assert launch._local_plan(["--nproc-per-node=2", "--max-restarts=1"]) is None  # torchrun's business
    assert launch._worker_timeout(["p.jsonl", "--timeout", "7"]) == 7.0
    assert launch._worker_timeout(["p.jsonl", "--timeout=nan"]) == launch.DEFAULT_TIMEOUT_S


def test_classify_names_the_slow_rank_not_the_rank_that_timed_out(tmp_path):
    err = {"rank": 0, "time": time.time(), "message": "RuntimeError: Timed out waiting 3000ms for recv", "code": 1}
    (tmp_path / "rank0.json").write_text(json.dumps(err))
    hb = lifecycle.Heartbeat(tmp_path, 1)
    hb.step(4)
    hb.close()
    msg, code = launch.classify_failure(tmp_path, {0: SimpleNamespace(exitcode=1)}, alive=[1])
    assert code == 1
    assert msg.startswith("rank 1 is slow (in step 4, no progress for ")
    assert msg.endswith("rank 0 gave up waiting for it: RuntimeError: Timed out waiting 3000ms for recv")
    # a rank that died without a word is the cause, not the slow-looking survivors
    msg, _ = launch.classify_failure(tmp_path, {0: SimpleNamespace(exitcode=1), 2: SimpleNamespace(exitcode=-9)},
                                     alive=[1])
    assert msg.startswith("rank 2 was killed by SIGKILL")
    # a failure that is not a timeout is the cause even while other ranks still run
    (tmp_path / "rank0.json").write_text(json.dumps(err | {"message": "ValueError: bad"}))
    assert launch.classify_failure(tmp_path, {0: SimpleNamespace(exitcode=1)}, alive=[1]) == ("rank 0: ValueError: bad",
                                                                                              1)


@pytest.mark.parametrize("value, message", [
    ("0", "--verify-timeout must be greater than 0 (got 0)"),
    ("nan", "--verify-timeout must be a finite number (got nan)"),
])
def test_verify_timeout_is_bounded_before_any_process_starts(plans, value, message):
    p = subprocess.run([ZEPPELIN, "run", str(plans[2]), "--verify", "--verify-timeout", value], capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"zeppelin: error: {message}"]
