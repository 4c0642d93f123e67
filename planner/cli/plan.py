"""`zeppelin plan` and `zeppelin validate`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from zeppelin.planner.cli import common
from zeppelin.planner.zeppelin.options import ZeppelinOptions
from zeppelin.schemas.common import (
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    MAX_WORKERS,
    InputError,
    check_float,
    check_int,
)


def _planner(name: str, options: dict):
    from zeppelin.planner.core.base import PLANNERS, construct_planner, get_planner
    from zeppelin.planner.zeppelin import planner as zeppelin_planner  # noqa: F401  (registers the zeppelin planners)

    if name in PLANNERS:  # the zeppelin planners: no need to import every baseline
        return construct_planner(name, **options)
    return get_planner(name, **options)


def _zeppelin_flag(name: str, *flags: str):
    """A ``zeppelin plan`` flag that sets a Zeppelin option: its default and help from
    :class:`ZeppelinOptions`."""
    spec = ZeppelinOptions.spec(name)
    return typer.Option(spec.default, *flags, help=f"zeppelin: {spec.help}")


def _list_options(value: bool) -> None:
    if not value:
        return
    from zeppelin.planner.core import registry  # noqa: F401 (imports every planner module: they register)
    from zeppelin.planner.core.base import PLANNERS

    typer.echo(options_listing(PLANNERS), nl=False)
    raise typer.Exit()


def options_listing(planners: dict) -> str:
    """Every planner's options (from its ``Options`` dataclass), planners sharing them together."""
    groups: dict[type, list[str]] = {}
    for name in sorted(planners):
        groups.setdefault(planners[name].Options, []).append(name)
    out = []
    for opts, names in sorted(groups.items(), key=lambda g: g[1][0]):
        specs = opts.specs()
        out.append(f"{', '.join(names)}:" + ("" if specs else " no options") + "\n")
        for s in specs:
            allowed = f" {s.allowed};" if s.allowed else ""
            out.append(f"  {s.name} ({s.type_name};{allowed} default {s.default_text}): {s.help}\n")
    out.append("Set them in a check case's \"options\", with `zeppelin plan --option NAME=VALUE`, or as keyword "
               "arguments of get_planner(NAME, ...).\n")
    return "".join(out)


