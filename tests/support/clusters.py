"""Cluster presets for tests that run the layouts planners make on CPU ranks.

The ``local-cpu`` preset carries gloo's measured link figures (milliseconds a call, see
benchmarks/bench_gloo_links.py), under which the planners rightly keep short sequences local on CPU
ranks. Tests whose subject is how the runtime executes rings, Ulysses groups, TP replicas or
several micro-batches plan over the fast links the preset had before (2 GB/s and 60 us inside a
"node", 1 GB/s and 120 us across), where the planners make those layouts.
"""

from __future__ import annotations

from zeppelin.schemas.cluster import ClusterSpec, LinkSpec
from zeppelin.schemas.cluster import cluster_preset as _preset

__all__ = ["cluster_preset"]


def cluster_preset(name: str) -> ClusterSpec:
    """``zeppelin.schemas.cluster.cluster_preset``, with fast links for ``local-cpu`` names."""
    base = _preset(name)
    if base.name != "local-cpu":
        return base
    nics = [n.model_copy(update={"bandwidth_GBps": 1.0, "latency_us": 120.0}) for n in base.nics]
    return base.model_copy(update={"intra_link": LinkSpec(kind="shm", bandwidth_GBps=2.0, latency_us=60.0),
                                   "nics": nics})


def cluster_file(directory, name: str):
    """``name`` (a ``local-cpu:NxG`` preset) over fast links written as a cluster JSON file in
    ``directory``, for tests that plan through the ``zeppelin`` command; returns its path."""
    from pathlib import Path

    path = Path(directory) / (name.replace(":", "-") + ".cluster.json")
    path.write_text(cluster_preset(name).model_dump_json())
    return path
