"""The planner's own whole-step searches, one module each (:class:`.protocols.StepSearch`: ``name``
and ``search(state, parts, found)``), their registry and the loop over micro-batch counts that runs
them.

Per micro-batch count (the fewest that fit first, :func:`split_microbatches`), every search in
:data:`REGISTRY` adds its whole-step layouts to the count's :class:`.protocols.Round`, in order (a
later search may read what the earlier ones found); the step's layouts are handed on as
:class:`.protocols.Candidate` s. Adding a search: one module with ``name`` and ``search``, and one
line in :data:`REGISTRY`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence as _Seq
from functools import partial

import numpy as np

from zeppelin.planner.core.base import PlanContext, PlanningError
from zeppelin.planner.costmodel.predict import lower_bounds, predict_from_terms
from zeppelin.planner.zeppelin.protocols import Candidate, Round, StepSearch
from zeppelin.planner.zeppelin.record import tiered_finisher
from zeppelin.planner.zeppelin.select import BUILD_ALL_MAX_UNITS
from zeppelin.planner.zeppelin.step_searches import node_cp, node_major, tiered
from zeppelin.planner.zeppelin.step_state import StepState
from zeppelin.schemas.plan import Sequence, StepPlan

#: the whole-step searches, in the order they run per micro-batch count
REGISTRY: tuple[StepSearch, ...] = (tiered, node_cp, node_major)
#: micro-batches are first counted for this share of the units' token capacity (slack for rings)
FILL = 0.9
#: beyond this many units, where a step needs several micro-batches and they are coupled (FSDP:
#: every unit waits for the slowest in each layer of each micro-batch), node-major runs first and,
#: when it finds a layout, alone: there its whole-step node balance beats the micro-batch-major
#: layouts by 20-25% of the step (benchmarks/bench_planner.py, 512-4,096 GPUs), and they cost
#: as much again to plan; nor are the large families built then (FLOP-share: 25-30% slower there)
NODE_MAJOR_FIRST_UNITS = 256
#: from this many units up to :data:`NODE_MAJOR_FIRST_UNITS`, node-major also runs first where
#: micro-batches are coupled, and alone where its plan is predicted within the option
#: ``search_gap`` of the step's lower bound: no micro-batch-major layout could gain more than every
#: plan pays above that bound (where the families' ``family_gap`` applies too)
NEAR_BOUND_MIN_UNITS = BUILD_ALL_MAX_UNITS + 1


def search_step(state: StepState, step: int, simulate: bool) -> list[Candidate]:
    """Every whole-step candidate of the step, scored by its predicted time (no gradient
    all-reduce): the layouts of the fewest micro-batches any search can plan (``simulate``: and of
    one more, which the simulator may find runs rings more smoothly). Raises
    :class:`PlanningError` when none fits."""
    try:
        found = _search_counts(state, step, simulate)
    finally:
        # span tables serve the step's candidate layouts (large on big clusters): none outlives the
        # search, so a long plan file streams with one step's memory
        state.span_tables.clear()
    ctx, sequences, lengths = state.ctx, state.sequences, state.lengths
    return [Candidate(t, a, partial(as_plan, ctx, step, sequences, lengths, built),
                      tiered_finisher(state, [b[1] for b in built])) for a, (built, t) in enumerate(found)]


def _search_counts(state: StepState, step: int, simulate: bool) -> list:
    ctx, lengths, n_seq = state.ctx, state.lengths, len(state.sequences)
    budget = ctx.num_units * state.tiering.cap
    M = max(1, min(n_seq, math.ceil(int(lengths.sum()) / (FILL * budget))))
    found = Round()
    while M <= n_seq:
        parts = MicroBatchSplit(ctx, lengths, M, budget)
        if not parts.fits():
            M += 1
            continue
        found = Round(found=found.found)
        for strategy in _searches(state, parts, found):
            strategy.search(state, parts, found)
            if _settled(state, parts, found):
                break
        if found.best_built is None:
            M += 1
            continue
        if simulate and M < n_seq and min(len(b) for b, _ in found.found) == M:
            M += 1
            continue
        break
    if not found.found:  # every sequence fits alone (checked before), so this means a packing failure
        raise PlanningError(f"step {step}: no feasible assignment found ({state.last_error})")
    return found.found


def _searches(state: StepState, parts: list[list[int]], found: Round):
    """The searches still to run for a micro-batch count. Where micro-batches are coupled beyond
    :data:`NODE_MAJOR_FIRST_UNITS` units, or from :data:`NEAR_BOUND_MIN_UNITS` units up, node-major
    runs here first: beyond the former no other search where it found a layout, below it none where
    that layout is predicted within ``search_gap`` of the step's lower bound, else the others; on
    smaller clusters every one of :data:`REGISTRY`."""
    ctx = state.ctx
    leads = ctx.num_units > NODE_MAJOR_FIRST_UNITS
    if not (len(parts) > 1 and ctx.microbatches_coupled and (leads or ctx.num_units >= NEAR_BOUND_MIN_UNITS)):
        return REGISTRY
    node_major.search(state, parts, found)
    if found.best_built is not None and (leads or _near_bound(state, found.best_built)):
        state.node_major_led = leads
        return ()
    return tuple(s for s in REGISTRY if s is not node_major)


def _settled(state: StepState, parts, found: Round) -> bool:
    """Whether the searches still to run for this count are skipped: where node-major runs
    first (coupled micro-batches from :data:`NEAR_BOUND_MIN_UNITS` units up), a count whose best
    layout so far is predicted within ``search_gap`` of the lower bound - what a later search could
    gain is less than every plan pays above that bound, as for node-major's own layout."""
    ctx = state.ctx
    return (len(parts) > 1 and ctx.microbatches_coupled and ctx.num_units >= NEAR_BOUND_MIN_UNITS
            and found.best_built is not None and _near_bound(state, found.best_built))


