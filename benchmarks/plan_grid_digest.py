"""Digest of every plan the Zeppelin planners make on the docs/RESULTS.md grid.

A reorganisation of the planner must leave its plans byte-identical. ``zeppelin check plans/
--exact`` and ``tests/project/test_plan_fingerprint.py`` cover a few settings; this script covers the
48 cells of ``benchmarks/bench_compare.py`` (same contexts, same sampled steps) and prints one
JSON object ``{"cells": {"<cluster>-<model>-<mix>-<gpus>/<planner>": "<sha256>", ...}}`` over each
step plan's canonical JSON (solver ``time_s`` left out: it is the only wall-clock field)::

    .venv/bin/python benchmarks/plan_grid_digest.py -o /tmp/before.json
    # ... change the planner ...
    .venv/bin/python benchmarks/plan_grid_digest.py -o /tmp/after.json && cmp /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLANNERS = ["zeppelin", "zeppelin-no-routing", "zeppelin-no-remap"]


def _grid():
    spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "benchmarks" / "bench_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cell(arg) -> dict[str, str]:
    cluster, model, tp, zero_stage, mix, gpus, steps, tokens_per_gpu, max_seq_len, planners = arg
    from types import SimpleNamespace

    from zeppelin.planner.core.base import get_planner
    from zeppelin.schemas.common import InputError

    # the page's own context and steps (bench_compare.cell_steps: its ZeRO stage per model,
    # ``--recompute auto``, seed 0)
    opts = SimpleNamespace(seed=0, tokens_per_gpu=tokens_per_gpu, max_seq_len=max_seq_len, steps=steps)
    ctx, _, sampled = _grid().cell_steps(cluster, model, tp, mix, gpus, opts, zero_stage)
    out = {}
    for name in planners:
        planner = get_planner(name)
        h = hashlib.sha256()
        for k, seqs in enumerate(sampled):
            try:
                sp = planner.plan_step(ctx, k, seqs)
            except InputError as e:  # a baseline that cannot plan the step: its message is the result
                h.update(f"step {k}: {e}".encode())
                break
            doc = json.loads(sp.model_dump_json())
            if doc.get("solver"):
                doc["solver"].pop("time_s", None)
            h.update(json.dumps(doc, sort_keys=True).encode())
        out[f"{cluster}-{model}-{mix}-{gpus}/{name}"] = h.hexdigest()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", help="write the JSON here instead of stdout")
    ap.add_argument("--steps", type=int, default=4, help="steps per cell (bench_compare's default)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--planners", default=",".join(PLANNERS))
    args = ap.parse_args()
    g = _grid()
    jobs = [(g.CLUSTERS[c], m, tp, g.ZERO[m], mix, gpus, args.steps, 16384, 131072, args.planners.split(","))
            for c in g.CLUSTERS for m, tp in g.MODELS.items() for mix in g.MIXES for gpus in g.GPUS]
    cells: dict[str, str] = {}
    if args.workers <= 1:
        for j in jobs:
            cells.update(_cell(j))
    else:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(args.workers) as pool:
            for r in pool.imap_unordered(_cell, jobs):
                cells.update(r)
    text = json.dumps({"cells": dict(sorted(cells.items()))}, indent=1) + "\n"
    if args.output:
        tmp = args.output + ".tmp"
        Path(tmp).write_text(text)
        os.replace(tmp, args.output)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
