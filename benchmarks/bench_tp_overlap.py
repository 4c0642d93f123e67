"""TP=2 SwiGLU MLP block on 2 gloo ranks: measured fwd+bwd time of --tp-overlap none / slicing /
commfuse over several token counts, next to the analytic prediction of each mode.

For each size the three modes are timed in interleaved rounds (ratios come from the same run);
a round's time is the slowest rank's. Two predictions are printed beside each measurement:

* ``predicted_s``: the cost model (``CostModel`` of the ``local-cpu:1x2`` preset profile) — GEMM time
  from the profile's linear-kernel efficiency curve, transfer time from its intra-node alpha-beta;
* ``calibrated_s``: the same overlap formulas fed with this run's *measured* isolated GEMM times
  and collective times (checks the overlap model itself, independent of the preset coefficients);
* ``cost_model_s``: what the planner / simulator charge — ``CostModel.tp_exposed_comm`` for the
  block's 4 collective sites plus its share of ``CostModel.linear_time``.

Overlap formulas, per collective site (an all-gather or reduce-scatter around one GEMM), with
``C`` the site's collective time, ``G`` its GEMM time, ``N`` the TP degree, ``k`` slicing chunks:

* none:     site = C + G
* slicing:  site = G + C/k + (k-1)/k * max(0, C - G)      (the tail: one chunk's transfer)
* commfuse: site = G + (N-1) * max(0, C/(N-1) - G/N)      (per ring step: max(0, transfer - GEMM))

The block has 4 overlapped sites (forward: AG+gate/up GEMM, down GEMM+RS; backward: their mirrors)
plus 2 weight-gradient GEMMs that no mode overlaps.

Usage: python benchmarks/bench_tp_overlap.py [--sizes 512 2048 8192] [--hidden 256] [--ffn 704]
       [--rounds 7] [--chunks 4]
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("none", "slicing", "commfuse")


def site_time(C: float, G: float, mode: str, N: int, k: int) -> float:
    """Time of one collective site under an overlap mode (see the module docstring)."""
    if mode == "none":
        return C + G
    if mode == "slicing":
        return G + C / k + (k - 1) / k * max(0.0, C - G)
    if mode == "commfuse":
        return G + (N - 1) * max(0.0, C / (N - 1) - G / N)
    raise ValueError(mode)


def block_time(sites: list[tuple[float, float]], extra_gemm: float, mode: str, N: int, k: int) -> float:
    return sum(site_time(C, G, mode, N, k) for C, G in sites) + extra_gemm


def _model_prediction(T: int, h: int, f: int, N: int, k: int, dtype_bytes: int) -> dict[str, float]:
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import model_preset

    cm = CostModel(cluster_preset(f"local-cpu:1x{N}"), model_preset("tiny"), tp=N)
    kl = cm.profile.linear

    def gemm(flops: float, n: float) -> float:
        eff = kl.eff_max * n / (n + kl.n_half)
        return kl.overhead_s + flops / (cm.peak_flops * eff)

    lk = cm.intra_link

    def coll(nbytes: float) -> float:
        return lk.alpha_s * (N - 1) + nbytes * (N - 1) / N / (lk.bandwidth_GBps * 1e9)

    act = T * h * dtype_bytes
    g_up = gemm(2.0 * T * h * 2 * f / N, T)      # gate+up column GEMM (and each of its backward GEMMs)
    g_down = gemm(2.0 * T * f * h / N, T)        # down row GEMM
    sites = [(coll(act), g_up), (coll(act), g_down), (coll(act), g_up), (coll(act), g_down)]
    extra = g_up + g_down                        # weight gradients
    return {m: block_time(sites, extra, m, N, k) for m in MODES}


def _cost_model_prediction(T: int, h: int, f: int, N: int) -> dict[str, float]:
    """What the planner and the simulator charge for this block: ``CostModel.tp_exposed_comm`` (the
    ``--tp-overlap`` formulas at the cost model's 8 collective sites per layer, of which the MLP block
    is 4) plus the MLP's share of ``CostModel.linear_time`` (fwd+bwd GEMMs of the TP shard), for a
    1-layer model of this block's hidden/FFN sizes on the ``local-cpu:1xN`` preset profile."""
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import model_preset

    spec = model_preset("tiny").model_copy(update={"hidden": h, "ffn_hidden": f, "num_layers": 1})
    out = {}
    for m in MODES:
        cm = CostModel(cluster_preset(f"local-cpu:1x{N}"), spec, tp=N, tp_overlap=m)
        mlp_share = 2.0 * cm._mlp_mult * h * f / cm.linear_flops_per_token
        sites_share = 4 / cm.TP_SITES
        out[m] = float(mlp_share * cm.linear_time(T) + sites_share * cm.tp_exposed_comm(T, m))
    return out


