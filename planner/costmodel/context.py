"""The planning context: a job's cluster, model and cost profile bound to its cost model.

:class:`PlanContext` is what every planner, the step predictor and the simulator receive; it builds
the :class:`~zeppelin.planner.costmodel.cost.CostModel` of a unit once (and once per tensor-parallel
degree for plans with replicas of mixed TP). :class:`PlanningError` is the one-line "no feasible plan"
error (exit code 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.schemas.cluster import ClusterSpec
from zeppelin.schemas.common import InputError
from zeppelin.schemas.model import ModelSpec
from zeppelin.schemas.profile import CostProfile


class PlanningError(InputError):
    """No feasible plan (bad setting or input): one-line message, exit code 2."""


@dataclass
class PlanContext:
    cluster: ClusterSpec
    model: ModelSpec
    profile: CostProfile
    tp: int = 1
    zero_stage: int = 1
    tp_overlap: str = "none"
    seed: int = 0
    recompute: str = "none"
    options: dict[str, Any] = field(default_factory=dict)
    # the longest sequence the run trains on (``--max-seq-len``, else the data's longest sample):
    # a run-level fact that planners sizing one layout for the whole run (te-cp) read; None: unknown
    max_seq_len: int | None = None
    # ``--recompute auto``'s pass without recomputation: a unit may hold more than ``recompute``'s
    # capacity (up to ``selective``'s), its micro-batch then choosing that unit's recomputation alone
    # (planner/zeppelin/recompute.py); a planner that can price it may lay units out so
    unit_recompute: bool = False

    def __post_init__(self):
        self.cost = CostModel(self.cluster, self.model, self.profile, tp=self.tp, zero_stage=self.zero_stage,
                              tp_overlap=self.tp_overlap, recompute=self.recompute)

    def cost_for(self, tp: int) -> CostModel:
        """The cost model of a unit of ``tp`` GPUs (replicas of mixed TP degree: Hydraulis plans),
        built once per degree."""
        if tp == self.tp:
            return self.cost
        cache = self.__dict__.setdefault("_costs_by_tp", {})
        if tp not in cache:
            cache[tp] = CostModel(self.cluster, self.model, self.profile, tp=tp, zero_stage=self.zero_stage,
                                  tp_overlap=self.tp_overlap, recompute=self.recompute)
        return cache[tp]

    @property
    def num_units(self) -> int:
        return self.cost.num_units

    @property
    def microbatches_coupled(self) -> bool:
        """Whether every unit waits for the slowest one in each layer of each micro-batch. At ZeRO
        1-3 the runtime runs FSDP2, which all-gathers every block's parameters and reduce-scatters
        its gradients in every micro-batch over the whole shard group (with hybrid sharding it also
        all-reduces them across the groups in every micro-batch): no unit finishes a block's
        collective before the slowest asks for it. At ZeRO-0 (``--dp replicate``) the weights are
        whole on every rank and the gradients are all-reduced once, after the last micro-batch:
        a unit runs its next micro-batch as soon as the units it exchanges data with are done
        (docs/CONCEPTS.md, "Micro-batch coupling"; measured by ``benchmarks/bench_coupling.py``)."""
        return self.zero_stage >= 1 and self.num_units > 1

    @property
    def units_per_node(self) -> int:
        return self.cost.units_per_node
