"""Helpers to run a function on N local ``torch.distributed`` processes (tests, benchmarks).

A test harness, not part of the installed package: import it as ``tests.support.dist_pool`` with
the repository root on ``sys.path`` (pytest puts it there for the test suite; the benchmarks that
use it insert it themselves).

Two entry points:

* :func:`run_distributed` ``(fn, world_size, *args, timeout=..., backend="gloo")`` — spawn a fresh
  world, run ``fn(rank, world_size, *args, **kwargs)`` on every rank, return the per-rank results
  (a list indexed by rank), tear the world down.
* :class:`DistributedPool` — a persistent world (spawn once, run many functions): spawning and
  initialising 8 processes that import torch costs seconds on a small machine, so a test module
  keeps one pool and submits every case to it::

      with DistributedPool(4) as pool:
          outs = pool.run(fn, x, y, timeout=30)

Processes start from a forkserver that imported torch once (``spawn`` where forkserver does not
exist), so a world of 8 ranks starts in seconds. Each rank runs with ``threads`` torch threads
(default 1) and ``GLOO_SOCKET_IFNAME=lo`` unless set. ``fn`` must be picklable by reference (a
module-level function, passed by reference through the pool's own queue); its arguments and return
values are moved with ``torch.save``/``torch.load(weights_only=True)``: tensors, numbers, strings and plain containers
(tensors come back on the CPU), nothing that needs unpickling code.

Failure handling: when a rank raises, its traceback is re-raised in the parent as
:class:`DistributedError` (ranks in rank order, first line names the rank); when a rank dies
(exit without reporting) or the call runs past ``timeout``, every process is killed and a
:class:`DistributedError` / :class:`DistributedTimeout` says which ranks had not answered. A pool
whose world was torn down by a failure restarts itself on the next :meth:`DistributedPool.run`.
Nothing hangs: the parent never waits without a deadline.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue as _queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = [
    "DistributedError",
    "DistributedPool",
    "DistributedTimeout",
    "free_port",
    "run_distributed",
]


class DistributedError(RuntimeError):
    """A rank raised or died while running a distributed function."""


class DistributedTimeout(DistributedError, TimeoutError):
    """A distributed function did not finish on every rank within its timeout."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dumps(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    """Tensors and plain containers only (``weights_only``: no code runs while reading)."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _worker(
    rank: int, world_size: int, port: int, backend: str, threads: int, pg_timeout_s: float, tasks, results
) -> None:  # pragma: no cover - runs in a child process
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        import torch
        import torch.distributed as dist

        if threads > 0:
            torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, -1, False, traceback.format_exc()))
        return
    results.put((rank, -1, True, b""))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            task_id, fn, payload = task
            try:
                args, kwargs = _loads(payload)
                out = fn(rank, world_size, *args, **kwargs)
                results.put((rank, task_id, True, _dumps(_to_cpu(out))))
            except BaseException:  # noqa: BLE001 - reported to the parent
                results.put((rank, task_id, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "tests.support.dist_pool"]
# the repository root: the ranks import this module and the functions they run (test modules,
# benchmarks) by name from it
_ROOT = str(Path(__file__).resolve().parents[2])


def _context():
    """A forkserver context whose server has imported torch once (children fork from it, so a
    world of 8 ranks does not import torch 8 times); spawn where forkserver is unavailable."""
    import multiprocessing as std_mp
    import sys

    import torch.multiprocessing as mp

    # children (and the forkserver) take the parent's sys.path: with the root on it they can import
    # this module (the forkserver's preload) and ``tests.*`` modules by name
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)

    if "forkserver" in std_mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


