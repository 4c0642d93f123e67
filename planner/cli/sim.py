"""`zeppelin simulate | compare | check | show`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from zeppelin.planner.cli import common
from zeppelin.planner.tools.config import CompareConfig
from zeppelin.schemas.common import MAX_STEPS, MAX_WORKERS, InputError, check_int
from zeppelin.schemas.io.safefiles import atomic_write_text, same_file


def _emit_json(doc: dict, output: Path | None) -> None:
    text = json.dumps(doc, indent=1) + "\n"
    if output is not None:
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
    from zeppelin.planner.sim.simulate import Simulator, context_from_header, summary
    from zeppelin.planner.sim.summary import PlanSummary, step_summary, summary_lines
    from zeppelin.planner.tools.tables import console as make_console
    from zeppelin.planner.tools.tables import simulate_step_tables, simulate_summary_table

    check_int("--step", step, 0, MAX_STEPS)
    if output is not None:
        from zeppelin.planner.core.inputs import check_path_writable

        check_path_writable(output, [plan])
    from zeppelin.schemas.plan import PlanReader, check_embedded_specs

    reader = PlanReader(plan)
    reader.verify()  # the digest first: an edited plan is "edited", whatever its edit
    check_embedded_specs(reader)  # the simulator prices the embedded cluster, model and profile
    header = reader.header
    sim = Simulator(context_from_header(header))
    results, counts = [], []
    total = PlanSummary()
    keep_counts = json_out or output is not None  # a JSON document lists each step's counts; the tables print their total
    for st in (reader if step is None else [reader.step(step)]):
        results.append(sim.simulate_step(st, timeline=timeline))
        c = step_summary(sim.ctx, st, traffic=results[-1].nic_traffic)
        total.add(c)
        if keep_counts:
            counts.append(c)
    if keep_counts:
        doc = {
            "plan": str(plan), "planner": header.planner, "cluster": header.cluster.name,
            "world_size": header.world_size, "tp": header.tp, "model": header.model.name,
            "summary": summary(results),
            "counts": total.to_dict(),
            "steps": [{**r.to_dict(timeline=timeline), "counts": c.to_dict()} for r, c in zip(results, counts)],
        }
        _emit_json(doc, output)
        if output is not None:
            typer.echo(f"wrote {output} ({len(results)} step(s))")
        return
    con = make_console()
    if step is not None:
        t, nt = simulate_step_tables(results[0])
        con.print(t)
        if results[0].nics:
            con.print(nt)
    else:
        con.print(simulate_summary_table(header, results))
    for line in summary_lines(total):
        con.print(line, highlight=False)
    s = summary(results)
    con.print(f"mean step {s['mean_step_time_s'] * 1e3:.2f} ms, p50 {s['p50_step_time_s'] * 1e3:.2f} ms, "
              f"p90 {s['p90_step_time_s'] * 1e3:.2f} ms over {s['steps']} step(s); "
              f"x{s['mean_ratio_to_lower_bound']:.2f} the lower bound")


def show(
    plan: Path = typer.Argument(..., help="plan file"),
    step: int = typer.Option(0, "--step", "-s", help="step to show"),
    all_steps: bool = typer.Option(False, "--all", help="show every step in full: each group, unit and NIC (by "
                                                        "default one step is summarised in one screen)"),
    png: Path | None = typer.Option(None, "--png", help="write a per-unit Gantt timeline of the simulated "
                                                           "step and a heat-map of unit loads to this PNG"),
) -> None:
    """Render a plan for a person: tiers and their sequences, per-unit load bars, NIC loads with and
    without routing, remap volume; `--png` draws the simulated step."""
    from zeppelin.planner.tools.show import draw_png, render_step
    from zeppelin.planner.tools.tables import console as make_console
    from zeppelin.schemas.plan import PlanReader, check_embedded_specs

    if step < 0:
        raise InputError(f"--step must be >= 0 (got {step})")
    if all_steps and png is not None:
        raise InputError("--png draws one step: use --step K, not --all")
    if png is not None:
        from zeppelin.planner.core.inputs import check_path_writable

        check_path_writable(png, [plan])
    reader = PlanReader(plan)
    reader.verify()
    check_embedded_specs(reader)
    h = reader.header
    con = make_console()
    con.print(f"plan [bold]{plan}[/bold]: planner {h.planner}, {h.cluster.name} ({h.cluster.num_nodes} nodes x "
              f"{h.cluster.gpus_per_node} GPUs, --tp {h.tp}), {h.model.name}, {h.num_steps} step(s)")
    from zeppelin.planner.sim.simulate import Simulator, context_from_header
    from zeppelin.planner.sim.summary import PlanSummary, summary_lines

    sim = Simulator(context_from_header(h))
    steps = list(reader) if all_steps else [reader.step(step)]
    total = PlanSummary()
    for st in steps:
        total.add(render_step(h, st, con, sim, full=all_steps))
    if all_steps:
        con.print(f"[bold]all {len(steps)} steps[/bold]:")
        for line in summary_lines(total):
            con.print(line, highlight=False)
    if png is not None:
        import sys

        t0 = time.perf_counter()
        if sys.stderr.isatty():  # a large step takes a while: say what is being done
            typer.echo(f"simulating step {steps[0].step} for the picture ({len(sim.replicas(steps[0]))} units)...",
                       err=True)
        res = sim.simulate_step(steps[0], timeline=True)
        draw_png(h, steps[0], res, png)
        con.print(f"wrote {png} ({time.perf_counter() - t0:.1f} s)")


@common.generated("compare")
def compare(**values: Any) -> None:
    """Plan the same steps with zeppelin and every baseline, simulate them side by side, and say what
    zeppelin would buy over each baseline (the verdict)."""
    from zeppelin.planner.core.inputs import check_path_writable, input_refs
    from zeppelin.planner.tools.compare import DEFAULT_PLANNERS

    cfg = CompareConfig.from_flags(_old_spellings(values))
    if cfg.solver_time_limit is not None:
        cfg.time_limit = cfg.solver_time_limit
    for p in (cfg.output, cfg.png):
        if p is not None:
            check_path_writable(p, [cfg.profile, *input_refs(cfg.cluster, cfg.model), cfg.manifest])
    if cfg.output is not None and cfg.png is not None and (str(cfg.output) == str(cfg.png)
                                                           or same_file(cfg.output, cfg.png)):
        raise InputError("-o and --png name the same file", source=cfg.output)
    names = DEFAULT_PLANNERS if cfg.planners is None else [x.strip() for x in cfg.planners.split(",") if x.strip()]
    if not names:
        raise InputError("--planners is empty")
    if cfg.baseline is not None and cfg.baseline not in names:
        raise InputError(f"--baseline {cfg.baseline!r} is not among the compared planners ({', '.join(names)})")
    _run_compare_command(cfg, names, cfg.options_by_planner(names, "the compared planners"))


def _old_spellings(values: dict[str, Any]) -> dict[str, Any]:
    """``compare``'s flags with the spellings of the previous release read as the new ones (one note each)."""
    import os

    from zeppelin.schemas.model import MODEL_PRESETS

    v = dict(values)
    # ``-m`` named the model in an older release: a value that is a model preset (and no file) still is, and
    # so is any model reference (``hf:DIR``, a model JSON file) next to the old ``-d DATA``
    m = v["manifest"]
    old_model = m is not None and ((m in MODEL_PRESETS and not os.path.exists(m)) or (
        v["dataset"] is not None and (m.startswith("hf:") or (m.lower().endswith(".json")
                                                               and not m.lower().endswith(".manifest.json")))))
    if old_model:
        common.deprecated("compare", "-m MODEL")
        v["manifest"], v["model"] = None, v["manifest"]
    if v["dataset"] is not None:
        common.deprecated("compare", "--dataset")
        if v["manifest"] is not None:
            raise InputError("--dataset is the old spelling of -m/--manifest: give one of them")
        v["manifest"] = v["dataset"]
    if v["steps_n"] is not None:
        common.deprecated("compare", "-n")
        v["steps"] = v["steps_n"]
    if v["solver_time_limit"] is not None:
        common.deprecated("compare", "--solver-time-limit")
    if v["tokens_per_gpu"] is not None:
        common.deprecated("compare", "--tokens-per-gpu")
    return v


