"""Shared plumbing of the baseline planners (``planner/baselines.py`` and ``planner/bl_*.py``).

* :class:`StepBuilder` accumulates micro-batches (groups, placements, per-unit queues), checks
  per-unit memory as it goes, adds the direct routes of inter-node ring groups and finishes a
  :class:`StepPlan` with the shared analytic prediction.
* small packing helpers (LPT balancing, first-fit-decreasing into micro-batches, padding,
  aligned power-of-two unit blocks) and the exact one-line failure messages.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from zeppelin.schemas.layout import contiguous_ranges, ranges_tokens, zigzag_ranges
from zeppelin.schemas.plan import (
    Group,
    MicroBatch,
    Placement,
    Route,
    RoutePath,
    Sequence,
    SolverInfo,
    StepPlan,
)

from .base import PlanContext, PlanningError

_TIER_ORDER = {"inter": 0, "intra": 1, "local": 2}


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


def pow2_sizes(limit: int) -> list[int]:
    """Powers of two 1, 2, 4, ... <= limit."""
    out, g = [], 1
    while g <= limit:
        out.append(g)
        g *= 2
    return out


def seq_label(i: int, seq: Sequence) -> str:
    return f"sequence {i} (sample {seq.sample_id}, {seq.length} tokens)"


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


def opt(options: dict[str, Any], key: str, kind: type, default, planner: str, minimum=None):
    """A planner option converted to ``kind`` (options may arrive as strings from the CLI)."""
    if key not in options or options[key] is None:
        return default
    raw = options[key]
    try:
        if kind is bool and isinstance(raw, str):
            low = raw.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            val = low in ("1", "true", "yes")
        else:
            val = kind(raw)
    except (TypeError, ValueError):
        raise PlanningError(f"{planner}: option {key}={raw!r} is not a valid {kind.__name__}") from None
    if minimum is not None and val < minimum:
        raise PlanningError(f"{planner}: option {key}={raw!r} must be at least {minimum}")
    return val


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


class StepBuilder:
    """Accumulates micro-batches of a step; one group per (micro-batch, unit set, kind)."""

    def __init__(self, ctx: PlanContext, sequences: list[Sequence], planner: str, n_units: int | None = None,
                 capacity: list[int] | int | None = None, replicas=None):
        self.ctx = ctx
        #: units that are replicas of mixed TP degree (Hydraulis): a unit's node is that of its GPU
        #: ranks; ring transfers between replicas run direct, one flow per TP rank over that rank's
        #: own NIC (every NIC of the node is already in use), so no routes are added
        self.replicas = replicas
        self.sequences = sequences
        self.planner = planner
        self.n = n_units if n_units is not None else ctx.num_units
        cap = ctx.cost.token_capacity if capacity is None else capacity
        self.cap = list(cap) if isinstance(cap, list) else [int(cap)] * self.n
        self.mbs: list[dict] = []

    # -- structure ------------------------------------------------------------------------
    def _mb(self, k: int) -> dict:
        while len(self.mbs) <= k:
            self.mbs.append({"groups": [], "key": {}, "placements": [], "held": [0] * self.n})
        return self.mbs[k]

    @property
    def num_microbatches(self) -> int:
        return len(self.mbs)

    def held(self, k: int, unit: int) -> int:
        return self._mb(k)["held"][unit] if k < len(self.mbs) else 0

    def tier_of(self, units: list[int]) -> str:
        if len(units) == 1:
            return "local"
        nodes = {self.node_of(u) for u in units}
        return "inter" if len(nodes) > 1 else "intra"

    def node_of(self, unit: int) -> int:
        if self.replicas is not None:
            return self.ctx.cluster.node_of(self.replicas[unit].ranks[0])
        return self.ctx.cost.node_of_unit(unit)

    def group(self, k: int, kind: str, units: list[int]) -> int:
        """Index of the group of ``kind`` over ``units`` (ring order) in micro-batch ``k``; created on demand."""
        mb = self._mb(k)
        if len(units) == 1:
            kind = "local"
        key = (kind, tuple(units))
        if key not in mb["key"]:
            mb["key"][key] = len(mb["groups"])
            mb["groups"].append(Group(kind=kind, tier=self.tier_of(units), units=list(units)))
        return mb["key"][key]

    def fits(self, k: int, units: list[int], per_unit_tokens: list[int]) -> bool:
        mb = self._mb(k) if k < len(self.mbs) else None
        for u, t in zip(units, per_unit_tokens):
            if (mb["held"][u] if mb else 0) + t > self.cap[u]:
                return False
        return True

    def place(self, k: int, kind: str, units: list[int], seq: int, scheme: str | None = None,
              padded_length: int | None = None) -> None:
        """Place sequence ``seq`` on ``units`` in micro-batch ``k`` (zigzag for ring/allgather,
        contiguous for ulysses, whole for one unit)."""
        G = len(units)
        length = self.sequences[seq].length
        total = padded_length if padded_length is not None else length
        if G == 1:
            scheme, ranges = "whole", [[[0, total]]]
        elif (scheme or ("contiguous" if kind == "ulysses" else "zigzag")) == "contiguous":
            scheme, ranges = "contiguous", contiguous_ranges(total, G)
        else:
            scheme, ranges = "zigzag", zigzag_ranges(total, G)
        gi = self.group(k, kind, units)
        mb = self._mb(k)
        mb["placements"].append(Placement(seq=seq, group=gi, scheme=scheme,
                                          padded_length=padded_length if padded_length != length else None,
                                          ranges=ranges))
        for pos, u in enumerate(units):
            mb["held"][u] += ranges_tokens(ranges[pos])

    # -- finishing --------------------------------------------------------------------------
    def _routes(self, mb: dict, groups: list[Group]) -> list[Route]:
        """Direct routes for every node-crossing hop of every inter-node ring group."""
        ctx = self.ctx
        if self.replicas is not None:
            return []
        per_group: dict[int, list[Placement]] = {}
        for p in mb["placements"]:
            per_group.setdefault(p.group, []).append(p)
        routes: list[Route] = []
        for gi, g in enumerate(groups):
            if g.kind != "ring" or g.tier != "inter":
                continue
            G = len(g.units)
            for pos in range(G):
                src, dst = g.units[pos], g.units[(pos + 1) % G]
                if self.node_of(src) == self.node_of(dst):
                    continue
                tokens = sum(ranges_tokens(p.ranges[pos]) for p in per_group.get(gi, ()))
                nic_s, nic_d = ctx.cluster.nic_of(src * ctx.tp), ctx.cluster.nic_of(dst * ctx.tp)
                routes.append(Route(group=gi, src=src, dst=dst, tokens=tokens,
                                    bytes=int(ctx.cost.kv_bytes(tokens)),
                                    paths=[RoutePath(via_src=src, via_dst=dst, nic_src=nic_s, nic_dst=nic_d,
                                                     tokens=tokens)]))
        return routes

    def microbatches(self) -> list[MicroBatch]:
        out = []
        for k, mb in enumerate(self.mbs):
            for u in range(self.n):
                if mb["held"][u] > self.cap[u]:  # defensive: every planner checks before placing
                    raise PlanningError(f"{self.planner}: internal error: unit {u} holds {mb['held'][u]} tokens "
                                        f"in micro-batch {k}, capacity {self.cap[u]}")
            groups: list[Group] = mb["groups"]
            # one global execution order (inter-node groups first, then intra-node, then local) so that
            # every member of a group reaches it in the same relative order as its peers
            order = sorted(range(len(groups)), key=lambda g: (_TIER_ORDER[groups[g].tier], g))
            queues: list[list[int]] = [[] for _ in range(self.n)]
            for g in order:
                for u in groups[g].units:
                    queues[u].append(g)
            out.append(MicroBatch(groups=groups, placements=mb["placements"], queues=queues,
                                  routes=self._routes(mb, groups)))
        if not out:
            out.append(MicroBatch(queues=[[] for _ in range(self.n)]))
        return out

    def finish(self, step: int, solver: SolverInfo, notes: dict[str, Any] | None = None,
               predict: Callable[[PlanContext, StepPlan], Any] | None = None, replicas=None) -> StepPlan:
        from .predict import predict_step

        placed = {p.seq for mb in self.mbs for p in mb["placements"]}
        missing = [i for i in range(len(self.sequences)) if i not in placed]
        if missing:
            i = missing[0]
            raise PlanningError(f"{self.planner}: internal error: {seq_label(i, self.sequences[i])} was not placed")
        plan = StepPlan(step=step, sequences=list(self.sequences), replicas=replicas,
                        microbatches=self.microbatches(), solver=solver, notes=dict(notes or {}))
        plan.prediction = (predict or predict_step)(self.ctx, plan)
        return plan


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
