"""What the planner's own whole-step searches share: planning every micro-batch of a step with the
tiered pipeline, and the choices of layout the searches read from the step's state."""

from __future__ import annotations

import numpy as np

from zeppelin.planner.zeppelin.step_state import StepState
from zeppelin.planner.zeppelin.tiered import best_microbatch


def balances(search: StepState) -> list[str]:
    """The objectives the tiered layouts balance: total per-unit cost, and (remap layer on, up to
    ``attention_max_units`` units: beyond, for planning latency, the FLOP-share family takes its
    place) attention alone with a remap evening out the linear tokens."""
    opts = search.options
    return ["total"] + (["attention"] if opts.remap and search.ctx.num_units <= opts.attention_max_units else [])


def node_cp_floor(search: StepState) -> int | None:
    """The node-CP layout's span floor (index of Span(units_per_node, "intra")), or None where
    there is no node-CP layout (one unit per node, or past ``node_cp_max_units`` units)."""
    ctx = search.ctx
    if ctx.units_per_node <= 1 or ctx.num_units > search.options.node_cp_max_units:
        return None
    return ctx.units_per_node - 1


def whole_step(search: StepState, parts: list[list[int]], floors, balances,
               fixed_nodes: list[int] | None = None):
    """Plan every micro-batch of a step, coarse ones first, each balanced on top of the per-unit
    load the earlier ones left (per unit, the step is the sum of its micro-batch periods, a
    period including the waits for the unit's coupled partners). Returns (built micro-batches,
    predicted time without the all-reduce); raises :class:`PackInfeasible`."""
    lengths = search.lengths
    carry = np.zeros(search.ctx.num_units)
    built = [None] * len(parts)
    for k in sorted(range(len(parts)), key=lambda k: -max(lengths[i] for i in parts[k])):
        mb, st, terms = best_microbatch(search, parts[k], carry, floors, balances, fixed_nodes=fixed_nodes)
        carry = carry + terms.period
        built[k] = (mb, st, terms)
    return built, float(carry.max())


def coupling_waste(search: StepState, built, t: float) -> bool:
    """Whether the units of a planned step lose more than ``tol`` of it waiting for partners."""
    busy = sum(b[2].busy for b in built)
    return t - float(busy.max()) > search.options.tol * t
