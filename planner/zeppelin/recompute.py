"""Recomputation chosen per micro-batch (``--recompute auto``, docs/CONCEPTS.md, "When recompute pays").

A step is planned under the token capacity of each global mode (``none``, then ``selective`` and
``full`` where they may help); in each candidate every micro-batch then takes, of the choices
under which all its units fit (``none``, ``selective``, ``full:k`` with the fewest layers k that
fit), the one whose slowest unit is fastest with the forward it runs again (kept only where it is
judged at least as fast as the plan in the mode it was made for), and the candidate judged fastest
(by the simulator where the planner selects or confirms by it, else by the prediction) is the
step's plan. So the micro-batching itself trades "one micro-batch with recomputation" (the
larger capacity) against "two without" (the smaller) by predicted time. A step whose plan without
recomputation has one micro-batch in which no unit recomputes is that plan: recomputation could only
add time (a unit laid out beyond its capacity in that pass, ``PlanContext.unit_recompute``, recomputes:
the other modes are planned then too). Nor is a step planned under ``full`` where ``selective``'s
plan has one micro-batch: ``full``'s larger capacity can lower the count of micro-batches, which one
cannot, and each unit of that plan already takes the fewest layers of ``full:k`` it needs
(:func:`assign`; docs/BENCHMARKS.md, "Planner latency", measures what ``full`` made there). Where the
candidates are judged by the prediction, a ``confirm`` judge (the simulator) may rank again those
predicted within :data:`CONFIRM_MARGIN` of the best: the prediction does not play out a second
micro-batch's waits, so it misprices "one against two" by a few per cent either way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from zeppelin.planner.costmodel.context import PlanContext, PlanningError
from zeppelin.planner.costmodel.predict import (
    attention_tokens,
    microbatch_terms,
    predict_from_terms,
    predict_step,
    ulysses_held_tokens,
)
from zeppelin.schemas.plan import PER_MICROBATCH, MicroBatch, Sequence, StepPlan

#: the ``--recompute`` value that lets a planner choose per micro-batch
AUTO = "auto"
#: the global modes a step is planned under, in the order tried
CANDIDATE_MODES = ("none", "selective", "full")
#: ``confirm`` ranks again the candidates predicted within this share of the best: the prediction's
#: error on a step of two micro-batches against one (docs/CONCEPTS.md, "When recompute pays") must not
#: decide between them, while a candidate predicted much slower is not simulated
CONFIRM_MARGIN = 0.10


def chooses(ctx: PlanContext) -> bool:
    """Whether the context asks for a choice per micro-batch."""
    return ctx.recompute in (AUTO, PER_MICROBATCH)


def mode_context(ctx: PlanContext, mode: str) -> PlanContext:
    """``ctx`` under the global ``mode`` (built once per mode, kept on ``ctx``); under ``none`` its
    units may hold more, each recomputing on its own (``PlanContext.unit_recompute``: the choice
    per unit is made afterwards, :func:`assign`)."""
    cache = ctx.__dict__.setdefault("_by_recompute", {})
    if mode not in cache:
        cache[mode] = PlanContext(ctx.cluster, ctx.model, ctx.profile, tp=ctx.tp, zero_stage=ctx.zero_stage,
                                  tp_overlap=ctx.tp_overlap, seed=ctx.seed, recompute=mode,
                                  options=ctx.options, max_seq_len=ctx.max_seq_len,
                                  unit_recompute=mode == "none")
    return cache[mode]


def held_tokens(mb: MicroBatch, n: int) -> np.ndarray:
    """Per unit, the most tokens it holds in the micro-batch (attention or linear layout)."""
    att = attention_tokens(mb, n)  # (token counts: whole numbers, summed exactly in any order)
    if mb.linear_layout is None:
        return att
    lin = np.array([sum(e - s for _, s, e in segs) for segs in mb.linear_layout], dtype=np.float64)
    return np.maximum(att, lin)


def _unit_fits(ctx: PlanContext, costs: list, held: np.ndarray, uly: np.ndarray | None):
    """``fits(mode, u)``: whether unit ``u`` fits under ``mode`` (a unit holding nothing always
    does). ``uly``: per unit, the tokens it holds in Ulysses groups, whose extra copies count on top
    (as ``validate`` counts them)."""
    def fits(mode: str, u: int) -> bool:
        if held[u] <= 0:
            return True
        eq = costs[u].recompute_layout_tokens(held[u], 0 if uly is None else uly[u], mode)
        return eq < costs[u].recompute_capacity(mode) + 1

    return fits


def _fewest_full(ctx: PlanContext, fits: Callable[[str], bool]) -> list[str]:
    """``[full:k]`` with the fewest layers k under which ``fits`` holds (``full`` where that is all
    of them; more only add time), or ``[]`` where not even ``full`` does."""
    L = ctx.model.num_layers
    if not fits("full"):
        return []
    lo, hi = 1, L
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(f"full:{mid}"):
            hi = mid
        else:
            lo = mid + 1
    return ["full" if lo >= L else f"full:{lo}"]


def _fitting(ctx: PlanContext, n: int, unit_fits) -> list[str]:
    """The choices under which every one of the ``n`` units fits (``unit_fits``, :func:`_unit_fits`):
    ``none``, ``selective``, and of ``full:1`` .. ``full`` only the fewest layers that fit."""
    def fits(mode: str) -> bool:
        return all(unit_fits(mode, u) for u in range(n))

    return [m for m in ("none", "selective") if fits(m)] + _fewest_full(ctx, fits)


def _costs(ctx: PlanContext, step: StepPlan, n: int) -> list:
    reps = step.replicas
    return [ctx.cost] * n if reps is None else [ctx.cost_for(r.tp) for r in reps]


def _fit_of(ctx: PlanContext, step: StepPlan, mb: MicroBatch):
    """``(costs, held, fits)`` of ``mb``'s units: their cost models, the tokens each holds
    (:func:`held_tokens`) and :func:`_unit_fits`."""
    n = len(mb.queues)
    costs = _costs(ctx, step, n)
    held = held_tokens(mb, n)
    return costs, held, _unit_fits(ctx, costs, held, ulysses_held_tokens(mb, n, costs))


def fitting_choices(ctx: PlanContext, step: StepPlan, mb: MicroBatch) -> list[str]:
    """The choices under which every unit of ``mb`` fits (:func:`_fitting`)."""
    _, held, fits = _fit_of(ctx, step, mb)
    return _fitting(ctx, len(held), fits)


def as_choices(by_unit: dict[int, str], held: np.ndarray) -> tuple[str | None, dict[str, list[int]] | None]:
    """``(MicroBatch.recompute, MicroBatch.recompute_units)`` for units running ``by_unit``'s choices
    and every other unit none (``held``: the tokens each unit holds): one choice for the whole
    micro-batch where every unit holding tokens runs the same one."""
    if not by_unit:
        return None, None
    modes = set(by_unit.values())
    if len(modes) == 1 and set(np.flatnonzero(held > 0).tolist()) <= set(by_unit):
        return modes.pop(), None
    units: dict[str, list[int]] = {}  # (choices in the order of their first unit)
    for u in sorted(by_unit):
        units.setdefault(by_unit[u], []).append(u)
    return None, units


def choose_microbatch(ctx: PlanContext, step: StepPlan, mb: MicroBatch,
                      terms_of: Callable[[MicroBatch], object] | None = None) -> tuple[str | None, dict | None]:
    """``(recompute, recompute_units)`` of ``mb``: each unit that does not fit without
    recomputation runs, of the choices under which it fits, the one that adds the least forward
    (its attention and linear work priced by the prediction's terms) - so the micro-batch's slowest
    unit is as fast as any choice makes it - and every other unit none (a unit that fits without
    recomputation need not pay for it; the choices' collectives are the same, so the runtime lets
    ranks differ); ``full`` on every unit where some unit fits under no choice (the plan's memory
    check then names it). ``terms_of``: the micro-batch's prediction terms as it stands (default:
    :func:`.predict.microbatch_terms`)."""
    costs, held, fits = _fit_of(ctx, step, mb)
    n = len(held)
    need = [u for u in range(n) if not fits("none", u)]
    if not need:
        return None, None
    per = {u: (["selective"] if fits("selective", u) else []) + _fewest_full(ctx, lambda m, u=u: fits(m, u))
           for u in need}
    if not all(per.values()):
        return "full", None
    mb.recompute, mb.recompute_units = None, None
    lengths = [q.length for q in step.sequences]
    terms = None if step.replicas is not None else terms_of(mb) if terms_of else microbatch_terms(ctx, lengths, mb)
    if terms is None:  # replicas of mixed TP: the choice that adds the least forward
        attn, lin = np.zeros(n), np.ones(n)
    else:
        attn, lin = terms.attn, terms.lin - np.asarray(ctx.cost.head_time(terms.tokens), dtype=np.float64)
    by_unit = {u: min(per[u], key=lambda m, u=u: float(costs[u].recompute_extra_time(m, attn[u], lin[u])))
               for u in need}
    return as_choices(by_unit, held)


def assign(ctx: PlanContext, plan: StepPlan, predictor: ChoicePredictor | None = None) -> StepPlan:
    """``plan`` with each micro-batch's choices set (:func:`choose_microbatch`; left out where no
    unit recomputes) and its prediction under them (``predictor``: by it)."""
    for mb in plan.microbatches:
        mb.recompute, mb.recompute_units = choose_microbatch(ctx, plan, mb, predictor.terms if predictor else None)
    plan.prediction = predictor() if predictor else predict_step(ctx, plan)
    return plan


class ChoicePredictor:
    """``predict_step(ctx, plan)`` for a plan whose micro-batches change only their recomputation
    choices while it is judged: each micro-batch's terms are computed once per choice (a choice
    tried on one micro-batch leaves the others' terms as they were)."""

    def __init__(self, ctx: PlanContext, plan: StepPlan):
        self.ctx, self.plan = ctx, plan
        self.lengths = [q.length for q in plan.sequences]
        self._terms: dict[tuple, object] = {}

    def terms(self, mb: MicroBatch):
        units = mb.recompute_units
        key = (id(mb), mb.recompute, None if units is None else tuple((m, tuple(us)) for m, us in units.items()))
        got = self._terms.get(key)
        if got is None:
            got = self._terms[key] = microbatch_terms(self.ctx, self.lengths, mb)
        return got

    def __call__(self):
        if self.plan.replicas is not None:  # (replicas of mixed TP degree: predicted per replica)
            return predict_step(self.ctx, self.plan)
        return predict_from_terms(self.ctx, self.lengths, [self.terms(mb) for mb in self.plan.microbatches])


