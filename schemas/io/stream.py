"""Plans as a stream: training starts before the whole plan exists.

``zeppelin plan --stream -o PLAN`` writes PLAN step by step as the steps are made
(:class:`StreamingPlanWriter`) and, beside it, ``PLAN.chain``: one line per record written,
``COUNT sha256:HEX``, the SHA-256 of every byte of PLAN up to and including its COUNT-th step record
(COUNT 0: the header). It is the end record's digest, chained: step k is vouched for as soon as
its line is written, before the end record exists. When the last step is written the end record
follows and ``PLAN.chain`` is removed: the finished PLAN is byte for byte what ``zeppelin plan``
writes without ``--stream``, and reads like any plan.

``zeppelin run PLAN --follow`` reads it with :class:`FollowReader`: step k is returned only once
its chain line exists and the digest of the bytes read (through one open descriptor, from the
start of the file) equals it; until then the reader waits (and says so). The writer holds an
exclusive ``flock`` on the chain file while it writes: a reader that finds the lock free and its
step missing knows the planner stopped, and says so in one line instead of waiting forever. A
planner that fails or is stopped removes what it wrote (nothing half-written stays behind); a
follower that had opened the files keeps reading its open descriptors and ends with that line.

Order of the writer's operations: the header is written to temporary files (plan and chain) that
are renamed into place (chain first), so that PLAN, once it exists, starts with a whole header and
has its chain; each step is written and flushed to PLAN before its chain line is appended.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from ..common import InputError
from ..plan import PlanHeader, PlanReader, StepPlan, _dump, end_record
from .safefiles import check_output, check_side_file, kind_of, open_temp, place, remove_own
from .signals import cleanup_signals

__all__ = ["CHAIN_SUFFIX", "FollowReader", "StreamingPlanWriter", "chain_path", "check_stream_target", "open_plan_reader",
           "waiting_line"]

CHAIN_SUFFIX = ".chain"


def chain_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.with_name(p.name + CHAIN_SUFFIX)


CHAIN_WHAT = "plan chain file"


def busy_line(plan: Path) -> str:
    """Why a second stream of ``plan`` is refused while the first one writes it."""
    return (f"{plan.name} is being written by another `zeppelin plan --stream` (a live stream); wait for it "
            "to end or write another file")


def check_stream_target(plan: str | os.PathLike) -> None:
    """Before any planning: the chain name of ``plan`` is free, left by a killed planner, or refused
    (a live stream, a link or anything zeppelin did not write there)."""
    target = Path(os.path.realpath(plan)) if os.path.islink(plan) else Path(plan)
    check_side_file(chain_path(target), CHAIN_WHAT, busy_line(target))


class StreamingPlanWriter:
    """Write a plan in place, step by step, with its chain file (see module docstring). The same
    interface as :class:`~zeppelin.schemas.plan.PlanWriter`; the bytes written are the same."""

    def __init__(self, path: str | os.PathLike, header: PlanHeader, fmt: Literal["jsonl", "pretty"] = "jsonl"):
        self.path, self.header, self.fmt = Path(path), header, fmt
        self.count = 0
        self._fh = self._ch = None
        self._targets: list[tuple[Path, tuple[int, int]]] = []
        self._signals = None

    def __enter__(self) -> StreamingPlanWriter:
        target = check_output(self.path, what="plan")
        chain = chain_path(target)
        self._signals = cleanup_signals()
        self._signals.__enter__()
        tmps: list[str] = []
        try:
            self._fh = os.fdopen(open_temp(target, tmps), "wb")
            self._ch = os.fdopen(open_temp(target, tmps), "wb")
            fcntl.flock(self._ch.fileno(), fcntl.LOCK_EX)  # held while the plan is being written
            head = _dump(self.header, self.fmt).encode()
            self._digest = hashlib.sha256(head)
            self._fh.write(head)
            self._sync()
            self._chain_line()
            place(tmps[1], chain, link=True, what=CHAIN_WHAT, busy=busy_line(target))  # appears locked
            self._own(chain, self._ch)
            place(tmps[0], target)
            self._own(target, self._fh)
        except BaseException as e:
            for t in tmps:
                with contextlib.suppress(OSError):
                    os.unlink(t)
            self._abort()
            if isinstance(e, OSError):
                raise InputError(f"cannot write plan: {e.strerror or e}", source=self.path) from None
            raise
        return self

    def _own(self, name: Path, fh) -> None:
        """``name`` now holds the file open as ``fh``: it is removed (on failure; the chain at the end)
        only while it still does, so a file another writer put at the name is never removed."""
        st = os.fstat(fh.fileno())
        self._targets.append((name, (st.st_dev, st.st_ino)))

    def _sync(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def _chain_line(self) -> None:
        self._ch.write(f"{self.count} sha256:{self._digest.hexdigest()}\n".encode())
        self._ch.flush()

    def write(self, step: StepPlan) -> None:
        if step.step != self.count:
            raise ValueError(f"steps must be written in order: expected step {self.count}, got {step.step}")
        data = _dump(step, self.fmt).encode()
        try:
            self._fh.write(data)
            self._sync()  # the record is in the file before its chain line vouches for it
            self._digest.update(data)
            self.count += 1
            self._chain_line()
        except OSError as e:
            self._abort()
            raise InputError(f"cannot write plan: {e.strerror or e}", source=self.path) from None

    def _abort(self) -> None:
        """Remove what was written (a follower keeps its open descriptors and sees the stream end)."""
        for name, ident in self._targets:
            remove_own(name, ident)
        self._targets = []
        for f in (self._fh, self._ch):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._fh = self._ch = None
        if self._signals is not None:
            sig, self._signals = self._signals, None
            sig.__exit__(None, None, None)

    def __exit__(self, et, ev, tb):
        if self._fh is None:  # a failed write has removed everything already
            return False
        if et is None and self.count != self.header.num_steps:
            self._abort()
            raise ValueError(f"header promises {self.header.num_steps} steps, {self.count} written")
        if et is not None:
            self._abort()
            return False
        try:
            self._fh.write(end_record(self.count, self._digest).encode())
            self._sync()
            remove_own(*self._targets[0])  # the chain: the end record vouches for the finished plan
            self._fh.close()
            self._ch.close()  # releases the lock: the stream is complete
        except OSError as e:
            self._abort()
            raise InputError(f"cannot write plan: {e.strerror or e}", source=self.path) from None
        finally:
            if self._signals is not None:
                sig, self._signals = self._signals, None
                sig.__exit__(None, None, None)
        return False


class FollowReader(PlanReader):
    """Read a plan while ``zeppelin plan --stream`` writes it: ``step(k)`` (k increasing) waits for
    step k and returns it once the chained digest vouches for it (see module docstring).

    ``on_wait(k, waited_s)``: called when step k has been waited for ``notice_s`` (once per
    step). A plan that is already complete (no chain file) is read and verified as a whole."""

    def __init__(self, path: str | os.PathLike, *, check: bool = True, poll_s: float = 0.05, notice_s: float = 1.0,
                 on_wait: Callable[[int, float], None] | None = None, stall_s: float = 300.0):
        super().__init__(path, check=check)
        self.poll_s, self.notice_s, self.on_wait, self.stall_s = poll_s, notice_s, on_wait, stall_s
        self._chain: list[str] = []
        self._buf = b""
        self._chain_bytes = 0
        self._cfh = open_chain(chain_path(self.path))  # None: a finished plan, its end record vouches for it
        self.following = self._cfh is not None
        if not self.following:
            self.verify()
            return
        self._wait(0, what="the plan's header")
        self._running = hashlib.sha256(self._header_raw)
        if "sha256:" + self._running.hexdigest() != self._chain[0]:
            raise InputError(f"the plan's header does not match its chain file {chain_path(self.path).name} "
                             "(a plan of another stream?)", source=self.path)
        self._next = 0
        self._off = self._first_step_offset
        self._last: StepPlan | None = None

    def _read_chain(self) -> None:
        limit = CHAIN_LINE_BYTES * (self.header.num_steps + 1)
        try:
            more = self._cfh.read(limit + 1 - self._chain_bytes)
        except OSError as e:
            raise InputError(f"cannot read the plan chain file: {e.strerror or e}", source=chain_path(self.path)) from None
        self._chain_bytes += len(more or b"")
        if self._chain_bytes > limit:
            raise InputError(f"chain file is larger than the {limit:,} bytes a plan of {self.header.num_steps} steps "
                             "has (not a chain zeppelin wrote)", source=chain_path(self.path))
        self._buf += more or b""
        *lines, self._buf = self._buf.split(b"\n")
        for ln in lines:
            count, _, digest = ln.decode("ascii", "replace").partition(" ")
            if count != str(len(self._chain)) or not digest.startswith("sha256:"):
                raise InputError(f"chain file: line {len(self._chain) + 1} is not the digest of record "
                                 f"{len(self._chain)}", source=chain_path(self.path))
            self._chain.append(digest)

    def _writer_alive(self) -> bool:
        try:
            fcntl.flock(self._cfh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return True
            raise
        fcntl.flock(self._cfh.fileno(), fcntl.LOCK_UN)
        return False

    def _wait(self, count: int, what: str) -> None:
        """Until the chain vouches for ``count`` step records (0: the header)."""
        t0 = last = time.monotonic()
        told = False
        have = len(self._chain)
        while True:
            self._read_chain()
            if len(self._chain) > count:
                return
            now = time.monotonic()
            if len(self._chain) > have:
                have, last = len(self._chain), now
            elif now - last > self.stall_s:
                raise InputError(f"{what}: the planner wrote nothing for {self.stall_s:g} s (--timeout); it is "
                                 f"stopped or stuck (the plan stream holds {max(have - 1, 0)} of "
                                 f"{self.header.num_steps} steps)", source=self.path)
            if not self._writer_alive():
                self._read_chain()
                if len(self._chain) > count:
                    return
                have = len(self._chain) - 1
                raise InputError(f"{what}: the planner stopped before writing it (the plan stream holds "
                                 f"{max(have, 0)} of {self.header.num_steps} steps)", source=self.path)
            waited = now - t0
            if not told and waited >= self.notice_s and self.on_wait is not None and count > 0:
                self.on_wait(count - 1, waited)
                told = True
            time.sleep(self.poll_s)

    def verify(self) -> None:
        if not getattr(self, "following", False):
            super().verify()

    def step(self, k: int) -> StepPlan:
        if not self.following:
            return super().step(k)
        if not 0 <= k < self.header.num_steps:
            raise InputError(f"step {k} out of range (plan has {self.header.num_steps} steps)", source=self.path)
        if k < self._next:
            if self._last is not None and self._last.step == k:
                return self._last
            raise InputError(f"step {k}: a followed plan is read in order (next: step {self._next})", source=self.path)
        while self._next <= k:
            n = self._next
            self._wait(n + 1, what=f"step {n}")
            rec, nxt = self._read_record(self._fh, self._off, what=f"step {n}")
            if rec is None or rec.get("kind") == "end":
                raise InputError(f"step {n}: plan is truncated", source=self.path)
            self._running.update(self._raw)
            if "sha256:" + self._running.hexdigest() != self._chain[n + 1]:
                raise InputError(f"step {n}: the record does not match its chained digest (the plan was edited "
                                 "while it was written)", source=self.path)
            step = self._parse_step(rec, n)  # every step, also one skipped over: its hash is kept
            self._note_step(step)
            if n == k:
                self._last = step
            self._off, self._next = nxt, n + 1
        return self._last

    def close(self) -> None:
        super().close()
        if self._cfh is not None:
            self._cfh.close()


#: the longest line of a chain file: ``COUNT sha256:HEX`` (a count of at most 7 digits)
CHAIN_LINE_BYTES = 7 + 1 + 7 + 64 + 1


def open_chain(path: Path):
    """The chain file opened for reading like the other small files zeppelin reads: non-blocking (a FIFO
    cannot hang the follower), a regular file only (a link to ``/dev/zero`` is refused); None when
    there is none."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InputError(f"cannot read the plan chain file: {e.strerror or e}", source=path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputError(f"plan chain file is {kind_of(st.st_mode)}, not a regular file", source=path)
    return os.fdopen(fd, "rb")


