"""Long steps on slow networks: steps of several 131,072-token sequences among short ones on nodes
of 4 NICs, where plans land farthest from their lower bound.

Cells (cluster A, ``zeppelin-a``: 8 GPUs and 4 NICs per node; LLaMA-13B, ZeRO-3, as the selection
benchmark's long-tail cells): tensor-parallel degree 2 and 1 x 8 nodes with 512K-token steps and
16 nodes with 1M-token steps; every step holds two to four 131,072-token sequences, the rest short
ones of the ``short`` mix (:func:`bench_selection.tail_steps`). Every planner of ``zeppelin
compare`` plans the same steps and every plan is simulated
(:func:`zeppelin.planner.tools.compare.run_compare`). Per cell and planner: the mean simulated step
over the step's lower bound ("x bound"), the worst step's, and the mean step time; whether zeppelin
beats every baseline. Zeppelin runs with ``--recompute auto`` (its choice per micro-batch; the
baselines run ``none`` under it, as ``zeppelin compare`` does by default) and, beside it, under each
global mode (``none``, ``selective``, ``full``): step time over the bound and predicted peak memory
over capacity per mode (:func:`bench_compare._mode_stats`). JSON on stdout (or ``-o``), a line per cell
on stderr; ``--write-results DIR`` also writes the long-step section of ``DIR/RESULTS.md`` (between its
markers) and ``DIR/results_longsteps.json``.

    python benchmarks/bench_longsteps.py [--steps 4] [--planners zeppelin,te-cp,...] [-o RESULT.json]
                                         [--write-results docs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (name, cluster, tensor-parallel degree, tokens per step)
CELLS = [("A8 llama-13b tp2 512K", "zeppelin-a:8", 2, 524288), ("A8 llama-13b tp1 512K", "zeppelin-a:8", 1, 524288),
         ("A16 llama-13b tp2 1M", "zeppelin-a:16", 2, 1048576)]
TARGET = 1.08


def long_steps(tokens: int, steps: int, seed: int = 0) -> list[list]:
    """Steps of 2-3 sequences of 131,072 tokens among short ones (``tokens`` in all); from a
    million tokens on, two more long ones in every step."""
    from bench_selection import tail_steps

    out = tail_steps(tokens, steps, seed)
    if tokens >= 1 << 20:
        out = [_with_long(s, 2) for s in out]
    return out


def _with_long(seqs: list, extra: int) -> list:
    """``seqs`` with its last short sequences replaced by ``extra`` more of 131,072 tokens (same total)."""
    from zeppelin.schemas.plan import Sequence

    total = sum(s.length for s in seqs)
    longs = [s for s in seqs if s.length == 131072]
    short = [s for s in seqs if s.length != 131072]
    keep, room = [], total - 131072 * (len(longs) + extra)
    for s in short:
        if room <= 0:
            break
        keep.append(Sequence(sample_id=s.sample_id, length=min(s.length, room)))
        room -= keep[-1].length
    base = max(s.sample_id for s in seqs) + 1
    return longs + [Sequence(sample_id=base + i, length=131072) for i in range(extra)] + keep


def _context(cluster: str, tp: int, recompute: str):
    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile

    cl = resolve_cluster(cluster)
    ctx = PlanContext(cl, resolve_model("llama-13b"), resolve_profile(None, cl), tp=tp, zero_stage=3,
                      recompute=recompute)
    ctx.max_seq_len = 131072
    return ctx


def run_cell(name: str, cluster: str, tp: int, tokens: int, steps: int, planners: list[str],
             recompute: str = "auto", modes: bool = True, breakdown: bool = False) -> dict:
    """One cell: every planner's mean / worst step over the bound; with ``modes``, zeppelin under
    ``auto`` and each global recompute mode (:func:`bench_compare._mode_stats` of each); with
    ``breakdown``, where zeppelin's steps spend their time (:func:`_breakdown`)."""
    from bench_compare import RECOMPUTE_GLOBAL, _mode_stats
    from zeppelin.planner.tools.compare import run_compare

    ctx = _context(cluster, tp, recompute)
    step_seqs = long_steps(tokens, steps)
    out = {"cell": name, "cluster": cluster, "tp": tp, "tokens": tokens, "recompute": recompute,
           "long_per_step": [sum(s.length == 131072 for s in st) for st in step_seqs], "planners": {}}
    keep = {("zeppelin", k) for k in range(len(step_seqs))} if "zeppelin" in planners else set()
    runs = run_compare(ctx, step_seqs, planners, keep=keep)
    for run in runs:
        if run.planner == "zeppelin" and modes:
            out["recompute_modes"] = {recompute: _mode_stats(ctx, run)}
        if run.error is not None:
            out["planners"][run.planner] = {"error": run.error}
            continue
        ratios = [t / b for t, b in zip(run.step_times, run.lower_bounds)]
        out["planners"][run.planner] = {"x_bound_mean": round(sum(ratios) / len(ratios), 4),
                                        "x_bound_worst": round(max(ratios), 4),
                                        "step_mean_s": round(sum(run.step_times) / len(run.step_times), 3)}
    for mode in RECOMPUTE_GLOBAL if "recompute_modes" in out else ():
        if mode not in out["recompute_modes"]:
            mctx = _context(cluster, tp, mode)
            (mz,) = run_compare(mctx, step_seqs, ["zeppelin"], keep=keep)
            out["recompute_modes"][mode] = _mode_stats(mctx, mz)
    zrun = next((r for r in runs if r.planner == "zeppelin"), None)
    if breakdown and zrun is not None and zrun.plans and zrun.error is None:
        out["breakdown"] = _breakdown(ctx, zrun)
    z = out["planners"].get("zeppelin", {})
    others = [v["step_mean_s"] for p, v in out["planners"].items() if p != "zeppelin" and not p.startswith(
        "zeppelin-") and "error" not in v]
    out["zeppelin_beats_every_baseline"] = "error" not in z and all(z["step_mean_s"] < o for o in others)
    out["zeppelin_within_target"] = "error" not in z and z["x_bound_mean"] <= TARGET
    return out


