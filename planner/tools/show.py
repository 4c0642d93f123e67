"""``zeppelin show``: a plan step rendered for a person, and its PNG (Gantt timeline + load heat-map)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from zeppelin.planner.sim.simulate import SimResult
from zeppelin.schemas.io.safefiles import atomic_write
from zeppelin.schemas.plan import PlanHeader, Prediction, StepPlan

__all__ = ["DETAIL_MAX_UNITS", "draw_demo_png", "draw_png", "gantt", "group_rows", "load_heatmap", "load_rows",
           "render_step", "step_prediction", "summary_boxes", "timeline_boxes", "unit_totals_ms"]

_BAR = 40


def step_prediction(header: PlanHeader, step: StepPlan) -> Prediction:
    """The plan's own prediction, or the analytic one when the plan carries none."""
    if step.prediction is not None:
        return step.prediction
    from zeppelin.planner.costmodel.predict import predict_step
    from zeppelin.planner.sim.simulate import context_from_header

    return predict_step(context_from_header(header), step)


def group_rows(step: StepPlan, nodes: list | None = None) -> list[dict]:
    """One row per group with placements: micro-batch, tier, kind, units, sequences (index:length).
    ``nodes``: per unit, the nodes its ranks sit on (:func:`~zeppelin.planner.sim.summary.unit_nodes`):
    the tier is then the span of the group's units, as every summary counts it; without, the label."""
    from zeppelin.planner.sim.summary import span_of_units

    rows = []
    for mbi, mb in enumerate(step.microbatches):
        seqs: dict[int, list[int]] = defaultdict(list)
        for p in mb.placements:
            seqs[p.group].append(p.seq)
        for gi, g in enumerate(mb.groups):
            if gi not in seqs:
                continue
            ss = sorted(seqs[gi], key=lambda i: -step.sequences[i].length)
            tier = span_of_units(nodes, g.units) if nodes is not None else g.tier
            rows.append({"microbatch": mbi, "group": gi, "tier": tier, "kind": g.kind, "units": list(g.units),
                         "sequences": [(i, step.sequences[i].length) for i in ss],
                         "tokens": sum(step.sequences[i].length for i in ss)})
    order = {"inter": 0, "intra": 1, "local": 2}
    rows.sort(key=lambda r: (r["microbatch"], order[r["tier"]], r["group"]))
    return rows


def load_rows(pred: Prediction) -> list[tuple[int, float, float, float, float, int]]:
    """(unit, attention, linear, exposed comm, total, tokens) per unit."""
    pu = pred.per_unit
    return [(u, pu.attention_s[u], pu.linear_s[u], pu.exposed_comm_s[u], pu.total_s[u], pu.tokens[u])
            for u in range(len(pu.total_s))]


def _units_text(units: list[int]) -> str:
    if len(units) > 2 and units == list(range(units[0], units[0] + len(units))):
        return f"{units[0]}-{units[-1]}"
    if len(units) > 12:
        return ",".join(map(str, units[:12])) + f",... ({len(units)})"
    return ",".join(map(str, units))


def _runs_text(units: list[int]) -> str:
    """Ascending units as runs: ``0-11,20-23,30``."""
    runs: list[list[int]] = []
    for u in units:
        if runs and u == runs[-1][1] + 1:
            runs[-1][1] = u
        else:
            runs.append([u, u])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _seqs_text(seqs: list[tuple[int, int]], limit: int = 8) -> str:
    txt = " ".join(f"#{i}:{n}" for i, n in seqs[:limit])
    if len(seqs) > limit:
        txt += f" ... (+{len(seqs) - limit})"
    return txt


