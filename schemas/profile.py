"""CostProfile: fitted coefficients of the cost model and where they came from.

Compute time of a kernel doing ``F`` FLOPs on a problem of size ``n`` (tokens for linear layers,
sequence length for attention) is modelled as::

    t = overhead_s + F / (peak_flops * eff_max * n / (n + n_half))

(efficiency grows with size and saturates at ``eff_max``). A measured profile may also carry
polynomial fits per model (``fits``), ``t(n) = c0 + c1*n + c2*n^2`` seconds per layer for forward
plus backward, which take precedence for the model they were fitted on.
Communication uses alpha-beta per link class: ``t = alpha_s + bytes / bandwidth``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_serializer

from .common import Doc, Strict

PROFILE_SCHEMA = "zeppelin.profile/1"


def _by_key(description: str):
    """A measured table keyed by a string (a group size, a mode, a stage): empty until measured."""
    return Field(default_factory=dict, description=description)


class KernelEfficiency(Strict):
    eff_max: float = Field(gt=0, le=1.0, description="fraction of peak reached by large problems")
    n_half: float = Field(ge=0, le=1e12, description="size at which half of eff_max is reached")
    overhead_s: float = Field(default=0.0, ge=0, le=1e3, description="fixed launch cost per call")


class LinkCost(Strict):
    alpha_s: float = Field(ge=0, le=1e3, description="latency per message, seconds")
    bandwidth_GBps: float = Field(ge=1e-3, le=1e6, description="achieved bandwidth, GB/s per direction")


class PolyFit(Strict):
    """t(n) = c0 + c1*n + c2*n^2 seconds (per layer, forward + backward)."""

    coeffs: list[float] = Field(min_length=1, max_length=3)
    valid_from: int = Field(default=0, ge=0)
    valid_to: int | None = None
    rel_error_median: float | None = None
    rel_error_max: float | None = None
    points: list[list[float]] | None = Field(
        default=None, description="the measured [n, seconds] pairs, ascending n; when present the cost model "
        "interpolates them (piecewise log-log) and uses the polynomial's shape only outside their range")


class ActivationMemory(Strict):
    """Measured activation memory of one recompute mode, bytes per token of the whole model (all
    layers and the head) on one rank: the slope over the measured lengths."""

    activations: float = Field(ge=0, le=1e12, description="what the forward keeps for the backward")
    recompute: float = Field(default=0.0, ge=0, le=1e12,
                             description="what one recomputation holds in the backward (selective/full)")
    time_factor: float | None = Field(
        default=None, ge=0, le=10, description="the time the mode adds to a micro-batch's forward and backward, as "
        "a fraction of that time without recomputation (measured by `zeppelin profile`)")

    @model_serializer(mode="wrap")
    def _omit_unmeasured_time(self, handler):
        # measured later than the bytes: left out while unmeasured, so older profiles keep their hash
        d = handler(self)
        if isinstance(d, dict) and d.get("time_factor", 0) is None:
            d.pop("time_factor")
        return d


class ModelFits(Strict):
    model: str = Field(description="model name the fits were measured for")
    dtype: str
    attention: PolyFit | None = Field(default=None, description="t(L) for one sequence of length L")
    linear: PolyFit | None = Field(default=None, description="t(T) for T tokens through all linear modules")
    tp: int = Field(default=1, ge=1, description="TP degree the fits were measured at: for tp > 1, `linear` is the "
                    "layer's compute on one rank of a TP-SP group of that size holding T tokens of the unit, "
                    "its collectives short-circuited")
    attention_block: PolyFit | None = Field(
        default=None, description="t(n) for an n x n block of one sequence whose keys all precede its queries "
        "(a ring round's off-diagonal chunk pair), forward + backward")
    head: PolyFit | None = Field(default=None, description="t(T): embedding + final norm + LM head + loss, "
                                 "once per model (not per layer)")
    optimizer_s: float | None = Field(
        default=None, ge=0, description="AdamW step over the whole model replica, seconds (measured)")
    grad_allreduce_s: dict[str, float] = _by_key(
        "all-reduce of the model's gradients by group size, seconds (keys: '2','4',...)")
    ring_attention: dict[str, PolyFit] = _by_key(
        "t(L) of the runtime's ring attention of one sequence of length L split (zigzag) over G "
        "ranks, forward + backward per layer, exchanges and their waits included, by G (keys: '2','4',...)")
    ring_compute: dict[str, PolyFit] = _by_key(
        "the same rings with their exchanges short-circuited: the ring's compute alone (blocks, "
        "log-sum-exp merges, accumulators); ring_attention minus this is what the exchanges cost")
    ring_sync_s: dict[str, float] = _by_key(
        "per ring round of G ranks (keys: '2','4',...), the time the runtime's exchanges add to the "
        "ring beyond its compute (forward and backward exchanges of the round, waits included), seconds: the "
        "median over the measured lengths of (ring_attention - ring_compute) / (G - 1)")
    remap_exchange: list[Annotated[float, Field(ge=0, le=1e3)]] | None = Field(
        default=None, min_length=2, max_length=2,
        description="[seconds, seconds per byte]: what one exchange of the runtime's remap (one direction, one "
        "pass, bytes sent per rank) adds to the compute around it, waits included; replaces the link model "
        "for remaps")
    fsdp_microbatch_s: dict[str, float] = _by_key(
        "seconds FSDP2 adds to each micro-batch of the whole model (parameter gathers, gradient "
        "reduce-scatters, their waits) on the profiled ranks, by ZeRO stage (keys: '1' for ZeRO-1 and 2, "
        "'3'); replaces the once-per-step gradient all-reduce for FSDP plans")
    linear_tp_comm: dict[str, PolyFit] = _by_key(
        "tp > 1: t(T) of the same TP-SP layer with the runtime's real collectives, by --tp-overlap "
        "mode (keys: 'none', 'slicing', 'commfuse'), forward + backward per layer; minus `linear` it is the "
        "exposed TP communication of that mode")
    activation_memory: dict[str, ActivationMemory] = _by_key(
        "measured activation bytes per token by recompute mode (keys: 'none', 'selective', 'full'); "
        "the cost model uses them instead of its analytic figures")

    @model_serializer(mode="wrap")
    def _omit_empty_ring_fits(self, handler):
        # optional fits: left out while empty, so that a profile without them keeps its content
        # hash (plans record it)
        d = handler(self)
        for key in ("ring_attention", "ring_compute", "ring_sync_s", "remap_exchange", "fsdp_microbatch_s",
                    "linear_tp_comm", "activation_memory"):
            if not d.get(key):
                d.pop(key, None)
        return d


class StepTimeCheck(Strict):
    """How far this profile's predicted step times were from measured ones: a few steps planned
    with the profile and run on the machine it measured (``zeppelin profile`` runs them)."""

    steps: int = Field(ge=1, le=10**6, description="steps compared (the warm-up step left out)")
    median_error: float = Field(ge=-1.0, le=1e3, description="median of measured / predicted - 1 (signed)")
    worst_error: float = Field(ge=0.0, le=1e3, description="largest |measured / predicted - 1|")
    plan: str = Field(default="", max_length=500, description="what was planned and run")


class ProfileSource(Strict):
    kind: Literal["preset", "measured"] = "preset"
    machine: str = ""
    created_at: str = ""
    notes: str = ""
    step_time_check: StepTimeCheck | None = Field(
        default=None, description="measured vs predicted step times of a short run under this profile")

    @model_serializer(mode="wrap")
    def _omit_no_check(self, handler):
        # left out while absent, so that profiles written before it keep their content hash
        d = handler(self)
        if d.get("step_time_check") is None:
            d.pop("step_time_check", None)
        return d


class CostProfile(Doc):
    schema_version: Literal["zeppelin.profile/1"] = PROFILE_SCHEMA
    source: ProfileSource = ProfileSource()
    cluster: str = Field(default="", description="cluster name this profile describes")
    peak_tflops: float | None = Field(default=None, ge=1e-6, le=1e6, description="overrides the cluster's GPU peak")
    linear: KernelEfficiency = KernelEfficiency(eff_max=0.75, n_half=512.0, overhead_s=20e-6)
    attention: KernelEfficiency = KernelEfficiency(eff_max=0.55, n_half=1024.0, overhead_s=30e-6)
    attention_block: KernelEfficiency | None = Field(
        default=None,
        description="efficiency of an attention block with every key visible (a ring round's chunk pair), "
        "size = the block's geometric-mean side; None: the causal whole-sequence curve `attention`")
    backward_linear_factor: float = Field(default=2.0, gt=0, le=1e3, description="linear backward / forward")
    backward_attention_factor: float = Field(default=2.5, gt=0, le=1e3, description="attention backward / forward")
    intra: LinkCost | None = Field(default=None, description="GPU<->GPU inside a node; default from cluster")
    inter: LinkCost | None = Field(default=None, description="per NIC across nodes; default from cluster")
    alltoall_efficiency: dict[str, float] = Field(
        default_factory=dict, description="achieved fraction of link bandwidth by group size (keys: '2','4',...)"
    )
    nic_shared_by_concurrent_transfers: bool = True
    activation_bytes_per_token_layer: float | None = Field(
        default=None, gt=0, le=1e12, description="activation memory per token per layer; default from the model"
    )
    memory_reserved_gb: float = Field(default=4.0, ge=0, le=1e5, description="framework/workspace reserve per GPU")
    optimizer_s_per_param: float | None = Field(
        default=None, ge=0, le=1.0,
        description="AdamW step time per parameter (measured); None: the optimizer step is not modelled")
    fits: list[ModelFits] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_unset_block_curve(self, handler):
        # optional curve: left out while unset, so that a profile without it keeps its content hash
        # (plans record it)
        d = handler(self)
        if d.get("attention_block", 0) is None:
            d.pop("attention_block")
        return d

    def fits_for(self, model: str, dtype: str, tp: int = 1) -> ModelFits | None:
        for f in self.fits:
            if f.model == model and f.dtype == dtype and f.tp == tp:
                return f
        return None


def default_profile(cluster_name: str = "", device: str = "cuda") -> CostProfile:
    """Preset efficiency curves (before `zeppelin profile` has measured the machine)."""
    if device == "cpu":
        return CostProfile(
            cluster=cluster_name,
            source=ProfileSource(kind="preset", notes="CPU defaults; run `zeppelin profile` to measure"),
            linear=KernelEfficiency(eff_max=1.0, n_half=64.0, overhead_s=50e-6),
            attention=KernelEfficiency(eff_max=1.0, n_half=128.0, overhead_s=80e-6),
            memory_reserved_gb=0.5,
        )
    # GPU attention kernels (FlashAttention-2 class): a causal whole-sequence kernel wastes part of
    # its tiles on the mask and reaches half its top efficiency near 1K tokens; a block with every key
    # visible (ring rounds) saturates several times sooner (FlashAttention-2 paper, fwd+bwd at head
    # dim 128: non-causal ~95% of its top speed from 4K tokens, causal ~85-90%)
    return CostProfile(cluster=cluster_name, source=ProfileSource(kind="preset"),
                       attention_block=KernelEfficiency(eff_max=0.55, n_half=256.0, overhead_s=30e-6))


#: measured profiles shipped with the package (``--profile NAME``): a device's kernels as
#: `zeppelin profile` measured them there, the file in schemas/data/ (``source`` says where and when)
MEASURED_PROFILES = {"h200-measured": "profile-h200-measured.json"}


def measured_profile(name: str) -> CostProfile:
    """The shipped measured profile ``name`` (one of :data:`MEASURED_PROFILES`)."""
    from pathlib import Path

    path = Path(__file__).resolve().parent / "data" / MEASURED_PROFILES[name]
    return CostProfile.model_validate_json(path.read_text())
