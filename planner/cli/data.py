"""`zeppelin data stats`: length statistics and a length histogram of a dataset manifest."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from zeppelin.planner.cli import common
from zeppelin.planner.tools import config
from zeppelin.planner.tools.tables import fmt_tokens, print_stats, stats_payload  # noqa: F401 (the tables of data stats)
from zeppelin.schemas.common import InputError


def write_histogram_png(path: Path, dataset) -> None:
    """Two panels (share of samples, share of tokens per log2 length bucket), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zeppelin.planner.tools.show import save_png
    from zeppelin.schemas.io.datasets import length_histogram

    hist = length_histogram(dataset.lengths)
    longest = int(max(dataset.lengths))
    x = [b["lo"] for b in hist]
    # each bucket drawn up to the longest sample, not to the power of two past it
    w = [min(b["hi"], longest + 1) - b["lo"] for b in hist]
    if w[-1] < x[-1] // 4:  # a top bucket of (nearly) one length: a visible sliver at the longest
        x[-1], w[-1] = longest * 7 // 8, longest // 8
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for ax, key, label, color in ((axes[0], "sample_share", "% of samples", "tab:blue"),
                                  (axes[1], "token_share", "% of tokens", "tab:purple")):
        ax.bar(x, [100 * b[key] for b in hist], width=w, align="edge", color=color, edgecolor="white")
        ax.set_xscale("log", base=2)
        ax.set_xlim(x[0], longest * 1.05)
        ax.axvline(longest, color="black", linestyle="--", linewidth=0.8)
        ax.text(longest, ax.get_ylim()[1] * 0.95, f"longest {longest:,} ", ha="right", va="top", fontsize=8)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{Path(dataset.source).name}: {dataset.num_samples:,} samples, {dataset.num_tokens:,} tokens")
    save_png(fig, path, dpi=110)


def import_python_tokenizer(ref: str):
    """``MODULE:CALLABLE`` -> the callable. This imports and runs code, so it is reached only from the
    ``--python-tokenizer`` option, never from anything a data file says."""
    import importlib

    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise InputError(f"--python-tokenizer {ref!r}: expected MODULE:CALLABLE")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # ImportError and errors raised while importing the module
        msg = str(e).splitlines()[0] if str(e) else ""
        raise InputError(f"--python-tokenizer: cannot import module {mod_name!r} ({e.__class__.__name__}: {msg})") \
            from None
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise InputError(f"--python-tokenizer {ref!r}: module {mod_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise InputError(f"--python-tokenizer {ref!r} is not callable")
    return obj


def load_for_cli(manifest: str | None, length_field: str | None, ids_field: str | None, text_field: str | None,
                 tokenizer: str | None, python_tokenizer: str | None = None):
    from zeppelin.planner.cli.common import load_dataset

    if tokenizer and python_tokenizer:
        raise InputError("--tokenizer and --python-tokenizer exclude each other")
    if text_field and not (tokenizer or python_tokenizer):
        from zeppelin.schemas.io.tokenizers import TOKENIZER_HINT

        raise InputError(f"--text-field needs --tokenizer ({TOKENIZER_HINT}) or --python-tokenizer MODULE:CALLABLE")
    if (tokenizer or python_tokenizer) and not text_field:
        raise InputError(f"{'--tokenizer' if tokenizer else '--python-tokenizer'} needs --text-field")
    tok = import_python_tokenizer(python_tokenizer) if python_tokenizer else tokenizer
    return load_dataset(manifest, length_field, ids_field, text_field, tok)


def check_png_path(png: Path, inputs=()) -> Path:
    from zeppelin.schemas.io.safefiles import check_output

    if png.suffix.lower() != ".png":
        raise InputError("--png needs a file name ending in .png", source=png)
    check_output(png, inputs)
    return png


def stats(
    manifest_arg: str | None = typer.Argument(None, metavar="[MANIFEST]",
                                              help="a file, directory, glob ('data/*.jsonl') or *.manifest.json "
                                                   "(or -m/--manifest; default: the shipped sample)"),
    manifest: str | None = common.option(config.MANIFEST),
    length_field: str | None = common.option(config.LENGTH_FIELD),
    ids_field: str | None = common.option(config.IDS_FIELD),
    tokens_field: str | None = typer.Option(None, "--tokens-field", hidden=True, help="old spelling of --ids-field"),
    text_field: str | None = common.option(config.TEXT_FIELD),
    tokenizer: str | None = common.option(config.TOKENIZER),
    python_tokenizer: str | None = typer.Option(
        None, "--python-tokenizer", metavar="MODULE:CALLABLE",
        help="for --text-field: IMPORTS AND RUNS this Python code as the tokenizer (callable(text) -> token ids "
             "or a count). Only this option runs code; a manifest never can."),
    png: Path | None = typer.Option(None, "--png", help="also write the histogram as a PNG picture"),
    as_json: bool = typer.Option(False, "--json", help="print machine-readable statistics instead of tables"),
    output: Path | None = typer.Option(None, "-o", "--output", help="write the --json statistics to this file (the "
                                                                    "tables stay on the terminal)"),
) -> None:
    """Length statistics of a dataset manifest: count, tokens, percentiles, a log2 length histogram."""
    from zeppelin.schemas.io.safefiles import atomic_write_text, check_output

    if manifest_arg is not None and manifest is not None:
        raise InputError("give the manifest once: as the argument or as -m/--manifest")
    manifest = manifest_arg if manifest_arg is not None else manifest
    if tokens_field is not None:
        common.deprecated("data stats", "--tokens-field")
        if ids_field is not None:
            raise InputError("--tokens-field is the old spelling of --ids-field: give one of them")
        ids_field = tokens_field
    if png is not None:
        check_png_path(png, [manifest] if manifest else [])
    if output is not None:
        check_output(output, [p for p in (manifest, png) if p is not None])
    ds = load_for_cli(manifest, length_field, ids_field, text_field, tokenizer, python_tokenizer)
    if output is not None:
        atomic_write_text(output, json.dumps(stats_payload(ds), indent=2) + "\n")
        print_stats(ds)
        typer.echo(f"wrote {output}")
    elif as_json:
        typer.echo(json.dumps(stats_payload(ds), indent=2))
    else:
        print_stats(ds)
    if png is not None:
        write_histogram_png(png, ds)
        if not as_json or output is not None:
            typer.echo(f"wrote {png}")
