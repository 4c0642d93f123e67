"""Process lifecycle of a job: who owns which process, how every process ends, faults on purpose.

The chain of processes of ``zeppelin run`` on one machine::

    zeppelin run  --(new session / process group)-->  launcher  -->  rank 0 .. rank N-1

* ``zeppelin run`` starts the launcher as the leader of a new process group (:func:`run_owned`)
  and owns that group: SIGINT, SIGTERM and SIGHUP are forwarded to the launcher, which stops the
  ranks; whatever is still alive after the grace period is killed with SIGKILL (the whole group),
  and the group is swept once more when the launcher has exited, so no rank outlives the command.
  If the launcher dies on its own (killed), ``zeppelin run`` says so in one line and kills the
  group.
* The launcher and every rank die with their parent (:func:`die_with_parent`:
  ``prctl(PR_SET_PDEATHSIG)`` on Linux, and a thread polling the parent pid elsewhere and as a
  second line of defence): killing ``zeppelin run`` ends the launcher, killing the launcher ends
  the ranks.
* A rank records the step it is at (:class:`Heartbeat`) so that the launcher can tell a rank that
  is merely slow from the ranks that timed out waiting for it.

Checkpoint directories (:func:`prepare_checkpoint_dir`): one run at a time holds an exclusive
``flock`` on ``<dir>/.zeppelin.lock`` for its whole life, and the directory is checked for
writability before training starts. :func:`check_resume_hyperparameters` refuses a ``--resume``
whose hyperparameters differ from the ones the checkpoint was trained with.

Fault injection for tests (:func:`maybe_fault`), ``ZEPPELIN_TEST_FAULT=KIND:RANK:STEP`` with KIND one of
``kill`` (SIGKILL itself), ``oom`` (exit 137, as a process killed by the out-of-memory killer
appears through a shell or container runtime), ``raise`` (a Python exception), ``stall`` (sleep
until stopped), ``exit`` (``os._exit(3)`` without a report), ``slowverify`` (rank 0's ``--verify``
reference of that step takes ``$ZEPPELIN_TEST_FAULT_SLEEP`` s, default 3, longer), ``slowsave`` (the
rank enters the checkpoint save after that step as much later, its peers waiting inside the save). The older form ``RANK:STEP:exit|raise`` is accepted too.
With ``ZEPPELIN_TEST_FAULT_LOG=FILE`` the rank writes ``KIND RANK STEP TIME`` there just before the fault
(tests measure the time from the fault to the end of the job).
These ``ZEPPELIN_TEST_*`` variables are a test hook, named as one; no other variable of the caller's
environment steers a job (the launcher makes ``ZEPPELIN_ERROR_DIR`` and ``ZEPPELIN_STORE_FILE`` for
each job and ignores inherited ones).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from zeppelin.schemas.common import InputError

FAULT_ENV = "ZEPPELIN_TEST_FAULT"
PARENT_ENV = "ZEPPELIN_PARENT_PID"
#: exit code of a rank that left because another rank reports the job's failure (no report of its own)
PEER_STOPPED_EXIT = 75
FAULT_KINDS = ("kill", "oom", "raise", "stall", "exit", "slowverify", "slowsave")
#: the slow kinds and where they act: rank 0's --verify reference, a rank's part of a checkpoint save
SLOW_FAULTS = {"slowverify": "verify", "slowsave": "save"}
FAULT_LOG_ENV = "ZEPPELIN_TEST_FAULT_LOG"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
LOCK_NAME = ".zeppelin.lock"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ---------------------------------------------------------------------------------------------
# dying with the parent
# ---------------------------------------------------------------------------------------------


def _prctl_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None, poll_s: float = 0.5) -> None:
    """End this process when its parent dies.

    ``prctl(PR_SET_PDEATHSIG, sig)`` on Linux; in addition a daemon thread polls the parent pid
    (every ``poll_s``) and sends ``sig`` to this process when it changes. ``expected_parent``
    (default: ``$ZEPPELIN_PARENT_PID`` or the current parent) closes the race of a parent that died
    before the call."""
    if expected_parent is None:
        env = os.environ.get(PARENT_ENV)
        expected_parent = int(env) if env and env.isdigit() else os.getppid()
    _prctl_pdeathsig(sig)
    if os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
        return

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != expected_parent:
                os.kill(os.getpid(), sig)
                return

    threading.Thread(target=watch, name="zeppelin-parent-watch", daemon=True).start()


# ---------------------------------------------------------------------------------------------
# zeppelin run owns its process group
# ---------------------------------------------------------------------------------------------


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP / SIGTSTP; Linux ``/proc``, else never)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read(4096).rpartition(b")")[2].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def run_owned(cmd: list[str], env: dict[str, str] | None = None, *, grace_s: float = 10.0,
              poll_s: float = 0.05, stall_s: float | None = None) -> int:
    """Run ``cmd`` (the launcher) as the leader of a new process group owned by this process.

    Returns its exit code. SIGINT / SIGTERM / SIGHUP received here are forwarded to the launcher
    (which stops its ranks and reports); if the group is not gone ``grace_s`` after the signal it
    is killed with SIGKILL, and one line says so. A launcher killed by a signal nobody here sent is
    reported in one line. In every case the whole group gets SIGKILL once the launcher has exited
    (sweeping any process left behind). Exit code: 128 + signal for a forwarded signal. A launcher
    that stays stopped (SIGSTOP) for ``stall_s`` seconds is killed with its group (exit 1, one line):
    nothing the command waits on waits longer than the job's ``--timeout``."""
    env = dict(os.environ if env is None else env)
    env[PARENT_ENV] = str(os.getpid())
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    except BaseException:
        for s, h in old.items():
            signal.signal(s, h)
        raise
    pgid = proc.pid
    forwarded = 0
    deadline = None
    killed = False
    since = None  # when the launcher was first seen stopped
    try:
        while True:
            try:
                rc = proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and forwarded < len(received):
                sig = received[forwarded]
                forwarded = len(received)
                if deadline is None:
                    deadline = time.monotonic() + grace_s
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
            if deadline is not None and time.monotonic() > deadline and not killed:
                killed = True
                _killpg(pgid, signal.SIGKILL)
            if stall_s is not None and not received:
                if not process_stopped(proc.pid):
                    since = None
                elif since is None:
                    since = time.monotonic()
                elif time.monotonic() - since > stall_s:
                    _killpg(pgid, signal.SIGKILL)
                    proc.wait()
                    print(f"zeppelin: error: the launcher (pid {proc.pid}) was stopped for more than --timeout "
                          f"{stall_s:g} s; the job was killed", file=sys.stderr, flush=True)
                    return 1
    finally:
        _killpg(pgid, signal.SIGKILL)  # sweep: nothing of the job outlives this command
        for s, h in old.items():
            signal.signal(s, h)
    if received:
        sig = received[0]
        if killed:
            print(f"zeppelin: error: zeppelin run received {signal_name(sig)}; the job did not stop within "
                  f"{grace_s:g} s and was killed", file=sys.stderr, flush=True)
        elif rc < 0:  # the launcher had no handler yet (still starting): nobody has reported
            print(f"zeppelin: error: zeppelin run received {signal_name(sig)}; every rank was stopped",
                  file=sys.stderr, flush=True)
        # otherwise the launcher reported the stop (or its own failure) in one line
        return rc if rc > 0 else 128 + int(sig)
    if rc < 0:
        print(f"zeppelin: error: the launcher (pid {proc.pid}) was killed by {signal_name(-rc)}; every rank was "
              f"stopped", file=sys.stderr, flush=True)
        return 1
    return rc


