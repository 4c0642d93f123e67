"""ClusterSpec: nodes, GPUs, intra-node links, NICs and the GPU->NIC affinity map; presets.

Units used throughout zeppelin: bandwidth in GB/s (1e9 bytes per second, per direction),
latency in microseconds, memory in GB (1e9 bytes), compute in TFLOP/s (dense bf16 peak).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from .common import Doc, InputError, Strict

CLUSTER_SCHEMA = "zeppelin.cluster/1"
MAX_NODES = 4096
MAX_GPUS_PER_NODE = 256


class GPUSpec(Strict):
    name: str
    peak_tflops: float = Field(ge=1e-6, le=1e6, description="dense bf16 peak, TFLOP/s")
    memory_gb: float = Field(ge=0.01, le=1e5, description="device memory, GB")


class LinkSpec(Strict):
    kind: Literal["nvswitch", "nvlink", "pcie", "shm", "loopback"] = "nvswitch"
    bandwidth_GBps: float = Field(ge=1e-3, le=1e6, description="per direction, GB/s")
    latency_us: float = Field(ge=0, le=1e6)


class NICSpec(Strict):
    id: str = Field(min_length=1)
    bandwidth_GBps: float = Field(ge=1e-3, le=1e6, description="per direction, GB/s")
    latency_us: float = Field(ge=0, le=1e6)
    pcie_switch: int | None = Field(default=None, ge=0, le=MAX_GPUS_PER_NODE,
                                    description="PCIe switch the NIC hangs off")


class ClusterSpec(Doc):
    """A homogeneous cluster: ``num_nodes`` identical nodes of ``gpus_per_node`` devices."""

    schema_version: Literal["zeppelin.cluster/1"] = CLUSTER_SCHEMA
    name: str = Field(min_length=1)
    description: str = ""
    device: Literal["cuda", "cpu"] = "cuda"
    num_nodes: int = Field(ge=1, le=MAX_NODES)
    gpus_per_node: int = Field(ge=1, le=MAX_GPUS_PER_NODE)
    gpu: GPUSpec
    intra_link: LinkSpec
    nics: list[NICSpec] = Field(min_length=1, max_length=MAX_GPUS_PER_NODE,
                                description="NICs of one node (every node alike)")
    gpu_nic: list[str] = Field(description="for each local GPU index, the id of the NIC it uses")
    gpu_pcie_switch: list[int] | None = Field(default=None, description="PCIe switch of each local GPU")

    @model_validator(mode="after")
    def _check(self) -> "ClusterSpec":
        ids = [n.id for n in self.nics]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate NIC ids in nics: {ids}")
        if len(self.gpu_nic) != self.gpus_per_node:
            raise ValueError(
                f"gpu_nic has {len(self.gpu_nic)} entries but gpus_per_node is {self.gpus_per_node}"
            )
        for i, nic in enumerate(self.gpu_nic):
            if nic not in ids:
                raise ValueError(f"gpu_nic[{i}] names NIC {nic!r}, which is not in nics ({', '.join(ids)})")
        if self.gpu_pcie_switch is not None and len(self.gpu_pcie_switch) != self.gpus_per_node:
            raise ValueError("gpu_pcie_switch must have one entry per local GPU")
        return self

    # -- derived quantities ----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def nic_of(self, rank: int) -> str:
        """Global NIC name ``node<k>/<id>`` used by ``rank``."""
        return f"node{self.node_of(rank)}/{self.gpu_nic[self.local_of(rank)]}"

    def nic_spec(self, nic_id: str) -> NICSpec:
        local = nic_id.split("/", 1)[-1]
        for n in self.nics:
            if n.id == local:
                return n
        raise KeyError(nic_id)

    def gpus_on_nic(self, nic_id: str) -> list[int]:
        return [i for i, n in enumerate(self.gpu_nic) if n == nic_id]

    @property
    def node_nic_bandwidth_GBps(self) -> float:
        return sum(n.bandwidth_GBps for n in self.nics)


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------


def _nodes(n_gpu: int, n_nic: int, bw: float, lat: float = 3.0) -> tuple[list[NICSpec], list[str], list[int]]:
    nics = [NICSpec(id=f"nic{i}", bandwidth_GBps=bw, latency_us=lat, pcie_switch=i) for i in range(n_nic)]
    per = max(1, n_gpu // n_nic)
    gpu_nic = [f"nic{min(g // per, n_nic - 1)}" for g in range(n_gpu)]
    sw = [min(g // per, n_nic - 1) for g in range(n_gpu)]
    return nics, gpu_nic, sw


def _cluster(name, desc, nodes, gpn, gpu, link, n_nic, nic_bw, device="cuda", nic_lat=3.0) -> ClusterSpec:
    nics, gpu_nic, sw = _nodes(gpn, n_nic, nic_bw, nic_lat)
    return ClusterSpec(
        name=name, description=desc, device=device, num_nodes=nodes, gpus_per_node=gpn, gpu=gpu,
        intra_link=link, nics=nics, gpu_nic=gpu_nic, gpu_pcie_switch=sw,
    )


A800 = GPUSpec(name="A800-SXM4-80GB", peak_tflops=312.0, memory_gb=80.0)
A100_40 = GPUSpec(name="A100-SXM4-40GB", peak_tflops=312.0, memory_gb=40.0)
H800 = GPUSpec(name="H800-SXM5-80GB", peak_tflops=989.0, memory_gb=80.0)
H100 = GPUSpec(name="H100-SXM5-80GB", peak_tflops=989.0, memory_gb=80.0)
H200 = GPUSpec(name="H200-SXM5-141GB", peak_tflops=989.0, memory_gb=141.0)


#: gloo's collectives between CPU processes as the runtime makes them (FSDP2's gathers and
#: reduce-scatters, hand-overs included): latency (us) and bandwidth (GB/s) fitted by
#: benchmarks/bench_gloo_links.py on 2 ranks (benchmarks/data/gloo_links/meas.json, ``fits.fsdp``)
LOCAL_CPU_LINK = (7900.0, 0.17)


def _local_cpu(nodes: int = 1, procs: int = 4) -> ClusterSpec:
    # N gloo processes on one machine: "nodes" are groups of processes. gloo moves every byte over
    # loopback TCP, inside a "node" and across alike: both links carry the measured figures.
    # `zeppelin profile` measures this machine's own.
    lat, bw = LOCAL_CPU_LINK
    return _cluster(
        "local-cpu", "gloo processes on this machine (CPU); 'nodes' are groups of processes",
        nodes, procs, GPUSpec(name="cpu-process", peak_tflops=0.05, memory_gb=4.0),
        LinkSpec(kind="shm", bandwidth_GBps=bw, latency_us=lat), 1, bw, device="cpu", nic_lat=lat,
    )


# name -> description, nodes (of 8 GPUs), GPU, intra-node link (kind, GB/s; 2 us latency), NICs per node,
# GB/s per NIC
_PRESETS = {
    "zeppelin-a": ("Zeppelin cluster A: 8x A800-80G per node, NVLink, 4x 200 Gb/s RoCE NICs per node",
                   2, A800, "nvlink", 200.0, 4, 25.0),
    "zeppelin-b": ("Zeppelin cluster B: 8x H800 per node, NVLink, 8x 200 Gb/s RoCE NICs per node",
                   2, H800, "nvlink", 200.0, 8, 25.0),
    "zeppelin-c": ("Zeppelin cluster C: 8x H200 per node, NVSwitch, 8x 400 Gb/s CX7 NICs per node",
                   2, H200, "nvswitch", 450.0, 8, 50.0),
    "flexsp-a100": ("FlexSP testbed: 8x A100-40GB per node, NVLink, 400 Gb/s InfiniBand per node",
                    8, A100_40, "nvlink", 300.0, 1, 50.0),
    "h100": ("generic H100 SXM node: 8 GPUs, NVSwitch, 8x 400 Gb/s NICs",
             1, H100, "nvswitch", 450.0, 8, 50.0),
}


def _preset(name: str) -> ClusterSpec:
    if name == "local-cpu":
        return _local_cpu()
    desc, nodes, gpu, kind, bw, n_nic, nic_bw = _PRESETS[name]
    link = LinkSpec(kind=kind, bandwidth_GBps=bw, latency_us=2.0)
    return _cluster(name, desc, nodes, 8, gpu, link, n_nic, nic_bw)


CLUSTER_PRESETS = (*_PRESETS, "local-cpu")

_NAME_RE = re.compile(r"^(?P<base>[a-z0-9][a-z0-9-]*)(?::(?P<nodes>\d+)(?:x(?P<gpn>\d+))?)?$")


def cluster_preset(name: str) -> ClusterSpec:
    """A preset by name. ``NAME:N`` sets the node count, ``NAME:NxG`` nodes and GPUs per node.

    Examples: ``zeppelin-a:8`` (64 GPUs), ``local-cpu:2x2`` (two 'nodes' of two processes).
    """
    m = _NAME_RE.match(name.strip())
    if not m or m.group("base") not in CLUSTER_PRESETS:
        raise InputError(f"unknown cluster preset {name!r} (known: {', '.join(CLUSTER_PRESETS)})")
    base = _preset(m.group("base"))
    nodes = int(m.group("nodes")) if m.group("nodes") else base.num_nodes
    gpn = int(m.group("gpn")) if m.group("gpn") else base.gpus_per_node
    if nodes < 1 or gpn < 1:
        raise InputError(f"cluster preset {name!r}: node and GPU counts must be at least 1")
    if nodes > MAX_NODES or gpn > MAX_GPUS_PER_NODE:
        raise InputError(f"cluster preset {name!r}: at most {MAX_NODES:,} nodes of {MAX_GPUS_PER_NODE} GPUs "
                         f"(got {nodes:,} x {gpn:,})")
    if m.group("base") == "local-cpu":
        return _local_cpu(nodes, gpn)
    if gpn != base.gpus_per_node:
        nics, gpu_nic, sw = _nodes(gpn, min(len(base.nics), gpn), base.nics[0].bandwidth_GBps)
        return base.model_copy(update=dict(num_nodes=nodes, gpus_per_node=gpn, nics=nics,
                                           gpu_nic=gpu_nic, gpu_pcie_switch=sw))
    return base.model_copy(update=dict(num_nodes=nodes))
