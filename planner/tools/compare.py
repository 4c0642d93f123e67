"""``zeppelin compare``: the same steps planned by every planner, simulated side by side.

Independent (planner, step) pairs run in worker processes; each job plans one step, checks its
structural invariants and simulates it (:mod:`zeppelin.planner.sim.simulate`). Per planner the table
reports mean / p50 / p90 simulated step time, speedup over ``te-cp`` (ratio of mean step times; the
faithful TransformerEngine baseline, one CP size for the run) and over ``te-cp-tuned`` (its CP size
tuned per step),
ratio to the lower bound, mean exposed communication and planner latency.

Datasets: a manifest (anything ``zeppelin data stats`` reads) or one of the built-in synthetic
length mixes below (``short``, ``mixed``, ``long``, ``longtail``), stand-ins for the short-heavy
(ArXiv-like), mixed (GitHub-like) and long-heavy (ProLong64k-like) corpora of the papers, and a
long tail of maximum-length sequences among short ones.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zeppelin.planner.core.base import PlanContext
from zeppelin.schemas.common import InputError

# Synthetic length mixes: (fraction, log-normal median, sigma) components, clipped to [16, 131072].
# ``longtail``: short sequences with 1.5% at the maximum length (a component whose median is far
# past the clip), so a step of a million tokens carries two to four 131,072-token sequences among
# about two hundred short ones - the steps a few maximum-length sequences set.
MIXES: dict[str, list[tuple[float, float, float]]] = {
    "short": [(0.85, 900.0, 0.9), (0.13, 6000.0, 0.7), (0.02, 40000.0, 0.5)],
    "mixed": [(0.55, 1500.0, 1.0), (0.35, 9000.0, 0.7), (0.10, 45000.0, 0.5)],
    "long": [(0.25, 2000.0, 1.0), (0.35, 16000.0, 0.6), (0.40, 60000.0, 0.35)],
    "longtail": [(0.985, 2000.0, 1.1), (0.015, 1e6, 0.1)],
}
DEFAULT_PLANNERS = ["packed-dp", "te-cp", "te-cp-tuned", "llama3-cp", "ulysses", "hybrid-dp", "megatron-dcp", "flexsp", "hydraulis",
                    "zeppelin", "zeppelin-no-routing", "zeppelin-no-remap"]
SOLVER_PLANNERS = ("flexsp", "hydraulis")  # planners whose optional wall-clock safety net --solver-time-limit sets


def mix_dataset(name: str, num_samples: int = 20000, seed: int = 0):
    """A deterministic synthetic dataset of one of the :data:`MIXES`."""
    from zeppelin.schemas.io.datasets import Dataset

    if name not in MIXES:
        raise InputError(f"unknown length mix {name!r} (known: {', '.join(MIXES)})")
    rng = np.random.default_rng(seed)
    comps = MIXES[name]
    which = rng.choice(len(comps), size=num_samples, p=[c[0] for c in comps])
    med = np.array([c[1] for c in comps])[which]
    sig = np.array([c[2] for c in comps])[which]
    lengths = np.clip(np.exp(np.log(med) + sig * rng.standard_normal(num_samples)), 16, 131072).astype(np.int64)
    return Dataset(lengths, source=f"mix:{name}", format="synthetic")


def resolve_dataset(ref: str | None, length_field: str | None = None, ids_field: str | None = None,
                    text_field: str | None = None, tokenizer: str | None = None):
    """``short`` / ``mixed`` / ``long`` / ``longtail`` (or ``mix:NAME``), else a manifest path read
    with the field flags (``None``: the shipped sample)."""
    from zeppelin.planner.core.inputs import load_dataset

    key = (ref or "").removeprefix("mix:")
    if key in MIXES:
        return mix_dataset(key)
    if ref is not None and ref.startswith("mix:"):
        raise InputError(f"unknown length mix {key!r} (known: {', '.join(MIXES)})")
    return load_dataset(ref, length_field, ids_field, text_field, tokenizer)


@dataclass
class PlannerRun:
    planner: str
    step_times: list[float] = field(default_factory=list)
    lower_bounds: list[float] = field(default_factory=list)
    exposed: list[float] = field(default_factory=list)
    sync: list[float] = field(default_factory=list)  # per step: the gradient sync part of ``exposed``
    span_nodes: list[int] = field(default_factory=list)  # per step: most nodes one group spans
    latencies: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    plan_cpu: list[float] = field(default_factory=list)
    sim_cpu: list[float] = field(default_factory=list)
    plans: dict = field(default_factory=dict)  # step -> StepPlan, for the (planner, step) pairs asked to keep
    options: dict = field(default_factory=dict)  # the options the planner was given
    layout: dict = field(default_factory=dict)  # group kind -> [fewest, most] units of its groups, over the steps
    error: str | None = None
    recompute: str = "none"  # the recomputation the planner ran with (its plans' header)

    def stats(self) -> dict[str, Any]:
        if self.error is not None or not self.step_times:
            return {"planner": self.planner, "error": self.error or "no steps", "recompute": self.recompute}
        t = np.array(self.step_times)
        lb = np.array(self.lower_bounds)
        return {
            "planner": self.planner, "error": None, "steps": len(t), "recompute": self.recompute,
            "mean_s": float(t.mean()), "p50_s": float(np.percentile(t, 50)), "p90_s": float(np.percentile(t, 90)),
            "ratio_to_lower_bound": float(np.mean(t / lb)) if np.all(lb > 0) else math.nan,
            "lower_bound_mean_s": float(np.mean(lb)),
            "exposed_comm_s": float(np.mean(self.exposed)),
            # its two parts (SimResult.exposed_transfers_s, allreduce_s): the table and the verdict show them
            "exposed_sync_s": float(np.mean(self.sync)) if self.sync else 0.0,
            "exposed_transfers_s": max(float(np.mean(self.exposed)) - (float(np.mean(self.sync)) if self.sync else 0.0),
                                       0.0),
            "steps_spanning_nodes": int(sum(x > 1 for x in self.span_nodes)),
            "predicted_mean_s": float(np.mean(self.predicted)),
            "plan_latency_mean_s": float(np.mean(self.latencies)), "plan_latency_max_s": float(np.max(self.latencies)),
            "plan_cpu_mean_s": float(np.mean(self.plan_cpu)) if self.plan_cpu else math.nan,
            "simulate_cpu_mean_s": float(np.mean(self.sim_cpu)) if self.sim_cpu else math.nan,
            "step_times_s": [float(x) for x in t],
            "options": dict(self.options), "layout": dict(self.layout),
        }

    def add_layout(self, layout: dict[str, list[int]]) -> None:
        for kind, (lo, hi) in layout.items():
            was = self.layout.get(kind, [lo, hi])
            self.layout[kind] = [min(was[0], lo), max(was[1], hi)]


def _layout(sp) -> dict[str, list[int]]:
    """A step plan's attention groups: per kind (local, ring, allgather, ulysses), the fewest and
    most units one group of that kind spans."""
    out: dict[str, list[int]] = {}
    for mb in sp.microbatches:
        for g in mb.groups:
            n = len(g.units)
            was = out.get(g.kind, [n, n])
            out[g.kind] = [min(was[0], n), max(was[1], n)]
    return out


#: how a configuration names the groups of each kind
_KIND_NAMES = {"local": "local", "ring": "CP", "allgather": "CP (all-gather)", "ulysses": "SP"}


def layout_text(layout: dict[str, list[int]]) -> str:
    """``CP 16``, ``local + CP 2-8``, ``SP 4``: the groups a planner used, with their sizes in units."""
    parts = []
    for kind in sorted(layout, key=lambda k: list(_KIND_NAMES).index(k) if k in _KIND_NAMES else len(_KIND_NAMES)):
        lo, hi = layout[kind]
        name = _KIND_NAMES.get(kind, kind)
        parts.append(name if kind == "local" else f"{name} {lo}" if lo == hi else f"{name} {lo}-{hi}")
    return " + ".join(parts) or "-"


# ------------------------------------------------------------------ worker side
_W: dict[str, Any] = {}


def _cpu() -> float:
    """CPU seconds of this process and its finished children (solver subprocesses such as CBC)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return time.process_time()
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def _init(ctx: PlanContext, options: dict[str, dict[str, Any]], steps: list[list], keep=frozenset()) -> None:
    """Per worker process, once: the context, planner options and the steps (inherited, not pickled,
    under fork); planners, plan headers and the simulator are built on first use and reused.
    ``keep``: (planner, step) pairs whose plans are sent back."""
    _W.update(ctx=ctx, options=options, steps=steps, sims=None, planners={}, headers={}, keep=keep)


