"""Measured vs predicted step and phase times of a `zeppelin run` (``zeppelin run --report``).

The runtime writes one metrics record per step (JSON Lines, rank 0): per rank and per phase the
measured wall time (:func:`zeppelin.runtime.train.metrics.metrics_record`). This module predicts the
same steps of the same plan with the event-driven simulator (:mod:`zeppelin.planner.sim.simulate`)
under the plan's own cost profile, and lines the two up.

Phases (the slowest rank / unit of each, except where said):

==================  ==========================================  =========================================
phase               measured (runtime)                          predicted (simulator, per unit)
==================  ==========================================  =========================================
``attention``       attention regions, fwd + bwd, including     per layer: time from the layer's start to
                    waits for ring / Ulysses transfers          the unit's last attention kernel (ring
                                                                waits included), x layers
``remap``           the remap all-to-alls (fwd + bwd)           per layer: what is left of the unit's
                                                                layer after attention and its linear
                                                                modules (exposed remap transfers), x layers
``linear``          forward + backward minus the two above      linear modules x layers + embedding,
                    (linear modules, norms, embedding, head)    LM head and loss
``grad_allreduce``  the gradient all-reduce of the rank that    ``CostModel.grad_allreduce_time``
                    arrived last (the *fastest* measured rank
                    time: the others also wait for stragglers)
``optimizer``       the AdamW step                              ``CostModel.optimizer_time`` (profiled)
``step``            the slowest rank's step                     simulated step + optimizer
==================  ==========================================  =========================================

Relative error is ``(predicted - measured) / measured``; the summary gives the median and the
worst absolute relative error of the predicted step time over the steps, and its mean (signed:
positive = the prediction is pessimistic).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from zeppelin.schemas.common import InputError

PHASES = ("attention", "remap", "linear", "grad_allreduce", "optimizer", "step")
PREDICTOR = "simulator"


# --------------------------------------------------------------------------------------------- I/O
def load_metrics(path: str | Path, skip: int = 0) -> list[dict[str, Any]]:
    """Metrics records of ``path`` (JSON Lines) after the first ``skip`` lines; a record of the
    same step seen twice (a resumed run appends) keeps the later one."""
    path = Path(path)
    if not path.is_file():
        raise InputError("metrics file not found", source=path)
    recs: dict[int, dict[str, Any]] = {}
    with path.open() as fh:
        for i, line in enumerate(fh):
            if i < skip or not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"line {i + 1} is not JSON ({e.msg})", source=path) from None
            if not isinstance(rec, dict) or "step" not in rec or "phases_s" not in rec:
                raise InputError(f"line {i + 1} is not a zeppelin run metrics record", source=path)
            recs[int(rec["step"])] = rec
    return [recs[k] for k in sorted(recs)]


def count_lines(path: str | Path) -> int:
    p = Path(path)
    if not p.is_file():
        return 0
    with p.open() as fh:
        return sum(1 for _ in fh)


# ------------------------------------------------------------------------------------ measured
def measured_phases(rec: dict[str, Any]) -> dict[str, float]:
    ph = rec["phases_s"]

    def agg(name: str, fn) -> float:
        v = ph.get(name) or [0.0]
        return float(fn(v))

    return {
        "attention": agg("attention", max),
        "remap": agg("remap", max),
        "linear": agg("linear", max),
        "grad_allreduce": agg("grad_allreduce", min),
        "optimizer": agg("optimizer", max),
        "step": float(rec.get("step_time_s") or agg("step", max)),
    }


# ----------------------------------------------------------------------------------- predicted
class Predictor:
    """Per-phase prediction of plan steps with the simulator (built once per plan header)."""

    def __init__(self, header, tp_overlap: str | None = None):
        from zeppelin.planner.sim.simulate import Simulator, context_from_header

        if tp_overlap is not None and tp_overlap != header.tp_overlap:
            header = header.model_copy(update={"tp_overlap": tp_overlap})
        self.header = header
        self.ctx = context_from_header(header)
        self.sim = Simulator(self.ctx)
        self.cost = self.ctx.cost

    def memory_model(self, step, rec: dict[str, Any]):
        """The cost model of the unit of the rank measuring the most memory in ``rec`` (its TP
        degree), or None when the record has no memory."""
        mem = rec.get("memory")
        if not isinstance(mem, dict) or not mem.get("measured_bytes"):
            return None
        measured = mem["measured_bytes"]
        r = max(range(len(measured)), key=lambda i: measured[i])
        for rep in self.header.replicas(step):
            if r in rep.ranks:
                return self.ctx.cost_for(rep.tp)
        return self.cost

    def phases(self, step) -> dict[str, float]:
        r = self.sim.simulate_step(step, timeline=True)
        n = len(r.units)
        L = r.num_layers
        att = np.zeros(n)
        remap = np.zeros(n)
        for mb in r.timeline or []:
            a_end = np.zeros(n)
            fin = np.zeros(n)
            lin = np.zeros(n)
            for iv in mb.intervals:
                u = iv.unit
                fin[u] = max(fin[u], iv.end)
                if iv.lane == "compute":
                    if iv.cat in ("linear", "recompute"):
                        lin[u] += iv.end - iv.start
                    else:
                        a_end[u] = max(a_end[u], iv.end)
                elif iv.cat.startswith("ulysses"):  # the output all-to-all ends the attention
                    a_end[u] = max(a_end[u], iv.end)
            att += L * a_end
            remap += L * np.maximum(fin - a_end - lin, 0.0)
        opt = self.cost.optimizer_time()
        return {
            "attention": float(att.max()) if n else 0.0,
            "remap": float(remap.max()) if n else 0.0,
            "linear": max((u.linear_s for u in r.units), default=0.0),
            "grad_allreduce": float(r.allreduce_s),
            "optimizer": float(opt),
            "step": float(r.step_time_s + opt),
        }


# -------------------------------------------------------------------------------------- report
def rel_error(pred: float, meas: float) -> float | None:
    return (pred - meas) / meas if meas > 0 else None


def error_summary(errors: list[float]) -> dict[str, float | int | None]:
    """Median and worst absolute relative error, and the signed mean (bias)."""
    e = np.array([x for x in errors if x is not None and math.isfinite(x)], dtype=np.float64)
    if e.size == 0:
        return {"steps": 0, "median_abs": None, "worst_abs": None, "mean": None}
    return {"steps": int(e.size), "median_abs": float(np.median(np.abs(e))),
            "worst_abs": float(np.max(np.abs(e))), "mean": float(np.mean(e))}


def build_report(header, steps: dict[int, Any], records: list[dict[str, Any]],
                 tp_overlap: str | None = None) -> dict[str, Any]:
    """The report of ``records`` (metrics) against the plan ``header`` and its ``steps`` (step
    number -> StepPlan). JSON-serialisable."""
    pred = Predictor(header, tp_overlap)
    rows = []
    for i, rec in enumerate(records):
        k = int(rec["step"])
        if k not in steps:
            raise InputError(f"metrics record for step {k}, which the plan does not have")
        m = measured_phases(rec)
        p = pred.phases(steps[k])
        rows.append({
            "step": k,
            "first": i == 0,
            "measured_s": m,
            "predicted_s": p,
            "rel_error": {ph: rel_error(p[ph], m[ph]) for ph in PHASES},
            "plan_prediction_s": (rec.get("predicted") or {}).get("step_time_s"),
            "memory": memory_row(rec, pred.memory_model(steps[k], rec)),
        })
    step_err = [r["rel_error"]["step"] for r in rows]
    by_choice = recompute_summary(pred, steps, records)
    out = {
        "predictor": PREDICTOR,
        "profile": _profile_label(header.profile),
        "tp_overlap": pred.header.tp_overlap,
        "steps": rows,
        "summary": {
            "step": error_summary(step_err),
            # the first step of a run also pays one-time costs (allocator warm-up, first collectives)
            "step_after_first": error_summary(step_err[1:]),
            "phases": {ph: error_summary([r["rel_error"][ph] for r in rows])
                       for ph in PHASES if ph != "step"},
            "memory": memory_summary([r["memory"] for r in rows]),
            "recompute": by_choice,
        },
    }
    return out


def recompute_summary(pred: Predictor, steps: dict[int, Any], records: list[dict[str, Any]]) -> list[dict] | None:
    """Per recomputation choice, over every rank's micro-batches of the records: how many, the
    activation bytes they held (kept for the backward plus one recomputation) measured and as the
    cost model predicts for their tokens under that choice, and their forward and backward time
    measured and predicted (:func:`~zeppelin.planner.costmodel.predict.microbatch_terms`: the
    unit's attention, linear modules, recomputation and exposed communication). None: the records
    have no micro-batches (runs before they were recorded)."""
    from zeppelin.planner.costmodel.predict import microbatch_terms

    acc: dict[str, dict[str, float]] = {}
    for rec in records:
        per_rank = (rec.get("memory") or {}).get("microbatches") or []
        step = steps[int(rec["step"])]
        lengths = [q.length for q in step.sequences]
        unit_of = {r: u for u, rep in enumerate(pred.header.replicas(step)) for r in rep.ranks}
        busy = [microbatch_terms(pred.ctx, lengths, mb).busy for mb in step.microbatches] \
            if step.replicas is None else None
        for r, mbs in enumerate(per_rank):
            u = unit_of.get(r)
            for i, m in enumerate(mbs):
                if u is None or i >= len(step.microbatches):
                    continue
                a = acc.setdefault(m["recompute"], {"microbatches": 0, "measured_bytes": 0.0, "predicted_bytes": 0.0,
                                                    "measured_s": 0.0, "predicted_s": 0.0})
                a["microbatches"] += 1
                a["measured_bytes"] += m["activations"] + m["recompute_bytes"]
                a["predicted_bytes"] += m["tokens"] * pred.cost.recompute_bytes_per_token(m["recompute"])
                a["measured_s"] += m["forward_s"] + m["backward_s"]
                a["predicted_s"] += float(busy[i][u]) if busy is not None else math.nan
    return [{"recompute": k, **v} for k, v in acc.items()] or None


def recompute_table(rows: list[dict]) -> list[str]:
    """The lines ``run --report`` prints for :func:`recompute_summary`."""
    def err(p, m):
        return "-" if not m or not math.isfinite(p) else f"{(p - m) / m:+.1%}"

    lines = ["per recomputation choice, every rank's micro-batches (activations: kept + one recomputation, MB; "
             "forward + backward, ms):",
             f"  {'choice':<12}{'mbs':>5}{'act pred':>10}{'measured':>10}{'error':>8}"
             f"{'time pred':>11}{'measured':>10}{'error':>8}"]
    for r in rows:
        pb, mbytes, ps, ms = r["predicted_bytes"], r["measured_bytes"], r["predicted_s"], r["measured_s"]
        lines.append(f"  {r['recompute']:<12}{r['microbatches']:>5}{pb / 1e6:>10,.2f}{mbytes / 1e6:>10,.2f}"
                     f"{err(pb, mbytes):>8}{ps * 1e3:>11,.1f}{ms * 1e3:>10,.1f}{err(ps, ms):>8}")
    return lines


#: memory components: (name in the metrics record, name in the cost model, label)
MEMORY_ROWS = (("params_bytes", "params", "weights (fp32)"), ("grads_bytes", "grads", "gradients"),
               ("optimizer_bytes", "optimizer", "AdamW moments"), ("unsharded_bytes", "unsharded", "whole weights"),
               ("activation_bytes", "activations", "activations"), ("recompute_bytes", "recompute", "recompute"),
               ("loss_bytes", "loss", "loss gradients"))


def memory_components(mem: dict[str, Any], r: int, predicted: float | None, cost) -> dict[str, Any] | None:
    """Rank ``r``'s measured memory by component beside the cost model's: the plan's predicted
    total fixes the tokens the rank's unit holds, the cost model splits it."""
    if cost is None or predicted is None:
        return None
    measured = {}
    for key, name, _ in MEMORY_ROWS:
        vals = mem.get(key)
        measured[name] = int(vals[r]) if isinstance(vals, list) and r < len(vals) else None
    per_token = cost.activation_bytes_per_token
    tokens = max((predicted - cost.model_state_bytes()) / per_token, 0.0) if per_token > 0 else 0.0
    pred = {k: float(v) for k, v in cost.memory_components(tokens).items()}
    return {"measured": measured, "predicted": pred, "tokens": tokens}


def memory_row(rec: dict[str, Any], cost=None) -> dict[str, Any] | None:
    """The rank measuring the most memory in a metrics record, with the plan's prediction for it
    (and, given the unit's cost model, both by component)."""
    mem = rec.get("memory")
    if not isinstance(mem, dict) or not mem.get("measured_bytes"):
        return None
    measured = mem["measured_bytes"]
    r = max(range(len(measured)), key=lambda i: measured[i])
    pred = (mem.get("predicted_bytes") or [None] * len(measured))[r]
    return {"rank": r, "measured_bytes": measured[r], "predicted_bytes": pred,
            "ratio": (measured[r] / pred) if pred else None,
            "components": memory_components(mem, r, pred, cost),
            "exceeds_capacity": list(mem.get("exceeds_capacity") or []),
            "capacity_bytes": mem.get("capacity_bytes")}


def memory_summary(rows: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    rows = [r for r in rows if r is not None]
    if not rows:
        return None
    ratios = sorted(r["ratio"] for r in rows if r["ratio"] is not None)
    top = max(range(len(rows)), key=lambda i: rows[i]["measured_bytes"])
    return {"peak_measured_bytes": rows[top]["measured_bytes"],
            "peak_step_components": rows[top].get("components"),
            "peak_predicted_bytes": max((r["predicted_bytes"] or 0) for r in rows) or None,
            "median_ratio": ratios[len(ratios) // 2] if ratios else None,
            "steps_exceeding_capacity": [i for i, r in enumerate(rows) if r["exceeds_capacity"]],
            "capacity_bytes": rows[0]["capacity_bytes"]}


def memory_table(comp: dict[str, Any]) -> list[str]:
    """The step measuring the most memory, predicted vs measured by component (MB), as lines of
    at most 80 columns."""
    def mb(x):
        return "-" if x is None else f"{x / 1e6:,.1f}"

    def err(p, m):
        return "-" if not m else f"{(p - m) / m:+.1%}"

    lines = ["memory of the rank measuring the most, by component (MB):",
             f"  {'component':<16}{'predicted':>12}{'measured':>12}{'error':>9}"]
    tot_p = tot_m = 0.0
    for _, name, label in MEMORY_ROWS:
        p, m = comp["predicted"].get(name, 0.0), comp["measured"].get(name)
        tot_p += p
        tot_m += m or 0
        lines.append(f"  {label:<16}{mb(p):>12}{mb(m):>12}{err(p, m):>9}")
    lines.append(f"  {'sum (peak)':<16}{mb(tot_p):>12}{mb(tot_m):>12}{err(tot_p, tot_m):>9}")
    lines.append("  error = (predicted - measured) / measured: + over-predicts, - under (OOM risk)")
    return lines


def report_for_plan(plan_path: str | Path, metrics_path: str | Path, *, skip: int = 0,
                    tp_overlap: str | None = None) -> dict[str, Any]:
    from zeppelin.schemas.plan import PlanReader

    reader = PlanReader(plan_path)
    records = load_metrics(metrics_path, skip=skip)
    if not records:
        raise InputError("no metrics records to report on", source=metrics_path)
    steps = {}
    for rec in records:
        k = int(rec["step"])
        if not 0 <= k < reader.header.num_steps:
            raise InputError(f"metrics record for step {k}, but the plan has {reader.header.num_steps} steps",
                             source=metrics_path)
        steps[k] = reader.step(k)
    return build_report(reader.header, steps, records, tp_overlap)


def _profile_label(profile) -> str:
    src = profile.source
    if src.kind == "measured":
        return f"measured on {src.machine}" + (f" at {src.created_at}" if src.created_at else "")
    return f"preset ({profile.cluster or 'defaults'})"


# ------------------------------------------------------------------------------------- render
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def render(report: dict[str, Any], console=None) -> None:
    """Print the per-step table and the error summary."""
    import numpy as np

    from rich import box
    from rich.console import Console
    from rich.table import Table

    def table(title: str, headers: list[str]) -> Table:
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for i, h in enumerate(headers):
            t.add_column(h, justify="left" if i == 0 else "right")
        return t

    con = console or Console()
    t = table(f"measured vs predicted ({report['predictor']}): step time, ms, slowest rank",
              ["step", "measured", "predicted", "error", "plan estimate"])
    for r in report["steps"]:
        m, p = r["measured_s"], r["predicted_s"]
        t.add_row(str(r["step"]) + ("*" if r["first"] else ""), _ms(m["step"]), _ms(p["step"]),
                  _pct(r["rel_error"]["step"]), _ms(r["plan_prediction_s"]))
    con.print(t)
    # the phases: medians over the steps (each step's phases are in --report-json)
    pt = table("per phase, median over the steps, ms", ["phase", "measured", "predicted", "median |error|"])
    # a phase under 1% of the step: its relative error (of a near-zero time) says nothing
    step_s = float(np.median([r["measured_s"]["step"] for r in report["steps"]])) if report["steps"] else 0.0
    tiny = False
    for ph in PHASES[:-1]:
        meas = [r["measured_s"][ph] for r in report["steps"] if r["measured_s"].get(ph) is not None]
        pred = [r["predicted_s"][ph] for r in report["steps"] if r["predicted_s"].get(ph) is not None]
        e = report["summary"]["phases"].get(ph, {})
        small = bool(meas) and bool(pred) and max(np.median(meas), np.median(pred)) < 0.01 * step_s
        tiny |= small
        pt.add_row(ph.replace("grad_", ""), _ms(float(np.median(meas))) if meas else "-",
                   _ms(float(np.median(pred))) if pred else "-",
                   "(tiny)" if small else f"{e['median_abs']:.0%}" if e.get("steps") else "-")
    con.print(pt)
    if tiny:
        con.print("(tiny): the phase takes under 1% of the step; its relative error is not shown", highlight=False)
    s = report["summary"]["step"]
    con.print("* first step of the run (includes one-time warm-up costs); measured allreduce: the rank that "
              "waited least (the others also wait for stragglers)")
    con.print(f"prediction: {report['predictor']} with the plan's profile ({report['profile']}); "
              f"tp overlap {report['tp_overlap']}")
    if s["steps"]:
        line = (f"predicted step time: relative error median {s['median_abs']:.1%}, "
                f"worst {s['worst_abs']:.1%}, mean {s['mean']:+.1%} over {s['steps']} step(s)")
        a = report["summary"]["step_after_first"]
        if a["steps"]:
            line += f"; without the first step: median {a['median_abs']:.1%}, worst {a['worst_abs']:.1%}"
        con.print(line)
    mem = report["summary"].get("memory")
    if mem:
        line = f"memory per GPU: measured peak {mem['peak_measured_bytes'] / 1e9:.3f} GB"
        if mem["peak_predicted_bytes"]:
            line += f", predicted {mem['peak_predicted_bytes'] / 1e9:.3f} GB"
        if mem["median_ratio"] is not None:
            line += f" (measured / predicted, median over steps: {mem['median_ratio']:.2f})"
        con.print(line)
        if mem.get("peak_step_components"):
            for line in memory_table(mem["peak_step_components"]):
                con.print(line, highlight=False)
        if report["summary"].get("recompute"):
            for line in recompute_table(report["summary"]["recompute"]):
                con.print(line, highlight=False)
        if mem["steps_exceeding_capacity"]:
            steps = [report["steps"][i]["step"] for i in mem["steps_exceeding_capacity"]]
            con.print(f"[bold red]steps exceeding the {mem['capacity_bytes'] / 1e9:g} GB per GPU of the plan's "
                      f"cluster (measured): {', '.join(map(str, steps))}[/]")