def waiting_line(k: int, waited: float) -> None:
    """``zeppelin run --follow``'s line when training waits for the planner (step ``k``; -1: the file)."""
    what = "to create the plan" if k < 0 else f"to write step {k}"
    print(f"zeppelin run: waiting for the planner {what} ({waited:.0f} s so far)", flush=True)


def open_plan_reader(path: str | os.PathLike, *, follow: bool = False, digest: str | None = None,
                     on_wait: Callable[[int, float], None] | None = None, wait_s: float = 300.0) -> PlanReader:
    """The reader ``zeppelin run`` uses: a :class:`FollowReader` with ``follow`` (waiting up to
    ``wait_s`` for the planner to create the file; ``on_wait(-1, s)`` says so), else a verified
    :class:`PlanReader` (``digest``: the end record's digest it must carry)."""
    if not follow:
        reader = PlanReader(path, digest=digest)
        reader.verify()
        return reader
    t0 = time.monotonic()
    told = False
    while not os.path.lexists(path):
        waited = time.monotonic() - t0
        if waited > wait_s:
            raise InputError(f"--follow: no plan appeared within {wait_s:g} s", source=path)
        if not told and waited >= 1.0 and on_wait is not None:
            on_wait(-1, waited)
            told = True
        time.sleep(0.1)
    return FollowReader(path, on_wait=on_wait, stall_s=wait_s)
