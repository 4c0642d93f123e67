"""A plan whose micro-batches each choose their recomputation (``none``, ``selective``, ``full``,
``full:k``) on 4 gloo ranks under FSDP2 at ZeRO-2 and ZeRO-3, for the built-in ``small`` model and
a tiny Hugging Face Llama: ``--verify`` equals the single-process reference, the model is wrapped
once (the same modules before and after the step), and each micro-batch's measured activation
memory, and the rank's memory with it, is within 5% of what the cost model predicts for its
choice.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.runtime.test_runtime_dist import make_header
from zeppelin.planner.costmodel.context import PlanContext
from zeppelin.planner.costmodel.predict import predict_step
from zeppelin.schemas.invariants import plan_problems
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Group, MicroBatch, Placement, PlanHeader, Sequence, StepPlan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORLD = 4
TOL = 0.05
MODES = ("none", "selective", "full", "full:k")  # full:k: the first half of the layers
LENGTH = 192  # every rank holds one sequence of this length per micro-batch


def mixed_step(header: PlanHeader, modes=MODES, length: int = LENGTH) -> StepPlan:
    """One step of ``len(modes)`` micro-batches, each rank holding one whole sequence in each; the
    micro-batches take ``modes`` in turn (``full:k``: half the layers), predicted under those choices."""
    k = max(header.model.num_layers // 2, 1)
    modes = [m.replace(":k", f":{k}") for m in modes]
    mbs, seqs = [], []
    for i, mode in enumerate(modes):
        groups = [Group(kind="local", tier="local", units=[u]) for u in range(WORLD)]
        pls = [Placement(seq=len(seqs) + u, group=u, ranges=[[[0, length - 7 * u]]]) for u in range(WORLD)]
        seqs += [Sequence(sample_id=10 * i + u, length=length - 7 * u) for u in range(WORLD)]
        mbs.append(MicroBatch(groups=groups, placements=pls, queues=[[u] for u in range(WORLD)],
                              recompute=None if mode == "none" else mode))
    step = StepPlan(step=0, sequences=seqs, microbatches=mbs)
    ctx = PlanContext(header.cluster, header.model, header.profile, zero_stage=header.zero_stage,
                      recompute=header.recompute)
    step.prediction = predict_step(ctx, step)
    return step


def _run(rank: int, world: int, header_json: str, step_json: str, hf: str | None):
    from tests.runtime.test_memory_model import step_executor
    from zeppelin.runtime.fsdp import decoder_blocks
    from zeppelin.runtime.train.verify import verify_step

    header = PlanHeader.model_validate_json(header_json)
    step = StepPlan.model_validate_json(step_json)
    ex = step_executor(rank, world, header, step, hf, seed=3, zero_stage=header.zero_stage,
                       recompute=header.recompute)
    model = ex.model
    before = [id(m) for m in model.modules()]
    res = ex.forward_backward(step, keep_hidden=True)
    report = verify_step(ex, step, res, 1e-5)
    ex.optimizer_step()
    wrapped = sum(type(m).__name__.endswith("SwitchableCheckpoint") for m in decoder_blocks(model).modules())
    return {"report": report, "memory": ex.measured_memory(res), "same_modules": before == [id(m) for m in model.modules()],
            "wrappers": wrapped, "layers": len(decoder_blocks(model))}


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> str:
    from tests.runtime.test_hf import make_hf_dir

    return "hf:" + str(make_hf_dir(Path(tmp_path_factory.mktemp("hf")) / "llama", "llama", seed=1))


def _held_bytes_per_token(cost, mode: str) -> float:
    """What the model charges a token under ``mode`` that a CPU rank measures: the forward's and one
    recomputation's bytes, without the loss's transient gradients (the cost model's ``loss``
    component, which the executor's count of held tensors does not see; tests/runtime/
    test_loss_memory.py measures it apart)."""
    _, rec = cost.recompute_split(mode)
    return cost.recompute_bytes_per_token(mode) - cost.loss_extra_bytes(rec)


@pytest.mark.parametrize("model, zero", [("small", 2), ("small", 3), ("hf", 2), ("hf", 3)])
def test_mixed_recompute_plan_verifies_and_holds_what_is_predicted(pool, hf_llama, model, zero):
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.schemas.model import resolve_model_ref

    hf = hf_llama if model == "hf" else None
    spec = resolve_model_ref(hf) if hf else model_preset("small")
    header = make_header(cluster_preset("local-cpu:1x4"), spec, 1, planner="hand")
    header = header.model_copy(update={"zero_stage": zero, "recompute": "per-microbatch"})
    step = mixed_step(header)
    outs = pool.run(_run, header.model_dump_json(), step.model_dump_json(), hf, timeout=240)
    rep = outs[0]["report"]
    assert rep["ok"] and rep["loss_rel"] <= 1e-5 and rep["hidden_rel"] <= 1e-5, rep
    cost = CostModel(header.cluster, spec, header.profile, zero_stage=zero, recompute="per-microbatch")
    state = cost.model_state_bytes()
    for rank, out in enumerate(outs):
        assert out["same_modules"] and out["wrappers"] == 2 * out["layers"], out
        mem = out["memory"]
        got_modes = [m["recompute"] for m in mem["microbatches"]]
        assert got_modes == [mb.recompute or "none" for mb in step.microbatches]
        assert [m.partition(":")[0] for m in got_modes] == ["none", "selective", "full", "full"]
        measured_state = sum(mem[k] for k in ("params", "grads", "optimizer", "unsharded"))
        for mb in mem["microbatches"]:
            assert mb["tokens"] == LENGTH - 7 * rank
            act = mb["activations"] + mb["recompute_bytes"]
            want = mb["tokens"] * _held_bytes_per_token(cost, mb["recompute"])
            assert abs(act - want) <= TOL * act, (rank, mb, want)
            total, want_total = measured_state + act, state + want
            assert abs(total - want_total) <= TOL * total, (rank, mb, want_total, total)
        # the choices differ in what they hold: none > selective > full, full:2 between full and none
        none, sel, full, part = (m["activations"] + m["recompute_bytes"] for m in mem["microbatches"])
        assert none > sel > full and part > full


@pytest.mark.parametrize("zero", [2, 3])
def test_recompute_on_some_units_only_verifies_and_each_rank_holds_its_own(pool, zero):
    """Micro-batches whose units run different choices (``recompute_units``): every rank runs its
    own unit's - the ranks of one micro-batch differ - and the step still equals the single-process
    reference; each rank's measured activations are its choice's prediction."""
    from zeppelin.planner.costmodel.cost import CostModel

    spec = model_preset("small")
    header = make_header(cluster_preset("local-cpu:1x4"), spec, 1, planner="hand")
    header = header.model_copy(update={"zero_stage": zero, "recompute": "per-microbatch"})
    step = mixed_step(header, modes=("selective", "full:k"))
    k = spec.num_layers // 2
    # micro-batch 0: selective on units 1 and 3, none elsewhere; 1: full:k on unit 0, none on 2 and 3,
    # the micro-batch's own selective on unit 1
    step.microbatches[0].recompute, step.microbatches[0].recompute_units = None, {"selective": [1, 3]}
    step.microbatches[1].recompute, step.microbatches[1].recompute_units = "selective", {
        f"full:{k}": [0], "none": [2, 3]}
    step.prediction = predict_step(PlanContext(header.cluster, spec, header.profile, zero_stage=zero,
                                               recompute=header.recompute), step)
    assert plan_problems(header, step) == []
    outs = pool.run(_run, header.model_dump_json(), step.model_dump_json(), None, timeout=240)
    rep = outs[0]["report"]
    assert rep["ok"] and rep["loss_rel"] <= 1e-5 and rep["hidden_rel"] <= 1e-5, rep
    cost = CostModel(header.cluster, spec, header.profile, zero_stage=zero, recompute="per-microbatch")
    want_modes = [["none", "selective", "none", "selective"], [f"full:{k}", "selective", "none", "none"]]
    for rank, out in enumerate(outs):
        mbs = out["memory"]["microbatches"]
        assert [m["recompute"] for m in mbs] == [want_modes[0][rank], want_modes[1][rank]]
        for m in mbs:
            act = m["activations"] + m["recompute_bytes"]
            want = m["tokens"] * _held_bytes_per_token(cost, m["recompute"])
            assert abs(act - want) <= TOL * act, (rank, m, want)


def test_recompute_on_one_of_two_tensor_parallel_units_verifies(pool):
    """TP-2 units (2 ranks each): the units' choices differ, the ranks of each unit agree (their TP
    collectives run again inside the recomputed forward together), and the step equals the
    single-process reference."""
    spec = model_preset("small")
    header = make_header(cluster_preset("local-cpu:1x4"), spec, 1, planner="hand")
    header = header.model_copy(update={"zero_stage": 3, "recompute": "per-microbatch", "tp": 2})
    mbs, seqs = [], []
    for i, (mode, units) in enumerate((("selective", [1]), ("full", [0]))):
        groups = [Group(kind="local", tier="local", units=[u]) for u in range(2)]
        pls = [Placement(seq=len(seqs) + u, group=u, ranges=[[[0, LENGTH - 9 * u]]]) for u in range(2)]
        seqs += [Sequence(sample_id=10 * i + u, length=LENGTH - 9 * u) for u in range(2)]
        mbs.append(MicroBatch(groups=groups, placements=pls, queues=[[0], [1]], recompute_units={mode: units}))
    step = StepPlan(step=0, sequences=seqs, microbatches=mbs)
    assert plan_problems(header, step) == []
    outs = pool.run(_run, header.model_dump_json(), step.model_dump_json(), None, timeout=240)
    rep = outs[0]["report"]
    assert rep["ok"] and rep["loss_rel"] <= 1e-5 and rep["hidden_rel"] <= 1e-5, rep
    got = [[m["recompute"] for m in out["memory"]["microbatches"]] for out in outs]
    assert got == [["none", "full"], ["none", "full"], ["selective", "none"], ["selective", "none"]]
