"""``zeppelin validate``: check every invariant of a plan file (docs/DESIGN.md, "Plan invariants").

Invariants, each reported with its name so a person can tell which one broke:

* ``coverage``, ``ring-order``, ``kinds``, ``tp``, ``routes``: the invariants that need no cost
  model, one list shared with the plan reader and the runtime (:mod:`zeppelin.schemas.invariants`);
* ``memory``     no unit holds more tokens than its activation memory allows, in either layout
                 (the cost model's token capacity);
* ``runnable``   ``zeppelin run`` executes the step for the model (:mod:`zeppelin.schemas.runnable`:
                 no tensor-parallel replicas for Hugging Face models, TP degrees dividing the heads);
* ``inputs``     the header's hashes match the inputs embedded in it and the inputs given on
                 the command line (cluster, model, profile, manifest).
"""

from __future__ import annotations

import os
from typing import Any

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.costmodel.predict import ulysses_held_tokens
from zeppelin.schemas.common import InputError, content_hash
from zeppelin.schemas.invariants import plan_problems
from zeppelin.schemas.plan import MicroBatch, PlanHeader, PlanReader, StepPlan, sample_problems


def header_context(header: PlanHeader) -> PlanContext:
    try:
        return PlanContext(header.cluster, header.model, header.profile, tp=header.tp, zero_stage=header.zero_stage, recompute=header.recompute,
                           tp_overlap=header.tp_overlap, seed=header.seed)
    except ValueError as e:
        raise InputError(f"plan header: {e}") from None


def input_problems(header: PlanHeader, cluster=None, model=None, profile=None, manifest: Any = None) -> list[str]:
    probs = []
    for name, embedded in (("cluster", header.cluster), ("model", header.model), ("profile", header.profile)):
        want = getattr(header.hashes, name)
        got = content_hash(embedded)
        if got != want:
            probs.append(f"inputs: the embedded {name} hashes to {got}, the header records {want} "
                         f"(plan edited after planning?)")
    for name, given in (("cluster", cluster), ("model", model), ("profile", profile)):
        if given is None:
            continue
        got = content_hash(given)
        want = getattr(header.hashes, name)
        if got != want:
            label = getattr(given, "name", "") or name
            probs.append(f"inputs: {name} {label!r} ({got}) is not the {name} this plan was made for "
                         f"({getattr(getattr(header, name), 'name', '') or name}, {want})")
    if manifest is not None:
        got = manifest.content_hash
        if got != header.hashes.manifest:
            probs.append(f"inputs: manifest {manifest.source!r} ({got}) is not the manifest this plan was made "
                         f"for ({header.manifest.path or '?'}, {header.hashes.manifest})")
    return probs


def memory_problems(ctx: PlanContext, step: StepPlan, mbi: int, mb: MicroBatch) -> list[str]:
    # units are uniform replicas of header.tp GPUs, or the step's own replicas (mixed TP degrees)
    reps = step.replicas
    costs = [ctx.cost] * ctx.num_units if reps is None else [ctx.cost_for(r.tp) for r in reps]
    n = len(costs)
    att = [0] * n
    for p in mb.placements:
        if not 0 <= p.group < len(mb.groups):
            continue
        units = mb.groups[p.group].units
        for pos, rs in enumerate(p.ranges):
            if pos < len(units) and 0 <= units[pos] < n:
                att[units[pos]] += sum(max(e - s, 0) for s, e in rs)
    # of them, tokens in Ulysses rows of two or more positions (their extra copies count, replicated
    # K/V heads on top)
    uly = ulysses_held_tokens(mb, n, costs)
    uly = [0] * n if uly is None else uly.tolist()
    lin = att if mb.linear_layout is None else [sum(max(e - s, 0) for _, s, e in segs) for segs in mb.linear_layout]
    probs = []
    for what, held in (("attention", att), ("linear", lin)):
        for u, t in enumerate(held):
            cm = costs[u] if u < n else ctx.cost
            mode = mb.recompute_of(u)  # the unit's recomputation in this micro-batch (None: the plan's)
            cap = cm.recompute_capacity(mode)
            held_eq = cm.recompute_layout_tokens(t, uly[u] if what == "attention" else 0, mode)
            if t > cap or held_eq >= cap + 1:
                gb = float(cm.recompute_memory_bytes(held_eq, mode)) / 1e9
                probs.append(f"memory: step {step.step} microbatch {mbi} unit {u} holds {t:,} tokens in the {what} "
                             f"layout, more than the {cap:,} its memory allows ({gb:.1f} GB > "
                             f"{ctx.cluster.gpu.memory_gb - ctx.profile.memory_reserved_gb:g} GB usable)")
    return probs


