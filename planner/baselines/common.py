"""Shared plumbing of the baseline planners (``planner/baselines/``).

* :class:`~zeppelin.planner.core.builder.StepBuilder` (re-exported here) writes placements down
  as a :class:`StepPlan`;
* small packing helpers (LPT balancing, first-fit-decreasing into micro-batches, padding,
  aligned power-of-two unit blocks) and the exact one-line failure messages.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable

from zeppelin.planner.core.base import PlanContext, PlanningError, pow2_sizes
from zeppelin.planner.core.builder import StepBuilder, seq_label  # noqa: F401  (re-exported)
from zeppelin.schemas.plan import Sequence

# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    x = max(int(x), 1)
    return 1 << (x - 1).bit_length()


def is_pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def pad_to(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def cp_padded(length: int, G: int) -> int:
    """TransformerEngine THD layout: every sequence padded to a multiple of 2*CP (no padding at CP=1)."""
    return length if G <= 1 else pad_to(length, 2 * G)


def unit_word(ctx: PlanContext) -> str:
    return "one GPU" if ctx.tp == 1 else f"one {ctx.tp}-GPU replica"


def check_capacity(ctx: PlanContext, planner: str) -> int:
    """Per-unit activation token capacity; a clear error when the model states alone do not fit."""
    cap = ctx.cost.token_capacity
    if cap <= 0:
        gb = ctx.cost.model_state_bytes() / 1e9
        raise PlanningError(
            f"{planner}: model states of {ctx.model.name} need {gb:.1f} GB per GPU, more than the "
            f"{ctx.cluster.gpu.memory_gb:g} GB GPU holds after the reserve; no tokens fit"
        )
    return cap


def lpt(weights: Iterable[float], n_bins: int, base: list[float] | None = None) -> list[int]:
    """Longest-processing-time-first: each item (heaviest first) to the currently lightest bin.

    Returns the bin of every item (input order). Ties go to the lowest bin index.
    """
    w = list(weights)
    heap = [((base[b] if base else 0.0), b) for b in range(n_bins)]
    heapq.heapify(heap)
    out = [0] * len(w)
    for i in sorted(range(len(w)), key=lambda k: (-w[k], k)):
        load, b = heapq.heappop(heap)
        out[i] = b
        heapq.heappush(heap, (load + w[i], b))
    return out


def ffd(items: list[int], sizes: list[float], capacity: float) -> list[list[int]]:
    """First-fit decreasing: pack ``items`` (with ``sizes``) into bins of ``capacity``."""
    bins: list[list[int]] = []
    room: list[float] = []
    for i in sorted(items, key=lambda k: (-sizes[k], k)):
        for b, r in enumerate(room):
            if sizes[i] <= r:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


# ---------------------------------------------------------------------------------------------
# StepBuilder
# ---------------------------------------------------------------------------------------------


class Timer:
    def __init__(self):
        self.t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def aligned_blocks(n_units: int, G: int) -> list[list[int]]:
    """The aligned blocks of ``G`` consecutive units (G a power of two dividing the unit count)."""
    return [list(range(s, s + G)) for s in range(0, n_units - G + 1, G)]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def log2i(x: int) -> int:
    return int(math.log2(x))


def largest_pow2_block(n: int) -> int:
    return pow2_sizes(n)[-1]


def fitting_cp(length: int, cap: int, start: int = 1) -> int:
    """Smallest power-of-two CP size >= start whose padded per-rank share fits ``cap``."""
    G = next_pow2(max(start, ceil_div(length, cap)))
    while cp_padded(length, G) // G > cap:
        G *= 2
    return G


def cp_sizes(sequences: list[Sequence], tokens: int, gmax: int, too_large: Callable[[int, Sequence, int], str]) -> list[int]:
    """Each sequence's CP size: the smallest power of two whose padded per-rank share holds at most
    ``tokens`` (:func:`fitting_cp`). Raises :class:`PlanningError` with ``too_large(i, sequence,
    size)`` for the first sequence that needs more than ``gmax`` units."""
    out = []
    for i, s in enumerate(sequences):
        g = fitting_cp(s.length, tokens)
        if g > gmax:
            raise PlanningError(too_large(i, s, g))
        out.append(g)
    return out
