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

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .common import InputError, content_hash, format_validation_error
from .io.documents import MAX_DOC_BYTES, parse_json
from .io.safefiles import note_input, read_small, stat_regular
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
    raw = ref[len(HF_PREFIX):]
    if not raw:
        raise InputError(f"--model {ref}: hf: needs a directory (hf:DIR names a directory with config.json)")
    try:
        d = Path(raw).expanduser()
    except RuntimeError:  # ~user of an unknown user
        raise InputError(f"--model {ref}: cannot expand {raw.split('/')[0]!r} (no such user)") from None
    try:
        is_dir = d.is_dir()
    except OSError as e:
        raise InputError(f"--model {ref}: cannot read {d} ({e.strerror or e.__class__.__name__})") from None
    if not is_dir:
        raise InputError(f"--model {ref}: {d} is not a directory (hf:DIR names a directory with config.json)")
    if not os.path.lexists(d / "config.json"):
        raise InputError(f"--model {ref}: no config.json in {d}")
    return d


#: names of weight files (any of them present means the model has weights); only safetensors are read
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def hf_weight_files(d: Path) -> list[Path]:
    """The ``*.safetensors`` weight files of a Hugging Face directory, each checked to be a regular
    file. Weights that are present but unusable are an error - a dangling link, a device, a
    directory, or weights only in a format zeppelin does not load (``pytorch_model.bin`` is a
    pickle); an empty list means the directory holds no weight file at all."""
    found, unusable = [], []
    for name in sorted(os.listdir(d)):
        if not name.endswith(_WEIGHT_SUFFIXES) or name.startswith("."):
            continue
        p = d / name
        st = stat_regular(p, "weight file", missing="weight file is a dangling symbolic link")
        if name.endswith(".safetensors"):
            _check_safetensors_size(p, st.st_size)
        (found if name.endswith(".safetensors") else unusable).append(p)
    if not found and unusable:
        names = ", ".join(p.name for p in unusable if not p.name.endswith(".index.json")) or unusable[0].name
        raise InputError(f"--model hf:{d}: weights only as {names}, which zeppelin does not load (pickle or "
                         "another framework's format); convert them to safetensors, or remove them to start from "
                         "random initialisation")
    return found


def _check_safetensors_size(p: Path, size: int) -> None:
    """A safetensors file starts with its header's length: a file shorter than that is truncated."""
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO swapped in cannot block the check
    try:
        head = os.pread(fd, 8, 0)
    except OSError:
        head = b""
    finally:
        os.close(fd)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or 8 + n > size:
        raise InputError(f"weight file of {size:,} bytes is truncated or not safetensors (no complete header)",
                         source=p)


def hf_input_files(d: Path) -> list[Path]:
    """Every file of a Hugging Face directory (config, weights, tokenizer), each noted as an input
    of the running command: no output may replace one."""
    out = []
    for name in sorted(os.listdir(d)):
        p = d / name
        if os.path.isfile(p):
            note_input(p)
            out.append(p)
    return out


def read_hf_config(d: Path) -> dict[str, Any]:
    path = d / "config.json"
    cfg = parse_json(read_small(path, "config.json", limit=MAX_DOC_BYTES), source=path)  # a regular file, bounded
    note_input(path)
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


# bounds of config.json fields: far above any real model, low enough to refuse a typo before any work
_INT_BOUNDS = {"hidden_size": 1 << 20, "num_attention_heads": 1 << 14, "num_key_value_heads": 1 << 14,
               "num_hidden_layers": 1 << 14, "intermediate_size": 1 << 22, "vocab_size": 1 << 24,
               "head_dim": 1 << 14, "max_position_embeddings": 1 << 32, "sliding_window": 1 << 32,
               "num_experts": 1 << 16, "num_local_experts": 1 << 16, "num_experts_per_tok": 1 << 16,
               "moe_intermediate_size": 1 << 22, "shared_expert_intermediate_size": 1 << 22}


def _cfg_int(cfg: dict[str, Any], key: str, src: Path, *, required: bool = True) -> int | None:
    v = cfg.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= _INT_BOUNDS[key]:
        got = "missing" if key not in cfg else f"got {v!r}"
        null = " or null" if not required else ""
        raise InputError(f"config.json: {key} must be an integer from 1 to {_INT_BOUNDS[key]:,}{null} ({got})",
                         source=src)
    return v


def _cfg_number(cfg: dict[str, Any], key: str, src: Path, default: float, lo: float, hi: float,
                *, lo_closed: bool = False) -> float:
    import math

    v = cfg.get(key, default)
    if v is None:
        v = default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= hi
    if not ok or (v < lo if lo_closed else v <= lo):
        low = f"at least {lo:g}" if lo_closed else f"greater than {lo:g}"
        raise InputError(f"config.json: {key} must be a number {low} and at most {hi:g} (got {v!r})", source=src)
    return float(v)


