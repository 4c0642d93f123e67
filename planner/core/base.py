"""The planner interface shared by zeppelin and every baseline.

A planner turns the sequences of one training step into a :class:`StepPlan`. The driver
(:mod:`zeppelin.planner.core.driver`) samples steps from a manifest, calls ``plan_step`` for each
(possibly in worker processes), fills in predictions and writes the plan file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from zeppelin.planner.core.options import NoOptions, PlannerOptions
from zeppelin.planner.costmodel.context import PlanContext, PlanningError
from zeppelin.schemas.common import InputError
from zeppelin.schemas.plan import Sequence, StepPlan

__all__ = ["PLANNERS", "PlanContext", "Planner", "PlannerOptions", "PlanningError", "get_planner", "register"]


class Planner:
    """Base class. Subclasses set ``name``, declare their options as ``Options`` (a
    :class:`~zeppelin.planner.core.options.PlannerOptions` dataclass) and implement :meth:`plan_step`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: the planner's options: names, types, ranges, defaults and help (:mod:`.options`)
    Options: ClassVar[type[PlannerOptions]] = NoOptions
    #: the names of ``Options``; any other option is refused (a misspelt option would otherwise be
    #: silently ignored and plan with the default)
    option_names: ClassVar[tuple[str, ...]] = ()
    #: whether ``--recompute auto`` lets the planner choose per micro-batch; a planner that does not
    #: (the baselines: their systems apply one mode) plans it as ``none``
    chooses_recompute: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.option_names = cls.Options.names()

    def __init__(self, **options: Any):
        #: the options as given (the plan header records them so)
        self.options = options
        #: the same, checked and typed: an ``Options`` instance
        self.opts = self.Options.parse(self.name, options)

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        raise NotImplementedError

    def recompute_mode(self, recompute: str) -> str:
        """The recomputation this planner's plans run for the ``--recompute`` value given (what
        their header says): ``auto`` is ``per-microbatch`` for a planner that chooses, else
        ``none``; a global mode is itself."""
        if recompute not in ("auto", "per-microbatch"):
            return recompute
        return "per-microbatch" if self.chooses_recompute else "none"


PLANNERS: dict[str, Callable[..., Planner]] = {}


def register(cls):
    """Class decorator: make a planner available by its ``name``."""
    PLANNERS[cls.name] = cls
    return cls


def get_planner(name: str, **options: Any) -> Planner:
    from zeppelin.planner.core import registry  # noqa: F401  (imports every planner module so they register)

    if name not in PLANNERS:
        raise InputError(f"unknown planner {name!r} (known: {', '.join(sorted(PLANNERS))})")
    return construct_planner(name, **options)


def construct_planner(name: str, **options: Any) -> Planner:
    """Build the registered planner ``name``; an unknown option, or one of the wrong type or range,
    is an InputError."""
    cls = PLANNERS[name]
    try:
        return cls(**options)  # Planner.__init__ checks the options against cls.Options
    except InputError:
        raise
    except (ValueError, TypeError, OverflowError) as e:  # an option of the wrong type or out of range
        raise InputError(f"planner {name!r}: bad option ({e})") from None


def pow2_sizes(limit: int) -> list[int]:
    """Powers of two 1, 2, 4, ... <= limit (group sizes every planner chooses among)."""
    out, g = [], 1
    while g <= limit:
        out.append(g)
        g *= 2
    return out


def zigzag_share(L, G: int) -> np.ndarray:
    """Tokens the fullest position of a zigzag ring of ``G`` holds of sequences ``L`` (as cut by
    :func:`zeppelin.schemas.layout.zigzag_ranges`: 2G near-equal chunks, position i holds chunks i
    and 2G-1-i, the first ``L mod 2G`` chunks one token longer)."""
    L = np.asarray(L, dtype=np.int64)
    if G <= 1:
        return L
    q, r = np.divmod(L, 2 * G)
    return 2 * q + (r > 0) + (r > G)
