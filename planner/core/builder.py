"""Building a :class:`StepPlan` placement by placement.

:class:`StepBuilder` accumulates micro-batches (groups, placements, per-unit queues), checks per-unit
memory as it goes, adds the direct routes of inter-node ring groups, orders every unit's queue
inter -> intra -> local, and finishes the :class:`StepPlan` with the shared analytic prediction. A
planner decides *where* each sequence goes; the builder writes it down in the plan format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from zeppelin.planner.costmodel.context import PlanContext, PlanningError
from zeppelin.schemas.invariants import inter_ring_transfers, kv_replication
from zeppelin.schemas.layout import contiguous_ranges, ranges_tokens, usp_ranges, zigzag_ranges
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

_TIER_ORDER = {"inter": 0, "intra": 1, "local": 2}


# (the slots every pydantic model carries, set directly: ``object.__setattr__`` costs more per record)
_SET_DICT = BaseModel.__dict__["__dict__"].__set__
_SET_FIELDS_SET = BaseModel.__pydantic_fields_set__.__set__
_SET_EXTRA = BaseModel.__pydantic_extra__.__set__
_SET_PRIVATE = BaseModel.__pydantic_private__.__set__


def record(cls, **fields):
    """``cls.model_construct(**fields)`` for records built from validated parts, with every field
    given: pydantic's validation (or model_construct) costs microseconds per call, and a step at
    4,096 GPUs builds tens of thousands of groups and placements."""
    m = cls.__new__(cls)
    defaults = _DEFAULTS.get(cls)
    if defaults is None:
        defaults = _defaults(cls)
    _SET_DICT(m, {**defaults, **fields} if defaults else fields)
    _SET_FIELDS_SET(m, set(fields))
    _SET_EXTRA(m, None)
    _SET_PRIVATE(m, None)
    return m


#: the fields a placement built by :func:`local_records` sets: all of them, so its placements share
#: this set (pydantic only ever adds a field's name to it, on assignment, and it holds them all)
_PLACEMENT_FIELDS = set(Placement.model_fields)


def local_records(seqs: list[int], units: list[int], lengths: list[int], first_group: int) -> tuple[list, list]:
    """The local groups and whole placements of local sequences, each as :func:`record` builds
    them (``record(Group, kind="local", tier="local", units=[u])``, ``record(Placement, seq=..,
    group=.., scheme="whole", ranges=[[[0, length]]], padded_length=None)``), without its generic
    work per record: sequence ``seqs[i]`` (of ``lengths[i]`` tokens) on unit ``units[i]``, the
    sequences of a unit together (a group per run of one unit, numbered from ``first_group``)."""
    new_g, new_p = Group.__new__, Placement.__new__
    g_copy = {"kind", "tier", "units"}.copy  # (a group leaves fields unset: each has its own set)
    p_set = _PLACEMENT_FIELDS
    set_dict, set_fs, set_extra, set_private = _SET_DICT, _SET_FIELDS_SET, _SET_EXTRA, _SET_PRIVATE
    g_defaults = _defaults(Group)
    groups: list = []
    placements: list = []
    gi, last = first_group - 1, None
    for seq, u, length in zip(seqs, units, lengths):
        if u != last:
            last, gi = u, gi + 1
            g = new_g(Group)
            set_dict(g, {**g_defaults, "kind": "local", "tier": "local", "units": [u]})
            set_fs(g, g_copy())
            set_extra(g, None)
            set_private(g, None)
            groups.append(g)
        p = new_p(Placement)
        set_dict(p, {"seq": seq, "group": gi, "scheme": "whole", "ranges": [[[0, length]]], "padded_length": None})
        set_fs(p, p_set)
        set_extra(p, None)
        set_private(p, None)
        placements.append(p)
    return groups, placements


_DEFAULTS: dict[type, dict] = {}


def _defaults(cls) -> dict:
    """The defaults of ``cls``'s optional fields that :func:`record` callers may leave out (a
    group's usp shape and K/V replication): the others are always given."""
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = {k: f.default for k, f in cls.model_fields.items()
                          if k in ("shape", "kv_replication") and not f.is_required()}
    return _DEFAULTS[cls]


