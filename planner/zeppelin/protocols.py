"""The two kinds of search the Zeppelin planner runs per step, as protocols, and the one candidate
shape both hand to :func:`.select.select` (docs/ARCHITECTURE.md, "Adding a candidate family").

* A :class:`StepSearch` (:mod:`.step_searches`) is one of the planner's own whole-step searches:
  per micro-batch count it lays every micro-batch out with the tiered pipeline and adds the priced
  whole-step layouts to that count's :class:`Round`; the step's layouts become :class:`Candidate` s
  whose score is their predicted step time.
* A :class:`Family` (:mod:`.families`) proposes whole-step layouts of its own shape. It scores each
  configuration with its own estimate of the step's slowest unit (no gradient all-reduce) and hands
  back the best few as :class:`Candidate` s.

Only the candidates that :func:`.select.select` keeps are built, and every built plan is judged by
the same prediction (or simulator), so no search compares its own scores against another's plans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from zeppelin.planner.core.base import PlanContext
from zeppelin.schemas.plan import Sequence, StepPlan

if TYPE_CHECKING:  # pragma: no cover
    from zeppelin.planner.zeppelin.step_state import StepState


class Candidate(NamedTuple):
    """One whole-step candidate: its score (seconds, lower is better: a family's own estimate, or
    the predicted step time of the planner's own layouts), its index among its search's candidates
    (ties of equal score keep the lower), the function that builds it into a priced plan (it may
    raise :class:`PlanningError` when it turns out not to fit) and, for the planner's own layouts,
    the function recording on the plan, once it has won, how it was found (its
    :class:`SolverInfo` from the seconds spent on the step, and its notes; None: the selector
    records a greedy solve)."""

    score: float
    index: int
    build: Callable[[], StepPlan]
    finish: Callable[[StepPlan, float], None] | None = None


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


@dataclass
class Round:
    """The whole-step layouts of one micro-batch count: every search adds to ``found`` (the step's
    layouts over all counts, as (built micro-batches, predicted time)) and to the best of this
    count."""

    found: list = field(default_factory=list)
    best_built: list | None = None
    best_t: float = float("inf")
    best_floors: list = field(default_factory=lambda: [None])  # span floors of the best tiered / node-CP layout

    def offer(self, built, t: float, floors: list | None = None) -> None:
        self.found.append((built, t))
        if t < self.best_t:
            self.best_built, self.best_t = built, t
            if floors is not None:
                self.best_floors = floors


class StepSearch(Protocol):
    """A module (or object) with a ``name`` and a ``search`` function; registered by one line in
    :data:`zeppelin.planner.zeppelin.step_searches.REGISTRY` (run in that order per micro-batch
    count)."""

    name: str

    def search(self, state: StepState, parts: list[list[int]], found: Round) -> None:
        """Adds the search's whole-step layouts of the step's micro-batches ``parts`` (sequence
        indices, one list per micro-batch) to ``found`` (a later search may read what the earlier
        ones found there). A layout that does not fit is left out, its error kept in
        ``state.last_error``; a search that does not apply to the step adds nothing."""
        ...
