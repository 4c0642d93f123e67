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

    @model_serializer(mode="wrap")
    def _drop_default_remap_payload(self, handler):
        data = handler(self)
        if self.remap_payload == "hidden":
            data.pop("remap_payload", None)
        return data

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:  # rotary embeddings rotate pairs of channels
            raise ValueError(f"head_dim = hidden / num_heads = {self.head_dim} must be even (rotary embeddings "
                             f"rotate pairs of channels)")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def remap_widths(self) -> tuple[int, int]:
        """Values per token the remap moves (to the attention layout, back to the linear layout)."""
        if self.remap_payload == "qkv":
            return self.hidden + 2 * self.kv_dim, self.hidden
        return self.hidden, self.hidden

    def params_per_layer(self) -> int:
        h, f = self.hidden, self.ffn_hidden
        attn = h * (h + 2 * self.kv_dim) + h * h
        mlp = (3 if self.mlp == "swiglu" else 2) * h * f
        return attn + mlp + 2 * h  # + two norms

    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden
        return self.num_layers * self.params_per_layer() + emb + head + self.hidden
