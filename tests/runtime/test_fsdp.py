"""FSDP2 runtime on 4 gloo ranks: exact training steps, sharded memory, recomputation, DCP resume.

Each distributed case trains several AdamW steps of planner output (zeppelin, te-cp, FlexSP,
Hydraulis) with the model sharded by FSDP2 at ZeRO-2 or ZeRO-3, and ``--verify`` compares every
step (loss, final hidden states, every gradient, gathered from the shards) with the
single-process fp32 reference within 1e-5.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tests.runtime.test_runtime_dist import make_header, planner_step
from tests.runtime.test_flexsp_hydraulis_tp_plans import planned_step, seed_header, tight_cluster

from tests.support.clusters import cluster_preset  # local-cpu over fast links
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import PlanHeader, StepPlan, write_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORLD = 4
ROOT = Path(__file__).resolve().parents[2]


def _train(rank: int, world: int, header_json: str, steps_json: list[str], dp: str = "fsdp", zero_stage: int = 3,
           dtype: str = "fp32", recompute: str = "none", hsdp: int | None = None, verify: bool = True,
           tol: float = 1e-5, ckpt: str | None = None, save_after: int | None = None, resume: bool = False,
           hf: str | None = None):
    """Train the steps on this rank; returns losses, verify reports, memory figures and (rank 0)
    the whole final parameters."""
    from zeppelin.runtime.checkpoint import (
        latest_checkpoint,
        load_checkpoint_tensors,
        read_checkpoint_state,
        rng_state,
        save_checkpoint,
    )
    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.executor import Executor
    from zeppelin.runtime.fsdp import full_params_and_grads
    from zeppelin.runtime.groups import GroupCache, set_default_cache
    from zeppelin.runtime.model import LlamaModel
    from zeppelin.runtime.train.verify import verify_step

    header = PlanHeader.model_validate_json(header_json)
    steps = [StepPlan.model_validate_json(s) for s in steps_json]
    cache = GroupCache(world, header=header, steps=steps)
    set_default_cache(cache)
    model = LlamaModel(header.model, seed=3)
    ex = Executor(header, model, TokenSource(header.model.vocab_size, header.seed), rank=rank, world_size=world,
                  device=torch.device("cpu"), groups=cache, dp=dp, zero_stage=zero_stage, dtype=dtype,
                  recompute=recompute, hsdp=hsdp, weight_decay=0.1)
    if hf is not None:  # a transformers model from DIR instead of the runtime's own Llama
        from zeppelin.runtime.hf import load_hf_model

        model = load_hf_model(hf, seed=0, spec=header.model)
        ex = Executor(header, model, TokenSource(header.model.vocab_size, header.seed), rank=rank,
                      world_size=world, device=torch.device("cpu"), groups=cache, dp=dp, zero_stage=zero_stage,
                      dtype=dtype, recompute=recompute, hsdp=hsdp, weight_decay=0.1)
    first = 0
    if resume:
        path = latest_checkpoint(ckpt)
        first = read_checkpoint_state(path, plan_hash="h", world_size=world)["next_step"]
        load_checkpoint_tensors(path, model, ex.optimizer)
    losses, reports, memory = [], [], []
    for k in range(first, len(steps)):
        res = ex.forward_backward(steps[k], keep_hidden=verify)
        if verify:
            reports.append(verify_step(ex, steps[k], res, tol))
        ex.optimizer_step()
        memory.append(ex.measured_memory(res) | {"tokens": res.tokens})
        losses.append(res.loss)
        if save_after is not None and k + 1 == save_after:
            import torch.distributed as dist

            rngs = [None] * world
            dist.all_gather_object(rngs, rng_state())
            save_checkpoint(ckpt, next_step=k + 1, model=model, optimizer=ex.optimizer, rng_states=rngs,
                            plan_hash="h", world_size=world, rank=rank,
                            extra={"hyperparameters": {"lr": 1e-3, "weight_decay": 0.0, "seed": 0}})
            break
    params, _ = full_params_and_grads(model)
    return {"losses": losses, "reports": reports, "memory": memory, "params": params if rank == 0 else None}


LENS = [[400, 150, 90, 60, 45, 29, 17, 13, 11, 9, 7, 5, 3, 2, 1],
        [300, 200, 120, 33, 21, 8, 5, 4, 2, 1],
        [350, 90, 80, 70, 60, 12, 6, 3],
        [250, 240, 100, 50, 25, 12, 6],
        [420, 60, 44, 33, 22, 11, 7, 5, 1]]


def _plan(planner: str) -> tuple[PlanHeader, list[StepPlan]]:
    """Five steps of a planner's output on 4 ranks (tiny model)."""
    tiny = model_preset("tiny")
    if planner == "zeppelin":
        header = make_header(cluster_preset("local-cpu:2x2"), tiny, len(LENS), planner="zeppelin")
        return header, [planner_step("zeppelin", header, ls, k) for k, ls in enumerate(LENS)]
    if planner == "te-cp":
        header = make_header(cluster_preset("local-cpu:1x4"), tiny, len(LENS), planner="te-cp")
        return header, [planner_step("te-cp", header, ls, k, cp=2) for k, ls in enumerate(LENS)]
    if planner == "flexsp":
        header = seed_header(tight_cluster(), tiny, len(LENS), "flexsp")
        return header, [planned_step("flexsp", header, ls, k) for k, ls in enumerate(LENS)]
    header = seed_header(cluster_preset("local-cpu:1x4"), tiny, len(LENS), "hydraulis")
    return header, [planned_step("hydraulis", header, ls, k, tp_degrees="1,2") for k, ls in enumerate(LENS)]


