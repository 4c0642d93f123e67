"""`zeppelin profile`: measure this machine (or every node of a cluster) and write a cost profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from zeppelin.planner.cli import common
from zeppelin.planner.tools import config
from zeppelin.schemas.common import InputError, check_int


def profile(
    ctx: typer.Context,
    output: Path = typer.Option(..., "-o", "--output", help="profile JSON to write (use with `zeppelin plan --profile`)"),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="processes on this node (default: GPUs, or 2 on CPU)"),
    nodes: int = typer.Option(1, "--nodes", help="on one CPU machine: how many 'nodes' the processes form"),
    model: str = common.option(config.MODEL.but(
        default="small", help="model preset or JSON whose kernels are timed: the model you will plan (`plan "
                              "--profile` refuses another)")),
    quick: bool = typer.Option(False, "--quick", help="small grids: under two minutes on a laptop-class CPU"),
    smoke: bool = typer.Option(False, "--smoke", help="the smallest grids (seconds): checks that profiling runs "
                                                      "end to end; the fits are rough"),
    cluster_name: str = typer.Option("", "--cluster-name", help="name recorded in the profile"),
    check: bool = typer.Option(True, "--check/--no-check",
                               help="after fitting, plan a few short steps with the profile, run them here and "
                                    "record how far the predicted step times were from the measured ones "
                                    "(`zeppelin compare` quotes it); one machine only"),
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
           "--cluster-name", cluster_name] + (["--quick"] if quick else []) + (["--smoke"] if smoke else [])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    # the fits are of this model: planning another one with the profile is refused (--force-profile)
    print(f"[profile] timing the kernels of model {model} (plan it with --profile {output}; another model: "
          f"--model NAME)", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=False, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        print(f"zeppelin: error: profiling failed (torchrun exit code {proc.returncode})", file=sys.stderr)
        raise SystemExit(1)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    report = json.loads(lines[-1]) if lines else {}
    _print_report(report, output)
    if check and extra == ["--standalone"]:
        check_step_times(output, nproc, nodes, model, cluster_name, env)


#: the check's run: a few steps of the shipped sample, short enough for a CPU machine
CHECK_STEPS, CHECK_TOKENS_PER_RANK, CHECK_MAX_SEQ_LEN = 4, 2048, 4096


def check_step_times(output: Path, nproc: int, nodes: int, model: str, cluster_name: str, env: dict) -> None:
    """Plan :data:`CHECK_STEPS` steps of the shipped sample with the new profile, run them here with
    ``zeppelin run --report-json`` and record in the profile (``source.step_time_check``) how far
    the predicted step times were from the measured ones. A check that cannot run leaves the
    profile as it is and says why."""
    import shutil
    import statistics
    import tempfile

    from zeppelin.schemas.io.documents import load_doc
    from zeppelin.schemas.io.safefiles import atomic_write
    from zeppelin.schemas.profile import CostProfile, StepTimeCheck

    cluster = cluster_name or f"local-cpu:{nodes}x{nproc // nodes}"
    tokens = CHECK_TOKENS_PER_RANK * nproc
    zep = [sys.executable, "-c", "from zeppelin.planner.cli import main; main()"]
    work = Path(tempfile.mkdtemp(prefix="zeppelin-profile-check-"))
    print(f"[profile] checking the profile: {CHECK_STEPS} steps of {tokens:,} tokens planned with it on {cluster} "
          f"and run here ...", file=sys.stderr, flush=True)
    try:
        plan, rep = work / "check.jsonl", work / "report.json"
        for args in (["plan", "-c", cluster, "--model", model, "--profile", str(output), "--steps", str(CHECK_STEPS),
                      "--tokens-per-step", str(tokens), "--max-seq-len", str(CHECK_MAX_SEQ_LEN), "-q", "-o", str(plan)],
                     ["run", str(plan), "--progress", "none", "--metrics", str(work / "metrics.jsonl"),
                      "--report-json", str(rep)]):
            r = subprocess.run([*zep, *args], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
                print(f"[profile] check skipped: `zeppelin {args[0]}` failed: {why}", file=sys.stderr)
                return
        steps = json.loads(rep.read_text())["steps"]
        rows = [s for s in steps if not s["first"]] or steps
        errs = [s["measured_s"]["step"] / s["predicted_s"]["step"] - 1.0 for s in rows if s["predicted_s"]["step"] > 0]
        if not errs:
            print("[profile] check skipped: the run reported no predicted step time", file=sys.stderr)
            return
        prof = load_doc(CostProfile, output)
        prof.source.step_time_check = StepTimeCheck(
            steps=len(errs), median_error=float(statistics.median(errs)), worst_error=float(max(abs(e) for e in errs)),
            plan=f"zeppelin plan of the shipped sample, {len(errs)} steps of {tokens:,} tokens on {cluster}, "
                 f"model {model}, run right after profiling")
        with atomic_write(output, replaces=True) as fh:  # the profile this command wrote, completed
            fh.write(prof.model_dump_json(indent=2) + "\n")
        chk = prof.source.step_time_check
        print(f"[profile] measured / predicted step time - 1: median {chk.median_error:+.1%}, worst "
              f"{chk.worst_error:.1%} over {chk.steps} steps (recorded in {output})", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
    for z, sec in sorted((report.get("fsdp_microbatch_s") or {}).items()):
        t.add_row(f"FSDP2 per micro-batch, ZeRO-{'1/2' if z == '1' else z}", f"{sec * 1e3:.2f} ms", "-", "-")
    r = report.get("remap_exchange")
    if r:
        t.add_row("remap exchange (beside compute)",
                  f"{r['seconds'] * 1e3:.2f} ms + bytes / {1e-9 / r['seconds_per_byte']:.2f} GB/s"
                  if r["seconds_per_byte"] > 0 else f"{r['seconds'] * 1e3:.2f} ms", "-", "-")
    con.print(t)
    con.print(f"plan with it: zeppelin plan --profile {output} ...")