def _check_rope(cfg: dict[str, Any], src: Path) -> float:
    """The RoPE base; a rope scaling block must be an object whose ``factor`` is a number >= 1."""
    theta = cfg.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):  # older and newer transformers name the block so
        rope = cfg.get(key)
        if rope is not None and not isinstance(rope, dict):
            raise InputError(f"config.json: rope scaling must be an object or null (got {type(rope).__name__})",
                             source=src)
        rope = rope or {}
        if "factor" in rope:
            _cfg_number({"rope factor": rope["factor"]}, "rope factor", src, 1.0, 1.0, 1e6, lo_closed=True)
        if theta is None and "rope_theta" in rope:
            theta = rope["rope_theta"]
    return _cfg_number({"rope_theta": theta}, "rope_theta", src, 10000.0, 0.0, 1e12)


def hf_max_positions(ref: str) -> int | None:
    """``max_position_embeddings`` of ``hf:DIR`` (None when the config does not bound positions)."""
    d = hf_dir(ref)
    return _cfg_int(read_hf_config(d), "max_position_embeddings", d / "config.json", required=False)


def check_positions(ref: str | None, longest: int) -> None:
    """Refuse sequences longer than an ``hf:DIR`` model's ``max_position_embeddings``."""
    if not is_hf_ref(ref):
        return
    limit = hf_max_positions(ref)
    if limit is not None and longest > limit:
        raise InputError(f"--model {ref}: a sequence of {longest:,} tokens is longer than the model's "
                         f"max_position_embeddings {limit:,} (config.json)")


def hf_model_spec(ref: str) -> ModelSpec:
    """``ModelSpec`` of the model in ``hf:DIR`` (refuses configs the runtime cannot run exactly).

    The one reader of Hugging Face configs: the planner and the runtime both size and check the
    model through it, so a config either plans and runs or is refused here with one line."""
    d = hf_dir(ref)
    cfg = read_hf_config(d)
    hf_input_files(d)
    src = d / "config.json"
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise InputError(f"model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})",
                         source=src)

    def need(key: str) -> int:
        return _cfg_int(cfg, key, src)

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv = _cfg_int(cfg, "num_key_value_heads", src, required=False) or heads
    if heads % kv:
        raise InputError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
                         source=src)
    head_dim = _cfg_int(cfg, "head_dim", src, required=False)
    if head_dim is None:
        head_dim = _HEAD_DIM_DEFAULT.get(mt)
    if head_dim is not None and (head_dim < 2 or head_dim % 2):
        raise InputError(f"config.json has a bad head_dim {head_dim!r} (an even integer >= 2)", source=src)
    head_size = head_dim if head_dim is not None and head_dim * heads != hidden else None
    _cfg_int(cfg, "max_position_embeddings", src, required=False)
    sw = cfg.get("sliding_window")
    if sw is not None and (not isinstance(sw, int) or isinstance(sw, bool) or not 0 <= sw <= _INT_BOUNDS["sliding_window"]):
        raise InputError(f"config.json: sliding_window must be an integer from 0 (none) to "
                         f"{_INT_BOUNDS['sliding_window']:,} or null (got {sw!r})", source=src)
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
    if not isinstance(dt, str) or dt not in _DTYPES:
        raise InputError(f"dtype {dt!r} is not one of {', '.join(_DTYPES)}", source=src)
    theta = _check_rope(cfg, src)
    eps = _cfg_number(cfg, "rms_norm_eps", src, 1e-6, 0.0, 1.0)
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise InputError(f"config.json: tie_word_embeddings must be true or false (got {tie!r})", source=src)
    arch = {k: v for k, v in sorted(cfg.items()) if k not in _NON_ARCH_KEYS}
    digest = content_hash(arch).split(":")[-1][:10]
    try:
        return ModelSpec(
            name=f"hf-{mt}-{digest}", family="llama", num_layers=layers, hidden=hidden,
            num_heads=heads, num_kv_heads=kv, ffn_hidden=need("intermediate_size"),
            vocab_size=need("vocab_size"), mlp="swiglu", dtype=_DTYPES[dt], rope_theta=theta, norm_eps=eps,
            tie_embeddings=tie, remap_payload="qkv",
            head_size=head_size, sliding_window=w, layer_types=layer_types if w is not None else None,
            qk_norm=mt in _QK_NORM, **moe)
    except ValidationError as e:  # the spec's own checks (divisibility, ...): one line, no help URL
        why = format_validation_error(e).removeprefix("(document): ")
        raise InputError(f"config.json does not describe a supported decoder: {why}", source=src) from None
