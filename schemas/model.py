"""ModelSpec: transformer shape and dtype; presets (LLaMA, Llama-3, GPT, tiny test models)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_serializer, model_validator

from .common import Doc, InputError

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
    #: Written only when not ``hidden``, so existing specs keep their hashes.
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


def _llama(name, h, layers, heads, kv, ffn, vocab=32000, theta=10000.0) -> ModelSpec:
    return ModelSpec(name=name, family="llama", num_layers=layers, hidden=h, num_heads=heads,
                     num_kv_heads=kv, ffn_hidden=ffn, vocab_size=vocab, rope_theta=theta)


def _gpt(name, h, layers, heads) -> ModelSpec:
    return ModelSpec(name=name, family="gpt", num_layers=layers, hidden=h, num_heads=heads,
                     num_kv_heads=heads, ffn_hidden=4 * h, vocab_size=50257, mlp="gelu")


_PRESETS = {
    "llama-3b": lambda: _llama("llama-3b", 3200, 26, 32, 32, 8640),
    "llama-7b": lambda: _llama("llama-7b", 4096, 32, 32, 32, 11008),
    "llama-13b": lambda: _llama("llama-13b", 5120, 40, 40, 40, 13824),
    "llama-30b": lambda: _llama("llama-30b", 6656, 60, 52, 52, 17920),
    "llama3-8b": lambda: _llama("llama3-8b", 4096, 32, 32, 8, 14336, vocab=128256, theta=500000.0),
    "gpt-7b": lambda: _gpt("gpt-7b", 4096, 32, 32),
    "gpt-13b": lambda: _gpt("gpt-13b", 5120, 40, 40),
    "gpt-30b": lambda: _gpt("gpt-30b", 6656, 60, 52),
    # tiny configurations for tests and CPU runs
    "tiny": lambda: ModelSpec(name="tiny", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                              ffn_hidden=176, vocab_size=256, dtype="fp32"),
    "tiny-mha": lambda: ModelSpec(name="tiny-mha", num_layers=2, hidden=64, num_heads=4, num_kv_heads=4,
                                  ffn_hidden=176, vocab_size=256, dtype="fp32"),
    "small": lambda: ModelSpec(name="small", num_layers=4, hidden=256, num_heads=8, num_kv_heads=4,
                               ffn_hidden=688, vocab_size=1024, dtype="fp32"),
}

MODEL_PRESETS = tuple(_PRESETS)


def model_preset(name: str) -> ModelSpec:
    key = name.strip().lower()
    if key not in _PRESETS:
        raise InputError(f"unknown model preset {name!r} (known: {', '.join(MODEL_PRESETS)})")
    return _PRESETS[key]()


def resolve_model_ref(ref: str) -> ModelSpec:
    """A model reference of the command line: ``hf:DIR`` (a Hugging Face ``config.json``, see
    :mod:`zeppelin.schemas.hf`), a ModelSpec JSON file, or a preset name."""
    import os

    from .common import load_doc

    if ref.startswith("hf:"):
        from .hf import hf_model_spec

        return hf_model_spec(ref)
    if ref.lower().endswith(".json") or "/" in ref or os.sep in ref:  # a bare name is always a preset
        return load_doc(ModelSpec, ref)
    return model_preset(ref)
