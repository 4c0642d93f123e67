"""Hugging Face model directories as model references: ``hf:DIR``.

``DIR`` holds a transformers ``config.json`` (and optionally ``*.safetensors`` weights) of a
Llama-family decoder: Llama, Mistral and Qwen2 (sliding windows included), Qwen3, and the
mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE. :func:`hf_model_spec` reads the config (plain JSON, no code, no network) into
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

#: transformers ``model_type`` values the runtime runs (Llama-family decoders, dense and MoE)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")

#: model types whose ``sliding_window`` applies only with ``use_sliding_window`` (and then to the
#: layers ``layer_types`` names, by default those from ``max_window_layers`` on)
_USE_SLIDING = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
#: per-head RMS norms on queries and keys
_QK_NORM = ("qwen3", "qwen3_moe")
#: transformers' default head size where the config may leave it out (else hidden / heads)
_HEAD_DIM_DEFAULT = {"qwen3": 128, "qwen3_moe": 128}
_LAYER_TYPES = ("full_attention", "sliding_attention")

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
    if cfg.get("model_type") in _USE_SLIDING and not cfg.get("use_sliding_window", False):
        return None
    w = cfg.get("sliding_window")
    return int(w) if isinstance(w, int) and not isinstance(w, bool) and w > 0 else None


def _layer_types(cfg: dict[str, Any], window: int | None, layers: int, src) -> list[str] | None:
    """Per-layer attention as transformers builds it (None: every layer alike)."""
    if window is None:
        return None
    lt = cfg.get("layer_types")
    if lt is None and cfg.get("model_type") in _USE_SLIDING:
        mwl = cfg.get("max_window_layers", 28)
        if not isinstance(mwl, int) or isinstance(mwl, bool) or mwl < 0:
            raise InputError(f"config.json has a bad max_window_layers {mwl!r}", source=src)
        lt = ["sliding_attention" if i >= mwl else "full_attention" for i in range(layers)]
    if lt is None:
        return None
    if not isinstance(lt, list) or len(lt) != layers or any(t not in _LAYER_TYPES for t in lt):
        raise InputError(f"layer_types must list {layers} of {', '.join(_LAYER_TYPES)}", source=src)
    if all(t == "sliding_attention" for t in lt):
        return None
    return list(lt)


def _moe_fields(cfg: dict[str, Any], mt: str, need, src) -> dict[str, int]:
    """ModelSpec's mixture-of-experts fields of an MoE config (refusing what the runtime does not run)."""
    if mt not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return {}
    # transformers writes the expert count under either name (its attribute_map aliases them)
    experts_key = "num_local_experts" if "num_local_experts" in cfg or mt == "mixtral" else "num_experts"
    if "num_experts" in cfg and "num_local_experts" not in cfg:
        experts_key = "num_experts"
    if mt == "mixtral":
        return {"num_experts": need(experts_key), "experts_per_token": need("num_experts_per_tok"),
                "expert_ffn_hidden": need("intermediate_size")}
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers") not in (None, []):
        raise InputError("decoder_sparse_step != 1 / mlp_only_layers (dense layers between MoE layers) are not "
                         "supported: every layer must be an MoE layer", source=src)
    out = {"num_experts": need(experts_key), "experts_per_token": need("num_experts_per_tok"),
           "expert_ffn_hidden": need("moe_intermediate_size")}
    if mt == "qwen2_moe":
        out["shared_expert_ffn_hidden"] = need("shared_expert_intermediate_size")
    return out


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
    head_dim = cfg.get("head_dim", _HEAD_DIM_DEFAULT.get(mt))
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2
                                 or head_dim % 2):
        raise InputError(f"config.json has a bad head_dim {head_dim!r} (an even integer >= 2)", source=src)
    head_size = head_dim if head_dim is not None and head_dim * heads != hidden else None
    if cfg.get("hidden_act", "silu") != "silu":
        raise InputError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (SwiGLU with silu only)",
                         source=src)
    w = sliding_window(cfg)
    layers = need("num_hidden_layers")
    layer_types = _layer_types(cfg, w, layers, src)
    if w is not None and layer_types is not None and "sliding_attention" not in layer_types:
        w = None  # every layer full: transformers never applies the window
    moe = _moe_fields(cfg, mt, need, src)
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
            name=f"hf-{mt}-{digest}", family="llama", num_layers=layers, hidden=hidden,
            num_heads=heads, num_kv_heads=kv, ffn_hidden=need("intermediate_size"),
            vocab_size=need("vocab_size"), mlp="swiglu", dtype=_DTYPES[dt],
            rope_theta=float(theta if theta is not None else 10000.0),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), remap_payload="qkv",
            head_size=head_size, sliding_window=w, layer_types=layer_types if w is not None else None,
            qk_norm=mt in _QK_NORM, **moe)
    except ValueError as e:  # pydantic validation (divisibility, ...)
        msg = str(e).splitlines()
        raise InputError(f"config.json does not describe a supported decoder: {msg[-1].strip() if msg else e}",
                         source=src) from None