def plan(
    manifest: str | None = common.manifest_option(),
    cluster: str = common.cluster_option(),
    model: str = common.model_option(),
    output: Path | None = common.output_option("plan file to write"),
    planner: str = typer.Option("zeppelin", "--planner", help="planner name (zeppelin, zeppelin-no-routing, "
                                                               "zeppelin-no-remap, zeppelin-tiers-only, baselines)"),
    tokens_per_step: int | None = common.tokens_option(),
    seqs_per_step: int | None = typer.Option(None, "--seqs-per-step", help="sequences per step"),
    steps: int = common.steps_option(10),
    seed: int = common.seed_option(),
    no_shuffle: bool = typer.Option(False, "--no-shuffle", help="take samples in manifest order"),
    max_seq_len: int | None = common.max_seq_len_option(),
    overflow: str = typer.Option("truncate", "--overflow", help="longer samples: truncate, reject or skip"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel degree of a unit"),
    zero_stage: int = typer.Option(1, "--zero-stage", help="ZeRO stage (0-3) for the memory model"),
    recompute: str = typer.Option("none", "--recompute",
                                  help="none | selective | full: activation recomputation `zeppelin run` will use "
                                       "(sets the activation memory per token)"),
    profile: str | None = common.profile_option(),
    length_field: str | None = common.length_field_option(),
    ids_field: str | None = common.ids_field_option(),
    text_field: str | None = common.text_field_option(),
    tokenizer: str | None = common.tokenizer_option(),
    ilp_nodes: int = _zeppelin_flag("ilp_nodes", "--ilp-nodes"),
    time_limit: float | None = common.time_limit_option(),
    ilp: str = _zeppelin_flag("ilp", "--ilp"),
    solver: str = _zeppelin_flag("solver", "--solver"),
    intra: str = _zeppelin_flag("intra", "--intra"),
    families: str = _zeppelin_flag("families", "--families"),
    option: list[str] = typer.Option([], "--option", "-O", metavar="NAME=VALUE",
                                     help="a planner option (repeatable; `--list-options` lists them)"),
    list_options: bool = typer.Option(False, "--list-options", is_eager=True, expose_value=False,
                                      callback=_list_options, help="list every planner's options and exit"),
    workers: int = typer.Option(1, "--workers", "-j", help="plan steps in this many processes"),
    fmt: str = typer.Option("jsonl", "--format", help="jsonl (compact) or pretty (readable, diffable)"),
    explain: bool = typer.Option(False, "--explain", help="print the tier thresholds and how they were derived"),
    save_case: Path | None = typer.Option(None, "--save-case", metavar="DIR/NAME",
                                          help="also write a `zeppelin check` case DIR/NAME.json from these flags "
                                               "and its golden plan DIR/NAME.plan (README: plan checks in CI)"),
    json_out: bool = common.json_option("print the summary as JSON"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or summary"),
    stream: bool = typer.Option(False, "--stream",
                                help="write each step as soon as it is planned (with PLAN.chain, the chained digest "
                                     "of every step, removed at the end), for `zeppelin run PLAN --follow`; the "
                                     "finished plan is the same bytes"),
) -> None:
    """Plan training steps: manifest + cluster + model -> plan file."""
    from zeppelin.planner.core.base import PlanContext, PlanningError
    from zeppelin.planner.core.driver import check_steps, make_header, plan_steps
    from zeppelin.planner.core.inputs import (
        check_path_writable,
        input_refs,
        resolve_cluster,
        resolve_model,
        resolve_profile,
    )
    from zeppelin.schemas.plan import PlanWriter, SamplerConfig

    if fmt not in ("jsonl", "pretty"):
        raise InputError(f"--format must be jsonl or pretty (got {fmt!r})")
    if overflow not in ("truncate", "reject", "skip"):
        raise InputError(f"--overflow must be truncate, reject or skip (got {overflow!r})")
    check_int("--steps", steps, 1, MAX_STEPS)
    check_int("--tokens-per-step", tokens_per_step, 1, MAX_TOKENS)
    check_int("--seqs-per-step", seqs_per_step, 1, 2**31)
    check_int("--max-seq-len", max_seq_len, 1, 2**31)
    check_int("--seed", seed, 0, MAX_SEED)
    check_int("--tp", tp, 1, 256)
    check_int("--workers", workers, 1, MAX_WORKERS)
    check_float("--time-limit", time_limit, 0.0, 3600.0, lo_open=True)
    if not 0 <= zero_stage <= 3:
        raise InputError(f"--zero-stage must be 0, 1, 2 or 3 (got {zero_stage})")
    if recompute not in ("none", "selective", "full"):
        raise InputError(f"--recompute must be none, selective or full (got {recompute!r})")
    if output is None and not explain and save_case is None:
        raise InputError("missing -o/--output PLAN (or use --explain alone to see the tier thresholds)")
    if output is not None:
        check_path_writable(output, [manifest, *input_refs(cluster, model, profile)])
        if stream:
            from zeppelin.schemas.io.stream import chain_path

            check_path_writable(chain_path(output), [manifest, *input_refs(cluster, model, profile)])
    if save_case is not None:
        from zeppelin.planner.tools.check import check_case_flags

        check_case_flags(save_case, {"--profile": profile, "--zero-stage": zero_stage != 1,
                                     "--recompute": recompute != "none", "--no-shuffle": no_shuffle,
                                     "--overflow": overflow != "truncate", "--seqs-per-step": seqs_per_step,
                                     "--length-field": length_field, "--ids-field": ids_field,
                                     "--text-field": text_field, "--tokenizer": tokenizer},
                         [output, manifest, *input_refs(cluster, model)])
    cl = resolve_cluster(cluster)
    md = resolve_model(model)
    pf = resolve_profile(profile, cl)
    if cl.gpus_per_node % tp:
        raise PlanningError(f"--tp {tp} does not divide the {cl.gpus_per_node} GPUs per node of {cl.name}")
    from zeppelin.schemas.runnable import HF_TP_REASON, model_runs_tp

    if tp > 1 and not model_runs_tp(md):
        raise PlanningError(f"--tp {tp}: {HF_TP_REASON} (plan with --tp 1)")
    ctx = PlanContext(cl, md, pf, tp=tp, zero_stage=zero_stage, seed=seed, recompute=recompute)
    if ilp_nodes < 0:
        raise InputError(f"--ilp-nodes must be >= 0 (got {ilp_nodes})")
    options = ({"ilp": ilp, "ilp_nodes": ilp_nodes, "solver": solver, "intra": intra}
               if planner.startswith("zeppelin") else {})
    if families != "all" and planner.startswith("zeppelin"):  # (only a value other than the default is recorded)
        options["families"] = families
    if time_limit is not None and (planner.startswith("zeppelin") or planner in ("flexsp", "hydraulis")):
        options["time_limit"] = time_limit
    options.update(_named_options(planner, option))
    pl = _planner(planner, options)
    if explain:
        from zeppelin.planner.tools.explain import explain_text

        typer.echo(explain_text(ctx))
        if output is None and save_case is None:
            return
    from zeppelin.planner.core.sampler import StepSampler, run_max_seq_len
    from zeppelin.schemas.hf import check_positions

    ds = common.load_dataset(manifest, length_field, ids_field, text_field, tokenizer)
    if tokens_per_step is None and seqs_per_step is None:
        tokens_per_step = common.default_tokens_per_step(ctx.cost.token_capacity, ctx.num_units)
    if save_case is not None:
        from zeppelin.planner.tools.check import save_case as write_case

        for line in write_case(save_case, cluster=cluster, model=model, manifest=manifest, planner=planner,
                               options=options, steps=steps, seed=seed, tokens_per_step=tokens_per_step,
                               max_seq_len=max_seq_len, tp=tp):
            typer.echo(line)
        if output is None:
            return
    cfg = SamplerConfig(tokens_per_step=tokens_per_step, seqs_per_step=seqs_per_step, shuffle=not no_shuffle,
                        seed=seed, max_seq_len=max_seq_len, overflow=overflow)
    ctx.max_seq_len = run_max_seq_len(ds, cfg)
    check_positions(model, ctx.max_seq_len)  # an hf:DIR model's max_position_embeddings
    # the steps are drawn again for each pass (the sampler is deterministic and cheap): checking
    # every step before any work, then planning and writing one step at a time, keeps a single
    # step's sequences and plan in memory however many steps the plan file holds
    def step_seqs():
        return StepSampler(ds, cfg).steps(steps)

    check_steps(step_seqs(), cfg)
    if hasattr(pl, "check_feasible"):
        for seqs in step_seqs():
            pl.check_feasible(ctx, seqs)
    header = make_header(ctx, pl, ds, cfg, steps)
    show = not quiet and sys.stderr.isatty()
    t0 = time.perf_counter()
    from zeppelin.planner.sim.simulate import Simulator, context_from_header
    from zeppelin.planner.sim.summary import PlanSummary, step_summary, summary_lines

    ratios, solvers, wall_hit = [], {}, []
    counts, t_counts = PlanSummary(), 0.0
    sim = None if quiet and not explain else Simulator(context_from_header(header))
    if stream:
        from zeppelin.schemas.io.stream import StreamingPlanWriter

        writer = StreamingPlanWriter(output, header, fmt)
    else:
        writer = PlanWriter(output, header, fmt)
    from zeppelin.schemas.runnable import step_problem

    with writer as w:
        for st in plan_steps(ctx, pl, step_seqs(), workers=workers, progress=show, total=steps):
            why = step_problem(header, st)  # a plan file holds only steps zeppelin run executes
            if why:
                raise PlanningError(f"planner {pl.name} made a step zeppelin run cannot execute: {why}")
            w.write(st)
            if st.prediction is not None and st.prediction.lower_bound_s > 0:
                ratios.append(st.prediction.step_time_s / st.prediction.lower_bound_s)
            if st.solver is not None:
                solvers[st.solver.name] = solvers.get(st.solver.name, 0) + 1
                if st.solver.status == "wall_clock_limit":
                    wall_hit.append(st.step)
            if sim is not None:  # (the planning time reported below leaves this counting out)
                t1 = time.perf_counter()
                counts.add(step_summary(sim.ctx, st, sim))
                t_counts += time.perf_counter() - t1
    if wall_hit:
        typer.echo(f"warning: step(s) {', '.join(map(str, wall_hit))} hit the --time-limit wall-clock safety net: "
                   f"their plans depend on this machine's load and are not reproducible", err=True)
    if explain:
        from zeppelin.planner.tools.explain import plan_against_thresholds

        for line in plan_against_thresholds(ctx, counts):
            typer.echo(line)
    if quiet:
        return
    import numpy as np

    el = time.perf_counter() - t0 - t_counts
    if json_out:
        import json

        typer.echo(json.dumps({
            "output": str(output), "steps": steps, "planner": pl.name, "model": md.name, "cluster": cl.name,
            "world_size": cl.world_size, "tokens_per_step": cfg.tokens_per_step, "planning_s": el,
            "step_over_lower_bound_median": float(np.median(ratios)) if ratios else None,
            "step_over_lower_bound_worst": float(max(ratios)) if ratios else None,
            "counts": counts.to_dict(), "solvers": solvers}, indent=1))
        return
    typer.echo(f"wrote {output}: {steps} steps planned by {pl.name} for {md.name} on {cl.name} "
               f"({cl.world_size} GPUs) in {el:.2f} s ({el / steps * 1e3:.0f} ms/step)")
    if ratios:
        r = np.array(ratios)
        typer.echo(f"predicted step / lower bound: median {np.median(r):.3f}, worst {r.max():.3f}")
    for line in summary_lines(counts):
        typer.echo(line)
    if solvers:
        typer.echo("solver: " + ", ".join(f"{k} x{v}" for k, v in sorted(solvers.items())))


# the Zeppelin options ``zeppelin plan`` sets with flags of their own (--time-limit also for flexsp, hydraulis)
_FLAGS = {"ilp": "--ilp", "ilp_nodes": "--ilp-nodes", "solver": "--solver", "intra": "--intra",
          "families": "--families", "time_limit": "--time-limit"}


def _named_options(planner: str, given: list[str]) -> dict:
    """``--option NAME=VALUE`` pairs as the planner's typed values (checked by its ``Options``)."""
    from zeppelin.planner.core import registry  # noqa: F401 (imports every planner module: they register)
    from zeppelin.planner.core.base import PLANNERS

    flagged = set(_FLAGS) if planner.startswith("zeppelin") else {"time_limit"} if planner in (
        "flexsp", "hydraulis") else set()
    out = {}
    for item in given:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not name:
            raise InputError(f"--option must be NAME=VALUE (got {item!r})")
        if name in flagged:
            raise InputError(f"--option {name}: use {_FLAGS[name]}")
        out[name] = value
    if not out or planner not in PLANNERS:
        return out  # (an unknown planner is refused with the list of known ones)
    typed = PLANNERS[planner].Options.parse(planner, out)
    return {k: getattr(typed, k) for k in out}


def validate(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="plan file"),
    cluster: str | None = typer.Option(None, "--cluster", "-c", help="check the plan was made for this cluster"),
    model: str | None = typer.Option(None, "--model", help="check the plan was made for this model"),
    profile: str | None = typer.Option(None, "--profile", help="check the plan was made with this profile"),
    manifest: str | None = typer.Option(None, "--manifest", "-m", help="check the plan was made from this manifest"),
    length_field: str | None = common.length_field_option(),
    ids_field: str | None = common.ids_field_option(),
    text_field: str | None = common.text_field_option(),
    tokenizer: str | None = common.tokenizer_option(),
    limit: int = typer.Option(10, "--limit", help="problems to print at most"),
) -> None:
    """Check a plan's invariants (coverage, memory, routes, ring order, input hashes) and that
    `zeppelin run` executes every step for the model (--model hf:DIR: no tensor parallelism).

    Exit 0 when valid, 1 with the first problems when not, 2 when the inputs cannot be read."""
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model
    from zeppelin.planner.tools.validate import validate_plan, validate_summary

    cl = resolve_cluster(cluster) if cluster else None
    md = resolve_model(model) if model else None
    pf = None
    if profile:
        from zeppelin.schemas.io.documents import load_doc
        from zeppelin.schemas.profile import CostProfile

        pf = load_doc(CostProfile, profile)
    ds = None
    if manifest:
        ds = common.load_dataset(manifest, length_field, ids_field, text_field, tokenizer)
    from zeppelin.schemas.hf import is_hf_ref

    probs = validate_plan(plan_path, cluster=cl, model=md, profile=pf, manifest=ds, limit=max(limit, 1),
                          hf=is_hf_ref(model) if model else None)
    if probs:
        typer.echo(f"{plan_path}: INVALID ({len(probs)}{'+' if len(probs) >= limit else ''} problem"
                   f"{'s' if len(probs) != 1 else ''})", err=True)
        for p in probs[:limit]:
            typer.echo(f"  {p}", err=True)
        raise typer.Exit(1)
    s = validate_summary(plan_path)
    msg = (f"{plan_path}: valid - {s['steps']} steps by {s['planner']}, {s['sequences']:,} sequences, "
           f"{s['tokens']:,} tokens on {s['world_size']} GPUs")
    if s["ratios"]:
        import numpy as np

        msg += f"; predicted step / lower bound median {float(np.median(s['ratios'])):.3f}"
    typer.echo(msg)