def _worker(rank, world, sizes, hidden, ffn, rounds, chunks, warmup):
    import torch
    import torch.distributed as dist

    from zeppelin.runtime.groups import GroupCache
    from zeppelin.runtime.tp import TPMLP, TPGroup, shard_sizes

    torch.manual_seed(0)
    GroupCache(world)
    grp = TPGroup(list(range(world)), rank, dist.group.WORLD)
    out = []
    for T in sizes:
        rows = shard_sizes(T, world)
        g = torch.Generator().manual_seed(T)
        wg = torch.randn(ffn, hidden, generator=g) * hidden ** -0.5
        wu = torch.randn(ffn, hidden, generator=g) * hidden ** -0.5
        wd = torch.randn(hidden, ffn, generator=g) * ffn ** -0.5
        x_full = torch.randn(T, hidden, generator=g)
        dy_full = torch.randn(T, hidden, generator=g)
        o = [0, rows[0], T]
        x = x_full[o[rank]:o[rank + 1]].contiguous()
        dy = dy_full[o[rank]:o[rank + 1]].contiguous()
        mlps = {m: TPMLP.from_full(wg, wu, wd, grp, overlap=m, chunks=chunks) for m in MODES}

        def once(m):
            xi = x.clone().requires_grad_(True)
            y = mlps[m](xi, rows)
            y.backward(dy)
            return y

        results = {}
        ref = None
        for m in MODES:  # the three modes compute the same numbers
            y = once(m).detach()
            ref = y if ref is None else ref
            results[m] = float((y - ref).abs().max())
        times = {m: [] for m in MODES}
        for r in range(warmup + rounds):
            for m in (MODES if r % 2 == 0 else MODES[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                once(m)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if r >= warmup:
                    times[m].append(dt.item())
        # isolated pieces for the calibrated prediction: the collectives and GEMMs of one site
        f_loc = shard_sizes(ffn, world)[rank]
        xa = torch.randn(T, hidden)
        w_up, w_dn = torch.randn(2 * f_loc, hidden), torch.randn(hidden, f_loc)
        h_loc = torch.randn(T, f_loc)
        iso = {"ag": [], "rs": [], "g_up": [], "g_down": []}
        m_rows = max(rows)
        buf = torch.randn(world * m_rows, hidden)
        for r in range(warmup + rounds):
            for key in iso:
                dist.barrier()
                t0 = time.perf_counter()
                if key == "ag":
                    dist.all_gather_into_tensor(torch.empty_like(buf), x_full[:m_rows].contiguous())
                elif key == "rs":
                    dist.reduce_scatter_tensor(torch.empty(m_rows, hidden), buf)
                elif key == "g_up":
                    xa @ w_up.t()
                else:
                    h_loc @ w_dn.t()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if r >= warmup:
                    iso[key].append(dt.item())
        out.append({"T": T, "times": times, "maxdiff": results,
                    "iso": {k2: statistics.median(v) for k2, v in iso.items()}})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=4)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.support.dist_pool import run_distributed

    N = 2
    res = run_distributed(_worker, N, a.sizes, a.hidden, a.ffn, a.rounds, a.chunks, a.warmup, timeout=1200)[0]
    rows = []
    for r in res:
        T = r["T"]
        med = {m: statistics.median(r["times"][m]) for m in MODES}
        iso = r["iso"]
        sites = [(iso["ag"], iso["g_up"]), (iso["rs"], iso["g_down"]), (iso["rs"], iso["g_up"]),
                 (iso["ag"], iso["g_down"])]
        extra = iso["g_up"] + iso["g_down"]
        calib = {m: block_time(sites, extra, m, N, a.chunks) for m in MODES}
        pred = _model_prediction(T, a.hidden, a.ffn, N, a.chunks, 4)
        rows.append({
            "tokens": T,
            "measured_s": med,
            "ratio_vs_none": {m: med[m] / med["none"] for m in MODES},
            "calibrated_s": calib,
            "predicted_s": pred,
            "cost_model_s": _cost_model_prediction(T, a.hidden, a.ffn, N),
            "isolated_s": iso,
            "max_abs_diff_vs_none": r["maxdiff"],
        })
    print(json.dumps({
        "benchmark": "tp_overlap",
        "machine": f"{platform.machine()} {os.cpu_count()} CPU, {platform.system()}, gloo, fp32, "
                   "1 thread/rank",
        "tp": N, "hidden": a.hidden, "ffn": a.ffn, "chunks": a.chunks, "rounds": a.rounds,
        "results": rows,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
