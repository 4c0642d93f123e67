"""Launcher: start the ranks of a job, watch them, report the first failure in one line.

``python -m zeppelin.runtime.launch [torchrun options] -m zeppelin.runtime PLAN [options]``.

On one machine (``--nnodes 1`` without a rendezvous endpoint or master address, only the options
``--standalone``, ``--nproc-per-node``, ``--nnodes``, ``--node-rank 0``) the launcher starts the
ranks itself ("zeppelin-local"); otherwise it runs ``torch.distributed.run`` (torchrun) in this
process. Either way:

* every rank gets ``ZEPPELIN_ERROR_DIR``; a failing rank writes its one-line error there, and its
  current step (the launcher tells a slow rank from the ranks that timed out waiting for it);
* **the first failure wins**: a rank that raises, exits non-zero or is killed is reported as the
  cause (a rank that died without a word — killed, ``os._exit`` — is named with its exit code or
  signal, ahead of the peers that then lost their connection to it); the other ranks are stopped
  at once (SIGTERM, SIGKILL one second later), not after ``--timeout``. When the first error is a
  timeout and a rank is still running without an error, that rank is named as *slow*;
* SIGINT / SIGTERM / SIGHUP stop every rank and exit with 128 + the signal, with one line; the
  launcher dies with its parent (``zeppelin run``) and every rank dies with the launcher
  (:mod:`zeppelin.runtime.lifecycle`).

Local runs bind nothing beyond the loopback interface: the ranks meet through a ``FileStore`` in
the job's private temporary directory (no TCP rendezvous store at all) and gloo/NCCL sockets are
bound to the loopback interface (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``). With torchrun
(several machines) the rendezvous timeouts are set to the job's ``--timeout``, so a rendezvous that
cannot form fails within it.

This module's top imports nothing heavy: ``zeppelin run`` imports :func:`torchrun_argv` without
torch. A local launch on a CPU build of torch imports once what every rank imports (torch, FSDP,
the trainer; transformers for an ``hf:`` model) and forks its ranks from there (:func:`_preload`):
each rank then starts in a fraction of a second instead of repeating seconds of imports. With a
CUDA or ROCm build (a GPU rank must not inherit a process that may have touched the device), or
with ``ZEPPELIN_LAUNCH=exec``, every rank is a fresh interpreter. A forked rank is named
``zeppelin-rankR`` (``ps -o comm``, ``/proc/PID/comm``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from .lifecycle import PEER_STOPPED_EXIT, signal_name

SETTLE_S = 0.3          # after the first failure: collect the other ranks' exits/reports this long
STOP_GRACE_S = 1.0      # SIGTERM -> SIGKILL for ranks being stopped
POLL_S = 0.02
DEFAULT_TIMEOUT_S = 300.0


def torchrun_argv(*, nproc_per_node: int, nnodes: int = 1, node_rank: int | None = None,
                  master_addr: str | None = None, master_port: int | None = None,
                  rdzv_backend: str | None = None, rdzv_endpoint: str | None = None,
                  rdzv_id: str | None = None, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """torchrun options for a job: standalone on one machine unless a rendezvous is named."""
    argv = [f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}"]
    multi = nnodes > 1 or master_addr or rdzv_endpoint
    if not multi:
        argv.append("--standalone")
    if node_rank is not None:
        argv.append(f"--node-rank={node_rank}")
    if master_addr:
        argv.append(f"--master-addr={master_addr}")
    if master_port:
        argv.append(f"--master-port={master_port}")
    if rdzv_backend:
        argv.append(f"--rdzv-backend={rdzv_backend}")
    if rdzv_endpoint:
        argv.append(f"--rdzv-endpoint={rdzv_endpoint}")
    if rdzv_id:
        argv.append(f"--rdzv-id={rdzv_id}")
    argv.extend(extra)
    return argv


def _read_errors(err_dir: Path, pattern: str = "rank*.json") -> dict[int, dict]:
    from zeppelin.schemas.common import InputError
    from zeppelin.schemas.io.safefiles import read_small

    errs = {}
    for f in err_dir.glob(pattern):
        try:
            rec = json.loads(read_small(f, "error record", limit=1 << 20))
            r, t = int(rec["rank"]), float(rec["time"])
        except (InputError, OSError, ValueError, KeyError, TypeError):
            continue
        errs[r] = dict(rec, rank=r, time=t)
    return errs


def _death(code: int) -> str:
    if code < 0:
        how = f"was killed by {signal_name(-code)}"
        if code == -int(signal.SIGKILL):
            how += " (e.g. by the out-of-memory killer)"
        return how
    if code == 137:
        return "exited with code 137 (128 + SIGKILL: killed, e.g. out of memory)"
    if code in (130, 143, 129):
        return f"was stopped by {signal_name(code - 128)} (exit code {code})"
    return f"exited with code {code} without an error message"


#: exit codes of ranks the launcher (or torchrun) itself stopped: SIGTERM, or the worker's handler of it
LAUNCHER_STOPPED = frozenset({-int(signal.SIGTERM), 130, 143, PEER_STOPPED_EXIT})


#: how a rank says that a peer is gone (gloo, NCCL, the store): the consequence of another rank's
#: failure, never its cause while a rank with a cause of its own is known
_PEER_LOST_RE = re.compile(r"by peer|connection (closed|reset|refused)|broken pipe|socket closed|ECONNRESET|EPIPE|"
                           r"communicator was aborted", re.IGNORECASE)


def _earliest(records) -> dict:
    return min(records, key=lambda x: (x["time"], x["rank"]))


def _then(errs: dict[int, dict], cause: int) -> str:
    """`` (then rank R: ...)``: the first report of another rank than the cause, for context."""
    rest = [e for r, e in errs.items() if r != cause]
    if not rest:
        return ""
    first = _earliest(rest)
    return f" (then rank {first['rank']}: {first['message']})"


def _summarise(err_dir: Path, failures: dict, stopped: frozenset = LAUNCHER_STOPPED,
               signals: bool = True) -> tuple[str, int]:
    """One line for the user about a failed job, and the exit code to return.

    ``failures``: rank -> object with ``exitcode`` for every rank that exited non-zero; ``stopped``:
    the exit codes that mean "stopped by the launcher" (a rank that exited so is not the cause);
    ``signals``: whether the ranks' records of a stop signal (``signal-rank<R>.json``) were all sent
    from outside the job (the launcher has stopped nobody yet). The cause, in this order: the first
    rank a signal from outside stopped; a rank that died without a word; the first report that is a
    cause of its own (not a peer's lost connection); the first report."""
    errs = _read_errors(err_dir)
    sigs = _read_errors(err_dir, "signal-rank*.json") if signals else {}
    if sigs:
        first = _earliest(sigs.values())
        how = f"was stopped by {signal_name(int(first.get('signal', 0)))} from outside the job"
        return f"rank {first['rank']} {how}{_then(errs, first['rank'])}", 1
    # a rank that died without writing an error caused the others' failures - unless the launcher
    # stopped it because another rank failed
    silent = sorted(r for r, pf in failures.items() if r not in errs)
    if any(failures[r].exitcode not in stopped for r in silent):
        silent = [r for r in silent if failures[r].exitcode not in stopped]
    elif errs:
        silent = []
    if silent:
        r = min(silent, key=lambda x: (getattr(failures[x], "time", 0.0), x))
        return f"rank {r} {_death(failures[r].exitcode)}{_then(errs, r)}", 1
    if errs:
        own = [e for e in errs.values() if not _PEER_LOST_RE.search(str(e.get("message", "")))]
        first = _earliest(own or errs.values())
        return f"rank {first['rank']}: {first['message']}", int(first.get("code", 1)) or 1
    return "the job failed (no worker reported an error)", 1


_TIMEOUT_RE = re.compile(r"timed? ?out|timeout", re.IGNORECASE)


def classify_failure(err_dir: Path, failures: dict, alive: list[int],
                     stopped: frozenset = LAUNCHER_STOPPED) -> tuple[str, int]:
    """:func:`_summarise`, and a slow rank named as slow: when the first report is a timeout and a
    rank is still running without having reported anything, that rank is the one the others were
    waiting for."""
    from .lifecycle import read_heartbeat

    errs = _read_errors(err_dir)
    silent_dead = [r for r, f in failures.items() if r not in errs and f.exitcode not in stopped]
    if errs and not silent_dead and not _read_errors(err_dir, "signal-rank*.json"):
        first = min(errs.values(), key=lambda x: x["time"])
        slow = [r for r in alive if r not in errs]
        if slow and _TIMEOUT_RE.search(first["message"]):
            r = slow[0]
            hb = read_heartbeat(err_dir, r)
            where = ""
            if hb is not None:
                at = f"step {hb[1]}" if hb[0] == "step" else f"{hb[0]} of step {hb[1]}"
                where = f" (in {at}, no progress for {max(time.time() - hb[2], 0):.0f} s)"
            others = ", ".join(str(x) for x in sorted(slow[1:]))
            return (f"rank {r} is slow{where}: rank {first['rank']} gave up waiting for it: {first['message']}"
                    + (f"; ranks {others} were also still running" if others else ""), 1)
    return _summarise(err_dir, failures, stopped)


# ---------------------------------------------------------------------------------------------
# argument handling
# ---------------------------------------------------------------------------------------------


def _split(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """``[launcher opts] -m MODULE [worker args]`` -> (opts, module, worker args)."""
    for i, a in enumerate(argv):
        if a == "-m" and i + 1 < len(argv):
            return argv[:i], argv[i + 1], argv[i + 2:]
        if a.startswith("-m") and len(a) > 2 and not a.startswith("--"):
            return argv[:i], a[2:], argv[i + 1:]
    return argv, "", []


def _opt_value(args: list[str], name: str) -> str | None:
    """Value of ``--name V`` / ``--name=V`` (also with underscores) in ``args``, last one wins."""
    names = {name, name.replace("-", "_")}
    val = None
    it = iter(range(len(args)))
    for i in it:
        a = args[i]
        key, eq, v = a.partition("=")
        if key in names:
            if eq:
                val = v
            elif i + 1 < len(args):
                val = args[i + 1]
                next(it, None)
    return val


_LOCAL_FLAGS = {"--standalone"}
_LOCAL_VALUED = {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank", "--node_rank",
                 "--monitor-interval", "--monitor_interval"}


def _local_plan(opts: list[str]) -> int | None:
    """Ranks to start locally when ``opts`` describe a one-machine job the launcher runs itself."""
    i = 0
    while i < len(opts):
        key, eq, _ = opts[i].partition("=")
        if key in _LOCAL_FLAGS and not eq:
            i += 1
            continue
        if key in _LOCAL_VALUED:
            i += 1 if eq else 2
            continue
        return None
    nnodes = _opt_value(opts, "--nnodes") or "1"
    if nnodes not in ("1", "1:1") or (_opt_value(opts, "--node-rank") or "0") != "0":
        return None
    n = _opt_value(opts, "--nproc-per-node") or "1"
    return int(n) if n.isdigit() and int(n) >= 1 else None


def _worker_timeout(wargs: list[str]) -> float:
    v = _opt_value(wargs, "--timeout")
    try:
        t = float(v) if v is not None else DEFAULT_TIMEOUT_S
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return t if math.isfinite(t) and t > 0 else DEFAULT_TIMEOUT_S


def loopback_interface() -> str:
    """Name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(OSError, AttributeError):
        names = [n for _, n in socket.if_nameindex()]
        for n in names:
            if n == "lo" or n.startswith("lo"):
                return n
    return "lo0" if sys.platform == "darwin" else "lo"


# ---------------------------------------------------------------------------------------------
# zeppelin-local: start, watch and stop the ranks of a one-machine job
# ---------------------------------------------------------------------------------------------


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_all(procs: dict[int, subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    for p in procs.values():
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
        time.sleep(POLL_S)
    for p in procs.values():
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
    for p in procs.values():
        with contextlib.suppress(Exception):
            p.wait(timeout=10)


class _StallWatch:
    """Ranks stopped (SIGSTOP) for longer than the job's timeout (checked every half second)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.since: dict[int, float] = {}
        self.next = 0.0

    def check(self, pids: dict[int, int]) -> int | None:
        from .lifecycle import process_stopped

        now = time.monotonic()
        if now < self.next:
            return None
        self.next = now + 0.5
        for r, pid in sorted(pids.items()):
            if not process_stopped(pid):
                self.since.pop(r, None)
            elif now - self.since.setdefault(r, now) > self.timeout_s:
                return r
        return None


LAUNCH_ENV = "ZEPPELIN_LAUNCH"
#: the one worker module a launcher forks (any other ``-m`` module, such as ``zeppelin profile``'s,
#: runs in an interpreter of its own)
WORKER_MODULE = "zeppelin.runtime"


def _preload(wargs: list[str]) -> bool:
    """Import what every rank imports, for ranks forked from this process; False (nothing imported
    past torch) where the ranks must be fresh interpreters: a torch built for CUDA or ROCm, or
    ``ZEPPELIN_LAUNCH=exec``."""
    if os.environ.get(LAUNCH_ENV, "fork") == "exec":
        return False
    try:
        import torch
    except ImportError:
        return False
    if torch.version.cuda or getattr(torch.version, "hip", None):
        return False
    import torch._dynamo  # noqa: F401  (FSDP2's fully_shard imports it on first use)
    import torch.distributed.fsdp  # noqa: F401

    import zeppelin.runtime.config  # noqa: F401
    import zeppelin.runtime.train.loop  # noqa: F401

    if any(a.startswith("hf:") or "=hf:" in a for a in wargs):
        with contextlib.suppress(ImportError):
            import transformers  # noqa: F401
    return True


class _Forked:
    """A rank forked from this process, watched like a :class:`subprocess.Popen`."""

    def __init__(self, module: str, wargs: list[str], env: dict[str, str]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _forked_main(module, wargs, env)
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(POLL_S)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _forked_main(module: str, wargs: list[str], env: dict[str, str]) -> None:
    """A forked rank: what ``python -m zeppelin.runtime *wargs`` runs, in this process image, then
    exit (never returns)."""
    import atexit
    import traceback

    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        _name_process(f"zeppelin-rank{env.get('RANK', '')}")
        sys.argv = [module, *wargs]
        from zeppelin.runtime import __main__ as worker

        code = worker._guarded_main()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _name_process(name: str) -> None:
    """This process's name as ``ps``, ``top`` and ``/proc/PID/comm`` show it (Linux; at most 15
    bytes): a forked rank shares its launcher's command line, its name tells which rank it is."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        # the process's own symbols (libc among them): ctypes.util.find_library would start ldconfig
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME


def run_local(nproc: int, module: str, wargs: list[str], err_dir: Path, timeout_s: float,
              pending: list[int]) -> int:
    env = dict(os.environ)
    lo = loopback_interface()
    env.update({
        "ZEPPELIN_ERROR_DIR": str(err_dir),
        "ZEPPELIN_STORE_FILE": str(err_dir / "store"),
        "ZEPPELIN_PARENT_PID": str(os.getpid()),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo,
    })
    env.pop("MASTER_PORT", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs: dict[int, subprocess.Popen | _Forked] = {}
    try:
        forked = module == WORKER_MODULE and _preload(wargs)
        for r in range(nproc):
            if pending:
                raise _Stop(pending[0])
            e = dict(env, RANK=str(r), LOCAL_RANK=str(r))
            procs[r] = _Forked(module, wargs, e) if forked else subprocess.Popen([sys.executable, "-m", module, *wargs],
                                                                                 env=e)
        exits: dict[int, SimpleNamespace] = {}
        first_bad = None
        stalls = _StallWatch(timeout_s)
        while True:
            if pending:
                raise _Stop(pending[0])
            now = time.time()
            held = stalls.check({r: p.pid for r, p in procs.items() if r not in exits})
            if held is not None:  # a stopped rank holds every peer and nothing would ever report it
                _stop_all(procs)
                print(f"zeppelin: error: job failed: rank {held} was stopped (SIGSTOP) for more than --timeout "
                      f"{timeout_s:g} s; every rank ended", file=sys.stderr, flush=True)
                return 1
            for r, p in procs.items():
                if r not in exits:
                    c = p.poll()
                    if c is not None:
                        exits[r] = SimpleNamespace(exitcode=c, time=now)
            if len(exits) == nproc and all(x.exitcode == 0 for x in exits.values()):
                return 0
            # a rank that left for its peer (PEER_STOPPED_EXIT) is no failure of its own: wait for the report
            bad = (any(x.exitcode not in (0, PEER_STOPPED_EXIT) for x in exits.values())
                   or any(err_dir.glob("rank*.json")))
            if bad and first_bad is None:
                first_bad = time.monotonic()
            if first_bad is not None and (time.monotonic() - first_bad >= SETTLE_S or len(exits) == nproc):
                break
            time.sleep(POLL_S)
        failures = {r: x for r, x in exits.items() if x.exitcode != 0}
        alive = sorted(r for r in procs if r not in exits)
        # every exit seen so far happened before this launcher stopped anyone: a rank that ended on
        # a SIGTERM got it from elsewhere and is a cause, not a casualty
        msg, code = classify_failure(err_dir, failures, alive, stopped=frozenset({PEER_STOPPED_EXIT}))
        _stop_all(procs)
        print(f"zeppelin: error: job failed: {msg}", file=sys.stderr, flush=True)
        return code
    except _Stop as s:
        _stop_all(procs)
        print(f"zeppelin: error: job stopped: received {signal_name(s.signum)}; every rank ended",
              file=sys.stderr, flush=True)
        return 128 + s.signum
    finally:
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                with contextlib.suppress(Exception):
                    p.wait(timeout=10)


# ---------------------------------------------------------------------------------------------
# several machines: torchrun in this process
# ---------------------------------------------------------------------------------------------


def run_torchrun(opts: list[str], module: str, wargs: list[str], err_dir: Path, timeout_s: float) -> int:
    import logging

    had = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # the launcher's store retries: one line below instead
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if had is None:  # the ranks keep the default level
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
    else:
        os.environ["TORCH_CPP_LOG_LEVEL"] = had
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    t = max(1, math.ceil(timeout_s))
    extra = []
    if _opt_value(opts, "--rdzv-conf") is None:
        extra.append(f"--rdzv-conf=join_timeout={t},read_timeout={t},timeout={t},last_call_timeout=1")
    if _opt_value(opts, "--monitor-interval") is None:
        extra.append("--monitor-interval=0.1")
    os.environ["ZEPPELIN_PARENT_PID"] = str(os.getpid())
    try:
        torchrun.main([*opts, *extra, "-m", module, *wargs])
        return 0
    except ChildFailedError as e:
        msg, code = _summarise(err_dir, e.failures, signals=False)  # torchrun has stopped the others
        print(f"zeppelin: error: job failed: {msg}", file=sys.stderr, flush=True)
        return code
    except (KeyboardInterrupt, SignalException) as e:
        sig = getattr(e, "sigval", signal.SIGINT)
        print(f"zeppelin: error: job stopped: received {signal_name(int(sig))}; every rank on this machine "
              f"ended", file=sys.stderr, flush=True)
        return 128 + int(sig)
    except Exception as e:  # noqa: BLE001 - rendezvous failures and the like: one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"zeppelin: error: job failed to start: {e.__class__.__name__}: {msg}"
              f" (rendezvous timeout {t} s)", file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    pending: list[int] = []

    def on_signal(signum, frame):
        pending.append(signum)
        if not local[0]:
            raise KeyboardInterrupt

    local = [True]
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    from .lifecycle import PARENT_ENV, die_with_parent

    if os.environ.get(PARENT_ENV):  # started by zeppelin run: end with it
        die_with_parent(signal.SIGTERM)
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, module, wargs = _split(argv)
    if not module:
        print("zeppelin: error: launcher: no worker module (-m zeppelin.runtime PLAN ...)", file=sys.stderr)
        return 2
    timeout_s = _worker_timeout(wargs)
    # the job's error channel is made here, for this job only: a directory named in the inherited
    # environment (an earlier job's) is never read or written
    err_dir = Path(tempfile.mkdtemp(prefix="zeppelin-job-"))
    os.environ["ZEPPELIN_ERROR_DIR"] = str(err_dir)
    os.environ.pop("ZEPPELIN_STORE_FILE", None)  # set per job by run_local; never inherited
    try:
        nproc = _local_plan(opts)
        if nproc is not None:
            return run_local(nproc, module, wargs, err_dir, timeout_s, pending)
        local[0] = False
        for s, h in old.items():  # torchrun installs its own handlers (SignalException), stops its workers
            signal.signal(s, h)
        if pending:
            return 128 + pending[0]
        return run_torchrun(opts, module, wargs, err_dir, timeout_s)
    finally:
        shutil.rmtree(err_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