def _max_group_nodes(ctx: PlanContext, sp) -> int:
    """The most nodes any attention group of the plan spans (1: every group stays inside a node)."""
    if sp.replicas is not None:
        node = [ctx.cluster.node_of(r.ranks[0]) for r in sp.replicas]
    else:
        node = [ctx.cost.node_of_unit(u) for u in range(ctx.num_units)]
    return max((len({node[u] for u in g.units}) for mb in sp.microbatches for g in mb.groups), default=1)


def _job(arg: tuple[str, int]) -> tuple[str, int, dict[str, Any]]:
    from zeppelin.planner.core.base import get_planner
    from zeppelin.planner.core.driver import make_header
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.schemas.common import InputError as _IE
    from zeppelin.schemas.plan import SamplerConfig, structural_problems

    name, k = arg
    ctx = _W["ctx"]
    seqs = _W["steps"][k]
    try:
        planner = _W["planners"].get(name)
        if planner is None:
            planner = _W["planners"][name] = get_planner(name, **_W["options"].get(name, {}))
        t0, c0 = time.perf_counter(), _cpu()
        sp = planner.plan_step(ctx, k, seqs)
        lat, plan_cpu = time.perf_counter() - t0, _cpu() - c0
    except _IE as e:
        return name, k, {"error": e.problem if hasattr(e, "problem") else str(e)}
    hkey = (name, len(seqs))
    if hkey not in _W["headers"]:
        _W["headers"][hkey] = make_header(ctx, planner, None, SamplerConfig(seqs_per_step=len(seqs)), 1)
    probs = structural_problems(_W["headers"][hkey], sp, limit=1)
    if probs:
        return name, k, {"error": f"invalid plan: {probs[0]}"}
    if _W["sims"] is None:
        _W["sims"] = Simulator(ctx)
    c1 = time.process_time()
    r = _W["sims"].simulate_step(sp)
    kept = {"plan": sp} if (name, k) in _W.get("keep", ()) else {}
    return name, k, {**kept, "time": r.step_time_s, "lb": r.lower_bound_s, "exposed": r.exposed_comm_s,
                     "sync": r.allreduce_s, "latency": lat,
                     "span_nodes": _max_group_nodes(ctx, sp), "layout": _layout(sp),
                     "predicted": sp.prediction.step_time_s if sp.prediction else r.step_time_s,
                     "plan_cpu": plan_cpu, "sim_cpu": time.process_time() - c1}