def _near_bound(state: StepState, built) -> bool:
    """Whether a whole-step layout is predicted within ``search_gap`` of the lower bound of a step
    in as many micro-batches (what the other searches of this count could reach: under
    ``--recompute auto`` the step's own bound counts the fewest micro-batches recomputation allows)."""
    gap = state.options.search_gap
    if gap <= 0:
        return False
    pr = predict_from_terms(state.ctx, state.lengths, [b[2] for b in built])
    return pr.step_time_s <= (1 + gap) * max(lower_bounds(state.ctx, state.lengths, microbatches=len(built)))


class MicroBatchSplit(_Seq):
    """The step's sequences in ``M`` micro-batches (:func:`split_microbatches`), cut when a search
    first reads them: node-major, which runs alone at scale, makes its own and reads only how many
    there are. Whether they fit is known without cutting where :func:`split_fits` proves it."""

    def __init__(self, ctx, lengths: np.ndarray, M: int, budget: int):
        self.ctx, self.lengths, self.M, self.budget = ctx, lengths, M, budget
        self._parts: list[list[int]] | None = None
        self._cut = False

    def fits(self) -> bool:
        """Whether :func:`split_microbatches` finds ``M`` micro-batches (none empty)."""
        return split_fits(self.ctx, self.lengths, self.M, self.budget) or self.parts() is not None

    def parts(self) -> list[list[int]] | None:
        """The micro-batches (sequence indices), cut on first call; None where they do not fit."""
        if not self._cut:
            self._parts, self._cut = split_microbatches(self.ctx, self.lengths, self.M, self.budget), True
        return self._parts

    def __len__(self) -> int:
        return self.M

    def __getitem__(self, k):
        return self.parts()[k]


def split_fits(ctx, lengths: np.ndarray, M: int, budget: int) -> bool:
    """A sufficient condition for :func:`split_microbatches` to find ``M`` micro-batches, none empty.
    A sequence of L tokens finds no micro-batch with room only when the others hold more than
    ``M * (budget - L)`` tokens, which all the tokens, less its own, cannot where ``total <=
    M * budget - (M - 1) * L``; and the first ``M`` sequences (heaviest first) each go to an empty
    micro-batch where every sequence has work (an empty one has the least)."""
    n = len(lengths)
    if M < 2 or n < M:
        return False
    total, longest = int(lengths.sum()), int(lengths.max())
    return total <= M * budget - (M - 1) * longest and bool((ctx.cost.work(lengths) > 0).all())


def split_microbatches(ctx, lengths: np.ndarray, M: int, budget: int) -> list[list[int]] | None:
    """The step's sequences into ``M`` micro-batches of at most ``budget`` tokens, balancing work:
    heaviest first to the micro-batch with the least work among those with room (ties: fewest
    tokens, lowest index). None when one stays empty or a sequence fits none."""
    if M == 1:
        return [list(range(len(lengths)))] if lengths.sum() <= budget else None
    work = ctx.cost.work(lengths)
    order = np.argsort(-work, kind="stable").tolist()
    wl, Ll = work.tolist(), lengths.tolist()
    parts: list[list[int]] = [[] for _ in range(M)]
    # a heap of (work, tokens, index); entries without room are set aside and put back
    heap = [(0.0, 0, j) for j in range(M)]
    for i in order:
        L = Ll[i]
        aside = []
        while heap and heap[0][1] + L > budget:
            aside.append(heapq.heappop(heap))
        if not heap:
            return None
        w, t, j = heapq.heappop(heap)
        parts[j].append(int(i))
        heapq.heappush(heap, (w + wl[i], t + L, j))
        for e in aside:
            heapq.heappush(heap, e)
    if any(not p for p in parts):
        return None
    return [sorted(p) for p in parts]


def as_plan(ctx: PlanContext, step: int, sequences: list[Sequence], lengths: np.ndarray, built) -> StepPlan:
    """A whole-step candidate (built micro-batches) as a plan, priced from its prediction terms
    (the same as ``predict_step(ctx, plan)``)."""
    plan = StepPlan(step=step, sequences=list(sequences), microbatches=[b[0] for b in built])
    plan.prediction = predict_from_terms(ctx, lengths, [b[2] for b in built])
    return plan
