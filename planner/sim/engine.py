"""The simulator's discrete-event engine: compute tasks on per-unit streams and flows over shared
resources (link ports, NIC sides) with max-min fair bandwidth, run in simulated time.

:class:`Engine` holds the task graph (what :mod:`~zeppelin.planner.sim.layer` builds for one layer);
``Engine.run`` plays it out with an :class:`_EventLoop`.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

__all__ = ["Engine"]

_INF = float("inf")


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
        """Simulate every task; returns the time the last one ends (:class:`_EventLoop`)."""
        return _EventLoop(self).run()

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

_COMPUTE_DONE, _BW_START, _FLOW_DONE = 0, 1, 2  # event codes


class _EventLoop:
    """One run of an :class:`Engine`'s tasks in simulated time.

    Flow progress is tracked lazily: a flow's remaining work is brought up to date only when
    its rate changes, and its projected end sits in the event heap (stale entries are skipped).
    When the set of transferring flows changes, only the flows connected to the changed
    resources (through shared resources) get new max-min rates.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.tasks = engine.tasks
        self.heap: list[tuple[float, int, int, int]] = []  # (time, seq, code, tid)
        self.ready: dict[int, list] = defaultdict(list)
        self.busy: dict[int, bool] = defaultdict(bool)
        self.on_res: dict[str, set[int]] = defaultdict(set)  # resource -> transferring flows
        self.dirty: set[str] = set()
        self.fresh: list[_Task] = []  # flows that started transferring at this instant
        self.kick: set[int] = set()  # units whose stream should pick a task once this instant is processed
        self.seq = 0

    def push(self, time: float, code: int, tid: int) -> int:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, code, tid))
        return self.seq

    def start_next(self, u: int, now: float) -> None:
        q = self.ready[u]
        if q and not self.busy[u]:
            _, tid = heapq.heappop(q)
            t = self.tasks[tid]
            t.start = now
            self.busy[u] = True
            self.push(now + t.dur, _COMPUTE_DONE, tid)

    def finish(self, t: _Task, now: float) -> None:
        t.end = now
        if t.kind == "compute":
            self.busy[t.unit] = False
            self.kick.add(t.unit)
        tasks = self.tasks
        for s in t.succs:
            st = tasks[s]
            st.ndeps -= 1
            if st.ndeps == 0:
                self.release(st, now)

    def begin_bw(self, t: _Task, now: float) -> None:
        t.bw_start = now
        if t.work <= 0.0:
            self.finish(t, now)
            return
        t.rem, t.t_upd, t.rate = t.work, now, 0.0
        for r in t.res:
            self.on_res[r].add(t.tid)
            self.dirty.add(r)
        self.fresh.append(t)

    def release(self, t: _Task, now: float) -> None:
        if t.kind == "compute":
            heapq.heappush(self.ready[t.unit], (t.prio, t.tid))
            self.kick.add(t.unit)
        elif t.kind == "flow":
            t.start = now
            if t.lat > 0.0:
                self.push(now + t.lat, _BW_START, t.tid)
            else:
                self.begin_bw(t, now)
        else:
            t.start = now
            self.finish(t, now)

    def connected(self) -> dict[int, _Task]:
        """The flows sharing a resource, directly or through other flows, with a changed resource
        or a flow that started transferring at this instant."""
        tasks, on_res = self.tasks, self.on_res
        comp: dict[int, _Task] = {t.tid: t for t in self.fresh}
        stack = list(self.dirty)
        seen_res = set(stack)
        for t in self.fresh:
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
        return comp

    def settle(self, now: float) -> None:
        """After an instant: start streams, re-rate the flows whose resources changed."""
        kick = self.kick
        while kick:
            self.start_next(kick.pop(), now)
        if not self.dirty and not self.fresh:
            return
        comp = self.connected()
        self.dirty.clear()
        self.fresh.clear()
        if not comp:
            return
        flows = list(comp.values())
        new_rates = self.engine._rates(flows)
        for f, rate in zip(flows, new_rates):
            if rate != f.rate:
                f.rem -= f.rate * (now - f.t_upd)
                f.t_upd, f.rate = now, rate
                f.hseq = self.push(now + max(f.rem, 0.0) / rate, _FLOW_DONE, f.tid)

    def instant(self, now: float) -> None:
        """Process every event at ``now`` (within rounding)."""
        heap, tasks = self.heap, self.tasks
        while heap and heap[0][0] <= now * (1 + 1e-12) + 1e-15:
            _, sq, code, tid = heapq.heappop(heap)
            t = tasks[tid]
            if code == _COMPUTE_DONE:
                self.finish(t, now)
            elif code == _BW_START:
                self.begin_bw(t, now)
            elif sq == t.hseq:  # FLOW_DONE, not superseded by a rate change
                t.rem, t.rate = 0.0, 0.0
                for r in t.res:
                    self.on_res[r].discard(tid)
                    self.dirty.add(r)
                self.finish(t, now)
        self.settle(now)

    def run(self) -> float:
        tasks = self.tasks
        for t in [t for t in tasks if t.ndeps == 0]:
            self.release(t, 0.0)
        now = 0.0
        self.settle(now)
        while self.heap:
            now = self.heap[0][0]
            self.instant(now)
        stuck = [t.tid for t in tasks if math.isnan(t.end)]
        if stuck:  # a dependency cycle: a bug in the caller, not bad input
            raise RuntimeError(f"simulation deadlock: {len(stuck)} tasks never ran (first: {stuck[:5]})")
        return max((t.end for t in tasks), default=0.0)
