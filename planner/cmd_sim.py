"""`zeppelin simulate | compare | check | show`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from zeppelin.schemas.common import InputError, atomic_write_text

from .notyet import not_implemented


def _emit_json(doc: dict, output: Path | None) -> None:
    text = json.dumps(doc, indent=1) + "\n"
    if output is not None:
        from .inputs import check_path_writable

        check_path_writable(output)
        atomic_write_text(output, text)
    else:
        typer.echo(text, nl=False)


def simulate(
    plan: Path = typer.Argument(..., help="plan file written by `zeppelin plan` (or any planner)"),
    step: int | None = typer.Option(None, "--step", "-s", help="simulate only this step and show it per unit"),
    json_out: bool = typer.Option(False, "--json", help="print the results as JSON instead of tables"),
    output: Path | None = typer.Option(None, "-o", "--output", help="write the JSON to this file"),
    timeline: bool = typer.Option(False, "--timeline", help="include the per-unit event timeline in the JSON"),
) -> None:
    """Predict a plan's per-unit timeline and step time with the event-driven simulator.

    Per step: simulated step time, the plan's analytic prediction and lower bound, per-unit
    busy / exposed-communication / idle time, NIC utilisation. `--step K` shows one step per unit.
    """
    from rich.console import Console

    from .simulate import render_step_table, render_summary_table, simulate_plan, summary

    if step is not None and step < 0:
        raise InputError(f"--step must be >= 0 (got {step})")
    header, results = simulate_plan(plan, steps=None if step is None else [step], timeline=timeline)
    if json_out or output is not None:
        doc = {
            "plan": str(plan), "planner": header.planner, "cluster": header.cluster.name,
            "world_size": header.world_size, "tp": header.tp, "model": header.model.name,
            "summary": summary(results),
            "steps": [r.to_dict(timeline=timeline) for r in results],
        }
        _emit_json(doc, output)
        if output is not None:
            typer.echo(f"wrote {output} ({len(results)} step(s))")
        return
    con = Console()
    if step is not None:
        t, nt = render_step_table(results[0])
        con.print(t)
        if results[0].nics:
            con.print(nt)
    else:
        con.print(render_summary_table(header, results))
    s = summary(results)
    con.print(f"mean step {s['mean_step_time_s'] * 1e3:.2f} ms, p50 {s['p50_step_time_s'] * 1e3:.2f} ms, "
              f"p90 {s['p90_step_time_s'] * 1e3:.2f} ms over {s['steps']} step(s); "
              f"x{s['mean_ratio_to_lower_bound']:.2f} the lower bound")


def show(
    plan: Path = typer.Argument(..., help="plan file"),
    step: int = typer.Option(0, "--step", "-s", help="step to show"),
    all_steps: bool = typer.Option(False, "--all", help="show every step (text only)"),
    png: Path | None = typer.Option(None, "--png", help="write a per-unit Gantt timeline of the simulated "
                                                           "step and a heat-map of unit loads to this PNG"),
) -> None:
    """Render a plan for a person: tiers and their sequences, per-unit load bars, NIC loads with and
    without routing, remap volume; `--png` draws the simulated step."""
    from rich.console import Console

    from zeppelin.schemas.plan import PlanReader

    from .show import draw_png, render_step

    if step < 0:
        raise InputError(f"--step must be >= 0 (got {step})")
    if all_steps and png is not None:
        raise InputError("--png draws one step: use --step K, not --all")
    if png is not None:
        from .inputs import check_path_writable

        check_path_writable(png)
    reader = PlanReader(plan)
    h = reader.header
    con = Console()
    con.print(f"plan [bold]{plan}[/bold]: planner {h.planner}, {h.cluster.name} ({h.cluster.num_nodes} nodes x "
              f"{h.cluster.gpus_per_node} GPUs, tp={h.tp}), {h.model.name}, {h.num_steps} step(s)")
    steps = list(reader) if all_steps else [reader.step(step)]
    for st in steps:
        render_step(h, st, con)
    if png is not None:
        from .simulate import Simulator, context_from_header

        res = Simulator(context_from_header(h)).simulate_step(steps[0], timeline=True)
        draw_png(h, steps[0], res, png)
        con.print(f"wrote {png}")


def compare(ctx: typer.Context) -> None:
    """Plan the same steps with zeppelin and every baseline; print them side by side."""
    not_implemented("compare")


def check(ctx: typer.Context) -> None:
    """CI plan regression check against the golden plans in plans/."""
    not_implemented("check")