# Pool order, longest jobs first so that short ones fill the tail: planners that solve MILPs
# every step, then zeppelin and its ablations (tiering, routing, remap; their simulation models
# every routed transfer), then the static and greedy baselines.
_HEAVY = (*SOLVER_PLANNERS, "zeppelin", "zeppelin-no-routing", "zeppelin-no-remap")


def job_order(planners: list[str], num_steps: int) -> list[tuple[str, int]]:
    """(planner, step) jobs in pool order: heavy planners first, each planner's steps in order (so a
    planner's first failing step is met early and its later steps can be dropped)."""
    rank = {p: (_HEAVY.index(p) if p in _HEAVY else len(_HEAVY)) for p in planners}
    ordered = sorted(planners, key=lambda p: (rank[p], planners.index(p)))
    return [(p, k) for p in ordered for k in range(num_steps)]


def run_compare(ctx: PlanContext, steps: list[list], planners: list[str],
                options: dict[str, dict[str, Any]] | None = None, workers: int = 1,
                progress: bool = False, keep=frozenset()) -> list[PlannerRun]:
    """Plan and simulate every (planner, step); a planner that fails on any step is reported failed
    (at its first failing step; its steps after a failure are not run). The plans of the
    (planner, step) pairs in ``keep`` come back in :attr:`PlannerRun.plans`."""
    keep = frozenset(keep)
    from zeppelin.planner.core.base import get_planner

    modes = {p: get_planner(p).recompute_mode(ctx.recompute) for p in planners}  # unknown names fail here
    options = options or {}
    jobs = job_order(planners, len(steps))
    note = Progress(len(jobs)) if progress else None
    runs = {p: PlannerRun(p, recompute=modes[p]) for p in planners}
    for p, given in options.items():
        if p in runs:
            runs[p].options = dict(given)
    out: dict[tuple[str, int], dict] = {}
    failed_at: dict[str, int] = {}  # planner -> smallest failing step seen so far
    if workers <= 1 or len(jobs) <= 1:
        _init(ctx, options, steps, keep)
        for name, k in jobs:
            if name in failed_at:
                continue
            out[(name, k)] = res = _job((name, k))[2]
            if note is not None:
                note.tick(name, k)
            if "error" in res:
                failed_at[name] = k
    else:
        import multiprocessing as mp
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=mp.get_context(method),
                                 initializer=_init, initargs=(ctx, options, steps, keep)) as ex:
            futs = {ex.submit(_job, j): j for j in jobs}
            pending = set(futs)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    if f.cancelled():
                        continue
                    name, k, res = f.result()
                    out[(name, k)] = res
                    if note is not None:
                        note.tick(name, k)
                    if "error" in res and k < failed_at.get(name, len(steps)):
                        failed_at[name] = k
                        # steps after the first failure cannot change the report: drop the queued ones
                        for g in pending:
                            if futs[g][0] == name and futs[g][1] > k:
                                g.cancel()
    if note is not None:
        note.close()
    for p in planners:
        run = runs[p]
        for k in range(len(steps)):
            res = out[(p, k)]  # every step up to a planner's first failure has run
            if "error" in res:
                run.error = f"step {k}: {res['error']}"
                break
            run.step_times.append(res["time"])
            run.lower_bounds.append(res["lb"])
            run.exposed.append(res["exposed"])
            run.sync.append(res["sync"])
            run.span_nodes.append(res.get("span_nodes", 1))
            run.latencies.append(res["latency"])
            run.predicted.append(res["predicted"])
            run.plan_cpu.append(res["plan_cpu"])
            run.sim_cpu.append(res["sim_cpu"])
            run.add_layout(res["layout"])
            if "plan" in res:
                run.plans[k] = res["plan"]
    return [runs[p] for p in planners]


