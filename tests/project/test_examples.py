"""The bring-your-own-loop examples (examples/) train on 2 gloo ranks exactly like one process.

Each example trains a few steps of a zeppelin plan (rings, local sequences, a remapped step;
Ulysses) and must give the same step losses and the same gradients, step after step, as a
single-process reference that knows nothing of zeppelin (whole sequences, plain SDPA attention),
within 1e-5 in float32.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.clusters import cluster_preset  # local-cpu over fast links
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import read_plan, write_plan

from tests.runtime.test_runtime_dist import make_header, planner_step
from tests.support.numerics import assert_matches_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
TOL = 1e-5
STEPS = [[600, 60, 33, 8, 5, 3, 1], [250, 60, 33, 8], [180, 150, 21, 2]]
VOCAB = 256
# SGD: the comparison stays well-conditioned over steps (Adam's first update is ~lr*sign(g), which
# turns fp32 summation-order noise in near-zero gradient entries into lr-sized parameter changes)
LR = 0.5


def tokens(sample_id: int) -> list[int]:
    """Token ids of a sample (deterministic, not a progression the model learns at once)."""
    g = torch.Generator().manual_seed(sample_id)
    return torch.randint(0, VOCAB, (1000,), generator=g).tolist()


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("example_plans")
    out = {}
    for key, opts in {"rings": {"intra": "ring"}, "ulysses": {}}.items():
        header = make_header(cluster_preset("local-cpu:1x2"), model_preset("tiny"), len(STEPS), planner="zeppelin")
        steps = [planner_step("zeppelin", header, lens, k, **opts) for k, lens in enumerate(STEPS)]
        kinds = {g.kind for st in steps for mb in st.microbatches for g in mb.groups}
        assert kinds >= ({"ring", "local"} if key == "rings" else {"ulysses"}), kinds
        if key == "rings":
            assert any(mb.linear_layout is not None for st in steps for mb in st.microbatches)
        path = d / f"{key}.jsonl"
        write_plan(path, header, steps)
        out[key] = str(path)
    return out


def _hf_on_rank(rank: int, world: int, plan: str):
    ex = load_example("hf_fsdp2_loop")
    return ex.train(plan, rank, world, lr=LR, optimizer="sgd", data=tokens, keep_grads=True)


def _hf_reference(plan: str) -> dict:
    """transformers alone, one process: each sequence whole, SDPA, the same optimizer."""
    ex = load_example("hf_fsdp2_loop")
    header, steps = read_plan(plan)
    model = ex.build_model(header.model, 0, attn_implementation="sdpa")
    opt = ex.make_optimizer(model.parameters(), "sgd", LR)
    out = {"losses": [], "grads": []}
    for st in steps:
        norm = sum(s.length - 1 for s in st.sequences)
        total = 0.0
        for s in st.sequences:
            ids = torch.tensor(tokens(s.sample_id)[: s.length])[None]
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            loss = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum") / norm
            loss.backward()
            total += float(loss.detach())
        out["losses"].append(total)
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out


def _compare(got: dict, ref: dict) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == len(STEPS)
    for k, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert_matches_reference(a, b, TOL, f"step {k} loss")
    for k, (ga, gb) in enumerate(zip(got["grads"], ref["grads"])):
        assert set(ga) == set(gb)
        for n in gb:
            assert_matches_reference(ga[n], gb[n], TOL, f"step {k} gradient of {n}")


@pytest.mark.parametrize("plan", ["rings", "ulysses"])
def test_hf_fsdp2_loop_matches_single_process_transformers(pool, plans, plan):
    outs = pool.run(_hf_on_rank, plans[plan], timeout=300)
    assert outs[0]["losses"] == outs[1]["losses"]
    ref = _hf_reference(plans[plan])
    _compare(outs[0], ref)
    assert all(p is not None and p > 0 for p in outs[0]["predicted_s"])


def _titan_on_rank(rank: int, world: int, plan: str):
    ex = load_example("torchtitan_llama")
    return ex.train(plan, rank, world, lr=LR, data=tokens, keep_grads=True)


def _titan_reference(plan: str) -> dict:
    """torchtitan alone, one process: its Llama 3 with its stock SDPA inner attention, each
    sequence whole (default positions), the same SGD."""
    ex = load_example("torchtitan_llama")
    header, steps = read_plan(plan)
    model = ex.build_model(header.model, 0, zeppelin=False)
    same = ex.build_model(header.model, 0, zeppelin=True).state_dict()
    assert all(torch.equal(t, same[n]) for n, t in model.state_dict().items())  # same initial weights
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = {"losses": [], "grads": []}
    for st in steps:
        norm = sum(s.length - 1 for s in st.sequences)
        total = 0.0
        for s in st.sequences:
            ids = torch.tensor(tokens(s.sample_id)[: s.length])[None]
            logits = model(ids)[0].float()
            loss = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum") / norm
            loss.backward()
            total += float(loss.detach())
        out["losses"].append(total)
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("plan", ["rings", "ulysses"])
def test_torchtitan_llama_matches_single_process_torchtitan(pool, plans, plan):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (./dev setup installs it)")
    outs = pool.run(_titan_on_rank, plans[plan], timeout=300)
    assert outs[0]["losses"] == outs[1]["losses"]
    _compare(outs[0], _titan_reference(plans[plan]))


def test_hf_fsdp2_loop_runs_from_the_command_line(plans):
    """The README command: torchrun on 2 processes, one line per step."""
    torchrun = Path(sys.executable).parent / "torchrun"
    r = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" /
                        "hf_fsdp2_loop.py"), plans["rings"], "--steps", "2"], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split(":")[0] for ln in lines] == ["step 0", "step 1"]
