"""The comparison grid of docs/RESULTS.md, in one command.

    .venv/bin/python benchmarks/bench_compare.py            # writes docs/RESULTS.md, docs/img/*.png,
                                                            # docs/results.json; prints the summary JSON
    ... --partial cells.jsonl       # the same, each finished cell kept in cells.jsonl: run again to resume
    ... --recompute-only --gpus 64  # zeppelin under auto and each global recompute mode only: the page's
                                    # recomputation section and results_recompute.json (--recompute-merge
                                    # joins the results_recompute.json of several such runs)

Grid: clusters A and C (``zeppelin-a``, ``zeppelin-c``) x LLaMA-7B (tp=1) and LLaMA-13B (tp=2, as
the Zeppelin paper runs 13B with tensor parallelism) x the synthetic length mixes short / mixed /
long (:data:`zeppelin.planner.tools.compare.MIXES`) x 16 / 32 / 64 / 128 GPUs, and beside it the
long-tail cells of :data:`LONG_TAIL_CELLS`. Every cell plans the same
sampled steps with every planner and simulates them (:func:`zeppelin.planner.tools.compare.run_compare`).
The page states the speedups and checks the papers' qualitative findings from the numbers of this
run; nothing on it is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = {"A": "zeppelin-a", "C": "zeppelin-c"}
MODELS = {"llama-7b": 1, "llama-13b": 2}  # model -> tensor-parallel degree
#: model -> ZeRO stage: the runtime keeps every parameter whole on each TP rank (TP ranks multiply
#: slices of them), so LLaMA-13B's TP units shard nothing by TP; ZeRO-3 shards them over every GPU
ZERO = {"llama-7b": 1, "llama-13b": 3}
MIXES = ["short", "mixed", "long"]
GPUS = [16, 32, 64, 128]
#: beside the grid: slow-network long-tail cells (cluster A's 4 NICs per node, LLaMA-13B, the
#: ``longtail`` mix - steps set by a few maximum-length sequences among short ones), as
#: (cluster key, model, mix, GPUs)
LONG_TAIL_CELLS = [("A", "llama-13b", "longtail", 64), ("A", "llama-13b", "longtail", 128)]
TABLE_MIXES = MIXES + sorted({c[2] for c in LONG_TAIL_CELLS})
#: beside the grid: a model with sliding-window attention and a mixture-of-experts model, as
#: (cluster key, model, tensor-parallel degree, ZeRO stage, mix, GPUs); each is also planned by
#: zeppelin blind to what sets the model apart (the window; the active experts) and simulated as it is
MODEL_CELLS = [("A", "mistral-7b", 1, 1, "long", 32), ("A", "qwen3-30b-a3b", 1, 3, "mixed", 32)]
#: beside the grid: models with few KV heads on the long mix, where sequences must cross nodes, as
#: (cluster key, model, GPUs): the sequence-parallel families side by side (:func:`run_usp_cell`)
USP_CELLS = [("A", m, g) for m in ("llama3-8b", "qwen3-8b", "qwen2.5-3b") for g in (32, 64)]
#: the zeppelin families without usp groups (the best plan without them)
FAMILIES_BEFORE_USP = "ulysses-groups,flop-share,tp-replicas,wide-rings"
PLANNERS = ["te-cp", "te-cp-tuned", "llama3-cp", "ulysses", "hybrid-dp", "megatron-dcp", "flexsp", "hydraulis", "packed-dp",
            "zeppelin", "zeppelin-no-routing", "zeppelin-no-remap"]


def cell_steps(cluster: str, model: str, tp: int, mix: str, gpus: int, args, zero_stage: int = 1,
               recompute: str = "auto", profile: str | None = None):
    """A cell's planning context, sampler settings and sampled steps (``recompute``: ``auto``, zeppelin
    chooses per micro-batch and the baselines run none, or one global mode for every planner;
    ``profile``: a shipped measured profile instead of the cluster's preset curves)."""
    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
    from zeppelin.planner.core.sampler import run_max_seq_len, sample_steps
    from zeppelin.planner.tools.compare import mix_dataset
    from zeppelin.schemas.plan import SamplerConfig

    cl = resolve_cluster(f"{cluster}:{gpus // 8}")
    ctx = PlanContext(cl, resolve_model(model), resolve_profile(profile, cl), tp=tp, seed=args.seed,
                      zero_stage=zero_stage, recompute=recompute)
    cfg = SamplerConfig(tokens_per_step=args.tokens_per_gpu * gpus, seed=args.seed, max_seq_len=args.max_seq_len)
    ds = mix_dataset(mix)
    ctx.max_seq_len = run_max_seq_len(ds, cfg)
    return ctx, cfg, sample_steps(ds, cfg, args.steps)


def run_cell(cluster: str, model: str, tp: int, mix: str, gpus: int, args, zero_stage: int = 1,
             profile: str | None = None) -> dict:
    from zeppelin.planner.tools.compare import SOLVER_PLANNERS, comparison, run_compare

    ctx, cfg, steps = cell_steps(cluster, model, tp, mix, gpus, args, zero_stage, profile=profile)
    options = ({p: {"time_limit": args.solver_time_limit} for p in SOLVER_PLANNERS}
               if args.solver_time_limit else {})
    t0 = time.perf_counter()
    keep = {("zeppelin", k) for k in range(len(steps))} if "zeppelin" in args.planners else set()
    runs = run_compare(ctx, steps, args.planners, options, workers=args.workers, keep=keep)
    doc = comparison(runs)
    doc.update({"cluster": cluster, "gpus": gpus, "model": model, "tp": tp, "mix": mix, "steps": args.steps,
                "tokens_per_step": cfg.tokens_per_step})
    if keep:
        auto = _mode_stats(ctx, next(r for r in runs if r.planner == "zeppelin"))
        doc["zeppelin_auto"] = auto
        if not getattr(args, "no_recompute_modes", False) and profile is None:
            doc["recompute"] = recompute_modes(cluster, model, tp, mix, gpus, args, zero_stage, {"auto": auto})
    doc["wall_s"] = time.perf_counter() - t0
    return doc


def recompute_modes(cluster: str, model: str, tp: int, mix: str, gpus: int, args, zero_stage: int = 1,
                    done: dict | None = None) -> dict:
    """Zeppelin on a cell's steps under ``auto`` and each global mode (:func:`_mode_stats` of each;
    ``done``: the modes already run)."""
    from zeppelin.planner.tools.compare import run_compare

    out = dict(done or {})
    for mode in ("auto", *RECOMPUTE_GLOBAL):
        if mode in out:
            continue
        mctx, _, steps = cell_steps(cluster, model, tp, mix, gpus, args, zero_stage, recompute=mode)
        keep = {("zeppelin", k) for k in range(len(steps))}
        (mz,) = run_compare(mctx, steps, ["zeppelin"], workers=args.workers, keep=keep)
        out[mode] = _mode_stats(mctx, mz)
    return out


#: the global recompute modes zeppelin's ``auto`` is compared with on every cell
RECOMPUTE_GLOBAL = ("none", "selective", "full")


def _mode_stats(ctx, run) -> dict:
    """Zeppelin's run of a cell under one recompute setting: mean step time, its ratio to the lower
    bound, the predicted peak memory of a GPU over its usable capacity, and the share of micro-batches
    with each choice (``auto``)."""
    if run.error is not None or not run.step_times:
        return {"error": run.error or "no steps"}
    plans = [run.plans[k] for k in sorted(run.plans)]
    peak = max(max(p.prediction.per_unit.memory_gb) for p in plans) * 1e9
    choices: dict[str, int] = {}
    running, of = 0, 0  # of the micro-batches that recompute: the units that run a choice, and all units
    for p in plans:
        for mb in p.microbatches:
            n = len(mb.queues)
            modes = {mb.recompute_of(u) or "none" for u in range(n)} - {"none"} or {"none"}
            # (a micro-batch whose units run choices of different kinds counts under each kind)
            for c in {m.partition(":")[0] + (":k" if ":" in m else "") for m in modes}:
                choices[c] = choices.get(c, 0) + 1
            if mb.recomputes():
                running += sum((mb.recompute_of(u) or "none") != "none" for u in range(n))
                of += n
    out = {"mean_s": float(np.mean(run.step_times)),
           "ratio_to_lower_bound": float(np.mean(np.array(run.step_times) / np.array(run.lower_bounds))),
           "memory_over_capacity": peak / ctx.cost.gpu_capacity_bytes, "microbatches": choices}
    if of:
        out["recomputing_unit_share"] = running / of
    return out


def blind_spec(md):
    """The model as a planner blind to what sets it apart sees it: a windowed model as full causal
    attention; a mixture of experts as if every token ran every expert."""
    if md.sliding_window is not None:
        return md.model_copy(update={"sliding_window": None, "layer_types": None})
    if md.is_moe:
        return md.model_copy(update={"experts_per_token": md.num_experts})
    return None