class Progress:
    """Progress of a long run on stderr: nothing for the first seconds; then, on a terminal, one line
    rewritten in place, elsewhere a line every few seconds."""

    QUIET_S = 2.0

    def __init__(self, total: int, what: str = "steps done"):
        import sys

        self.total, self.what, self.done = total, what, 0
        self.t0 = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.shown = False

    def tick(self, planner: str, step: int) -> None:
        import sys

        self.done += 1
        now = time.perf_counter()
        if now - self.t0 < self.QUIET_S or now - self.last < (0.2 if self.tty else 5.0):
            return
        self.last, self.shown = now, True
        line = (f"compare: {self.done}/{self.total} {self.what} (last: {planner} step {step}), "
                f"{now - self.t0:.0f} s")
        print(("\r" + line + "\x1b[K") if self.tty else line, end="" if self.tty else "\n", file=sys.stderr,
              flush=True)

    def close(self) -> None:
        import sys

        if self.shown and self.tty:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)


#: the spread of a speedup over the sampled steps: these percentiles of the per-step ratios
SPREAD = (10, 90)


def step_ratios(ref_times: list[float], times: list[float]) -> list[float]:
    """Per step, the reference's step time over the planner's (the same sampled steps)."""
    return [float(r) / float(t) for r, t in zip(ref_times, times)]


def spread(ratios: list[float]) -> tuple[float, float]:
    """The :data:`SPREAD` percentiles of per-step ratios (linear interpolation between steps)."""
    lo, hi = np.percentile(np.asarray(ratios, dtype=np.float64), SPREAD)
    return float(lo), float(hi)


def comparison(runs: list[PlannerRun], reference: str = "te-cp",
               also: tuple[str, ...] = ("te-cp-tuned",)) -> dict[str, Any]:
    """Per-planner statistics plus speedups over ``reference``, over each planner of ``also``
    (when it ran) and over the best other baseline. A speedup is the ratio of mean step times; beside
    it, the per-step ratios over the same sampled steps and their p10 / p90 (``..._p10``, ``..._p90``)."""
    stats = [r.stats() for r in runs]
    by = {s["planner"]: s for s in stats}
    doc: dict[str, Any] = {"planners": stats, "reference": reference,
                           "references": [reference] + [a for a in also if a in by and a != reference]}
    z = by.get("zeppelin")
    for name in doc["references"]:
        ref = by.get(name)
        ref_mean = ref["mean_s"] if ref and ref.get("error") is None else None
        if not ref_mean:
            continue
        key = name.replace("-", "_")
        for s in stats:
            if s.get("error") is None:
                s["speedup_vs_" + key] = ref_mean / s["mean_s"]
                per = step_ratios(ref["step_times_s"], s["step_times_s"])
                s[f"speedup_vs_{key}_per_step"] = per
                s[f"speedup_vs_{key}_p{SPREAD[0]}"], s[f"speedup_vs_{key}_p{SPREAD[1]}"] = spread(per)
        if z and z.get("error") is None:
            doc["zeppelin_speedup_vs_" + key] = ref_mean / z["mean_s"]
            for q in SPREAD:
                doc[f"zeppelin_speedup_vs_{key}_p{q}"] = z[f"speedup_vs_{key}_p{q}"]
    if z and z.get("error") is None:
        others = [s for s in stats if s.get("error") is None and not s["planner"].startswith("zeppelin")]
        if others:
            best = min(others, key=lambda s: s["mean_s"])
            doc["best_baseline"] = best["planner"]
            doc["zeppelin_speedup_vs_best_baseline"] = best["mean_s"] / z["mean_s"]
            per = step_ratios(best["step_times_s"], z["step_times_s"])
            doc["zeppelin_speedup_vs_best_baseline_per_step"] = per
            doc["zeppelin_speedup_vs_best_baseline_p10"], doc["zeppelin_speedup_vs_best_baseline_p90"] = spread(per)
    return doc


