"""Selection fidelity of the Zeppelin planner: does it choose what its own simulator would choose?

    .venv/bin/python benchmarks/bench_selection.py                  # every cell, JSON on stdout
    .venv/bin/python benchmarks/bench_selection.py --cells longtail --detail   # per-candidate lines

Per step, every candidate plan the planner builds (collected through ``ZeppelinPlanner.collector``)
is predicted (``StepPlan.prediction``, :mod:`zeppelin.planner.costmodel.predict`) and simulated
(:mod:`zeppelin.planner.sim.simulate`, the reference). Two statistics (docs/DESIGN.md, "One
truth"):

* **choice**: the share of steps whose chosen plan simulates within 0.5% of the fastest-simulated
  candidate of the step;
* **fidelity**: the share of candidates whose predicted step time is within 5% of the simulated one.

Cells: the RESULTS grid (``benchmarks/bench_compare.py``: clusters A and C x LLaMA-7B tp 1 /
LLaMA-13B tp 2 x the short / mixed / long mixes x 16 / 32 / 64 / 128 GPUs, 4 steps each) and
slow-network long-tail cells (``zeppelin-a:8``, LLaMA-13B, ZeRO-3, 512K-token steps: the mixed and
long mixes, and steps of several 131,072-token sequences among short ones) and the usp cells
(models with few KV heads, the long mix on 32 and 64 GPUs, where usp groups are candidates and
the ``usp`` baseline's plans are judged too). Every exception is
listed with the terms of both models (``--detail``: every candidate).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

GRID_CLUSTERS = ("zeppelin-a", "zeppelin-c")
GRID_MODELS = {"llama-7b": 1, "llama-13b": 2}
GRID_ZERO = {"llama-7b": 1, "llama-13b": 3}   # as bench_compare.ZERO
GRID_MIXES = ("short", "mixed", "long")
GRID_GPUS = (16, 32, 64, 128)
CHOICE_TOL = 0.005
FIDELITY_TOL = 0.05


def grid_cells(steps: int = 4) -> list[dict]:
    return [{"name": f"{cl[-1].upper()} {m} {mix} {g}", "cluster": f"{cl}:{g // 8}", "model": m, "tp": tp,
             "zero": GRID_ZERO[m], "mix": mix, "tokens": 16384 * g, "steps": steps}
            for cl in GRID_CLUSTERS for m, tp in GRID_MODELS.items() for mix in GRID_MIXES for g in GRID_GPUS]


def longtail_cells(steps: int = 4) -> list[dict]:
    out = []
    for tp in (2, 1):
        for mix in ("mixed", "long"):
            out.append({"name": f"A8 llama-13b tp{tp} {mix} 512K", "cluster": "zeppelin-a:8", "model": "llama-13b",
                        "tp": tp, "zero": 3, "mix": mix, "tokens": 524288, "steps": steps})
        out.append({"name": f"A8 llama-13b tp{tp} tail 512K", "cluster": "zeppelin-a:8", "model": "llama-13b",
                    "tp": tp, "zero": 3, "mix": "tail", "tokens": 524288, "steps": steps})
    return out


#: models with few KV heads for the usp cells: Llama-3-8B and Qwen3-8B (8), Qwen2.5-3B (2)
USP_MODELS = ("llama3-8b", "qwen3-8b", "qwen2.5-3b")


def usp_cells(steps: int = 4) -> list[dict]:
    """Cells where sequences must cross nodes and usp groups are candidates: the long mix on 32 and
    64 GPUs of cluster A for models with few KV heads. Beside the Zeppelin planner's candidates,
    the ``usp`` baseline's plan of each step is judged too (its fixed u x r groups), and static
    Ulysses' (its degrees up to the query heads: K/V heads replicated past the KV heads)."""
    return [{"name": f"A {m} long {g}", "cluster": f"zeppelin-a:{g // 8}", "model": m, "tp": 1, "zero": 1,
             "mix": "long", "tokens": 16384 * g, "steps": steps, "extra": ["usp", "ulysses"]}
            for m in USP_MODELS for g in (32, 64)]


def tail_steps(tokens: int, steps: int, seed: int = 0) -> list[list]:
    """Steps of 2-3 sequences of 131,072 tokens among short ones of the short mix (``tokens`` in all)."""
    from zeppelin.planner.tools.compare import mix_dataset
    from zeppelin.schemas.plan import Sequence

    short = mix_dataset("short", seed=seed).lengths
    rng = np.random.default_rng(seed)
    out, sid = [], 0
    for k in range(steps):
        lens = [131072] * (2 + k % 2)
        while sum(lens) < tokens:
            x = int(short[rng.integers(len(short))])
            lens.append(min(x, tokens - sum(lens)))
        out.append([Sequence(sample_id=sid + i, length=int(x)) for i, x in enumerate(lens)])
        sid += len(lens)
    return out


def cell_inputs(cell: dict, seed: int = 0):
    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
    from zeppelin.planner.core.sampler import run_max_seq_len, sample_steps
    from zeppelin.planner.tools.compare import mix_dataset
    from zeppelin.schemas.plan import SamplerConfig

    cl = resolve_cluster(cell["cluster"])
    ctx = PlanContext(cl, resolve_model(cell["model"]), resolve_profile(None, cl), tp=cell["tp"],
                      zero_stage=cell["zero"], seed=seed)
    cfg = SamplerConfig(tokens_per_step=cell["tokens"], seed=seed, max_seq_len=131072)
    if cell["mix"] == "tail":
        ctx.max_seq_len = 131072
        return ctx, tail_steps(cell["tokens"], cell["steps"], seed)
    ds = mix_dataset(cell["mix"])
    ctx.max_seq_len = run_max_seq_len(ds, cfg)
    return ctx, sample_steps(ds, cfg, cell["steps"])


