"""Stage 1's usp prices against rings alone: the Zeppelin planner's steps with spans over whole nodes
priced as the cheaper of a ring and a usp group (the default), and with stage 1 pricing rings alone
(planner option ``usp_spans=off``: the layout still turns rings over whole nodes into usp groups
where the prediction finds it faster).

Cells: clusters ``zeppelin-c`` (8 NICs per node) and ``zeppelin-a`` (4 NICs per node) of 32 to 128
nodes, LLaMA-7B, ZeRO-1, ``--recompute none``; steps of 1, 2, 4 and 8 sequences per GPU from the
``mixed`` distribution of ``bench_planner.py`` (seeded per cell). Each step is judged by the
simulator up to 1,024 units, by the prediction beyond. One JSON line per cell (the steps' time with
usp prices over the time with rings alone; below 1: faster), then a summary line.

    python benchmarks/bench_usp_spans.py [--clusters zeppelin-c:32,zeppelin-a:64] [--per 1,2,4,8] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_planner import draw  # noqa: E402

from zeppelin.planner.core.base import PlanContext  # noqa: E402
from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile  # noqa: E402
from zeppelin.planner.sim.simulate import Simulator  # noqa: E402
from zeppelin.planner.zeppelin.planner import ZeppelinPlanner  # noqa: E402
from zeppelin.schemas.plan import Sequence  # noqa: E402


def plan_rings_alone(ctx: PlanContext, k: int, seqs: list[Sequence]):
    """The step planned with stage 1 pricing spans over whole nodes as rings alone (``usp_spans=off``)."""
    return ZeppelinPlanner(usp_spans="off").plan_step(ctx, k, seqs)


def cell(cluster: str, per: int, steps: int) -> dict:
    cl = resolve_cluster(cluster)
    ctx = PlanContext(cl, resolve_model("llama-7b"), resolve_profile(None, cl), tp=1, zero_stage=1)
    rng = np.random.default_rng(per * 100 + cl.num_nodes)
    judge = Simulator(ctx) if ctx.num_units <= 1024 else None
    ratios, bounds = [], []
    for k in range(steps):
        seqs = [Sequence(sample_id=i, length=int(x)) for i, x in enumerate(draw("mixed", rng, per * ctx.num_units))]
        plans = (ZeppelinPlanner().plan_step(ctx, k, seqs), plan_rings_alone(ctx, k, seqs))
        t = [judge.simulate_step(p).step_time_s if judge else p.prediction.step_time_s for p in plans]
        ratios.append(t[0] / t[1])
        bounds.append([x / plans[0].prediction.lower_bound_s for x in t])
    return {"bench": "usp_spans", "cluster": cluster, "gpus": ctx.num_units, "seqs_per_gpu": per,
            "judge": "simulator" if judge else "prediction", "usp_over_rings": [round(r, 4) for r in ratios],
            "x_bound_usp": [round(b[0], 4) for b in bounds], "x_bound_rings": [round(b[1], 4) for b in bounds]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", default="zeppelin-c:32,zeppelin-a:64,zeppelin-c:128")
    ap.add_argument("--per", default="1,2,4,8", help="sequences per GPU, comma list")
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args(argv)
    rows = []
    for cluster in a.clusters.split(","):
        for per in (int(x) for x in a.per.split(",")):
            rows.append(cell(cluster, per, a.steps))
            print(json.dumps(rows[-1]), flush=True)
    r = [x for row in rows for x in row["usp_over_rings"]]
    print(json.dumps({"bench": "usp_spans_summary", "steps": len(r), "slower": sum(x > 1 + 1e-9 for x in r),
                      "faster_by_1pct": sum(x < 0.99 for x in r), "worst": max(r), "best": min(r),
                      "geomean": round(float(np.exp(np.mean(np.log(r)))), 4)}), flush=True)


if __name__ == "__main__":
    main()