def render_step(header: PlanHeader, step: StepPlan, console, sim=None, full: bool = False):
    """Print the step: groups by tier, the step's counts (:mod:`zeppelin.planner.sim.summary`), per-unit
    load bars, NIC loads with and without routing (the simulator's flows), remap volume.
    ``sim``: a :class:`Simulator` for the plan (reused across steps). ``full``: every group and unit
    (else one screen: local groups summed per micro-batch, the most and least loaded units). Returns
    the step's :class:`~zeppelin.planner.sim.summary.PlanSummary`."""
    from zeppelin.planner.sim.summary import step_summary, summary_lines, unit_nodes
    from zeppelin.planner.tools.tables import table

    if sim is None:
        from zeppelin.planner.sim.simulate import Simulator, context_from_header

        sim = Simulator(context_from_header(header))
    counts = step_summary(sim.ctx, step, sim)

    pred = step_prediction(header, step)
    lengths = [s.length for s in step.sequences]
    msg = (f"[bold]step {step.step}[/bold]: {len(lengths)} sequences, {sum(lengths)} tokens "
           f"(longest {max(lengths)}), {len(step.microbatches)} micro-batch(es); predicted "
           f"{pred.step_time_s * 1e3:.2f} ms, lower bound {pred.lower_bound_s * 1e3:.2f} ms")
    if pred.lower_bound_s > 0:
        msg += f" (x{pred.step_time_s / pred.lower_bound_s:.2f})"
    console.print(msg)

    groups = group_rows(step, unit_nodes(sim.ctx, step))
    if not full:
        groups = summarised_groups(groups)
    t = table("groups by tier" + ("" if full else " (local groups summed per micro-batch; --all lists each)"),
              [(c, "left" if c.startswith("seq") else "right")
               for c in ("mb", "tier", "kind", "units", "seqs", "tokens", "sequences (#index:length)")])
    for r in groups:
        t.add_row(str(r["microbatch"]), r["tier"], r["kind"], r.get("units_text") or _units_text(r["units"]),
                  str(r.get("count", len(r["sequences"]))), str(r["tokens"]),
                  r.get("seqs_text") or _seqs_text(r["sequences"]))
    console.print(t)
    for line in summary_lines(counts):
        console.print(line, highlight=False)
    tps = [r.tp for r in step.replicas] if step.replicas is not None else None
    console.print(load_table(pred, full, tps=tps))
    routed = counts.nic_bytes()
    if routed:
        # the same step with every transfer on its ranks' own NICs: what routing saves
        direct = step.model_copy(update={"microbatches": [mb.model_copy(update={"routes": []})
                                                           for mb in step.microbatches]})
        unrouted: dict[str, float] = defaultdict(float)
        for per in sim.nic_traffic(direct).values():
            for k, b in per.items():
                unrouted[k] += b
        nt = table("NIC load per step (GB sent + received)",
                   [(c, "right") for c in ("NIC", "with routing", "without routing")])
        nics = sorted(set(routed) | set(unrouted))
        if not full and len(nics) > 8:  # one screen: the busiest (with routing) first
            nics = sorted(nics, key=lambda k: -routed.get(k, 0.0))[:8]
            nt.title += f": the 8 busiest of {len(set(routed) | set(unrouted))} (--all: each)"
        for k in nics:
            nt.add_row(k, f"{routed.get(k, 0.0) / 1e9:.3f}", f"{unrouted.get(k, 0.0) / 1e9:.3f}")
        r_max = max(routed.values(), default=0.0)
        u_max = max(unrouted.values(), default=0.0)
        nt.caption = f"busiest NIC: {r_max / 1e9:.3f} GB routed, {u_max / 1e9:.3f} GB unrouted"
        console.print(nt)
    else:
        console.print("NIC load: no inter-node traffic in this step")
    remaps = []
    for mbi, mb in enumerate(step.microbatches):
        rm = mb.remap
        if rm.enabled or mb.linear_layout is not None:
            extra = f", predicted saving {rm.predicted_saving_s * 1e3:.2f} ms" if rm.predicted_saving_s else ""
            remaps.append(f"remap (micro-batch {mbi}): {rm.tokens_moved} tokens moved, {rm.tokens_moved_inter} "
                          f"across nodes{extra}" + (f" - {rm.reason}" if rm.reason else ""))
        elif full:
            remaps.append(f"remap (micro-batch {mbi}): off" + (f" - {rm.reason}" if rm.reason else ""))
    if not full and not remaps:
        remaps.append(f"remap: off in all {len(step.microbatches)} micro-batch(es)")
    for line in remaps + recompute_lines(step):
        console.print(line, highlight=False)
    return counts


