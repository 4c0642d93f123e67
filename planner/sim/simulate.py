"""Event-driven simulator of one training step (``zeppelin simulate``).

The analytic prediction (:mod:`zeppelin.planner.costmodel.predict`) adds up closed-form costs per unit. The
simulator plays the step out instead, with the same :class:`~zeppelin.planner.costmodel.cost.CostModel`
supplying every kernel and link time:

* **Resources.** Each unit has one compute stream. Every GPU rank has an intra-node send port and
  receive port (``intra_link`` bandwidth each way); every NIC ``node<k>/<id>`` has a send and a
  receive side (``inter_link`` bandwidth each way). A transfer is a *flow* over the resources it
  crosses; concurrent flows share bandwidth max-min fairly (progressive filling), so two transfers
  through one NIC each get half of it. A flow first waits its link latency (alpha), then moves its
  bytes at the rate it is given; alone on its links it takes exactly ``alpha + bytes / bandwidth``.
* **One transformer layer per micro-batch, in detail.** Forward and backward of a layer are
  modelled together, as the cost model does (block times are fwd+bwd, a ring round moves K,V
  forward and K,V,dK,dV backward). For a unit: its attention groups in plan queue order, the
  remap all-to-all into the linear layout, the linear modules, the remap back.
  - *ring* groups: round 0 computes the local block; in round r >= 1 a unit computes against the
    K/V block of ring position (i - r) mod G, which arrived during round r - 1. Every round is an
    explicit event; the transfer into a position starts when its sender holds the block and the
    receiver's double buffer is free, so a round ends at max(compute, transfer). Chunk-pair FLOPs
    are counted exactly from the token ranges (zigzag, contiguous, padding included).
  - inter-node transfers with a plan *route* become dispatch (intra link to the proxy) -> NIC
    transfer on the proxies' NICs -> combine (intra link to the destination), per path.
  - *ulysses*: an all-to-all before the attention (over heads) and one after; *allgather*: a ring
    all-gather of K/V (fwd) plus all-gather and reduce-scatter of dK/dV (bwd) before the compute.
  - the compute stream runs, among the tasks that are ready, the earliest in plan order: inter
    work first, then intra, then local, and local work fills the gaps while transfers are in flight.
* **Step.** Units coupled by communication in a micro-batch advance layer by layer together, so a
  unit's layer period is the latest finish among the units it exchanges data with; the step is
  ``sum over micro-batches of (num_layers x period + embedding/LM head)`` per unit, then the
  gradient all-reduce (``CostModel.grad_allreduce_time``) once every unit is done.

Output per step (:class:`SimResult`): step time, per-unit busy / exposed-communication / idle
breakdown, per-NIC bytes and busy fraction, and optionally the timeline of the simulated layers.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zeppelin.planner.costmodel.context import PlanContext
from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.schemas.layout import ranges_tokens
from zeppelin.schemas.plan import MicroBatch, Placement, PlanHeader, Replica, StepPlan

__all__ = [
    "Engine",
    "SimResult",
    "Simulator",
    "context_from_header",
    "simulate_plan",
    "summary",
]

_INF = float("inf")


# =============================================================================================
# A small discrete-event engine: compute tasks on per-unit streams, flows with max-min sharing
# =============================================================================================


class _Task:
    __slots__ = (
        "bw_start",
        "cap",
        "cat",
        "dur",
        "end",
        "hseq",
        "kind",
        "lat",
        "nbytes",
        "ndeps",
        "nics",
        "prio",
        "rate",
        "rem",
        "res",
        "rix",
        "start",
        "succs",
        "t_upd",
        "tid",
        "unit",
        "units",
        "work",
    )

    def __init__(self, tid: int, kind: str):
        self.tid, self.kind = tid, kind
        self.unit = -1
        self.prio: tuple = ()
        self.dur = 0.0
        self.nbytes = 0.0
        self.work = 0.0
        self.res: tuple = ()
        self.rix: list[int] = []
        self.lat = 0.0
        self.cap = _INF
        self.cat = ""
        self.units: tuple = ()
        self.nics: tuple = ()
        self.succs: list[int] = []
        self.ndeps = 0
        self.start = math.nan
        self.bw_start = math.nan
        self.end = math.nan
        self.rem = 0.0
        self.rate = 0.0
        self.t_upd = 0.0
        self.hseq = -1


class Engine:
    """Tasks with dependencies, run in simulated time.

    * ``compute(unit, seconds, prio)`` occupies the unit's stream; among ready tasks the stream
      picks the smallest ``prio`` (non-preemptive list scheduling).
    * ``flow(bytes, resources, latency)`` waits ``latency`` then moves ``bytes`` over every listed
      resource at once; ``capacity[resource]`` (bytes/s) is shared max-min fairly by the flows
      transferring through it at the same time.
    * ``mark(deps)`` completes as soon as its dependencies have.
    """

    def __init__(self, capacity: dict[str, float]):
        self.capacity = capacity
        self.tasks: list[_Task] = []
        self._rid: dict[str, int] = {}  # resource -> index into _cap (for the vectorised rates)
        self._cap: list[float] = []

    def _new(self, kind: str, deps: Iterable[int]) -> _Task:
        t = _Task(len(self.tasks), kind)
        t.succs = []
        for d in deps:
            self.tasks[d].succs.append(t.tid)
            t.ndeps += 1
        self.tasks.append(t)
        return t

    def compute(self, unit: int, seconds: float, prio: tuple, deps: Iterable[int] = (), cat: str = "attention") -> int:
        if not seconds >= 0.0:  # an event before its cause would stall the event loop, not fail it
            raise ValueError(f"simulated {cat} compute of {seconds!r} s on unit {unit}: durations must be >= 0")
        t = self._new("compute", deps)
        t.unit, t.dur, t.prio, t.cat = unit, float(seconds), prio, cat
        return t.tid

    def flow(self, nbytes: float, resources: tuple, latency: float, deps: Iterable[int] = (), *,
             work: float | None = None, cap: float = _INF, cat: str = "comm", units: tuple = (),
             nics: tuple = ()) -> int:
        """``work`` (default ``nbytes``) is what the bandwidth must move: bytes / efficiency."""
        rix = []
        for r in resources:
            k = self._rid.get(r)
            if k is None:
                if r not in self.capacity:
                    raise KeyError(f"unknown resource {r!r}")
                k = self._rid[r] = len(self._cap)
                self._cap.append(self.capacity[r])
            rix.append(k)
        t = self._new("flow", deps)
        t.rix = rix
        t.nbytes = float(nbytes)
        t.work = float(nbytes if work is None else work)
        t.res, t.lat, t.cap, t.cat, t.units, t.nics = tuple(resources), float(latency), cap, cat, units, nics
        return t.tid

    def mark(self, deps: Iterable[int]) -> int:
        return self._new("mark", deps).tid

    # ------------------------------------------------------------------ run
    def run(self) -> float:
        """Simulate every task; returns the time the last one ends.

        Flow progress is tracked lazily: a flow's remaining work is brought up to date only when
        its rate changes, and its projected end sits in the event heap (stale entries are skipped).
        When the set of transferring flows changes, only the flows connected to the changed
        resources (through shared resources) get new max-min rates.
        """
        tasks = self.tasks
        heap: list[tuple[float, int, int, int]] = []  # (time, seq, code, tid)
        ready: dict[int, list] = defaultdict(list)
        busy: dict[int, bool] = defaultdict(bool)
        on_res: dict[str, set[int]] = defaultdict(set)  # resource -> transferring flows
        dirty: set[str] = set()
        fresh: list[_Task] = []  # flows that started transferring at this instant
        kick: set[int] = set()  # units whose stream should pick a task once this instant is processed
        seq = 0
        COMPUTE_DONE, BW_START, FLOW_DONE = 0, 1, 2

        def push(time: float, code: int, tid: int) -> int:
            nonlocal seq
            seq += 1
            heapq.heappush(heap, (time, seq, code, tid))
            return seq

        def start_next(u: int, now: float) -> None:
            q = ready[u]
            if q and not busy[u]:
                _, tid = heapq.heappop(q)
                t = tasks[tid]
                t.start = now
                busy[u] = True
                push(now + t.dur, COMPUTE_DONE, tid)

        def finish(t: _Task, now: float) -> None:
            t.end = now
            if t.kind == "compute":
                busy[t.unit] = False
                kick.add(t.unit)
            for s in t.succs:
                st = tasks[s]
                st.ndeps -= 1
                if st.ndeps == 0:
                    release(st, now)

        def begin_bw(t: _Task, now: float) -> None:
            t.bw_start = now
            if t.work <= 0.0:
                finish(t, now)
                return
            t.rem, t.t_upd, t.rate = t.work, now, 0.0
            for r in t.res:
                on_res[r].add(t.tid)
                dirty.add(r)
            fresh.append(t)

        def release(t: _Task, now: float) -> None:
            if t.kind == "compute":
                heapq.heappush(ready[t.unit], (t.prio, t.tid))
                kick.add(t.unit)
            elif t.kind == "flow":
                t.start = now
                if t.lat > 0.0:
                    push(now + t.lat, BW_START, t.tid)
                else:
                    begin_bw(t, now)
            else:
                t.start = now
                finish(t, now)

        def settle(now: float) -> None:
            """After an instant: start streams, re-rate the flows whose resources changed."""
            while kick:
                start_next(kick.pop(), now)
            if not dirty and not fresh:
                return
            comp: dict[int, _Task] = {t.tid: t for t in fresh}
            stack = list(dirty)
            seen_res = set(stack)
            for t in fresh:
                for r in t.res:
                    if r not in seen_res:
                        seen_res.add(r)
                        stack.append(r)
            while stack:
                r = stack.pop()
                for tid in on_res.get(r, ()):
                    if tid not in comp:
                        f = tasks[tid]
                        comp[tid] = f
                        for r2 in f.res:
                            if r2 not in seen_res:
                                seen_res.add(r2)
                                stack.append(r2)
            dirty.clear()
            fresh.clear()
            if not comp:
                return
            flows = list(comp.values())
            new_rates = self._rates(flows)
            for f, rate in zip(flows, new_rates):
                if rate != f.rate:
                    f.rem -= f.rate * (now - f.t_upd)
                    f.t_upd, f.rate = now, rate
                    f.hseq = push(now + max(f.rem, 0.0) / rate, FLOW_DONE, f.tid)

        for t in [t for t in tasks if t.ndeps == 0]:
            release(t, 0.0)
        now = 0.0
        settle(now)
        while heap:
            now = heap[0][0]
            while heap and heap[0][0] <= now * (1 + 1e-12) + 1e-15:
                _, sq, code, tid = heapq.heappop(heap)
                t = tasks[tid]
                if code == COMPUTE_DONE:
                    finish(t, now)
                elif code == BW_START:
                    begin_bw(t, now)
                elif sq == t.hseq:  # FLOW_DONE, not superseded by a rate change
                    t.rem, t.rate = 0.0, 0.0
                    for r in t.res:
                        on_res[r].discard(tid)
                        dirty.add(r)
                    finish(t, now)
            settle(now)
        stuck = [t.tid for t in tasks if math.isnan(t.end)]
        if stuck:  # a dependency cycle: a bug in the caller, not bad input
            raise RuntimeError(f"simulation deadlock: {len(stuck)} tasks never ran (first: {stuck[:5]})")
        return max((t.end for t in tasks), default=0.0)

    def _rates(self, flows: list[_Task]) -> list[float]:
        """Max-min fair rates of ``flows`` (a closed set: every flow sharing their resources)."""
        if len(flows) >= _VECTOR_FLOWS:
            return self._rates_np(flows)
        cap = self.capacity
        count: dict[str, int] = {}
        for f in flows:
            for r in f.res:
                count[r] = count.get(r, 0) + 1
        rates = [0.0] * len(flows)
        contended = []
        for i, f in enumerate(flows):
            rate = f.cap
            for r in f.res:
                if count[r] != 1:
                    contended.append(i)
                    break
                c = cap[r]
                rate = min(rate, c)
            else:
                rates[i] = rate if rate < _INF else 1e30
        if not contended:
            return rates
        residual = {r: cap[r] for r in count}
        count = defaultdict(int)
        for i in contended:
            for r in flows[i].res:
                count[r] += 1
        unfrozen = contended
        while unfrozen:
            share = min((residual[r] / c for r, c in count.items() if c > 0), default=_INF)
            share = min(share, min(flows[i].cap for i in unfrozen))
            if share == _INF:
                share = 1e30
            thr = share * (1 + 1e-9)
            neck = {r for r, c in count.items() if c > 0 and residual[r] / c <= thr}
            keep = []
            for i in unfrozen:
                f = flows[i]
                if f.cap <= thr or not neck.isdisjoint(f.res):
                    rates[i] = max(share, 1e-30)
                    for r in f.res:
                        residual[r] -= share
                        count[r] -= 1
                else:
                    keep.append(i)
            unfrozen = keep
        return rates


    def _rates_np(self, flows: list[_Task]) -> list[float]:
        """Progressive filling as :meth:`_rates`, vectorised over the flows (large all-to-alls)."""
        width = max(len(f.rix) for f in flows)
        pad = len(self._cap)  # index of an unlimited dummy resource
        if width == 0:
            inc = np.full((len(flows), 1), pad, dtype=np.int64)
        else:
            inc = np.array([f.rix + [pad] * (width - len(f.rix)) for f in flows], dtype=np.int64)
        used_r, inc = np.unique(inc, return_inverse=True)
        inc = inc.reshape(len(flows), -1)
        R = len(used_r)
        residual = np.array(self._cap + [_INF], dtype=np.float64)[used_r]
        real = used_r != pad
        fcap = np.array([f.cap for f in flows], dtype=np.float64)
        rates = np.zeros(len(flows))
        live = np.ones(len(flows), dtype=bool)
        while live.any():
            cnt = np.bincount(inc[live].ravel(), minlength=R).astype(np.float64)
            act = real & (cnt > 0)
            per = np.full(R, _INF)
            per[act] = residual[act] / cnt[act]
            share = min(float(per.min()), float(fcap[live].min()))
            if share == _INF:
                share = 1e30
            thr = share * (1 + 1e-9)
            neck = act & (per <= thr)
            hit = live & (neck[inc].any(axis=1) | (fcap <= thr))
            rates[hit] = max(share, 1e-30)
            np.subtract.at(residual, inc[hit].ravel(), share)
            live &= ~hit
        return rates.tolist()


_VECTOR_FLOWS = 48  # contended flows from which max-min rates are computed with numpy


# =============================================================================================
# Results
# =============================================================================================


@dataclass
class UnitStats:
    attention_s: float = 0.0
    linear_s: float = 0.0  # linear modules + embedding/LM head
    exposed_comm_s: float = 0.0  # stream idle while waiting for its own transfers (+ all-reduce)
    idle_s: float = 0.0  # waiting for coupled units and for the slowest unit of the step
    comm_s: float = 0.0  # time with a transfer of this unit in flight (overlapped or not)
    tokens: int = 0

    @property
    def busy_s(self) -> float:
        return self.attention_s + self.linear_s


@dataclass
class NICStats:
    bytes: float = 0.0  # sent + received over the step (attention, routing, remap traffic)
    busy_s: float = 0.0  # time with at least one transfer moving data through it
    busy_frac: float = 0.0
    util: float = 0.0  # bytes / (2 directions x bandwidth x step time)


@dataclass
class Interval:
    unit: int
    start: float
    end: float
    cat: str  # attention | linear | comm-intra | comm-inter | remap | route ...
    lane: str  # "compute" or "comm"


@dataclass
class MicroBatchTimeline:
    layer_period_s: float  # max over units of the simulated layer's finish
    intervals: list[Interval] = field(default_factory=list)
    #: per unit: the layer's period as the unit runs it (it waits for the units it shares groups with,
    #: not for the others), and the output head after the micro-batch's last layer
    unit_period_s: list[float] = field(default_factory=list)
    head_s: list[float] = field(default_factory=list)


@dataclass
class SimResult:
    step: int
    step_time_s: float
    compute_end_s: float  # when the last unit finished its micro-batches (before the all-reduce)
    allreduce_s: float
    lower_bound_s: float
    predicted_s: float | None  # the plan's analytic prediction, if it carries one
    num_layers: int
    units: list[UnitStats]
    nics: dict[str, NICStats]
    layer_periods_s: list[float]  # per micro-batch, max over units
    timeline: list[MicroBatchTimeline] | None = None
    #: bytes per step through each NIC by transfer kind (ring, ulysses, allgather, remap): {kind: {nic: bytes}}
    nic_traffic: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "step": self.step,
            "step_time_s": self.step_time_s,
            "compute_end_s": self.compute_end_s,
            "allreduce_s": self.allreduce_s,
            "lower_bound_s": self.lower_bound_s,
            "predicted_s": self.predicted_s,
            "layer_periods_s": self.layer_periods_s,
            "per_unit": {
                "busy_s": [u.busy_s for u in self.units],
                "attention_s": [u.attention_s for u in self.units],
                "linear_s": [u.linear_s for u in self.units],
                "exposed_comm_s": [u.exposed_comm_s for u in self.units],
                "idle_s": [u.idle_s for u in self.units],
                "comm_s": [u.comm_s for u in self.units],
                "tokens": [u.tokens for u in self.units],
            },
            "nics": {k: {"bytes": v.bytes, "busy_s": v.busy_s, "busy_frac": v.busy_frac, "util": v.util}
                     for k, v in sorted(self.nics.items())},
            "nic_traffic": {k: dict(sorted(v.items())) for k, v in sorted(self.nic_traffic.items())},
        }
        if timeline and self.timeline is not None:
            d["timeline"] = [
                {"layer_period_s": mb.layer_period_s, "unit_period_s": mb.unit_period_s, "head_s": mb.head_s,
                 "intervals": [[iv.unit, iv.start, iv.end, iv.cat, iv.lane] for iv in mb.intervals]}
                for mb in self.timeline
            ]
        return d

    @property
    def exposed_comm_s(self) -> float:
        """Mean over units of exposed communication."""
        return float(np.mean([u.exposed_comm_s for u in self.units])) if self.units else 0.0

    @property
    def max_nic_busy_frac(self) -> float:
        return max((n.busy_frac for n in self.nics.values()), default=0.0)


# =============================================================================================
# The simulator
# =============================================================================================


def context_from_header(header: PlanHeader) -> PlanContext:
    return PlanContext(header.cluster, header.model, header.profile, tp=header.tp,
                       zero_stage=header.zero_stage, recompute=header.recompute, tp_overlap=header.tp_overlap, seed=header.seed,
                       options=dict(header.planner_options))


def _prefix_pairs(x: np.ndarray, ks: np.ndarray, ke: np.ndarray) -> np.ndarray:
    """Number of causal (q, k) pairs with q < x, ks <= k < ke and k <= q."""
    lk = ke - ks
    m = np.clip(x - ks, 0, lk)
    return m * (m + 1) / 2.0 + np.maximum(x - ke, 0) * lk


class Simulator:
    """Simulates steps of plans made for ``ctx`` (build it with :func:`context_from_header`)."""

    def __init__(self, ctx: PlanContext):
        self.ctx = ctx
        self.cluster = ctx.cluster
        c = ctx.cost
        self.intra_bw = c.intra_link.bandwidth_GBps * 1e9
        self.intra_alpha = c.intra_link.alpha_s
        self.nic_bw = c.inter_link.bandwidth_GBps * 1e9
        self.nic_alpha = c.inter_link.alpha_s
        self.nic_shared = ctx.profile.nic_shared_by_concurrent_transfers
        self.attn_overhead = c.attn_call_overhead
        cap: dict[str, float] = {}
        for g in range(self.cluster.world_size):
            cap[f"gtx{g}"] = self.intra_bw
            cap[f"grx{g}"] = self.intra_bw
        for node in range(self.cluster.num_nodes):
            for nic in self.cluster.nics:
                name = f"node{node}/{nic.id}"
                cap[f"ntx:{name}"] = self.nic_bw
                cap[f"nrx:{name}"] = self.nic_bw
        self.capacity = cap

    # ------------------------------------------------------------------ helpers
    def cost_for(self, tp: int) -> CostModel:
        return self.ctx.cost_for(tp)

    def replicas(self, step: StepPlan) -> list[Replica]:
        if step.replicas is not None:
            return step.replicas
        t = self.ctx.tp
        return [Replica(ranks=list(range(u * t, (u + 1) * t)), tp=t) for u in range(self.cluster.world_size // t)]

    # ------------------------------------------------------------------ public
    def simulate_step(self, step: StepPlan, *, timeline: bool = False) -> SimResult:
        from zeppelin.planner.costmodel.predict import lower_bounds

        ctx = self.ctx
        reps = self.replicas(step)
        n = len(reps)
        L = ctx.model.num_layers
        units = [UnitStats() for _ in range(n)]
        nic_bytes: dict[str, float] = defaultdict(float)
        nic_busy: dict[str, float] = defaultdict(float)
        traffic: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        finish = np.zeros(n)
        periods: list[float] = []
        tl: list[MicroBatchTimeline] = []
        for mb in step.microbatches:
            # one task graph per layer type (attention window), counted for its layers
            acc = np.zeros((5, n))  # attention, linear, exposed, comm, period per unit
            for w, nl in ctx.model.window_counts().items():
                lay = _Layer(self, step, mb, reps, window=w)
                lay.build()
                lay.engine.run()
                f, comp_a, comp_l, comm, comps = lay.unit_results()
                period_u = np.zeros(n)
                for comp in comps:
                    m = max(f[u] for u in comp)
                    for u in comp:
                        period_u[u] = m
                for u in range(n):
                    acc[0, u] += float(nl * comp_a[u])
                    acc[1, u] += nl * comp_l[u]
                    acc[2, u] += float(nl * max(f[u] - comp_a[u] - comp_l[u], 0.0))
                    acc[3, u] += float(nl * comm[u])
                acc[4] += nl * period_u
                for nic, b in lay.nic_bytes().items():
                    nic_bytes[nic] += nl * b
                for nic, b in lay.nic_busy().items():
                    nic_busy[nic] += nl * b
                for (kind, nic), b in lay.nic_traffic().items():
                    traffic[kind][nic] += nl * b
            lin_tok = lay.linear_tokens
            head = np.array([float(self.cost_for(reps[u].tp).head_time(lin_tok[u])) for u in range(n)])
            for u in range(n):
                st = units[u]
                st.attention_s += float(acc[0, u])
                st.linear_s += float(acc[1, u] + head[u])
                st.exposed_comm_s += float(acc[2, u])
                st.comm_s += float(acc[3, u])
                st.tokens += int(lin_tok[u])
            finish += acc[4] + head
            periods.append(float(f.max()) if n else 0.0)
            if timeline:
                tl.append(MicroBatchTimeline(layer_period_s=float(f.max()), intervals=lay.intervals(),
                                             unit_period_s=[float(x) for x in period_u],
                                             head_s=[float(x) for x in head]))
        # each replica all-reduces its own shards (replicas of another TP degree: their cost model)
        tps = {r.tp for r in step.replicas} if step.replicas is not None else {ctx.tp}
        ar = max(self.cost_for(t).step_collectives_time(len(step.microbatches), n) for t in tps)
        compute_end = float(finish.max()) if n else 0.0
        step_time = compute_end + ar
        for st in units:
            st.exposed_comm_s += ar
            st.comm_s += ar
            st.idle_s = max(step_time - st.busy_s - st.exposed_comm_s, 0.0)
        nics: dict[str, NICStats] = {}
        for nic in sorted(set(nic_bytes) | set(nic_busy)):
            b = nic_bytes.get(nic, 0.0)
            busy = nic_busy.get(nic, 0.0)
            nics[nic] = NICStats(bytes=b, busy_s=busy, busy_frac=busy / step_time if step_time > 0 else 0.0,
                                 util=b / (2 * self.nic_bw * step_time) if step_time > 0 else 0.0)
        lengths = np.array([s.length for s in step.sequences], dtype=np.float64)
        if step.prediction is not None:
            lb = step.prediction.lower_bound_s
        else:
            wb, lbl = lower_bounds(ctx, lengths)
            lb = max(wb, lbl)
        return SimResult(
            step=step.step, step_time_s=step_time, compute_end_s=compute_end, allreduce_s=ar, lower_bound_s=lb,
            predicted_s=step.prediction.step_time_s if step.prediction is not None else None,
            num_layers=L, units=units, nics=nics, layer_periods_s=periods, timeline=tl if timeline else None,
            nic_traffic={k: dict(v) for k, v in traffic.items()},
        )

    def nic_traffic(self, step: StepPlan) -> dict[str, dict[str, float]]:
        """The bytes per step through each NIC by transfer kind, ``{kind: {nic: bytes}}``: the flows
        :meth:`simulate_step` would move (the same task graph, built without kernel times and not run),
        so that a summary of a plan counts exactly the traffic its simulation puts on the NICs."""
        reps = self.replicas(step)
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for mb in step.microbatches:
            for w, nl in self.ctx.model.window_counts().items():
                lay = _Layer(self, step, mb, reps, compute=False, window=w)
                lay.build()
                for (kind, nic), b in lay.nic_traffic().items():
                    out[kind][nic] += nl * b
        return {k: dict(v) for k, v in out.items()}


class _Layer:
    """The task graph of one transformer layer (fwd + bwd) of one micro-batch."""

    def __init__(self, sim: Simulator, step: StepPlan, mb: MicroBatch, reps: list[Replica], compute: bool = True,
                 window: int | None = None):
        self.sim, self.step, self.mb, self.reps = sim, step, mb, reps
        #: the layer's attention window (None: full causal attention)
        self.window = window
        #: False: kernel times are not priced (every compute task takes no time): the graph is built
        #: for its transfers only (:meth:`Simulator.nic_traffic`)
        self.compute = compute
        self.n = len(reps)
        self.engine = Engine(sim.capacity)
        self.node = [sim.cluster.node_of(r.ranks[0]) for r in reps]
        self.attn_tasks: dict[int, list[int]] = defaultdict(list)  # unit -> compute tasks of attention
        self.links: list[tuple[int, int]] = []  # coupled unit pairs
        self.linear_tokens = np.zeros(self.n, dtype=np.int64)

    # ------------------------------------------------------------------ transfers
    def _gpu_flow(self, ga: int, gb: int, nbytes: float, deps, cat: str, units: tuple, work: float | None = None,
                  latency_mult: float = 1.0, nic_a: str | None = None, nic_b: str | None = None) -> int:
        """One GPU-to-GPU flow over the intra link (same node) or the two NICs (different nodes)."""
        sim, cl = self.sim, self.sim.cluster
        if cl.node_of(ga) == cl.node_of(gb):
            if ga == gb:
                return self.engine.mark(deps)
            return self.engine.flow(nbytes, (f"gtx{ga}", f"grx{gb}"), sim.intra_alpha * latency_mult, deps,
                                    work=work, cat=cat + "-intra", units=units)
        na = nic_a or cl.nic_of(ga)
        nb = nic_b or cl.nic_of(gb)
        if sim.nic_shared:
            res, cap = (f"ntx:{na}", f"nrx:{nb}"), _INF
        else:
            res, cap = (), sim.nic_bw
        return self.engine.flow(nbytes, res, sim.nic_alpha * latency_mult, deps, work=work, cap=cap,
                                cat=cat + "-inter", units=units, nics=(na, nb))

    def transfer(self, a: int, b: int, per_gpu_bytes: float, deps, cat: str, *, route=None,
                 work_factor: float = 1.0, latency_mult: float = 1.0) -> int:
        """Unit ``a`` -> unit ``b``: one flow per tensor-parallel rank (each moves its shard)."""
        ra, rb = self.reps[a].ranks, self.reps[b].ranks
        self.links.append((a, b))
        deps = list(deps)
        if route is not None and self.node[a] != self.node[b]:
            return self._routed(a, b, per_gpu_bytes, deps, cat, route, work_factor)
        ends = []
        for k, ga in enumerate(ra):
            gb = rb[k % len(rb)]
            ends.append(self._gpu_flow(ga, gb, per_gpu_bytes, deps, cat, (a, b), work=per_gpu_bytes * work_factor,
                                       latency_mult=latency_mult))
        tid = ends[0] if len(ends) == 1 else self.engine.mark(ends)
        return tid

    def _routed(self, a: int, b: int, per_gpu_bytes: float, deps, cat: str, route, work_factor: float) -> int:
        """dispatch (src -> proxy, NVLink) -> NIC transfer (proxy -> proxy) -> combine (proxy -> dst)."""
        ends = []
        total = route.tokens
        for p in route.paths:
            if p.tokens <= 0 or total <= 0:
                continue
            share = per_gpu_bytes * p.tokens / total
            ra, rb = self.reps[a].ranks, self.reps[b].ranks
            pa, pb = self.reps[p.via_src].ranks, self.reps[p.via_dst].ranks
            self.links += [(a, p.via_src), (p.via_src, p.via_dst), (p.via_dst, b)]
            for k, ga in enumerate(ra):
                d = list(deps)
                gpa = pa[k % len(pa)]
                gpb = pb[k % len(pb)]
                gb = rb[k % len(rb)]
                if gpa != ga:
                    d = [self._gpu_flow(ga, gpa, share, d, "dispatch", (a, p.via_src), work=share * work_factor)]
                one_nic = len(pa) == 1 and len(pb) == 1
                d = [self._gpu_flow(gpa, gpb, share, d, cat, (p.via_src, p.via_dst), work=share * work_factor,
                                    nic_a=p.nic_src if one_nic else None, nic_b=p.nic_dst if one_nic else None)]
                if gpb != gb:
                    d = [self._gpu_flow(gpb, gb, share, d, "combine", (p.via_dst, b), work=share * work_factor)]
                ends.append(d[0])
        tid = self.engine.mark(ends) if ends else self.engine.mark(deps)
        return tid

    # ------------------------------------------------------------------ attention blocks
    def _block_times(self, pls: list[Placement], G: int, cost: CostModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per placement p, position i, round r: fwd+bwd time of i's queries against the K/V of
        position (i - r) mod G (one kernel call); also tokens per (p, position) and call counts."""
        P = len(pls)
        R = max(1, max(len(rs) for p in pls for rs in p.ranges))
        qs = np.zeros((P, G, R))
        qe = np.zeros((P, G, R))
        for pi, p in enumerate(pls):
            for i, rs in enumerate(p.ranges):
                for k, (s, e) in enumerate(rs):
                    qs[pi, i, k], qe[pi, i, k] = s, e
        tok = (qe - qs).sum(axis=2)  # (P, G)
        j = (np.arange(G)[:, None] - np.arange(G)[None, :]) % G  # [i, r] -> source position
        q_start = qs[:, :, None, :, None]
        q_end = qe[:, :, None, :, None]
        k_start = qs[:, j][:, :, :, None, :]
        k_end = qe[:, j][:, :, :, None, :]
        causal = _prefix_pairs(q_end, k_start, k_end) - _prefix_pairs(q_start, k_start, k_end)
        pairs = causal
        w = self.window
        if w is not None:  # the pairs with k <= q - w: those of the queries shifted back by w
            pairs = causal - (_prefix_pairs(q_end - w, k_start, k_end) - _prefix_pairs(q_start - w, k_start, k_end))
        lq = np.broadcast_to(q_end - q_start, pairs.shape)
        lk = np.broadcast_to(k_end - k_start, pairs.shape)
        nz = (pairs > 0) & (lq > 0) & (lk > 0)
        if not self.compute:
            return np.zeros((P, G, G)), tok, nz.sum(axis=(3, 4))
        same_start = np.broadcast_to(q_start, pairs.shape) == np.broadcast_to(k_start, pairs.shape)
        square = nz & same_start & (lq == lk)
        diag = square & (pairs >= causal)
        wdiag = square & ~diag  # a diagonal the window cuts: a causal square of its pair count
        full = nz & ~square & (pairs >= lq * lk)
        part = nz & ~square & ~full
        t = np.zeros(pairs.shape)
        if diag.any():
            t[diag] = cost.attn_block_time(lq[diag], lq[diag], causal=True)
        if full.any():
            t[full] = cost.attn_block_time(lq[full], lk[full], causal=False)
        if part.any():
            t[part] = cost.attn_block_time(lq[part], pairs[part] / lq[part], causal=False)
        if wdiag.any():
            e = np.sqrt(2.0 * pairs[wdiag])
            t[wdiag] = cost.attn_block_time(e, e, causal=True)
        calls = nz.sum(axis=(3, 4))  # pieces per (p, i, r)
        tt = t.sum(axis=(3, 4)) - np.maximum(calls - 1, 0) * self.sim.attn_overhead
        # the overhead comes from the whole-sequence fit, the pieces from the block fit: where
        # pieces cost less than it, fusing them still costs at least the largest one
        tt = np.maximum(tt, t.max(axis=(3, 4)))
        return tt, tok, calls

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        mb, eng = self.mb, self.engine
        n = self.n
        by_group: dict[int, list[Placement]] = defaultdict(list)
        for p in mb.placements:
            by_group[p.group].append(p)
        qpos: dict[tuple[int, int], int] = {}
        for u, q in enumerate(mb.queues):
            for k, g in enumerate(q):
                qpos[(u, g)] = k
        routes = {(r.group, r.src, r.dst): r for r in mb.routes}
        for gi, g in enumerate(mb.groups):
            pls = by_group.get(gi, [])
            if not pls:
                continue
            U = g.units
            G = len(U)
            if g.kind == "local" or G == 1:
                self._local(U[0], pls, qpos.get((U[0], gi), 0))
            elif g.kind == "ring":
                self._ring(gi, U, pls, qpos, routes)
            elif g.kind == "allgather":
                self._allgather(gi, U, pls, qpos, routes)
            else:
                self._ulysses(gi, U, pls, qpos)
        # linear modules and remap
        attn_done = {u: eng.mark(self.attn_tasks.get(u, [])) for u in range(n)}
        att = mb.attention_layout(n)
        lin = mb.linear_layout if mb.linear_layout is not None else att
        lin_tok = np.array([sum(e - s for _, s, e in lin[u]) for u in range(n)], dtype=np.int64)
        self.attention_layout = att
        self.linear_tokens = lin_tok
        moves = self._remap_moves() if mb.linear_layout is not None else {}
        in_deps: dict[int, list[int]] = defaultdict(list)
        # values per token moved: to the attention layout / back to the linear layout (ModelSpec.remap_payload)
        to_attn_w, to_lin_w = self.sim.ctx.model.remap_widths()
        hidden_dev = to_lin_w * self.sim.ctx.model.dtype_bytes
        for (a, b), tokens in moves.items():
            nb = 2.0 * tokens * hidden_dev / self.reps[a].tp  # activations fwd + their gradients bwd
            f = self._remap_transfer(a, b, nb, [attn_done[a], attn_done[b]])
            in_deps[b].append(f)
            in_deps[a].append(f)
        lin_task = {}
        for u in range(n):
            cost = self.sim.cost_for(self.reps[u].tp)
            dur = float(cost.linear_time(lin_tok[u]))
            lin_task[u] = eng.compute(u, dur, (10**9, 0), [attn_done[u]] + in_deps.get(u, []), cat="linear")
            if cost.tp > 1:  # TP-SP all-gathers / reduce-scatters the GEMMs cannot hide (per overlap mode)
                tp_exp = float(cost.tp_exposed_comm(lin_tok[u]))
                if tp_exp > 0:
                    lin_task[u] = eng.compute(u, tp_exp, (10**9, 1), [lin_task[u]], cat="tp-comm")
        for (a, b), tokens in moves.items():
            nb = 2.0 * tokens * to_attn_w * self.sim.ctx.model.dtype_bytes / self.reps[b].tp
            self._remap_transfer(b, a, nb, [lin_task[a], lin_task[b]])
        self.lin_task = lin_task

    def _remap_transfer(self, a: int, b: int, nbytes: float, deps) -> int:
        """One remap move (``nbytes``: its forward and backward passes together). With a profile
        that measured the runtime's remap exchange, each pass takes what the profile says one
        exchange of half the bytes costs (a delay, not a flow on the links); else a transfer."""
        cost = self.sim.cost_for(self.reps[a].tp)
        if not cost.remap_measured:
            return self.transfer(a, b, nbytes, deps, "remap")
        self.links.append((a, b))
        cls = "intra" if self.node[a] == self.node[b] else "inter"
        dur = 2.0 * float(cost.remap_exchange_time(nbytes / 2.0, cls))
        return self.engine.flow(0.0, (), dur, deps, work=0.0, cat=f"remap-{cls}", units=(a, b))

    def _local(self, u: int, pls: list[Placement], qp: int) -> None:
        cost = self.sim.cost_for(self.reps[u].tp)
        tt, _, _ = self._block_times(pls, 1, cost)
        prev = []
        for pi in range(len(pls)):
            tid = self.engine.compute(u, float(tt[pi, 0, 0]), (qp, pi), prev, cat="attention")
            self.attn_tasks[u].append(tid)
            prev = [tid]

    def _ring(self, gi: int, U: list[int], pls: list[Placement], qpos, routes) -> None:
        G = len(U)
        eng = self.engine
        costs = [self.sim.cost_for(self.reps[u].tp) for u in U]
        tt, tok, calls = self._block_times(pls, G, costs[0])
        c0 = costs[0]
        # [owner position, round]: some position computes on the owner's block in that round; a
        # block travels on only while a later round still needs it (windows end rings early)
        uses = np.zeros((G, G), dtype=bool)
        for r in range(G):
            for i in range(G):
                uses[(i - r) % G, r] = bool(calls[:, i, r].sum() > 0)
        still = np.zeros((G, G), dtype=bool)  # [owner, r]: needed in a round after r
        for r in range(G - 2, -1, -1):
            still[:, r] = still[:, r + 1] | uses[:, r + 1]
        Lp = np.array([sum(e - s for rs in p.ranges for s, e in rs) for p in pls], dtype=float)
        meas = c0.ring_compute_measured(Lp, G) if self.compute else None
        if meas is not None:  # each sequence's blocks scaled so that its slowest position takes as measured
            per_pos = tt.sum(axis=2).max(axis=1)
            tt = tt * np.where(per_pos > 0, meas / np.maximum(per_pos, 1e-30), 1.0)[:, None, None]
        sync = c0.ring_sync(G)
        if sync:  # the exchanges' cost beyond compute, once per round of the group, rounds 1..G-1
            tt[:, :, 1:] += sync / len(pls)
        if len({c.tp for c in costs}) > 1 and self.compute:  # mixed TP degrees: time each position with its own model
            tts = [self._block_times(pls, G, c)[0] for c in costs]
            comp = np.stack([tts[i].sum(axis=0)[i] for i in range(G)])
        else:
            comp = tt.sum(axis=0)  # (G, G)
        pos_tok = tok.sum(axis=0)  # tokens per position
        comp_t = [[-1] * G for _ in range(G)]
        send = [[-1] * max(G - 1, 0) for _ in range(G)]
        for r in range(G):
            for i in range(G):
                u = U[i]
                deps = []
                if r >= 1:
                    deps.append(comp_t[i][r - 1])
                    deps.append(send[(i - 1) % G][r - 1])
                comp_t[i][r] = eng.compute(u, float(comp[i, r]), (qpos.get((u, gi), 0), r), deps, cat="attention")
                self.attn_tasks[u].append(comp_t[i][r])
            if r == G - 1:
                break
            for i in range(G):
                k = (i + 1) % G
                deps = []
                if r >= 1:
                    deps += [send[(i - 1) % G][r - 1], comp_t[k][r - 1], send[k][r - 1]]
                src_pos = (i - r) % G
                if not still[src_pos, r]:  # no later position sees this block: the ring does not send it
                    send[i][r] = eng.mark(deps)
                    continue
                nb = float(costs[i].ring_round_bytes(pos_tok[src_pos]))
                send[i][r] = self.transfer(U[i], U[k], nb, deps, "ring", route=routes.get((gi, U[i], U[k])))

    def _allgather(self, gi: int, U: list[int], pls: list[Placement], qpos, routes) -> None:
        G = len(U)
        eng = self.engine
        cost = self.sim.cost_for(self.reps[U[0]].tp)
        tt, tok, calls = self._block_times(pls, G, cost)
        # one call per placement against the gathered K/V: drop the per-round launch overheads
        rounds = (calls > 0).sum(axis=2)  # (P, G)
        comp = tt.sum(axis=2) - np.maximum(rounds - 1, 0) * self.sim.attn_overhead  # (P, G)
        comp = np.maximum(comp, tt.max(axis=2)).sum(axis=0)  # (as in _block_times: at least the largest call)
        pos_tok = tok.sum(axis=0)
        total = float(pos_tok.sum())
        flows = []
        for i in range(G):
            k = (i + 1) % G
            others = total - float(pos_tok[k])
            nb = 3.0 * float(cost.kv_bytes(others))  # K,V gather fwd; K,V gather + dK,dV reduce-scatter bwd
            flows.append(self.transfer(U[i], U[k], nb, [], "allgather", route=routes.get((gi, U[i], U[k])),
                                       latency_mult=3.0 * (G - 1)))
        done = eng.mark(flows)
        for i, u in enumerate(U):
            tid = eng.compute(u, float(comp[i]), (qpos.get((u, gi), 0), 0), [done], cat="attention")
            self.attn_tasks[u].append(tid)

    def _ulysses(self, gi: int, U: list[int], pls: list[Placement], qpos) -> None:
        G = len(U)
        eng = self.engine
        m = self.sim.ctx.model
        cost = self.sim.cost_for(self.reps[U[0]].tp)
        lengths = np.array([float(p.padded_length or self.step.sequences[p.seq].length) for p in pls])
        t_att = float(np.sum(cost.ulysses_attn_time(lengths, G))) if self.compute else 0.0  # 1/G of the heads
        held = [sum(ranges_tokens(p.ranges[i]) for p in pls) for i in range(G)]
        eff = cost.profile.alltoall_efficiency.get(str(G), 1.0)
        per_tok = (2 * m.hidden + 2 * m.kv_dim) * m.dtype_bytes / cost.tp

        def a2a(deps_of) -> dict[int, list[int]]:
            out: dict[int, list[int]] = defaultdict(list)
            for i in range(G):
                for k in range(G):
                    if i == k:
                        continue
                    nb = held[i] * per_tok / G
                    f = self.transfer(U[i], U[k], nb, deps_of(i, k), "ulysses", work_factor=1.0 / eff,
                                      latency_mult=float(G - 1))
                    out[i].append(f)
                    out[k].append(f)
            return out

        first = a2a(lambda i, k: [])
        comps = {}
        for i, u in enumerate(U):
            comps[i] = eng.compute(u, t_att, (qpos.get((u, gi), 0), 0), first.get(i, []), cat="attention")
            self.attn_tasks[u].append(comps[i])
        second = a2a(lambda i, k: [comps[i], comps[k]])
        for i, u in enumerate(U):
            self.attn_tasks[u].append(eng.mark(second.get(i, [])))

    def _remap_moves(self) -> dict[tuple[int, int], int]:
        """Tokens each (attention owner -> linear owner) pair must move."""
        mb = self.mb
        owners: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for u in range(self.n):
            for q, s, e in self.attention_layout[u]:
                owners[q].append((s, e, u))
        for segs in owners.values():
            segs.sort()
        moves: dict[tuple[int, int], int] = defaultdict(int)
        for v in range(self.n):
            for q, s, e in mb.linear_layout[v]:
                for a, b, u in owners.get(q, ()):
                    if b <= s:
                        continue
                    if a >= e:
                        break
                    ov = min(e, b) - max(s, a)
                    if ov > 0 and u != v:
                        moves[(u, v)] += ov
        return dict(moves)

    # ------------------------------------------------------------------ results
    def unit_results(self):
        n = self.n
        tasks = self.engine.tasks
        f = np.zeros(n)
        comp_a = np.zeros(n)
        comp_l = np.zeros(n)
        iv: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for t in tasks:
            if t.kind == "compute":
                if t.cat == "linear":
                    comp_l[t.unit] += t.dur
                elif t.cat != "tp-comm":  # exposed TP communication counts as exposed, not busy
                    comp_a[t.unit] += t.dur
                f[t.unit] = max(f[t.unit], t.end)
            elif t.kind == "flow":
                for u in t.units:
                    f[u] = max(f[u], t.end)
                    if t.end > t.start:
                        iv[u].append((t.start, t.end))
        comm = np.array([_union_length(iv.get(u, [])) for u in range(n)])
        # coupled components (union-find over every pair that exchanged data)
        parent = list(range(n))

        def find(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for a, b in self.links:
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[ra] = rb
        comps: dict[int, list[int]] = defaultdict(list)
        for u in range(n):
            comps[find(u)].append(u)
        return f, comp_a, comp_l, comm, list(comps.values())

    def _nic_flows(self):
        for t in self.engine.tasks:
            if t.kind == "flow" and t.nics:
                yield t

    def nic_bytes(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for t in self._nic_flows():
            out[t.nics[0]] += t.nbytes
            out[t.nics[1]] += t.nbytes
        return dict(out)

    def nic_traffic(self) -> dict[tuple[str, str], float]:
        """Bytes through each NIC by transfer kind: ``{(kind, nic): bytes}`` (sent + received)."""
        out: dict[tuple[str, str], float] = defaultdict(float)
        for t in self._nic_flows():
            kind = t.cat.removesuffix("-inter")
            out[(kind, t.nics[0])] += t.nbytes
            out[(kind, t.nics[1])] += t.nbytes
        return dict(out)

    def nic_busy(self) -> dict[str, float]:
        iv: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for t in self._nic_flows():
            if t.end > t.bw_start:
                iv[t.nics[0]].append((t.bw_start, t.end))
                iv[t.nics[1]].append((t.bw_start, t.end))
        return {k: _union_length(v) for k, v in iv.items()}

    def intervals(self) -> list[Interval]:
        out = []
        for t in self.engine.tasks:
            if t.kind == "compute" and t.end > t.start:
                out.append(Interval(t.unit, t.start, t.end, t.cat, "compute"))
            elif t.kind == "flow" and t.end > t.start:
                for u in t.units:
                    out.append(Interval(u, t.start, t.end, t.cat, "comm"))
        return out


def _union_length(iv: list[tuple[float, float]]) -> float:
    if not iv:
        return 0.0
    iv = sorted(iv)
    total, cs, ce = 0.0, iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > ce:
            total += ce - cs
            cs, ce = s, e
        elif e > ce:
            ce = e
    return total + ce - cs


# =============================================================================================
# Plan-level helpers and rendering
# =============================================================================================


def simulate_plan(path, steps: list[int] | None = None, timeline: bool = False):
    """(header, [SimResult]) for the plan at ``path`` (all steps, or the listed ones)."""
    from zeppelin.schemas.plan import PlanReader

    reader = PlanReader(path)
    sim = Simulator(context_from_header(reader.header))
    if steps is None:
        results = [sim.simulate_step(s, timeline=timeline) for s in reader]
    else:
        results = [sim.simulate_step(reader.step(k), timeline=timeline) for k in steps]
    return reader.header, results


def summary(results: list[SimResult]) -> dict[str, float]:
    t = np.array([r.step_time_s for r in results]) if results else np.zeros(1)
    lb = np.array([r.lower_bound_s for r in results]) if results else np.zeros(1)
    return {
        "steps": len(results),
        "mean_step_time_s": float(t.mean()),
        "p50_step_time_s": float(np.percentile(t, 50)),
        "p90_step_time_s": float(np.percentile(t, 90)),
        "total_time_s": float(t.sum()),
        "mean_ratio_to_lower_bound": float(np.mean(t / np.where(lb > 0, lb, np.nan))) if np.any(lb > 0) else math.nan,
        "mean_exposed_comm_s": float(np.mean([r.exposed_comm_s for r in results])) if results else 0.0,
        "max_nic_busy_frac": float(max((r.max_nic_busy_frac for r in results), default=0.0)),
    }
