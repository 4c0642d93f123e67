"""The options every command shares: one name, one short form, one help text and one default.

``plan``, ``compare``, ``demo``, ``simulate``, ``show`` and ``data stats`` build their shared options
here, so that ``-m`` is the manifest and ``-c`` the cluster wherever they appear, and every command
reading a manifest takes the same ``--length-field / --ids-field / --text-field / --tokenizer``.
Spellings of an older release still work for one release: :func:`deprecated` prints one note on
stderr naming the new spelling (the names are listed in :data:`DEPRECATED`).
"""

from __future__ import annotations

import sys
from typing import Any

import typer

#: the default token budget of a step, in every command: what the cluster's activation memory holds
#: at once (per-GPU token capacity after model states x data-parallel units)
TOKENS_HELP = ("token budget of a step (default: what the cluster's activation memory holds at once - a GPU's "
               "token capacity after model states x the data-parallel units; docs/CONCEPTS.md)")

#: old spelling -> (command, the spelling that replaces it); each prints one note and still works
DEPRECATED = {
    ("compare", "--dataset"): "-m/--manifest",
    ("compare", "-d"): "-m/--manifest",
    ("compare", "-n"): "--steps",
    ("compare", "--tokens-per-gpu"): "--tokens-per-step",
    ("compare", "--solver-time-limit"): "--time-limit",
    ("compare", "-m MODEL"): "--model MODEL",
    ("data stats", "--tokens-field"): "--ids-field",
}

_noted: set[str] = set()


def deprecated(command: str, old: str) -> None:
    """One note on stderr (once per process) that ``old`` is an old spelling, naming the new one."""
    new = DEPRECATED[(command, old)]
    if (command, old) in _noted:
        return
    _noted.add((command, old))
    print(f"zeppelin: note: `{command} {old}` is deprecated and goes in the next release; use {new}",
          file=sys.stderr)


def default_tokens_per_step(token_capacity: int, num_units: int) -> int:
    """The one default token budget (:data:`TOKENS_HELP`)."""
    return max(int(token_capacity) * int(num_units), 1)


# ------------------------------------------------------------------ option factories
def manifest_option(help_extra: str = "") -> Any:
    return typer.Option(None, "--manifest", "-m",
                        help="dataset manifest: file, directory, glob or *.manifest.json (default: the shipped "
                             "sample)" + help_extra)


def cluster_option(default: Any = ...) -> Any:
    return typer.Option(default, "--cluster", "-c", help="cluster preset (zeppelin-a, zeppelin-a:4, local-cpu:2x2, "
                                                         "...) or JSON file")


def model_option(default: Any = ...) -> Any:
    return typer.Option(default, "--model", help="model preset (llama-7b, tiny, ...) or JSON file")


def profile_option() -> Any:
    return typer.Option(None, "--profile", help="cost profile JSON from `zeppelin profile` (default: the preset "
                                                "curves of the cluster's GPU)")


def tokens_option() -> Any:
    return typer.Option(None, "--tokens-per-step", help=TOKENS_HELP)


def max_seq_len_option(default: Any = None) -> Any:
    return typer.Option(default, "--max-seq-len", help="longest sequence to train on; longer samples are truncated "
                                                       "(default: the longest sample)")


def steps_option(default: int) -> Any:
    return typer.Option(default, "--steps", help="number of steps to sample and plan")


def seed_option() -> Any:
    return typer.Option(0, "--seed", help="sampler (shuffle) seed")


def time_limit_option() -> Any:
    return typer.Option(None, "--time-limit",
                        help="optional wall-clock safety net per solve, seconds, for the planners that solve ILPs "
                             "(zeppelin, flexsp, hydraulis; off by default: the solvers stop at deterministic limits)")


def output_option(what: str) -> Any:
    return typer.Option(None, "-o", "--output", help=what)


def json_option(what: str = "also print the results as JSON (on stdout; the tables then go to stderr)") -> Any:
    return typer.Option(False, "--json", help=what)


def length_field_option() -> Any:
    return typer.Option(None, "--length-field", help="manifest field/column holding each sample's length "
                                                     "(default: length)")


def ids_field_option() -> Any:
    return typer.Option(None, "--ids-field", help="manifest field/column holding token-id lists (the length is "
                                                  "their count)")


def text_field_option() -> Any:
    return typer.Option(None, "--text-field", help="manifest field/column holding raw text (needs --tokenizer)")


def tokenizer_option() -> Any:
    return typer.Option(None, "--tokenizer", help="for --text-field: whitespace, bytes or a Hugging Face "
                                                  "tokenizer.json (file or directory)")


# reading a manifest with the field flags (in planner.core, below the tools that read manifests too)
from zeppelin.planner.core.inputs import load_dataset  # noqa: F401
