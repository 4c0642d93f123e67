"""`zeppelin run PLAN`: execute a plan with torch, launched through torchrun.

This module does not import torch: it checks the plan header, works out the torchrun options
(processes per node default to the plan's GPUs per node; on a ``local-cpu`` plan every "node" is
a group of processes on this machine, so all ranks start here) and spawns::

    python -m zeppelin.runtime.launch --nproc-per-node N [rendezvous flags] -m zeppelin.runtime PLAN ...

Options zeppelin does not know are passed to torchrun unchanged (e.g. ``--max-restarts 2``).

``--report``: once the job has finished, the steps it ran are predicted again with the simulator
under the plan's cost profile and printed next to the measured times, per step and per phase, with
the median / worst relative error of the predicted step time (:mod:`zeppelin.planner.sim.report`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from zeppelin.schemas.common import MAX_TIMEOUT_S, InputError, check_float, check_int, check_training_options


def run(
    ctx: typer.Context,
    plan: Path = typer.Argument(..., help="plan file written by `zeppelin plan`"),
    model: str | None = typer.Option(None, "--model",
                                     help="model preset, JSON file or hf:DIR (Hugging Face); must match the plan"),
    data: str | None = typer.Option(None, "--data", help="dataset manifest (token ids); must match the plan"),
    steps: int | None = typer.Option(None, "--steps", help="run the first N steps (default: all)"),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate"),
    weight_decay: float = typer.Option(0.0, "--weight-decay"),
    seed: int | None = typer.Option(None, "--seed", help="model init seed (default: the plan's seed)"),
    metrics: Path | None = typer.Option(None, "--metrics", help="JSON Lines metrics (default: PLAN.metrics.jsonl)"),
    verify: bool = typer.Option(False, "--verify", help="compare every step with a single-process reference"),
    verify_tol: float | None = typer.Option(None, "--verify-tol", help="relative tolerance (fp32 1e-5, bf16 2e-2)"),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="checkpoint every N steps (and at the end)"),
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir"),
    resume: bool = typer.Option(False, "--resume", help="continue from the latest checkpoint in --checkpoint-dir"),
    timeout: float = typer.Option(300.0, "--timeout", help="collective / P2P timeout per operation, seconds"),
    verify_timeout: float | None = typer.Option(
        None, "--verify-timeout",
        help="with --verify: how long the ranks wait for rank 0's single-process verdict on a step, seconds "
             "(default: max(600, 4 x --timeout))"),
    progress: str = typer.Option("auto", "--progress", help="auto | rich | plain | none"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    threads: int | None = typer.Option(None, "--threads", help="torch threads per rank (default: cores / ranks)"),
    nproc_per_node: int | None = typer.Option(None, "--nproc-per-node", help="processes on this machine"),
    nnodes: int | None = typer.Option(None, "--nnodes", help="machines in the job"),
    node_rank: int | None = typer.Option(None, "--node-rank"),
    master_addr: str | None = typer.Option(None, "--master-addr"),
    master_port: int | None = typer.Option(None, "--master-port"),
    rdzv_backend: str | None = typer.Option(None, "--rdzv-backend"),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint"),
    rdzv_id: str | None = typer.Option(None, "--rdzv-id"),
    report: bool = typer.Option(
        False, "--report",
        help="after the job: measured vs predicted time per step and phase, and the prediction error"),
    report_json: Path | None = typer.Option(
        None, "--report-json", help="also write that report as JSON (implies --report)"),
    tp_overlap: str | None = typer.Option(
        None, "--tp-overlap", help="none | slicing | commfuse: TP-SP overlap (default: the plan's)"),
    dp: str = typer.Option("fsdp", "--dp", help="fsdp (FSDP2 at the plan's ZeRO stage) | replicate "
                           "(whole model on every rank, one gradient all-reduce)"),
    zero_stage: int | None = typer.Option(None, "--zero-stage", help="ZeRO stage 0-3 (default: the plan's)"),
    hsdp: int | None = typer.Option(None, "--hsdp", help="hybrid sharding: shard inside groups of this many "
                                    "ranks (a node), replicate across them"),
    dtype: str | None = typer.Option(None, "--dtype", help="fp32 | bf16 compute (default: bf16 on CUDA, fp32 on CPU)"),
    recompute: str | None = typer.Option(None, "--recompute", help="none | selective | full (default: the plan's)"),
    recompute_override: bool = typer.Option(False, "--recompute-override",
                                            help="run a plan made for another --recompute setting"),
    export: Path | None = typer.Option(
        None, "--export", help="after the run, write the model as a Hugging Face directory (config.json + "
                               "model.safetensors) that transformers' from_pretrained loads"),
) -> None:
    """Execute a plan with torch (launched through torchrun): train, report metrics, verify."""
    from zeppelin.planner.sim.report import count_lines
    from zeppelin.runtime.launch import torchrun_argv  # torch-free module top
    from zeppelin.runtime.lifecycle import run_owned
    from zeppelin.schemas.plan import PlanReader, check_embedded_specs

    check_training_options(lr=lr, weight_decay=weight_decay, seed=seed, timeout=timeout, verify_tol=verify_tol,
                           checkpoint_every=checkpoint_every, threads=threads)
    check_float("--verify-timeout", verify_timeout, 0.0, MAX_TIMEOUT_S, lo_open=True)
    check_int("--nproc-per-node", nproc_per_node, 1, 1024)
    check_int("--nnodes", nnodes, 1, 4096)
    check_int("--master-port", master_port, 1, 65535)
    if node_rank is not None:
        check_int("--node-rank", node_rank, 0, (nnodes or 1) - 1)
    reader = PlanReader(plan)
    header = reader.header
    reader.verify()  # every record against the plan's digest, before any process starts
    check_embedded_specs(reader)
    if model is not None:
        _check_model(model, header)
    cl = header.cluster
    if progress not in ("auto", "rich", "plain", "none"):
        raise InputError(f"--progress must be auto, rich, plain or none (got {progress!r})")
    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"--device must be auto, cpu or cuda (got {device!r})")
    local = cl.device == "cpu" or device == "cpu"
    if nproc_per_node is None:
        nproc_per_node = header.world_size if local and nnodes in (None, 1) else cl.gpus_per_node
    if nnodes is None:
        nnodes = 1 if local else max(1, header.world_size // nproc_per_node)
    if nproc_per_node < 1 or nnodes < 1:
        raise InputError("--nproc-per-node and --nnodes must be at least 1")
    if nproc_per_node * nnodes != header.world_size:
        raise InputError(f"the plan is for {header.world_size} ranks but --nproc-per-node {nproc_per_node} x "
                         f"--nnodes {nnodes} gives {nproc_per_node * nnodes}")
    if nnodes > 1 and not (master_addr or rdzv_endpoint):
        raise InputError(f"the plan spans {nnodes} machines: pass --master-addr (and --node-rank) or "
                         f"--rdzv-endpoint on each of them, or run a local-cpu plan on one machine")
    if steps is not None and not 1 <= steps <= header.num_steps:
        raise InputError(f"--steps {steps} is out of range (the plan has {header.num_steps} steps)")
    if (checkpoint_every or resume) and checkpoint_dir is None:
        raise InputError("--checkpoint-every/--resume need --checkpoint-dir")
    if tp_overlap is not None and tp_overlap not in ("none", "slicing", "commfuse"):
        raise InputError(f"--tp-overlap must be none, slicing or commfuse (got {tp_overlap!r})")
    if dp not in ("fsdp", "replicate"):
        raise InputError(f"--dp must be fsdp or replicate (got {dp!r})")
    if dtype is not None and dtype not in ("fp32", "bf16"):
        raise InputError(f"--dtype must be fp32 or bf16 (got {dtype!r})")
    if recompute is not None and recompute not in ("none", "selective", "full"):
        raise InputError(f"--recompute must be none, selective or full (got {recompute!r})")
    if zero_stage is not None and not 0 <= zero_stage <= 3:
        raise InputError(f"--zero-stage must be 0, 1, 2 or 3 (got {zero_stage})")
    if recompute is not None and recompute != header.recompute and not recompute_override:
        raise InputError(f"the plan was made for --recompute {header.recompute} (its activation memory per "
                         f"token), not {recompute}; re-plan with `zeppelin plan --recompute {recompute}` or pass "
                         "--recompute-override")
    if export is not None and export.exists() and (not export.is_dir() or any(export.iterdir())):
        raise InputError("--export: the directory exists and is not empty", source=export)
    report = report or report_json is not None
    if report_json is not None and report_json.is_dir():
        raise InputError("--report-json is a directory", source=report_json)
    metrics_path = metrics if metrics is not None else plan.with_suffix(".metrics.jsonl")
    _check_outputs(plan, model, data, metrics_path, report_json)
    if report and nnodes > 1 and node_rank not in (None, 0):
        report = False  # rank 0 (node 0) writes the metrics; the other nodes have nothing to report
    # a resumed run appends to the metrics file: report only on the records this run adds
    skip = count_lines(metrics_path) if (report and resume) else 0
    worker = [str(plan)]
    opts = {"--model": model, "--data": data, "--steps": steps, "--lr": lr, "--weight-decay": weight_decay,
            "--seed": seed, "--metrics": metrics, "--verify-tol": verify_tol,
            "--checkpoint-every": checkpoint_every or None, "--checkpoint-dir": checkpoint_dir,
            "--timeout": timeout, "--verify-timeout": verify_timeout, "--progress": progress, "--device": device,
            "--threads": threads, "--tp-overlap": tp_overlap, "--dp": dp, "--zero-stage": zero_stage, "--hsdp": hsdp,
            "--dtype": dtype, "--recompute": recompute, "--export": export}
    for k, v in opts.items():
        if v is not None:
            worker += [k, str(v)]
    if verify:
        worker.append("--verify")
    if resume:
        worker.append("--resume")
    if recompute_override:
        worker.append("--recompute-override")
    trargs = torchrun_argv(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                           master_addr=master_addr, master_port=master_port, rdzv_backend=rdzv_backend,
                           rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, extra=list(ctx.args))
    env = dict(os.environ)
    if threads is None and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    cmd = [sys.executable, "-m", "zeppelin.runtime.launch", *trargs, "-m", "zeppelin.runtime", *worker]
    # the launcher leads a process group this command owns: signals here stop every rank, and no
    # process of the job outlives the command (zeppelin.runtime.lifecycle)
    rc = run_owned(cmd, env, grace_s=min(timeout, 10.0) + 2.0)
    if rc == 0 and report:
        _report(plan, metrics_path, skip, tp_overlap, report_json)
    raise SystemExit(rc)


def _check_model(ref: str, header) -> None:
    """``--model`` must be the model embedded in the plan, field by field."""
    from zeppelin.schemas.model import resolve_model_ref

    given = resolve_model_ref(ref).model_dump()
    planned = header.model.model_dump()
    for key in sorted(planned, key=lambda k: k == "name"):  # the architecture first, the name last
        if given.get(key) != planned[key]:
            raise InputError(f"--model {ref} does not match the plan: {key} is {given.get(key)!r} here, "
                             f"{planned[key]!r} in the plan's model {header.model.name!r}")


def _check_outputs(plan: Path, model: str | None, data: str | None, metrics: Path, report_json: Path | None) -> None:
    """The metrics and report files may not be (the same file as) an input, a device or a FIFO."""
    from zeppelin.planner.core.inputs import check_path_writable, input_refs
    from zeppelin.schemas.common import check_input_file

    inputs = [plan, data, *input_refs(model)]
    if data is not None and os.path.lexists(data) and not os.path.isdir(data):
        check_input_file(data, "manifest")  # a device or FIFO is refused here, before any rank reads it
    check_path_writable(metrics, inputs)
    if report_json is not None:
        check_path_writable(report_json, inputs + [metrics])
        if same_path(report_json, metrics):
            raise InputError("--report-json and the metrics file are the same file", source=report_json)


def same_path(a: Path, b: Path) -> bool:
    from zeppelin.schemas.common import same_file

    return os.path.abspath(a) == os.path.abspath(b) or same_file(a, b)


def _report(plan: Path, metrics_path: Path, skip: int, tp_overlap: str | None,
            report_json: Path | None) -> None:
    """Print measured vs predicted times of the steps just run (and write them as JSON)."""
    import json

    from zeppelin.planner.sim.report import render, report_for_plan
    from zeppelin.schemas.common import atomic_write_text

    rep = report_for_plan(plan, metrics_path, skip=skip, tp_overlap=tp_overlap)
    render(rep)
    if report_json is not None:
        atomic_write_text(report_json, json.dumps(rep, indent=1) + "\n")
