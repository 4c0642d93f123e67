"""`zeppelin plan` and `zeppelin validate`.

``plan``'s flags are declared in :mod:`zeppelin.planner.tools.config` (:data:`PlanConfig`); this
module resolves the inputs, plans the steps and writes the plan.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import typer

from zeppelin.planner.cli import common
from zeppelin.planner.tools import config
from zeppelin.planner.tools.config import PlanConfig
from zeppelin.schemas.common import InputError
from zeppelin.schemas.io.safefiles import is_null_device


def _planner(name: str, options: dict):
    from zeppelin.planner.core.base import PLANNERS, construct_planner, get_planner
    from zeppelin.planner.zeppelin import planner as zeppelin_planner  # noqa: F401  (registers the zeppelin planners)

    if name in PLANNERS:  # the zeppelin planners: no need to import every baseline
        return construct_planner(name, **options)
    return get_planner(name, **options)


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
    from zeppelin.planner.tools.tables import wrapped

    out = []
    for opts, names in sorted(groups.items(), key=lambda g: g[1][0]):
        specs = opts.specs()
        out.append(wrapped(f"{', '.join(names)}:" + ("" if specs else " no options")) + "\n")
        for s in specs:
            allowed = f" {s.allowed};" if s.allowed else ""
            out.append(wrapped(f"  {s.name} ({s.type_name};{allowed} default {s.default_text}): {s.help}",
                               indent="      ") + "\n")
    out.append(wrapped("Set them in a check case's \"options\", with `zeppelin plan --option NAME=VALUE` (compare "
                       "and demo: -O PLANNER.NAME=VALUE), or as keyword arguments of get_planner(NAME, ...).") + "\n")
    return "".join(out)


@common.generated("plan", list_options=_list_options)
def plan(**values: Any) -> None:
    """Plan training steps: manifest + cluster + model -> plan file."""
    from zeppelin.planner.core.driver import check_steps, make_header
    from zeppelin.planner.core.sampler import StepSampler, run_max_seq_len
    from zeppelin.schemas.hf import check_positions

    cfg = PlanConfig.from_flags(values)
    _check_outputs(cfg)
    ctx, pl = _context_and_planner(cfg)
    if cfg.explain:
        from zeppelin.planner.tools.explain import explain_text

        typer.echo(explain_text(ctx, getattr(pl, "split_waste", None)))
        if cfg.output is None and cfg.save_case is None:
            return
    ds = common.load_dataset(cfg.manifest, *cfg.field_flags)
    sampler = cfg.sampler(ctx)
    if cfg.save_case is not None:
        from zeppelin.planner.tools.check import save_case

        held = ("cluster", "model", "steps", "seed", "max_seq_len", "tp", "zero_stage", "recompute", "overflow",
                *(f.name for f in config.FIELD_FLAGS))
        for line in save_case(cfg.save_case, manifest=cfg.manifest, planner=cfg.planner, options=pl.options,
                              tokens_per_step=sampler.tokens_per_step, shuffle=not cfg.no_shuffle,
                              **{k: getattr(cfg, k) for k in held}):
            typer.echo(line)
        if cfg.output is None:
            return
    ctx.max_seq_len = run_max_seq_len(ds, sampler)
    check_positions(cfg.model, ctx.max_seq_len)  # an hf:DIR model's max_position_embeddings

    # the steps are drawn again for each pass (the sampler is deterministic and cheap): checking
    # every step before any work, then planning and writing one step at a time, keeps a single
    # step's sequences and plan in memory however many steps the plan file holds
    def step_seqs():
        return StepSampler(ds, sampler).steps(cfg.steps)

    check_steps(step_seqs(), sampler)
    if hasattr(pl, "check_feasible"):
        for seqs in step_seqs():
            pl.check_feasible(ctx, seqs)
    header = make_header(ctx, pl, ds, sampler, cfg.steps)
    t0 = time.perf_counter()
    tally = _write_plan(cfg, ctx, pl, header, step_seqs())
    if tally.wall_hit:
        typer.echo(f"warning: step(s) {', '.join(map(str, tally.wall_hit))} hit the --time-limit wall-clock safety "
                   f"net: their plans depend on this machine's load and are not reproducible", err=True)
    if cfg.explain:
        from zeppelin.planner.tools.explain import plan_against_thresholds

        for line in plan_against_thresholds(ctx, tally.counts):
            typer.echo(line)
    if not cfg.quiet:
        _print_summary(cfg, ctx, pl, sampler, tally, time.perf_counter() - t0 - tally.counting_s)


def _check_outputs(cfg: PlanConfig) -> None:
    """Before any work: an output to write, files that can be written and are no input, and a
    ``--save-case`` a check case can hold."""
    from zeppelin.planner.core.inputs import check_path_writable, input_refs

    if cfg.output is None and not cfg.explain and cfg.save_case is None:
        raise InputError("missing -o/--output PLAN (or use --explain alone to see the tier thresholds)")
    inputs = [cfg.manifest, *input_refs(cfg.cluster, cfg.model, cfg.profile)]
    if is_null_device(cfg.output):  # -o /dev/null: plan every step, write nothing
        if cfg.stream:
            raise InputError("--stream writes the plan as it goes: drop it with -o /dev/null (plan and discard)")
    elif cfg.output is not None:
        check_path_writable(cfg.output, inputs)
        if cfg.stream:
            from zeppelin.schemas.io.stream import chain_path, check_stream_target

            check_stream_target(cfg.output)  # no live stream, nothing foreign at the chain's name
            check_path_writable(chain_path(cfg.output), inputs)
    if cfg.save_case is not None:
        from zeppelin.planner.tools.check import check_case_flags

        check_case_flags(cfg.save_case, cfg.beyond_case(),
                         [cfg.output, cfg.manifest, *input_refs(cfg.cluster, cfg.model)])


def _context_and_planner(cfg: PlanConfig):
    """The planning context (cluster, model, profile, tp, memory setting) and the planner with its options."""
    from zeppelin.planner.core.base import PlanningError
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
    from zeppelin.schemas.runnable import HF_TP_REASON, model_runs_tp

    cl = resolve_cluster(cfg.cluster)
    md = resolve_model(cfg.model)
    pf = resolve_profile(cfg.profile, cl)
    if cl.gpus_per_node % cfg.tp:
        raise PlanningError(f"--tp {cfg.tp} does not divide the {cl.gpus_per_node} GPUs per node of {cl.name}")
    if cfg.tp > 1 and not model_runs_tp(md):
        raise PlanningError(f"--tp {cfg.tp}: {HF_TP_REASON} (plan with --tp 1)")
    if not md.tp_splits_heads(cfg.tp):
        raise PlanningError(f"--tp {cfg.tp} does not divide the model's {md.num_heads} query and "
                            f"{md.num_kv_heads} key/value heads")
    ctx = cfg.context(cl, md, pf)
    return ctx, _planner(cfg.planner, cfg.planner_options(cfg.planner))


#: up to this many units the summary counts every step's inter-node traffic; beyond, one step in
#: ``ceil(units / TRAFFIC_ALL_MAX_UNITS)`` (steps 0, k, 2k, ...: the same steps on every run), labelled
#: as sampled: a step's traffic (its task graph, built by the simulator) costs more than planning it
#: on large clusters, and about as much more as the cluster is larger
TRAFFIC_ALL_MAX_UNITS = 64


class _Tally:
    """What ``plan`` counts while it writes: step / lower-bound ratios, solvers, wall-clock hits and
    the plan summary (the time spent counting it is left out of the planning time). Tiers and
    groups count every step; inter-node traffic every ``stride``-th step (see
    :data:`TRAFFIC_ALL_MAX_UNITS`), so the summary is the same whatever the machine's speed."""

    def __init__(self, stride: int = 1) -> None:
        from zeppelin.planner.sim.summary import PlanSummary

        self.ratios: list[float] = []
        self.solvers: dict[str, int] = {}
        self.wall_hit: list[int] = []
        self.counts = PlanSummary()
        self.counting_s = 0.0
        self.stride = max(1, stride)

    def add(self, st, sim) -> None:
        if st.prediction is not None and st.prediction.lower_bound_s > 0:
            self.ratios.append(st.prediction.step_time_s / st.prediction.lower_bound_s)
        if st.solver is not None:
            self.solvers[st.solver.name] = self.solvers.get(st.solver.name, 0) + 1
            if st.solver.status == "wall_clock_limit":
                self.wall_hit.append(st.step)
        if sim is not None:
            from zeppelin.planner.sim.summary import step_summary

            t1 = time.perf_counter()
            if st.step % self.stride == 0:
                self.counts.add(step_summary(sim.ctx, st, traffic=sim.nic_traffic(st)))
            else:
                one = step_summary(sim.ctx, st, traffic={})
                one.traffic_steps = 0
                self.counts.add(one)
            self.counting_s += time.perf_counter() - t1