def recompute_lines(step: StepPlan) -> list[str]:
    """One line per micro-batch that recomputes: each choice and the units that run it."""
    out = []
    for mbi, mb in enumerate(step.microbatches):
        if not mb.recomputes():
            continue
        n = len(mb.queues)
        if not mb.recompute_units:
            out.append(f"recompute (micro-batch {mbi}): {mb.recompute} on every unit")
            continue
        parts = [f"{m} on unit {us[0]}" if len(us) == 1 else f"{m} on units {_runs_text(us)} ({len(us)})"
                 for m, us in mb.recompute_units.items()]
        rest = n - sum(len(us) for us in mb.recompute_units.values())
        out.append(f"recompute (micro-batch {mbi}): " + "; ".join(parts)
                   + f"; {mb.recompute or 'none'} on the other {rest} of {n}")
    return out


def summarised_groups(rows: list[dict]) -> list[dict]:
    """:func:`group_rows` for one screen: the split groups as they are, the local ones of a micro-batch
    summed in one row (units, sequences, tokens, length range)."""
    out: list[dict] = []
    local: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        (local[r["microbatch"]].append(r) if r["kind"] == "local" else out.append(r))
    for mbi, rs in local.items():
        lens = [n for r in rs for _, n in r["sequences"]]
        out.append({"microbatch": mbi, "group": -1, "tier": "local", "kind": "local", "units": [],
                    "units_text": f"{len(rs)} units", "count": len(lens), "sequences": [],
                    "tokens": sum(r["tokens"] for r in rs), "seqs_text": f"lengths {min(lens)}-{max(lens)}"})
    order = {"inter": 0, "intra": 1, "local": 2}
    out.sort(key=lambda r: (r["microbatch"], order.get(r["tier"], 3), r["group"]))
    return out


def load_table(pred: Prediction, full: bool = False, top: int = 4, tps: list[int] | None = None):
    """Per-unit predicted load bars: every unit with ``full`` or up to 16 units, else the ``top`` most
    and least loaded (with the spread of the rest in the caption). ``tps``: per unit, its TP degree
    (its GPUs), shown in a column when the step's units are replicas of their own degrees."""
    from rich.text import Text

    from zeppelin.planner.tools.tables import table

    rows = load_rows(pred)
    tmax = max((r[4] for r in rows), default=0.0) or 1.0
    shown = rows
    if not full and len(rows) > 16:
        by = sorted(rows, key=lambda r: -r[4])
        shown = by[:top] + by[-top:]
    lt = table("per-unit predicted load (█ attention, ▓ linear, ░ exposed comm)"
               + ("" if shown is rows else f": the {top} most and least loaded of {len(rows)} units (--all: each)"),
               [(c, "left" if c == "load" else "right")
                for c in ("unit", *(("GPUs",) if tps else ()), "tokens", "total ms", "load")])
    for u, a, li, ex, tot, tok in shown:
        bar = Text()
        na = round(a / tmax * _BAR)
        nl = round((a + li) / tmax * _BAR) - na
        ne = round(tot / tmax * _BAR) - na - nl
        bar.append("█" * na, style="cyan")
        bar.append("▓" * max(nl, 0), style="green")
        bar.append("░" * max(ne, 0), style="red")
        lt.add_row(str(u), *((f"{tps[u]} (TP-{tps[u]})",) if tps else ()), str(tok), f"{tot * 1e3:.2f}", bar)
    if rows:
        tot = [r[4] for r in rows]
        lt.caption = (f"all {len(rows)} units: {min(tot) * 1e3:.2f}-{max(tot) * 1e3:.2f} ms (total: attention + "
                      f"linear + exposed comm)")
    return lt


