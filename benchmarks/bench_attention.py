"""Attention engine throughput: local varlen attention and exact ring attention.

Prints one JSON object. For each length L: the local path (one process, the whole causal sequence)
and the ring path over G processes (zigzag, 2G chunks), forward and forward+backward; median wall
time over ``--repeats`` runs after a warm-up (for the ring: the slowest rank's time), and the
achieved GFLOP/s from the causal FLOP count of :func:`attn_flops` (for the ring path: the whole
sequence's FLOPs over the ring's time, i.e. summed over its ranks).

CPU (default when no GPU): gloo processes with ``--threads`` intra-op threads each (1 by default,
so G ranks use G cores; the local path uses the same thread count so the two are comparable per
core). On a CUDA machine: NCCL, one GPU per rank, flash-attn for the local path when importable.

    python benchmarks/bench_attention.py --lengths 1024 2048 4096 --ranks 2 4
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

# the repository root, for the test process pool (tests/support/dist_pool.py, not part of the package)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def attn_flops(L: int, hq: int, d: int, backward: bool) -> float:
    """Causal attention FLOPs of one sequence: QK^T and PV are 2·L²·Hq·D each, half visible
    under the mask -> 2·L²·Hq·D forward; backward (dQ, dK, dV, recomputed P) is 2.5x forward."""
    fwd = 2.0 * L * L * hq * d
    return fwd * (3.5 if backward else 1.0)


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats: int, dev) -> float:
    fn()  # warm-up
    _sync(dev)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _tensors(L, hq, hkv, d, dtype, dev, seed=0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(L, hq, d, generator=g).to(dev, dtype)
    k = torch.randn(L, hkv, d, generator=g).to(dev, dtype)
    v = torch.randn(L, hkv, d, generator=g).to(dev, dtype)
    return q, k, v


def bench_local(L, hq, hkv, d, dtype_name, repeats, threads):
    import torch

    from zeppelin.runtime.attn.local import flash_attn_available, local_attention

    if threads > 0:
        torch.set_num_threads(threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, dtype_name)
    q, k, v = _tensors(L, hq, hkv, d, dtype, dev)
    cu = [0, L]

    def fwd():
        with torch.no_grad():
            local_attention(q, k, v, cu)

    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))

    def fwdbwd():
        o = local_attention(qq, kk, vv, cu)
        o.backward(torch.ones_like(o))

    tf = _time(fwd, repeats, dev)
    tb = _time(fwdbwd, repeats, dev)
    return {
        "path": "local",
        "ranks": 1,
        "length": L,
        "kernel": "flash-attn varlen" if flash_attn_available(dev) else f"aten sdpa flash ({dev.type})",
        "fwd_s": tf,
        "fwd_bwd_s": tb,
        "fwd_gflops": attn_flops(L, hq, d, False) / tf / 1e9,
        "fwd_bwd_gflops": attn_flops(L, hq, d, True) / tb / 1e9,
    }


def _ring_rank(rank, world, L, hq, hkv, d, dtype_name, repeats):
    import torch
    import torch.distributed as dist

    from zeppelin.runtime.attn.ring import RingSpec, ring_attention
    from zeppelin.runtime.attn.transport import Transport
    from zeppelin.schemas.layout import zigzag_ranges

    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    dtype = getattr(torch, dtype_name)
    q, k, v = _tensors(L, hq, hkv, d, dtype, dev)
    rng = zigzag_ranges(L, world)
    idx = torch.cat([torch.arange(s, e) for s, e in rng[rank]]).to(dev)
    ql, kl, vl = q[idx], k[idx], v[idx]
    spec = RingSpec(ranks=list(range(world)), pos=rank, seqs=[rng])
    tr = Transport()

    def fwd():
        with torch.no_grad():
            ring_attention(ql, kl, vl, spec, tr)

    qq, kk, vv = (x.clone().requires_grad_() for x in (ql, kl, vl))

    def fwdbwd():
        o = ring_attention(qq, kk, vv, spec, tr)
        o.backward(torch.ones_like(o))

    out = {}
    for name, fn in (("fwd_s", fwd), ("fwd_bwd_s", fwdbwd)):
        fn()
        ts = []
        for _ in range(repeats):
            dist.barrier()
            _sync(dev)
            t = time.perf_counter()
            fn()
            _sync(dev)
            dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a ring step ends when its slowest rank ends
            ts.append(float(dt))
        out[name] = statistics.median(ts)
    return out


def bench_ring(pool, world, L, hq, hkv, d, dtype_name, repeats):
    res = pool.run(_ring_rank, L, hq, hkv, d, dtype_name, repeats, timeout=1800)[0]
    return {
        "path": "ring",
        "ranks": world,
        "length": L,
        "fwd_s": res["fwd_s"],
        "fwd_bwd_s": res["fwd_bwd_s"],
        "fwd_gflops": attn_flops(L, hq, d, False) / res["fwd_s"] / 1e9,
        "fwd_bwd_gflops": attn_flops(L, hq, d, True) / res["fwd_bwd_s"] / 1e9,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 (default: float32 on CPU, bfloat16 on CUDA)"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    a = ap.parse_args(argv)

    import torch

    from tests.support.dist_pool import DistributedPool

    cuda = torch.cuda.is_available()
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    if a.heads % a.kv_heads:
        print(
            f"bench_attention: error: --heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}",
            file=sys.stderr,
        )
        return 2
    load_before = os.getloadavg()
    results = []
    for L in a.lengths:
        results.append(bench_local(L, a.heads, a.kv_heads, a.head_dim, dtype, a.repeats, a.threads))
    backend = "nccl" if cuda else "gloo"
    for g in a.ranks:
        if cuda and g > torch.cuda.device_count():
            continue
        with DistributedPool(g, backend=backend, threads=a.threads, pg_timeout_s=1800) as pool:
            for L in a.lengths:
                results.append(bench_ring(pool, g, L, a.heads, a.kv_heads, a.head_dim, dtype, a.repeats))
    for r in results:
        for key in list(r):
            if isinstance(r[key], float):
                r[key] = round(r[key], 6 if key.endswith("_s") else 3)
    print(
        json.dumps(
            {
                "benchmark": "attention",
                "machine": {
                    "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(),
                    "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                    "torch": torch.__version__,
                },
                "backend": backend,
                "dtype": dtype,
                "heads": a.heads,
                "kv_heads": a.kv_heads,
                "head_dim": a.head_dim,
                "threads_per_rank": a.threads,
                "repeats": a.repeats,
                "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
                "results": results,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
