"""Do the plans of another version of zeppelin fit in memory as this version's memory model says?

A memory model that changes moves every capacity, and with them the plans: a comparison of plan
quality across such a change is only fair between plans that both fit. This benchmark plans the
RESULTS grid cells (``benchmarks/bench_compare.py``'s cells, 4 steps each) with the zeppelin
planner of the code in ``--code-tree`` (a worktree of any commit; default: this tree), then prices
every micro-batch of those plans with *this* tree's memory model: per cell the number of
micro-batches in which some unit holds more tokens than its memory allows, and the largest
predicted-memory / usable-memory ratio.

    git worktree add --detach /tmp/old 01f751d
    .venv/bin/python benchmarks/memory_feasibility.py --code-tree /tmp/old -o RESULT.json

JSON on stdout or ``-o``; a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

_PLAN_WITH_TREE = r'''
import json, sys
from zeppelin.planner.core.base import PlanContext, get_planner
from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
from zeppelin.planner.core.sampler import run_max_seq_len, sample_steps
from zeppelin.planner.tools.compare import mix_dataset
from zeppelin.schemas.plan import SamplerConfig
out = []
for cluster, gpus, model, tp, mix, steps, tokens_per_gpu in json.loads(sys.argv[1]):
    cl = resolve_cluster(f"{cluster}:{gpus // 8}")
    ctx = PlanContext(cl, resolve_model(model), resolve_profile(None, cl), tp=tp, seed=0)
    cfg = SamplerConfig(tokens_per_step=tokens_per_gpu * gpus, seed=0, max_seq_len=None)
    try:
        ds = mix_dataset(mix)
    except Exception as e:  # a mix that code does not know
        out.append({"cell": [cluster, gpus, model, tp, mix], "error": str(e).splitlines()[0]})
        continue
    ctx.max_seq_len = run_max_seq_len(ds, cfg)
    planner = get_planner("zeppelin")
    mbs = []
    for k, seqs in enumerate(sample_steps(ds, cfg, steps)):
        try:
            sp = planner.plan_step(ctx, k, seqs)
        except Exception as e:  # an unplannable step: recorded, not priced
            mbs.append({"error": str(e).splitlines()[0]})
            continue
        tps = [r.tp for r in sp.replicas] if sp.replicas is not None else [tp] * ctx.num_units
        for mb in sp.microbatches:
            att = [0] * len(tps)
            for p in mb.placements:
                units = mb.groups[p.group].units
                for pos, rs in enumerate(p.ranges):
                    att[units[pos]] += sum(e - s for s, e in rs)
            lin = att if mb.linear_layout is None else [sum(e - s for _, s, e in g) for g in mb.linear_layout]
            mbs.append({"step": k, "held": [max(a, b) for a, b in zip(att, lin)], "tp": tps})
    out.append({"cell": [cluster, gpus, model, tp, mix], "microbatches": mbs})
print(json.dumps(out))
'''


def plan_with_tree(tree: Path, cells: list) -> list:
    """The zeppelin planner of ``tree`` on ``cells``: per micro-batch the tokens each unit holds."""
    with tempfile.TemporaryDirectory(prefix="zeppelin-tree-") as tmp:
        pkg = Path(tmp) / "zeppelin"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        for sub in ("schemas", "planner", "runtime"):
            (pkg / sub).symlink_to(tree.resolve() / sub)
        env = dict(os.environ, PYTHONPATH=tmp)
        r = subprocess.run([sys.executable, "-c", _PLAN_WITH_TREE, json.dumps(cells)], env=env,
                           capture_output=True, text=True, cwd=tmp)
        if r.returncode != 0:
            raise SystemExit(f"memory_feasibility: planning with {tree} failed: {r.stderr.strip()[-500:]}")
        return json.loads(r.stdout)


def price(planned: list) -> list[dict]:
    """This tree's memory model over the micro-batches of ``planned``."""
    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile

    rows = []
    for item in planned:
        if "error" in item:
            rows.append({"cell": item["cell"], "error": item["error"]})
            continue
        cluster, gpus, model, tp, mix = item["cell"]
        cl = resolve_cluster(f"{cluster}:{gpus // 8}")
        ctx = PlanContext(cl, resolve_model(model), resolve_profile(None, cl), tp=tp, seed=0)
        usable = ctx.cost.gpu_capacity_bytes
        over, peak, priced, errors = 0, 0.0, 0, 0
        for mb in item["microbatches"]:
            if "error" in mb:
                errors += 1
                continue
            priced += 1
            ratios = [float(ctx.cost_for(t).memory_bytes(h)) / usable for h, t in zip(mb["held"], mb["tp"])]
            peak = max(peak, max(ratios))
            over += max(ratios) > 1.0
        rows.append({"cell": item["cell"], "microbatches": priced, "unplannable_steps": errors,
                     "microbatches_over_memory": over, "peak_memory_over_usable": peak,
                     "capacity_tokens": int(ctx.cost.token_capacity)})
    return rows


def main(argv=None) -> int:
    from bench_compare import CLUSTERS, GPUS, LONG_TAIL_CELLS, MIXES, MODELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code-tree", type=Path, default=ROOT, help="a worktree of the code whose plans are priced")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens-per-gpu", type=int, default=16384)
    ap.add_argument("--clusters", default="A,C")
    ap.add_argument("--cells", default=None, help="JSON list of [cluster, gpus, model, tp, mix] (default: the grid)")
    ap.add_argument("-o", "--output", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cells:
        cells = [[*c, args.steps, args.tokens_per_gpu] for c in json.loads(args.cells)]
    else:
        cells = [[CLUSTERS[k], g, m, tp, mix, args.steps, args.tokens_per_gpu] for k in args.clusters.split(",")
                 for m, tp in MODELS.items() for mix in MIXES for g in GPUS]
        cells += [[CLUSTERS[k], g, m, MODELS[m], mix, args.steps, args.tokens_per_gpu]
                  for k, m, mix, g in LONG_TAIL_CELLS if k in args.clusters.split(",")]
    rows = price(plan_with_tree(args.code_tree, cells))
    for r in rows:
        c = r["cell"]
        if "error" in r:
            print(f"{c[0]:<11}{c[1]:>4} {c[2]:<10}{c[4]:<9} {r['error']}", file=sys.stderr)
            continue
        print(f"{c[0]:<11}{c[1]:>4} {c[2]:<10}{c[4]:<9} capacity {r['capacity_tokens']:>6}  over memory "
              f"{r['microbatches_over_memory']:>2}/{r['microbatches']:<3} peak {r['peak_memory_over_usable']:.2f}x",
              file=sys.stderr)
    doc = {"code_tree": str(args.code_tree), "cells": rows,
           "cells_with_a_microbatch_over_memory": sum(r.get("microbatches_over_memory", 0) > 0 for r in rows)}
    text = json.dumps(doc, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
