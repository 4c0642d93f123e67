"""Hugging Face models (``--model hf:DIR``): the planner's ModelSpec from config.json, the
transformers model on a plan's layouts equal to transformers' own single-process forward/backward,
and ``zeppelin run --model hf:DIR`` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeppelin.schemas.common import InputError, content_hash
from zeppelin.schemas.hf import hf_model_spec
from zeppelin.schemas.model import resolve_model_ref
from zeppelin.schemas.plan import PlanHeader, StepPlan, write_plan

from tests.runtime.test_runtime_dist import WORLD, hand_step, make_header, two_node_cluster  # noqa: F401 - WORLD: the pool's size
from tests.support.numerics import assert_matches_reference

ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")


def make_hf_dir(path: Path, kind: str = "llama", *, dtype: str = "float32", tie: bool = False,
                seed: int = 0, weights: bool = True) -> Path:
    """A tiny transformers model directory (config.json + model.safetensors) written by
    transformers itself."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[kind]
    extra = {"sliding_window": None} if kind == "mistral" else {}
    cfg = cls(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=tie, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if kind == "qwen2":  # non-zero q/k/v biases, so that they are exercised
            for layer in model.model.layers:
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(lin.bias, std=0.02)
    model.save_pretrained(str(path))
    c = json.loads((path / "config.json").read_text())
    c["dtype"] = dtype
    (path / "config.json").write_text(json.dumps(c, indent=1))
    if not weights:
        for f in path.glob("*.safetensors"):
            f.unlink()
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"llama": make_hf_dir(root / "llama", "llama", seed=1),
            "qwen2": make_hf_dir(root / "qwen2", "qwen2", tie=True, seed=2),
            "qwen2-bf16": make_hf_dir(root / "qwen2-bf16", "qwen2", tie=True, seed=2, dtype="bfloat16"),
            "mistral": make_hf_dir(root / "mistral", "mistral", seed=4)}


# ---------------------------------------------------------------------------------------------
# the planner's ModelSpec
# ---------------------------------------------------------------------------------------------


def test_model_spec_from_config(hf_dirs, tmp_path):
    spec = resolve_model_ref(f"hf:{hf_dirs['llama']}")
    assert (spec.num_layers, spec.hidden, spec.num_heads, spec.num_kv_heads, spec.ffn_hidden, spec.vocab_size) \
        == (2, 64, 4, 2, 176, 256)
    assert spec.dtype == "fp32" and not spec.tie_embeddings and spec.name.startswith("hf-llama-")
    q = hf_model_spec(f"hf:{hf_dirs['qwen2-bf16']}")
    assert q.dtype == "bf16" and q.tie_embeddings and q.name.startswith("hf-qwen2-")
    # the directory's location is not part of the spec (same config elsewhere: same model hash)
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "config.json").write_text((hf_dirs["llama"] / "config.json").read_text())
    assert content_hash(hf_model_spec(f"hf:{moved}")) == content_hash(spec)
    # another config of the same shape is another model
    c = json.loads((moved / "config.json").read_text())
    c["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    (moved / "config.json").write_text(json.dumps(c))
    assert content_hash(hf_model_spec(f"hf:{moved}")) != content_hash(spec)
    assert hf_model_spec(f"hf:{moved}").rope_theta == 500000.0
    m = make_hf_dir(tmp_path / "mistral", "mistral", weights=False)
    assert hf_model_spec(f"hf:{m}").name.startswith("hf-mistral-")


def test_planner_prices_the_qkv_remap(hf_dirs):
    """An HF model's remap moves Q, K, V to the attention layout (the output comes back): the cost
    model charges 2 x kv_dim more values per token each way than for the runtime's own model."""
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.schemas.cluster import cluster_preset

    spec = hf_model_spec(f"hf:{hf_dirs['llama']}")
    assert spec.remap_payload == "qkv" and spec.remap_widths() == (spec.hidden + 2 * spec.kv_dim, spec.hidden)
    own = spec.model_copy(update={"remap_payload": "hidden"})
    assert "remap_payload" not in own.model_dump(mode="json")  # presets and JSON specs keep their hashes
    c_hf, c_own = CostModel(cluster_preset("h100"), spec), CostModel(cluster_preset("h100"), own)
    n = 10_000
    extra = float(c_hf.remap_time(n, "inter") - c_own.remap_time(n, "inter"))
    want = 2 * n * 2 * spec.kv_dim * spec.dtype_bytes / (c_hf.link("inter").bandwidth_GBps * 1e9)
    assert abs(extra - want) <= 1e-9 * want


@pytest.mark.parametrize("edit, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported (supported: llama, mistral, qwen2, qwen3, mixtral, "
                             "qwen2_moe, qwen3_moe)"),
    ({"sliding_window": 16, "layer_types": ["sliding_attention"]},
     "layer_types must list 2 of full_attention, sliding_attention"),
    ({"head_dim": 31}, "config.json has a bad head_dim 31 (an even integer >= 2)"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported (SwiGLU with silu only)"),
    ({"num_hidden_layers": 0}, "config.json: num_hidden_layers must be an integer from 1 to 16,384 (got 0)"),
])
def test_bad_configs_refused(hf_dirs, tmp_path, edit, message):
    c = json.loads((hf_dirs["llama"] / "config.json").read_text())
    c.update(edit)
    if edit.get("sliding_window"):
        c["model_type"] = "mistral"
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(InputError) as e:
        hf_model_spec(f"hf:{tmp_path}")
    assert str(e.value) == f"{tmp_path / 'config.json'}: {message}"


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(InputError, match=r"is not a directory \(hf:DIR names a directory with config.json\)"):
        resolve_model_ref(f"hf:{tmp_path / 'nope'}")
    with pytest.raises(InputError, match="no config.json in"):
        resolve_model_ref(f"hf:{tmp_path}")