class _Discard:
    """The plan writer of ``-o /dev/null``: takes every step, writes nothing."""

    def __enter__(self) -> "_Discard":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def write(self, step) -> None:
        return None


def _write_plan(cfg: PlanConfig, ctx, pl, header, steps) -> _Tally:
    """Plan ``steps`` one at a time and write each (streamed with ``--stream``)."""
    from zeppelin.planner.core.base import PlanningError
    from zeppelin.planner.core.driver import plan_steps
    from zeppelin.planner.sim.simulate import Simulator, context_from_header
    from zeppelin.schemas.plan import PlanWriter
    from zeppelin.schemas.runnable import step_problem

    tally = _Tally(stride=-(-ctx.num_units // TRAFFIC_ALL_MAX_UNITS))
    sim = None if cfg.quiet and not cfg.explain else Simulator(context_from_header(header))
    if is_null_device(cfg.output):
        writer = _Discard()
    elif cfg.stream:
        from zeppelin.schemas.io.stream import StreamingPlanWriter

        writer = StreamingPlanWriter(cfg.output, header, cfg.fmt)
    else:
        writer = PlanWriter(cfg.output, header, cfg.fmt)
    show = not cfg.quiet and sys.stderr.isatty()
    with writer as w:
        for st in plan_steps(ctx, pl, steps, workers=cfg.workers, progress=show, total=cfg.steps):
            why = step_problem(header, st)  # a plan file holds only steps zeppelin run executes
            if why:
                raise PlanningError(f"planner {pl.name} made a step zeppelin run cannot execute: {why}")
            w.write(st)
            tally.add(st, sim)
    return tally


def _print_summary(cfg: PlanConfig, ctx, pl, sampler, tally: _Tally, el: float) -> None:
    import numpy as np

    from zeppelin.planner.sim.summary import summary_lines

    cl, md, ratios = ctx.cluster, ctx.model, tally.ratios
    if cfg.json_out:
        import json

        typer.echo(json.dumps({
            "output": str(cfg.output), "steps": cfg.steps, "planner": pl.name, "model": md.name, "cluster": cl.name,
            "world_size": cl.world_size, "tokens_per_step": sampler.tokens_per_step, "planning_s": el,
            "step_over_lower_bound_median": float(np.median(ratios)) if ratios else None,
            "step_over_lower_bound_worst": float(max(ratios)) if ratios else None,
            "counts": tally.counts.to_dict(), "solvers": tally.solvers}, indent=1))
        return
    from zeppelin.planner.tools.tables import wrapped

    done = "planned (discarded: -o /dev/null)" if is_null_device(cfg.output) else f"wrote {cfg.output}"
    typer.echo(wrapped(f"{done}: {cfg.steps} steps planned by {pl.name} for {md.name} on {cl.name} "
                       f"({cl.world_size} GPUs) in {el:.2f} s ({el / cfg.steps * 1e3:.0f} ms/step)"))
    if ratios:
        r = np.array(ratios)
        typer.echo(f"predicted step / lower bound: median {np.median(r):.3f}, worst {r.max():.3f}")
    for line in summary_lines(tally.counts):
        typer.echo(line)
    if tally.solvers:
        typer.echo("solver: " + ", ".join(f"{k} x{v}" for k, v in sorted(tally.solvers.items())))


def validate(
    plan_path: Path = typer.Argument(..., metavar="PLAN", help="plan file"),
    cluster: str | None = common.option(config.CLUSTER.but(default=None,
                                                           help="check the plan was made for this cluster")),
    model: str | None = common.option(config.MODEL.but(default=None, help="check the plan was made for this model")),
    profile: str | None = common.option(config.PROFILE.but(help="check the plan was made with this profile")),
    manifest: str | None = common.option(config.MANIFEST.but(help="check the plan was made from this manifest")),
    length_field: str | None = common.option(config.LENGTH_FIELD),
    ids_field: str | None = common.option(config.IDS_FIELD),
    text_field: str | None = common.option(config.TEXT_FIELD),
    tokenizer: str | None = common.option(config.TOKENIZER),
    limit: int = typer.Option(10, "--limit", help="problems to print at most"),
) -> None:
    """Check a plan's invariants (coverage, memory, routes, ring order, input hashes) and that
    `zeppelin run` executes every step for the model (--model hf:DIR: no tensor parallelism).

    Exit 0 when valid, 1 with the first problems when not, 2 when the inputs cannot be read."""
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model
    from zeppelin.planner.tools.validate import validate_plan

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

    s: dict = {}  # the totals, from the same single pass over the plan
    probs = validate_plan(plan_path, cluster=cl, model=md, profile=pf, manifest=ds, limit=max(limit, 1),
                          hf=is_hf_ref(model) if model else None, summary=s)
    if probs:
        typer.echo(f"{plan_path}: INVALID ({len(probs)}{'+' if len(probs) >= limit else ''} problem"
                   f"{'s' if len(probs) != 1 else ''})", err=True)
        for p in probs[:limit]:
            typer.echo(f"  {p}", err=True)
        raise typer.Exit(1)
    msg = (f"{plan_path}: valid - {s['steps']} steps by {s['planner']}, {s['sequences']:,} sequences, "
           f"{s['tokens']:,} tokens on {s['world_size']} GPUs")
    if s["ratios"]:
        import numpy as np

        msg += f";\n  predicted step / lower bound median {float(np.median(s['ratios'])):.3f}"
    typer.echo(msg)
