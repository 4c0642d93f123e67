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
* **Step.** Units coupled in a micro-batch advance layer by layer together, so a unit's layer
  period is the latest finish among the units it is coupled with; the step is ``sum over
  micro-batches of (num_layers x period + embedding/LM head)`` per unit, then the data-parallel
  collectives (``CostModel.step_collectives_time``) once every unit is done. Coupled are, at ZeRO
  1-3, every unit (FSDP2 all-gathers and reduce-scatters each block over the whole shard group in
  every micro-batch: ``PlanContext.microbatches_coupled``), so the step is the sum over
  micro-batches of the slowest unit; at ZeRO-0 (replicated weights, one gradient all-reduce), the
  units that exchange data in the micro-batch, so a unit alone runs its micro-batches back to back.

Output per step (:class:`SimResult`): step time, per-unit busy / exposed-communication / idle
breakdown, per-NIC bytes and busy fraction, and optionally the timeline of the simulated layers.

The simulator is three modules: :mod:`~zeppelin.planner.sim.engine` (the discrete-event engine:
compute streams, flows with max-min sharing), :mod:`~zeppelin.planner.sim.layer` (the task graph of
one layer of a micro-batch) and :mod:`~zeppelin.planner.sim.results` (the result types); this module
plays a plan's steps out with them and keeps their public names.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from zeppelin.planner.costmodel.context import PlanContext
from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.planner.sim.engine import Engine
from zeppelin.planner.sim.layer import LayerGraph
from zeppelin.planner.sim.results import Interval, MicroBatchTimeline, NICStats, SimResult, UnitStats, summary
from zeppelin.schemas.plan import MicroBatch, PlanHeader, Replica, StepPlan, uniform_replicas

__all__ = [
    "Engine",
    "Interval",
    "MicroBatchTimeline",
    "NICStats",
    "SimResult",
    "Simulator",
    "UnitStats",
    "context_from_header",
    "simulate_plan",
    "summary",
]


def context_from_header(header: PlanHeader) -> PlanContext:
    return PlanContext(header.cluster, header.model, header.profile, tp=header.tp,
                       zero_stage=header.zero_stage, recompute=header.recompute, tp_overlap=header.tp_overlap, seed=header.seed,
                       options=dict(header.planner_options))


