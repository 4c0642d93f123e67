"""``zeppelin show``: a plan step rendered for a person, and its PNG (Gantt timeline + load heat-map)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from zeppelin.planner.sim.simulate import SimResult
from zeppelin.schemas.common import atomic_write
from zeppelin.schemas.plan import PlanHeader, Prediction, StepPlan

__all__ = ["draw_demo_png", "draw_png", "gantt", "group_rows", "load_rows", "render_step", "step_prediction"]

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


def _seqs_text(seqs: list[tuple[int, int]], limit: int = 8) -> str:
    txt = " ".join(f"#{i}:{n}" for i, n in seqs[:limit])
    if len(seqs) > limit:
        txt += f" ... (+{len(seqs) - limit})"
    return txt


def render_step(header: PlanHeader, step: StepPlan, console, sim=None):
    """Print the step: groups by tier, the step's counts (:mod:`zeppelin.planner.sim.summary`), per-unit
    load bars, NIC loads with and without routing (the simulator's flows), remap volume.
    ``sim``: a :class:`Simulator` for the plan (reused across steps). Returns the step's
    :class:`~zeppelin.planner.sim.summary.PlanSummary`."""
    from rich.text import Text

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

    t = table("groups by tier", [(c, "left" if c.startswith("seq") else "right")
                                 for c in ("mb", "tier", "kind", "units", "seqs", "tokens", "sequences (#index:length)")])
    for r in group_rows(step, unit_nodes(sim.ctx, step)):
        t.add_row(str(r["microbatch"]), r["tier"], r["kind"], _units_text(r["units"]), str(len(r["sequences"])),
                  str(r["tokens"]), _seqs_text(r["sequences"]))
    console.print(t)
    for line in summary_lines(counts):
        console.print(line, highlight=False)

    rows = load_rows(pred)
    tmax = max((r[4] for r in rows), default=0.0) or 1.0
    lt = table("per-unit predicted load (█ attention, ▓ linear, ░ exposed comm)",
               [(c, "left" if c == "load" else "right") for c in ("unit", "tokens", "total ms", "load")])
    for u, a, li, ex, tot, tok in rows:
        bar = Text()
        na = round(a / tmax * _BAR)
        nl = round((a + li) / tmax * _BAR) - na
        ne = round(tot / tmax * _BAR) - na - nl
        bar.append("█" * na, style="cyan")
        bar.append("▓" * max(nl, 0), style="green")
        bar.append("░" * max(ne, 0), style="red")
        lt.add_row(str(u), str(tok), f"{tot * 1e3:.2f}", bar)
    console.print(lt)

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
        for k in sorted(set(routed) | set(unrouted)):
            nt.add_row(k, f"{routed.get(k, 0.0) / 1e9:.3f}", f"{unrouted.get(k, 0.0) / 1e9:.3f}")
        r_max = max(routed.values(), default=0.0)
        u_max = max(unrouted.values(), default=0.0)
        nt.caption = f"busiest NIC: {r_max / 1e9:.3f} GB routed, {u_max / 1e9:.3f} GB unrouted"
        console.print(nt)
    else:
        console.print("NIC load: no inter-node traffic in this step")
    for mbi, mb in enumerate(step.microbatches):
        rm = mb.remap
        if rm.enabled or mb.linear_layout is not None:
            extra = f", predicted saving {rm.predicted_saving_s * 1e3:.2f} ms" if rm.predicted_saving_s else ""
            console.print(f"remap (micro-batch {mbi}): {rm.tokens_moved} tokens moved, {rm.tokens_moved_inter} "
                          f"across nodes{extra}" + (f" - {rm.reason}" if rm.reason else ""))
        else:
            console.print(f"remap (micro-batch {mbi}): off" + (f" - {rm.reason}" if rm.reason else ""))
    return counts


_COLORS = {"attention": "#1f77b4", "linear": "#2ca02c", "ring-intra": "#ff7f0e", "ring-inter": "#d62728",
           "dispatch-intra": "#9467bd", "combine-intra": "#8c564b", "remap-intra": "#e377c2",
           "remap-inter": "#e377c2", "ulysses-intra": "#bcbd22", "ulysses-inter": "#bcbd22",
           "allgather-intra": "#17becf", "allgather-inter": "#17becf"}


def gantt(ax, result: SimResult, title: str, legend: bool = True) -> None:
    """Per-unit Gantt of a simulated step's layers (one per micro-batch; compute full height, its
    communication as a thin bar beneath) on ``ax``."""
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    n = len(result.units)
    offset = 0.0
    # one collection of rectangles per (category, lane): thousands of intervals draw in one call each
    boxes: dict[tuple[str, str], list] = defaultdict(list)
    for mbi, mb in enumerate(result.timeline or []):
        for iv in mb.intervals:
            x0, x1 = (offset + iv.start) * 1e3, (offset + iv.end) * 1e3
            y0, y1 = (iv.unit - 0.4, iv.unit + 0.15) if iv.lane == "compute" else (iv.unit + 0.2, iv.unit + 0.4)
            boxes[(iv.cat, iv.lane)].append(((x0, y0), (x0, y1), (x1, y1), (x1, y0)))
        if mbi:
            ax.axvline(offset * 1e3, color="k", lw=0.6, ls="--")
        offset += mb.layer_period_s
    seen = set()
    for (cat, lane), verts in boxes.items():
        ax.add_collection(PolyCollection(verts, facecolors=_COLORS.get(cat, "#7f7f7f"), edgecolors="none",
                                         alpha=1.0 if lane == "compute" else 0.6))
        seen.add(cat)
    ax.set_xlim(0, max(offset * 1e3, 1e-9))
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_yticks(range(0, n, max(1, n // 32)))
    ax.set_xlabel("ms (one transformer layer, forward + backward, per micro-batch)")
    ax.set_ylabel("unit")
    ax.set_title(title)
    handles = [Patch(color=_COLORS.get(c, "#7f7f7f"), label=c) for c in sorted(seen)]
    if handles and legend:
        ax.legend(handles=handles, loc="upper right", fontsize=7)


def draw_png(header: PlanHeader, step: StepPlan, result: SimResult, path: str | Path) -> None:
    """Per-unit Gantt of the simulated layers (one per micro-batch) and a heat-map of unit loads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(result.units)
    fig_h = min(max(3.0, 0.18 * n + 2.5), 18.0)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, fig_h), gridspec_kw={"width_ratios": [3, 1.2]})
    gantt(ax, result, f"{header.planner}: step {step.step}, simulated {result.step_time_s * 1e3:.1f} ms "
                      f"({result.num_layers} layers + head + all-reduce)")
    # heat-map of unit loads: nodes x units per node, simulated busy time
    upn = max(1, len(result.units) // max(header.cluster.num_nodes, 1))
    rows = (n + upn - 1) // upn
    grid = np.full((rows, upn), np.nan)
    for u, s in enumerate(result.units):
        grid[u // upn, u % upn] = s.busy_s * 1e3
    im = ax2.imshow(grid, aspect="auto", cmap="viridis")
    ax2.set_xticks(range(0, upn, max(1, upn // 16)))
    ax2.set_yticks(range(0, rows, max(1, rows // 32)))
    ax2.set_xlabel("unit within node")
    ax2.set_ylabel("node")
    ax2.set_title("busy ms per unit")
    fig.colorbar(im, ax=ax2)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def draw_demo_png(timelines: list[tuple[str, SimResult]], speedups: list[tuple[str, float]], reference: str,
                  title: str, path: str | Path, spreads: dict[str, tuple[float, float]] | None = None) -> None:
    """The demo's picture: per-unit timelines of one step side by side (same time axis) and the
    speedup of every planner over ``reference`` as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(r.units) for _, r in timelines)
    fig_h = min(max(3.2, 0.16 * n + 2.4), 12.0)
    widths = [3] * len(timelines) + [2]
    fig, axes = plt.subplots(1, len(timelines) + 1, figsize=(6 * len(timelines) + 4, fig_h),
                             gridspec_kw={"width_ratios": widths})
    xmax = max(sum(mb.layer_period_s for mb in (r.timeline or [])) for _, r in timelines) * 1e3
    for ax, (label, r) in zip(axes, timelines):
        gantt(ax, r, f"{label}: {r.step_time_s * 1e3:,.0f} ms step ({len(r.timeline or [])} micro-batch"
                     f"{'es' if len(r.timeline or []) != 1 else ''})")
        ax.set_xlim(0, xmax * 1.02)
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
        ax.text(ends[y], y, f" {v:.2f}x", va="center", fontsize=8)
    ax.set_xlabel(f"speedup over {reference}")
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