def run_model_cell(cluster: str, model: str, tp: int, zero_stage: int, mix: str, gpus: int, args) -> dict:
    """A :data:`MODEL_CELLS` cell: the planners side by side, plus zeppelin planned on
    :func:`blind_spec` and simulated on the real model (its ring cuts counted)."""
    from zeppelin.planner.core.base import PlanContext, get_planner
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.schemas.common import InputError

    doc = run_cell(cluster, model, tp, mix, gpus, args, zero_stage=zero_stage)
    ctx, cfg, steps = cell_steps(cluster, model, tp, mix, gpus, args, zero_stage)
    md, cl = ctx.model, ctx.cluster
    sim, z = Simulator(ctx), get_planner("zeppelin")
    schemes: dict[str, int] = {}
    for k, seqs in enumerate(steps):
        for mb in z.plan_step(ctx, k, seqs).microbatches:
            for pl in mb.placements:
                if mb.groups[pl.group].kind == "ring":
                    schemes[pl.scheme] = schemes.get(pl.scheme, 0) + 1
    doc.update({"zero_stage": zero_stage, "pattern": md.attention_pattern(), "ring_cuts": schemes,
                "active_params": None, "params": md.num_params()})
    if md.is_moe:
        doc["active_params"] = md.num_params() - md.num_layers * 3 * md.hidden * md.expert_ffn_hidden * (
            md.num_experts - md.experts_per_token)
    bctx = PlanContext(cl, blind_spec(md), ctx.profile, tp=tp, seed=args.seed, zero_stage=zero_stage)
    bctx.max_seq_len = ctx.max_seq_len
    try:
        ts = [sim.simulate_step(z.plan_step(bctx, k, seqs)).step_time_s for k, seqs in enumerate(steps)]
        doc["zeppelin_blind_mean_s"] = float(np.mean(ts))
    except InputError as e:
        doc["zeppelin_blind_error"] = str(e)
    return doc