def render_table(doc: dict[str, Any], title: str):
    """The side-by-side table of ``zeppelin compare`` (and of the demo), 80 columns wide: per planner
    the mean and p90 simulated step time, speedups over each reference (te-cp; te-cp-tuned as
    "tuned") with their spread over the steps (p10-p90 of the per-step ratios), ratio to the lower
    bound, exposed communication and planning time per step (the p50 is in the JSON)."""
    from zeppelin.planner.tools.tables import EXPOSED_NOTE, exposed_cell, table

    refs = doc.get("references", [doc["reference"]])
    keys = ["speedup_vs_" + r.replace("-", "_") for r in refs]
    labels = ["vs tuned" if r == "te-cp-tuned" else f"vs {r}" for r in refs]
    t = table(title, ["planner", "mean", "p90", *labels, "x LB", "exposed", "plan"])
    t.columns[0].min_width = max((len(s["planner"]) for s in doc["planners"]), default=7)
    t.columns[0].no_wrap = True
    for c in t.columns[3:3 + len(keys)]:  # a spread "2.12-2.81" is never folded mid-number
        c.no_wrap = True
    failed = []
    for s in doc["planners"]:
        if s.get("error"):
            t.add_row(s["planner"], "[red]failed[/red]", *[""] * (len(refs) + 4))
            failed.append(f"{s['planner']}: {s['error']}")
            continue
        t.add_row(s["planner"], _ms(s["mean_s"]), _ms(s["p90_s"]),
                  *(_speedup_cell(s, k) for k in keys), f"{s['ratio_to_lower_bound']:.2f}",
                  exposed_cell(s.get("exposed_transfers_s", s["exposed_comm_s"]), s.get("exposed_sync_s", 0.0), _ms),
                  f"{s['plan_latency_mean_s'] * 1e3:.0f}")
    lo, hi = SPREAD
    notes = [("mean, p90: simulated step time, ms; " + EXPOSED_NOTE + "; plan: planning time per "
              f"step, ms; vs: ratio of mean step times, below it p{lo}-p{hi} of the per-step ratios; x LB: "
              f"step time / lower bound (docs/CONCEPTS.md)")]
    if "te-cp-tuned" in refs:
        notes.append("tuned: te-cp-tuned")
    notes.append(recompute_note(doc["planners"]))
    if failed:
        notes.append("failed: " + "; ".join(failed))
    if notes:
        t.caption = "; ".join(notes)
    return t


def recompute_note(stats: list[dict[str, Any]]) -> str:
    """Which recomputation each planner ran with: ``recompute: per micro-batch (zeppelin), none
    (te-cp, flexsp)``."""
    by: dict[str, list[str]] = {}
    for s in stats:
        mode = s.get("recompute", "none")
        by.setdefault("per micro-batch" if mode == "per-microbatch" else mode, []).append(s["planner"])
    return "recompute: " + ", ".join(f"{m} ({', '.join(ps)})" for m, ps in by.items())


def _ms(seconds: float) -> str:
    # a tenth of a millisecond only where it is a visible part of the time (it keeps the table in 80 columns)
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def _speedup_cell(s: dict[str, Any], key: str) -> str:
    if key not in s:
        return "-"
    lo, hi = (s.get(f"{key}_p{q}") for q in SPREAD)
    if lo is None or hi is None:
        return f"{s[key]:.2f}x"
    return f"{s[key]:.2f}x\n{lo:.2f}-{hi:.2f}"


def speedup_text(doc: dict[str, Any], reference: str, planner: str = "zeppelin", label: str | None = None) -> str:
    """``2.43x over te-cp (p10-p90 per step 2.10-2.80x)`` from a :func:`comparison` document
    (``reference="best-baseline"``: zeppelin over the best other baseline; ``label`` names it)."""
    key = reference.replace("-", "_")
    label = label or reference
    if planner == "zeppelin":
        mean = doc.get(f"zeppelin_speedup_vs_{key}")
        lo, hi = (doc.get(f"zeppelin_speedup_vs_{key}_p{q}") for q in SPREAD)
    else:
        s = next((x for x in doc["planners"] if x["planner"] == planner), {})
        mean = s.get(f"speedup_vs_{key}")
        lo, hi = (s.get(f"speedup_vs_{key}_p{q}") for q in SPREAD)
    if mean is None:
        return f"no speedup over {label}"
    rng = f" (p{SPREAD[0]}-p{SPREAD[1]} per step {lo:.2f}-{hi:.2f}x)" if lo is not None and hi is not None else ""
    return f"{mean:.2f}x over {label}{rng}"


