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
    lin = att if mb.linear_layout is None else [sum(max(e - s, 0) for _, s, e in segs) for segs in mb.linear_layout]
    probs = []
    for what, held in (("attention", att), ("linear", lin)):
        for u, t in enumerate(held):
            cm = costs[u] if u < n else ctx.cost
            cap = cm.recompute_capacity(mb.recompute)  # the micro-batch's recomputation (None: the plan's)
            if t > cap:
                gb = float(cm.recompute_memory_bytes(t, mb.recompute)) / 1e9
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
                  limit: int = 20, hf: bool | None = None) -> list[str]:
    """All problems of the plan at ``path`` (empty: valid). Raises InputError if it cannot be read.
    ``hf``: the run trains a Hugging Face model (``--model hf:DIR``; None: as the plan's model
    name says) - the ``runnable`` check (:mod:`zeppelin.schemas.runnable`)."""
    from zeppelin.schemas.runnable import step_problem

    reader = PlanReader(path, check=False)
    header = reader.header
    ctx = header_context(header)
    probs = input_problems(header, cluster, model, profile, manifest)
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
    except InputError as e:
        probs.append(f"format: {e.problem}")
    return probs[:limit]


def validate_summary(path: str | os.PathLike) -> dict[str, Any]:
    """Totals of a valid plan for the CLI's report."""
    from zeppelin.planner.sim.summary import PlanSummary, step_summary

    reader = PlanReader(path, check=False)
    ctx = header_context(reader.header)
    steps = seqs = tokens = 0
    counts = PlanSummary()
    ratios = []
    for st in reader:
        steps += 1
        seqs += len(st.sequences)
        tokens += st.tokens
        counts.add(step_summary(ctx, st, traffic={}))  # tiers by the units' span; traffic is not needed here
        if st.prediction is not None and st.prediction.lower_bound_s > 0:
            ratios.append(st.prediction.step_time_s / st.prediction.lower_bound_s)
    return {"planner": reader.header.planner, "steps": steps, "sequences": seqs, "tokens": tokens,
            "tiers": dict(counts.sequences), "ratios": ratios, "world_size": reader.header.world_size}
