"""Step time and memory per rank of the FSDP2 runtime vs the replicated runtime, same plan.

Runs on N gloo ranks of this machine (default 4): zeppelin plans one short-heavy step for
``local-cpu:2x2``; the step (forward, backward, gradient reduction, AdamW) runs ``--repeats``
times under each data-parallel mode — ``replicate`` (whole model and AdamW state on every rank,
one SUM all-reduce of the gradients: ZeRO-0), FSDP2 ZeRO-2 and FSDP2 ZeRO-3 — the modes
interleaved (A B C A B C ...) so that machine noise hits all of them alike. Prints one JSON
document: per mode the median step time (slowest rank), per-round times, the bytes of parameters,
gradients and AdamW state each rank holds and the activation bytes autograd saved; the FSDP /
replicated step-time ratios (median of per-round ratios).

    python benchmarks/bench_fsdp.py [--ranks 4] [--model small] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# the repository root, for the test process pool (tests/support/dist_pool.py, not part of the package)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = {"replicate": {"dp": "replicate"}, "fsdp-zero2": {"dp": "fsdp", "zero_stage": 2},
         "fsdp-zero3": {"dp": "fsdp", "zero_stage": 3}}


def _worker(rank, world, header_json, step_json, repeats, seed):
    import time

    import torch

    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.executor import Executor
    from zeppelin.runtime.groups import GroupCache, set_default_cache
    from zeppelin.runtime.model import LlamaModel
    from zeppelin.schemas.plan import PlanHeader, StepPlan

    header = PlanHeader.model_validate_json(header_json)
    step = StepPlan.model_validate_json(step_json)
    cache = GroupCache(world, header=header, steps=[step])
    set_default_cache(cache)
    execs = {name: Executor(header, LlamaModel(header.model, seed=seed), TokenSource(header.model.vocab_size,
                                                                                      header.seed),
                            rank=rank, world_size=world, device=torch.device("cpu"), groups=cache, **kw)
             for name, kw in MODES.items()}
    out = {name: [] for name in MODES}
    for r in range(repeats + 1):  # the first round warms up
        for name, ex in execs.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            res = ex.forward_backward(step)
            ex.optimizer_step()
            dt = time.perf_counter() - t0
            mem = ex.measured_memory(res)
            if r > 0:
                out[name].append({"step": dt, "loss": res.loss, "memory": mem})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--model", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import numpy as np

    from zeppelin.planner.core.base import PlanContext, get_planner
    from tests.support.dist_pool import DistributedPool
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.common import content_hash
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.plan import InputHashes, PlanHeader, Sequence
    from zeppelin.schemas.profile import default_profile

    cluster = cluster_preset("local-cpu:2x2" if args.ranks == 4 else f"local-cpu:1x{args.ranks}")
    model = model_preset(args.model)
    profile = default_profile(cluster.name, cluster.device)
    rng = np.random.default_rng(args.seed)
    lens = [1024, 256] + [int(x) for x in rng.integers(16, 128, size=24)]
    seqs = [Sequence(sample_id=i, length=L) for i, L in enumerate(lens)]
    header = PlanHeader(planner="zeppelin", num_steps=1, world_size=cluster.world_size, seed=args.seed,
                        cluster=cluster, model=model, profile=profile,
                        hashes=InputHashes(cluster=content_hash(cluster), model=content_hash(model),
                                           profile=content_hash(profile), manifest="synthetic"))
    ctx = PlanContext(cluster=cluster, model=model, profile=profile, seed=args.seed)
    step = get_planner("zeppelin").plan_step(ctx, 0, seqs)
    with DistributedPool(args.ranks, threads=1) as pool:
        outs = pool.run(_worker, header.model_dump_json(), step.model_dump_json(), args.repeats, args.seed,
                        timeout=1800)
    result = {"machine": "see docs/BENCHMARKS.md", "ranks": args.ranks, "model": args.model,
              "parameters": model.num_params(), "tokens": sum(lens), "sequences": len(lens),
              "repeats": args.repeats, "modes": {}}
    for name in MODES:
        runs = [[outs[r][name][i] for r in range(args.ranks)] for i in range(args.repeats)]
        per_round = [max(rk["step"] for rk in run) for run in runs]
        last = [outs[r][name][-1]["memory"] for r in range(args.ranks)]
        result["modes"][name] = {
            "step_median_s": statistics.median(per_round),
            "step_per_round_s": [round(x, 4) for x in per_round],
            "losses_equal_across_ranks": all(outs[r][name][i]["loss"] == outs[0][name][i]["loss"]
                                             for r in range(args.ranks) for i in range(args.repeats)),
            "bytes_per_rank": {k: max(m.get(k, 0) for m in last)
                               for k in ("params", "grads", "optimizer", "activations")},
        }
        b = result["modes"][name]["bytes_per_rank"]
        b["params_plus_optimizer"] = b["params"] + b["optimizer"]
    rep = result["modes"]["replicate"]
    for name in ("fsdp-zero2", "fsdp-zero3"):
        m = result["modes"][name]
        m["step_ratio_vs_replicate"] = statistics.median(
            a / b for a, b in zip(m["step_per_round_s"], rep["step_per_round_s"]))
        m["state_fraction_of_replicate"] = (m["bytes_per_rank"]["params_plus_optimizer"]
                                            / rep["bytes_per_rank"]["params_plus_optimizer"])
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
