"""Signals while a file is being written: SIGTERM and SIGHUP become an exception, so that the
writer's cleanup (removing its temporary files) runs before the process ends."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["Terminated", "cleanup_signals"]


class Terminated(BaseException):
    """Raised by the signal handlers :func:`cleanup_signals` installs (SIGTERM, SIGHUP) while a file
    is written (:func:`zeppelin.schemas.io.safefiles.atomic_write`, a streamed plan)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextmanager
def cleanup_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into :class:`Terminated` while writing (so the temporary file is removed),
    restoring the previous handlers afterwards. Only the main thread can install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, _raise_terminated)
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