def _usp_variants(ctx) -> dict[str, list[tuple[str, dict]]]:
    """The families a :data:`USP_CELLS` cell compares, each as the planner runs it chooses from:
    rings only; Ulysses up to the KV heads; Ulysses with K/V replication (up to the query heads);
    the usp baseline; zeppelin without usp groups; zeppelin."""
    from zeppelin.planner.baselines.static_sp import Ulysses
    from zeppelin.planner.core.base import get_planner

    sizes = Ulysses.sizes(get_planner("ulysses"), ctx)
    kv = max(1, ctx.model.num_kv_heads // ctx.tp)
    return {"te-cp-tuned": [("te-cp-tuned", {})],
            "ulysses <= kv": [("ulysses", {"sp": g}) for g in sizes if g <= kv],
            "ulysses + replication": [("ulysses", {})],
            "usp": [("usp", {})],
            "zeppelin rings only": [("zeppelin", {"families": "none", "intra": "ring", "inter": "ring"})],
            "zeppelin without usp": [("zeppelin", {"families": FAMILIES_BEFORE_USP, "inter": "ring"})],
            "zeppelin": [("zeppelin", {})]}


def run_usp_cell(cluster: str, model: str, gpus: int, args) -> dict:
    """A :data:`USP_CELLS` cell: every variant of :func:`_usp_variants` plans the cell's steps (a
    variant of several runs keeps, per cell, the run of the lowest mean simulated step time), every
    plan simulated; and where zeppelin's plans put usp groups (their shapes)."""
    from zeppelin.planner.core.base import get_planner
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.schemas.common import InputError

    ctx, _, steps = cell_steps(cluster, model, 1, "long", gpus, args)
    sim = Simulator(ctx)
    doc: dict = {"cluster": cluster, "model": model, "gpus": gpus, "mix": "long", "steps": args.steps,
                 "kv_heads": ctx.model.num_kv_heads, "heads": ctx.model.num_heads, "mean_s": {}}
    for name, runs in _usp_variants(ctx).items():
        best = None
        for planner, opts in runs:
            try:
                plans = [get_planner(planner, **opts).plan_step(ctx, k, seqs) for k, seqs in enumerate(steps)]
            except InputError:
                continue
            t = float(np.mean([sim.simulate_step(p).step_time_s for p in plans]))
            if best is None or t < best[0]:
                best = (t, plans)
        doc["mean_s"][name] = None if best is None else best[0]
        if name == "zeppelin" and best is not None:
            shapes = sorted({f"{g.shape[0]}x{g.shape[1]}" for p in best[1] for mb in p.microbatches
                             for g in mb.groups if g.kind == "usp"})
            doc["usp_steps"] = sum(any(g.kind == "usp" for mb in p.microbatches for g in mb.groups)
                                   for p in best[1])
            doc["usp_shapes"] = shapes
    return doc


#: beside the grid: cells of the model the shipped measured profile measured, on the cluster of its
#: device, each planned with the cluster's preset curves and with the measured profile, as
#: (cluster key, model, mix, GPUs)
PROFILE_NAME = "h200-measured"
PROFILE_CELLS = [("C", "llama3.2-1b", mix, g) for mix in ("mixed", "long") for g in (16, 64)]
PROFILE_MARKERS = ("<!-- measured profile section: generated by benchmarks/bench_compare.py --profile-cells-only -->",
                   "<!-- end of the measured profile section -->")


def run_profile_cells(args) -> list[dict]:
    """Every :data:`PROFILE_CELLS` cell planned by every planner under the preset curves and under
    :data:`PROFILE_NAME` (the same sampled steps; each plan simulated under its own profile)."""
    out, t0 = [], time.perf_counter()
    for k, model, mix, g in PROFILE_CELLS:
        for prof in (None, PROFILE_NAME):
            c = run_cell(CLUSTERS[k], model, 1, mix, g, args, profile=prof)
            c["profile"] = prof or "preset"
            out.append(c)
            print(f"[{time.perf_counter() - t0:6.0f} s] {model} {mix} {g} GPUs, {c['profile']}: zeppelin "
                  f"{c.get('zeppelin_speedup_vs_best_baseline', math.nan):.2f}x best ({c.get('best_baseline')})",
                  file=sys.stderr, flush=True)
    return out


def render_profile_cells(pcells: list[dict], args) -> list[str]:
    """The section of the page on :data:`PROFILE_CELLS`: zeppelin and the best other planner under
    the preset curves beside the same cells under the measured profile."""
    out = [PROFILE_MARKERS[0], "## Planned with a measured GPU profile", "",
           f"Beside the grid: Llama-3.2-1B's shapes (`llama3.2-1b`) on cluster C (H200 nodes), planned with the "
           f"cluster's preset curves and with `--profile {PROFILE_NAME}` (the kernels of that model measured by "
           "`zeppelin profile` on one H200, docs/BENCHMARKS.md \"GPU check (first light)\"; its single GPU measured no links: "
           "both price communication by the cluster preset's links). The same sampled steps "
           f"({args.steps} per cell, the grid's sampling); each plan simulated under the profile it was planned "
           "with. zeppelin / bound: its mean simulated step over the mean lower bound.", "",
           "| mix | GPUs | profile | zeppelin s | best other | its s | lead | zeppelin / bound |",
           "|---|---:|---|---:|---|---:|---:|---:|"]
    for c in pcells:
        z = next((p for p in c["planners"] if p["planner"] == "zeppelin"), None)
        b = next((p for p in c["planners"] if p["planner"] == c.get("best_baseline")), None)
        if z is None or b is None or z.get("mean_s") is None:
            continue
        out.append(f"| {c['mix']} | {c['gpus']} | {c['profile']} | {z['mean_s']:.3f} | {b['planner']} | "
                   f"{b['mean_s']:.3f} | {b['mean_s'] / z['mean_s']:.3f}x | {z['ratio_to_lower_bound']:.3f} |")
    out += ["", f"Command: `.venv/bin/python benchmarks/bench_compare.py --profile-cells-only` ({args.machine}; "
            f"code at `{args.code}`).", PROFILE_MARKERS[1]]
    return out


def write_profile_section(out_dir: Path, lines: list[str]) -> None:
    """Put the section into ``out_dir``/RESULTS.md (in place of an earlier one, else at the end)."""
    import re

    from zeppelin.schemas.io.safefiles import atomic_write_text

    page = (out_dir / "RESULTS.md").read_text()
    block = "\n".join(lines)
    pat = re.escape(PROFILE_MARKERS[0]) + r".*?" + re.escape(PROFILE_MARKERS[1])
    page = re.sub(pat, lambda _: block, page, flags=re.S) if re.search(pat, page, re.S) else \
        page.rstrip("\n") + "\n\n" + block + "\n"
    atomic_write_text(out_dir / "RESULTS.md", page)


def render_usp_cells(ucells: list[dict], args) -> list[str]:
    """The section of the page on :data:`USP_CELLS`: the families side by side, where usp groups are
    chosen and what they gain over the best plan without them."""
    names = list(ucells[0]["mean_s"]) if ucells else []
    out = [USP_HEADING, "",
           "Beside the grid: models with few KV heads (Llama-3-8B and Qwen3-8B: 32 query / 8 KV heads; "
           "Qwen2.5-3B: 16 / 2) on the `long` mix, where some sequences must be split across nodes "
           f"({args.steps} steps each, the grid's sampling, tp=1). Mean simulated step time in seconds per family: rings only "
           "(`te-cp-tuned`; zeppelin with rings only), Ulysses up to the KV heads (static Ulysses, the best SP "
           "degree <= KV heads), Ulysses with K/V heads replicated (degrees up to the query heads), the `usp` "
           "baseline (long-context-attention's USP: Ulysses inside a node x a ring over nodes, one shape for "
           "every sequence), zeppelin without usp groups, and zeppelin, which chooses usp shapes u x r per "
           "step beside its other layouts. \"gain\": zeppelin over zeppelin without usp groups; \"vs usp\": "
           "zeppelin over the `usp` baseline.", "",
           "| model | GPUs | " + " | ".join(names) + " | usp in steps (shapes) | gain | vs usp |",
           "|---|---:|" + "---:|" * len(names) + "---|---:|---:|"]
    for c in ucells:
        m = c["mean_s"]
        cells = [f"{m[n]:.2f}" if m[n] is not None else "fail" for n in names]
        gain = m["zeppelin without usp"] / m["zeppelin"] if m.get("zeppelin") and m.get("zeppelin without usp") else None
        vs = m["usp"] / m["zeppelin"] if m.get("zeppelin") and m.get("usp") else None
        where = f"{c.get('usp_steps', 0)} of {c['steps']} ({', '.join(c.get('usp_shapes', [])) or '-'})"
        out.append(f"| {c['model']} | {c['gpus']} | " + " | ".join(cells) + f" | {where} | "
                   + (f"{gain:.3f}x" if gain else "-") + " | " + (f"{vs:.3f}x" if vs else "-") + " |")
    out += ["", f"Command: `.venv/bin/python benchmarks/bench_compare.py --usp-cells-only` ({args.machine}; "
            f"code at `{args.code}`)."]
    return out


def render_model_cells(mcells: list[dict], args) -> list[str]:
    """The section of the page on :data:`MODEL_CELLS`: the table and what zeppelin gains there and why."""
    if not mcells:
        return []
    out = ["## Sliding windows and mixtures of experts", "",
           (f"Beside the grid, one cell per model kind ({args.steps} steps each, the grid's sampling); "
            "\"blind\" is zeppelin planned on the model without what sets it apart (the window priced as full "
            "causal attention; every expert priced as run by every token) and simulated on the real model."), "",
           "| cluster | model | mix | GPUs | te-cp s | zeppelin s | vs te-cp | best other | vs best | zeppelin blind s |",
           "|---|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for c in mcells:
        te, z = _stat(c, "te-cp"), _stat(c, "zeppelin")
        blind = f"{c['zeppelin_blind_mean_s']:.2f}" if "zeppelin_blind_mean_s" in c else "cannot plan"
        row = [c["cluster"], c["model"], c["mix"], str(c["gpus"]), f"{te['mean_s']:.2f}" if te else "fail"]
        if z is None:
            row += ["fail", "-", "-", "-", "-"]
        else:
            row += [f"{z['mean_s']:.2f}", f"{c.get('zeppelin_speedup_vs_te_cp', math.nan):.2f}x",
                    str(c.get("best_baseline", "-")), f"{c.get('zeppelin_speedup_vs_best_baseline', math.nan):.2f}x",
                    blind]
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    for c in mcells:
        z = _stat(c, "zeppelin")
        if z is None:
            continue
        if c.get("pattern", "full causal") != "full causal":
            gain = c["zeppelin_blind_mean_s"] / z["mean_s"] if "zeppelin_blind_mean_s" in c else math.nan
            cuts = ", ".join(f"{n} {k}" for k, n in sorted(c.get("ring_cuts", {}).items())) or "none"
            out += [(f"**{c['model']}** ({c['pattern']} attention): zeppelin {z['mean_s']:.2f} s per step, "
                     f"{c.get('zeppelin_speedup_vs_te_cp', math.nan):.2f}x te-cp and "
                     f"{c.get('zeppelin_speedup_vs_best_baseline', math.nan):.2f}x the best other planner "
                     f"({c.get('best_baseline', '-')}); planned blind to the window {gain:.2f}x slower. Why: a "
                     "windowed layer's attention grows as L*w, not L^2/2, so a long sequence is far cheaper than "
                     "its length says. zeppelin's tiers, thresholds and balance use the windowed cost, and its "
                     "rings cut a sequence contiguously once each share covers the window (ring cuts in its "
                     f"plans: {cuts}), which makes a ring one neighbour exchange per layer instead of G-1 rounds. "
                     "Planned blind, zeppelin balances L^2 work that a windowed layer never does and cuts every "
                     "ring zigzag, so every ring pays its G-1 exchange rounds."), ""]
        else:
            act = c.get("active_params")
            why_blind = (f"planned blind (every expert priced as run) it takes {c['zeppelin_blind_mean_s']:.2f} s"
                         if "zeppelin_blind_mean_s" in c else
                         "planned blind (every expert priced as run, and its activations kept) the step cannot "
                         f"even be planned ({c.get('zeppelin_blind_error', '')})")
            out += [(f"**{c['model']}** ({c['params'] / 1e9:.1f}B parameters, "
                     f"{(act or 0) / 1e9:.1f}B active per token; ZeRO-{c.get('zero_stage', 1)}): zeppelin "
                     f"{z['mean_s']:.2f} s per step, {c.get('zeppelin_speedup_vs_te_cp', math.nan):.2f}x te-cp and "
                     f"{c.get('zeppelin_speedup_vs_best_baseline', math.nan):.2f}x the best other planner "
                     f"({c.get('best_baseline', '-')}); {why_blind}. Why: the experts' memory (all of them) "
                     "leaves few tokens per GPU, so long sequences are split over many units, while the compute "
                     "per token (the active experts) is that of a small model, so attention's quadratic share "
                     "decides the step: sizing each sequence's group by its cost gains over te-cp's fixed groups "
                     "(as Hydraulis' per-sequence groups do where they tie). Pricing memory from all experts and "
                     "compute from the active ones is what makes the step plannable and priced right. No expert "
                     "parallelism: FSDP shards the experts like other weights."), ""]
    return out


#: the long-tailed mixes, where a few long sequences need recomputation and most micro-batches do not
LONG_TAILED = ("mixed", "long", "longtail")


def recompute_summary(cells: list[dict]) -> dict:
    """``auto`` against zeppelin's global modes over the cells: where auto is slower by more than 0.5%
    than the best global mode whose plans fit (peak memory of a GPU within its usable capacity: a plan
    over it does not run), where a global mode is that much faster only with plans over capacity, where
    auto's own plans exceed capacity, and where auto is faster than global ``selective`` on the
    long-tailed mixes."""
    rows = [c for c in cells if "recompute" in c and "mean_s" in c["recompute"]["auto"]]
    slower, over_cap, auto_over, ratios, not_sel, faster_sel, long_cells = [], [], [], [], [], 0, 0
    for c in rows:
        rc, label = c["recompute"], f"{c['cluster']} {c['model']} {c['mix']} {c['gpus']} GPUs"
        auto = rc["auto"]["mean_s"]
        fit = [(rc[m]["mean_s"], m) for m in RECOMPUTE_GLOBAL if _fits(rc[m])]
        if fit:
            best = min(fit)
            ratios.append(auto / best[0])
            if auto > best[0] * 1.005:
                slower.append(f"{label} ({best[1]})")
        over_cap += [f"{label} ({m} {rc[m]['mean_s'] / auto:.3f}x auto's time, peak {rc[m]['memory_over_capacity']:.2f}"
                     " of capacity)" for m in RECOMPUTE_GLOBAL
                     if "mean_s" in rc[m] and not _fits(rc[m]) and auto > rc[m]["mean_s"] * 1.005]
        if not _fits(rc["auto"]):
            auto_over.append(label)
        if c["mix"] in LONG_TAILED:
            long_cells += 1
            sel = rc["selective"].get("mean_s")
            faster_sel += sel is None or auto < sel
            if sel is not None and auto >= sel:
                not_sel.append(f"{label} (selective's peak {rc['selective']['memory_over_capacity']:.2f} of capacity)")
    return {"cells": len(rows), "auto_slower_than_best_global": slower, "long_tailed_cells": long_cells,
            "auto_faster_than_selective_long_tailed": faster_sel, "auto_not_faster_than_selective": not_sel,
            "faster_global_over_capacity": over_cap,
            "auto_over_capacity": auto_over, "auto_over_best_global_geomean": _gmean(ratios)}


def _fits(st: dict) -> bool:
    """A mode's run of a cell planned every step and its peak memory is within the GPUs' usable capacity."""
    return "mean_s" in st and st["memory_over_capacity"] <= 1.0


RECOMPUTE_MARKERS = ("<!-- recompute section: generated by benchmarks/bench_compare.py -->",
                     "<!-- end of the recompute section -->")


def load_partial(path: Path | None, steps: int) -> dict[tuple, dict]:
    """The cells an earlier run with ``--partial PATH`` finished (one JSON line each: its key and its
    document), by key; lines of a run with another number of steps are left out."""
    if path is None or not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {tuple(r["key"]): r["cell"] for r in rows if r["steps"] == steps}


def save_partial(path: Path | None, key: tuple, cell: dict) -> dict:
    """``cell`` appended to ``--partial PATH`` under ``key`` (nothing without a path); returns ``cell``."""
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps({"key": list(key), "steps": cell.get("steps"), "cell": cell}) + "\n")
    return cell


def grid_todo(args) -> list[tuple[str, str, str, int]]:
    """The grid's cells asked for by ``--clusters`` / ``--models`` / ``--mixes`` / ``--gpus`` as (cluster,
    model, mix, GPUs), then the long-tail cells among them (:data:`LONG_TAIL_CELLS`)."""
    cls = [CLUSTERS[k] for k in args.clusters.split(",")]
    models, mixes = args.models.split(","), args.mixes.split(",")
    gpus = [int(g) for g in args.gpus.split(",")]
    todo = [(cl, model, mix, g) for cl in cls for model in models for mix in mixes if mix in MIXES for g in gpus]
    return todo + [(CLUSTERS[k], model, mix, g) for k, model, mix, g in LONG_TAIL_CELLS
                   if CLUSTERS[k] in cls and model in models and mix in mixes and g in gpus]


#: the heading of the section :func:`render_usp_cells` writes (``--usp-cells-only`` prints it; the page keeps it)
USP_HEADING = "## Sequence parallelism past the KV heads"


def kept_sections(page: str, recompute: bool) -> list[str]:
    """The sections of an existing RESULTS.md that other runs wrote and a full run of the grid keeps:
    the usp cells' section (:data:`USP_HEADING`, up to the next section) and every section between
    ``<!-- NAME section: generated by ... -->`` markers (the recomputation one only with ``recompute``)."""
    import re

    out = []
    if USP_HEADING in page:
        rest = page.split(USP_HEADING, 1)[1]
        end = min([i for i in (rest.find("\n<!-- "), rest.find("\n## ")) if i >= 0], default=len(rest))
        out.append((USP_HEADING + rest[:end]).rstrip("\n"))
    for m in re.finditer(r"<!-- (\S[^\n]*?) section: generated by [^\n]*?-->.*?<!-- end of the \1 section -->",
                         page, re.S):
        if recompute or not m.group(0).startswith(RECOMPUTE_MARKERS[0]):
            out.append(m.group(0))
    return out


def recompute_only(args) -> None:
    """``--recompute-only``: zeppelin's recompute modes on the cells asked for, written into the
    recomputation section of RESULTS.md (the rest of the page is left as it is)."""
    t0 = time.perf_counter()
    cells, done = [], load_partial(args.partial, args.steps)
    for cl, model, mix, g in grid_todo(args):
        key = ("recompute", cl, model, mix, g)
        c = done.get(key)
        if c is None:
            t1 = time.perf_counter()
            rc = recompute_modes(cl, model, MODELS[model], mix, g, args, ZERO[model])
            c = save_partial(args.partial, key, {"cluster": cl, "model": model, "mix": mix, "gpus": g, "recompute": rc,
                                                 "steps": args.steps, "wall_s": time.perf_counter() - t1})
        cells.append(c)
        print(f"[{time.perf_counter() - t0:6.0f} s] {cl} {model} {mix} {g} GPUs", file=sys.stderr, flush=True)
    argv_s = " ".join(sys.argv[1:])
    command = f".venv/bin/python benchmarks/bench_compare.py {argv_s}".strip()
    wall = time.perf_counter() - t0 + sum(c.get("wall_s", 0.0) for c in done.values())
    write_recompute_section(args.out_dir, cells, command, wall, args.steps, _git_describe())


def recompute_merge(args) -> None:
    """``--recompute-merge``: the recomputation section re-rendered from the ``results_recompute.json``
    of several ``--recompute-only`` runs (e.g. one per GPU count), their cells in the order given; no
    planning."""
    docs = [json.loads(Path(p).read_text()) for p in args.recompute_merge.split(",")]
    commands = [c for d in docs for c in (d["command"] if isinstance(d["command"], list) else [d["command"]])]
    codes = sorted({d.get("code", "unknown") for d in docs})
    write_recompute_section(args.out_dir, [c for d in docs for c in d["cells"]], commands,
                            sum(d["wall_s"] for d in docs), docs[0]["steps"], ", ".join(codes))


def write_recompute_section(out_dir: Path, cells: list[dict], command: str | list[str], wall: float, steps: int,
                            code: str) -> None:
    """The recomputation section of ``out_dir/RESULTS.md`` (between its markers) and
    ``results_recompute.json`` (``command``: the command, or the commands of merged runs)."""
    from zeppelin.schemas.io.safefiles import atomic_write_text

    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}"
    shown = " and ".join(f"`{c}`" for c in ([command] if isinstance(command, str) else command))
    head = (f"Generated by {shown} ({len(cells)} cells, {steps} steps per cell, {wall / 60:.1f} minutes "
            f"wall on {machine}, under load; code at commit `{code}`). It rewrites this section only: "
            "the grid above keeps the figures of its own run (the command at the top of the page). "
            + ("With `--recompute auto` zeppelin plans every cell below." if all(
                "mean_s" in c["recompute"]["auto"] for c in cells) else
               "With `--recompute auto` zeppelin cannot plan: " + "; ".join(
                   f"{c['cluster']} {c['model']} {c['mix']} {c['gpus']} GPUs" for c in cells
                   if "mean_s" not in c["recompute"]["auto"]) + "."))
    section = [RECOMPUTE_MARKERS[0], *render_recompute(cells, head), RECOMPUTE_MARKERS[1]]
    page_path = out_dir / "RESULTS.md"
    page = page_path.read_text() if page_path.exists() else ""
    if RECOMPUTE_MARKERS[0] in page:
        before, rest = page.split(RECOMPUTE_MARKERS[0], 1)
        page = before + "\n".join(section) + rest.split(RECOMPUTE_MARKERS[1], 1)[1]
    else:
        page = page.rstrip("\n") + "\n\n" + "\n".join(section) + "\n"
    atomic_write_text(page_path, page)
    atomic_write_text(out_dir / "results_recompute.json",
                      json.dumps({"summary": recompute_summary(cells), "cells": cells, "command": command,
                                  "wall_s": wall, "steps": steps, "code": code}, indent=1) + "\n")
    print(json.dumps(recompute_summary(cells), indent=1))