def test_plan_cli_reads_hf_dir(hf_dirs, tmp_path):
    out = tmp_path / "p.jsonl"
    argv = [ZEPPELIN, "plan", "--cluster", "local-cpu:1x2", "--model", f"hf:{hf_dirs['llama']}", "--steps", "1",
            "--seqs-per-step", "4", "-q", "-o", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True)
    # the built-in dataset's longest sequences exceed the config's 4,096 positions: refused, unless cut
    assert p.returncode == 2 and p.stderr.endswith("max_position_embeddings 4,096 (config.json)\n"), p.stderr
    p = subprocess.run([*argv, "--max-seq-len", "4096"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    header = json.loads(out.read_text().splitlines()[0])
    spec = hf_model_spec(f"hf:{hf_dirs['llama']}")
    assert header["hashes"]["model"] == content_hash(spec)


def test_weights_load_like_from_pretrained(hf_dirs):
    from transformers import AutoModelForCausalLM

    from zeppelin.runtime.hf import load_hf_model

    for kind in ("llama", "qwen2"):
        mine = load_hf_model(f"hf:{hf_dirs[kind]}").state_dict()
        ref = AutoModelForCausalLM.from_pretrained(str(hf_dirs[kind]), dtype=torch.float32).state_dict()
        assert set(mine) == {k for k in ref if not k.endswith("inv_freq")}
        for k, v in mine.items():
            assert torch.equal(v, ref[k]), k
        # RoPE tables (non-persistent buffers) as transformers builds them: the weights-only path skips
        # the random initialisation, not the buffers
        mb = dict(load_hf_model(f"hf:{hf_dirs[kind]}").named_buffers())
        rb = dict(AutoModelForCausalLM.from_pretrained(str(hf_dirs[kind])).named_buffers())
        assert mb.keys() == rb.keys() and all(torch.equal(mb[k], rb[k]) for k in mb)


def test_reference_copy_has_the_same_names_and_leaves_the_rng(hf_dirs):
    from zeppelin.runtime.hf import load_hf_model

    model = load_hf_model(f"hf:{hf_dirs['qwen2']}")
    torch.manual_seed(11)
    want = torch.rand(3)
    torch.manual_seed(11)
    ref = model.reference_copy()
    assert torch.equal(torch.rand(3), want)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert ref.dtype == torch.float32 and ref.config is not model.config


def test_random_init_is_seeded(tmp_path):
    from zeppelin.runtime.hf import load_hf_model

    d = make_hf_dir(tmp_path / "cfgonly", "llama", weights=False)
    a = load_hf_model(f"hf:{d}", seed=5).state_dict()
    b = load_hf_model(f"hf:{d}", seed=5).state_dict()
    c = load_hf_model(f"hf:{d}", seed=6).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


# ---------------------------------------------------------------------------------------------
# distributed steps vs transformers' own single-process forward/backward
# ---------------------------------------------------------------------------------------------


def _hf_step(rank: int, world: int, header_json: str, step_json: str, ref: str, dp: str = "fsdp",
             zero_stage: int = 3):
    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.executor import Executor
    from zeppelin.runtime.fsdp import full_params_and_grads
    from zeppelin.runtime.groups import GroupCache, set_default_cache
    from zeppelin.runtime.hf import build_hf_model

    header = PlanHeader.model_validate_json(header_json)
    step = StepPlan.model_validate_json(step_json)
    cache = GroupCache(world, header=header, steps=[step])
    set_default_cache(cache)
    model = build_hf_model(ref, seed=0, spec=header.model)  # on the meta device: the executor fills each rank's rows
    ex = Executor(header, model, TokenSource(header.model.vocab_size, header.seed), rank=rank, world_size=world,
                  device=torch.device("cpu"), groups=cache, dp=dp, zero_stage=zero_stage)
    res = ex.forward_backward(step)
    _, grads = full_params_and_grads(model)  # whole gradients (collective under FSDP)
    return {"loss": res.loss, "bytes": res.bytes, "grads": grads if rank == 0 else None}


def transformers_reference(d: Path, header: PlanHeader, step: StepPlan, dtype: torch.dtype):
    """transformers' own model (from_pretrained, eager attention), one sequence at a time:
    loss = sum of token cross-entropies / predicted tokens of the step, and its gradients."""
    from transformers import AutoModelForCausalLM

    from zeppelin.runtime.data import TokenSource, predicted_tokens

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager")
    source = TokenSource(header.model.vocab_size, header.seed)
    n = predicted_tokens(step.sequences)
    total = torch.zeros(())
    for i, s in enumerate(step.sequences):
        if s.length < 2:  # predicts nothing (transformers' mean over no tokens would be nan)
            continue
        ids = torch.from_numpy(source.segments(step.sequences, [[i, 0, s.length]]).tokens)[None]
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = model(input_ids=ids, labels=ids)
        total = total + out.loss.float() * (s.length - 1)
    loss = total / n
    loss.backward()
    return float(loss.detach()), {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("kind, tol, dp, zero", [("llama", 1e-5, "fsdp", 3), ("qwen2", 1e-5, "replicate", 0),
                                                 ("mistral", 1e-5, "fsdp", 2), ("qwen2-bf16", 2e-2, "fsdp", 3)])
def test_hand_plan_equals_transformers(pool, hf_dirs, kind, tol, dp, zero):
    """Every path (routed inter-node ring, intra rings, remap, padded zigzag ring, locals) on 4
    gloo ranks, FSDP2 (ZeRO-3 / ZeRO-2) or replicated, vs transformers single-process (fp32 1e-5;
    bf16 within 2e-2 of fp32)."""
    ref = f"hf:{hf_dirs[kind]}"
    spec = hf_model_spec(ref)
    header = make_header(two_node_cluster(), spec, 1)
    step = hand_step(0, spec)
    outs = pool.run(_hf_step, header.model_dump_json(), step.model_dump_json(), ref, dp=dp, zero_stage=zero,
                    timeout=180)
    ref_loss, ref_grads = transformers_reference(hf_dirs[kind], header, step, torch.float32)
    for o in outs:
        assert_matches_reference(o["loss"], ref_loss, tol, "loss")
    grads = outs[0]["grads"]
    assert set(grads) == set(ref_grads)
    for k in grads:
        assert_matches_reference(grads[k], ref_grads[k], tol, f"{kind}: gradient of {k}")
    assert sum(o["bytes"]["inter"] for o in outs) > 0 and sum(o["bytes"]["intra"] for o in outs) > 0


# ---------------------------------------------------------------------------------------------
# zeppelin run --model hf:DIR
# ---------------------------------------------------------------------------------------------


def test_run_refuses_another_model(hf_dirs, tmp_path):
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks

    spec = hf_model_spec(f"hf:{hf_dirs['llama']}")
    plan = tmp_path / "p.jsonl"
    write_plan(plan, make_header(two_node_cluster(), spec, 1), [hand_step(0, spec)])
    startup_checks(RunConfig(plan=str(plan), model=f"hf:{hf_dirs['llama']}"), 4)  # the same model: accepted
    other = hf_model_spec(f"hf:{hf_dirs['qwen2']}")
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan=str(plan), model=f"hf:{hf_dirs['qwen2']}"), 4)
    assert str(e.value) == (f"--model hf:{hf_dirs['qwen2']} does not match the plan: the plan was made for model "
                            f"{spec.name!r} (hash {content_hash(spec)}, given {content_hash(other)})")


# ---------------------------------------------------------------------------------------------
# --export
# ---------------------------------------------------------------------------------------------


def _logits_by_sequence(model, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    outs, pos = [], 0
    for n in lengths:
        outs.append(model(input_ids=tokens[pos:pos + n][None]).logits[0])
        pos += n
    return torch.cat(outs)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "own-tiny"])
