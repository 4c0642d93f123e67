"""`zeppelin profile`: measure this machine (or every node of a cluster) and write a cost profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from zeppelin.schemas.common import InputError, check_int


def profile(
    ctx: typer.Context,
    output: Path = typer.Option(..., "-o", "--output", help="profile JSON to write (use with `zeppelin plan --profile`)"),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="processes on this node (default: GPUs, or 2 on CPU)"),
    nodes: int = typer.Option(1, "--nodes", help="on one CPU machine: how many 'nodes' the processes form"),
    model: str = typer.Option("small", "--model", help="model preset or JSON whose kernels are timed"),
    quick: bool = typer.Option(False, "--quick", help="small grids: under two minutes on a laptop-class CPU"),
    cluster_name: str = typer.Option("", "--cluster-name", help="name recorded in the profile"),
) -> None:
    """Measure attention/linear kernel times, link bandwidths and the topology; fit the cost model.

    Extra arguments (e.g. torchrun's --nnodes, --node-rank, --rdzv-endpoint for a multi-node run)
    are passed to torchrun. Run the same command on every node of a cluster.
    """
    from zeppelin.planner.core.inputs import resolve_model

    from zeppelin.planner.core.inputs import check_path_writable, input_refs

    check_int("--nproc", nproc, 1, 1024)
    check_int("--nodes", nodes, 1, 4096)
    resolve_model(model)  # fail early on a bad name
    check_path_writable(output, input_refs(model))
    check_path_writable(Path(str(output) + ".raw.json"), input_refs(model))
    if nproc is None:
        try:
            import torch

            nproc = torch.cuda.device_count() or 2
        except ImportError:
            nproc = 2
    if nproc < 1 or nproc % nodes:
        raise InputError(f"--nodes {nodes} must divide --nproc {nproc}")
    extra = list(ctx.args)
    if not any(a.startswith("--rdzv") or a.startswith("--nnodes") or a.startswith("--master") for a in extra):
        extra = ["--standalone"] + extra
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *extra,
           "-m", "zeppelin.runtime.profiler", "--model", model, "--nodes", str(nodes), "-o", str(output),
           "--cluster-name", cluster_name] + (["--quick"] if quick else [])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, capture_output=False, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        print(f"zeppelin: error: profiling failed (torchrun exit code {proc.returncode})", file=sys.stderr)
        raise SystemExit(1)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    report = json.loads(lines[-1]) if lines else {}
    _print_report(report, output)


def _print_report(report: dict, output: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"cost-model fit ({output})")
    for c in ("quantity", "fit", "median |err|", "worst |err|"):
        t.add_column(c)
    for key in ("attention", "linear"):
        r = report.get(key)
        if r:
            c = r["coeffs"]
            t.add_row(f"{key} t(n) per layer fwd+bwd", f"{c[0]:.3g} + {c[1]:.3g} n + {c[2]:.3g} n^2 s",
                      f"{r['median']:.1%}", f"{r['worst']:.1%}")
    for key in sorted((k for k in report if k.startswith("ring_total_")), key=lambda k: int(k.rsplit("_", 1)[1])):
        G = key.rsplit("_", 1)[1]
        r, rc = report[key], report.get(f"ring_compute_{G}")
        c = r["coeffs"]
        t.add_row(f"ring of {G} t(L) per layer fwd+bwd", f"{c[0]:.3g} + {c[1]:.3g} L + {c[2]:.3g} L^2 s",
                  f"{r['median']:.1%}", f"{r['worst']:.1%}")
        if rc:
            sync = report.get("ring_sync_s", {}).get(G)
            c = rc["coeffs"]
            t.add_row(f"  its compute (exchanges cost {sync * 1e3:.2f} ms/round)" if sync is not None
                      else "  its compute", f"{c[0]:.3g} + {c[1]:.3g} L + {c[2]:.3g} L^2 s",
                      f"{rc['median']:.1%}", f"{rc['worst']:.1%}")
    for key in sorted((k for k in report if k.startswith("tp") and k.endswith("_compute")),
                      key=lambda k: int(k[2:].split("_")[0])):
        G = key[2:].split("_")[0]
        for part in ("compute", "none", "slicing", "commfuse"):
            r = report.get(f"tp{G}_{part}")
            if r:
                c = r["coeffs"]
                what = (f"linear t(T) at TP={G}, compute alone" if part == "compute"
                        else f"  with --tp-overlap {part} collectives")
                t.add_row(what, f"{c[0]:.3g} + {c[1]:.3g} T + {c[2]:.3g} T^2 s", f"{r['median']:.1%}", f"{r['worst']:.1%}")
    for key in ("p2p_intra", "p2p_inter"):
        r = report.get(key)
        if r and "alpha_s" in r:
            t.add_row(key.replace("p2p_", "link ") + " t(b) = a + b/B",
                      f"a = {r['alpha_s'] * 1e6:.1f} us, B = {r['bandwidth_GBps']:.2f} GB/s",
                      f"{r['median']:.1%}", f"{r['worst']:.1%}")
    con.print(t)
    con.print(f"plan with it: zeppelin plan --profile {output} ...")