def plan_step(ctx: PlanContext, step: int, sequences: list[Sequence],
              plan_one: Callable[[PlanContext, int, list[Sequence]], StepPlan],
              score: Callable[[StepPlan], float] | None = None,
              confirm: Callable[[StepPlan], float] | None = None) -> StepPlan:
    """The step planned with a choice per micro-batch (module docstring); ``plan_one`` plans it
    under one global mode's context, ``score`` judges the candidates (default: their predicted
    step time); ``confirm`` (given only with the default ``score``) ranks again those predicted
    within :data:`CONFIRM_MARGIN` of the best. Ties keep the earlier mode. The plan's header says
    ``per-microbatch``."""
    score = score or (lambda p: p.prediction.step_time_s)
    cands: list[tuple[float, StepPlan]] = []
    error: PlanningError | None = None
    for mode in CANDIDATE_MODES:
        try:
            plan, t = _judged(ctx, plan_one(mode_context(ctx, mode), step, sequences), mode, score)
            cands.append((t, plan))
        except PlanningError as e:
            error = error or e
            continue
        if mode == "none" and len(plan.microbatches) == 1 and not any(mb.recomputes() for mb in plan.microbatches):
            break  # one micro-batch without recomputation: nothing to save (with units recomputing: the
            # other modes' plans may do without them)
        if mode == "selective" and len(plan.microbatches) == 1:
            break  # one micro-batch under selective's capacity: full's cannot make fewer (module docstring)
    if not cands:
        raise error
    if confirm is not None and len(cands) > 1:
        cands = _confirmed(cands, confirm)
    return min(enumerate(cands), key=lambda ic: (ic[1][0], ic[0]))[1][1]