def test_export_round_trips_through_from_pretrained(hf_dirs, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    from zeppelin.runtime.hf import export_model, load_hf_model
    from zeppelin.runtime.model import LlamaModel, ReferenceLayout
    from zeppelin.schemas.model import model_preset

    if kind == "own-tiny":
        spec = model_preset("tiny")
        model = LlamaModel(spec, seed=3)
    else:
        model = load_hf_model(f"hf:{hf_dirs[kind]}", seed=0)
        spec = model.spec
        with torch.no_grad():  # not the weights of DIR: the export must write the model's own
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    out = export_model(model, spec, tmp_path / "export")
    assert sorted(f.name for f in out.iterdir() if f.suffix in (".json", ".safetensors"))[:2] == [
        "config.json", "generation_config.json"] and (out / "model.safetensors").is_file()
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temporary left behind
    lengths = [5, 9, 3]
    tokens = torch.randint(0, spec.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = model.logits(model.hidden_states(tokens, ReferenceLayout(lengths)))
        theirs = _logits_by_sequence(AutoModelForCausalLM.from_pretrained(str(out)), tokens, lengths)
    assert float((mine - theirs).abs().max()) <= 1e-5 * float(mine.abs().max())
    # and the export reads back as a model reference of its own
    assert hf_model_spec(f"hf:{out}").num_params() == spec.num_params()
    with pytest.raises(InputError, match="export directory exists and is not empty"):
        export_model(model, spec, out)


def test_export_refusals(hf_dirs, tmp_path):
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks
    from zeppelin.runtime.hf import export_problem
    from zeppelin.schemas.model import model_preset

    assert export_problem(None, model_preset("gpt-7b")) == (
        "--export writes Llama-family models; model 'gpt-7b' has a gelu MLP, which has no transformers Llama "
        "equivalent")
    assert export_problem(None, model_preset("tiny")) is None
    spec = hf_model_spec(f"hf:{hf_dirs['llama']}")
    plan = tmp_path / "p.jsonl"
    write_plan(plan, make_header(two_node_cluster(), spec, 1), [hand_step(0, spec)])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan=str(plan), model=f"hf:{hf_dirs['llama']}", export=str(tmp_path / "full")), 4)
    assert str(e.value) == f"{tmp_path / 'full'}: --export: the directory exists and is not empty"


