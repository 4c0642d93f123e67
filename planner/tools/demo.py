"""``zeppelin demo``: the main job on built-in defaults, in stages.

``data`` prints the manifest's statistics, ``cost`` the per-step cost picture of the analytic cost
model (no planning: the sampled steps, and why short sequences stay local while long ones split,
from a ring round's compute against its K/V transfer), ``plan`` the sampled steps planned by
zeppelin and the main baselines, simulated side by side, with the verdict and a picture of one step.
The stages share a :class:`DemoContext`; :func:`run_demo` runs the ones asked for from a
``DemoConfig`` (:mod:`zeppelin.planner.tools.config`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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
    options: dict = field(default_factory=dict)  # planner -> its options (the flags that set them, -O)
    results: dict = field(default_factory=dict)
    _steps: list | None = None

    @property
    def steps(self) -> list:
        """The sampled steps (lists of Sequence), drawn once and shared by every stage."""
        if self._steps is None:
            from zeppelin.planner.core.sampler import sample_steps

            self._steps = sample_steps(self.dataset, self.sampler, self.num_steps)
        return self._steps

    def plan_context(self) -> Any:
        """A planning context of the demo's cluster, model, profile and memory setting."""
        from zeppelin.planner.core.base import PlanContext

        cm = self.cost
        return PlanContext(self.cluster, self.model, self.profile, tp=cm.tp, zero_stage=cm.zero_stage,
                           seed=self.sampler.seed, recompute=cm.recompute)


def _ms(x: float) -> str:
    return f"{1e3 * x:,.2f}" if x < 1 else f"{1e3 * x:,.0f}"


# ------------------------------------------------------------------ stage: data
def _stage_data(ctx: DemoContext) -> None:
    from zeppelin.planner.tools.tables import print_stats

    print_stats(ctx.dataset, ctx.console, title=f"dataset  {ctx.dataset.source}")


# ------------------------------------------------------------------ stage: cost
def _stage_cost(ctx: DemoContext) -> None:
    """The per-step cost picture from the analytic cost model (no planning yet)."""
    _print_setting(ctx)
    ctx.results["steps"] = _sampled_steps(ctx)
    rings = _Rings(ctx)
    _print_tiers_table(ctx, rings)
    ctx.results["crossover_tokens"] = cross = rings.crossovers()
    _print_why_tiers(ctx, rings, cross)


def _print_setting(ctx: DemoContext) -> None:
    cm, con, cl, prof = ctx.cost, ctx.console, ctx.cluster, ctx.profile
    con.print(
        f"[bold]cost model[/bold]  {cl.name}: {cl.num_nodes} x {cl.gpus_per_node} {cl.gpu.name}, "
        f"{cl.gpu.peak_tflops:g} TFLOP/s, {cl.gpu.memory_gb:g} GB; NVLink {cl.intra_link.bandwidth_GBps:g} GB/s, "
        f"{len(cl.nics)} NICs x {cl.nics[0].bandwidth_GBps:g} GB/s per node; model {ctx.model.name} "
        f"({ctx.model.num_params() / 1e9:.2f}B params, {ctx.model.num_layers} layers); profile: {prof.source.kind}"
    )
    con.print(f"per-GPU memory after model states (ZeRO-{cm.zero_stage}, {cm.num_units}-way DP): "
              f"{cm.token_capacity:,} tokens of activations; a sequence longer than that must be split across GPUs")


def _sampled_steps(ctx: DemoContext) -> list[dict[str, Any]]:
    """The table of the sampled steps: their attention share of the FLOPs, how concentrated their work
    is, and their ideal step time against their longest sequence alone; its rows."""
    import numpy as np

    from zeppelin.planner.tools.tables import fmt_tokens, table

    cm, prof = ctx.cost, ctx.profile
    cap = cm.token_capacity
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
        row = {"step": i, "seqs": int(L.size), "tokens": int(L.sum()), "longest": longest,
               "attn_flop_share": attn / (attn + lin), "top5_work_share": float(order[:top].sum() / total),
               "longest_work_share": float(order[0] / total), "gpus_to_hold_longest": need,
               "ideal_step_s": total / cm.num_units, "longest_alone_s": cm.best_time_of_sequence(longest, need)}
        rows.append(row)
        t.add_row(str(i), f"{row['seqs']:,}", fmt_tokens(row["tokens"]), fmt_tokens(longest),
                  f"{100 * row['attn_flop_share']:.1f}", f"{100 * row['top5_work_share']:.1f}",
                  f"{100 * row['longest_work_share']:.1f}", str(need), f"{row['ideal_step_s']:.2f}",
                  f"{row['longest_alone_s']:.2f}")
    ctx.console.print(t)
    ctx.console.print("ideal step s = the step's work spread evenly over all GPUs; longest alone s = its longest "
                      "sequence spread over just the GPUs needed to hold it (no communication)")
    return rows