def prediction_error(profile, given: bool) -> dict[str, Any]:
    """What is known of the error of the simulated step times under ``profile``: the step-time
    check ``zeppelin profile`` runs (a few steps planned with the profile and run on the machine it
    measured: ``source.step_time_check``), and how well its kernel curves fit their own
    measurements. Preset curves carry no check: their step-time error is unknown.
    ``given``: the profile came from ``--profile`` (else the preset curves)."""
    fit_errors = [f.rel_error_median for mf in profile.fits
                  for f in (mf.attention, mf.linear, mf.attention_block, mf.head, *mf.ring_attention.values())
                  if f is not None and f.rel_error_median is not None]
    src = profile.source
    label = (f"measured on {src.machine or 'an unnamed machine'}" + (f" at {src.created_at}" if src.created_at else "")
             if src.kind == "measured" else "preset curves")
    chk = src.step_time_check
    return {"profile": label, "given": given, "measured": src.kind == "measured",
            "step_time_error": None if chk is None else chk.median_error,
            "step_time_error_worst": None if chk is None else chk.worst_error,
            "step_time_error_steps": None if chk is None else chk.steps,
            "kernel_fit_rel_error_median_worst": max(fit_errors) if fit_errors else None}


def prediction_error_text(err: dict[str, Any]) -> str:
    """One line for :func:`prediction_error`."""
    fit = err["kernel_fit_rel_error_median_worst"]
    fits = (f"; its kernel curves fit their measurements within {fit:.1%} (median, worst curve)"
            if fit is not None else "")
    if err.get("step_time_error") is not None:
        return (f"prediction error of these step times: measured {err['step_time_error']:+.1%} (median of measured / "
                f"predicted - 1 over {err['step_time_error_steps']} steps run when the profile was taken, worst "
                f"{err['step_time_error_worst']:.1%}; profile {err['profile']}){fits}")
    return (f"prediction error of these step times: unknown for this profile ({err['profile']}): it records "
            f"no measured step-time error{fits}; `zeppelin profile` measures it, `zeppelin run --report` "
            f"measures it for a plan")


def draw_png(doc: dict[str, Any], title: str, path) -> None:
    """Bar charts: mean step time (whiskers: the fastest and the slowest step) and speedup over the
    reference (whiskers: the p10-p90 of the per-step ratios); planners that failed are named under
    the charts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zeppelin.planner.tools.show import save_png

    ok = [s for s in doc["planners"] if not s.get("error")]
    names = [s["planner"] for s in ok]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.6))
    mean = np.array([s["mean_s"] * 1e3 for s in ok])
    lo = mean - np.array([min(s["step_times_s"], default=s["mean_s"]) * 1e3 for s in ok])
    hi = np.array([max(s["step_times_s"], default=s["mean_s"]) * 1e3 for s in ok]) - mean
    colors = ["#d62728" if n.startswith("zeppelin") else "#1f77b4" for n in names]
    a1.bar(names, mean, color=colors, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], capsize=3)
    a1.set_ylabel("simulated step time, ms")
    a1.set_title("bars: mean; whiskers: fastest..slowest step", fontsize=9)
    key = "speedup_vs_" + doc["reference"].replace("-", "_")
    sp = np.array([s.get(key, 0.0) for s in ok])
    lo_q, hi_q = SPREAD
    lo = sp - np.array([s.get(f"{key}_p{lo_q}", v) for s, v in zip(ok, sp)])
    hi = np.array([s.get(f"{key}_p{hi_q}", v) for s, v in zip(ok, sp)]) - sp
    a2.bar(names, sp, color=colors, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], capsize=3)
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set_ylabel(f"speedup over {doc['reference']}")
    a2.set_title(f"ratio of mean step times; whiskers: p{lo_q}..p{hi_q} per step", fontsize=9)
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=45)
        for lab in ax.get_xticklabels():
            lab.set_ha("right")
    fig.suptitle(title, fontsize=10)
    failed = [s["planner"] for s in doc["planners"] if s.get("error")]
    fig.tight_layout(rect=(0, 0.05 if failed else 0, 1, 1))
    if failed:
        fig.text(0.01, 0.01, f"not shown, failed to plan these steps: {', '.join(failed)} (the table says why)",
                 fontsize=9, color="#d62728")
    save_png(fig, path, dpi=100)


def setting(ctx: PlanContext, dataset: str, steps: int, sampler) -> dict[str, Any]:
    """What a comparison was made for (the top-level fields of ``compare --json``)."""
    return {"cluster": ctx.cluster.name, "world_size": ctx.cluster.world_size, "model": ctx.model.name, "tp": ctx.tp,
            "zero_stage": ctx.zero_stage, "recompute": ctx.recompute, "dataset": dataset, "steps": steps,
            "tokens_per_step": sampler.tokens_per_step, "seqs_per_step": sampler.seqs_per_step}


def compare_title(ctx: PlanContext, manifest: str | None, steps: int, sampler) -> str:
    """The title of ``compare``'s table: the setting, the data and the step budget."""
    cl = ctx.cluster
    memory = "" if (ctx.zero_stage, ctx.recompute) in ((1, "none"), (1, "auto")) else \
        f", ZeRO-{ctx.zero_stage}, recompute {ctx.recompute}"
    budget = (f"{sampler.tokens_per_step:,} tokens" if sampler.tokens_per_step is not None
              else f"{sampler.seqs_per_step:,} sequences")
    return (f"{cl.name} ({cl.world_size} GPUs), {ctx.model.name}, tp={ctx.tp}{memory}, "
            f"{manifest or 'the shipped sample'}, {steps} steps of {budget}")