def render_recompute(cells: list[dict], head: str | None = None) -> list[str]:
    """The section of the page comparing zeppelin's ``--recompute auto`` with each global mode."""
    rows = [c for c in cells if "recompute" in c]
    if not rows:
        return []
    rs = recompute_summary(cells)
    out = ["## Activation recomputation: chosen per micro-batch against one global mode", "",
           *([head, ""] if head else []),
           ("Zeppelin plans each cell's steps with `--recompute auto` (its choice per micro-batch; the baselines "
            "run `none` under it) and with one global mode for the whole run (`--recompute none`, `selective`, "
            "`full`), and the simulator judges every plan. Per mode: step time over the lower bound (mean over the "
            "steps; the bound is the work without recomputation) / the predicted peak memory of a GPU over its "
            "usable capacity; auto's micro-batches by choice (`full:k`: full recomputation of the first k layers). "
            "docs/CONCEPTS.md, \"When recompute pays\", says why."), "",
           (f"- auto is slower than the best global mode whose plans fit (peak within capacity) by more than 0.5% in "
            f"{len(rs['auto_slower_than_best_global'])} of {rs['cells']} cells"
            + (": " + "; ".join(rs["auto_slower_than_best_global"]) if rs["auto_slower_than_best_global"] else "")
            + f"; auto / best such global mode, geometric mean {rs['auto_over_best_global_geomean']:.4f}. "
            "A global mode faster than auto by more than 0.5% with plans over capacity (they would not run): "
            + ("; ".join(rs.get("faster_global_over_capacity", [])) or "none") + ". auto's plans over capacity: "
            + ("; ".join(rs.get("auto_over_capacity", [])) or "none") + "."),
           (f"- auto is faster than global `selective` in {rs['auto_faster_than_selective_long_tailed']} of "
            f"{rs['long_tailed_cells']} cells of the long-tailed mixes ({', '.join(LONG_TAILED)})"
            + (": not in " + "; ".join(rs["auto_not_faster_than_selective"]) if rs.get("auto_not_faster_than_selective")
               else "") + "."), "",
           "| cluster | model | mix | GPUs | auto | none | selective | full | auto's micro-batches |",
           "|---|---|---|---:|---:|---:|---:|---:|---|"]

    def cell(st: dict) -> str:
        if "mean_s" not in st:
            return "cannot plan"
        return f"{st['ratio_to_lower_bound']:.3f} / {st['memory_over_capacity']:.2f}"

    for c in rows:
        rc = c["recompute"]
        mbs = ", ".join(f"{k} {v}" for k, v in sorted(rc["auto"].get("microbatches", {}).items()))
        out.append("| " + " | ".join([c["cluster"], c["model"], c["mix"], str(c["gpus"]), cell(rc["auto"]),
                                      *(cell(rc[m]) for m in RECOMPUTE_GLOBAL), mbs]) + " |")
    return out + [""]


def _stat(doc: dict, planner: str) -> dict | None:
    for s in doc["planners"]:
        if s["planner"] == planner:
            return None if s.get("error") else s
    return None


def _gmean(xs) -> float:
    xs = [x for x in xs if x and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(xs)))) if xs else math.nan


def compute_ratio(cluster: str) -> float:
    """Compute-to-network ratio of a node as a ratio of *times*: for work that moves one GB over the
    NICs per TFLOP computed, (time computing) / (time communicating) = NIC GB/s / peak TFLOP/s. Low:
    the network is slow relative to compute (communication-bound), the papers' sense."""
    from zeppelin.schemas.cluster import cluster_preset

    c = cluster_preset(cluster)
    return sum(n.bandwidth_GBps for n in c.nics) / (c.gpu.peak_tflops * c.gpus_per_node)


