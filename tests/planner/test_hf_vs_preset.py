"""An ``hf:DIR`` Llama-3-8B and the ``llama3-8b`` preset: the same shape, different token counts
(transformers' RMSNorm keeps its rows in bf16, the runtime's own norm in fp32), and ``--explain``
says so with both figures."""

from __future__ import annotations

import json

from tests.support.cli import run_cli
from zeppelin.schemas.model import model_preset, resolve_model_ref

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
             "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
             "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "vocab_size": 128256}


def _memory_lines(out: str) -> list[str]:
    return [ln.strip() for ln in out.splitlines() if "holds" in ln or "MB" in ln or "per unit)" in ln]


def test_hf_llama3_and_the_preset_differ_only_in_their_modules(tmp_path, capsys):
    (tmp_path / "l3").mkdir()
    (tmp_path / "l3" / "config.json").write_text(json.dumps(LLAMA3_8B))
    ref = f"hf:{tmp_path / 'l3'}"
    hf, preset = resolve_model_ref(ref).model_dump(), model_preset("llama3-8b").model_dump()
    assert {k for k in hf.keys() | preset.keys() if hf.get(k) != preset.get(k)} == {"name", "remap_payload"}
    code, out, err = run_cli(["plan", "-c", "h100:8x8", "--model", "llama3-8b", "--explain"], capsys)
    assert code == 0, err
    assert "  one unit holds          6,615 tokens: longer sequences are split over units" in out
    assert "transformers" not in out  # the note is for hf:DIR models only
    code, out, err = run_cli(["plan", "-c", "h100:8x8", "--model", ref, "--explain"], capsys)
    assert code == 0, err
    assert "  one unit holds          7,056 tokens: longer sequences are split over units" in out
    assert " ".join(out.split()).count(
        "(hf:DIR runs transformers' modules, whose RMSNorm keeps its rows in bf16: 7.999 MB per token; the "
        "runtime's own model of this shape, e.g. a preset, keeps them in fp32: 8.532 MB, 6,615 tokens per unit)") == 1