class _Rings:
    """Why tiers: per length, a ring round's compute against the K/V transfer it must hide, inside a
    node (over NVLink) and across nodes (one NIC, or routed over all of a node's NICs)."""

    def __init__(self, ctx: DemoContext) -> None:
        from zeppelin.planner.zeppelin.tiering import Tiering

        cm, cl = ctx.cost, ctx.cluster
        self.cm = cm
        self.g_intra = cl.gpus_per_node // cm.tp
        self.g_inter = cm.num_units
        self.n_nics = len(cl.nics)
        self.multi = cl.num_nodes > 1
        self.tiering = Tiering(ctx.plan_context())

    def ring(self, L, G: int, tier: str, nics: int = 1):
        """(compute, transfer) of one later round (two full blocks of L/(2G)) of a ring over G units."""
        cm = self.cm
        comp = cm.ring_round_compute(L, G)[1]
        # a ring spanning nodes is paced by its node-crossing hop: one NIC, or spread over all of them
        # by routing (same NIC-sharing and dispatch/combine model as the planner's tiering)
        share = self.tiering.inter_sharers(nics) if tier == "inter" else 1.0
        comm = cm.p2p_time(cm.ring_round_bytes(L / G), cm.tier_link(tier), share)
        return comp, comm

    def split_extra(self, L: float) -> float:
        """Extra attention device time of a ring over the node's GPUs vs one GPU: its 2G chunks run as
        small blocks, at the efficiency (and launch overhead) of small kernels."""
        g, cm = self.g_intra, self.cm
        return float(g * cm.ring_compute_time(L, g) / cm.attn_time(L)) - 1.0 if g > 1 else 0.0

    def crossovers(self) -> dict[str, int | None]:
        """Per case, the length from which every longer one hides its transfer (None: none up to 4M)."""
        import numpy as np

        grid = np.geomspace(256, 1 << 22, 4000)
        cases = [("intra", self.g_intra, "intra", 1)]
        if self.multi:
            cases += [("inter_1nic", self.g_inter, "inter", 1), ("inter_routed", self.g_inter, "inter", self.n_nics)]
        cross: dict[str, int | None] = {}
        for key, G, tier, nics in cases:
            comp, comm = self.ring(grid, G, tier, nics)
            ok = comp >= comm
            # the crossover: from here on every longer length hides (tiny lengths can hide spuriously,
            # a kernel's launch overhead covering a tiny transfer)
            bad = np.flatnonzero(~ok)
            if not ok.any() or (len(bad) and bad[-1] == len(grid) - 1):
                cross[key] = None
            else:
                cross[key] = int(grid[bad[-1] + 1 if len(bad) else 0])
        return cross