def auto_summary(cells: list[dict]) -> dict:
    """Zeppelin's ``--recompute auto`` runs over the grid's cells (``zeppelin_auto`` of each): the cells it
    planned, the highest predicted peak memory of a GPU over its usable capacity and its cell, the cells
    above capacity, and the micro-batches by recompute choice."""
    rows = [(f"{c['cluster']} {c['model']} {c['mix']} {c['gpus']} GPUs", c["zeppelin_auto"]) for c in cells
            if "zeppelin_auto" in c]
    ok = [(label, a) for label, a in rows if "mean_s" in a]
    choices: dict[str, int] = {}
    for _, a in ok:
        for k, v in a["microbatches"].items():
            choices[k] = choices.get(k, 0) + v
    top = max(ok, key=lambda r: r[1]["memory_over_capacity"], default=None)
    return {"auto_cells": len(rows), "auto_planned_cells": len(ok),
            "auto_memory_over_capacity_max": top[1]["memory_over_capacity"] if top else math.nan,
            "auto_memory_over_capacity_max_cell": top[0] if top else None,
            "auto_over_capacity_cells": [label for label, a in ok if a["memory_over_capacity"] > 1.0],
            "auto_microbatches": dict(sorted(choices.items()))}


def findings(cells: list[dict]) -> tuple[dict, list[str]]:
    """The summary numbers and the papers' qualitative findings, checked against this run."""
    z_te = [c["zeppelin_speedup_vs_te_cp"] for c in cells if "zeppelin_speedup_vs_te_cp" in c]
    z_tuned = [c["zeppelin_speedup_vs_te_cp_tuned"] for c in cells if "zeppelin_speedup_vs_te_cp_tuned" in c]
    z_best = [c["zeppelin_speedup_vs_best_baseline"] for c in cells if "zeppelin_speedup_vs_best_baseline" in c]
    summ = {
        "cells": len(cells),
        "zeppelin_vs_te_cp_mean": float(np.mean(z_te)) if z_te else math.nan,
        "zeppelin_vs_te_cp_geomean": _gmean(z_te),
        "zeppelin_vs_te_cp_max": float(np.max(z_te)) if z_te else math.nan,
        "zeppelin_vs_te_cp_tuned_mean": float(np.mean(z_tuned)) if z_tuned else math.nan,
        "zeppelin_vs_te_cp_tuned_geomean": _gmean(z_tuned),
        "zeppelin_vs_te_cp_tuned_max": float(np.max(z_tuned)) if z_tuned else math.nan,
        "zeppelin_vs_best_baseline_mean": float(np.mean(z_best)) if z_best else math.nan,
        "zeppelin_vs_best_baseline_geomean": _gmean(z_best),
        "zeppelin_wins_cells": int(sum(x > 1.0 for x in z_best)),
        "best_baseline_counts": {},
    }
    # fastest or tied (within 0.5%) per cell, and every cell where zeppelin is not, with the numbers
    fastest, exceptions, close, unplannable, only = 0, [], [], [], []
    for c in cells:
        label = f"{c['cluster']} {c.get('model', '')} {c['mix']} {c['gpus']} GPUs".replace("  ", " ")
        z = _stat(c, "zeppelin")
        others = [s for s in c["planners"] if not s["planner"].startswith("zeppelin") and not s.get("error")]
        if z is None and not others:  # the cluster's memory holds no layout of some step: nobody plans it
            err = next((s.get("error") for s in c["planners"] if s["planner"] == "zeppelin"), None) or "no plan"
            unplannable.append(f"{label} ({err})")
            continue
        if z is None:
            err = next((s.get("error") for s in c["planners"] if s["planner"] == "zeppelin"), None) or "no plan"
            exceptions.append(f"{label}: zeppelin cannot plan it ({err})")
            continue
        if not others:  # zeppelin alone plans it
            fastest += 1
            only.append(label)
            continue
        b = min(others, key=lambda s: s["mean_s"])
        r = b["mean_s"] / z["mean_s"]
        if r >= 0.995:
            fastest += 1
            if r < 1.02:
                close.append(f"{label} ({b['planner']}, {r:.3f}x)")
        else:
            exceptions.append(f"{label}: {b['planner']} {b['mean_s']:.3f} s vs zeppelin {z['mean_s']:.3f} s "
                              f"({(1 / r - 1) * 100:.1f}% slower by the simulator; predicted {b['predicted_mean_s']:.3f} "
                              f"vs {z['predicted_mean_s']:.3f} s)")
    # headroom: how far zeppelin and the best other baseline are from the step's lower bound (perfect
    # balance of each sequence's cheapest attention and of the linear work, docs/DESIGN.md, "Lower
    # bounds"; no plan reaches it where a few long sequences or coarse groups set the step), and the
    # margin zeppelin would have if it reached the bound in every cell
    hz, hb = [], []
    for c in cells:
        z = _stat(c, "zeppelin")
        others = [s for s in c["planners"] if not s["planner"].startswith("zeppelin") and not s.get("error")]
        if z and others and z.get("lower_bound_mean_s"):
            b = min(others, key=lambda s: s["mean_s"])
            hz.append(z["mean_s"] / z["lower_bound_mean_s"])
            hb.append(b["mean_s"] / z["lower_bound_mean_s"])
    summ["zeppelin_over_lower_bound_geomean"] = _gmean(hz)
    summ["best_other_over_lower_bound_geomean"] = _gmean(hb)
    # what a 1.10x geometric-mean lead over the best other baseline takes: the cap c on zeppelin's
    # step / bound (every cell above it brought down to it) that gives 1.10x, by bisection; and the
    # cells where the best other baseline is itself within 1.10x of the bound (no plan leads it there
    # by 1.10x)
    if hz:
        def lead(cap):
            return _gmean([b / min(z, cap) for z, b in zip(hz, hb)])
        if lead(1.0) >= 1.10:
            lo, hi = 1.0, max(hz)
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if lead(mid) >= 1.10 else (lo, mid)
            summ["cap_for_1_10_lead"] = lo
        summ["cells_best_other_within_1_10_of_bound"] = sum(1 for b in hb if b < 1.10)
    summ["zeppelin_fastest_or_tied_cells"] = fastest
    summ["zeppelin_exceptions"] = exceptions
    summ["cells_no_planner_can_plan"] = unplannable
    summ["cells_only_zeppelin_can_plan"] = only
    summ["zeppelin_wins_cells"] += len(only)  # the only planner of a cell is its fastest
    summ["zeppelin_within_2pct_of_best_other"] = close
    summ.update(auto_summary(cells))
    for c in cells:
        b = c.get("best_baseline")
        if b:
            summ["best_baseline_counts"][b] = summ["best_baseline_counts"].get(b, 0) + 1
    lines = []
    # 1. advantage over te-cp by length mix
    by_mix = {m: _gmean([c.get("zeppelin_speedup_vs_te_cp") for c in cells if c["mix"] == m]) for m in MIXES}
    summ["zeppelin_vs_te_cp_by_mix"] = by_mix
    holds = by_mix["short"] == max(by_mix.values())
    lines.append("Zeppelin's advantage over te-cp is largest on short-heavy data: geometric-mean speedup over "
                 "te-cp by mix: " + ", ".join(f"{m} {v:.2f}x" for m, v in by_mix.items())
                 + f" -> **{'holds' if holds else 'does not hold'}** in this run.")
    # 2. by cluster compute-to-network ratio
    by_cl = {k: _gmean([c.get("zeppelin_speedup_vs_te_cp") for c in cells if c["cluster"] == v])
             for k, v in CLUSTERS.items()}
    ratio = {k: compute_ratio(v) for k, v in CLUSTERS.items()}
    summ["zeppelin_vs_te_cp_by_cluster"] = by_cl
    summ["compute_to_network_tflops_per_GBps"] = ratio
    low = min(ratio, key=ratio.get)
    holds = by_cl[low] == max(by_cl.values())
    lines.append("Zeppelin's advantage over te-cp is largest on the cluster with the lower compute-to-network "
                 "ratio (compute time over communication time for the same work = node NIC bandwidth / node peak "
                 "compute: " + ", ".join(f"{k} {ratio[k]:.3f} GB/s per TFLOP/s" for k in ratio)
                 + f"; lower: {low}, whose network is slower relative to its compute): geometric-mean speedup over "
                 "te-cp " + ", ".join(f"{k} {by_cl[k]:.2f}x" for k in by_cl)
                 + f" -> **{'holds' if holds else 'does not hold'}** in this run.")
    # 3. flexsp ahead of static ulysses
    pairs = [(s_f["mean_s"], s_u["mean_s"]) for c in cells
             if (s_f := _stat(c, "flexsp")) and (s_u := _stat(c, "ulysses"))]
    ahead = sum(f <= u * (1 + 1e-9) for f, u in pairs)
    gm = _gmean([u / f for f, u in pairs])
    summ["flexsp_vs_ulysses"] = {"cells": len(pairs), "flexsp_not_slower": ahead, "geomean_speedup": gm}
    holds = pairs and ahead == len(pairs) and gm > 1.0
    lines.append(f"FlexSP is ahead of static Ulysses: flexsp is at least as fast in {ahead} of {len(pairs)} cells "
                 f"where both plan, geometric-mean speedup {gm:.3f}x -> **{'holds' if holds else 'does not hold'}**"
                 + ("" if holds else " as stated") + ".")
    # 4. te-cp dominated by inter-node ring traffic as GPUs grow. te-cp's one CP group is sized for the
    # run's longest allowed sequence: it crosses nodes where a node cannot hold that sequence, and then its
    # every ring pays NIC hops. Measured: the share of te-cp's time above the lower bound (what it
    # loses) that is exposed communication, by GPU count, where its group spans nodes and where not
    def _lb(s):
        return s.get("lower_bound_mean_s") or s["mean_s"] / s["ratio_to_lower_bound"]

    def _share(g, spans):
        xs = [(s["exposed_comm_s"] / max(s["mean_s"] - _lb(s), 1e-12), s["exposed_comm_s"] / s["mean_s"])
              for c in cells if c["gpus"] == g and (s := _stat(c, "te-cp"))
              and (s.get("steps_spanning_nodes", 0) > 0) == spans]
        if not xs:
            return math.nan, math.nan, 0
        return float(np.mean([a for a, _ in xs])), float(np.mean([b for _, b in xs])), len(xs)

    frac = {g: float(np.mean([s["exposed_comm_s"] / s["mean_s"] for c in cells if c["gpus"] == g
                              and (s := _stat(c, "te-cp"))] or [math.nan])) for g in GPUS}
    across = {g: _share(g, True) for g in GPUS}
    inside = {g: _share(g, False) for g in GPUS}
    summ["te_cp_exposed_comm_fraction_by_gpus"] = frac
    summ["te_cp_loss_from_exposed_comm_by_gpus_when_spanning_nodes"] = {g: v[0] for g, v in across.items()}
    summ["te_cp_loss_from_exposed_comm_by_gpus_inside_a_node"] = {g: v[0] for g, v in inside.items()}
    summ["te_cp_exposed_fraction_of_step_by_gpus_when_spanning_nodes"] = {g: v[1] for g, v in across.items()}
    seen = [g for g in GPUS if across[g][2]]
    dom = bool(seen) and all(across[g][0] > 0.5 for g in seen)

    def _fmt(d):
        return ", ".join(f"{g} GPUs {d[g][0]:.0%} ({d[g][2]} cells; {d[g][1]:.0%} of the step)" for g in GPUS if d[g][2])

    lines.append("te-cp is dominated by inter-node ring traffic from 16 to 128 GPUs: where its CP group must span "
                 "nodes (the longest allowed sequence does not fit one node), exposed communication is this share of "
                 "te-cp's time above the lower bound: " + _fmt(across) + "; where the group stays inside a node: "
                 + (_fmt(inside) or "no such cell")
                 + " -> exposed inter-node ring traffic is most of what te-cp loses at every GPU count where it spans "
                 f"nodes: **{'holds' if dom else 'does not hold'}**"
                 + ("" if seen else " (no cell where te-cp spans nodes)") + ".")
    # diagnostics: how far each planner's own analytic prediction is from the simulation
    gap = {}
    for p in ("te-cp", "ulysses", "flexsp", "hydraulis", "zeppelin", "zeppelin-no-remap"):
        xs = [s["mean_s"] / s["predicted_mean_s"] for c in cells if (s := _stat(c, p)) and s.get("predicted_mean_s")]
        if xs:
            gap[p] = _gmean(xs)
    summ["simulated_over_predicted"] = gap
    # and how zeppelin's plans compare with te-cp's and the best baseline's by the analytic model alone
    pz = []
    for c in cells:
        z, te = _stat(c, "zeppelin"), _stat(c, "te-cp")
        b = _stat(c, c.get("best_baseline") or "")
        if z and te and b and z.get("predicted_mean_s"):
            pz.append((te["predicted_mean_s"] / z["predicted_mean_s"], b["predicted_mean_s"] / z["predicted_mean_s"]))
    summ["predicted_speedup_zeppelin_vs_te_cp"] = _gmean([a for a, _ in pz])
    summ["predicted_speedup_zeppelin_vs_best_baseline"] = _gmean([b for _, b in pz])
    return summ, lines