def default_workers() -> int:
    return max(1, os.cpu_count() or 1)


# ------------------------------------------------------------------ the verdict: what zeppelin buys
#: each baseline planner and the real system it stands for (docs/CONCEPTS.md has the full table)
BASELINE_SYSTEMS = {
    "packed-dp": "plain packing, DP only",
    "te-cp": "TransformerEngine / Megatron CP",
    "te-cp-tuned": "TE CP, size tuned per step",
    "llama3-cp": "Llama 3 all-gather CP",
    "ulysses": "DeepSpeed-Ulysses",
    "hybrid-dp": "FLOP-balanced hybrid DP",
    "megatron-dcp": "Megatron dynamic CP",
    "flexsp": "FlexSP",
    "hydraulis": "Hydraulis",
    "usp": "long-context-attention USP (Ulysses x ring)",
}


def _where(s: dict[str, Any], allreduce_s: float) -> dict[str, float]:
    """A planner's mean step in four parts that add up to it: its gradient sync and exposed transfers
    (the two parts of the table's exposed communication, the same figures), the compute of the step's
    lower bound (the bound without its gradient all-reduce, ``allreduce_s``) and the rest, compute
    imbalance and idle waiting (none where the transfers already take the step past its bound)."""
    step = s["mean_s"]
    sync = s.get("exposed_sync_s", allreduce_s)
    transfers = s.get("exposed_transfers_s", max(s["exposed_comm_s"] - sync, 0.0))
    compute_bound = max(s["lower_bound_mean_s"] - allreduce_s, 0.0)
    imbalance = max(step - compute_bound - sync - transfers, 0.0)
    return {"step_s": step, "compute_s": step - sync - transfers - imbalance, "sync_s": sync,
            "exposed_transfers_s": transfers, "imbalance_s": imbalance,
            "lower_bound_s": s["lower_bound_mean_s"], "sync_beyond_bound_s": max(sync - allreduce_s, 0.0)}