@dataclass
class _StepTotals:
    """What a step's micro-batches add up, per unit and per NIC (:meth:`Simulator.simulate_step`)."""

    n: int
    units: list[UnitStats] = field(init=False)
    nic_bytes: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    nic_busy: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    traffic: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    finish: np.ndarray = field(init=False)
    periods: list[float] = field(default_factory=list)
    mb_compute: list[float] = field(default_factory=list)  # per micro-batch, the slowest unit's layers + head
    timeline: list[MicroBatchTimeline] = field(default_factory=list)

    def __post_init__(self):
        self.units = [UnitStats() for _ in range(self.n)]
        self.finish = np.zeros(self.n)


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
        #: (TP degree, window, tokens) -> attention time of a whole local range (LayerGraph._local_times)
        self.whole_block_times: dict[tuple[int, int | None, int], float] = {}
        #: (kind, TP degree, tokens) -> linear or head time (:meth:`token_time`)
        self.token_times: dict[tuple[str, int, int], float] = {}

    # ------------------------------------------------------------------ helpers
    def cost_for(self, tp: int) -> CostModel:
        return self.ctx.cost_for(tp)

    def replicas(self, step: StepPlan) -> list[Replica]:
        if step.replicas is not None:
            return step.replicas
        return list(uniform_replicas(self.cluster.world_size, self.ctx.tp))

    def token_time(self, kind: str, tp: int, tokens) -> float:
        """``CostModel.linear_time`` (kind ``"linear"``) or ``head_time`` (``"head"``) of a unit of ``tp``
        GPUs holding ``tokens`` tokens: depends on the count alone, priced once per count."""
        key = (kind, tp, int(tokens))
        t = self.token_times.get(key)
        if t is None:
            cost = self.cost_for(tp)
            t = self.token_times[key] = float(cost.linear_time(tokens) if kind == "linear" else cost.head_time(tokens))
        return t

    # ------------------------------------------------------------------ public
    def simulate_step(self, step: StepPlan, *, timeline: bool = False) -> SimResult:
        ctx = self.ctx
        reps = self.replicas(step)
        n = len(reps)
        tot = _StepTotals(n)
        for mb in step.microbatches:
            self._simulate_microbatch(step, mb, reps, tot, timeline)
        # each replica all-reduces its own shards (replicas of another TP degree: their cost model)
        tps = {r.tp for r in step.replicas} if step.replicas is not None else {ctx.tp}
        ar = max(self.cost_for(t).step_collectives_time(len(step.microbatches), n, tot.mb_compute if n else None)
                 for t in tps)
        compute_end = float(tot.finish.max()) if n else 0.0
        step_time = compute_end + ar
        for st in tot.units:
            st.exposed_comm_s += ar
            st.comm_s += ar
            st.idle_s = max(step_time - st.busy_s - st.exposed_comm_s, 0.0)
        return SimResult(
            step=step.step, step_time_s=step_time, compute_end_s=compute_end, allreduce_s=ar,
            lower_bound_s=self._lower_bound(step),
            predicted_s=step.prediction.step_time_s if step.prediction is not None else None,
            num_layers=ctx.model.num_layers, units=tot.units, nics=self._nic_stats(tot, step_time),
            layer_periods_s=tot.periods, timeline=tot.timeline if timeline else None,
            nic_traffic={k: dict(v) for k, v in tot.traffic.items()},
        )

    def _simulate_microbatch(self, step: StepPlan, mb: MicroBatch, reps: list[Replica], tot: _StepTotals,
                             timeline: bool) -> None:
        """Adds one micro-batch to ``tot``: its layers, then the embedding/LM head on each unit."""
        n = len(reps)
        acc, lay, f, period_u = self._layer_types(step, mb, reps, tot)
        lin_tok = lay.linear_tokens
        head = np.array([self.token_time("head", reps[u].tp, lin_tok[u]) for u in range(n)])
        for u in range(n):
            st = tot.units[u]
            st.attention_s += float(acc[0, u])
            st.linear_s += float(acc[1, u] + head[u])
            st.exposed_comm_s += float(acc[2, u])
            st.comm_s += float(acc[3, u])
            st.tokens += int(lin_tok[u])
        tot.finish += acc[4] + head
        tot.mb_compute.append(float((acc[4] + head).max()) if n else 0.0)
        tot.periods.append(float(f.max()) if n else 0.0)
        if timeline:
            tot.timeline.append(MicroBatchTimeline(layer_period_s=float(f.max()), intervals=lay.intervals(),
                                                   unit_period_s=[float(x) for x in period_u],
                                                   head_s=[float(x) for x in head]))

    def _layer_types(self, step: StepPlan, mb: MicroBatch, reps: list[Replica], tot: _StepTotals):
        """One task graph per layer type (attention window) of a micro-batch, counted for its layers.

        Returns per unit (rows) the attention, linear, exposed-communication, communication time
        and layer period summed over the layers, and the last layer type's graph, unit finishes
        and periods; adds the NICs' bytes, busy time and traffic to ``tot``."""
        n = len(reps)
        acc = np.zeros((5, n))  # attention, linear, exposed, comm, period per unit
        for w, nl in self.ctx.model.window_counts().items():
            lay = LayerGraph(self, step, mb, reps, window=w)
            lay.build()
            lay.engine.run()
            f, comp_a, comp_l, comm, comps = lay.unit_results()
            if self.ctx.microbatches_coupled:  # FSDP's collectives: every unit waits for the slowest
                comps = [list(range(n))]
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
                tot.nic_bytes[nic] += nl * b
            for nic, b in lay.nic_busy().items():
                tot.nic_busy[nic] += nl * b
            for (kind, nic), b in lay.nic_traffic().items():
                tot.traffic[kind][nic] += nl * b
        return acc, lay, f, period_u

    def _nic_stats(self, tot: _StepTotals, step_time: float) -> dict[str, NICStats]:
        nics: dict[str, NICStats] = {}
        for nic in sorted(set(tot.nic_bytes) | set(tot.nic_busy)):
            b = tot.nic_bytes.get(nic, 0.0)
            busy = tot.nic_busy.get(nic, 0.0)
            nics[nic] = NICStats(bytes=b, busy_s=busy, busy_frac=busy / step_time if step_time > 0 else 0.0,
                                 util=b / (2 * self.nic_bw * step_time) if step_time > 0 else 0.0)
        return nics

    def _lower_bound(self, step: StepPlan) -> float:
        """The plan's lower bound of the step, else the analytic one of its sequences."""
        from zeppelin.planner.costmodel.predict import lower_bounds

        if step.prediction is not None:
            return step.prediction.lower_bound_s
        lengths = np.array([s.length for s in step.sequences], dtype=np.float64)
        wb, lbl = lower_bounds(self.ctx, lengths)
        return max(wb, lbl)

    def nic_traffic(self, step: StepPlan) -> dict[str, dict[str, float]]:
        """The bytes per step through each NIC by transfer kind, ``{kind: {nic: bytes}}``: the flows
        :meth:`simulate_step` would move (the same task graph, built without kernel times and not run),
        so that a summary of a plan counts exactly the traffic its simulation puts on the NICs."""
        reps = self.replicas(step)
        out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for mb in step.microbatches:
            for w, nl in self.ctx.model.window_counts().items():
                lay = LayerGraph(self, step, mb, reps, compute=False, window=w)
                lay.build()
                for (kind, nic), b in lay.nic_traffic().items():
                    out[kind][nic] += nl * b
        return {k: dict(v) for k, v in out.items()}


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