def _run_compare_command(cfg: CompareConfig, names: list[str], options: dict[str, dict[str, Any]]) -> None:
    """`zeppelin compare` once its flags are checked: sample, plan, simulate, print table and verdict."""
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
    from zeppelin.planner.core.sampler import run_max_seq_len, sample_steps
    from zeppelin.planner.tools import compare as cmp
    from zeppelin.planner.tools.tables import console as make_console

    cl = resolve_cluster(cfg.cluster)
    md = resolve_model(cfg.model)
    prof = resolve_profile(cfg.profile, cl)
    ctx = cfg.context(cl, md, prof)
    ds = cmp.resolve_dataset(cfg.manifest, *cfg.field_flags)
    sampler = cfg.sampler(ctx, None if cfg.tokens_per_gpu is None or cfg.tokens_per_step is not None
                          else cfg.tokens_per_gpu * cl.world_size)
    ctx.max_seq_len = run_max_seq_len(ds, sampler)
    step_seqs = sample_steps(ds, sampler, cfg.steps)
    t0 = time.perf_counter()
    runs = cmp.run_compare(ctx, step_seqs, names, options, workers=cfg.workers or cmp.default_workers(),
                           progress=True)
    wall = time.perf_counter() - t0
    doc = cmp.comparison(runs)
    title = cmp.compare_title(ctx, cfg.manifest, cfg.steps, sampler)
    doc.update(cmp.setting(ctx, cfg.manifest or "sample", cfg.steps, sampler))
    doc.update({"seed": cfg.seed, "wall_s": wall,
                "prediction_error": cmp.prediction_error(prof, given=cfg.profile is not None)})
    doc["verdict"] = cmp.verdict(doc, ctx, step_seqs, baseline=cfg.baseline)
    if cfg.png is not None:
        cmp.draw_png(doc, title, cfg.png)
    if cfg.output is not None or cfg.json_out:
        _emit_json(doc, cfg.output)
    # the table and the verdict always reach the terminal: on stderr when stdout carries the JSON
    con = make_console(stderr=cfg.json_out and cfg.output is None)
    con.print(cmp.render_table(doc, title))
    for line in cmp.verdict_lines(doc["verdict"]):
        con.print(line, highlight=False, markup=False)
    con.print(f"(planned and simulated in {wall:.1f} s)", highlight=False)
    for p in (cfg.output, cfg.png):
        if p is not None:
            con.print(f"wrote {p}", highlight=False, markup=False)


