"""Peak memory of one step: reset the high-water mark when a step starts, read it when it ends.

* CUDA: ``torch.cuda.reset_peak_memory_stats`` / ``max_memory_allocated`` (bytes allocated by
  tensors on the device).
* CPU (Linux): the process's resident-set high-water mark ``VmHWM`` from ``/proc/self/status``,
  reset by writing ``5`` to ``/proc/self/clear_refs`` (the kernel then sets the mark to the current
  RSS), so each step reports its own peak rather than the lifetime peak of the process.
* Elsewhere (no ``clear_refs``): ``ru_maxrss``, which cannot be reset - the lifetime peak; the
  returned dict says which source was used.

Usage::

    tracker = StepMemory(device)
    tracker.reset()          # at the start of each step
    ...                      # the step
    peak = tracker.peak()    # bytes
"""

from __future__ import annotations

import resource
import sys

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _read_status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> int | None:
    """Current resident set size of this process (bytes), or None where /proc is missing."""
    kib = _read_status_kib("VmRSS")
    return None if kib is None else kib * 1024


def reset_cpu_peak() -> bool:
    """Reset this process's RSS high-water mark to its current RSS; False where unsupported."""
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def cpu_peak_bytes() -> int:
    """The RSS high-water mark since the last :func:`reset_cpu_peak` (VmHWM), else ru_maxrss."""
    kib = _read_status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024  # macOS reports bytes


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def mmap_large_blocks(threshold: int = 1 << 20) -> bool:
    """Serve allocations of ``threshold`` bytes or more with their own ``mmap`` (glibc ``mallopt``),
    so that freeing a large tensor returns its pages to the OS at once.

    glibc raises its mmap threshold dynamically (up to 32 MiB) after large blocks are freed; tensors
    below it come from the heap, which fragments and keeps the resident set near its high-water mark.
    The ``--verify`` reference allocates and frees many layer-sized blocks: with this, rank 0's
    resident set tracks what it holds. Returns False where glibc's ``mallopt`` is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


class StepMemory:
    """Per-step peak memory of this process on ``device`` (a ``torch.device`` or its type name)."""

    def __init__(self, device) -> None:
        self.cuda = getattr(device, "type", device) == "cuda"
        self.device = device
        self.source = "cuda_max_allocated" if self.cuda else "vmhwm"
        self._resettable = True

    def reset(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
            return
        if not reset_cpu_peak():
            self._resettable = False
            self.source = "ru_maxrss_lifetime"

    def peak(self) -> int:
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated(self.device))
        return cpu_peak_bytes()


def step_peak_memory(device, fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and return ``(result, peak bytes during the call)``."""
    tracker = StepMemory(device)
    tracker.reset()
    out = fn(*args, **kwargs)
    return out, tracker.peak()


__all__ = ["StepMemory", "cpu_peak_bytes", "mmap_large_blocks", "reset_cpu_peak", "rss_bytes", "step_peak_memory"]