def _confirmed(cands: list[tuple[float, StepPlan]], confirm: Callable[[StepPlan], float]) -> list[tuple[float, StepPlan]]:
    """``cands`` (predicted time, plan), those within :data:`CONFIRM_MARGIN` of the best timed by
    ``confirm`` instead and the others left out; a plan made the same as an earlier one (same
    micro-batches, choices and prediction: two modes' capacities may give one plan) is not timed
    twice - the earlier wins the tie."""
    limit = min(t for t, _ in cands) * (1 + CONFIRM_MARGIN)
    out: list[tuple[float, StepPlan]] = []
    seen: list[tuple] = []
    for t, plan in cands:
        if t > limit:
            continue
        key = (t, tuple((mb.recompute, tuple((m, tuple(us)) for m, us in (mb.recompute_units or {}).items()),
                         len(mb.placements)) for mb in plan.microbatches))
        if key in seen:
            continue
        seen.append(key)
        out.append((confirm(plan), plan))
    return out


def _fits_as(ctx: PlanContext, plan: StepPlan, mb: MicroBatch, mode: str) -> bool:
    """Whether every unit of ``mb`` fits under the global ``mode`` (``full``: all layers)."""
    choices = fitting_choices(ctx, plan, mb)
    return mode in choices or (mode == "full" and any(c.startswith("full") for c in choices))


