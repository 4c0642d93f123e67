"""What gloo's collectives cost between 2 CPU processes of this machine, as raw calls and as the
runtime's FSDP2 makes them, each fitted as ``latency + bytes / bandwidth``: the figures the
``local-cpu`` cluster preset's links carry (``zeppelin.schemas.cluster``).

Two processes (one per core, one thread each, as ``zeppelin run`` gives a rank of a 2-rank plan on
2 cores) time:

* ``all_gather``, ``reduce_scatter``, ``send_recv``: one raw call of a few sizes, after a barrier;
  the bytes a rank receives are half the whole tensor of a collective over 2 ranks (the cost
  model's ``(W-1)/W * bytes / bandwidth + latency`` of one ring hop), the message of a send/recv
  exchange. Operations and sizes interleaved (each round times every one once, so a change of
  the machine's load spreads over all of them), ``--reps`` rounds after ``--warmup``; per size
  the median of the slower rank.
* ``fsdp``: what FSDP2 adds to one ZeRO-3 micro-batch of the runtime's own model (the
  profiler's ``measure_fsdp_microbatch``: forward + backward on 512 tokens per rank, sharded
  minus whole), for ``small`` and the same shape narrower, wider, shallower and deeper; each
  against the collectives the cost model counts in that micro-batch (``calls``) and the bytes a
  rank receives in them (``recv_bytes``), fitted as ``calls * latency + recv_bytes / bandwidth``.
  This is what the preset takes: FSDP2's collectives as the runtime runs them on the CPU
  (gathers into and out of flat buffers, hooks, the wait for the slower rank), several times the
  raw calls.

Fits are least squares of the relative residuals (every size counts alike).

    python benchmarks/bench_gloo_links.py [--reps 10] [-o RESULT.json]
    python benchmarks/bench_gloo_links.py --refit RESULT.json     # fits again, timings kept

The result (JSON, standard output or ``-o``) holds the machine, the load average, the timings and
``fits``: per operation ``{"latency_us", "bandwidth_GBps", "worst_rel_error"}`` (the fit's largest
relative miss over its points).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

#: whole-tensor bytes (fp32) of the collectives; messages of the send/recv exchange
SIZES = [2**12, 2**16, 2**18, 2**20, 2**21, 2**22, 2**23]
OPS = ("all_gather", "reduce_scatter", "send_recv")
#: (hidden, layers) of the ``small``-shaped models whose ZeRO-3 micro-batch is timed; tokens per rank
FSDP_SHAPES = [(128, 4), (256, 2), (256, 4), (256, 8), (384, 4), (512, 4)]
FSDP_TOKENS = 512
CLUSTER = "local-cpu:1x2"


def _op(name: str, nbytes: int, rank: int):
    """A closure running one ``name`` of ``nbytes`` and the bytes a rank receives in it."""
    import torch
    import torch.distributed as dist

    n = nbytes // 4
    if name == "all_gather":
        shard, out = torch.ones(n // 2), torch.empty(n)
        return (lambda: dist.all_gather_into_tensor(out, shard)), nbytes / 2
    if name == "reduce_scatter":
        whole, out = torch.ones(n), torch.empty(n // 2)
        return (lambda: dist.reduce_scatter_tensor(out, whole)), nbytes / 2
    peer = 1 - rank
    buf, rb = torch.ones(n), torch.empty(n)

    def exchange():
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, rb, peer)])
        for w in works:
            w.wait()

    return exchange, float(nbytes)


def fsdp_models() -> list[Any]:
    """``small`` and the same shape at the other (hidden, layers) of :data:`FSDP_SHAPES`."""
    from zeppelin.schemas.model import model_preset

    small = model_preset("small")
    return [small.model_copy(update={"name": f"small-h{h}-l{n}", "hidden": h, "num_layers": n,
                                     "ffn_hidden": small.ffn_hidden * h // small.hidden})
            for h, n in FSDP_SHAPES]


def fsdp_calls_bytes(model) -> tuple[float, float]:
    """The collectives of one ZeRO-3 micro-batch of ``model`` on 2 CPU ranks and the bytes a rank
    receives in them, as the cost model counts them: ``CostModel.fsdp_comm_s`` over a link of
    1 s latency and no transfer time, then over one of no latency and 1 GB/s."""
    from zeppelin.planner.costmodel.context import PlanContext
    from zeppelin.schemas.cluster import LinkSpec, cluster_preset
    from zeppelin.schemas.profile import default_profile

    def priced(latency_us: float, gbps: float) -> float:
        cl = cluster_preset(CLUSTER)
        cl = cl.model_copy(update={"intra_link": LinkSpec(kind="shm", bandwidth_GBps=gbps, latency_us=latency_us)})
        return PlanContext(cl, model, default_profile(cl.name, cl.device), zero_stage=3).cost.fsdp_comm_s()

    return round(priced(1e6, 1e6)), priced(0.0, 1.0) * 1e9


def _worker(rank: int, port: int, reps: int, warmup: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from zeppelin.runtime.profiler import Timer, measure_fsdp_microbatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cases = [(name, nbytes, *_op(name, nbytes, rank)) for name in OPS for nbytes in SIZES]
    med = torch.tensor(Timer(torch.device("cpu")).sweep([c[2] for c in cases], reps, warmup, sync=dist.barrier),
                       dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    rows = [{"op": name, "bytes": nbytes, "recv_bytes": recv, "median_s": float(m)}
            for (name, nbytes, _, recv), m in zip(cases, med)]
    cpu = torch.device("cpu")
    for model in fsdp_models():  # (already the slower rank's: measure_fsdp_microbatch reduces by MAX)
        sec = measure_fsdp_microbatch(model, FSDP_TOKENS, cpu, Timer(cpu), reps, warmup)["3"]
        calls, recv = fsdp_calls_bytes(model)
        rows.append({"op": "fsdp", "model": model.name, "calls": calls, "recv_bytes": recv, "median_s": sec})
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_link(calls, nbytes, seconds) -> dict[str, float]:
    """``seconds = calls * latency + bytes / bandwidth`` by least squares of the relative residuals."""
    t = np.asarray(seconds, dtype=float)
    a = np.stack([np.asarray(calls, dtype=float), np.asarray(nbytes, dtype=float)], axis=1) / t[:, None]
    (alpha, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:  # no latency the data can show: bandwidth alone
        alpha, per_byte = 0.0, float(np.sum(a[:, 1]) / np.sum(a[:, 1] ** 2))
    worst = float(np.max(np.abs(a @ np.array([alpha, per_byte]) - 1.0)))
    return {"latency_us": round(float(alpha) * 1e6, 1), "bandwidth_GBps": round(float(1.0 / per_byte / 1e9), 4),
            "worst_rel_error": round(worst, 3)}


def fits(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    def of(ops):
        sel = [r for r in rows if r["op"] in ops]
        return fit_link([r.get("calls", 1) for r in sel], [r["recv_bytes"] for r in sel], [r["median_s"] for r in sel])

    out = {op: of((op,)) for op in (*OPS, "fsdp")}
    out["collectives"] = of(("all_gather", "reduce_scatter"))
    return out


def measure(reps: int, warmup: int) -> dict[str, Any]:
    import tempfile

    import torch
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        before = [round(x, 2) for x in os.getloadavg()]
        mp.spawn(_worker, args=(_free_port(), reps, warmup, out), nprocs=2, join=True)
        rows = json.loads(Path(out).read_text())
    return {"machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()}); torch {torch.__version__}",
            "ranks": 2, "threads_per_rank": 1, "reps": reps, "warmup": warmup, "fsdp_tokens": FSDP_TOKENS,
            "load_avg_before": before, "load_avg_after": [round(x, 2) for x in os.getloadavg()], "timings": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("-o", "--output", type=Path, default=None)
    ap.add_argument("--refit", type=Path, default=None, metavar="RESULT.json", help="fit a saved result again")
    args = ap.parse_args(argv)
    doc = json.loads(args.refit.read_text()) if args.refit else measure(args.reps, args.warmup)
    doc["fits"] = fits(doc["timings"])
    text = json.dumps(doc, indent=1)
    if args.output is not None:
        args.output.write_text(text + "\n")
    else:
        print(text)
    print(json.dumps(doc["fits"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
