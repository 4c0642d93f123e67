"""Model references: presets (LLaMA, Llama-3, GPT, tiny test models), ModelSpec JSON files and
``hf:DIR`` Hugging Face directories, resolved to a :class:`ModelSpec` (defined in
:mod:`zeppelin.schemas.model_spec`, re-exported here)."""

from __future__ import annotations

from .common import InputError
from .model_spec import DTYPE_BYTES, MODEL_SCHEMA, ModelSpec

__all__ = ["DTYPE_BYTES", "MODEL_PRESETS", "MODEL_SCHEMA", "ModelSpec", "model_preset", "resolve_model_ref"]


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
    # Llama-3.2-1B's shapes (the model the h200-measured profile measured)
    "llama3.2-1b": lambda: _llama("llama3.2-1b", 2048, 16, 32, 8, 8192, vocab=128256, theta=500000.0).model_copy(
        update={"tie_embeddings": True}),
    # Mistral 7B: Llama-3-like GQA with a 4096-token sliding window on every layer
    "mistral-7b": lambda: _llama("mistral-7b", 4096, 32, 32, 8, 14336).model_copy(
        update={"sliding_window": 4096}),
    "qwen3-8b": lambda: _llama("qwen3-8b", 4096, 36, 32, 8, 12288, vocab=151936, theta=1e6).model_copy(
        update={"qk_norm": True, "norm_eps": 1e-6}),
    # Qwen2.5-3B: 16 query heads over 2 KV heads (Ulysses past 2 ranks replicates K/V heads)
    "qwen2.5-3b": lambda: _llama("qwen2.5-3b", 2048, 36, 16, 2, 11008, vocab=151936, theta=1e6).model_copy(
        update={"norm_eps": 1e-6, "tie_embeddings": True}),
    # mixture of experts: memory holds every expert, a token runs top-k of them
    "qwen3-30b-a3b": lambda: _llama("qwen3-30b-a3b", 2048, 48, 32, 4, 768, vocab=151936, theta=1e6).model_copy(
        update={"qk_norm": True, "norm_eps": 1e-6, "head_size": 128, "num_experts": 128, "experts_per_token": 8,
                "expert_ffn_hidden": 768}),
    "mixtral-8x7b": lambda: _llama("mixtral-8x7b", 4096, 32, 32, 8, 14336, theta=1e6).model_copy(
        update={"num_experts": 8, "experts_per_token": 2, "expert_ffn_hidden": 14336}),
    "gpt-7b": lambda: _gpt("gpt-7b", 4096, 32, 32),
    "gpt-13b": lambda: _gpt("gpt-13b", 5120, 40, 40),
    "gpt-30b": lambda: _gpt("gpt-30b", 6656, 60, 52),
    # tiny configurations for tests and CPU runs
    "tiny": lambda: ModelSpec(name="tiny", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                              ffn_hidden=176, vocab_size=256, dtype="fp32"),
    "tiny-mha": lambda: ModelSpec(name="tiny-mha", num_layers=2, hidden=64, num_heads=4, num_kv_heads=4,
                                  ffn_hidden=176, vocab_size=256, dtype="fp32"),
    "tiny-window": lambda: ModelSpec(name="tiny-window", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                                     ffn_hidden=176, vocab_size=256, dtype="fp32", sliding_window=64),
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

    from .io.documents import load_doc

    if ref.startswith("hf:"):
        from .hf import hf_model_spec

        return hf_model_spec(ref)
    if os.path.isdir(ref):
        hint = f"; did you mean hf:{ref}?" if os.path.isfile(os.path.join(ref, "config.json")) else ""
        raise InputError(f"model {ref!r} is a directory: a Hugging Face model directory is named hf:DIR{hint}")
    if ref.lower().endswith(".json") or "/" in ref or os.sep in ref:  # a bare name is always a preset
        return load_doc(ModelSpec, ref)
    return model_preset(ref)