# ---------------------------------------------------------------------------------------------
# progress heartbeat of a rank (read by the launcher)
# ---------------------------------------------------------------------------------------------


class Heartbeat:
    """A rank's current step in ``<dir>/rank<R>.step`` (rewritten in place; read by the launcher)."""

    def __init__(self, directory: str | os.PathLike | None, rank: int) -> None:
        self.fd = None
        if directory:
            with contextlib.suppress(OSError):
                self.fd = os.open(os.path.join(directory, f"rank{rank}.step"),
                                  os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    def step(self, k: int, what: str = "step") -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            data = f"{what} {k} {time.time():.3f}\n".encode().ljust(48)
            os.pwrite(self.fd, data, 0)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def read_heartbeat(directory: str | os.PathLike, rank: int) -> tuple[str, int, float] | None:
    from zeppelin.schemas.io.safefiles import read_small

    try:
        what, k, t = read_small(Path(directory) / f"rank{rank}.step", "heartbeat", limit=4096).decode().split()[:3]
        return what, int(k), float(t)
    except (InputError, OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# checkpoint directory: one run at a time, writable, same hyperparameters on --resume
# ---------------------------------------------------------------------------------------------


class CheckpointLock:
    """An exclusive ``flock`` on ``<dir>/.zeppelin.lock``, held until :meth:`release` or exit."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def prepare_checkpoint_dir(directory: str | os.PathLike) -> CheckpointLock:
    """Create ``directory`` if needed, check it is a writable directory, and lock it for this run.

    Raises :class:`InputError` (one line naming the directory and the reason) when it is not a
    directory, cannot be created or written, or another run holds its lock."""
    import errno
    import fcntl

    from zeppelin.schemas.io.safefiles import ManagedDir

    from .checkpoint import clean_interrupted_saves

    d = Path(directory)
    if os.path.lexists(d) and not d.is_dir():
        raise InputError("--checkpoint-dir is not a directory", source=d)
    # every name inside is opened relative to the directory and never followed (zeppelin.schemas.io.safefiles)
    with ManagedDir(d, "--checkpoint-dir") as md:
        md.probe_writable()
        fd = md.open_lock(LOCK_NAME)
        path = d / LOCK_NAME
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                holder = os.pread(fd, 32, 0).decode().strip()
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise InputError("--checkpoint-dir is in use by another run" + (f" (pid {holder})" if holder else "")
                                 + "; one run at a time may write a checkpoint directory", source=d) from None
            raise InputError(f"--checkpoint-dir cannot be locked ({e.strerror or e})", source=d) from None
        try:
            clean_interrupted_saves(md)  # this run holds the lock: a temporary directory is an interrupted save
        except OSError as e:
            os.close(fd)
            raise InputError(f"--checkpoint-dir: cannot remove an interrupted save ({e.strerror or e})",
                             source=d) from None
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return CheckpointLock(fd, path)


RESUME_HYPERPARAMETERS = ("lr", "weight_decay", "seed", "betas", "eps", "lr_schedule", "warmup_steps", "min_lr",
                          "grad_clip")


def check_resume_hyperparameters(saved: dict | None, current: dict, source=None) -> None:
    """Refuse a ``--resume`` whose hyperparameters differ from the checkpoint's.

    ``saved``: the hyperparameters recorded in the checkpoint (None for a checkpoint that has no
    record: accepted). Raises :class:`InputError` naming every differing option."""
    if not saved:
        return
    diffs = []
    for key in RESUME_HYPERPARAMETERS:
        if key in saved and key in current and saved[key] != current[key]:
            diffs.append(f"--{key.replace('_', '-')} {current[key]!r} (checkpoint: {saved[key]!r})")
    if diffs:
        raise InputError("--resume with other hyperparameters than the checkpoint was trained with: "
                         + ", ".join(diffs) + "; pass the checkpoint's values, or start a new --checkpoint-dir",
                         source=source)


def inspect_checkpoint_dir(directory: str | os.PathLike) -> None:
    """Read-only checks of a checkpoint directory before any process starts: a directory (or
    nothing yet), whose lock file, when there, is a regular file with one link (never a link that
    locking would write through)."""
    import stat

    from zeppelin.schemas.io.safefiles import ManagedDir

    d = Path(directory)
    if not os.path.lexists(d):
        return
    if not d.is_dir():
        raise InputError("--checkpoint-dir is not a directory", source=d)
    with ManagedDir(d, "--checkpoint-dir", create=False) as md:
        st = md.lstat(LOCK_NAME)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise md.foreign(LOCK_NAME, st)
        if st is not None and st.st_nlink != 1:
            raise InputError(f"--checkpoint-dir: {LOCK_NAME} has {st.st_nlink} hard links, not a file zeppelin "
                             "wrote (remove it)", source=d)


def resume_point(directory: str | os.PathLike, *, plan_hash: str, world_size: int, end: int,
                 hparams: dict, prefix: Any = None) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a ``--resume`` continues from and its checked state (None: start afresh).
    Read-only; the command line runs it before any process starts, rank 0 again under the lock."""
    from .checkpoint import latest_checkpoint, read_checkpoint_state

    path = latest_checkpoint(directory)
    if path is None:
        return None
    state = read_checkpoint_state(path, plan_hash=plan_hash, world_size=world_size, prefix=prefix)
    if not 0 <= state["next_step"] <= end:
        raise InputError(f"checkpoint resumes at step {state['next_step']}, beyond --steps {end}", source=path)
    check_resume_hyperparameters((state.get("extra") or {}).get("hyperparameters"), hparams, source=path)
    return path, state



# ---------------------------------------------------------------------------------------------
# fault injection (tests of failure handling)
# ---------------------------------------------------------------------------------------------


def parse_fault(spec: str | None) -> tuple[str, int, int] | None:
    """``KIND:RANK:STEP`` (or the older ``RANK:STEP:exit|raise``) -> (kind, rank, step)."""
    if not spec:
        return None
    parts = spec.strip().split(":")
    if len(parts) != 3:
        return None
    if parts[0] in FAULT_KINDS:
        kind, r, k = parts
    else:
        r, k, kind = parts
    if kind not in FAULT_KINDS:
        return None
    try:
        return kind, int(r), int(k)
    except ValueError:
        return None


def maybe_fault(rank: int, step: int, where: str = "step") -> None:
    """Inject the fault ``$ZEPPELIN_TEST_FAULT`` names when this rank reaches that step (``where``:
    ``"step"`` at the start of the step, ``"verify"`` before rank 0's reference, ``"save"`` at the
    start of the checkpoint save after the step)."""
    f = parse_fault(os.environ.get(FAULT_ENV))
    if f is None or f[1] != rank or f[2] != step or SLOW_FAULTS.get(f[0], "step") != where:
        return
    kind = f[0]
    log = os.environ.get(FAULT_LOG_ENV)
    if log:
        with contextlib.suppress(OSError), open(log, "a") as fh:
            fh.write(f"{kind} {rank} {step} {time.time():.6f}\n")
    sys.stderr.flush()
    if kind in SLOW_FAULTS:
        time.sleep(float(os.environ.get("ZEPPELIN_TEST_FAULT_SLEEP", "3")))
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    if kind == "oom":
        os._exit(137)
    if kind == "exit":
        os._exit(3)
    if kind == "stall":
        while True:
            time.sleep(1.0)
    raise RuntimeError(f"injected fault at step {step}")