def _run(pool, header, steps, **kw):
    return pool.run(_train, header.model_dump_json(), [s.model_dump_json() for s in steps], timeout=240, **kw)


def _check_verified(outs, n_steps: int, tol: float = 1e-5):
    reports = outs[0]["reports"]
    assert len(reports) == n_steps >= 5
    for rep in reports:
        assert rep["ok"] and rep["loss_rel"] <= tol and rep["hidden_rel"] <= tol, rep
        assert rep["grad_rel"] <= tol or rep["grad_rel_vs_fp64"] <= max(tol, 2 * rep["fp32_reference_vs_fp64"]), rep
    # every rank saw the same (all-reduced) loss, and the loss moved
    assert all(o["losses"] == outs[0]["losses"] for o in outs)
    assert outs[0]["losses"][0] != outs[0]["losses"][-1]


@pytest.mark.parametrize("planner,zero_stage", [("zeppelin", 3), ("hydraulis", 3), ("zeppelin", 2),
                                                ("hydraulis", 2), ("te-cp", 2), ("flexsp", 3)])
def test_fsdp_plans_train_exactly(pool, planner, zero_stage):
    """Five AdamW steps, every step equal to the single-process reference (loss, outputs, every
    gradient) with the model sharded by FSDP2 (Hydraulis: mixed TP-1/TP-2 replicas)."""
    header, steps = _plan(planner)
    if planner == "hydraulis":
        assert any(r.tp == 2 for s in steps for r in s.replicas)
    outs = _run(pool, header, steps, zero_stage=zero_stage)
    _check_verified(outs, len(steps))


def test_sharded_state_is_a_quarter_of_the_replicated_run(pool):
    """Parameter + optimizer bytes per rank: ZeRO-3 and ZeRO-2 hold ~1/N of the replicated run
    (within 10% plus one unsharded block); the trained parameters agree with the replicated run."""
    header, steps = _plan("zeppelin")
    steps = steps[:2]
    rep = _run(pool, header, steps, dp="replicate", verify=False)
    spec = header.model
    block_bytes = spec.params_per_layer() * 4
    whole = rep[0]["memory"][-1]["params"] + rep[0]["memory"][-1]["optimizer"]
    assert spec.num_params() * 12 <= whole <= spec.num_params() * 12 + 4096  # fp32 weights, 2 moments, steps
    for z in (3, 2):
        outs = _run(pool, header, steps, zero_stage=z, verify=False)
        for o in outs:
            held = o["memory"][-1]["params"] + o["memory"][-1]["optimizer"]
            assert abs(held - whole / WORLD) <= 0.1 * whole / WORLD + block_bytes, (z, held, whole)
        for name, p in rep[0]["params"].items():
            assert torch.allclose(outs[0]["params"][name], p, rtol=1e-4, atol=1e-6), name


def test_recompute_full_holds_less_per_token_and_stays_exact(pool):
    """The planner's model: --recompute full holds more tokens per GPU than none; the runtime's
    measured activation bytes per token fall the same way, and the recomputed steps stay exact."""
    from zeppelin.planner.costmodel.cost import CostModel

    header, steps = _plan("zeppelin")
    caps = {r: CostModel(header.cluster, header.model, header.profile, recompute=r).token_capacity
            for r in ("none", "selective", "full")}
    assert caps["full"] > caps["selective"] > caps["none"]
    per_token = {}
    for r in ("none", "selective", "full"):
        outs = _run(pool, header, steps[:1], recompute=r, verify=r != "none")
        if r != "none":
            rep = outs[0]["reports"][0]
            assert rep["ok"] and rep["loss_rel"] <= 1e-5, rep
        per_token[r] = max(m["activations"] / m["activation_tokens"] for o in outs for m in o["memory"]
                           if m["activation_tokens"])
    assert per_token["full"] < per_token["selective"] < per_token["none"], per_token


def test_bf16_and_hybrid_sharding_verify(pool):
    """bf16 compute (fp32 master weights and reductions) within 2e-2 of the fp32 reference; hybrid
    sharding over a 2 x 2 mesh (shard in pairs, replicate across) within 1e-5."""
    header, steps = _plan("zeppelin")
    outs = _run(pool, header, steps[:2], dtype="bf16", tol=2e-2)
    for rep in outs[0]["reports"]:
        assert rep["ok"] and 0 < rep["grad_rel"] <= 2e-2, rep
    outs = _run(pool, header, steps[:2], hsdp=2)
    for rep in outs[0]["reports"]:
        assert rep["ok"] and rep["loss_rel"] <= 1e-5, rep