def _breakdown(ctx, run) -> dict:
    """Where zeppelin's plans of a cell spend the step, by the simulator, each term over the step's
    lower bound and averaged over the steps: the units' compute (mean and slowest: attention and
    linear modules, recomputed forwards included; the bound holds the balanced compute without
    recomputation), their exposed transfers (ring, routing, remap; the gradient collectives apart),
    their idle time (waiting for the slowest unit of each micro-batch), and the gradient
    collectives; beside them the micro-batches per step and their recompute choices."""
    from zeppelin.planner.sim.simulate import Simulator

    sim, rows = Simulator(ctx), []
    for k in sorted(run.plans):
        plan, b = run.plans[k], run.lower_bounds[k]
        r = sim.simulate_step(plan)
        busy = np.array([u.busy_s for u in r.units])
        rows.append([busy.mean() / b, busy.max() / b,
                     np.mean([u.exposed_comm_s - r.allreduce_s for u in r.units]) / b,
                     np.mean([u.idle_s for u in r.units]) / b, r.allreduce_s / b, len(plan.microbatches)])
    m = np.mean(rows, axis=0)
    choices = sorted({mb.recompute_of(u) or "none" for k in run.plans for mb in run.plans[k].microbatches
                      for u in range(len(mb.queues))})
    return {"compute_mean": round(float(m[0]), 4), "compute_max": round(float(m[1]), 4),
            "exposed_comm": round(float(m[2]), 4), "idle": round(float(m[3]), 4),
            "grad_collectives": round(float(m[4]), 4), "microbatches_per_step": round(float(m[5]), 2),
            "recompute_choices": choices}


MARKERS = ("<!-- long-steps section: generated by benchmarks/bench_longsteps.py -->",
           "<!-- end of the long-steps section -->")