def check(
    directory: Path = typer.Argument(Path("plans"), help="directory of check cases (*.json) and golden plans (*.plan)"),
    update: bool = typer.Option(False, "--update", help="rewrite the golden plans and print what changed"),
    case: list[str] = typer.Option(None, "--case", "-k", help="check only this case (repeatable)"),
    workers: int = typer.Option(0, "--workers", "-j", help="worker processes (0: one per CPU)"),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON"),
    exact: bool = typer.Option(False, "--exact", help="also fail when a new plan is not byte-identical to its golden "
                                                      "(plans are deterministic)"),
) -> None:
    """CI plan regression check against the golden plans in plans/.

    Re-plans every case (one JSON file each), validates the plan, simulates it and the golden plan, and fails (exit 1) when the mean step time got worse than the golden's by more than the case's tolerance, when a plan is invalid, when zeppelin no longer beats a baseline of the same setting, or when a step hit a solver's wall-clock safety net (non-reproducible); `--exact` also fails on any byte difference from the golden. Exit 2: bad input.

    `--update` rewrites the goldens (atomically) and prints the step time before and after.
    """
    from zeppelin.planner.tools.check import render, run_check
    from zeppelin.planner.tools.compare import default_workers

    check_int("--workers", workers, 0, MAX_WORKERS)
    report = run_check(directory, update=update, workers=workers or default_workers(), only=case or None,
                       exact=exact and not update)
    if report.bad_input:
        raise InputError(report.bad_input[0])
    if json_out:
        typer.echo(json.dumps(report.to_dict(), indent=1))
    else:
        from zeppelin.planner.tools.tables import console as make_console

        from zeppelin.planner.tools.tables import wrapped

        con = make_console()
        con.print(render(report, update))
        for row in report.beats:
            mark = "ok" if row["ok"] else "FAIL"
            typer.echo(wrapped(f"{mark}: {row['zeppelin_case']} {row['zeppelin_s'] * 1e3:.2f} ms vs "
                               f"{row['baseline']} {row['baseline_s'] * 1e3:.2f} ms ({row['speedup']:.3f}x)"))
        if update:
            for r in report.results:
                if r.written:
                    before = f"{r.golden_mean_s * 1e3:.2f} ms" if r.golden_mean_s is not None else "none"
                    after = f"{r.new_mean_s * 1e3:.2f} ms"
                    ch = f" ({r.change * 100:+.2f}%)" if r.change is not None else ""
                    typer.echo(f"updated {r.name}.plan: step time {before} -> {after}{ch}")
        for r in report.results:
            for note in r.notes:
                typer.echo(f"note: {note}")
        for f in report.failures:
            typer.echo(wrapped(f"FAIL {f}"))
        n = len(report.results)
        verdict = f"{len(report.failures)} failure(s)" if report.failures else "passed"
        typer.echo(f"{n} case(s) checked in {report.wall_s:.1f} s: {verdict}")
    if report.failures:
        raise typer.Exit(1)
