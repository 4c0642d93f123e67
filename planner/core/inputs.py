"""Resolving command-line inputs: ``--cluster FILE|NAME``, ``--model FILE|NAME``, ``--profile FILE``."""

from __future__ import annotations

from pathlib import Path

from zeppelin.schemas.cluster import ClusterSpec, cluster_preset
from zeppelin.schemas.common import InputError, load_doc
from zeppelin.schemas.model import ModelSpec, resolve_model_ref
from zeppelin.schemas.profile import CostProfile, default_profile


def _looks_like_file(ref: str) -> bool:
    return ref.endswith(".json") or "/" in ref or Path(ref).exists()


def resolve_cluster(ref: str) -> ClusterSpec:
    """A cluster preset name (``zeppelin-a``, ``zeppelin-a:8``, ``local-cpu:2x2``) or a JSON file."""
    if _looks_like_file(ref):
        return load_doc(ClusterSpec, ref)
    return cluster_preset(ref)


def resolve_model(ref: str) -> ModelSpec:
    """A preset name, a ModelSpec JSON file or ``hf:DIR`` (a Hugging Face config.json)."""
    return resolve_model_ref(ref)


def resolve_profile(ref: str | None, cluster: ClusterSpec) -> CostProfile:
    if ref is None:
        return default_profile(cluster.name, cluster.device)
    prof = load_doc(CostProfile, ref)
    return prof


def check_path_writable(path: str | Path) -> Path:
    p = Path(path)
    if p.exists() and p.is_dir():
        raise InputError("output path is a directory", source=p)
    return p


__all__ = ["resolve_cluster", "resolve_model", "resolve_profile", "check_path_writable", "InputError"]
