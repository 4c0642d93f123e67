"""ModelSpec: the transformer's shape and dtype, as the planner sizes it and the runtime builds it.

A module of its own so that :mod:`zeppelin.schemas.hf` (which turns a Hugging Face config into a
ModelSpec) and :mod:`zeppelin.schemas.model` (which resolves ``hf:DIR`` references through it)
depend one way: ``model -> hf -> model_spec``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_serializer, model_validator

from .common import Doc

MODEL_SCHEMA = "zeppelin.model/1"

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


#: optional fields and their defaults (left out of a spec's JSON when at the default)
_OPTIONAL_DEFAULTS = {"head_size": None, "sliding_window": None, "layer_types": None, "qk_norm": False,
                      "num_experts": 0, "experts_per_token": 0, "expert_ffn_hidden": 0,
                      "shared_expert_ffn_hidden": 0}


class ModelSpec(Doc):
    schema_version: Literal["zeppelin.model/1"] = MODEL_SCHEMA
    name: str = Field(min_length=1)
    family: Literal["llama", "gpt"] = "llama"
    num_layers: int = Field(ge=1, le=1024)
    hidden: int = Field(ge=1, le=131072)
    num_heads: int = Field(ge=1, le=1024)
    num_kv_heads: int = Field(ge=1, le=1024)
    ffn_hidden: int = Field(ge=1, le=1 << 20)
    vocab_size: int = Field(ge=2, le=1 << 24)
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    rope_theta: float = Field(default=10000.0, gt=0, le=1e12)
    norm_eps: float = Field(default=1e-5, gt=0, le=1.0)
    tie_embeddings: bool = False
    #: what the linear <-> attention remap carries per token: ``hidden`` (the runtime's own model
    #: remaps the normed hidden states; the result of attention's O projection comes back) or ``qkv``
    #: (Hugging Face models: Q, K and V go to the attention layout, the attention output comes back).
    #: Written only when not ``hidden``, so that a spec without it keeps its content hash.
    remap_payload: Literal["hidden", "qkv"] = "hidden"
    #: attention head size when it is not ``hidden / num_heads`` (Qwen3 and others project to
    #: ``num_heads * head_size`` channels); None: ``hidden / num_heads``.
    head_size: int | None = Field(default=None, ge=2, le=1024)
    #: sliding-window attention: a query sees the ``sliding_window`` keys ending at its own position
    #: (transformers' ``kv_idx > q_idx - sliding_window``); None: full causal attention.
    sliding_window: int | None = Field(default=None, ge=1, le=1 << 30)
    #: per-layer attention of a model mixing window and full layers (``"sliding_attention"`` /
    #: ``"full_attention"``, transformers' ``layer_types``); None with a window: every layer windowed.
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    #: RMS norms on queries and keys per head (Qwen3): their parameters and activations.
    qk_norm: bool = False
    #: mixture of experts: routed experts per MoE layer (0: dense MLP), experts each token runs
    #: (top-k), an expert's FFN width, and the always-on shared expert's width (0: none).
    num_experts: int = Field(default=0, ge=0, le=4096)
    experts_per_token: int = Field(default=0, ge=0, le=4096)
    expert_ffn_hidden: int = Field(default=0, ge=0, le=1 << 20)
    shared_expert_ffn_hidden: int = Field(default=0, ge=0, le=1 << 20)

    @model_serializer(mode="wrap")
    def _drop_defaults(self, handler):
        """Fields written only when set, so that a spec without them keeps its content hash (and
        every plan made before them its bytes)."""
        data = handler(self)
        if self.remap_payload == "hidden":
            data.pop("remap_payload", None)
        for key, default in _OPTIONAL_DEFAULTS.items():
            if key in data and data[key] == default:
                data.pop(key)
        return data

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.head_size is None and self.hidden % self.num_heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_layers}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(f"experts_per_token ({self.experts_per_token}) must be in 1..num_experts "
                                 f"({self.num_experts})")
            if self.expert_ffn_hidden < 1:
                raise ValueError("a mixture-of-experts model needs expert_ffn_hidden >= 1")
        elif self.experts_per_token or self.expert_ffn_hidden or self.shared_expert_ffn_hidden:
            raise ValueError("experts_per_token / expert_ffn_hidden / shared_expert_ffn_hidden need num_experts >= 1")
        if self.head_dim % 2:  # rotary embeddings rotate pairs of channels
            raise ValueError(f"head_dim = hidden / num_heads = {self.head_dim} must be even (rotary embeddings "
                             f"rotate pairs of channels)")
        return self

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.hidden // self.num_heads

    @property
    def q_dim(self) -> int:
        """Channels of the queries (and of the attention output): ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    # ------------------------------------------------------------------ attention pattern
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: full causal attention)."""
        if self.sliding_window is None:
            return (None,) * self.num_layers
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    def window_counts(self) -> dict[int | None, int]:
        """Layers per attention window (None: full attention), the cost model's layer types."""
        out: dict[int | None, int] = {}
        for w in self.layer_windows():
            out[w] = out.get(w, 0) + 1
        return out

    def attention_pattern(self) -> str:
        """One line naming the attention the model runs (plans record it; ``run`` compares it)."""
        counts = self.window_counts()
        if set(counts) == {None}:
            return "full causal"
        w = self.sliding_window
        if None not in counts:
            return f"sliding window {w}"
        pattern = "".join("W" if x else "F" for x in self.layer_windows())
        return f"sliding window {w} on {counts[w]} of {self.num_layers} layers ({pattern})"

    # ------------------------------------------------------------------ mixture of experts
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def mlp_ffn_params(self, active: bool) -> int:
        """FFN widths whose weights an MLP layer holds (``active=False``) or a token runs through
        (``active=True``): all experts, or the top-k, plus the shared expert."""
        if not self.is_moe:
            return self.ffn_hidden
        n = self.experts_per_token if active else self.num_experts
        return n * self.expert_ffn_hidden + self.shared_expert_ffn_hidden

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def tp_splits_heads(self, tp: int) -> bool:
        """Whether a tensor-parallel degree ``tp`` splits both the query and the key/value heads
        evenly (the only degrees the runtime shards the attention projections over)."""
        return tp >= 1 and self.num_heads % tp == 0 and self.num_kv_heads % tp == 0

    def remap_widths(self) -> tuple[int, int]:
        """Values per token the remap moves (to the attention layout, back to the linear layout)."""
        if self.remap_payload == "qkv":
            return self.q_dim + 2 * self.kv_dim, self.q_dim
        return self.hidden, self.hidden

    def params_per_layer(self) -> int:
        """Parameters of one layer (every expert of an MoE layer, its router included)."""
        h = self.hidden
        attn = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        mlp = (3 if self.mlp == "swiglu" else 2) * h * self.mlp_ffn_params(active=False)
        if self.is_moe:
            mlp += h * self.num_experts + (h if self.shared_expert_ffn_hidden else 0)  # routers (+ shared gate)
        qk = 2 * self.head_dim if self.qk_norm else 0
        return attn + mlp + 2 * h + qk  # + two norms

    def active_params(self) -> int:
        """Parameters one token runs through: :meth:`num_params` with only the top-k experts (and the
        shared expert) of each MoE layer; all of them for a dense model."""
        idle = self.mlp_ffn_params(active=False) - self.mlp_ffn_params(active=True)
        return self.num_params() - self.num_layers * (3 if self.mlp == "swiglu" else 2) * self.hidden * idle

    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden
        return self.num_layers * self.params_per_layer() + emb + head + self.hidden
