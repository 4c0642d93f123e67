"""`zeppelin demo | presets | schema`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from zeppelin.schemas.common import InputError, atomic_write_text

from .notyet import not_implemented

SCHEMAS = ("cluster", "model", "manifest", "profile", "plan", "step")


def _schema_cls(name: str):
    from zeppelin.schemas.cluster import ClusterSpec
    from zeppelin.schemas.manifest import ManifestSpec
    from zeppelin.schemas.model import ModelSpec
    from zeppelin.schemas.plan import PlanHeader, StepPlan
    from zeppelin.schemas.profile import CostProfile

    return {"cluster": ClusterSpec, "model": ModelSpec, "manifest": ManifestSpec, "profile": CostProfile,
            "plan": PlanHeader, "step": StepPlan}[name]


def schema(
    name: str = typer.Argument(..., help=f"one of: {', '.join(SCHEMAS)} (plan = the header record, step = a step record)"),
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


def presets(
    dump: Optional[str] = typer.Option(None, "--dump", help="print one preset as JSON (cluster or model name)"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="with --dump: write to this file"),
) -> None:
    """List the preset clusters and models; `--dump NAME -o FILE` to edit one and pass it back in."""
    from rich.console import Console
    from rich.table import Table

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
    con = Console()
    t = Table(title="cluster presets  (NAME, NAME:NODES or NAME:NODESxGPUS)")
    for col in ("name", "nodes x gpus", "gpu", "TFLOP/s", "mem GB", "intra GB/s", "NICs x GB/s"):
        t.add_column(col)
    for n in CLUSTER_PRESETS:
        c = cluster_preset(n)
        t.add_row(n, f"{c.num_nodes} x {c.gpus_per_node}", c.gpu.name, f"{c.gpu.peak_tflops:g}",
                  f"{c.gpu.memory_gb:g}", f"{c.intra_link.bandwidth_GBps:g}",
                  f"{len(c.nics)} x {c.nics[0].bandwidth_GBps:g}")
    con.print(t)
    t = Table(title="model presets")
    for col in ("name", "layers", "hidden", "heads", "kv heads", "ffn", "vocab", "mlp", "dtype", "params"):
        t.add_column(col)
    for n in MODEL_PRESETS:
        m = model_preset(n)
        p = m.num_params()
        t.add_row(n, str(m.num_layers), str(m.hidden), str(m.num_heads), str(m.num_kv_heads), str(m.ffn_hidden),
                  str(m.vocab_size), m.mlp, m.dtype, f"{p / 1e9:.2f}B" if p > 1e8 else f"{p / 1e6:.2f}M")
    con.print(t)


def demo(ctx: typer.Context) -> None:
    """Run the main job on built-in defaults (shipped sample manifest, preset cluster and model)."""
    not_implemented("demo")
