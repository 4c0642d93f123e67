"""What a simulated step reports (:class:`SimResult`: step time, per-unit busy / exposed
communication / idle time, per-NIC bytes and busy fraction, optionally the layers' timelines) and
:func:`summary` of a plan's results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Interval", "MicroBatchTimeline", "NICStats", "SimResult", "UnitStats", "summary"]


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
        """Mean over units of exposed communication: :attr:`exposed_transfers_s` + :attr:`allreduce_s`
        (the one definition every command reports, its two parts labelled)."""
        return float(np.mean([u.exposed_comm_s for u in self.units])) if self.units else 0.0

    @property
    def exposed_transfers_s(self) -> float:
        """The part of :attr:`exposed_comm_s` inside the micro-batches: attention transfers (ring
        rounds, all-to-alls, all-gathers), their routing and the remap, where compute does not hide
        them. The rest, :attr:`allreduce_s`, is the gradient sync (all-reduce, or FSDP's per
        micro-batch gathers and reduce-scatters), which every unit waits for in full."""
        return max(self.exposed_comm_s - self.allreduce_s, 0.0)

    @property
    def max_nic_busy_frac(self) -> float:
        return max((n.busy_frac for n in self.nics.values()), default=0.0)


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