def direct_routes(ctx: PlanContext, mb: MicroBatch) -> list[Route]:
    """The direct routes of a micro-batch: one path over the pair's own NICs (no proxies) for every
    node-crossing hop of every inter-node ring group that carries tokens
    (:func:`zeppelin.schemas.invariants.inter_ring_transfers`), in group and ring order. A unit of
    ``ctx.tp`` GPUs uses the NIC of its first GPU."""
    per_node = ctx.units_per_node
    node_of_unit = [u // per_node for u in range(ctx.num_units)]
    routes: list[Route] = []
    for (gi, src, dst), tokens in inter_ring_transfers(mb, node_of_unit).items():
        nic_s, nic_d = ctx.cluster.nic_of(src * ctx.tp), ctx.cluster.nic_of(dst * ctx.tp)
        nbytes = int(ctx.cost.kv_bytes(tokens) * ctx.cost.ring_hop_share(mb.groups[gi])[1])
        routes.append(Route(group=gi, src=src, dst=dst, tokens=tokens, bytes=nbytes,
                            paths=[RoutePath(via_src=src, via_dst=dst, nic_src=nic_s, nic_dst=nic_d, tokens=tokens)]))
    return routes


def seq_label(i: int, seq: Sequence) -> str:
    return f"sequence {i} (sample {seq.sample_id}, {seq.length} tokens)"


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

    def group(self, k: int, kind: str, units: list[int], shape: tuple[int, int] | None = None) -> int:
        """Index of the group of ``kind`` over ``units`` (ring order; usp: row by row, ``shape = (u,
        r)``) in micro-batch ``k``; created on demand."""
        mb = self._mb(k)
        if len(units) == 1:
            kind, shape = "local", None
        key = (kind, tuple(units), shape)
        if key not in mb["key"]:
            mb["key"][key] = len(mb["groups"])
            extra = {}
            if kind == "usp" and shape is not None:
                m, tp = self.ctx.model, self.ctx.tp
                extra = {"shape": list(shape), "kv_replication": kv_replication(m.num_heads, m.num_kv_heads, tp, shape[0])}
            mb["groups"].append(Group(kind=kind, tier=self.tier_of(units), units=list(units), **extra))
        return mb["key"][key]

    def fits(self, k: int, units: list[int], per_unit_tokens: list[int]) -> bool:
        mb = self._mb(k) if k < len(self.mbs) else None
        for u, t in zip(units, per_unit_tokens):
            if (mb["held"][u] if mb else 0) + t > self.cap[u]:
                return False
        return True

    def place(self, k: int, kind: str, units: list[int], seq: int, scheme: str | None = None,
              padded_length: int | None = None, shape: tuple[int, int] | None = None) -> None:
        """Place sequence ``seq`` on ``units`` in micro-batch ``k`` (zigzag for ring/allgather/usp,
        contiguous for ulysses, whole for one unit; ``shape``: a usp group's (u, r))."""
        G = len(units)
        length = self.sequences[seq].length
        total = int(padded_length) if padded_length is not None else length
        if G == 1:
            scheme, ranges = "whole", [[[0, total]]]
        elif kind == "usp" and shape is not None:
            scheme = scheme or "zigzag"
            ranges = usp_ranges(total, shape[0], shape[1], scheme)
        elif (scheme or ("contiguous" if kind == "ulysses" else "zigzag")) == "contiguous":
            scheme, ranges = "contiguous", contiguous_ranges(total, G)
        else:
            scheme, ranges = "zigzag", zigzag_ranges(total, G)
        gi = self.group(k, kind, units, shape if G > 1 else None)
        mb = self._mb(k)
        # (indices and ranges the builder derived itself: recorded without re-validation)
        mb["placements"].append(record(Placement, seq=int(seq), group=gi, scheme=scheme,
                                       padded_length=int(padded_length) if padded_length not in (None, length)
                                       else None, ranges=ranges))
        held = mb["held"]
        for pos, u in enumerate(units):
            held[u] += ranges_tokens(ranges[pos])

    # -- finishing --------------------------------------------------------------------------
    def microbatches(self, routes: bool = True) -> list[MicroBatch]:
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
            m = MicroBatch(groups=groups, placements=mb["placements"], queues=queues, routes=[])
            if routes and self.replicas is None:  # (replicas' ring transfers run direct, unrouted)
                m.routes = direct_routes(self.ctx, m)
            out.append(m)
        if not out:
            out.append(MicroBatch(queues=[[] for _ in range(self.n)]))
        return out

    def finish(self, step: int, solver: SolverInfo, notes: dict[str, Any] | None = None,
               predict: Callable[[PlanContext, StepPlan], Any] | None = None, replicas=None,
               routes: bool = True) -> StepPlan:
        """The step plan (``routes=False``: without the direct routes, for a caller that routes the
        micro-batches itself and predicts after)."""
        from zeppelin.planner.costmodel.predict import predict_step

        placed = {p.seq for mb in self.mbs for p in mb["placements"]}
        missing = [i for i in range(len(self.sequences)) if i not in placed]
        if missing:
            i = missing[0]
            raise PlanningError(f"{self.planner}: internal error: {seq_label(i, self.sequences[i])} was not placed")
        plan = StepPlan(step=step, sequences=list(self.sequences), replicas=replicas,
                        microbatches=self.microbatches(routes), solver=solver, notes=dict(notes or {}))
        plan.prediction = (predict or predict_step)(self.ctx, plan)
        return plan