_COLORS = {"attention": "#1f77b4", "linear": "#2ca02c", "ring-intra": "#ff7f0e", "ring-inter": "#d62728",
           "dispatch-intra": "#9467bd", "combine-intra": "#8c564b", "remap-intra": "#e377c2",
           "remap-inter": "#e377c2", "ulysses-intra": "#bcbd22", "ulysses-inter": "#bcbd22",
           "allgather-intra": "#17becf", "allgather-inter": "#17becf", "head": "#7f7f7f", "recompute": "#aec7e8",
           "grad all-reduce": "#000000", "waiting": "#f2b8b5"}

#: above this many units ``--png`` draws each micro-batch of a unit as its layers' time summed per kind
#: (:func:`summary_boxes`): every layer's boxes would be millions of polygons, minutes to draw
DETAIL_MAX_UNITS = 64


def timeline_boxes(result: SimResult) -> tuple[dict[tuple[str, str], list[tuple[float, float, int]]], float]:
    """The step as the model runs it, per unit: every micro-batch's layers one after the other (each
    layer as the simulator timed it; a unit waits only for the units it shares groups with), the
    output head after a micro-batch's last layer, then the gradient all-reduce once every unit is
    done. Returns ``{(category, lane): [(start_s, end_s, unit), ...]}`` and the drawn extent in
    seconds (the simulated step time)."""
    n = len(result.units)
    L = result.num_layers
    boxes: dict[tuple[str, str], list[tuple[float, float, int]]] = defaultdict(list)
    clock = np.zeros(n)
    for mb in result.timeline or []:
        per_unit: dict[int, list] = defaultdict(list)
        for iv in mb.intervals:
            per_unit[iv.unit].append(iv)
        period = mb.unit_period_s or [mb.layer_period_s] * n
        head = mb.head_s or [0.0] * n
        for u in range(n):
            for layer in range(L):
                t0 = clock[u] + layer * period[u]
                for iv in per_unit.get(u, ()):
                    boxes[(iv.cat, iv.lane)].append((t0 + iv.start, t0 + iv.end, u))
            clock[u] += L * period[u]
            if head[u] > 0:
                boxes[("head", "compute")].append((clock[u], clock[u] + head[u], u))
            clock[u] += head[u]
    end = float(clock.max()) if n else 0.0
    if result.allreduce_s > 0:
        for u in range(n):
            boxes[("grad all-reduce", "compute")].append((end, end + result.allreduce_s, u))
    return boxes, end + result.allreduce_s


def summary_boxes(result: SimResult) -> tuple[dict[tuple[str, str], list[tuple[float, float, int]]], float]:
    """:func:`timeline_boxes` at a glance, for large steps: per unit and micro-batch, one box per kind
    of compute holding its time summed over the micro-batch's layers (attention, then linear), then
    ``waiting`` for the rest of the micro-batch's layers (exposed communication and waiting for the
    units it shares groups with), the output head and the gradient all-reduce. Same extent and
    per-unit micro-batch boundaries as the detailed timeline; no communication lane."""
    n = len(result.units)
    L = result.num_layers
    boxes: dict[tuple[str, str], list[tuple[float, float, int]]] = defaultdict(list)
    clock = np.zeros(n)
    for mb in result.timeline or []:
        per: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(n))
        for iv in mb.intervals:
            if iv.lane == "compute":
                per[iv.cat][iv.unit] += iv.end - iv.start
        period = mb.unit_period_s or [mb.layer_period_s] * n
        head = mb.head_s or [0.0] * n
        for u in range(n):
            t, end = clock[u], clock[u] + L * period[u]
            for cat in sorted(per):
                d = L * float(per[cat][u])
                if d > 0:
                    boxes[(cat, "compute")].append((t, t + d, u))
                    t += d
            if end > t:
                boxes[("waiting", "compute")].append((t, end, u))
            if head[u] > 0:
                boxes[("head", "compute")].append((end, end + head[u], u))
            clock[u] = end + head[u]
    end = float(clock.max()) if n else 0.0
    if result.allreduce_s > 0:
        for u in range(n):
            boxes[("grad all-reduce", "compute")].append((end, end + result.allreduce_s, u))
    return boxes, end + result.allreduce_s


