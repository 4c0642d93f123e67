"""Measured step time of zeppelin vs te-cp vs packed-dp plans of the same short-heavy step.

Runs on N gloo ranks of this machine (default 2): the three planners plan the same sequences for
``local-cpu:1xN``; each plan's step (forward, backward, gradient all-reduce, AdamW) is executed
``--repeats`` times, the plans interleaved (A B C A B C ...) so that machine noise hits all of
them alike; prints one JSON document: per plan the median measured step time (slowest rank),
the median of each phase (slowest rank), and ``predict_step``'s prediction next to it; ratios of
the baselines' medians to zeppelin's.

    python benchmarks/bench_runtime.py [--ranks 2] [--model small] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# the repository root, for the test process pool (tests/support/dist_pool.py, not part of the package)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _worker(rank, world, header_json, steps_json, repeats, seed):
    import time

    import torch

    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.executor import Executor
    from zeppelin.runtime.groups import GroupCache, set_default_cache
    from zeppelin.runtime.model import LlamaModel
    from zeppelin.schemas.plan import PlanHeader, StepPlan

    header = PlanHeader.model_validate_json(header_json)
    steps = {k: StepPlan.model_validate_json(v) for k, v in steps_json.items()}
    cache = GroupCache(world, header=header, steps=list(steps.values()))
    set_default_cache(cache)
    execs = {}
    for name in steps:
        model = LlamaModel(header.model, seed=seed)
        execs[name] = Executor(header, model, TokenSource(header.model.vocab_size, header.seed), rank=rank,
                               world_size=world, device=torch.device("cpu"), groups=cache)
    out = {name: [] for name in steps}
    for r in range(repeats + 1):  # the first round warms up
        for name, step in steps.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            res = execs[name].forward_backward(step)
            res.phases["optimizer"] = execs[name].optimizer_step()
            res.phases["step"] = time.perf_counter() - t0
            if r > 0:
                out[name].append({"phases": res.phases, "bytes": res.bytes, "loss": res.loss})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import numpy as np

    from zeppelin.planner.core.base import PlanContext, get_planner
    from zeppelin.planner.costmodel.predict import predict_step
    from tests.support.dist_pool import DistributedPool
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.common import content_hash
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.plan import InputHashes, PlanHeader, Sequence
    from zeppelin.schemas.profile import default_profile

    cluster = cluster_preset(f"local-cpu:1x{args.ranks}")
    model = model_preset(args.model)
    profile = default_profile(cluster.name, cluster.device)
    # one short-heavy step: one long document, a few medium, many short (lengths seeded)
    rng = np.random.default_rng(args.seed)
    lens = [1536, 384, 256] + [int(x) for x in rng.integers(16, 160, size=40)]
    seqs = [Sequence(sample_id=i, length=L) for i, L in enumerate(lens)]
    header = PlanHeader(planner="bench", num_steps=1, world_size=cluster.world_size, seed=args.seed,
                        cluster=cluster, model=model, profile=profile,
                        hashes=InputHashes(cluster=content_hash(cluster), model=content_hash(model),
                                           profile=content_hash(profile), manifest="synthetic"))
    ctx = PlanContext(cluster=cluster, model=model, profile=profile, seed=args.seed)
    steps, preds = {}, {}
    for name in ("zeppelin", "te-cp", "packed-dp"):
        st = get_planner(name).plan_step(ctx, 0, seqs)
        steps[name] = st
        preds[name] = predict_step(ctx, st)
    with DistributedPool(args.ranks, threads=1) as pool:
        outs = pool.run(_worker, header.model_dump_json(), {k: v.model_dump_json() for k, v in steps.items()},
                        args.repeats, args.seed, timeout=1800)
    result = {"machine": "see docs/BENCHMARKS.md", "ranks": args.ranks, "model": args.model,
              "sequences": len(lens), "tokens": sum(lens), "longest": max(lens), "repeats": args.repeats,
              "plans": {}}
    phases = ["attention", "remap", "linear", "grad_allreduce", "optimizer", "step"]
    for name, st in steps.items():
        runs = [[outs[r][name][i] for r in range(args.ranks)] for i in range(args.repeats)]
        med = {ph: statistics.median(max(rk["phases"].get(ph, 0.0) for rk in run) for run in runs) for ph in phases}
        p = preds[name]
        result["plans"][name] = {
            "groups": sorted({f"{g.kind}/{g.tier}/{len(g.units)}" for mb in st.microbatches for g in mb.groups}),
            "microbatches": len(st.microbatches),
            "remap": any(mb.linear_layout is not None for mb in st.microbatches),
            "measured_median_s": med,
            "measured_runs_step_s": [round(max(rk["phases"]["step"] for rk in run), 4) for run in runs],
            "bytes_sent_per_step": {c: sum(rk["bytes"].get(c, 0) for rk in runs[0]) for c in ("intra", "inter")},
            "predicted_s": {"step": p.step_time_s, "attention": max(p.per_unit.attention_s),
                            "linear": max(p.per_unit.linear_s), "comm": max(p.per_unit.comm_s),
                            "exposed_comm": max(p.per_unit.exposed_comm_s)},
        }
    z = result["plans"]["zeppelin"]["measured_median_s"]["step"]
    result["speedup_of_zeppelin"] = {n: result["plans"][n]["measured_median_s"]["step"] / z
                                     for n in ("te-cp", "packed-dp")}
    # ratios inside each interleaved round, then their median
    result["speedup_of_zeppelin_per_round_median"] = {
        n: statistics.median(
            max(outs[r][n][i]["phases"]["step"] for r in range(args.ranks))
            / max(outs[r]["zeppelin"][i]["phases"]["step"] for r in range(args.ranks))
            for i in range(args.repeats))
        for n in ("te-cp", "packed-dp")}
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
