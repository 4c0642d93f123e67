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


_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _block() -> set | None:
    """Block SIGTERM/SIGHUP in this thread while handlers are swapped; the mask before (None where
    signals cannot be blocked)."""
    try:
        return signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    except (AttributeError, OSError, ValueError):
        return None


def _unblock(state: SignalState | None, mask: set | None) -> None:
    """Restore the mask :func:`_block` returned. With ``state``, a SIGTERM/SIGHUP that arrived while
    blocked is taken first and recorded there: delivered now, it would meet the handlers just
    restored (and CPython drops a signal whose handler was reset to the default between its arrival
    and the handler's run). Without, it reaches the handler just installed."""
    if mask is None:
        return
    wanted = [s for s in _SIGNALS if s not in mask]
    while state is not None and wanted:
        try:
            info = signal.sigtimedwait(wanted, 0)
        except (AttributeError, OSError):
            break
        if info is None:
            break
        if state.received is None:
            state.received = info.si_signo
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextmanager
def cleanup_signals() -> Iterator[SignalState]:
    """Turn SIGTERM/SIGHUP into :class:`Terminated` while writing (so the temporary file is removed),
    restoring the previous handlers afterwards. Only the main thread can install handlers.

    A signal is never lost: the handlers are swapped (both ways) with SIGTERM and SIGHUP blocked, so
    no signal lands between a handler's installation and its record or between the restoration and
    the final check; a signal that came meanwhile, or whose exception was swallowed or wrapped on its
    way (a ``__del__``, a callback that ignores exceptions, a serializer error), raises
    :class:`Terminated` when the block ends."""
    state = SignalState()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    closing = []

    def handler(signum, frame):
        if state.received is None:
            state.received = signum
        if not closing:  # while the handlers are being restored it only records (raised below)
            raise Terminated(signum)

    old = {}
    mask = _block()
    try:
        for sig in _SIGNALS:
            try:
                old[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass
        mask, before = None, mask
        _unblock(None, before)  # installed: a signal that came meanwhile reaches the handler now
        yield state
    except GeneratorExit:
        # a writer's generator closed unfinished (collected after the termination it was left
        # suspended by went past it): it only cleans up - raising here would be printed as an
        # exception ignored while the process ends
        raise
    except BaseException as e:
        # a library that turns the handler's exception into its own (pydantic wraps an exception
        # raised inside a serializer): still a termination, reported as such
        if state.received is not None and not isinstance(e, Terminated):
            raise Terminated(state.received) from e
        raise
    finally:
        closing.append(True)
        mask = _block() if mask is None else mask
        for sig, h in old.items():
            signal.signal(sig, h)
        _unblock(state, mask)
    state.check()
