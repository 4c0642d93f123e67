"""Micro-benchmark of NIC routing and remapping (planner/zeppelin/routing.py, planner/zeppelin/remap.py).

Random steps shaped like Zeppelin's three tiers: long sequences on inter-node rings of 4-16 units
drawn from random nodes (about 40% of the units), the other units holding short local sequences.
For each cluster size it reports the median wall time per call of ``plan_routes``,
``route_problems`` and ``plan_remap``, and per step the most loaded NIC (bytes per step) without and
with routing. Prints one JSON object.

    python benchmarks/bench_routing.py [--steps 5] [--repeat 7] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.zeppelin.remap import plan_remap
from zeppelin.planner.zeppelin.routing import nic_load_table, plan_routes, route_problems
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.layout import zigzag_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Group, MicroBatch, Placement, Sequence
from zeppelin.schemas.profile import default_profile


def random_step(ctx: PlanContext, rng: random.Random) -> tuple[list[Sequence], MicroBatch]:
    n, upn = ctx.num_units, ctx.units_per_node
    free = list(range(n))
    rng.shuffle(free)
    groups, pls, seqs = [], [], []
    queues: list[list[int]] = [[] for _ in range(n)]
    budget = int(0.4 * n)
    while budget >= 4 and len(free) >= 4:
        G = min(rng.choice([4, 8, 16]), budget, len(free))
        units, free = free[:G], free[G:]
        if len({u // upn for u in units}) < 2:
            free += units
            break
        L = rng.randint(32_768, 262_144)
        groups.append(Group(kind="ring", tier="inter", units=units))
        pls.append(Placement(seq=len(seqs), group=len(groups) - 1, scheme="zigzag", ranges=zigzag_ranges(L, G)))
        seqs.append(Sequence(sample_id=len(seqs), length=L))
        for u in units:
            queues[u].append(len(groups) - 1)
        budget -= G
    for u in free:
        groups.append(Group(kind="local", tier="local", units=[u]))
        queues[u].append(len(groups) - 1)
        for _ in range(rng.randint(1, 6)):
            L = rng.randint(256, 8192)
            pls.append(Placement(seq=len(seqs), group=len(groups) - 1, ranges=[[[0, L]]]))
            seqs.append(Sequence(sample_id=len(seqs), length=L))
    return seqs, MicroBatch(groups=groups, placements=pls, queues=queues)


def timed(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench(cluster: str, model: str, steps: int, repeat: int, seed: int) -> dict:
    c = cluster_preset(cluster)
    ctx = PlanContext(c, model_preset(model), default_profile(c.name))
    rng = random.Random(seed)
    rows = []
    for k in range(steps):
        seqs, mb = random_step(ctx, rng)
        routes = plan_routes(ctx, mb)
        direct = plan_routes(ctx, mb, enable=False)
        routed_mb = mb.model_copy(update={"routes": routes})
        assert route_problems(ctx, routed_mb) == []
        un = nic_load_table(ctx, mb.model_copy(update={"routes": direct}), routed=False)
        ro = nic_load_table(ctx, routed_mb, routed=True)
        layout, info = plan_remap(ctx, seqs, mb)
        rows.append({
            "step": k,
            "inter_transfers": len(routes),
            "paths": sum(len(r.paths) for r in routes),
            "max_nic_bytes_direct": max(un.values()),
            "max_nic_bytes_routed": max(ro.values()),
            "max_nic_reduction": max(un.values()) / max(ro.values()),
            "plan_routes_ms": 1e3 * timed(lambda: plan_routes(ctx, mb), repeat),
            "route_problems_ms": 1e3 * timed(lambda: route_problems(ctx, routed_mb), repeat),
            "plan_remap_ms": 1e3 * timed(lambda: plan_remap(ctx, seqs, mb), repeat),
            "remap_enabled": info.enabled,
            "remap_tokens_moved": info.tokens_moved,
            "remap_tokens_moved_inter": info.tokens_moved_inter,
        })
    med = {key: statistics.median(r[key] for r in rows)
           for key in ("plan_routes_ms", "route_problems_ms", "plan_remap_ms", "max_nic_reduction")}
    return {"cluster": cluster, "gpus": c.world_size, "nics_per_node": len(c.nics), "model": model,
            "median": med, "steps": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "python": platform.python_version(),
           "results": [bench(cl, "llama-7b", a.steps, a.repeat, a.seed)
                       for cl in ("zeppelin-a:8", "zeppelin-c:8", "zeppelin-a:128")]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
