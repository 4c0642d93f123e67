"""Activation recomputation as a choice per micro-batch: the memory and the extra time of each
choice. A mixin of :class:`~zeppelin.planner.costmodel.cost.CostModel`.

The choices (``MicroBatch.recompute``; docs/RUNTIME.md, "Activation recomputation"):

* ``none``       every activation is kept;
* ``selective``  each block's MLP is recomputed in the backward (its forward runs twice);
* ``full``       each block keeps its input only and runs its whole forward again in the backward;
* ``full:k``     ``full`` on the first ``k`` of the ``L`` layers, ``none`` on the others.

A cost model built for one global mode (``recompute``) prices that mode; one built for
``per-microbatch`` prices ``none`` by default and every choice through the functions here. The
lower bound of a step stays the work without recomputation, in the fewest micro-batches ``full``'s
capacity allows where the micro-batches choose.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from zeppelin.planner.costmodel.compute import as_array
from zeppelin.schemas.plan import PER_MICROBATCH, parse_recompute


class RecomputeCosts:
    """Memory and time of each recomputation choice (see the module's docstring)."""

    @property
    def chooses_recompute(self) -> bool:
        """Whether the micro-batches choose their own recomputation (``per-microbatch``, ``auto``)."""
        return self.recompute in (PER_MICROBATCH, "auto")

    @property
    def global_recompute(self) -> str:
        """The mode of the micro-batches that name none: the plan's global mode (``none`` for a
        plan whose micro-batches each say their own, and for ``--recompute auto`` until a planner
        chooses)."""
        return "none" if self.chooses_recompute else self.recompute

    def for_recompute(self, mode: str):
        """The cost model of this unit under the global ``mode`` (built once per mode)."""
        if mode == self.recompute:
            return self
        cache = self.__dict__.setdefault("_by_recompute", {})
        if mode not in cache:
            cache[mode] = dataclasses.replace(self, recompute=mode)
        return cache[mode]

    def recompute_split(self, mode: str | None) -> tuple[float, float]:
        """Bytes per token (kept by the forward, held by one recomputation in the backward) of one
        choice (None: :attr:`global_recompute`). ``full:k``: the first ``k`` layers keep their
        input only, the others all their parts; one recomputed layer is held at a time."""
        mode = self.global_recompute if mode is None else mode
        kind, k = parse_recompute(mode)
        if k is None:
            return self.for_recompute(kind).activation_split
        act_none, _ = self.for_recompute("none").activation_split
        act_full, rec_full = self.for_recompute("full").activation_split
        L = self.model.num_layers
        # per layer, the forward keeps (act_none - head) / L without recomputation and
        # (act_full - head) / L with it; the head's share is the same in both
        return act_none - k * (act_none - act_full) / L, rec_full

    def overshoot_layers(self, x) -> np.ndarray:
        """For units holding ``x`` times the tokens they may hold without recomputation, the share
        of the layers that the fewest-layer ``full:k`` under which they fit recomputes (0 where
        ``x <= 1``; above 1 where not even ``full`` fits): what the choice per unit
        (planner/zeppelin/recompute.py) gives such a unit, as a planner prices it."""
        x = as_array(x)
        act_none, _ = self.recompute_split("none")
        act_full, rec_full = self.for_recompute("full").activation_split
        L = self.model.num_layers
        need = (act_none * (1.0 - 1.0 / np.maximum(x, 1.0)) + rec_full) / max(act_none - act_full, 1e-30)
        return np.where(x > 1.0, np.ceil(need * L - 1e-9) / L, 0.0)

    def recompute_bytes_per_token(self, mode: str | None) -> float:
        act, rec = self.recompute_split(mode)
        return act + rec + self.loss_extra_bytes(rec)

    def recompute_capacity(self, mode: str | None) -> int:
        """Tokens one GPU can hold for activations under ``mode`` (:attr:`token_capacity` of it)."""
        cache = self.__dict__.setdefault("_capacity_by_recompute", {})
        if mode not in cache:
            free = self.gpu_capacity_bytes - self.model_state_bytes()
            cache[mode] = max(int(free / self.recompute_bytes_per_token(mode)), 0)
        return cache[mode]

    def recompute_layout_tokens(self, tokens, ulysses_tokens, mode: str | None) -> float:
        """Token-equivalents under ``mode`` of ``tokens`` held, ``ulysses_tokens`` of them in Ulysses
        groups (each member's extra copies counted on top): what :meth:`recompute_capacity` bounds."""
        if not ulysses_tokens:
            return float(tokens)
        extra = sum(self.ulysses_extra_split) / self.recompute_bytes_per_token(mode)
        return float(tokens) + float(ulysses_tokens) * extra

    def recompute_memory_bytes(self, tokens_held, mode: str | None) -> np.ndarray:
        """Predicted peak bytes of one GPU holding ``tokens_held`` tokens under ``mode``."""
        return self.model_state_bytes() + as_array(tokens_held) * self.recompute_bytes_per_token(mode)

    def recompute_memory_components(self, tokens_held, mode: str | None) -> dict[str, np.ndarray]:
        """:meth:`memory_components` under ``mode``."""
        T = as_array(tokens_held)
        act, rec = self.recompute_split(mode)
        out = {k: np.full_like(T, v) for k, v in self.model_state_components().items()}
        out["activations"] = T * act
        out["recompute"] = np.where(T > 0, T * rec, 0.0)
        out["loss"] = np.where(T > 0, T * self.loss_extra_bytes(rec), 0.0)
        return out

    def mlp_flops_share(self) -> float:
        """The MLP's share of a layer's linear forward FLOPs (what ``selective`` runs again)."""
        m = self.model
        mlp = 2.0 * self._mlp_mult * m.hidden * m.mlp_ffn_params(active=True)
        return min(mlp / self.linear_flops_per_token, 1.0)

    def recompute_extra_time(self, mode: str | None, attn_s, lin_s) -> np.ndarray:
        """Extra time of ``mode`` for units whose micro-batch takes ``attn_s`` (attention, every
        layer, forward and backward) and ``lin_s`` (linear modules of every layer, forward and
        backward; the head excluded): the forward it runs again. A profile that measured the
        mode's time (``activation_memory[mode].time_factor``) gives its fraction of the
        no-recompute time instead."""
        mode = self.global_recompute if mode is None else mode
        kind, k = parse_recompute(mode)
        attn, lin = as_array(attn_s), as_array(lin_s)
        if kind == "none":
            return np.zeros_like(attn + lin)
        f = self._fits
        got = f.activation_memory.get(kind) if f is not None else None
        if got is not None and got.time_factor is not None:
            frac = got.time_factor * (attn + lin)
        elif kind == "selective":
            frac = lin * self.mlp_flops_share() / (1.0 + self.profile.backward_linear_factor)
        else:
            frac = (attn / (1.0 + self.profile.backward_attention_factor)
                    + lin / (1.0 + self.profile.backward_linear_factor))
        return frac if k is None else frac * (k / self.model.num_layers)
