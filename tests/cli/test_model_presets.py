"""The presets of the models people name (`zeppelin plan --model NAME`, no config directory):
each plans and validates, and a windowed plan is refused by the runtime's own (dense,
full-attention) model in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")


@pytest.mark.parametrize("name, pattern", [("llama3-8b", "full causal"), ("qwen3-8b", "full causal"),
                                           ("mistral-7b", "sliding window 4096"),
                                           ("qwen3-30b-a3b", "full causal"), ("mixtral-8x7b", "full causal")])
def test_preset_plans_and_validates(tmp_path, name, pattern):
    plan = tmp_path / "p.plan"
    p = subprocess.run([ZEPPELIN, "plan", "-c", "zeppelin-a:2", "--model", name, "--steps", "1", "--zero-stage", "3",
                        "-q", "-o", str(plan)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([ZEPPELIN, "validate", str(plan)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and ": valid - 1 steps by zeppelin" in p.stdout, p.stdout + p.stderr
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.plan import read_plan

    header, _ = read_plan(plan)
    assert header.model == model_preset(name) and header.model.attention_pattern() == pattern


@pytest.mark.timeout(120)
def test_windowed_plan_needs_a_transformers_model(tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"length": n}) + "\n" for n in [300, 13, 90, 7, 33, 64, 21, 5]))
    plan = tmp_path / "p.plan"
    p = subprocess.run([ZEPPELIN, "plan", "-m", str(manifest), "-c", "local-cpu:1x2", "--model", "tiny-window",
                        "--steps", "1", "--seqs-per-step", "4", "--tokens-per-step", "256", "-q", "-o", str(plan)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([ZEPPELIN, "run", str(plan), "--progress", "none"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    # the launcher checks what the ranks would check, before starting them: one line, exit 2
    assert (p.returncode, p.stderr) == (2, "zeppelin: error: the plan's model 'tiny-window' (sliding window 64 "
                                           "attention) runs through transformers: pass --model hf:DIR (the runtime's "
                                           "own model is a dense full-attention Llama)\n")