def _train_like_the_runtime(d: Path, plan: Path, steps: int, lr: float):
    """transformers single-process: ``steps`` AdamW steps (the runtime's settings) on the plan's
    steps, each sequence whole, eager attention."""
    from transformers import AutoModelForCausalLM

    from zeppelin.runtime.data import TokenSource, predicted_tokens
    from zeppelin.schemas.plan import PlanReader

    reader = PlanReader(plan)
    header = reader.header
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8,
                            foreach=False)
    source = TokenSource(header.model.vocab_size, header.seed)
    for k in range(steps):
        step = reader.step(k)
        n = predicted_tokens(step.sequences)
        for i, s in enumerate(step.sequences):
            if s.length < 2:
                continue
            ids = torch.from_numpy(source.segments(step.sequences, [[i, 0, s.length]]).tokens)[None]
            (model(input_ids=ids, labels=ids).loss * ((s.length - 1) / n)).backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_run_cli_hf_verify(hf_dirs, tmp_path):
    """`zeppelin run --model hf:DIR --verify --export OUT --zero-stage 3` on 2 ranks (FSDP2, the
    parameters sharded): verify within 1e-5 every step, and the exported weights (gathered from the
    shards) equal transformers trained single-process the same way."""
    ref = f"hf:{hf_dirs['qwen2']}"
    plan = tmp_path / "p.jsonl"
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"length": n}) + "\n" for n in [300, 13, 90, 7, 33, 64, 21, 5]))
    p = subprocess.run([ZEPPELIN, "plan", "-m", str(manifest), "--cluster", "local-cpu:1x2", "--model", ref,
                        "--steps", "2", "--seqs-per-step", "4", "--tokens-per-step", "256", "-q", "-o", str(plan)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    metrics = tmp_path / "m.metrics.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "export"
    p = subprocess.run([ZEPPELIN, "run", str(plan), "--model", ref, "--verify", "--progress", "none",
                        "--metrics", str(metrics), "--lr", "1e-3", "--export", str(out), "--zero-stage", "3",
                        "--zero-stage-override"],
                       capture_output=True, text=True, env=env, timeout=200)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].startswith("zeppelin run: synthetic token ids (no --data given; seed 0")
    assert "--verify max relative differences" in p.stdout and " - ok" in p.stdout
    recs = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert len(recs) == 2 and all(r["verify"]["ok"] and r["verify"]["grad_rel"] <= 1e-5 for r in recs)
    assert f"zeppelin run: exported the model to {out}" in p.stdout
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    expected = _train_like_the_runtime(hf_dirs["qwen2"], plan, 2, 1e-3).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(str(hf_dirs["qwen2"])).state_dict()
    assert set(exported) == set(expected)
    for k, v in expected.items():
        moved = (v - initial[k]).norm()
        if moved > 0:  # trained: the export holds the trained weights, not the initial ones
            assert float((exported[k] - v).norm()) <= 1e-3 * float(moved), k
