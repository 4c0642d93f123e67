"""Long steps on slow networks: steps of several 131,072-token sequences among short ones on nodes
of 4 NICs, where plans land farthest from their lower bound.

Cells (cluster A, ``zeppelin-a``: 8 GPUs and 4 NICs per node; LLaMA-13B, ZeRO-3, as the selection
benchmark's long-tail cells): tensor-parallel degree 2 and 1 x 8 nodes with 512K-token steps and
16 nodes with 1M-token steps; every step holds two to four 131,072-token sequences, the rest short
ones of the ``short`` mix (:func:`bench_selection.tail_steps`). Every planner of ``zeppelin
compare`` plans the same steps and every plan is simulated
(:func:`zeppelin.planner.tools.compare.run_compare`). Per cell and planner: the mean simulated step
over the step's lower bound ("x bound"), the worst step's, and the mean step time; whether zeppelin
beats every baseline. JSON on stdout (or ``-o``), a table on stderr.

    python benchmarks/bench_longsteps.py [--steps 4] [--planners zeppelin,te-cp,...] [-o RESULT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def run_cell(name: str, cluster: str, tp: int, tokens: int, steps: int, planners: list[str]) -> dict:
    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
    from zeppelin.planner.tools.compare import run_compare

    cl = resolve_cluster(cluster)
    ctx = PlanContext(cl, resolve_model("llama-13b"), resolve_profile(None, cl), tp=tp, zero_stage=3)
    ctx.max_seq_len = 131072
    step_seqs = long_steps(tokens, steps)
    out = {"cell": name, "cluster": cluster, "tp": tp, "tokens": tokens,
           "long_per_step": [sum(s.length == 131072 for s in st) for st in step_seqs], "planners": {}}
    for run in run_compare(ctx, step_seqs, planners):
        if run.error is not None:
            out["planners"][run.planner] = {"error": run.error}
            continue
        ratios = [t / b for t, b in zip(run.step_times, run.lower_bounds)]
        out["planners"][run.planner] = {"x_bound_mean": round(sum(ratios) / len(ratios), 4),
                                        "x_bound_worst": round(max(ratios), 4),
                                        "step_mean_s": round(sum(run.step_times) / len(run.step_times), 3)}
    z = out["planners"].get("zeppelin", {})
    others = [v["step_mean_s"] for p, v in out["planners"].items() if p != "zeppelin" and not p.startswith(
        "zeppelin-") and "error" not in v]
    out["zeppelin_beats_every_baseline"] = "error" not in z and all(z["step_mean_s"] < o for o in others)
    out["zeppelin_within_target"] = "error" not in z and z["x_bound_mean"] <= TARGET
    return out


def main(argv=None) -> int:
    from zeppelin.planner.tools.compare import DEFAULT_PLANNERS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--planners", default=",".join(DEFAULT_PLANNERS))
    ap.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    ap.add_argument("-o", "--output", type=Path, default=None)
    args = ap.parse_args(argv)
    want = None if args.cells is None else set(args.cells.split(","))
    cells = []
    for name, cluster, tp, tokens in CELLS:
        if want is not None and name not in want:
            continue
        cells.append(run_cell(name, cluster, tp, tokens, args.steps, args.planners.split(",")))
        c = cells[-1]
        z = c["planners"].get("zeppelin", {})
        print(f"{name}: zeppelin x bound {z.get('x_bound_mean')} (worst {z.get('x_bound_worst')}), beats every "
              f"baseline: {c['zeppelin_beats_every_baseline']}", file=sys.stderr, flush=True)
    text = json.dumps({"target_x_bound": TARGET, "steps": args.steps, "cells": cells}, indent=1) + "\n"
    (sys.stdout.write if args.output is None else args.output.write_text)(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
