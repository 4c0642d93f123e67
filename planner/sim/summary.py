"""What a plan does, counted one way for every command that reports it.

``zeppelin plan`` (its closing summary and ``--explain``), ``zeppelin show`` and ``zeppelin simulate``
all describe a plan with :func:`step_summary` and print it with :func:`summary_lines`, so that the
three agree on every count:

* **sequences by tier**, judged from where a sequence's attention really runs - the units of its
  group and the nodes their GPU ranks sit on: ``local`` (one unit), ``intra`` (several units of one
  node), ``inter`` (units of several nodes). A group's ``tier`` field is the planner's label and is
  not trusted: a Ulysses or family group spanning nodes is ``inter`` whatever it says.
* **groups by kind and span** (ring / allgather / ulysses / usp / local, by the same three spans);
* **inter-node traffic**: the bytes per step each NIC sends and receives, by transfer kind (ring
  rounds, routed or direct; Ulysses all-to-alls; all-gathers; remap moves), exactly the flows the
  simulator puts on the NICs (:meth:`~zeppelin.planner.sim.simulate.Simulator.nic_traffic`), and
  from them the NICs in use.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from zeppelin.planner.costmodel.context import PlanContext
from zeppelin.schemas.plan import StepPlan

__all__ = ["TIERS", "PlanSummary", "span_of_units", "step_summary", "summary_lines", "unit_nodes", "units_line"]

TIERS = ("local", "intra", "inter")
KINDS = ("ring", "allgather", "ulysses", "usp", "local")


def unit_nodes(ctx: PlanContext, step: StepPlan) -> list[frozenset[int]]:
    """Per unit, the nodes its GPU ranks sit on."""
    cl = ctx.cluster
    if step.replicas is not None:
        return [frozenset(cl.node_of(r) for r in rep.ranks) for rep in step.replicas]
    t = ctx.tp
    return [frozenset({cl.node_of(u * t), cl.node_of(u * t + t - 1)}) for u in range(cl.world_size // t)]


def span_of_units(nodes: list[frozenset[int]], units: list[int]) -> str:
    """``local`` / ``intra`` / ``inter``: one unit, several units of one node, units of several nodes."""
    spanned = set().union(*(nodes[u] for u in units))
    if len(spanned) > 1:
        return "inter"
    return "local" if len(units) == 1 else "intra"


@dataclass
class PlanSummary:
    """Counts over one step or, merged with :meth:`add`, over several (``steps``)."""

    steps: int = 0
    sequences: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    #: shortest and longest sequence of each tier
    lengths: dict[str, list[int]] = field(default_factory=dict)
    #: (kind, span) -> groups with at least one placement
    groups: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    #: groups whose ``tier`` label differs from the span of their units
    mislabeled: int = 0
    #: kind -> NIC -> bytes sent + received, summed over the steps
    traffic: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    #: steps that move bytes across nodes
    steps_with_traffic: int = 0
    #: steps whose traffic is counted (all of them, unless the traffic is sampled; None: ``steps``)
    traffic_steps: int | None = None
    #: NICs of the cluster (for "N of M NICs used")
    nics_in_cluster: int = 0
    #: TP degree -> data-parallel units of that degree (the most of any step); a unit has that many GPUs
    unit_tps: dict[int, int] = field(default_factory=dict)
    #: (tier, group kind) -> [sequences, shortest, longest], each sequence at the group of its widest span
    by_kind: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    #: TP degree -> [sequences, longest] of the sequences whole on one unit of that degree
    local_by_tp: dict[int, list[int]] = field(default_factory=dict)

    def add(self, other: PlanSummary) -> PlanSummary:
        if self.traffic_steps is not None or other.traffic_steps is not None:
            self.traffic_steps = self.counted_steps + other.counted_steps
        self.steps += other.steps
        for k, v in other.sequences.items():
            self.sequences[k] = self.sequences.get(k, 0) + v
        for k, (lo, hi) in other.lengths.items():
            cur = self.lengths.get(k)
            self.lengths[k] = [min(lo, cur[0]), max(hi, cur[1])] if cur else [lo, hi]
        for k, v in other.groups.items():
            self.groups[k] += v
        self.mislabeled += other.mislabeled
        for kind, per in other.traffic.items():
            for nic, b in per.items():
                self.traffic[kind][nic] += b
        self.steps_with_traffic += other.steps_with_traffic
        self.nics_in_cluster = max(self.nics_in_cluster, other.nics_in_cluster)
        for tp, k in other.unit_tps.items():
            self.unit_tps[tp] = max(self.unit_tps.get(tp, 0), k)
        for key, (k, lo, hi) in other.by_kind.items():
            cur = self.by_kind.get(key)
            self.by_kind[key] = [cur[0] + k, min(lo, cur[1]), max(hi, cur[2])] if cur else [k, lo, hi]
        for tp, (k, hi) in other.local_by_tp.items():
            cur = self.local_by_tp.get(tp)
            self.local_by_tp[tp] = [cur[0] + k, max(hi, cur[1])] if cur else [k, hi]
        return self

    # ------------------------------------------------------------------ derived
    @property
    def counted_steps(self) -> int:
        """Steps whose traffic is counted (per-step traffic is averaged over these)."""
        return self.steps if self.traffic_steps is None else self.traffic_steps

    @property
    def traffic_sampled(self) -> bool:
        return self.counted_steps < self.steps

    def nic_bytes(self) -> dict[str, float]:
        """Bytes per NIC over every kind of transfer."""
        out: dict[str, float] = defaultdict(float)
        for per in self.traffic.values():
            for nic, b in per.items():
                out[nic] += b
        return dict(out)

    @property
    def inter_node_bytes(self) -> float:
        """Bytes that cross nodes (each transfer counted once: a NIC sends it, another receives it)."""
        return sum(self.nic_bytes().values()) / 2.0

    @property
    def nics_used(self) -> int:
        return sum(1 for b in self.nic_bytes().values() if b > 0)

    def to_dict(self) -> dict[str, Any]:
        per_step = max(self.counted_steps, 1)
        nb = self.nic_bytes()
        out = {
            "steps": self.steps,
            "sequences_by_tier": dict(self.sequences),
            "length_range_by_tier": {k: list(v) for k, v in self.lengths.items()},
            "groups_by_kind_and_span": {f"{k}/{s}": v for (k, s), v in sorted(self.groups.items())},
            "groups_mislabeled": self.mislabeled,
            "inter_node_bytes_per_step": self.inter_node_bytes / per_step,
            "inter_node_bytes_per_step_by_kind": {k: sum(v.values()) / 2.0 / per_step
                                                  for k, v in sorted(self.traffic.items())},
            "nic_bytes_per_step": {k: v / per_step for k, v in sorted(nb.items())},
            "nics_used": self.nics_used,
            "nics_in_cluster": self.nics_in_cluster,
            "steps_with_inter_node_traffic": self.steps_with_traffic,
            "units_by_tp": {str(k): v for k, v in sorted(self.unit_tps.items())},
        }
        if self.traffic_sampled:
            out["steps_with_traffic_counted"] = self.counted_steps
        return out


def step_summary(ctx: PlanContext, step: StepPlan, sim=None,
                 traffic: dict[str, dict[str, float]] | None = None) -> PlanSummary:
    """The counts of one step of a plan made for ``ctx``. ``traffic``: the step's
    :attr:`SimResult.nic_traffic <zeppelin.planner.sim.simulate.SimResult.nic_traffic>` when it was
    simulated already; otherwise ``sim`` (a :class:`Simulator` for ``ctx``, built when None) counts it."""
    nodes = unit_nodes(ctx, step)
    s = PlanSummary(steps=1, nics_in_cluster=ctx.cluster.num_nodes * len(ctx.cluster.nics))
    tps = [r.tp for r in step.replicas] if step.replicas is not None else [ctx.tp] * len(nodes)
    for tp in tps:
        s.unit_tps[tp] = s.unit_tps.get(tp, 0) + 1
    widest: dict[int, tuple[str, str, int]] = {}  # sequence -> (span, kind, TP degree of its first unit)
    rank = {t: i for i, t in enumerate(TIERS)}
    for mb in step.microbatches:
        used = {p.group for p in mb.placements}
        spans = [span_of_units(nodes, g.units) for g in mb.groups]
        for gi, g in enumerate(mb.groups):
            if gi not in used:
                continue
            s.groups[("local" if len(g.units) == 1 else g.kind, spans[gi])] += 1
            if g.tier != spans[gi]:
                s.mislabeled += 1
        for p in mb.placements:  # a sequence placed in pieces counts once, at its widest span
            sp, g = spans[p.group], mb.groups[p.group]
            if rank[sp] >= rank[widest.get(p.seq, ("local",))[0]]:
                widest[p.seq] = (sp, "local" if len(g.units) == 1 else g.kind, tps[g.units[0]])
    for i, (t, kind, tp) in widest.items():
        s.sequences[t] += 1
        n = step.sequences[i].length
        lo_hi = s.lengths.get(t)
        s.lengths[t] = [min(n, lo_hi[0]), max(n, lo_hi[1])] if lo_hi else [n, n]
        k = s.by_kind.get((t, kind))
        s.by_kind[(t, kind)] = [k[0] + 1, min(n, k[1]), max(n, k[2])] if k else [1, n, n]
        if t == "local":
            k = s.local_by_tp.get(tp)
            s.local_by_tp[tp] = [k[0] + 1, max(n, k[1])] if k else [1, n]
    if traffic is None:
        if sim is None:
            from zeppelin.planner.sim.simulate import Simulator

            sim = Simulator(ctx)
        traffic = sim.nic_traffic(step)
    for kind, per in traffic.items():
        for nic, b in per.items():
            if b > 0:
                s.traffic[kind][nic] += b
    s.steps_with_traffic = int(any(s.traffic.values()))
    s.traffic_steps = 1
    return s


def _gb(b: float) -> str:
    return f"{b / 1e9:,.3f} GB"


def units_line(unit_tps: dict[int, int]) -> str:
    """The data-parallel units by tensor-parallel degree and GPUs, e.g. ``units: 2 TP-4 (4 GPUs each),
    8 TP-1 (1 GPU each)``."""
    return "units: " + ", ".join(f"{k:,} TP-{tp} ({tp} GPU{'s' if tp > 1 else ''} each)"
                                 for tp, k in sorted(unit_tps.items(), reverse=True))


def summary_lines(s: PlanSummary) -> list[str]:
    """The summary as lines of text (``zeppelin plan``, ``show`` and ``simulate`` print these)."""
    lines = ["sequences by tier: " + ", ".join(f"{t} {s.sequences.get(t, 0):,}" for t in TIERS)]
    rng = [f"{t} {v[0]:,}-{v[1]:,}" for t in TIERS if (v := s.lengths.get(t))]
    if rng:
        lines.append("  lengths: " + ", ".join(rng) + " tokens")
    by_kind: dict[str, list[str]] = defaultdict(list)
    for kind in KINDS:
        for t in TIERS:
            n = s.groups.get((kind, t), 0)
            if n:
                by_kind[kind].append(f"{t} {n:,}" if kind != "local" else f"{n:,}")
    lines.append("groups by kind and span: " + "; ".join(
        f"{k} {', '.join(v)}" for k, v in by_kind.items()) if by_kind else "groups by kind and span: none")
    if s.unit_tps:
        lines.append(units_line(s.unit_tps) + (", max per step" if len(s.unit_tps) > 1 and s.steps > 1 else ""))
    if s.mislabeled:
        lines.append(f"  {s.mislabeled:,} group(s) labelled with another tier than their units span "
                     f"(counted by their units)")
    per_step = max(s.counted_steps, 1)
    sampled = (f" (sampled: the traffic of {s.counted_steps:,} of {s.steps:,} steps)" if s.traffic_sampled else "")
    if s.counted_steps == 0:
        lines.append(f"inter-node traffic: not counted (sampled: none of {s.steps:,} steps fit the summary's "
                     f"time budget; `zeppelin show` or `simulate` count it)")
    elif s.inter_node_bytes > 0:
        kinds = ", ".join(f"{k} {_gb(sum(v.values()) / 2.0 / per_step)}" for k, v in sorted(s.traffic.items())
                          if sum(v.values()) > 0)
        busiest = max(s.nic_bytes().values()) / per_step
        where = f" in {s.steps_with_traffic:,} of {s.counted_steps:,} steps" if s.counted_steps > 1 else ""
        lines.append(f"inter-node traffic: {_gb(s.inter_node_bytes / per_step)} per step{where} ({kinds}){sampled}")
        lines.append(f"  NICs: {s.nics_used:,} of {s.nics_in_cluster:,} used, the busiest sends + receives "
                     f"{_gb(busiest)} per step")
    else:
        lines.append("inter-node traffic: none (no transfer crosses nodes)" + sampled)
    return lines
