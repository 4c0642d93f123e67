"""Resolving command-line inputs: ``--cluster FILE|NAME``, ``--model FILE|NAME``, ``--profile FILE``."""

from __future__ import annotations

import os
import re
from pathlib import Path

from zeppelin.schemas.cluster import ClusterSpec, cluster_preset
from zeppelin.schemas.common import InputError
from zeppelin.schemas.io.documents import load_doc
from zeppelin.schemas.io.safefiles import check_output
from zeppelin.schemas.model import ModelSpec, resolve_model_ref
from zeppelin.schemas.profile import MEASURED_PROFILES, CostProfile, default_profile, measured_profile


def _looks_like_file(ref: str) -> bool:
    """A reference is a file when it looks like a path (``./tiny``, ``tiny.json``, ``dir/x``); a bare
    name is always a preset, even when a file of that name is in the working directory."""
    return ref.lower().endswith(".json") or "/" in ref or os.sep in ref


def input_refs(*refs) -> list[str]:
    """The references among ``refs`` that name files (for the output checks)."""
    out = []
    for r in refs:
        if r is None:
            continue
        r = str(r)
        if r.startswith("hf:"):  # a Hugging Face model directory: its config.json is the input
            out.append(os.path.join(r[3:], "config.json"))
        elif _looks_like_file(r):
            out.append(r)
    return out


def resolve_cluster(ref: str) -> ClusterSpec:
    """A cluster preset name (``zeppelin-a``, ``zeppelin-a:8``, ``local-cpu:2x2``) or a JSON file."""
    if _looks_like_file(ref):
        return load_doc(ClusterSpec, ref)
    return cluster_preset(ref)


def resolve_model(ref: str) -> ModelSpec:
    """A preset name, a ModelSpec JSON file or ``hf:DIR`` (a Hugging Face config.json)."""
    return resolve_model_ref(ref)


def _shipped(ref: str) -> bool:
    """Whether ``--profile ref`` names a shipped measured profile (a file of that name wins)."""
    return ref in MEASURED_PROFILES and not os.path.exists(ref)


def resolve_profile(ref: str | None, cluster: ClusterSpec) -> CostProfile:
    """The cluster's preset curves (None), a shipped measured profile (``h200-measured``) or a
    profile JSON file."""
    if ref is None:
        return default_profile(cluster.name, cluster.device)
    if _shipped(ref):
        return measured_profile(ref)
    prof = load_doc(CostProfile, ref)
    return prof


def profile_mismatch(prof: CostProfile, ref: str, cluster: ClusterSpec, cluster_ref: str, model: ModelSpec,
                     model_ref: str) -> str | None:
    """Why the measured profile ``prof`` (file ``ref``) does not describe planning ``model`` on
    ``cluster`` (one line naming both sides), or None. A preset profile always fits; a measured one
    must come from the cluster's kind of device and hold kernel fits of the model."""
    if prof.source.kind != "measured":
        return None
    m = re.search(r"\((cpu|cuda)\b", prof.source.machine)
    device = m.group(1) if m else None
    if device is not None and device != cluster.device:
        what = {"cpu": "CPUs", "cuda": "GPUs"}
        return (f"--profile {ref} was measured on {what[device]} ({prof.source.machine}) but --cluster "
                f"{cluster_ref} has {what[cluster.device]}: profile the cluster's machines")
    fitted = sorted({f.model for f in prof.fits})
    # a shipped profile prices models it did not measure by its measured efficiency curves
    if fitted and model.name not in fitted and not _shipped(ref):
        return (f"--profile {ref} holds kernel fits of model {', '.join(fitted)}, not of --model {model_ref} "
                f"({model.name}): measure it with `zeppelin profile --model {model_ref}`")
    return None


def check_path_writable(path: str | Path, inputs=()) -> Path:
    """Refuse an output path up front (before any work): see
    :func:`zeppelin.schemas.io.safefiles.check_output`."""
    check_output(path, inputs)
    return Path(path)


__all__ = ["input_refs", "resolve_cluster", "resolve_model", "resolve_profile", "check_path_writable", "InputError",
           "load_dataset", "profile_mismatch"]


# ------------------------------------------------------------------ a manifest from command-line flags
def load_dataset(manifest: str | None, length_field: str | None = None, ids_field: str | None = None,
                 text_field: str | None = None, tokenizer=None):
    """The manifest named on the command line (the shipped sample when none), its fields overridden by
    the field flags. An error about a missing field names the flag that picks another one."""
    from zeppelin.schemas.io.datasets import default_manifest_path, load_manifest
    from zeppelin.schemas.io.tokenizers import TOKENIZER_HINT

    if text_field and not tokenizer:
        raise InputError(f"--text-field needs --tokenizer ({TOKENIZER_HINT})")
    if tokenizer and not text_field:
        raise InputError("--tokenizer needs --text-field")
    ref = manifest if manifest is not None else default_manifest_path()
    try:
        return load_manifest(ref, length_field=length_field, tokens_field=ids_field, text_field=text_field,
                             tokenizer=tokenizer)
    except InputError as e:
        hint = _missing_field_hint(e.problem, ids_field, text_field)
        if hint is None:
            raise
        raise InputError(e.problem + hint, source=e.source) from None


def _missing_field_hint(problem: str, ids_field: str | None, text_field: str | None) -> str | None:
    if not (problem.startswith(("column ", "field ")) and " not found" in problem):
        return None
    flag = "--ids-field" if ids_field else "--text-field" if text_field else "--length-field"
    return f"; name the {'column' if problem.startswith('column') else 'field'} to use with {flag} NAME"