def chart(cells: list[dict], cluster: str, model: str, path: Path, planners: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zeppelin.planner.tools.show import save_png

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), sharey=True)
    for ax, mix in zip(axes, MIXES):
        sub = sorted((c for c in cells if c["cluster"] == cluster and c["model"] == model and c["mix"] == mix),
                     key=lambda c: c["gpus"])
        palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 3]  # red is zeppelin's
        others = [p for p in planners if p not in ("te-cp", "zeppelin")]
        for p in planners:
            if p == "te-cp":
                continue
            ys = [(_stat(c, p) or {}).get("speedup_vs_te_cp", math.nan) for c in sub]
            style = ({"lw": 2.2, "color": "#d62728"} if p == "zeppelin"
                     else {"lw": 1.0, "color": palette[others.index(p) % len(palette)]})
            if p.startswith("zeppelin-"):
                style["ls"] = "--"
            ax.plot([GPUS.index(c["gpus"]) for c in sub], ys, marker="o", ms=3, label=p, **style)
        ax.axhline(1.0, color="k", lw=0.7)
        for c in sub:  # no speedup to draw where te-cp itself cannot plan the cell's steps
            if any(s["planner"] == "te-cp" and s.get("error") for s in c["planners"]):
                ax.text(GPUS.index(c["gpus"]), 0.5, "te-cp\ncannot\nplan", transform=ax.get_xaxis_transform(),
                        fontsize=8, color="0.35", ha="center", va="center")
        ax.set_xticks(range(len(GPUS)), [str(g) for g in GPUS])
        ax.set_xlim(-0.5, len(GPUS) - 0.5)
        ax.set_title(f"{mix} mix", fontsize=9)
        ax.set_xlabel("GPUs")
    axes[0].set_ylabel("speedup over te-cp (simulated)")
    axes[-1].legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"cluster {cluster}, {model}", fontsize=10)
    fig.tight_layout()
    save_png(fig, path, dpi=72)


