"""`zeppelin demo | presets | schema`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from zeppelin.planner.cli import common
from zeppelin.schemas.common import MAX_SEED, MAX_TOKENS, InputError, check_float, check_int
from zeppelin.schemas.io.safefiles import atomic_write_text

SCHEMAS = ("cluster", "model", "manifest", "profile", "plan", "step", "case")


def _schema_cls(name: str):
    from zeppelin.schemas.cluster import ClusterSpec
    from zeppelin.schemas.manifest import ManifestSpec
    from zeppelin.schemas.model import ModelSpec
    from zeppelin.schemas.plan import PlanHeader, StepPlan
    from zeppelin.schemas.profile import CostProfile

    if name == "case":  # a `zeppelin check` case (planner/tools/check.py)
        from zeppelin.planner.tools.check import CheckCase

        return CheckCase
    return {"cluster": ClusterSpec, "model": ModelSpec, "manifest": ManifestSpec, "profile": CostProfile,
            "plan": PlanHeader, "step": StepPlan}[name]


def schema(
    name: str = typer.Argument(..., help=f"one of: {', '.join(SCHEMAS)} (plan = the header record, step = a step "
                                         f"record, case = a `zeppelin check` case)"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="write to this file instead of stdout"),
) -> None:
    """Print the JSON Schema of a zeppelin document."""
    key = name.strip().lower()
    if key not in SCHEMAS:
        raise InputError(f"unknown schema {name!r} (known: {', '.join(SCHEMAS)})")
    text = json.dumps(_schema_cls(key).model_json_schema(), indent=2) + "\n"
    if output:
        atomic_write_text(output, text)
    else:
        typer.echo(text, nl=False)


def presets(
    dump: Optional[str] = typer.Option(None, "--dump", help="print one preset as JSON (cluster or model name)"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="with --dump: write to this file"),
) -> None:
    """List the preset clusters and models; `--dump NAME -o FILE` to edit one and pass it back in."""
    from zeppelin.planner.tools.tables import console, table
    from zeppelin.schemas.cluster import CLUSTER_PRESETS, cluster_preset
    from zeppelin.schemas.model import MODEL_PRESETS, model_preset

    if dump:
        base = dump.split(":")[0]
        if base in CLUSTER_PRESETS:
            doc = cluster_preset(dump)
        elif dump in MODEL_PRESETS:
            doc = model_preset(dump)
        else:
            raise InputError(f"unknown preset {dump!r} (clusters: {', '.join(CLUSTER_PRESETS)}; "
                             f"models: {', '.join(MODEL_PRESETS)})")
        text = doc.model_dump_json(indent=2) + "\n"
        if output:
            atomic_write_text(output, text)
            typer.echo(f"wrote {output}")
        else:
            typer.echo(text, nl=False)
        return
    con = console()
    t = table("cluster presets  (NAME, NAME:NODES or NAME:NODESxGPUS)",
              ["name", "nodes x gpus", ("gpu", "left"), "TFLOP/s", "mem GB", "intra GB/s", "NICs x GB/s"])
    for n in CLUSTER_PRESETS:
        c = cluster_preset(n)
        t.add_row(n, f"{c.num_nodes} x {c.gpus_per_node}", c.gpu.name, f"{c.gpu.peak_tflops:g}",
                  f"{c.gpu.memory_gb:g}", f"{c.intra_link.bandwidth_GBps:g}",
                  f"{len(c.nics)} x {c.nics[0].bandwidth_GBps:g}")
    con.print(t)
    t = table("model presets", ["name", "layers", "hidden", "heads", "kv heads", "ffn", "vocab", ("mlp", "left"),
                                ("dtype", "left"), "params"])
    for n in MODEL_PRESETS:
        m = model_preset(n)
        p = m.num_params()
        t.add_row(n, str(m.num_layers), str(m.hidden), str(m.num_heads), str(m.num_kv_heads), str(m.ffn_hidden),
                  str(m.vocab_size), m.mlp, m.dtype, f"{p / 1e9:.2f}B" if p > 1e8 else f"{p / 1e6:.2f}M")
    con.print(t)


# ---------------------------------------------------------------------------------------------
# zeppelin demo
# ---------------------------------------------------------------------------------------------

DEMO_CLUSTER = "zeppelin-a"
DEMO_MODEL = "llama-7b"


@dataclass
class DemoContext:
    """What the demo stages share. Later stages (plan, simulate, run) add their results here."""

    console: Any
    cluster: Any
    model: Any
    profile: Any
    cost: Any
    dataset: Any
    sampler: Any  # SamplerConfig
    num_steps: int
    planners: list = field(default_factory=list)
    workers: int = 0
    png: Any = None  # where the picture goes (None: no picture)
    profile_given: bool = False  # the profile came from --profile (else the preset curves)
    baseline: str | None = None  # --baseline: the planner the verdict leads with
    time_limit: float | None = None  # --time-limit of the planners that solve ILPs
    results: dict = field(default_factory=dict)
    _steps: list | None = None

    @property
    def steps(self) -> list:
        """The sampled steps (lists of Sequence), drawn once and shared by every stage."""
        if self._steps is None:
            from zeppelin.planner.core.sampler import sample_steps

            self._steps = sample_steps(self.dataset, self.sampler, self.num_steps)
        return self._steps


def _stage_data(ctx: DemoContext) -> None:
    from zeppelin.planner.cli.data import print_stats

    print_stats(ctx.dataset, ctx.console, title=f"dataset  {ctx.dataset.source}")


def _ms(x: float) -> str:
    return f"{1e3 * x:,.2f}" if x < 1 else f"{1e3 * x:,.0f}"


def _stage_cost(ctx: DemoContext) -> None:
    """The per-step cost picture from the analytic cost model (no planning yet)."""
    import numpy as np

    from zeppelin.planner.cli.data import fmt_tokens
    from zeppelin.planner.tools.tables import table

    cm, con, cl = ctx.cost, ctx.console, ctx.cluster
    prof = ctx.profile
    cap = cm.token_capacity
    con.print(
        f"[bold]cost model[/bold]  {cl.name}: {cl.num_nodes} x {cl.gpus_per_node} {cl.gpu.name}, "
        f"{cl.gpu.peak_tflops:g} TFLOP/s, {cl.gpu.memory_gb:g} GB; NVLink {cl.intra_link.bandwidth_GBps:g} GB/s, "
        f"{len(cl.nics)} NICs x {cl.nics[0].bandwidth_GBps:g} GB/s per node; model {ctx.model.name} "
        f"({ctx.model.num_params() / 1e9:.2f}B params, {ctx.model.num_layers} layers); profile: {prof.source.kind}"
    )
    con.print(f"per-GPU memory after model states (ZeRO-{cm.zero_stage}, {cm.num_units}-way DP): "
              f"{cap:,} tokens of activations; a sequence longer than that must be split across GPUs")

    attn_f = 1.0 + prof.backward_attention_factor
    lin_f = 1.0 + prof.backward_linear_factor
    t = table(f"sampled steps  (tokens_per_step={ctx.sampler.tokens_per_step:,}, shuffle={ctx.sampler.shuffle}, "
              f"seed={ctx.sampler.seed})",
              [(c, "right") for c in ("step", "seqs", "tokens", "longest", "attn % FLOPs", "top 5% % work",
                                      "longest % work", "GPUs to hold it", "ideal step s", "longest alone s")])
    rows = []
    for i, seqs in enumerate(ctx.steps):
        L = np.array([s.length for s in seqs], dtype=np.float64)
        attn = float((cm.attn_flops_fwd(L) * attn_f).sum())
        lin = float((cm.linear_flops_fwd(L) * lin_f).sum())
        work = cm.work(L)
        order = np.sort(work)[::-1]
        top = max(1, int(np.ceil(0.05 * L.size)))
        total = float(work.sum())
        longest = int(L.max())
        need = min(int(np.ceil(longest / cap)), cm.num_units) if cap > 0 else cm.num_units
        row = dict(step=i, seqs=int(L.size), tokens=int(L.sum()), longest=longest,
                   attn_flop_share=attn / (attn + lin), top5_work_share=float(order[:top].sum() / total),
                   longest_work_share=float(order[0] / total), gpus_to_hold_longest=need,
                   ideal_step_s=total / cm.num_units, longest_alone_s=cm.best_time_of_sequence(longest, need))
        rows.append(row)
        t.add_row(str(i), f"{row['seqs']:,}", fmt_tokens(row["tokens"]), fmt_tokens(longest),
                  f"{100 * row['attn_flop_share']:.1f}", f"{100 * row['top5_work_share']:.1f}",
                  f"{100 * row['longest_work_share']:.1f}", str(need), f"{row['ideal_step_s']:.2f}",
                  f"{row['longest_alone_s']:.2f}")
    ctx.results["steps"] = rows
    con.print(t)
    con.print("ideal step s = the step's work spread evenly over all GPUs; longest alone s = its longest sequence "
              "spread over just the GPUs needed to hold it (no communication)")

    # why tiers: per length, ring compute per round vs the K/V transfer it must hide
    g_intra = cl.gpus_per_node // cm.tp
    g_inter = cm.num_units
    n_nics = len(cl.nics)
    lens = ctx.dataset.lengths
    hi = int(np.floor(np.log2(max(int(lens.max()), 2))))
    lo = min(9, hi)

    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.zeppelin.tiering import Tiering

    tiering = Tiering(PlanContext(cl, cm.model, cm.profile, tp=cm.tp, zero_stage=cm.zero_stage))

    def ring(Lv, G, tier, nics=1):
        comp = cm.ring_round_compute(Lv, G)[1]  # one later round: two full blocks of L/(2G)
        # a ring spanning nodes is paced by its node-crossing hop: one NIC, or spread over all of them
        # by routing (same NIC-sharing and dispatch/combine model as the planner's tiering)
        share = tiering.inter_sharers(nics) if tier == "inter" else 1.0
        comm = cm.p2p_time(cm.ring_round_bytes(Lv / G), cm.tier_link(tier), share)
        return comp, comm

    def split_extra(Lv):
        """Extra attention device time of a ring over the node's GPUs vs one GPU: its 2G chunks run as
        small blocks, at the efficiency (and launch overhead) of small kernels."""
        return float(g_intra * cm.ring_compute_time(Lv, g_intra) / cm.attn_time(Lv)) - 1.0 if g_intra > 1 else 0.0

    colour = con.color_system is not None

    def cell(comp, comm):
        if not colour:  # no colour on this output: a mark says what red would
            return _ms(comm) + ("" if comp >= comm else "*")
        color = "green" if comp >= comm else "red"
        return f"[{color}]{_ms(comm)}[/{color}]"

    multi = cl.num_nodes > 1
    cols = ["length", "% samples", "% tokens", "1 GPU ms", f"{g_intra}-GPU extra %", f"{g_intra}-GPU comp ms",
            "NVLink comm ms"]
    if multi:
        cols += [f"{g_inter}-GPU comp ms", "1 NIC comm ms", f"{n_nics} NICs comm ms"]
    legend = "green = hidden, red = exposed" if colour else "* = exposed (not hidden)"
    t = table("why tiers: per layer, a ring round's attention compute (comp) must hide its K/V transfer; "
              f"{legend} (times at the bucket's lower edge)", [(c, "right") for c in cols],
              drop=["% samples", f"{g_intra}-GPU extra %", "1 GPU ms", "% tokens", *reversed(cols[4:])])
    for k in range(lo, hi + 1):
        L = float(1 << k)
        in_b = (lens >= (1 << k)) & (lens < (1 << (k + 1))) if k > lo else lens < (1 << (k + 1))
        c_i, m_i = ring(L, g_intra, "intra")
        c_x, m_x = ring(L, g_inter, "inter")
        _, m_r = ring(L, g_inter, "inter", n_nics)
        row = [f"{fmt_tokens(L)}-{fmt_tokens(2 * L)}", f"{100 * in_b.mean():.2f}",
               f"{100 * lens[in_b].sum() / lens.sum():.2f}", _ms(float(cm.attn_time(L) + cm.linear_time(L))),
               f"{100 * split_extra(L):.0f}", _ms(float(c_i)), cell(c_i, m_i)]
        if multi:
            row += [_ms(float(c_x)), cell(c_x, m_x), cell(c_x, m_r)]
        t.add_row(*row)
    con.print(t)
    grid = np.geomspace(256, 1 << 22, 4000)
    cross = {}
    cases = [("intra", g_intra, "intra", 1)]
    if multi:
        cases += [("inter_1nic", g_inter, "inter", 1), ("inter_routed", g_inter, "inter", n_nics)]
    for key, G, tier, nics in cases:
        comp, comm = ring(grid, G, tier, nics)
        ok = comp >= comm
        # the crossover: from here on every longer length hides (tiny lengths can hide spuriously,
        # a kernel's launch overhead covering a tiny transfer)
        bad = np.flatnonzero(~ok)
        if not ok.any() or (len(bad) and bad[-1] == len(grid) - 1):
            cross[key] = None
        else:
            cross[key] = int(grid[bad[-1] + 1 if len(bad) else 0])
    ctx.results["crossover_tokens"] = cross

    def _c(v):
        return f"~{fmt_tokens(v)}" if v else "never (up to 4M)"

    frac_local = float((lens < (cross["intra"] or np.inf)).mean())
    across = (f", {_c(cross['inter_1nic'])} across nodes through one NIC, {_c(cross['inter_routed'])} when the "
              f"crossing is routed over all {n_nics} NICs of a node" if multi else "")
    med = float(np.median(lens))
    ctx.results["split_extra_at_median"] = split_extra(med)
    why_local = (f"{100 * frac_local:.1f}% of the samples are below the intra-node crossover: splitting them only "
                 f"adds exposed communication" if cross["intra"] and cross["intra"] > 256 else
                 f"but splitting is not free: a ring over {g_intra} GPUs spends {100 * split_extra(med):.0f}% more "
                 f"attention device time than one GPU at the median sample ({fmt_tokens(med)} tokens; its chunks run "
                 f"as small, inefficient kernels) and {100 * split_extra(65536.0):.0f}% more at 64K")
    con.print(f"ring communication hides from {_c(cross['intra'])} tokens inside a node{across}; {why_local}. "
              f"So short sequences stay local (balanced across GPUs), longer ones split inside a node, and "
              f"only the longest ones should span nodes (tiers: local / intra-node / inter-node).")


# zeppelin and the main baselines: TransformerEngine CP as run (te-cp) and tuned per step, static
# Ulysses, the FLOP-based hybrid, Megatron's dynamic CP, FlexSP and Hydraulis
DEMO_PLANNERS = ["zeppelin", "te-cp", "te-cp-tuned", "ulysses", "hybrid-dp", "megatron-dcp", "flexsp", "hydraulis"]


def _stage_plan(ctx: DemoContext) -> None:
    """Plan the sampled steps with zeppelin and the main baselines, simulate every plan, print the
    side-by-side table and draw one step's per-GPU timeline (zeppelin vs te-cp) and the speedups."""
    import time

    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.core.sampler import run_max_seq_len
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.planner.tools.compare import (
        SOLVER_PLANNERS,
        comparison,
        default_workers,
        prediction_error,
        render_table,
        run_compare,
        verdict,
        verdict_lines,
    )
    from zeppelin.planner.tools.show import draw_demo_png

    con = ctx.console
    pctx = PlanContext(ctx.cluster, ctx.model, ctx.profile, tp=ctx.cost.tp, zero_stage=ctx.cost.zero_stage,
                       seed=ctx.sampler.seed)
    pctx.max_seq_len = run_max_seq_len(ctx.dataset, ctx.sampler)
    steps = ctx.steps
    t0 = time.perf_counter()
    keep = {("zeppelin", 0), ("te-cp", 0)}
    tl = ctx.time_limit
    options = {p: {"time_limit": tl} for p in ctx.planners if tl and p in ("zeppelin", *SOLVER_PLANNERS)}
    runs = run_compare(pctx, steps, ctx.planners, options, workers=ctx.workers or default_workers(), keep=keep,
                       progress=True)
    wall = time.perf_counter() - t0
    doc = comparison(runs)
    doc["prediction_error"] = prediction_error(ctx.profile, given=ctx.profile_given)
    ctx.results["comparison"] = doc
    title = (f"{len(steps)} step(s) of the sample planned by every planner and simulated "
             f"({ctx.cluster.name}, {ctx.cluster.world_size} GPUs, {ctx.model.name}; {wall:.1f} s)")
    con.print(render_table(doc, title))
    doc["verdict"] = verdict(doc, pctx, steps, baseline=ctx.baseline)
    for line in verdict_lines(doc["verdict"]):
        con.print(line, highlight=False, markup=False)
    con.print(f"te-cp's CP size is set by the longest allowed sequence, {pctx.max_seq_len:,} tokens, as "
              f"TransformerEngine jobs run; planner names and terms: docs/CONCEPTS.md", highlight=False)
    if ctx.png is None:
        return
    by = {r.planner: r for r in runs}
    timelines = []
    sim = Simulator(pctx)
    for name in ("zeppelin", "te-cp"):
        r = by.get(name)
        if r is not None and 0 in r.plans:
            timelines.append((name, sim.simulate_step(r.plans[0], timeline=True)))
    speedups = [(s["planner"], s["speedup_vs_te_cp"]) for s in doc["planners"] if "speedup_vs_te_cp" in s]
    spreads = {s["planner"]: (s["speedup_vs_te_cp_p10"], s["speedup_vs_te_cp_p90"]) for s in doc["planners"]
               if "speedup_vs_te_cp_p10" in s}
    if not timelines or not speedups:
        con.print("no picture: zeppelin or te-cp could not plan these steps")
        return
    draw_demo_png(timelines, speedups, "te-cp",
                  f"step 0 per GPU (the whole step), and the speedup over te-cp of every planner - "
                  f"{ctx.cluster.name}, {ctx.cluster.world_size} GPUs, {ctx.model.name}", ctx.png, spreads=spreads)
    ctx.results["png"] = str(ctx.png)
    con.print(f"wrote {ctx.png} (per-GPU timeline of step 0: zeppelin vs te-cp; speedup bars)")