def test_dcp_resume_is_bit_identical(pool, tmp_path):
    """4 steps straight vs 2 steps, a DCP checkpoint, a fresh job resuming for 2 more: the same
    losses and the same parameters, bit for bit (ZeRO-3 shards)."""
    header, steps = _plan("zeppelin")
    steps = steps[:4]
    straight = _run(pool, header, steps, verify=False)
    ckpt = tmp_path / "ckpt"
    first = _run(pool, header, steps, verify=False, ckpt=str(ckpt), save_after=2)
    files = sorted(p.name for p in (ckpt / "ckpt-000002").iterdir())
    assert "state.json" in files and all(f.endswith(".safetensors") or f == "state.json" for f in files), files
    assert (ckpt / "latest").read_text() == "ckpt-000002\n"
    second = _run(pool, header, steps, verify=False, ckpt=str(ckpt), resume=True)
    assert first[0]["losses"] + second[0]["losses"] == straight[0]["losses"]
    for name, p in straight[0]["params"].items():
        assert torch.equal(second[0]["params"][name], p), name


def test_checkpoint_pointer_is_confined_to_the_directory(tmp_path):
    from zeppelin.runtime.checkpoint import latest_checkpoint
    from zeppelin.schemas.common import InputError

    (tmp_path / "latest").write_text("../elsewhere\n")
    with pytest.raises(InputError, match=r"checkpoint pointer names '\.\./elsewhere', not a checkpoint of this "
                                         r"directory \(expected ckpt-NNNNNN\)"):
        latest_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("ckpt-000007\n")
    with pytest.raises(InputError, match="checkpoint pointer names 'ckpt-000007', which does not exist"):
        latest_checkpoint(tmp_path)


def test_no_pickle_loads_in_the_package():
    """Nothing the package reads from disk or from its workers is unpickled."""
    bad = re.compile(r"weights_only\s*=\s*False|pickle\.loads?\(|cPickle|dill\.|allow_pickle\s*=\s*True")
    found = []
    for folder in ("schemas", "planner", "runtime"):
        for f in (ROOT / folder).rglob("*.py"):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if bad.search(line):
                    found.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []


def test_run_refuses_a_plan_made_for_another_recompute(tmp_path):
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks
    from zeppelin.schemas.common import InputError

    header, steps = _plan("zeppelin")
    header = header.model_copy(update={"recompute": "full", "num_steps": 1})
    path = tmp_path / "p.jsonl"
    write_plan(path, header, steps[:1])
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan=str(path), recompute="none"), WORLD)
    assert str(e.value) == ("the plan was made for --recompute full (its activation memory per token), not none; "
                            "re-plan with `zeppelin plan --recompute none` or pass --recompute-override")
    startup_checks(RunConfig(plan=str(path), recompute="none", recompute_override=True), WORLD)
    startup_checks(RunConfig(plan=str(path)), WORLD)


def test_metrics_memory_record_and_report():
    """Each rank's measured memory sits beside the plan's prediction for its unit; a step over the
    GPU's memory is listed, and the report summarises measured vs predicted."""
    from zeppelin.planner.sim.report import memory_row, memory_summary
    from zeppelin.runtime.train.metrics import memory_record

    header, steps = _plan("zeppelin")
    step = steps[0]
    cap = header.cluster.gpu.memory_gb * 1e9
    mems = [{"measured": 1000 + r, "params": 10, "grads": 20, "optimizer": 30, "activations": 400,
             "activation_tokens": 100, "process_peak": 5000} for r in range(WORLD)]
    mems[2]["measured"] = int(cap) + 1
    per_rank = [({}, {}, 100, m) for m in mems]
    rec = memory_record(step, per_rank, header)
    gb = step.prediction.per_unit.memory_gb
    assert rec["predicted_bytes"] == [int(gb[r] * 1e9) for r in range(WORLD)]  # one rank per unit here
    assert rec["exceeds_capacity"] == [2]
    assert rec["activation_bytes_per_token"] == [4.0] * WORLD
    row = memory_row({"memory": rec})
    assert row["rank"] == 2 and row["measured_bytes"] == int(cap) + 1
    summ = memory_summary([row, None])
    assert summ["steps_exceeding_capacity"] == [0] and summ["peak_measured_bytes"] == int(cap) + 1


def test_transformers_model_sharded_with_full_recompute(pool, tmp_path):
    """A transformers Llama (``--model hf:DIR``) sharded by FSDP2 at ZeRO-3 with every decoder
    layer recomputed: two AdamW steps equal transformers' own single-process step within 1e-5."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeppelin.schemas.hf import hf_model_spec

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"))
    ref = f"hf:{tmp_path / 'hf'}"
    spec = hf_model_spec(ref)
    header = make_header(cluster_preset("local-cpu:2x2"), spec, 2, planner="zeppelin")
    steps = [planner_step("zeppelin", header, ls, k) for k, ls in enumerate(LENS[:2])]
    outs = _run(pool, header, steps, zero_stage=3, recompute="full", hf=ref)
    for rep in outs[0]["reports"]:
        assert rep["ok"] and rep["loss_rel"] <= 1e-5 and rep["hidden_rel"] <= 1e-5, rep
