"""Hugging Face model directories as model references: ``hf:DIR``.

``DIR`` holds a transformers ``config.json`` (and optionally ``*.safetensors`` weights) of a
Llama-family decoder. :func:`hf_model_spec` reads the config (plain JSON, no code, no network) into
the :class:`~zeppelin.schemas.model_spec.ModelSpec` the planner sizes, so ``zeppelin plan --model hf:DIR``
and ``zeppelin run --model hf:DIR`` agree on one model. The spec's ``name`` carries the model type
and a digest of the config's architecture fields, so a run with another DIR whose shape happens to
match but whose config differs (biases, rope scaling, ...) is refused by the plan's model hash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import InputError, content_hash, parse_json, read_input_bytes
from .model_spec import ModelSpec

HF_PREFIX = "hf:"

#: transformers ``model_type`` values the runtime runs (Llama-family decoders)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# config keys that do not change the computation (left out of the name digest)
_NON_ARCH_KEYS = {"transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype",
                  "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "_attn_implementation",
                  "output_attentions", "output_hidden_states", "return_dict"}


def is_hf_ref(ref: str | None) -> bool:
    return isinstance(ref, str) and ref.startswith(HF_PREFIX)


def hf_dir(ref: str) -> Path:
    """The directory of an ``hf:DIR`` reference (checked to hold a ``config.json``)."""
    d = Path(ref[len(HF_PREFIX):]).expanduser()
    if not d.is_dir():
        raise InputError(f"--model {ref}: {d} is not a directory (hf:DIR names a directory with config.json)")
    if not (d / "config.json").is_file():
        raise InputError(f"--model {ref}: no config.json in {d}")
    return d


def read_hf_config(d: Path) -> dict[str, Any]:
    path = d / "config.json"
    cfg = parse_json(read_input_bytes(path, "config.json"), source=path)  # a regular file, bounded JSON
    if not isinstance(cfg, dict):
        raise InputError("config.json is not a JSON object", source=path)
    return cfg


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """The effective sliding-window size of a config (None: full causal attention)."""
    if cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window", False):
        return None
    w = cfg.get("sliding_window")
    return int(w) if isinstance(w, int) and w > 0 else None


def hf_model_spec(ref: str) -> ModelSpec:
    """``ModelSpec`` of the model in ``hf:DIR`` (refuses configs the runtime cannot run exactly)."""
    d = hf_dir(ref)
    cfg = read_hf_config(d)
    src = d / "config.json"
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise InputError(f"model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})",
                         source=src)

    def need(key: str) -> int:
        v = cfg.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"config.json needs a positive integer {key!r} (got {v!r})", source=src)
        return v

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    if not isinstance(kv, int) or kv < 1:
        raise InputError(f"config.json has a bad num_key_value_heads {kv!r}", source=src)
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise InputError(f"head_dim {head_dim} x {heads} heads != hidden_size {hidden}: the runtime needs "
                         "head_dim = hidden_size / num_attention_heads", source=src)
    if cfg.get("hidden_act", "silu") != "silu":
        raise InputError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (SwiGLU with silu only)",
                         source=src)
    w = sliding_window(cfg)
    if w is not None:
        raise InputError(f"sliding-window attention (sliding_window={w}) is not supported; set it to null",
                         source=src)
    dt = cfg.get("dtype", cfg.get("torch_dtype")) or "float32"
    if dt not in _DTYPES:
        raise InputError(f"dtype {dt!r} is not one of {', '.join(_DTYPES)}", source=src)
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(cfg.get("rope_parameters"), dict):
        theta = cfg["rope_parameters"].get("rope_theta")
    arch = {k: v for k, v in sorted(cfg.items()) if k not in _NON_ARCH_KEYS}
    digest = content_hash(arch).split(":")[-1][:10]
    try:
        return ModelSpec(
            name=f"hf-{mt}-{digest}", family="llama", num_layers=need("num_hidden_layers"), hidden=hidden,
            num_heads=heads, num_kv_heads=kv, ffn_hidden=need("intermediate_size"),
            vocab_size=need("vocab_size"), mlp="swiglu", dtype=_DTYPES[dt],
            rope_theta=float(theta if theta is not None else 10000.0),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), remap_payload="qkv")
    except ValueError as e:  # pydantic validation (divisibility, ...)
        msg = str(e).splitlines()
        raise InputError(f"config.json does not describe a supported decoder: {msg[-1].strip() if msg else e}",
                         source=src) from None
