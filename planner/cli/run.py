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

import inspect
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from zeppelin.runtime.config import FlagSpec, LaunchConfig, RunConfig, flag_specs
from zeppelin.schemas.common import InputError


def run(ctx: typer.Context, **values: Any) -> None:
    """Execute a plan with torch (launched through torchrun): train, report metrics, verify."""
    from zeppelin.runtime.launch import torchrun_argv  # torch-free module top
    from zeppelin.runtime.lifecycle import run_owned
    from zeppelin.runtime.startup import T0_ENV

    t0 = getattr(sys.modules.get("zeppelin.planner.cli"), "STARTED_AT", None)  # the ranks count from here
    cfg = RunConfig(**{s.name: values.pop(s.name) for s in flag_specs(RunConfig)})  # checks every option
    launch = LaunchConfig(**values)
    reader = _check_plan(cfg)
    header = reader.header
    nproc_per_node, nnodes = _process_layout(cfg, launch, header)
    cfg.check_plan(header)
    report_json = _check_files(cfg, launch, reader)
    if not cfg.follow:
        # what every rank checks before its first collective, checked once here: a refusal is
        # printed once, before any process starts
        from zeppelin.runtime.train.checks import startup_checks

        startup_checks(cfg, header.world_size)
    report = launch.report
    if report and nnodes > 1 and launch.node_rank not in (None, 0):
        report = False  # rank 0 (node 0) writes the metrics; the other nodes have nothing to report
    # a resumed run appends to the metrics file: report only on the records this run adds
    skip = 0
    if report and cfg.resume:
        # (imported here: the simulator's modules and numpy are not on the path to the first step)
        from zeppelin.planner.sim.report import count_lines

        skip = count_lines(cfg.metrics_path)
    trargs = torchrun_argv(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=launch.node_rank,
                           master_addr=launch.master_addr, master_port=launch.master_port,
                           rdzv_backend=launch.rdzv_backend, rdzv_endpoint=launch.rdzv_endpoint,
                           rdzv_id=launch.rdzv_id, extra=list(ctx.args))
    env = dict(os.environ)
    if t0 is not None:
        env[T0_ENV] = repr(t0)
    if cfg.progress != "none" and sys.stderr.isatty():
        print(f"zeppelin run: starting {nproc_per_node * nnodes} ranks through torchrun ...", file=sys.stderr,
              flush=True)
    if cfg.threads is None and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    cmd = [sys.executable, "-m", "zeppelin.runtime.launch", *trargs, "-m", "zeppelin.runtime", *cfg.to_argv()]
    # the launcher leads a process group this command owns: signals here stop every rank, and no
    # process of the job outlives the command (zeppelin.runtime.lifecycle)
    rc = run_owned(cmd, env, grace_s=min(cfg.timeout_s, 10.0) + 2.0, stall_s=cfg.timeout_s)
    if rc == 0 and report:
        if cfg.resume and count_lines(cfg.metrics_path) <= skip:  # resumed at the end: no step ran
            print("zeppelin run: --report: no step ran (the checkpoint is at the end of the run); nothing to report")
        else:
            _report(Path(cfg.plan), cfg.metrics_path, skip, cfg.tp_overlap, report_json)
    raise SystemExit(rc)


def _check_plan(cfg: RunConfig):
    """Every record of the plan against its digest before any process starts (``--follow``: the
    header only; each step is checked by the ranks when it arrives); the model; every step runnable.
    Returns the plan's reader."""
    from zeppelin.schemas.plan import check_embedded_specs
    from zeppelin.schemas.io.stream import open_plan_reader, waiting_line

    reader = open_plan_reader(Path(cfg.plan), follow=cfg.follow, digest=cfg.plan_digest, on_wait=waiting_line,
                              wait_s=cfg.timeout_s)
    if not cfg.follow:
        cfg.plan_digest = reader.digest  # the ranks run exactly the plan checked here
    check_embedded_specs(reader)
    if cfg.model is not None:
        _check_model(cfg.model, reader.header)
    if not cfg.follow:
        _check_runnable(reader, cfg)
    return reader