def gantt(ax, result: SimResult, title: str, legend: bool = True, xmax_ms: float | None = None,
          summary: bool | None = None) -> float:
    """Per-unit Gantt of a whole simulated step (:func:`timeline_boxes`; compute full height, its
    communication as a thin bar beneath) on ``ax``; returns the drawn extent in ms. ``summary``
    (default: above :data:`DETAIL_MAX_UNITS` units): :func:`summary_boxes` instead."""
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    n = len(result.units)
    if summary is None:
        summary = n > DETAIL_MAX_UNITS
    boxes, extent = summary_boxes(result) if summary else timeline_boxes(result)
    seen = []
    for (cat, lane), spans in boxes.items():
        verts = []
        for x0, x1, u in spans:
            y0, y1 = (u - 0.4, u + 0.15) if lane == "compute" else (u + 0.2, u + 0.4)
            verts.append(((x0 * 1e3, y0), (x0 * 1e3, y1), (x1 * 1e3, y1), (x1 * 1e3, y0)))
        ax.add_collection(PolyCollection(verts, facecolors=_COLORS.get(cat, "#7f7f7f"), edgecolors="none",
                                         alpha=1.0 if lane == "compute" else 0.6))
        if cat not in seen:
            seen.append(cat)
    ax.set_xlim(0, max(xmax_ms or extent * 1e3, 1e-9))
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(0, n, max(1, n // 32)))
    ax.set_xlabel(f"time in the step, ms ({result.num_layers} layers per micro-batch"
                  + (", summed per kind" if summary else "") + ", head, gradient all-reduce)", fontsize=8)
    ax.set_ylabel("unit (data-parallel rank group)")
    ax.set_title(title, fontsize=9)
    handles = [Patch(color=_COLORS.get(c, "#7f7f7f"), label=c) for c in sorted(seen)]
    if handles and legend:
        # under the axis, never over the bars
        # (the pad, in font sizes, clears the tick labels and the axis title whatever the figure's height)
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), borderaxespad=4.2,
                  ncol=min(len(handles), 6), fontsize=7, frameon=False)
    return extent * 1e3