def step_problems(ctx: PlanContext, header: PlanHeader, step: StepPlan, limit: int = 20) -> list[str]:
    """Every invariant of one step: the shared list (:func:`zeppelin.schemas.invariants.plan_problems`),
    then memory (only when ``coverage`` holds: the memory check indexes freely)."""
    probs = plan_problems(header, step, limit=limit)
    if any(p.startswith("coverage: ") for p in probs):
        return probs
    for mbi, mb in enumerate(step.microbatches):
        if len(probs) >= limit:
            break
        probs += memory_problems(ctx, step, mbi, mb)
    return probs[:limit]


def validate_plan(path: str | os.PathLike, cluster=None, model=None, profile=None, manifest: Any = None,
                  limit: int = 20, hf: bool | None = None, summary: dict[str, Any] | None = None) -> list[str]:
    """All problems of the plan at ``path`` (empty: valid). Raises InputError if it cannot be read.
    ``hf``: the run trains a Hugging Face model (``--model hf:DIR``; None: as the plan's model
    name says) - the ``runnable`` check (:mod:`zeppelin.schemas.runnable`). ``summary``: filled with
    :func:`validate_summary`'s totals in the same pass (complete when the plan is valid)."""
    from zeppelin.schemas.runnable import step_problem

    reader = PlanReader(path, check=False)
    header = reader.header
    ctx = header_context(header)
    probs = input_problems(header, cluster, model, profile, manifest)
    totals = _Totals(ctx, header) if summary is not None else None
    try:
        for step in reader:
            probs += step_problems(ctx, header, step, limit=limit)
            why = step_problem(header, step, hf)
            if why:
                probs.append(f"runnable: {why}")
            if manifest is not None:
                probs += [f"inputs: {p}" for p in sample_problems(step, manifest.lengths)]
            if len(probs) >= limit:
                break
            if totals is not None and not probs:  # the totals matter only for a valid plan
                totals.add(step)
    except InputError as e:
        probs.append(f"format: {e.problem}")
    if totals is not None:
        summary.update(totals.result())
    return probs[:limit]


class _Totals:
    """The totals :func:`validate_summary` reports, step by step."""

    def __init__(self, ctx, header: PlanHeader) -> None:
        from zeppelin.planner.sim.summary import PlanSummary

        self.ctx, self.header = ctx, header
        self.steps = self.seqs = self.tokens = 0
        self.counts = PlanSummary()
        self.ratios: list[float] = []

    def add(self, st: StepPlan) -> None:
        from zeppelin.planner.sim.summary import step_summary

        self.steps += 1
        self.seqs += len(st.sequences)
        self.tokens += st.tokens
        self.counts.add(step_summary(self.ctx, st, traffic={}))  # tiers by the units' span; no traffic needed
        if st.prediction is not None and st.prediction.lower_bound_s > 0:
            self.ratios.append(st.prediction.step_time_s / st.prediction.lower_bound_s)

    def result(self) -> dict[str, Any]:
        return {"planner": self.header.planner, "steps": self.steps, "sequences": self.seqs, "tokens": self.tokens,
                "tiers": dict(self.counts.sequences), "ratios": self.ratios, "world_size": self.header.world_size}


def validate_summary(path: str | os.PathLike) -> dict[str, Any]:
    """Totals of a valid plan for the CLI's report."""
    reader = PlanReader(path, check=False)
    totals = _Totals(header_context(reader.header), reader.header)
    for st in reader:
        totals.add(st)
    return totals.result()