def _process_layout(cfg: RunConfig, launch: LaunchConfig, header) -> tuple[int, int]:
    """Processes per machine and machines: the options, else the plan's ranks on one machine for a
    CPU run, else the plan's GPUs per node."""
    cl = header.cluster
    local = cl.device == "cpu" or cfg.device == "cpu"
    nproc_per_node, nnodes = launch.nproc_per_node, launch.nnodes
    if nproc_per_node is None:
        nproc_per_node = header.world_size if local and nnodes in (None, 1) else cl.gpus_per_node
    if nnodes is None:
        nnodes = 1 if local else max(1, header.world_size // nproc_per_node)
    if nproc_per_node < 1 or nnodes < 1:
        raise InputError("--nproc-per-node and --nnodes must be at least 1")
    if nproc_per_node * nnodes != header.world_size:
        raise InputError(f"the plan is for {header.world_size} ranks but --nproc-per-node {nproc_per_node} x "
                         f"--nnodes {nnodes} gives {nproc_per_node * nnodes}")
    if nnodes > 1 and not (launch.master_addr or launch.rdzv_endpoint):
        raise InputError(f"the plan spans {nnodes} machines: pass --master-addr (and --node-rank) or "
                         f"--rdzv-endpoint on each of them, or run a local-cpu plan on one machine")
    return nproc_per_node, nnodes


def _check_files(cfg: RunConfig, launch: LaunchConfig, reader) -> Path | None:
    """The run's files before any process starts: the manifest, the checkpoint directory and the
    checkpoint to resume (read-only), every input against every output. Returns ``--report-json``."""
    from zeppelin.schemas.io.safefiles import check_input_file, check_output

    header = reader.header
    report_json = None if launch.report_json is None else Path(launch.report_json)
    if report_json is not None and report_json.is_dir():
        raise InputError("--report-json is a directory", source=report_json)
    metrics_path = cfg.metrics_path
    if cfg.data is not None and os.path.lexists(cfg.data) and not os.path.isdir(cfg.data):
        check_input_file(cfg.data, "manifest")  # a device or FIFO is refused here, before any rank reads it
    end = header.num_steps if cfg.steps is None else cfg.steps
    if cfg.checkpoint_dir is not None:
        from zeppelin.runtime.checkpoint import plan_hash, plan_prefix
        from zeppelin.runtime.lifecycle import inspect_checkpoint_dir, resume_point

        inspect_checkpoint_dir(cfg.checkpoint_dir)
        if cfg.resume and os.path.isdir(cfg.checkpoint_dir):
            resume_point(cfg.checkpoint_dir, plan_hash=plan_hash(header), world_size=header.world_size, end=end,
                         hparams=cfg.hyperparameters(header.seed), prefix=lambda n: plan_prefix(reader, n))
    # every file the ranks will read (plan, model files, manifest, shards, tokenizer) against every output
    # (--follow: the steps are not written yet; the planner refused sequences beyond the positions)
    inputs = cfg.check_inputs(reader, 0 if cfg.follow else end)
    if report_json is not None:
        check_output(report_json, [*inputs, metrics_path], "output")
        cfg.check_outside_checkpoint_dir(report_json, "--report-json")
        if same_path(report_json, metrics_path):
            raise InputError("--report-json and the metrics file are the same file", source=report_json)
    return report_json


def _parameter(spec: FlagSpec) -> inspect.Parameter:
    """The typer parameter of one option of :mod:`zeppelin.runtime.config`."""
    kind = Path if spec.path else spec.kind
    if not spec.flags:
        return inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, annotation=kind,
                                 default=typer.Argument(..., help=spec.help_text))
    optional = spec.default is None
    return inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY,
                             annotation=Optional[kind] if optional else kind,  # noqa: UP045 (typer reads it)
                             default=typer.Option(spec.default, *spec.flags, help=spec.help_text, metavar=spec.metavar))


# the command's parameters come from RunConfig (the ranks' options) and LaunchConfig (zeppelin run's own)
run.__signature__ = inspect.Signature(
    [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    + [_parameter(s) for s in (*flag_specs(RunConfig), *flag_specs(LaunchConfig))])


def _check_model(ref: str, header) -> None:
    """``--model`` must be the model embedded in the plan, field by field."""
    from zeppelin.schemas.model import resolve_model_ref

    spec = resolve_model_ref(ref)
    if spec.attention_pattern() != header.model.attention_pattern():
        raise InputError(f"--model {ref} runs {spec.attention_pattern()} attention but the plan was made for "
                         f"{header.model.attention_pattern()} attention (plan it for this model)")
    given = spec.model_dump()
    planned = header.model.model_dump()
    # (optional fields appear only where set: compare the keys of both)
    keys = list(planned) + [k for k in given if k not in planned]
    for key in sorted(keys, key=lambda k: k == "name"):  # the architecture first, the name last
        if given.get(key) != planned.get(key):
            raise InputError(f"--model {ref} does not match the plan: {key} is {given.get(key)!r} here, "
                             f"{planned.get(key)!r} in the plan's model {header.model.name!r}")


def _check_runnable(reader, cfg: RunConfig) -> None:
    """Every step to run is one the runtime executes for the model (:mod:`zeppelin.schemas.runnable`),
    checked before any process starts: a plan that cannot run to its end does not start."""
    from zeppelin.schemas.hf import is_hf_ref
    from zeppelin.schemas.runnable import step_problem

    hf = is_hf_ref(cfg.model)
    end = min(cfg.steps or reader.header.num_steps, reader.header.num_steps)
    for step in reader:
        if step.step >= end:
            break
        why = step_problem(reader.header, step, hf)
        if why:
            raise InputError(f"zeppelin run cannot execute {why} (nothing was run)", source=reader.path)


def same_path(a: Path, b: Path) -> bool:
    from zeppelin.schemas.io.safefiles import same_file

    return os.path.abspath(a) == os.path.abspath(b) or same_file(a, b)


def _report(plan: Path, metrics_path: Path, skip: int, tp_overlap: str | None,
            report_json: Path | None) -> None:
    """Print measured vs predicted times of the steps just run (and write them as JSON)."""
    import json

    from zeppelin.planner.sim.report import render, report_for_plan
    from zeppelin.schemas.io.safefiles import atomic_write_text

    rep = report_for_plan(plan, metrics_path, skip=skip, tp_overlap=tp_overlap)
    render(rep)
    if report_json is not None:
        atomic_write_text(report_json, json.dumps(rep, indent=1) + "\n")