def verdict(doc: dict[str, Any], ctx: PlanContext, steps: list[list], baseline: str | None = None) -> dict[str, Any]:
    """What zeppelin buys over each baseline of ``doc`` (a :func:`comparison`): the ratio of mean step
    times with its p10-p90 over the sampled steps, the system each baseline stands for, the
    assumptions (the cost profile and its known error), and where the time goes (lower bound,
    exposed communication, imbalance; the memory that forces splitting). ``baseline`` leads."""
    by = {s["planner"]: s for s in doc["planners"]}
    z = by.get("zeppelin")
    out: dict[str, Any] = {"baseline": baseline, "rows": [], "where": {}}
    if z is None or z.get("error"):
        out["problem"] = "zeppelin did not plan these steps" + (f" ({z['error']})" if z else "")
        return out
    names = [s["planner"] for s in doc["planners"] if not s["planner"].startswith("zeppelin") and not s.get("error")]
    if baseline in names:
        names.remove(baseline)
        names.insert(0, baseline)
    for name in names:
        b = by[name]
        lo, hi = spread(step_ratios(b["step_times_s"], z["step_times_s"]))
        out["rows"].append({"baseline": name, "system": BASELINE_SYSTEMS.get(name, name),
                            "speedup": b["mean_s"] / z["mean_s"], f"p{SPREAD[0]}": lo, f"p{SPREAD[1]}": hi,
                            "layout": layout_text(b.get("layout", {})),
                            "options": _set_options(name, b.get("options", {}))})
    out["setting"] = {"tp": ctx.tp, "zero_stage": ctx.zero_stage, "recompute": ctx.recompute}
    if baseline is not None and baseline not in names and (by.get(baseline) or {}).get("error"):
        out["baseline_error"] = by[baseline]["error"]  # the baseline named could not plan these steps
    ref = baseline if baseline in names else ("te-cp" if "te-cp" in names else names[0] if names else None)
    ar = float(ctx.cost.step_collectives_time(1, ctx.num_units))
    for name in ["zeppelin", *([ref] if ref else [])]:
        out["where"][name] = _where(by[name], ar)
    cap = int(ctx.cost.token_capacity)
    longest = max((s.length for seqs in steps for s in seqs), default=0)
    out["memory"] = {"tokens_per_gpu": cap, "longest_sequence": longest,
                     "gpus_to_hold_longest": -(-longest // cap) if cap > 0 else None}
    out["assumptions"] = doc.get("prediction_error") or {}
    if ctx.model.is_moe:
        out["moe"] = {"experts": ctx.model.num_experts, "top_k": ctx.model.experts_per_token}
    return out


def _set_options(planner: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of ``planner`` that are not at their default (what the user set)."""
    from zeppelin.planner.core.base import PLANNERS

    specs = {s.name: s for s in PLANNERS[planner].Options.specs()} if planner in PLANNERS else {}
    return {k: v for k, v in options.items() if k not in specs or specs[k].default != v}


def _value_text(v: Any) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else f"{v:g}" if isinstance(v, float) else str(v)


def configuration_lines(v: dict[str, Any], width: int = 80) -> list[str]:
    """Each baseline as it ran: the groups it split sequences into (CP / SP sizes in units) and the
    options set, after the setting every planner shared (tp, ZeRO stage, recompute)."""
    import textwrap

    s = v.get("setting")
    if not s or not v["rows"]:
        return []
    items = []
    for r in v["rows"]:
        opts = ", ".join(f"{k}={_value_text(x)}" for k, x in r["options"].items())
        items.append(f"{r['baseline']} {r['layout']}" + (f" ({opts})" if opts else ""))
    text = (f"as run (tp={s['tp']}, ZeRO-{s['zero_stage']}, recompute {s['recompute']}; sizes in units): "
            + "; ".join(items))
    return textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False)


def verdict_lines(v: dict[str, Any]) -> list[str]:
    """The verdict as the few lines (each under 80 columns) ``compare`` and the demo print under the table."""
    if "problem" in v:
        return [f"verdict: none - {v['problem']}"]
    lo_q, hi_q = SPREAD
    lines = [f"verdict: zeppelin's speedup per baseline (ratio of mean step times; p{lo_q}-p{hi_q})"]
    width = max((len(r["baseline"]) for r in v["rows"]), default=8)
    for r in v["rows"]:
        mine = "  (yours)" if r["baseline"] == v["baseline"] else ""
        lines.append(f"  {r['speedup']:5.2f}x  {r[f'p{lo_q}']:.2f}-{r[f'p{hi_q}']:.2f}  {r['baseline']:<{width}}  "
                     f"{r['system']}{mine}")
    if v.get("baseline_error"):
        import textwrap

        lines += textwrap.wrap(f"{v['baseline']} (yours) could not plan these steps: {v['baseline_error']}", 78,
                               initial_indent="  ", subsequent_indent="    ")
    lines += configuration_lines(v)
    a = v.get("assumptions") or {}
    if a.get("given"):
        lines.append("assumes: " + prediction_error_text(a))
    elif a:
        fit = a.get("kernel_fit_rel_error_median_worst")
        err = (f" (kernel curves fit within {fit:.1%})" if fit is not None else "")
        lines.append(f"assumes: cost profile {a['profile']}{err}")
        lines.append("  its step-time error is not measured: `zeppelin run --report` measures it")
    if v.get("moe"):
        from zeppelin.planner.tools.explain import moe_note

        lines += moe_note(v["moe"]["experts"], v["moe"]["top_k"])
    if v["where"]:
        lines.append("where the time goes, ms per step = compute + gradient sync + exposed transfers")
        lines.append("  + imbalance (sync + transfers = the table's exposed; +N%: over the bound):")
        width = max(len(n) for n in v["where"])
        for name, w in v["where"].items():
            lost = w["step_s"] - w["lower_bound_s"]
            parts = {"transfers": w["exposed_transfers_s"], "imbalance": w["imbalance_s"],
                     "sync": w.get("sync_beyond_bound_s", 0.0)}
            why = ("at the bound" if lost < 0.02 * w["step_s"] else
                   f"+{lost / w['step_s']:.0%}: " + max(parts, key=parts.get))
            lines.append(f"  {name:<{width}}  {_ms(w['step_s'])} = {_ms(w['compute_s'])} + {_ms(w['sync_s'])} + "
                         f"{_ms(w['exposed_transfers_s'])} + {_ms(w['imbalance_s'])}  ({why})")
    m = v.get("memory")
    if m and m["gpus_to_hold_longest"]:
        lines.append(f"memory: a GPU holds {m['tokens_per_gpu']:,} tokens; the longest sequence "
                     f"({m['longest_sequence']:,}) needs {m['gpus_to_hold_longest']} GPU(s)")
    return lines
