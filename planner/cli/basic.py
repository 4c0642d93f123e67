"""`zeppelin demo | presets | schema`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from zeppelin.planner.cli import common
from zeppelin.planner.tools.config import DemoConfig
from zeppelin.schemas.common import InputError
from zeppelin.schemas.io.safefiles import atomic_write_text

SCHEMAS = ("cluster", "model", "manifest", "profile", "plan", "step", "case")


def _schema_cls(name: str):
    from zeppelin.schemas.cluster import ClusterSpec
    from zeppelin.schemas.manifest import ManifestSpec
    from zeppelin.schemas.model import ModelSpec
    from zeppelin.schemas.plan import PlanHeader, StepPlan
    from zeppelin.schemas.profile import CostProfile

    if name == "case":  # a `zeppelin check` case (planner/tools/check.py)
        from zeppelin.planner.tools.check import CheckCase

        return CheckCase
    return {"cluster": ClusterSpec, "model": ModelSpec, "manifest": ManifestSpec, "profile": CostProfile,
            "plan": PlanHeader, "step": StepPlan}[name]


def schema(
    name: str = typer.Argument(..., help=f"one of: {', '.join(SCHEMAS)} (plan = the header record, step = a step "
                                         f"record, case = a `zeppelin check` case)"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="write to this file instead of stdout"),
) -> None:
    """Print the JSON Schema of a zeppelin document."""
    key = name.strip().lower()
    if key not in SCHEMAS:
        raise InputError(f"unknown schema {name!r} (known: {', '.join(SCHEMAS)})")
    text = json.dumps(_schema_cls(key).model_json_schema(), indent=2) + "\n"
    if output:
        atomic_write_text(output, text)
    else:
        typer.echo(text, nl=False)


def config(
    dump: bool = typer.Option(False, "--dump", help="write every key of a job file at its default"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="with --dump: write to this file"),
) -> None:
    """The job file of `plan`, `compare`, `demo` and `run` (`--config FILE`): `--dump` writes
    every key at its default; a flag on the command line wins over the file."""
    from zeppelin.planner.cli.jobfile import dump as dump_text

    if not dump:
        raise InputError("zeppelin config takes --dump (and -o FILE)")
    text = dump_text()
    if output:
        atomic_write_text(output, text)
        typer.echo(f"wrote {output}")
    else:
        typer.echo(text, nl=False)


def presets(
    dump: Optional[str] = typer.Option(None, "--dump", help="print one preset as JSON (cluster or model name)"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="with --dump: write to this file"),
) -> None:
    """List the preset clusters and models; `--dump NAME -o FILE` to edit one and pass it back in."""
    from zeppelin.planner.tools.tables import console, table
    from zeppelin.schemas.cluster import CLUSTER_PRESETS, cluster_preset
    from zeppelin.schemas.model import MODEL_PRESETS, model_preset

    if dump:
        base = dump.split(":")[0]
        if base in CLUSTER_PRESETS:
            doc = cluster_preset(dump)
        elif dump in MODEL_PRESETS:
            doc = model_preset(dump)
        else:
            raise InputError(f"unknown preset {dump!r} (clusters: {', '.join(CLUSTER_PRESETS)}; "
                             f"models: {', '.join(MODEL_PRESETS)})")
        text = doc.model_dump_json(indent=2) + "\n"
        if output:
            atomic_write_text(output, text)
            typer.echo(f"wrote {output}")
        else:
            typer.echo(text, nl=False)
        return
    con = console()
    t = table("cluster presets  (NAME, NAME:NODES or NAME:NODESxGPUS)",
              ["name", "nodes x gpus", ("gpu", "left"), "TFLOP/s", "mem GB", "intra GB/s", "NICs x GB/s"])
    for n in CLUSTER_PRESETS:
        c = cluster_preset(n)
        t.add_row(n, f"{c.num_nodes} x {c.gpus_per_node}", c.gpu.name, f"{c.gpu.peak_tflops:g}",
                  f"{c.gpu.memory_gb:g}", f"{c.intra_link.bandwidth_GBps:g}",
                  f"{len(c.nics)} x {c.nics[0].bandwidth_GBps:g}")
    con.print(t)
    t = table("model presets", ["name", "layers", "hidden", "heads", "kv heads", "ffn", "vocab", ("mlp", "left"),
                                ("dtype", "left"), "params"])
    for n in MODEL_PRESETS:
        m = model_preset(n)
        p = m.num_params()
        t.add_row(n, str(m.num_layers), str(m.hidden), str(m.num_heads), str(m.num_kv_heads), str(m.ffn_hidden),
                  str(m.vocab_size), m.mlp, m.dtype, _params_text(p))
    moe = [model_preset(n) for n in MODEL_PRESETS if model_preset(n).is_moe]
    if moe:
        t.caption = ("mixture of experts (ffn: one expert's width): " + "; ".join(
            f"{m.name} {m.num_experts} experts, top-{m.experts_per_token}, {_params_text(m.active_params())} of "
            f"{_params_text(m.num_params())} parameters active per token" for m in moe)
            + "; planned without expert parallelism, experts evenly loaded (docs/HF.md)")
    con.print(t)
    from zeppelin.schemas.profile import MEASURED_PROFILES, measured_profile

    for name in MEASURED_PROFILES:
        src = measured_profile(name).source
        con.print(f"measured profile (--profile {name}): {src.machine}, {src.created_at[:10]} (docs/PROFILING.md)")


def _params_text(p: int) -> str:
    return f"{p / 1e9:.2f}B" if p > 1e8 else f"{p / 1e6:.2f}M"


@common.generated("demo")
def demo(**values: Any) -> None:
    """Run the main job on built-in defaults (shipped sample manifest, preset cluster and model):
    data statistics, the cost picture, then the sampled steps planned by zeppelin and the main
    baselines - side-by-side table and a picture of one step."""
    from zeppelin.planner.tools.demo import jsonable, run_demo

    cfg = DemoConfig.from_flags(values)
    ctx = run_demo(cfg)
    if cfg.json_out or cfg.output is not None:
        text = json.dumps(jsonable(ctx.results), indent=1) + "\n"
        if cfg.output is not None:
            atomic_write_text(cfg.output, text)
            ctx.console.print(f"wrote {cfg.output}", highlight=False, markup=False)
        else:
            typer.echo(text, nl=False)
