"""The analytic cost model (docs/DESIGN.md, "Cost model"), vectorised over arrays of lengths.

All times are seconds, sizes are tokens, bytes are bytes. Per-layer quantities are for one
transformer layer; ``*_model`` helpers multiply by the number of layers and add embeddings and the
LM head. A *unit* is one data-parallel replica of ``tp`` GPUs (``tp == 1``: one GPU).

Formulas (h hidden, g KV heads, d head dim, f FFN, m = 3 for SwiGLU / 2 for GELU):

* linear FLOPs, forward, per layer:   2 * T * (h*(h + 2*g*d) + h*h + m*h*f)
* attention FLOPs, forward, causal:   2 * L^2 * h          (QK^T and PV, half masked)
* with a sliding window w:            4 * (L*w - w^2/2) * h once L > w (the visible pairs); a
  model mixing window and full layers: the mean over its layer types, so ``num_layers x`` a
  per-layer time is their sum; rings priced block by block (:meth:`CostModel.ring_window_rounds`)
* mixture of experts: linear FLOPs of the active experts (top-k + shared), memory of all of them
* backward = ``backward_linear_factor`` (2.0) / ``backward_attention_factor`` (2.5) x forward
* kernel time = overhead + FLOPs / (peak * eff_max * n / (n + n_half))
* link time   = alpha + bytes / bandwidth

The formulas live in four parts, one mixin each, that :class:`CostModel` (the facade every caller
imports) puts together: :mod:`~zeppelin.planner.costmodel.compute` (kernel FLOPs and times, ring
rounds' compute), :mod:`~zeppelin.planner.costmodel.comm` (links, rings' exchanges, all-to-alls,
remap, data- and tensor-parallel collectives), :mod:`~zeppelin.planner.costmodel.memory` (peak
bytes per GPU by component) and :mod:`~zeppelin.planner.costmodel.recompute` (the memory and time
of each recomputation choice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from zeppelin.planner.costmodel.comm import CommCosts
from zeppelin.planner.costmodel.compute import (
    ComputeCosts,
    as_array,
    causal_prefix,
    eval_fit,
    ring_position_ranges,
    window_pairs,
    window_pairs_between,
)
from zeppelin.planner.costmodel.memory import MemoryCosts
from zeppelin.planner.costmodel.recompute import RecomputeCosts
from zeppelin.schemas.cluster import ClusterSpec
from zeppelin.schemas.model import ModelSpec
from zeppelin.schemas.profile import CostProfile, default_profile

__all__ = [
    "CostModel",
    "as_array",
    "causal_prefix",
    "eval_fit",
    "ring_position_ranges",
    "window_pairs",
    "window_pairs_between",
]


@dataclass
class CostModel(ComputeCosts, CommCosts, MemoryCosts, RecomputeCosts):
    """The cost model of one unit (``tp`` GPUs) of a cluster running a model, priced from a profile."""

    cluster: ClusterSpec
    model: ModelSpec
    profile: CostProfile = field(default=None)  # type: ignore[assignment]
    tp: int = 1
    zero_stage: int = 1
    tp_overlap: str = "none"
    recompute: str = "none"
    _rounds_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.profile is None:
            self.profile = default_profile(self.cluster.name, self.cluster.device)
        if self.tp < 1 or self.cluster.gpus_per_node % self.tp:
            raise ValueError(f"tp={self.tp} must divide gpus_per_node={self.cluster.gpus_per_node}")

    # ---------------------------------------------------------------- units and the profile's fits
    @property
    def num_units(self) -> int:
        return self.cluster.world_size // self.tp

    @property
    def units_per_node(self) -> int:
        return self.cluster.gpus_per_node // self.tp

    def node_of_unit(self, unit: int) -> int:
        return unit // self.units_per_node

    @cached_property
    def _fits(self):
        return self.profile.fits_for(self.model.name, self.model.dtype, self.tp)

    @cached_property
    def _fits_tp1(self):
        """The profiled model's TP=1 fits (for a TP unit: what it is derived from where the profile
        has no fit of the unit's own TP degree)."""
        return self.profile.fits_for(self.model.name, self.model.dtype, 1)