def render_page(cells: list[dict], summ: dict, lines: list[str], args, wall: float, command: str) -> str:
    plannable = summ["cells"] - len(summ.get("cells_no_planner_can_plan", []))
    out = ["# Results: zeppelin against the published systems (simulated)", ""]
    out += [(f"Generated by one command: `{command}` "
            f"({summ['cells']} cells, {args.steps} steps per cell, {len(args.planners)} planners, "
            f"{wall / 60:.1f} minutes wall on {args.machine}; code at commit `{getattr(args, 'code', 'unknown')}`"
            + ("; `-dirty`: with uncommitted changes" if str(getattr(args, "code", "")).endswith("-dirty") else "")
            + "). Nothing on this page is typed by hand; "
            "the full per-planner statistics are in [`results.json`](results.json)."), ""]
    out += [("**Method.** Each cell samples the same steps (seed "
            f"{args.seed}, {args.tokens_per_gpu:,} tokens per GPU per step, sequences longer than "
            f"{args.max_seq_len:,} tokens truncated) from a synthetic length mix — `short` (ArXiv-like, short-heavy), "
            "`mixed` (GitHub-like), `long` (ProLong64k-like), and on cluster A with LLaMA-13B at 64 and 128 GPUs "
            "`longtail` (short sequences with a few of the maximum length in every step), see "
            "`zeppelin.planner.tools.compare.MIXES` — plans them with "
            "every planner and simulates every plan with the event-driven simulator (`zeppelin simulate`), "
            "which uses the preset cost profiles (docs/DESIGN.md, \"Cost model\"), not measurements on these clusters. "
            "LLaMA-13B runs with tensor parallelism 2 (units of 2 GPUs), as in the Zeppelin paper, at ZeRO-3: the "
            "runtime keeps every parameter whole on each TP rank, so FSDP's sharding over every GPU takes the place "
            "of TP's (at ZeRO-1 each GPU would hold the whole bf16 model); 7B with tp=1 at ZeRO-1. "
            "Every MILP stops at deterministic limits, never at a clock, so every number on this page is the same "
            "on any machine and under any load: FlexSP runs at most 2 MILP solves per step of 30 branch-and-bound "
            "nodes each (the root alone for MILPs of more than 1,000 columns, 64+ GPUs), Hydraulis at most 4 packing ILPs of 50 nodes, zeppelin 1 packing ILP of 10 nodes (their "
            "papers spend 5-15 s per step, overlapped with training; these budgets bound the grid's planning "
            "time; this run's wall time is stated above)"
            + (f"; wall-clock safety net per solve: {args.solver_time_limit:g} s (where a solve stops at the net, "
               "that planner's plan may vary from run to run)" if args.solver_time_limit else "")
            + ". "
            f"With {args.steps} steps per cell the numbers are indicative, not converged statistics."), ""]
    out += ["## Summary", ""]
    out += [(f"- Mean speedup of zeppelin over te-cp: **{summ['zeppelin_vs_te_cp_mean']:.2f}x** (arithmetic mean over "
            f"cells; geometric mean {summ['zeppelin_vs_te_cp_geomean']:.2f}x, max "
            f"{summ['zeppelin_vs_te_cp_max']:.2f}x). te-cp is TransformerEngine / Megatron CP as jobs run it: one "
            "CP size for the whole run, the smallest power of two whose share of the longest allowed sequence fits "
            "a GPU's memory."),
            (f"- Mean speedup of zeppelin over te-cp-tuned (the same layout with the CP size chosen per step by "
             f"predicted time, stronger than what users run): **{summ.get('zeppelin_vs_te_cp_tuned_mean', math.nan):.2f}x** "
             f"(geometric mean {summ.get('zeppelin_vs_te_cp_tuned_geomean', math.nan):.2f}x, max "
             f"{summ.get('zeppelin_vs_te_cp_tuned_max', math.nan):.2f}x)."),
            f"- Mean speedup of zeppelin over the best other baseline of each cell: "
            f"**{summ['zeppelin_vs_best_baseline_mean']:.3f}x** (geometric mean "
            f"**{summ['zeppelin_vs_best_baseline_geomean']:.3f}x**); zeppelin is the fastest planner in "
            f"{summ['zeppelin_wins_cells']} of {plannable} cells some planner can plan, fastest or within 0.5% of "
            f"the fastest in **{summ.get('zeppelin_fastest_or_tied_cells', '-')} of {plannable}**. Best other "
            "baseline per cell: "
            + ", ".join(f"{k} {v}" for k, v in sorted(summ["best_baseline_counts"].items(), key=lambda kv: -kv[1]))
            + ".",
            (f"- Headroom: zeppelin's step time is {summ.get('zeppelin_over_lower_bound_geomean', math.nan):.3f}x the "
             "step's lower bound (geometric mean over cells; perfect balance, which a few long sequences or coarse "
             "groups make unreachable), the best other baseline's "
             f"{summ.get('best_other_over_lower_bound_geomean', math.nan):.3f}x: a plan at the bound in every cell "
             f"would lead the best other baseline by {summ.get('best_other_over_lower_bound_geomean', math.nan):.3f}x "
             "(geometric mean). A 1.10x geometric-mean lead needs zeppelin within "
             f"{summ.get('cap_for_1_10_lead', math.nan):.3f}x of the bound in every cell (each cell above brought down "
             f"to it); in {summ.get('cells_best_other_within_1_10_of_bound', '-')} of {summ['cells']} cells the best "
             "other baseline is itself within 1.10x of the bound, so no plan leads it there by 1.10x."),
            "- Cells where zeppelin is neither fastest nor within 0.5%: "
            + ("; ".join(summ.get("zeppelin_exceptions", [])) or "none") + ".",
            "- Cells no planner can plan (a step's longest sequence fits no layout within the GPUs' memory): "
            + ("; ".join(summ.get("cells_no_planner_can_plan", [])) or "none") + ".",
            *([(f"- Zeppelin plans {summ['auto_planned_cells']} of {summ['auto_cells']} cells with `--recompute auto` "
                "(its choice per micro-batch; the baselines run without recomputation); the highest predicted peak "
                "memory of a GPU over its usable capacity in its plans is "
                f"{summ['auto_memory_over_capacity_max']:.3f} ({summ['auto_memory_over_capacity_max_cell']}), "
                + ("so every micro-batch fits" if not summ["auto_over_capacity_cells"] else
                   "above capacity in " + "; ".join(summ["auto_over_capacity_cells"]))
                + "; its micro-batches by choice: "
                + ", ".join(f"{k} {v}" for k, v in summ["auto_microbatches"].items()) + ".")]
              if summ.get("auto_cells") else []),
            "- Cells only zeppelin can plan (every baseline fails on some step; counted among zeppelin's fastest "
            "above, left out of the speedups): " + ("; ".join(summ.get("cells_only_zeppelin_can_plan", [])) or "none")
            + ".",
            "- Cells where zeppelin leads the best other baseline by less than 2% (its margin there is a tie, not "
            "a lead): " + ("; ".join(summ.get("zeppelin_within_2pct_of_best_other", [])) or "none") + ".", ""]
    out += ["## The papers' qualitative findings, checked", ""]
    out += [f"{i + 1}. {t}" for i, t in enumerate(lines)] + [""]
    gap = summ.get("simulated_over_predicted", {})
    out += ["**Reading the numbers.** Each planner chooses its plan with the analytic cost model "
            "(`zeppelin.planner.costmodel.predict`, or its own objective for FlexSP and Hydraulis); the tables judge the plans "
            "with the event-driven simulator, which also plays out link contention, the coupling of units that "
            "exchange data (a unit waits for its slowest partner every layer) and the remap all-to-alls. "
            "Simulated / predicted step time, geometric mean over cells: "
            + ", ".join(f"{p} {v:.2f}" for p, v in gap.items())
            + ". Where a planner's ratio is well above the others', its own model under-estimates what its plans "
            "cost, and it is the planner, not the baselines, that the comparison penalises. By the analytic model "
            "alone (predicted step times, geometric mean over cells) zeppelin's plans are "
            f"{summ.get('predicted_speedup_zeppelin_vs_te_cp', math.nan):.2f}x te-cp's and "
            f"{summ.get('predicted_speedup_zeppelin_vs_best_baseline', math.nan):.2f}x the simulated-best baseline's "
            "(values above 1: zeppelin faster). Under ZeRO 1-3 both models make every unit wait for the slowest "
            "in each micro-batch, as FSDP2's per-layer gathers and reduce-scatters do (docs/CONCEPTS.md), so what "
            "must balance is each micro-batch; FlexSP's MILP minimises a sum of per-micro-batch maxima, and our "
            "FlexSP also considers whole-step homogeneous configurations (static Ulysses' "
            "among them) and keeps whichever candidate `predict_step` rates fastest. Zeppelin builds, beside its "
            "tiered plans and node-major micro-batches (sequences assigned to nodes for the whole step), four "
            "whole-step candidate families (`zeppelin.planner.zeppelin.families`): Ulysses groups that keep their "
            "units for the whole step (homogeneous or of two sizes, FlexSP's freedom), FLOP-share rings beside "
            "local units, replicas of a larger tensor-parallel degree (Hydraulis' freedom, up to a whole node: a long "
            "sequence then runs on one unit, without a ring), and, where a step's "
            "longest sequences keep it far above its bound, those sequences on side-by-side rings of 2, 4, ... "
            "whole nodes routed over every NIC; it keeps whichever "
            "candidate the prediction (on 16 units or fewer: the simulator) rates fastest. Where a family's layout "
            "is the cell's best, zeppelin ties the baseline that runs it rather than beating it.", ""]
    for cl_key, cl in CLUSTERS.items():
        for model, tp in MODELS.items():
            sub = [c for c in cells if c["cluster"] == cl and c["model"] == model]
            if not sub:
                continue
            img = f"img/results_{cl_key}_{model}.png"
            out += [f"## Cluster {cl_key} ({cl}), {model} (tp={tp}, ZeRO-{ZERO[model]})", "",
                    f"![speedup over te-cp]({img})", ""]
            out += [("Speedup over te-cp (ratio of mean simulated step times; `fail` = the planner cannot plan some "
                    "step, e.g. a sequence exceeds what it can hold); te-cp's and zeppelin's mean step time in "
                    "seconds."), ""]
            names = [p for p in args.planners if p != "te-cp"]
            out += ["| mix | GPUs | te-cp s | zeppelin s | " + " | ".join(names) + " | best other |",
                    "|---|---:|---:|---:|" + "---:|" * len(names) + "---|"]
            for c in sorted(sub, key=lambda c: (TABLE_MIXES.index(c["mix"]), c["gpus"])):
                te, z = _stat(c, "te-cp"), _stat(c, "zeppelin")
                row = [c["mix"], str(c["gpus"]), f"{te['mean_s']:.2f}" if te else "fail",
                       f"{z['mean_s']:.2f}" if z else "fail"]
                for p in names:
                    s = _stat(c, p)
                    v = s.get("speedup_vs_te_cp") if s else None
                    cellv = "fail" if s is None else (f"{v:.2f}" if v is not None else "-")
                    row.append(f"**{cellv}**" if p == "zeppelin" and s else cellv)
                row.append(c.get("best_baseline", "-"))
                out.append("| " + " | ".join(row) + " |")
            out.append("")
    out += ["## Planner latency", "",
            ("Mean planning time per step (ms, wall clock in the worker processes of this run; the machine is shared, "
            "so these are upper bounds), over all cells of each GPU count:"), ""]
    out += ["| planner | " + " | ".join(f"{g} GPUs" for g in GPUS) + " |", "|---|" + "---:|" * len(GPUS)]
    for p in args.planners:
        vals = []
        for g in GPUS:
            xs = [s["plan_latency_mean_s"] for c in cells if c["gpus"] == g and (s := _stat(c, p))]
            vals.append(f"{np.mean(xs) * 1e3:.0f}" if xs else "-")
        out.append(f"| {p} | " + " | ".join(vals) + " |")
    out.append("")
    return "\n".join(out)


_NO_CBC = ("import pulp\n"
           "def _no_cbc(*a, **k):\n"
           "    raise RuntimeError('CBC fallback disabled for this measurement')\n"
           "pulp.PULP_CBC_CMD = _no_cbc\n")