def draw_png(header: PlanHeader, step: StepPlan, result: SimResult, path: str | Path) -> None:
    """Per-unit Gantt of the whole simulated step and a heat-map of unit loads (scale from 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(result.units)
    fig_h = min(max(3.5, 0.18 * n + 2.5), 18.0)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, fig_h), gridspec_kw={"width_ratios": [3, 1.2]})
    summary = n > DETAIL_MAX_UNITS
    gantt(ax, result, f"{header.planner}: step {step.step}, simulated {result.step_time_s * 1e3:,.1f} ms "
                      f"({len(result.timeline or [])} micro-batch(es) x {result.num_layers} layers + head "
                      f"+ all-reduce)" + (f"\nsummary of {n} units: each micro-batch's layers as their time "
                                          f"per kind (every layer drawn up to {DETAIL_MAX_UNITS} units)"
                                          if summary else ""), summary=summary)
    load_heatmap(fig, ax2, result, max(header.cluster.num_nodes, 1))
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def unit_totals_ms(result: SimResult) -> np.ndarray:
    """Per unit, the simulated total the heat-map draws: attention + linear + exposed comm, in ms (the
    quantity of the ``total ms`` column of ``show``'s load table; idle time left out)."""
    return np.array([(s.busy_s + s.exposed_comm_s) * 1e3 for s in result.units])


def load_heatmap(fig, ax, result: SimResult, num_nodes: int) -> None:
    """Total time per unit (:func:`unit_totals_ms`), nodes x units per node, on a colour scale from 0
    (so that a few percent of spread looks like a few percent); the title states the spread."""
    n = len(result.units)
    upn = max(1, n // num_nodes)
    rows = (n + upn - 1) // upn
    grid = np.full((rows, upn), np.nan)
    total = unit_totals_ms(result)
    for u, b in enumerate(total):
        grid[u // upn, u % upn] = b
    top = float(total.max()) if n else 1.0
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(top, 1e-9))
    if rows * upn <= 64:
        for u, b in enumerate(total):
            ax.text(u % upn, u // upn, f"{b:,.0f}", ha="center", va="center", fontsize=6,
                    color="white" if b < 0.6 * top else "black")
    ax.set_xticks(range(0, upn, max(1, upn // 16)))
    ax.set_yticks(range(0, rows, max(1, rows // 32)))
    ax.set_xlabel("unit within node")
    ax.set_ylabel("node")
    lo = float(total.min()) if n else 0.0
    spread = (top - lo) / top if top > 0 else 0.0
    ax.set_title(f"total ms per unit: attention + linear\n+ exposed comm (scale from 0)\n"
                 f"min {lo:,.0f}, max {top:,.0f}: {spread:.1%} spread", fontsize=9)
    fig.colorbar(im, ax=ax, label="total ms (attention + linear + exposed comm)")


def draw_demo_png(timelines: list[tuple[str, SimResult]], speedups: list[tuple[str, float]], xlabel: str,
                  title: str, path: str | Path, spreads: dict[str, tuple[float, float]] | None = None) -> None:
    """The demo's picture: per-unit timelines of one step side by side (same time axis) and the
    ``speedups`` (name, ratio) as bars, labelled ``xlabel``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(r.units) for _, r in timelines)
    fig_h = min(max(3.2, 0.16 * n + 2.4), 12.0)
    widths = [3] * len(timelines) + [2]
    fig, axes = plt.subplots(1, len(timelines) + 1, figsize=(6 * len(timelines) + 4, fig_h),
                             gridspec_kw={"width_ratios": widths})
    xmax = max(r.step_time_s for _, r in timelines) * 1e3  # one time axis: the longer step, whole
    for ax, (label, r) in zip(axes, timelines):
        gantt(ax, r, f"{label}: {r.step_time_s * 1e3:,.0f} ms step ({len(r.timeline or [])} micro-batch"
                     f"{'es' if len(r.timeline or []) != 1 else ''})", xmax_ms=xmax * 1.02)
    ax = axes[-1]
    names = [p for p, _ in speedups]
    vals = [v for _, v in speedups]
    colors = ["#d62728" if p.startswith("zeppelin") else "#1f77b4" for p in names]
    xerr = None
    if spreads:  # whiskers: the spread of the per-step ratios around the ratio of the means
        xerr = [[max(v - spreads.get(p, (v, v))[0], 0.0) for p, v in speedups],
                [max(spreads.get(p, (v, v))[1] - v, 0.0) for p, v in speedups]]
    ax.barh(range(len(names)), vals, color=colors, xerr=xerr, capsize=3 if xerr else 0)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ends = [v + (xerr[1][y] if xerr else 0.0) for y, v in enumerate(vals)]  # labels past the whiskers
    for y, v in enumerate(vals):
        ax.text(ends[y], y, f"  {v:.2f}x", va="center", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_title("ratio of simulated mean step times" + ("\nwhiskers: p10..p90 per step" if xerr else ""), fontsize=9)
    ax.set_xlim(0, max(ends + [1.0]) * 1.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_png(fig, path, dpi=90)


def save_png(fig, path, dpi: int = 100) -> None:
    """Write a matplotlib figure as a PNG file atomically (temporary name, then rename; nothing
    half-written is left behind) and close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_write(path, "wb") as fh:
            fig.savefig(fh, format="png", dpi=dpi)
    finally:
        plt.close(fig)
