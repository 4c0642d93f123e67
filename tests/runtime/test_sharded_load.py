"""Models built on the meta device and filled after sharding (zeppelin.runtime.weights): on 4 gloo
ranks at ZeRO-3 each rank reads only its own rows of the weight files (bytes counted), the sharded
weights equal transformers' own (``from_pretrained``; seeded ``from_config`` without weight files;
the runtime's Llama's seeded init), a step's loss equals the whole-model loader's, and ``--export``
writes one file per rank that transformers loads back to the same outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.runtime.test_hf import make_hf_dir
from tests.runtime.test_hf_models import make_model_dir
from tests.runtime.test_runtime_dist import hand_step, make_header, two_node_cluster

WORLD = 4


def _executor(header, model, rank, world, zero_stage=3):
    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.executor import Executor
    from zeppelin.runtime.groups import GroupCache, set_default_cache

    cache = GroupCache(world, header=header, steps=[hand_step(0, header.model)])
    set_default_cache(cache)
    return Executor(header, model, TokenSource(header.model.vocab_size, header.seed), rank=rank, world_size=world,
                    device=torch.device("cpu"), groups=cache, zero_stage=zero_stage)


def _whole_model(ref: str, seed: int):
    """Today's loader: the whole transformers model in every process (from_pretrained, or
    from_config under the seed), behind the runtime's interface."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from zeppelin.runtime.hf import HFCausalLM, register_attention
    from zeppelin.schemas.hf import hf_dir, hf_model_spec, hf_weight_files

    d = hf_dir(ref)
    config = AutoConfig.from_pretrained(str(d))
    config._attn_implementation = register_attention()
    if hf_weight_files(d):
        causal = AutoModelForCausalLM.from_pretrained(str(d), config=config, dtype=torch.float32)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            causal = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    causal.train()
    return HFCausalLM(causal, hf_model_spec(ref))


def _sharded_step(rank: int, world: int, ref: str, seed: int, export: str | None = None):
    from zeppelin.runtime.fsdp import full_params_and_grads, local_tensor
    from zeppelin.runtime.hf import build_hf_model, export_model
    from zeppelin.schemas.hf import hf_model_spec

    spec = hf_model_spec(ref)
    header = make_header(two_node_cluster(), spec, 1)
    step = hand_step(0, spec)
    model = build_hf_model(ref, seed=seed, spec=spec)
    ex = _executor(header, model, rank, world)
    read = getattr(model.weights, "bytes_read", None)
    held = sum(local_tensor(p.detach()).numel() * 4 for p in model.parameters())
    params, _ = full_params_and_grads(model)
    loss = ex.forward_backward(step).loss
    old = _executor(header, _whole_model(ref, seed), rank, world).forward_backward(step).loss
    if export:
        export_model(model, spec, export)
    return {"read": read, "held": held, "loss": loss, "old_loss": old,
            "params": params if rank == 0 else None}


def _want_state(d: Path, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForCausalLM

    if list(d.glob("*.safetensors")):
        m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(d)), dtype=torch.float32)
    return {k: v for k, v in m.state_dict().items() if not k.endswith("inv_freq")}


@pytest.mark.slow
@pytest.mark.parametrize("kind, weights", [("qwen2-tied", True), ("qwen3-moe", True), ("qwen3-moe", False),
                                           ("qwen2-tied", False)])
def test_each_rank_reads_its_rows_and_trains_the_same_loss(pool, tmp_path, kind, weights):
    if kind == "qwen3-moe":
        d = make_model_dir(tmp_path / kind, kind, seed=3)
    else:
        d = make_hf_dir(tmp_path / kind, kind.split("-")[0], tie=kind.endswith("tied"), seed=3)
    if not weights:
        for f in d.glob("*.safetensors"):
            f.unlink()
    outs = pool.run(_sharded_step, f"hf:{d}", 7, timeout=240)
    want = _want_state(d, 7)
    got = outs[0]["params"]
    assert set(got) == set(want) - ({"lm_head.weight"} if kind.endswith("tied") else set())
    for k in got:
        assert torch.equal(got[k], want[k]), k
    for o in outs:  # the same loss as the whole-model loader's, bit for bit
        assert o["loss"] == o["old_loss"] and o["loss"] == outs[0]["loss"]
    if weights:
        total = sum(v.numel() * 4 for k, v in want.items() if k in got)
        # every byte of the files is read once, by the rank holding it: a rank reads what it holds
        assert sum(o["read"] for o in outs) == total
        for o in outs:
            assert o["read"] == o["held"] and o["read"] < total / WORLD * 1.3
    else:
        assert all(o["read"] is None for o in outs)


def _own_model(rank: int, world: int, seed: int):
    from zeppelin.runtime.fsdp import full_params_and_grads
    from zeppelin.runtime.model import LlamaModel
    from zeppelin.schemas.model import model_preset

    spec = model_preset("tiny")
    header = make_header(two_node_cluster(), spec, 1)
    model = LlamaModel(spec, seed=seed, meta=True)
    ex = _executor(header, model, rank, world)
    params, _ = full_params_and_grads(model)
    loss = ex.forward_backward(hand_step(0, spec)).loss
    old = _executor(header, LlamaModel(spec, seed=seed), rank, world).forward_backward(hand_step(0, spec)).loss
    return {"params": params if rank == 0 else None, "loss": loss, "old_loss": old}


@pytest.mark.slow
def test_own_model_seeded_per_shard(pool):
    from zeppelin.runtime.model import LlamaModel
    from zeppelin.schemas.model import model_preset

    outs = pool.run(_own_model, 5, timeout=240)
    want = dict(LlamaModel(model_preset("tiny"), seed=5).named_parameters())
    assert set(outs[0]["params"]) == set(want)
    assert all(torch.equal(outs[0]["params"][k], want[k].detach()) for k in want)
    assert all(o["loss"] == o["old_loss"] for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_sharded_export_round_trips(pool, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    d = (make_model_dir(tmp_path / kind, kind, seed=3) if kind == "qwen3-moe"
         else make_hf_dir(tmp_path / kind, kind, seed=3))
    out = tmp_path / "export"
    outs = pool.run(_sharded_step, f"hf:{d}", 0, str(out), timeout=240)
    files = sorted(f.name for f in out.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    mine = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    with torch.no_grad():
        for k, v in mine.state_dict().items():
            if not k.endswith("inv_freq"):
                v.copy_(outs[0]["params"][k])  # the trained-on weights (the same here: no optimizer step)
        ids = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(0))
        a, b = mine(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert torch.equal(a, b)