def _print_tiers_table(ctx: DemoContext, rings: _Rings) -> None:
    """Per log2 length bucket of the data: the share of samples and tokens, and whether a ring round
    inside a node and across nodes hides its transfer."""
    import numpy as np

    from zeppelin.planner.tools.tables import fmt_tokens, table

    con, cm, g_intra = ctx.console, ctx.cost, rings.g_intra
    lens = ctx.dataset.lengths
    hi = int(np.floor(np.log2(max(int(lens.max()), 2))))
    lo = min(9, hi)
    colour = con.color_system is not None

    def cell(comp, comm):
        if not colour:  # no colour on this output: a mark says what red would
            return _ms(comm) + ("" if comp >= comm else "*")
        color = "green" if comp >= comm else "red"
        return f"[{color}]{_ms(comm)}[/{color}]"

    cols = ["length", "% samples", "% tokens", "1 GPU ms", f"{g_intra}-GPU extra %", f"{g_intra}-GPU comp ms",
            "NVLink comm ms"]
    if rings.multi:
        cols += [f"{rings.g_inter}-GPU comp ms", "1 NIC comm ms", f"{rings.n_nics} NICs comm ms"]
    legend = "green = hidden, red = exposed" if colour else "* = exposed (not hidden)"
    t = table("why tiers: per layer, a ring round's attention compute (comp) must hide its K/V transfer; "
              f"{legend} (times at the bucket's lower edge)", [(c, "right") for c in cols],
              drop=["% samples", f"{g_intra}-GPU extra %", "1 GPU ms", "% tokens", *reversed(cols[4:])])
    for k in range(lo, hi + 1):
        L = float(1 << k)
        in_b = (lens >= (1 << k)) & (lens < (1 << (k + 1))) if k > lo else lens < (1 << (k + 1))
        c_i, m_i = rings.ring(L, g_intra, "intra")
        row = [f"{fmt_tokens(L)}-{fmt_tokens(2 * L)}", f"{100 * in_b.mean():.2f}",
               f"{100 * lens[in_b].sum() / lens.sum():.2f}", _ms(float(cm.attn_time(L) + cm.linear_time(L))),
               f"{100 * rings.split_extra(L):.0f}", _ms(float(c_i)), cell(c_i, m_i)]
        if rings.multi:
            c_x, m_x = rings.ring(L, rings.g_inter, "inter")
            _, m_r = rings.ring(L, rings.g_inter, "inter", rings.n_nics)
            row += [_ms(float(c_x)), cell(c_x, m_x), cell(c_x, m_r)]
        t.add_row(*row)
    con.print(t)


def _print_why_tiers(ctx: DemoContext, rings: _Rings, cross: dict[str, int | None]) -> None:
    """The conclusion of the tier table, in a sentence."""
    import numpy as np

    from zeppelin.planner.tools.tables import fmt_tokens

    def _c(v):
        return f"~{fmt_tokens(v)}" if v else "never (up to 4M)"

    lens = ctx.dataset.lengths
    frac_local = float((lens < (cross["intra"] or np.inf)).mean())
    across = (f", {_c(cross['inter_1nic'])} across nodes through one NIC, {_c(cross['inter_routed'])} when the "
              f"crossing is routed over all {rings.n_nics} NICs of a node" if rings.multi else "")
    med = float(np.median(lens))
    ctx.results["split_extra_at_median"] = rings.split_extra(med)
    why_local = (f"{100 * frac_local:.1f}% of the samples are below the intra-node crossover: splitting them only "
                 f"adds exposed communication" if cross["intra"] and cross["intra"] > 256 else
                 f"but splitting is not free: a ring over {rings.g_intra} GPUs spends "
                 f"{100 * rings.split_extra(med):.0f}% more attention device time than one GPU at the median sample "
                 f"({fmt_tokens(med)} tokens; its chunks run as small, inefficient kernels) and "
                 f"{100 * rings.split_extra(65536.0):.0f}% more at 64K")
    ctx.console.print(f"ring communication hides from {_c(cross['intra'])} tokens inside a node{across}; "
                      f"{why_local}. So short sequences stay local (balanced across GPUs), longer ones split inside a "
                      f"node, and only the longest ones should span nodes (tiers: local / intra-node / inter-node).")