def terms(plan, sim) -> dict:
    """The largest unit's terms of the prediction and of the simulation (seconds)."""
    p = plan.prediction.per_unit
    u = int(np.argmax(p.total_s))
    s = sim.units
    v = int(np.argmax([x.busy_s + x.exposed_comm_s for x in s]))
    return {"pred": {"attn": p.attention_s[u], "lin": p.linear_s[u], "exposed": p.exposed_comm_s[u]},
            "sim": {"attn": s[v].attention_s, "lin": s[v].linear_s, "exposed": s[v].exposed_comm_s,
                    "idle": s[v].idle_s}}


def describe(plan) -> str:
    """A candidate's shape: solver name / family and its group kinds."""
    from collections import Counter

    kinds = Counter(f"{g.kind}-{g.tier}:{len(g.units)}" for mb in plan.microbatches for g in mb.groups if len(g.units) > 1)
    top = ",".join(f"{k}x{n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:4])
    return f"{plan.solver.name if plan.solver else '?'} mb={len(plan.microbatches)} {top}"


def run_cell(cell: dict, detail: bool = False, seed: int = 0) -> dict:
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
    from zeppelin.schemas.common import InputError

    ctx, steps = cell_inputs(cell, seed)
    sim = Simulator(ctx)
    out = {"cell": cell["name"], "steps": [], "candidates": 0, "fidelity_ok": 0, "choice_ok": 0, "exceptions": [],
           "unplannable": None}
    for k, seqs in enumerate(steps):
        built: list = []
        pl = ZeppelinPlanner()
        pl.collector = built.append
        try:
            chosen = pl.plan_step(ctx, k, seqs)
        except InputError as e:  # no layout holds the step (the cell reports why; no statistic counts it)
            out["unplannable"] = f"step {k}: {e}"
            break
        for name in cell.get("extra", ()):  # other planners' plans, judged like the candidates
            from zeppelin.planner.core.base import get_planner

            built.append(get_planner(name).plan_step(ctx, k, seqs))
        rows = []
        for plan in built:
            r = sim.simulate_step(plan)
            rows.append((plan, plan.prediction.step_time_s, r.step_time_s, r))
        best = min(x[2] for x in rows)
        mine = next((x for x in rows if x[0] is chosen), None)
        t_chosen = mine[2] if mine is not None else sim.simulate_step(chosen).step_time_s
        ok = t_chosen <= best * (1 + CHOICE_TOL)
        out["choice_ok"] += ok
        out["steps"].append({"step": k, "chosen_sim_s": t_chosen, "best_sim_s": best, "ok": bool(ok),
                             "lower_bound_s": chosen.prediction.lower_bound_s, "candidates": len(rows)})
        if not ok:
            out["exceptions"].append({"kind": "choice", "step": k, "chosen_sim_s": t_chosen, "best_sim_s": best,
                                      "chosen_pred_s": chosen.prediction.step_time_s,
                                      "best_pred_s": min(rows, key=lambda x: x[2])[1]})
        for plan, pred, simt, r in rows:
            out["candidates"] += 1
            good = abs(pred / simt - 1) <= FIDELITY_TOL
            out["fidelity_ok"] += good
            if not good or detail:
                row = {"kind": "fidelity" if not good else "candidate", "step": k, "plan": describe(plan),
                       "pred_s": pred, "sim_s": simt, "ratio": pred / simt, **terms(plan, r)}
                out["exceptions"].append(row)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default="grid,longtail,usp", help="grid, longtail, usp (comma list)")
    ap.add_argument("--steps", type=int, default=4, help="steps per cell")
    ap.add_argument("--only", default="", help="only the cells whose name contains this text")
    ap.add_argument("--detail", action="store_true", help="list every candidate, not only the exceptions")
    args = ap.parse_args(argv)
    cells = []
    if "grid" in args.cells:
        cells += grid_cells(args.steps)
    if "longtail" in args.cells:
        cells += longtail_cells(args.steps)
    if "usp" in args.cells:
        cells += usp_cells(args.steps)
    cells = [c for c in cells if args.only in c["name"]]
    t0 = time.perf_counter()
    res = []
    for c in cells:
        r = run_cell(c, args.detail)
        res.append(r)
        print(f"[{time.perf_counter() - t0:6.0f} s] {c['name']}: choice {r['choice_ok']}/{len(r['steps'])}, "
              f"fidelity {r['fidelity_ok']}/{r['candidates']}"
              + (f" (cannot be planned: {r['unplannable']})" if r["unplannable"] else ""), file=sys.stderr, flush=True)
    steps = sum(len(r["steps"]) for r in res)
    cands = sum(r["candidates"] for r in res)
    ratios = [s["chosen_sim_s"] / s["lower_bound_s"] for r in res for s in r["steps"]]
    best_ratios = [s["best_sim_s"] / s["lower_bound_s"] for r in res for s in r["steps"]]
    doc = {
        "command": ".venv/bin/python benchmarks/bench_selection.py" + (" " + " ".join(argv or sys.argv[1:])).rstrip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
        "cells": len(res), "steps": steps, "candidates": cands,
        "choice_within_0_5pct": sum(r["choice_ok"] for r in res) / max(steps, 1),
        "fidelity_within_5pct": sum(r["fidelity_ok"] for r in res) / max(cands, 1),
        "chosen_over_bound_mean": float(np.mean(ratios)) if ratios else None,
        "best_over_bound_mean": float(np.mean(best_ratios)) if best_ratios else None,
        "unplannable_cells": [f"{r['cell']}: {r['unplannable']}" for r in res if r["unplannable"]],
        "wall_s": time.perf_counter() - t0,
        "per_cell": res,
    }
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
