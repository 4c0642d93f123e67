"""The planner interface shared by zeppelin and every baseline.

A planner turns the sequences of one training step into a :class:`StepPlan`. The driver
(:mod:`zeppelin.planner.driver`) samples steps from a manifest, calls ``plan_step`` for each
(possibly in worker processes), fills in predictions and writes the plan file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from zeppelin.schemas.cluster import ClusterSpec
from zeppelin.schemas.common import InputError
from zeppelin.schemas.model import ModelSpec
from zeppelin.schemas.plan import Sequence, StepPlan
from zeppelin.schemas.profile import CostProfile

from .cost import CostModel


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
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.cost = CostModel(self.cluster, self.model, self.profile, tp=self.tp, zero_stage=self.zero_stage,
                              tp_overlap=self.tp_overlap)

    def cost_for(self, tp: int) -> CostModel:
        """The cost model of a unit of ``tp`` GPUs (replicas of mixed TP degree: Hydraulis plans),
        built once per degree."""
        if tp == self.tp:
            return self.cost
        cache = self.__dict__.setdefault("_costs_by_tp", {})
        if tp not in cache:
            cache[tp] = CostModel(self.cluster, self.model, self.profile, tp=tp, zero_stage=self.zero_stage,
                                  tp_overlap=self.tp_overlap)
        return cache[tp]

    @property
    def num_units(self) -> int:
        return self.cost.num_units

    @property
    def units_per_node(self) -> int:
        return self.cost.units_per_node


class Planner:
    """Base class. Subclasses set ``name`` and implement :meth:`plan_step`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, **options: Any):
        self.options = options

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        raise NotImplementedError


PLANNERS: dict[str, Callable[..., Planner]] = {}


def register(cls):
    """Class decorator: make a planner available by its ``name``."""
    PLANNERS[cls.name] = cls
    return cls


def get_planner(name: str, **options: Any) -> Planner:
    from . import registry  # noqa: F401  (imports every planner module so they register)

    if name not in PLANNERS:
        raise InputError(f"unknown planner {name!r} (known: {', '.join(sorted(PLANNERS))})")
    return PLANNERS[name](**options)
