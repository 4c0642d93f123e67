"""Zeppelin planner benchmark: latency per step, plan quality vs the lower bound, ablation.

    python benchmarks/bench_planner.py                      # everything (JSON lines on stdout)
    python benchmarks/bench_planner.py --only latency --sizes 16,64,256
    python benchmarks/bench_planner.py --only latency --sizes 64,1024,4096,16384 --latency-steps 5
    python benchmarks/bench_planner.py --only latency --sizes 64,1024 --recompute auto   # zeppelin plan's default
    python benchmarks/bench_planner.py --only quality --steps 100
    python benchmarks/bench_planner.py --only rss --rss-gpus 4096 --rss-steps 1,4   # peak RSS of plan files

Length distributions are generated here (seeded): *short-heavy* (log-normal, median ~1.1K),
*long-heavy* (log-normal, median ~22K) and *mixed* (log-normal body + Pareto tail); all clipped to
128K. A step takes sequences until its token budget (the cluster's activation capacity) is full.
Quality = predicted step time / lower bound (``predict_step``: the micro-batches memory forces
included), per step; the latency rows also report it against the bound of one micro-batch
(``median_ratio_one_microbatch_bound``, the bound before it counted them). The latency rows also give
the process's peak resident memory after each size (``peak_rss_mb``; sizes run smallest first, so
it is the peak of planning that size) and, where the code can report it (``--breakdown``), where
the step's time above its bound goes; with ``--simulate-max-gpus N``, up to N GPUs, also the
simulated step over the bound (``median_sim_ratio``, after the timing).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import zlib

import numpy as np

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.costmodel.predict import lower_bounds
from zeppelin.planner.zeppelin.planner import ZeppelinNoRemap, ZeppelinPlanner, ZeppelinTiersOnly
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Sequence
from zeppelin.schemas.profile import default_profile

MAX_LEN = 128 * 1024


def draw(dist: str, rng: np.random.Generator, n: int, max_len: int = MAX_LEN) -> np.ndarray:
    if dist == "short":
        L = rng.lognormal(7.0, 1.0, n)
    elif dist == "long":
        L = rng.lognormal(10.0, 1.0, n)
    elif dist == "mixed":
        body = rng.lognormal(7.0, 1.0, n)
        tail = (rng.pareto(1.2, n) + 1.0) * 4096
        L = np.where(rng.random(n) < 0.1, tail, body)
    else:
        raise ValueError(dist)
    return np.clip(L.astype(np.int64), 16, max_len)


def steps_for(dist: str, budget: int, num_steps: int, seed: int, max_len: int = MAX_LEN) -> list[list[Sequence]]:
    rng = np.random.default_rng(seed)
    out, sid = [], 0
    for _ in range(num_steps):
        L = draw(dist, rng, 4096, max_len)
        while L.sum() < budget:
            L = np.concatenate([L, draw(dist, rng, 4096, max_len)])
        cut = max(1, int(np.searchsorted(np.cumsum(L), budget, side="right")))
        out.append([Sequence(sample_id=sid + i, length=int(x)) for i, x in enumerate(L[:cut])])
        sid += cut
    return out


def ctx_for(cluster: str, model: str, zero_stage: int = 1, recompute: str = "none") -> PlanContext:
    cl = cluster_preset(cluster)
    return PlanContext(cl, model_preset(model), default_profile(cl.name), zero_stage=zero_stage, recompute=recompute)


# LLaMA-13B with ZeRO-1 leaves 2K activation tokens per A800 (32K for 16 GPUs, less than one 128K
# sequence); the paper runs 13B with model-state sharding / TP, so the benchmark uses ZeRO-3 for it.
ZERO = {"llama-7b": 1, "llama-13b": 3}


def warm_solvers() -> None:
    """The MILP solvers' one-time set-up (HiGHS imported, PuLP's probe of the solvers it can run),
    made before any timing: the planner makes it at its first packing ILP, which a run pays once,
    not at whichever timed step happens to solve one first."""
    from zeppelin.planner.core.solver import available_solvers, quiet_highs

    quiet_highs()
    available_solvers()


def latency(sizes: list[int], steps: int, breakdown: bool = False, simulate_max: int = 0,
            recompute: str = "none") -> None:
    warm_solvers()
    for gpus in sizes:
        nodes = max(1, gpus // 8)
        ctx, todo = latency_inputs(gpus, steps, recompute)
        n_steps = len(todo)
        pl = ZeppelinPlanner()
        times, cpu, seqs, ratios, solvers, parts, sims, one = [], [], [], [], [], [], [], []
        for k, ss in enumerate(todo):
            L = np.array([q.length for q in ss], dtype=np.int64)
            t0, c0 = time.perf_counter(), time.process_time()
            sp = pl.plan_step(ctx, k, ss)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            seqs.append(len(ss))
            ratios.append(sp.prediction.step_time_s / sp.prediction.lower_bound_s)
            # (against the bound of one micro-batch, which memory may not allow: the former bound)
            one.append(sp.prediction.step_time_s / max(lower_bounds(ctx, L.astype(np.float64), microbatches=1)))
            solvers.append(sp.solver.name)
            if breakdown:
                parts.append(over_bound(ctx, sp))
            if gpus <= simulate_max:  # (after the timing: the simulator is the judge, not the planner)
                from zeppelin.planner.sim.simulate import Simulator

                sims.append(Simulator(ctx).simulate_step(sp).step_time_s / sp.prediction.lower_bound_s)
        row = {}
        if sims:
            row["median_sim_ratio"] = round(float(np.median(sims)), 4)
        if parts:
            row["over_bound"] = {k: round(float(np.median([p[k] for p in parts])), 4) for k in parts[0]}
        print(json.dumps({"bench": "planner_latency", "gpus": gpus, "cluster": ctx.cluster.name,
                          "nodes": nodes, "model": "llama-7b", "recompute": recompute,
                          "seqs_per_step": int(np.median(seqs)),
                          "steps": n_steps, "median_s": round(float(np.median(times)), 4),
                          "max_s": round(float(np.max(times)), 4), "median_cpu_s": round(float(np.median(cpu)), 4),
                          "median_ratio": round(float(np.median(ratios)), 4),
                          "median_ratio_one_microbatch_bound": round(float(np.median(one)), 4),
                          "solvers": {s: solvers.count(s) for s in sorted(set(solvers))},
                          "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                          **row}), flush=True)


def latency_inputs(gpus: int, steps: int, recompute: str = "none") -> tuple[PlanContext, list[list[Sequence]]]:
    """A latency row's context (``zeppelin-c``, 8 GPUs a node, LLaMA-7B) and its steps: ~8 sequences
    per GPU of the mixed distribution; ``steps`` up to 1,024 GPUs, half beyond, a third beyond 4,096."""
    ctx = ctx_for(f"zeppelin-c:{max(1, gpus // 8)}", "llama-7b", recompute=recompute)
    rng = np.random.default_rng(gpus)
    n = steps if gpus <= 1024 else max(3, steps // 2) if gpus <= 4096 else max(2, steps // 3)
    return ctx, [[Sequence(sample_id=i, length=int(x)) for i, x in enumerate(draw("mixed", rng, 8 * gpus))]
                 for _ in range(n)]


def whole_cpu(sizes: list[int], steps: int, recompute: str = "none") -> None:
    """The latency rows' steps planned back to back, each plan dropped before the next: process CPU
    per step including whatever a step leaves to do after ``plan_step`` returns (the cyclic
    collector's pass over its plan), which the latency rows' timer around ``plan_step`` does not see.
    Runs any code on ``PYTHONPATH`` (it calls ``plan_step`` only)."""
    import gc

    warm_solvers()
    for gpus in sizes:
        ctx, todo = latency_inputs(gpus, steps, recompute)
        pl = ZeppelinPlanner()
        gc.collect()
        c0 = time.process_time()
        for k, ss in enumerate(todo):
            sp = pl.plan_step(ctx, k, ss)
            del sp
        cpu = (time.process_time() - c0) / len(todo)
        print(json.dumps({"bench": "planner_whole_cpu", "gpus": gpus, "recompute": recompute, "steps": len(todo),
                          "cpu_s_per_step": round(cpu, 4)}), flush=True)


def over_bound(ctx: PlanContext, plan) -> dict[str, float]:
    """Where a plan's predicted step time above its lower bound goes, as shares of the bound:
    ``work`` (the units' mean time above the work bound: ring and split overheads, linear kernels
    on smaller micro-batches), ``exposed`` (mean exposed communication beyond the gradient
    all-reduce, part of ``work`` too), ``imbalance`` (per micro-batch, the slowest unit above the
    mean, summed: what coupled micro-batches pay) and ``micro_batches``."""
    from zeppelin.planner.costmodel.predict import microbatch_terms

    pr = plan.prediction
    lengths = [q.length for q in plan.sequences]
    terms = [microbatch_terms(ctx, lengths, mb) for mb in plan.microbatches]
    # (the gradient collectives as the prediction charges them: FSDP's prefetched ones hide behind
    # each micro-batch's layers)
    ar = ctx.cost.step_collectives_time(len(terms), ctx.num_units, [float(t.period.max()) for t in terms])
    mean = sum(float(t.busy.mean()) for t in terms) + ar
    lb = pr.lower_bound_s
    return {"work": (mean - lb) / lb, "exposed": sum(float(t.exposed.mean()) for t in terms) / lb,
            "imbalance": sum(float(t.period.max() - t.busy.mean()) for t in terms) / lb,
            "micro_batches": float(len(terms))}


def quality(clusters, models, dists, steps: int) -> None:
    for cluster in clusters:
        for model in models:
            ctx = ctx_for(cluster, model, ZERO[model])
            budget = ctx.cost.token_capacity * ctx.num_units
            pl = ZeppelinPlanner()
            # (the data's longest sequence: 128K, or what the cluster's units hold together)
            longest = held_together(pl, ctx)
            for dist in dists:
                ratios, times, mbs = [], [], []
                seed = zlib.crc32(f"{cluster}|{model}|{dist}".encode())
                for k, ss in enumerate(steps_for(dist, budget, steps, seed=seed, max_len=longest)):
                    t0 = time.perf_counter()
                    sp = pl.plan_step(ctx, k, ss)
                    times.append(time.perf_counter() - t0)
                    ratios.append(sp.prediction.step_time_s / sp.prediction.lower_bound_s)
                    mbs.append(len(sp.microbatches))
                r = np.array(ratios)
                print(json.dumps({"bench": "plan_quality", "cluster": cluster, "model": model,
                                  "zero_stage": ZERO[model], "dist": dist, "max_len": longest,
                                  "steps": steps, "tokens_per_step": budget, "median_ratio": round(float(np.median(r)), 4),
                                  "worst_ratio": round(float(r.max()), 4), "p90_ratio": round(float(np.quantile(r, 0.9)), 4),
                                  "median_plan_s": round(float(np.median(times)), 4),
                                  "median_microbatches": float(np.median(mbs))}), flush=True)


def held_together(pl, ctx: PlanContext) -> int:
    """The longest sequence (at most :data:`MAX_LEN`) some span of the cluster's units holds."""
    tiering = pl.tiering(ctx)
    lo, hi = 16, MAX_LEN
    if tiering.min_span(hi) is not None:
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if tiering.min_span(mid) is not None else (lo, mid - 1)
    return lo


def ablation(cluster: str, model: str, dists, steps: int) -> None:
    ctx = ctx_for(cluster, model)
    budget = ctx.cost.token_capacity * ctx.num_units
    # the tiered search alone (no candidate families), so that the layers' contributions show
    variants = [("tiers only", ZeppelinTiersOnly(families="none")), ("+ routing", ZeppelinNoRemap(families="none")),
                ("+ remapping", ZeppelinPlanner(families="none"))]
    for dist in dists:
        all_steps = steps_for(dist, budget, steps, seed=7)
        res = {}
        for label, pl in variants:
            t = [pl.plan_step(ctx, k, ss).prediction.step_time_s for k, ss in enumerate(all_steps)]
            res[label] = float(np.sum(t))
        base = res["tiers only"]
        print(json.dumps({"bench": "ablation", "cluster": cluster, "model": model, "dist": dist, "steps": steps,
                          "total_predicted_s": {k: round(v, 3) for k, v in res.items()},
                          "speedup_vs_tiers_only": {k: round(base / v, 4) for k, v in res.items()}}), flush=True)


_RSS_CODE = ("import atexit, resource, sys\n"
             "atexit.register(lambda: print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
             " file=sys.stderr))\n"
             "from zeppelin.planner.cli import main\nmain(sys.argv[1:])\n")


def rss(gpus: int, step_counts: list[int]) -> None:
    """Peak resident memory of ``zeppelin plan`` writing a plan file of ``k`` steps at ``gpus`` GPUs
    (LLaMA-7B, cluster zeppelin-c, the shipped sample manifest, a step = the cluster's activation
    capacity): steps are written as they are planned, so the peak should not grow with ``k``."""
    import os
    import subprocess
    import tempfile

    for k in step_counts:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "plan.jsonl")
            cmd = ["plan", "-c", f"zeppelin-c:{max(1, gpus // 8)}", "--model", "llama-7b", "--steps", str(k),
                   "-o", out, "-q"]
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", _RSS_CODE, *cmd], capture_output=True, text=True, check=True)
            wall = time.perf_counter() - t0
            kb = int(next(line.split()[1] for line in r.stderr.splitlines() if line.startswith("MAXRSS_KB")))
            size = os.path.getsize(out)
        print(json.dumps({"bench": "plan_file_rss", "gpus": gpus, "steps": k, "command": "zeppelin " + " ".join(cmd),
                          "peak_rss_mb": round(kb / 1024, 1), "plan_file_mb": round(size / 2**20, 2),
                          "wall_s": round(wall, 1)}), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["latency", "whole-cpu", "quality", "ablation", "rss"], default=None,
                    help="whole-cpu: the latency rows' steps back to back, CPU per step with what each leaves "
                         "to do after plan_step (not in the default run)")
    ap.add_argument("--sizes", default="16,64,256,1024,4096,16384", help="GPUs (8 per node), comma list")
    ap.add_argument("--latency-steps", type=int, default=5, help="steps per size up to 1,024 GPUs (half beyond, "
                    "a third beyond 4,096)")
    ap.add_argument("--breakdown", action="store_true", help="latency rows: where the time above the bound goes")
    ap.add_argument("--recompute", default="none", choices=["none", "auto"],
                    help="latency rows: plan under this setting (auto: zeppelin plan's default, a choice per micro-batch)")
    ap.add_argument("--simulate-max-gpus", type=int, default=0, metavar="N",
                    help="latency rows up to N GPUs: also the simulated step over the bound (median_sim_ratio)")
    ap.add_argument("--steps", type=int, default=100, help="steps per quality cell")
    ap.add_argument("--ablation-steps", type=int, default=30)
    ap.add_argument("--rss-gpus", type=int, default=4096)
    ap.add_argument("--rss-steps", default="1,4", help="plan-file lengths (steps) whose peak RSS is compared")
    a = ap.parse_args(argv)
    print(json.dumps({"bench": "machine", "python": sys.version.split()[0]}), flush=True)
    if a.only in (None, "latency"):
        latency(sorted(int(x) for x in a.sizes.split(",")), a.latency_steps, a.breakdown, a.simulate_max_gpus,
                a.recompute)
    if a.only == "whole-cpu":
        whole_cpu(sorted(int(x) for x in a.sizes.split(",")), a.latency_steps, a.recompute)
    if a.only in (None, "quality"):
        quality(["zeppelin-a", "zeppelin-c"], ["llama-7b", "llama-13b"], ["short", "long", "mixed"], a.steps)
    if a.only in (None, "ablation"):
        for cl in ("zeppelin-a", "zeppelin-c"):
            ablation(cl, "llama-7b", ["short", "mixed", "long"], a.ablation_steps)
    if a.only in (None, "rss"):
        rss(a.rss_gpus, [int(x) for x in a.rss_steps.split(",")])


if __name__ == "__main__":
    main()
