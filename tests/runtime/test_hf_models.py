"""Sliding-window, Qwen3 and mixture-of-experts Hugging Face models on a plan's layouts, exactly as
transformers computes them: 4 gloo ranks, FSDP2, the hand plan's routed inter-node ring, intra
rings, remap, padded zigzag ring and locals (tests/runtime/test_runtime_dist.py's ``hand_step``)
against transformers' own single-process eager model, loss and every gradient (fp32 1e-5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.test_hf import _hf_step, transformers_reference
from tests.runtime.test_runtime_dist import WORLD, hand_step, make_header, two_node_cluster  # noqa: F401 - WORLD: the pool's size
from tests.support.numerics import assert_matches_reference
from zeppelin.schemas.common import InputError
from zeppelin.schemas.hf import hf_model_spec

WINDOW = 6  # the hand plan's sequences reach 37 tokens: several windows, split over rings

_BASE = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096}


def _config(kind: str):
    from transformers import MistralConfig, MixtralConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    if kind == "mistral-window":
        return MistralConfig(intermediate_size=176, sliding_window=WINDOW, **_BASE)
    if kind == "qwen3-mixed":  # Qwen3 (q/k norms, head_dim 32 != 64 / 4) with a window layer and a full layer
        return Qwen3Config(intermediate_size=176, head_dim=32, use_sliding_window=True, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention"], **_BASE)
    if kind == "qwen3":
        return Qwen3Config(intermediate_size=176, head_dim=16, **_BASE)
    if kind == "qwen3-moe":
        return Qwen3MoeConfig(intermediate_size=176, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                              head_dim=16, norm_topk_prob=True, **_BASE)
    if kind == "qwen3-moe-aux":  # the router's load-balancing loss in the training loss, weighted heavily
        return Qwen3MoeConfig(intermediate_size=176, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                              head_dim=16, output_router_logits=True, router_aux_loss_coef=0.5, **_BASE)
    if kind == "qwen2-moe":
        return Qwen2MoeConfig(intermediate_size=176, moe_intermediate_size=48, shared_expert_intermediate_size=64,
                              num_experts=4, num_experts_per_tok=2, **_BASE)
    if kind == "mixtral":
        return MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                             **_BASE)
    raise ValueError(kind)


def make_model_dir(path: Path, kind: str, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    model.save_pretrained(str(path))
    c = json.loads((path / "config.json").read_text())
    c["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(c, indent=1))
    return path


KINDS = ["mistral-window", "qwen3-mixed", "qwen3", "qwen3-moe", "qwen2-moe", "mixtral"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hfm")
    return {k: make_model_dir(root / k, k, seed=i) for i, k in enumerate([*KINDS, "qwen3-moe-aux"])}


def test_specs_of_each_model_type(model_dirs):
    m = hf_model_spec(f"hf:{model_dirs['mistral-window']}")
    assert (m.sliding_window, m.layer_types, m.attention_pattern()) == (WINDOW, None, f"sliding window {WINDOW}")
    q = hf_model_spec(f"hf:{model_dirs['qwen3-mixed']}")
    assert q.layer_windows() == (WINDOW, None) and q.qk_norm and q.head_dim == 32 and q.q_dim == 128
    assert q.attention_pattern() == f"sliding window {WINDOW} on 1 of 2 layers (WF)"
    moe = hf_model_spec(f"hf:{model_dirs['qwen2-moe']}")
    assert (moe.num_experts, moe.experts_per_token, moe.expert_ffn_hidden, moe.shared_expert_ffn_hidden) == (4, 2, 48, 64)
    # memory counts every expert, compute the active ones: parameters as transformers has them
    # (but Qwen2's q/k/v biases, which no ModelSpec counts)
    from transformers import AutoModelForCausalLM

    for kind in KINDS:
        spec = hf_model_spec(f"hf:{model_dirs[kind]}")
        hf = AutoModelForCausalLM.from_pretrained(str(model_dirs[kind]))
        assert spec.num_params() == sum(p.numel() for n, p in hf.named_parameters() if not n.endswith("bias")), kind


def test_moe_cost_uses_active_experts(model_dirs):
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.schemas.cluster import cluster_preset

    spec = hf_model_spec(f"hf:{model_dirs['qwen2-moe']}")
    cm = CostModel(cluster_preset("h100"), spec)
    h = spec.hidden
    # attention projections + top-2 experts + shared expert (SwiGLU: 3 matrices) + router, x2 FLOPs
    want = 2 * (h * (spec.q_dim + 2 * spec.kv_dim) + spec.q_dim * h + 3 * h * (2 * 48 + 64) + h * 4)
    assert cm.linear_flops_per_token == want


@pytest.mark.parametrize("edit, message", [
    ({"mlp_only_layers": [1]}, "decoder_sparse_step != 1 / mlp_only_layers (dense layers between MoE layers) are "
     "not supported: every layer must be an MoE layer"),
    ({"num_local_experts": 0}, "config.json: num_local_experts must be an integer from 1 to 65,536 (got 0)"),
])
def test_moe_configs_refused(model_dirs, tmp_path, edit, message):
    c = json.loads((model_dirs["qwen3-moe"] / "config.json").read_text())
    c.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(InputError) as e:
        hf_model_spec(f"hf:{tmp_path}")
    assert str(e.value) == f"{tmp_path / 'config.json'}: {message}"


def test_bad_layer_types_refused(model_dirs, tmp_path):
    c = json.loads((model_dirs["qwen3-mixed"] / "config.json").read_text())
    c["layer_types"] = ["sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(InputError) as e:
        hf_model_spec(f"hf:{tmp_path}")
    assert str(e.value) == f"{tmp_path / 'config.json'}: layer_types must list 2 of full_attention, sliding_attention"


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_hand_plan_equals_transformers(pool, model_dirs, kind):
    ref = f"hf:{model_dirs[kind]}"
    spec = hf_model_spec(ref)
    header = make_header(two_node_cluster(), spec, 1)
    step = hand_step(0, spec)
    outs = pool.run(_hf_step, header.model_dump_json(), step.model_dump_json(), ref, timeout=240)
    ref_loss, ref_grads = transformers_reference(model_dirs[kind], header, step, torch.float32)
    for o in outs:
        assert_matches_reference(o["loss"], ref_loss, 1e-5, "loss")
    grads = outs[0]["grads"]
    assert set(grads) == set(ref_grads)
    for k in grads:
        assert_matches_reference(grads[k], ref_grads[k], 1e-5, f"{kind}: gradient of {k}")


ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")
#: the model types ``zeppelin run --verify`` runs below: one of each kind of layer stack
RUN_KINDS = ("mistral-window", "qwen3-mixed", "qwen3-moe-aux", "mixtral")


def _zeppelin(*args, cwd=None, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([ZEPPELIN, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plans_of_each_model_type_validate_and_verify(model_dirs, tmp_path):
    """`zeppelin plan` / `validate` for every model type, `run --verify` on 2 ranks for one of each
    kind of layer stack (the windowed model, whose 64-token sequence runs as a contiguous ring of 2:
    its window needs the neighbour's K/V only; mixed full / windowed layers; a mixture of experts with
    its router loss; Mixtral's expert block): every type's distributed step is compared with
    transformers itself by ``test_hand_plan_equals_transformers``. A plan made for one attention
    pattern is refused with another."""
    from tests.support.clusters import cluster_file

    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"length": n}) + "\n" for n in [300, 13, 90, 7, 33, 64, 21, 5]))
    cluster = cluster_file(tmp_path, "local-cpu:1x2")  # over fast links: the planner makes the ring
    for kind in [*KINDS, "qwen3-moe-aux"]:
        plan = tmp_path / f"{kind}.plan"
        ref = f"hf:{model_dirs[kind]}"
        p = _zeppelin("plan", "-m", str(manifest), "--cluster", str(cluster), "--model", ref, "--steps", "2",
                      "--seqs-per-step", "4", "--tokens-per-step", "256", "-q", "-o", str(plan))
        assert p.returncode == 0, p.stderr
        p = _zeppelin("validate", str(plan))
        assert p.returncode == 0 and ": valid - 2 steps by zeppelin" in p.stdout, p.stdout + p.stderr
        if kind not in RUN_KINDS:
            continue
        p = _zeppelin("run", str(plan), "--model", ref, "--verify", "--progress", "none", cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        assert "--verify max relative differences" in p.stdout and " - ok" in p.stdout, (kind, p.stdout)
        assert "Loading weights" not in p.stderr
        if kind == "mistral-window":
            from zeppelin.schemas.plan import read_plan

            _, steps = read_plan(plan)
            schemes = {(g.kind, pl.scheme) for s in steps for mb in s.microbatches for pl in mb.placements
                       for g in [mb.groups[pl.group]]}
            assert ("ring", "contiguous") in schemes, schemes
    p = _zeppelin("run", str(tmp_path / "mistral-window.plan"), "--model", f"hf:{model_dirs['qwen3-mixed']}",
                  "--progress", "none", cwd=tmp_path)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1] == (
        f"zeppelin: error: --model hf:{model_dirs['qwen3-mixed']} runs sliding window {WINDOW} on 1 of 2 layers (WF) "
        f"attention but the plan was made for sliding window {WINDOW} attention (plan it for this model)")


def transformers_reference_with_router_loss(d: Path, header, step):
    """transformers' own MoE model with ``output_router_logits``: each micro-batch's sequences as
    one right-padded batch (its loss: mean cross-entropy + coef x the batch's load-balancing loss),
    weighted by the micro-batch's share of the step's predicted tokens; and each micro-batch's
    router loss (``aux_loss``)."""
    from transformers import AutoModelForCausalLM

    from zeppelin.runtime.data import TokenSource, predicted_tokens
    from zeppelin.runtime.train.verify import step_microbatches

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager")
    source = TokenSource(header.model.vocab_size, header.seed)
    n = predicted_tokens(step.sequences)
    total, auxes = torch.zeros(()), []
    for seqs in step_microbatches(step):
        rows = [torch.from_numpy(source.segments(step.sequences, [[i, 0, step.sequences[i].length]]).tokens)
                for i in seqs]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, :len(r)], mask[b, :len(r)] = r, 1
        labels = ids.masked_fill(mask == 0, -100)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        pred = sum(len(r) - 1 for r in rows)
        total = total + out.loss * pred / n
        auxes.append(float(out.aux_loss.detach()))
    total.backward()
    return float(total.detach()), {k: p.grad for k, p in model.named_parameters()}, auxes


@pytest.mark.slow
def test_router_loss_equals_transformers(pool, model_dirs):
    """A Qwen3-MoE whose config puts the router's load-balancing loss in the training loss
    (``output_router_logits``, coefficient 0.5): the hand plan on 4 ranks (rings, remap, locals;
    the statistic all-reduced per micro-batch) equals transformers' batch loss and gradients, and
    the runtime's per-micro-batch router loss is transformers' ``aux_loss``."""
    d = model_dirs["qwen3-moe-aux"]
    ref = f"hf:{d}"
    spec = hf_model_spec(ref)
    header = make_header(two_node_cluster(), spec, 1)
    step = hand_step(0, spec)
    outs = pool.run(_hf_step, header.model_dump_json(), step.model_dump_json(), ref, timeout=240)
    ref_loss, ref_grads, auxes = transformers_reference_with_router_loss(d, header, step)
    for o in outs:
        assert_matches_reference(o["loss"], ref_loss, 1e-5, "loss")
    grads = outs[0]["grads"]
    for k in grads:
        assert_matches_reference(grads[k], ref_grads[k], 1e-5, f"gradient of {k}")
    # the router loss is a real part of it (about 1 of the loss's 6.6): checked to ~1e-4 of itself
    assert 0.5 * min(auxes) > 0.1 * ref_loss
    # the runtime's own statistic, single process, on each micro-batch's sequences
    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.train.verify import step_microbatches
    from zeppelin.runtime.hf import load_hf_model
    from zeppelin.runtime.model import ReferenceLayout

    model = load_hf_model(ref, spec=spec)
    source = TokenSource(spec.vocab_size, header.seed)
    for seqs, aux in zip(step_microbatches(step), auxes):
        lens = [step.sequences[i].length for i in seqs]
        batch = source.segments(step.sequences, [[i, 0, step.sequences[i].length] for i in seqs])
        model.hidden_states(torch.from_numpy(batch.tokens), ReferenceLayout(lens))
        per_layer = [torch.cat([r[layer] for r in model._router_logits], 0) for layer in range(spec.num_layers)]
        got = float(model._aux_of(model._router_stats(per_layer)).detach())
        assert abs(got - aux) <= 1e-6 * max(1.0, abs(aux)), (got, aux)