# name -> stage function, in execution order
DEMO_STAGES: dict[str, Callable[[DemoContext], None]] = {
    "data": _stage_data,
    "cost": _stage_cost,
    "plan": _stage_plan,
}


def demo(
    manifest: Optional[str] = common.manifest_option(),
    cluster: str = common.cluster_option(DEMO_CLUSTER),
    model: str = common.model_option(DEMO_MODEL),
    profile: Optional[str] = common.profile_option(),
    tokens_per_step: Optional[int] = common.tokens_option(),
    max_seq_len: Optional[int] = common.max_seq_len_option(),
    steps: int = common.steps_option(2),
    seed: int = common.seed_option(),
    time_limit: Optional[float] = common.time_limit_option(),
    length_field: Optional[str] = common.length_field_option(),
    ids_field: Optional[str] = common.ids_field_option(),
    text_field: Optional[str] = common.text_field_option(),
    tokenizer: Optional[str] = common.tokenizer_option(),
    stages: str = typer.Option(",".join(DEMO_STAGES), "--stages",
                               help=f"comma-separated stages to run (available: {', '.join(DEMO_STAGES)})"),
    planners: str = typer.Option(",".join(DEMO_PLANNERS), "--planners", help="planners of the plan stage"),
    baseline: Optional[str] = typer.Option(None, "--baseline", metavar="NAME",
                                           help="the planner closest to what you run today: the verdict leads "
                                                "with it (docs/CONCEPTS.md)"),
    png: Path = typer.Option(Path("zeppelin-demo.png"), "--png",
                             help="where the plan stage writes its picture (per-GPU timeline, speedup bars)"),
    workers: int = typer.Option(0, "--workers", "-j", help="worker processes of the plan stage (0: one per CPU)"),
    json_out: bool = common.json_option("also print the results as JSON (on stdout; the tables then go to stderr)"),
    output: Optional[Path] = common.output_option("write the results as JSON to this file"),
) -> None:
    """Run the main job on built-in defaults (shipped sample manifest, preset cluster and model):
    data statistics, the cost picture, then the sampled steps planned by zeppelin and the main
    baselines - side-by-side table and a picture of one step."""
    from zeppelin.planner.core.inputs import (
        check_path_writable,
        resolve_cluster,
        resolve_model,
        resolve_profile,
    )
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.planner.tools.tables import console
    from zeppelin.schemas.plan import SamplerConfig

    wanted = [s.strip() for s in stages.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in DEMO_STAGES]
    if unknown or not wanted:
        raise InputError(f"unknown demo stage {(unknown or [stages])[0]!r} (available: {', '.join(DEMO_STAGES)})")
    check_int("--steps", steps, 1, 10_000)
    check_int("--tokens-per-step", tokens_per_step, 1, MAX_TOKENS)
    check_int("--max-seq-len", max_seq_len, 1, 2**31)
    check_int("--seed", seed, 0, MAX_SEED)
    check_int("--workers", workers, 0, 1024)
    check_float("--time-limit", time_limit, 0.0, 3600.0, lo_open=True)
    names = [p.strip() for p in planners.split(",") if p.strip()]
    if baseline is not None and baseline not in names:
        raise InputError(f"--baseline {baseline!r} is not among the demo's planners ({', '.join(names)})")
    if "plan" in wanted:
        from zeppelin.planner.core.base import get_planner

        if not names:
            raise InputError("--planners is empty")
        for p in names:
            get_planner(p)  # unknown names fail before any work
        check_path_writable(png, [manifest])
    if output is not None:
        check_path_writable(output, [manifest, png])
    cl = resolve_cluster(cluster)
    mo = resolve_model(model)
    pr = resolve_profile(profile, cl)
    try:
        cm = CostModel(cl, mo, pr)
    except ValueError as e:
        raise InputError(str(e)) from None
    ds = common.load_dataset(manifest, length_field, ids_field, text_field, tokenizer)
    cfg = SamplerConfig(tokens_per_step=tokens_per_step or common.default_tokens_per_step(cm.token_capacity,
                                                                                          cm.num_units),
                        seed=seed, max_seq_len=max_seq_len)
    ctx = DemoContext(console=console(stderr=json_out and output is None), cluster=cl, model=mo, profile=pr,
                      cost=cm, dataset=ds, sampler=cfg, num_steps=steps, planners=names, workers=workers, png=png,
                      profile_given=profile is not None, baseline=baseline, time_limit=time_limit)
    for name in DEMO_STAGES:
        if name in wanted:
            DEMO_STAGES[name](ctx)
    if json_out or output is not None:
        text = json.dumps(_jsonable(ctx.results), indent=1) + "\n"
        if output is not None:
            atomic_write_text(output, text)
            ctx.console.print(f"wrote {output}", highlight=False, markup=False)
        else:
            typer.echo(text, nl=False)


def _jsonable(x: Any) -> Any:
    """The demo's results as JSON values (numpy scalars as numbers, plans left out)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)
