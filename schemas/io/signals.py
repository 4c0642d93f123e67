"""Signals while a file is being written: SIGTERM and SIGHUP become an exception, so that the
writer's cleanup (removing its temporary files) runs before the process ends."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["SignalState", "Terminated", "cleanup_signals"]


class Terminated(BaseException):
    """Raised by the signal handlers :func:`cleanup_signals` installs (SIGTERM, SIGHUP) while a file
    is written (:func:`zeppelin.schemas.io.safefiles.atomic_write`, a streamed plan)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


class SignalState:
    """What :func:`cleanup_signals` yields: the first signal received while it was installed."""

    def __init__(self) -> None:
        self.received: int | None = None

    def check(self) -> None:
        """Raise :class:`Terminated` if a signal came (call it before the step that makes a write
        visible: a signal whose exception some code swallowed still stops the write)."""
        if self.received is not None:
            raise Terminated(self.received)


@contextmanager
def cleanup_signals() -> Iterator[SignalState]:
    """Turn SIGTERM/SIGHUP into :class:`Terminated` while writing (so the temporary file is removed),
    restoring the previous handlers afterwards. Only the main thread can install handlers.

    A signal is never lost: the handlers are installed inside the ``try`` that restores them, and a
    signal whose exception was swallowed on its way (a ``__del__``, a callback that ignores
    exceptions) raises :class:`Terminated` again when the block ends."""
    state = SignalState()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def handler(signum, frame):
        if state.received is None:
            state.received = signum
        raise Terminated(signum)

    old = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                old[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass
        yield state
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    state.check()