class DistributedPool:
    """A persistent world of ``world_size`` local processes running submitted functions.

    ``backend``: ``"gloo"`` (default) or ``"nccl"`` (one GPU per rank). ``threads``: torch intra-op
    threads per rank (default 1 — N ranks share the machine's cores). ``pg_timeout_s``: the
    process-group timeout given to ``init_process_group`` (collectives that wait longer fail).
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        threads: int = 1,
        start_timeout: float = 120.0,
        pg_timeout_s: float = 120.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.threads = threads
        self.start_timeout = start_timeout
        self.pg_timeout_s = pg_timeout_s
        self._procs: list = []
        self._tasks: list = []
        self._results = None
        self._next_id = 0
        self._alive = False

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> DistributedPool:  # noqa: PYI034 - Self needs Python 3.11
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._alive:
            return
        last_err = ""
        for _attempt in range(3):
            err = self._start_once()
            if err is None:
                self._alive = True
                return
            last_err = err
            self._kill()
            if "address already in use" not in err.lower() and "eaddrinuse" not in err.lower():
                break
        raise DistributedError(f"could not start a world of {self.world_size} processes:\n{last_err}")

    def _start_once(self) -> str | None:
        ctx = _context()
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self._procs = []
        for r in range(self.world_size):
            p = ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    port,
                    self.backend,
                    self.threads,
                    self.pg_timeout_s,
                    self._tasks[r],
                    self._results,
                ),
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout
        while len(ready) < self.world_size:
            msg = self._get(deadline)
            if msg is None:
                missing = sorted(set(range(self.world_size)) - ready)
                return f"ranks {missing} did not initialise within {self.start_timeout:.0f} s"
            rank, task_id, ok, payload = msg
            if task_id != -1:
                continue
            if not ok:
                return f"rank {rank} failed to initialise:\n{payload}"
            ready.add(rank)
        return None

    def _get(self, deadline: float):
        """Next result message, or None when the deadline passed or a rank died silently."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                return self._results.get(timeout=min(0.2, left))
            except _queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    # a dead rank may still have a message in flight: drain once more
                    try:
                        return self._results.get(timeout=0.5)
                    except _queue.Empty:
                        codes = {r: self._procs[r].exitcode for r in dead}
                        raise _RankDied(codes) from None

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []
        self._tasks = []
        self._results = None
        self._alive = False

    def close(self) -> None:
        """Stop the world (graceful when idle, killed otherwise)."""
        if self._alive:
            for q in self._tasks:
                with contextlib.suppress(Exception):
                    q.put(None)
            deadline = time.monotonic() + 10
            for p in self._procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._kill()

    # -- running ---------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; results indexed by rank."""
        if not self._alive:
            self.start()
        task_id = self._next_id
        self._next_id += 1
        payload = _dumps((args, kwargs))
        for q in self._tasks:
            q.put((task_id, fn, payload))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < self.world_size:
                # once a rank failed, the others may block in a collective: give them a short grace
                d = min(deadline, time.monotonic() + 5.0) if errors else deadline
                msg = self._get(d)
                if msg is None:
                    missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
                    self._kill()
                    if errors:
                        raise DistributedError(_format_errors(fn, errors, missing))
                    raise DistributedTimeout(
                        f"{_name(fn)} did not finish within {timeout:g} s on ranks {missing}"
                    )
                rank, tid, ok, data = msg
                if tid != task_id:
                    continue
                if ok:
                    results[rank] = _loads(data)
                else:
                    errors[rank] = data
        except _RankDied as died:
            self._kill()
            lines = [f"rank {r} died (exit code {c})" for r, c in sorted(died.codes.items())]
            raise DistributedError(
                f"{_name(fn)}: "
                + "; ".join(lines)
                + (("\n" + _format_errors(fn, errors, [])) if errors else "")
            ) from None
        if errors:
            # the surviving ranks finished (their collectives did not involve the failed one)
            raise DistributedError(_format_errors(fn, errors, []))
        return [results[r] for r in range(self.world_size)]


class _RankDied(Exception):
    def __init__(self, codes: dict[int, int | None]) -> None:
        super().__init__(str(codes))
        self.codes = codes


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _format_errors(fn: Callable[..., Any], errors: dict[int, str], missing: list[int]) -> str:
    parts = [
        f"{_name(fn)} failed on rank{'s' if len(errors) > 1 else ''} {sorted(errors)}"
        + (f" (ranks {missing} did not finish)" if missing else "")
    ]
    for r in sorted(errors):
        parts.append(f"--- rank {r} ---\n{errors[r].rstrip()}")
    return "\n".join(parts)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
    threads: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Spawn a world of ``world_size`` processes, run ``fn(rank, world_size, *args, **kwargs)``
    on each, and return the results indexed by rank. See the module docstring for failures."""
    pool = DistributedPool(
        world_size,
        backend=backend,
        threads=threads,
        start_timeout=max(timeout, 60.0),
        pg_timeout_s=max(timeout, 30.0),
    )
    try:
        pool.start()
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    finally:
        pool.close()