def _each_choice_judged(ctx: PlanContext, plan: StepPlan, score: Callable[[StepPlan], float],
                        predict: ChoicePredictor) -> float:
    """``plan``'s score after each micro-batch that recomputes has tried, in turn, each choice that
    fits all its units needing one on those units alone, under ``score``, keeping any that rates the
    plan faster: the choices are priced from the prediction's terms, and a choice on a few units can
    come out within what the simulator's waits decide."""
    t = score(plan)
    kept = plan.prediction  # the prediction of the choices kept so far
    for mb in plan.microbatches:
        if not mb.recomputes():
            continue
        best = (mb.recompute, mb.recompute_units)
        _, held, fits = _fit_of(ctx, plan, mb)
        need = [u for u in range(len(held)) if not fits("none", u)]
        for m in _fitting(ctx, len(held), fits):
            alt = as_choices({u: m for u in need}, held)
            if m == "none" or alt == best:
                continue
            mb.recompute, mb.recompute_units = alt
            plan.prediction = predict()
            tm = score(plan)
            if tm < t:
                t, best, kept = tm, alt, plan.prediction
        mb.recompute, mb.recompute_units = best
    # (a prediction depends on the plan and its choices alone: the kept choices' is reused)
    plan.prediction = kept
    return t


def _judged(ctx: PlanContext, plan: StepPlan, mode: str, score: Callable[[StepPlan], float]) -> tuple[StepPlan, float]:
    """``plan`` (made under the global ``mode``) with its choices per micro-batch (:func:`assign`) and
    its score; where ``score`` rates the plan as made, every micro-batch in ``mode``, faster (the
    choice prices the slowest unit's forward, the simulator also plays out its waits) and every
    micro-batch fits so, that one: a choice per micro-batch never loses to the global mode its plan
    was made for."""
    predict = ChoicePredictor(ctx, plan)
    assign(ctx, plan, predict)
    t = _each_choice_judged(ctx, plan, score, predict)
    chosen = [(mb.recompute, mb.recompute_units) for mb in plan.microbatches]
    as_made = None if mode == "none" else mode
    if all(c == (as_made, None) for c in chosen) or not all(_fits_as(ctx, plan, mb, mode) for mb in plan.microbatches):
        return plan, t  # as chosen, or as made would not fit (a layout's extra copies the capacity misses)
    kept = plan.prediction
    for mb in plan.microbatches:
        mb.recompute, mb.recompute_units = as_made, None
    plan.prediction = predict()
    t_made = score(plan)
    if t_made < t:
        return plan, t_made
    for mb, (c, us) in zip(plan.microbatches, chosen):
        mb.recompute, mb.recompute_units = c, us
    plan.prediction = kept
    return plan, t