def render(doc: dict, head: str) -> list[str]:
    """The long-step section of RESULTS.md: every planner's mean step over the bound per cell, and
    zeppelin's recompute settings side by side."""
    from bench_compare import RECOMPUTE_GLOBAL

    cells = doc["cells"]
    planners = list(dict.fromkeys(p for c in cells for p in c["planners"]))
    fmt = (lambda v: "fail" if "error" in v else f"{v['x_bound_mean']:.3f}")
    met = sum(c["zeppelin_within_target"] for c in cells)
    beats = sum(c["zeppelin_beats_every_baseline"] for c in cells)
    out = ["## Long steps on slow networks", "", head, "",
           ("Steps of several 131,072-token sequences among short ones (2-3 per 512K-token step, 4-5 per 1M-token "
            "step) on cluster A (`zeppelin-a`, 4 NICs per node), LLaMA-13B, ZeRO-3: every planner plans the same "
            "steps and the simulator judges every plan. Per planner: mean simulated step time over the step's lower "
            "bound (the work without recomputation, perfectly balanced)."), "",
           f"- zeppelin beats every baseline in {beats} of {len(cells)} cells; it is within "
           f"{doc['target_x_bound']:.2f}x the bound in {met} of {len(cells)}.", "",
           "| cell | long per step | " + " | ".join(planners) + " |",
           "|---|---|" + "---:|" * len(planners)]
    for c in cells:
        out.append(f"| {c['cell']} | {', '.join(map(str, c['long_per_step']))} | "
                   + " | ".join(fmt(c["planners"].get(p, {"error": "-"})) for p in planners) + " |")
    rows = [c for c in cells if "recompute_modes" in c]
    if rows:
        out += ["", ("Zeppelin under `--recompute auto` and under each global mode: step time over the bound / "
                     "predicted peak memory of a GPU over its usable capacity; auto's micro-batches by choice (and "
                     "of those that recompute, the share of their units that run it: the others fit without)."), "",
                "| cell | auto | " + " | ".join(RECOMPUTE_GLOBAL) + " | auto's micro-batches |",
                "|---|---:|" + "---:|" * len(RECOMPUTE_GLOBAL) + "---|"]
        for c in rows:
            rc = c["recompute_modes"]
            st = (lambda m: "cannot plan" if "mean_s" not in rc[m] else
                  f"{rc[m]['ratio_to_lower_bound']:.3f} / {rc[m]['memory_over_capacity']:.2f}")
            mbs = ", ".join(f"{k} {v}" for k, v in sorted(rc["auto"].get("microbatches", {}).items()))
            if "recomputing_unit_share" in rc["auto"]:
                mbs += f" (on {rc['auto']['recomputing_unit_share']:.0%} of their units)"
            out.append(f"| {c['cell']} | {st('auto')} | " + " | ".join(st(m) for m in RECOMPUTE_GLOBAL)
                       + f" | {mbs} |")
    brk = [c for c in cells if "breakdown" in c]
    if brk:
        out += ["", ("Where zeppelin's steps spend their time, by the simulator, over the bound (mean over the steps): "
                     "the units' compute (mean and slowest unit; recomputed forwards included, the bound holds the "
                     "balanced compute without them), exposed transfers, idle time waiting for the slowest unit of "
                     "each micro-batch, and the gradient collectives (in the bound too)."), "",
                "| cell | compute mean | compute slowest | exposed transfers | idle | gradient collectives | "
                "micro-batches per step | recompute choices |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        for c in brk:
            d = c["breakdown"]
            out.append(f"| {c['cell']} | {d['compute_mean']:.3f} | {d['compute_max']:.3f} | {d['exposed_comm']:.3f} | "
                       f"{d['idle']:.3f} | {d['grad_collectives']:.3f} | {d['microbatches_per_step']:.2f} | "
                       f"{', '.join(d['recompute_choices'])} |")
    return out + [""]


def write_results(out_dir: Path, doc: dict, command: str, wall: float, code: str) -> None:
    """The long-step section of ``out_dir/RESULTS.md`` (between :data:`MARKERS`, appended where the
    page has none) and ``out_dir/results_longsteps.json``; ``code``: the commit the run started at."""
    from zeppelin.schemas.io.safefiles import atomic_write_text

    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}"
    head = (f"Generated by `{command}` ({len(doc['cells'])} cells, {doc['steps']} steps per cell, "
            f"{wall / 60:.1f} minutes wall on {machine}, under load; code at commit `{code}`).")
    section = "\n".join([MARKERS[0], *render(doc, head), MARKERS[1]])
    path = out_dir / "RESULTS.md"
    page = path.read_text() if path.exists() else ""
    if MARKERS[0] in page:
        before, rest = page.split(MARKERS[0], 1)
        page = before + section + rest.split(MARKERS[1], 1)[1]
    else:
        page = page.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write_text(path, page)
    atomic_write_text(out_dir / "results_longsteps.json", json.dumps({**doc, "command": command, "wall_s": wall},
                                                                      indent=1) + "\n")


def main(argv=None) -> int:
    from zeppelin.planner.tools.compare import DEFAULT_PLANNERS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--planners", default=",".join(DEFAULT_PLANNERS))
    ap.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    ap.add_argument("--recompute", default="auto",
                    help="auto (zeppelin chooses per micro-batch, the baselines run none, as `zeppelin compare` "
                         "by default) or one global mode for every planner")
    ap.add_argument("--no-recompute-modes", action="store_true",
                    help="leave out zeppelin's runs under each global recompute mode beside auto")
    ap.add_argument("--breakdown", action="store_true",
                    help="also say where zeppelin's steps spend their time (compute, exposed transfers, idle, "
                         "gradient collectives; over the bound)")
    ap.add_argument("-o", "--output", type=Path, default=None)
    ap.add_argument("--write-results", type=Path, default=None, metavar="DIR",
                    help="also write the long-step section of DIR/RESULTS.md and DIR/results_longsteps.json")
    args = ap.parse_args(argv)
    from bench_compare import _git_describe

    code = _git_describe()  # (before this run writes its own outputs into the tree)
    want = None if args.cells is None else set(args.cells.split(","))
    cells, t0 = [], time.perf_counter()
    for name, cluster, tp, tokens in CELLS:
        if want is not None and name not in want:
            continue
        cells.append(run_cell(name, cluster, tp, tokens, args.steps, args.planners.split(","), args.recompute,
                              modes=args.recompute == "auto" and not args.no_recompute_modes,
                              breakdown=args.breakdown))
        c = cells[-1]
        z = c["planners"].get("zeppelin", {})
        print(f"{name}: zeppelin x bound {z.get('x_bound_mean')} (worst {z.get('x_bound_worst')}), beats every "
              f"baseline: {c['zeppelin_beats_every_baseline']}", file=sys.stderr, flush=True)
    doc = {"target_x_bound": TARGET, "steps": args.steps, "cells": cells}
    text = json.dumps(doc, indent=1) + "\n"
    (sys.stdout.write if args.output is None else args.output.write_text)(text)
    if args.write_results is not None:
        argv_s = shlex.join(sys.argv[1:] if argv is None else argv)
        write_results(args.write_results, doc, f".venv/bin/python benchmarks/bench_longsteps.py {argv_s}".strip(),
                      time.perf_counter() - t0, code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