def _git_describe() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, check=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def speed(args) -> dict:
    """`zeppelin compare` at 64 GPUs, 50 steps, every planner: wall and CPU (with all child processes)."""
    import resource
    import subprocess

    cmd = ["compare", "-c", "zeppelin-a:8", "-m", "llama-7b", "-n", str(args.speed_steps), "--json"]
    code = ("import sys\n" + (_NO_CBC if args.no_cbc_fallback else "")
            + "from zeppelin.planner.cli import main\nmain(sys.argv[1:])\n")
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    doc = json.loads(out.stdout)
    per = {p["planner"]: ({"error": p["error"]} if p.get("error") else {
        "plan_latency_mean_ms": p["plan_latency_mean_s"] * 1e3, "plan_cpu_mean_ms": p["plan_cpu_mean_s"] * 1e3,
        "simulate_cpu_mean_ms": p["simulate_cpu_mean_s"] * 1e3}) for p in doc["planners"]}
    return {"command": "zeppelin " + " ".join(cmd), "cbc_fallback": not args.no_cbc_fallback, "wall_s": wall,
            "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
            "load_average_after": os.getloadavg(), "planners": per}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="steps per cell")
    ap.add_argument("--tokens-per-gpu", type=int, default=16384)
    ap.add_argument("--max-seq-len", type=int, default=131072)
    ap.add_argument("--solver-time-limit", type=float, default=None,
                    help="optional wall-clock safety net per MILP solve of flexsp / hydraulis (default: none; "
                         "their MILPs stop at deterministic node limits)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--clusters", default=",".join(CLUSTERS), help="subset of A,C")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--mixes", default=",".join(TABLE_MIXES),
                    help="of the grid's mixes and the long-tail cells' (those run only where their cluster, model "
                         "and GPU count are asked too)")
    ap.add_argument("--gpus", default=",".join(map(str, GPUS)))
    ap.add_argument("--model-cells", default=",".join(c[1] for c in MODEL_CELLS),
                    help="of MODEL_CELLS' models, those to run (empty: none)")
    ap.add_argument("--model-cells-only", action="store_true",
                    help="run only --model-cells and print their section of the page (writes nothing)")
    ap.add_argument("--usp-cells", default=",".join(sorted({c[1] for c in USP_CELLS})),
                    help="of USP_CELLS' models, those to run (empty: none)")
    ap.add_argument("--profile-cells-only", action="store_true",
                    help=f"plan only the cells beside the grid planned with --profile {PROFILE_NAME} and with the "
                    "preset curves; write their section into --out-dir's RESULTS.md")
    ap.add_argument("--usp-cells-only", action="store_true",
                    help="run only --usp-cells and print their section of the page (writes nothing)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "docs", help="RESULTS.md, results.json and img/ go here")
    ap.add_argument("--partial", type=Path, default=None, metavar="JSONL",
                    help="append each finished cell to JSONL and take the cells it already holds (same --steps) "
                         "from it instead of planning them again: a long run stopped part-way resumes")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="re-render the page and charts from a previous run's results.json (no planning)")
    ap.add_argument("--speed", action="store_true",
                    help="only time `zeppelin compare` at 64 GPUs x --speed-steps steps x every planner (JSON)")
    ap.add_argument("--speed-steps", type=int, default=50)
    ap.add_argument("--no-cbc-fallback", action="store_true",
                    help="with --speed: make PuLP's CBC unavailable (the zeppelin planner's ILP then falls back "
                         "to its greedy packing instead of a CBC subprocess)")
    ap.add_argument("--no-recompute-modes", action="store_true",
                    help="leave out zeppelin's runs under each global recompute mode beside auto")
    ap.add_argument("--recompute-only", action="store_true",
                    help="only zeppelin under auto and each global recompute mode on the cells asked for: writes "
                         "the recomputation section of RESULTS.md (between its markers) and results_recompute.json")
    ap.add_argument("--recompute-merge", default=None, metavar="JSON[,JSON...]",
                    help="re-render the recomputation section of RESULTS.md (in --out-dir) from the "
                         "results_recompute.json files of several --recompute-only runs (no planning)")
    args = ap.parse_args(argv)
    if args.speed:
        print(json.dumps(speed(args), indent=1))
        return
    args.planners = [p for p in args.planners.split(",") if p]
    if args.recompute_only:
        recompute_only(args)
        return
    if args.recompute_merge:
        recompute_merge(args)
        return
    args.machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}"
    args.code = _git_describe()
    cells = []
    t0 = time.perf_counter()
    todo = grid_todo(args)
    mtodo = [c for c in MODEL_CELLS if c[1] in args.model_cells.split(",")]
    utodo = [c for c in USP_CELLS if c[1] in args.usp_cells.split(",")]
    if args.usp_cells_only:
        ucells = []
        for k, model, g in utodo:
            ucells.append(run_usp_cell(CLUSTERS[k], model, g, args))
            print(f"[{time.perf_counter() - t0:6.0f} s] {model} {g} GPUs: {ucells[-1]['mean_s']}", file=sys.stderr,
                  flush=True)
        print("\n".join(render_usp_cells(ucells, args)))
        return
    if args.profile_cells_only:
        write_profile_section(args.out_dir, render_profile_cells(run_profile_cells(args), args))
        return
    if args.model_cells_only:
        mcells = [run_model_cell(CLUSTERS[k], model, tp, zs, mix, g, args) for k, model, tp, zs, mix, g in mtodo]
        print("\n".join(render_model_cells(mcells, args)))
        return
    mcells = []
    if args.from_json is not None:
        prev = json.loads(args.from_json.read_text())
        cells, wall, command = prev["cells"], prev["wall_s"], prev["command"]
        mcells = prev.get("model_cells", [])
        mtodo = []
        for k, v in prev.get("args", {}).items():
            setattr(args, k, v)
        todo = []
    done = load_partial(args.partial, args.steps)
    for cl, model, mix, g in todo:
        c = done.get(("grid", cl, model, mix, g)) or save_partial(args.partial, ("grid", cl, model, mix, g),
                                                                  run_cell(cl, model, MODELS[model], mix, g, args,
                                                                           zero_stage=ZERO[model]))
        cells.append(c)
        z = c.get("zeppelin_speedup_vs_te_cp", math.nan)
        print(f"[{time.perf_counter() - t0:6.0f} s] {cl} {model} {mix} {g} GPUs: zeppelin {z:.2f}x te-cp, "
              f"{c.get('zeppelin_speedup_vs_best_baseline', math.nan):.2f}x best ({c.get('best_baseline')})"
              f" [{c['wall_s']:.0f} s]", file=sys.stderr, flush=True)
    for k, model, tp, zs, mix, g in mtodo:
        key = ("model", CLUSTERS[k], model, mix, g)
        mcells.append(done.get(key) or save_partial(args.partial, key,
                                                    run_model_cell(CLUSTERS[k], model, tp, zs, mix, g, args)))
        print(f"[{time.perf_counter() - t0:6.0f} s] {model} {mix} {g} GPUs: zeppelin "
              f"{mcells[-1].get('zeppelin_speedup_vs_te_cp', math.nan):.2f}x te-cp", file=sys.stderr, flush=True)
    if args.from_json is None:  # cells taken from --partial count with the wall time they took
        wall = time.perf_counter() - t0 + sum(c.get("wall_s", 0.0) for c in done.values())
        argv_s = " ".join(sys.argv[1:] if argv is None else argv)
        command = ".venv/bin/python benchmarks/bench_compare.py" + (f" {argv_s}" if argv_s else "")
    summ, lines = findings(cells)
    if any("recompute" in c for c in cells):
        summ["recompute"] = recompute_summary(cells)
    out_dir = args.out_dir
    from zeppelin.schemas.io.safefiles import atomic_write_text

    (out_dir / "img").mkdir(parents=True, exist_ok=True)
    for k, cl in CLUSTERS.items():
        for model in MODELS:
            if any(c["cluster"] == cl and c["model"] == model for c in cells):
                chart(cells, cl, model, out_dir / "img" / f"results_{k}_{model}.png", args.planners)
    run_args = {k: getattr(args, k) for k in ("steps", "tokens_per_gpu", "max_seq_len", "solver_time_limit", "seed",
                                              "planners", "machine", "code")}
    atomic_write_text(out_dir / "results.json", json.dumps({"summary": summ, "cells": cells, "model_cells": mcells,
                                                            "wall_s": wall, "command": command, "args": run_args},
                                                           indent=1) + "\n")
    old_page = (out_dir / "RESULTS.md").read_text() if (out_dir / "RESULTS.md").exists() else ""
    has_rc = any("recompute" in c for c in cells)
    page = render_page(cells, summ, lines, args, wall, command)
    if mcells:
        page = page.rstrip("\n") + "\n\n" + "\n".join(render_model_cells(mcells, args))
    if has_rc:
        page = page.rstrip("\n") + "\n\n" + "\n".join([RECOMPUTE_MARKERS[0], *render_recompute(cells),
                                                       RECOMPUTE_MARKERS[1]])
    for block in kept_sections(old_page, recompute=not has_rc):
        page = page.rstrip("\n") + "\n\n" + block
    atomic_write_text(out_dir / "RESULTS.md", page.rstrip("\n") + "\n")
    print(json.dumps({"summary": summ, "findings": lines, "wall_s": wall, "command": command}, indent=1))


if __name__ == "__main__":
    main()