# ------------------------------------------------------------------ stage: plan
def _stage_plan(ctx: DemoContext) -> None:
    """Plan the sampled steps with zeppelin and the main baselines, simulate every plan, print the
    side-by-side table and draw one step's per-GPU timeline (zeppelin vs te-cp) and the speedups."""
    import time

    from zeppelin.planner.core.sampler import run_max_seq_len
    from zeppelin.planner.tools.compare import (
        comparison,
        default_workers,
        prediction_error,
        render_table,
        run_compare,
        verdict,
        verdict_lines,
    )

    con = ctx.console
    pctx = ctx.plan_context()
    pctx.max_seq_len = run_max_seq_len(ctx.dataset, ctx.sampler)
    steps = ctx.steps
    t0 = time.perf_counter()
    keep = {("zeppelin", 0), ("te-cp", 0)}
    runs = run_compare(pctx, steps, ctx.planners, ctx.options, workers=ctx.workers or default_workers(), keep=keep,
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
    te_cp = next((r for r in doc["verdict"].get("rows", []) if r["baseline"] == "te-cp"), None)
    if te_cp is not None and "cp" not in te_cp["options"]:  # (-O te-cp.cp=N sets it)
        con.print(f"te-cp's CP size is set by the longest allowed sequence, {pctx.max_seq_len:,} tokens, as "
                  f"TransformerEngine jobs run; planner names and terms: docs/CONCEPTS.md", highlight=False)
    if ctx.png is not None:
        _draw_picture(ctx, pctx, runs, doc)


def _draw_picture(ctx: DemoContext, pctx: Any, runs: list, doc: dict[str, Any]) -> None:
    """Step 0 per GPU (zeppelin and te-cp) and zeppelin's speedup over each baseline, as a PNG."""
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.planner.tools.show import draw_demo_png

    by = {r.planner: r for r in runs}
    timelines = []
    sim = Simulator(pctx)
    for name in ("zeppelin", "te-cp"):
        r = by.get(name)
        if r is not None and 0 in r.plans:
            timelines.append((name, sim.simulate_step(r.plans[0], timeline=True)))
    # zeppelin's speedup over each baseline (the verdict's rows), not every planner against te-cp: a
    # weak te-cp would make every bar look alike and zeppelin's lead over the strong ones vanish
    rows = doc.get("verdict", {}).get("rows", [])
    speedups = [(r["baseline"], r["speedup"]) for r in rows]
    spreads = {r["baseline"]: (r["p10"], r["p90"]) for r in rows}
    if not timelines or not speedups:
        ctx.console.print("no picture: zeppelin or te-cp could not plan these steps")
        return
    draw_demo_png(timelines, speedups, "zeppelin's speedup over each baseline",
                  f"step 0 per GPU (the whole step), and zeppelin's speedup over each baseline - "
                  f"{ctx.cluster.name}, {ctx.cluster.world_size} GPUs, {ctx.model.name}", ctx.png, spreads=spreads)
    ctx.results["png"] = str(ctx.png)
    ctx.console.print(f"wrote {ctx.png} (per-GPU timeline of step 0: zeppelin vs te-cp; zeppelin's speedup over "
                      f"each baseline)")


#: name -> stage function, in execution order
DEMO_STAGES: dict[str, Callable[[DemoContext], None]] = {
    "data": _stage_data,
    "cost": _stage_cost,
    "plan": _stage_plan,
}


# ------------------------------------------------------------------ the whole demo
def run_demo(cfg: Any) -> DemoContext:
    """The stages ``cfg`` (a ``DemoConfig``) asks for; their results are in the returned context."""
    from zeppelin.planner.core.inputs import (
        check_path_writable,
        resolve_cluster,
        resolve_model,
        resolve_profile,
    )
    from zeppelin.planner.tools.tables import console
    from zeppelin.schemas.common import InputError

    wanted = [s.strip() for s in cfg.stages.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in DEMO_STAGES]
    if unknown or not wanted:
        raise InputError(f"unknown demo stage {(unknown or [cfg.stages])[0]!r} (available: {', '.join(DEMO_STAGES)})")
    names = [p.strip() for p in cfg.planners.split(",") if p.strip()]
    if cfg.baseline is not None and cfg.baseline not in names:
        raise InputError(f"--baseline {cfg.baseline!r} is not among the demo's planners ({', '.join(names)})")
    options = {}
    if "plan" in wanted:
        if not names:
            raise InputError("--planners is empty")
        options = cfg.options_by_planner(names, "the demo's planners")  # unknown names fail before any work
        check_path_writable(cfg.png, [cfg.manifest])
    if cfg.output is not None:
        check_path_writable(cfg.output, [cfg.manifest, cfg.png])
    cl = resolve_cluster(cfg.cluster)
    mo = resolve_model(cfg.model)
    pr = resolve_profile(cfg.profile, cl)
    pctx = cfg.context(cl, mo, pr)
    from zeppelin.planner.core.inputs import load_dataset

    ds = load_dataset(cfg.manifest, *cfg.field_flags)
    ctx = DemoContext(console=console(stderr=cfg.json_out and cfg.output is None), cluster=cl, model=mo, profile=pr,
                      cost=pctx.cost, dataset=ds, sampler=cfg.sampler(pctx), num_steps=cfg.steps, planners=names,
                      workers=cfg.workers, png=cfg.png, profile_given=cfg.profile is not None,
                      baseline=cfg.baseline, options=options)
    for name, stage in DEMO_STAGES.items():
        if name in wanted:
            stage(ctx)
    return ctx


def jsonable(x: Any) -> Any:
    """The demo's results as JSON values (numpy scalars as numbers, plans left out)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)
