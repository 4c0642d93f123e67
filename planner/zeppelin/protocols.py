"""What a candidate family of the Zeppelin planner is (docs/ARCHITECTURE.md, "Adding a candidate
family").

A family proposes whole-step layouts of its own shape. It scores each configuration with its own
estimate of the step's slowest unit (no gradient all-reduce) and hands back the best few as
:class:`Candidate` s; only those that :func:`.select.select` keeps are built, and every built plan
is judged by the same prediction (or simulator), so families never compare their own scores
against each other's plans.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from zeppelin.planner.core.base import PlanContext
from zeppelin.schemas.plan import Sequence, StepPlan


class Candidate(NamedTuple):
    """One configuration of a family: its own score (seconds, lower is better), its index among
    the family's configurations (ties of equal score keep the lower), and the function that builds
    it into a priced plan (it may raise :class:`PlanningError` when it turns out not to fit)."""

    score: float
    index: int
    build: Callable[[], StepPlan]


class Family(Protocol):
    """A module (or object) with a ``name`` and a ``candidates`` function; registered by one line
    in :data:`zeppelin.planner.zeppelin.families.REGISTRY`."""

    name: str

    def candidates(self, ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
                   routing: bool = True, top: int = 2) -> list[Candidate]:
        """The family's best ``top`` configurations for the step, best first. ``limit``: the
        caller builds no configuration scored above it (a family may skip searching those);
        ``routing``: whether inter-node transfers are routed over every NIC. A family that cannot
        plan the step returns none (or raises :class:`PlanningError`)."""
        ...
