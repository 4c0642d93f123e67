"""`zeppelin simulate | compare | check | show`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from zeppelin.planner.cli import common
from zeppelin.schemas.common import (
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    MAX_WORKERS,
    InputError,
    check_float,
    check_int,
)
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
    for st in (reader if step is None else [reader.step(step)]):
        results.append(sim.simulate_step(st, timeline=timeline))
        counts.append(step_summary(sim.ctx, st, traffic=results[-1].nic_traffic))
    total = PlanSummary()
    for c in counts:
        total.add(c)
    if json_out or output is not None:
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
              f"{h.cluster.gpus_per_node} GPUs, tp={h.tp}), {h.model.name}, {h.num_steps} step(s)")
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
        res = sim.simulate_step(steps[0], timeline=True)
        draw_png(h, steps[0], res, png)
        con.print(f"wrote {png}")


def compare(
    manifest: str | None = common.manifest_option(
        "; or a synthetic length mix: short, mixed, long, longtail"),
    cluster: str = common.cluster_option("zeppelin-a:2"),
    model: str = common.model_option("llama-7b"),
    profile: Path | None = common.profile_option(),
    tokens_per_step: int | None = common.tokens_option(),
    max_seq_len: int | None = common.max_seq_len_option(),
    steps: int = common.steps_option(10),
    seed: int = common.seed_option(),
    time_limit: float | None = common.time_limit_option(),
    length_field: str | None = common.length_field_option(),
    ids_field: str | None = common.ids_field_option(),
    text_field: str | None = common.text_field_option(),
    tokenizer: str | None = common.tokenizer_option(),
    planners: str | None = typer.Option(None, "--planners", help="comma-separated planners (default: all)"),
    baseline: str | None = typer.Option(None, "--baseline", metavar="NAME",
                                        help="the planner closest to what you run today (docs/CONCEPTS.md: "
                                             "te-cp = TransformerEngine/Megatron CP, ...): the verdict leads with it"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel degree of a unit"),
    workers: int = typer.Option(0, "--workers", "-j", help="worker processes (0: one per CPU)"),
    json_out: bool = common.json_option(),
    output: Path | None = common.output_option("write the JSON to this file (the table stays on the terminal)"),
    png: Path | None = typer.Option(None, "--png", help="bar charts of step time and speedup"),
    dataset: str | None = typer.Option(None, "--dataset", "-d", hidden=True, help="old spelling of -m/--manifest"),
    steps_n: int | None = typer.Option(None, "-n", hidden=True, help="old spelling of --steps"),
    tokens_per_gpu: int | None = typer.Option(None, "--tokens-per-gpu", hidden=True,
                                              help="old: tokens per step per GPU (use --tokens-per-step)"),
    solver_time_limit: float | None = typer.Option(None, "--solver-time-limit", hidden=True,
                                                   help="old spelling of --time-limit"),
) -> None:
    """Plan the same steps with zeppelin and every baseline, simulate them side by side, and say what
    zeppelin would buy over each baseline (the verdict)."""
    from zeppelin.planner.core.inputs import check_path_writable, input_refs

    manifest, model = _old_model_flag(manifest, model)
    if dataset is not None:
        common.deprecated("compare", "--dataset")
        if manifest is not None:
            raise InputError("--dataset is the old spelling of -m/--manifest: give one of them")
        manifest = dataset
    if steps_n is not None:
        common.deprecated("compare", "-n")
        steps = steps_n
    if solver_time_limit is not None:
        common.deprecated("compare", "--solver-time-limit")
        check_float("--solver-time-limit", solver_time_limit, 0.0, 3600.0, lo_open=True)
        time_limit = solver_time_limit
    if tokens_per_gpu is not None:
        common.deprecated("compare", "--tokens-per-gpu")
        check_int("--tokens-per-gpu", tokens_per_gpu, 1, MAX_TOKENS)
    check_int("--steps", steps, 1, MAX_STEPS)
    check_int("--tokens-per-step", tokens_per_step, 1, MAX_TOKENS)
    check_int("--max-seq-len", max_seq_len, 1, 2**31)
    check_int("--tp", tp, 1, 256)
    check_int("--seed", seed, 0, MAX_SEED)
    check_int("--workers", workers, 0, MAX_WORKERS)
    check_float("--time-limit", time_limit, 0.0, 3600.0, lo_open=True)
    for p in (output, png):
        if p is not None:
            check_path_writable(p, [profile, *input_refs(cluster, model), manifest])
    if output is not None and png is not None and (str(output) == str(png) or same_file(output, png)):
        raise InputError("-o and --png name the same file", source=output)
    from zeppelin.planner.tools.compare import DEFAULT_PLANNERS

    names = DEFAULT_PLANNERS if planners is None else [x.strip() for x in planners.split(",") if x.strip()]
    if not names:
        raise InputError("--planners is empty")
    if baseline is not None and baseline not in names:
        raise InputError(f"--baseline {baseline!r} is not among the compared planners ({', '.join(names)})")
    fields = (length_field, ids_field, text_field, tokenizer)
    _run_compare_command(dict(
        manifest=manifest, fields=fields, cluster=cluster, model=model, profile=profile, tp=tp, seed=seed,
        tokens_per_step=tokens_per_step, tokens_per_gpu=tokens_per_gpu, max_seq_len=max_seq_len, steps=steps,
        names=names, time_limit=time_limit, workers=workers, baseline=baseline, json_out=json_out,
        output=output, png=png))


def _old_model_flag(manifest: str | None, model: str) -> tuple[str | None, str]:
    """``compare -m llama-7b``: ``-m`` named the model in an older release; a value that is a model
    preset (and no file) is still read as the model, with a note."""
    import os

    from zeppelin.schemas.model import MODEL_PRESETS

    if manifest is not None and manifest in MODEL_PRESETS and not os.path.exists(manifest):
        common.deprecated("compare", "-m MODEL")
        return None, manifest
    return manifest, model


def _run_compare_command(a: dict) -> None:
    """`zeppelin compare` once its flags are checked: sample, plan, simulate, print table and verdict."""
    from zeppelin.planner.core.base import PlanContext, PlanningError
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
    from zeppelin.planner.core.sampler import run_max_seq_len, sample_steps
    from zeppelin.planner.tools import compare as cmp
    from zeppelin.planner.tools.tables import console as make_console
    from zeppelin.schemas.plan import SamplerConfig

    cl = resolve_cluster(a["cluster"])
    md = resolve_model(a["model"])
    prof = resolve_profile(str(a["profile"]) if a["profile"] else None, cl)
    try:
        ctx = PlanContext(cl, md, prof, tp=a["tp"], seed=a["seed"])
    except ValueError as e:
        raise PlanningError(str(e)) from None
    ds = cmp.resolve_dataset(a["manifest"], *a["fields"])
    tokens = a["tokens_per_step"]
    if tokens is None:
        tokens = (a["tokens_per_gpu"] * cl.world_size if a["tokens_per_gpu"] is not None
                  else common.default_tokens_per_step(ctx.cost.token_capacity, ctx.num_units))
    cfg = SamplerConfig(tokens_per_step=tokens, seed=a["seed"], max_seq_len=a["max_seq_len"])
    ctx.max_seq_len = run_max_seq_len(ds, cfg)
    step_seqs = sample_steps(ds, cfg, a["steps"])
    tl = a["time_limit"]
    options = {p: {"time_limit": tl} for p in a["names"] if tl and (p in cmp.SOLVER_PLANNERS or p == "zeppelin")}
    t0 = time.perf_counter()
    runs = cmp.run_compare(ctx, step_seqs, a["names"], options, workers=a["workers"] or cmp.default_workers(),
                           progress=True)
    wall = time.perf_counter() - t0
    doc = cmp.comparison(runs)
    data = a["manifest"] or "the shipped sample"
    title = (f"{cl.name} ({cl.world_size} GPUs), {md.name}, tp={a['tp']}, {data}, {a['steps']} steps of "
             f"{cfg.tokens_per_step:,} tokens")
    doc.update({"cluster": cl.name, "world_size": cl.world_size, "model": md.name, "tp": a["tp"],
                "dataset": a["manifest"] or "sample", "steps": a["steps"], "tokens_per_step": cfg.tokens_per_step,
                "seed": a["seed"], "wall_s": wall,
                "prediction_error": cmp.prediction_error(prof, given=a["profile"] is not None)})
    doc["verdict"] = cmp.verdict(doc, ctx, step_seqs, baseline=a["baseline"])
    if a["png"] is not None:
        cmp.draw_png(doc, title, a["png"])
    if a["output"] is not None or a["json_out"]:
        _emit_json(doc, a["output"])
    # the table and the verdict always reach the terminal: on stderr when stdout carries the JSON
    con = make_console(stderr=a["json_out"] and a["output"] is None)
    con.print(cmp.render_table(doc, title))
    for line in cmp.verdict_lines(doc["verdict"]):
        con.print(line, highlight=False, markup=False)
    con.print(f"(planned and simulated in {wall:.1f} s)", highlight=False)
    for p in (a["output"], a["png"]):
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

        con = make_console()
        con.print(render(report, update))
        for row in report.beats:
            mark = "ok" if row["ok"] else "FAIL"
            typer.echo(f"{mark}: {row['zeppelin_case']} {row['zeppelin_s'] * 1e3:.2f} ms vs {row['baseline']} "
                       f"{row['baseline_s'] * 1e3:.2f} ms ({row['speedup']:.3f}x)")
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
            typer.echo(f"FAIL {f}")
        n = len(report.results)
        verdict = f"{len(report.failures)} failure(s)" if report.failures else "passed"
        typer.echo(f"{n} case(s) checked in {report.wall_s:.1f} s: {verdict}")
    if report.failures:
        raise typer.Exit(1)
