"""The planner's memory model against what the runtime measures, on 4 gloo ranks.

One step of a ``packed-dp`` plan (every sequence on one rank: the attention and linear layouts
hold the same tokens) is planned under each ZeRO stage and recompute mode, run by the executor,
and each rank's measured memory (runtime/executor.py ``measured_memory``: the tensors the step
holds, by component) is compared with the plan's predicted total and with the cost model's
components for the tokens the rank holds: each within 10%. The built-in ``small`` model (fp32,
and bf16 for ZeRO-3) and a tiny Hugging Face Llama.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.runtime.test_runtime_dist import make_header
from zeppelin.planner.core.base import PlanContext, get_planner
from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import PlanHeader, Sequence, StepPlan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORLD = 4
TOL = 0.10
# two sequences per rank; enough tokens that activations are a large share of the peak
LENGTHS = {"small": [256] * 8, "hf": [512] * 8}


def _measure(rank: int, world: int, header_json: str, step_json: str, zero: int, recompute: str, dtype: str,
             hf: str | None):
    header = PlanHeader.model_validate_json(header_json)
    step = StepPlan.model_validate_json(step_json)
    ex = step_executor(rank, world, header, step, hf, zero_stage=zero, dtype=dtype, recompute=recompute)
    res = ex.forward_backward(step)
    ex.optimizer_step()
    return ex.measured_memory(res)


def step_executor(rank: int, world: int, header: PlanHeader, step: StepPlan, hf: str | None, seed: int = 0, **kw):
    """An executor of ``step`` on this rank (inside the pool's process group): the built-in model of
    the header (``seed``), or the Hugging Face model ``hf``; ``kw``: the executor's settings."""
    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.executor import Executor
    from zeppelin.runtime.groups import GroupCache, set_default_cache
    from zeppelin.runtime.model import LlamaModel

    cache = GroupCache(world, header=header, steps=[step])
    set_default_cache(cache)
    if hf is not None:
        from zeppelin.runtime.hf import load_hf_model

        model = load_hf_model(hf, seed=0, spec=header.model)
    else:
        model = LlamaModel(header.model, seed=seed)
    return Executor(header, model, TokenSource(header.model.vocab_size, header.seed), rank=rank, world_size=world,
                    device=torch.device("cpu"), groups=cache, **kw)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> str:
    from tests.runtime.test_hf import make_hf_dir

    return "hf:" + str(make_hf_dir(Path(tmp_path_factory.mktemp("hf")) / "llama", "llama", seed=1))


def _plan(spec, lengths, zero: int, recompute: str) -> tuple[PlanHeader, StepPlan]:
    header = make_header(cluster_preset("local-cpu:1x4"), spec, 1, planner="packed-dp")
    header = header.model_copy(update={"zero_stage": zero, "recompute": recompute})
    ctx = PlanContext(cluster=header.cluster, model=spec, profile=header.profile, zero_stage=zero,
                      recompute=recompute)
    seqs = [Sequence(sample_id=100 + i, length=L) for i, L in enumerate(lengths)]
    return header, get_planner("packed-dp").plan_step(ctx, 0, seqs)


CASES = ([("small", "fp32", z, r) for z in (0, 1, 2, 3) for r in ("none", "selective", "full")]
         + [("small", "bf16", 3, r) for r in ("none", "full")]
         + [("hf", "fp32", z, r) for z in (0, 2, 3) for r in ("none", "selective", "full")])


@pytest.mark.parametrize("model, dtype, zero, recompute", CASES)
def test_predicted_memory_matches_measured(pool, hf_llama, model, dtype, zero, recompute):
    from zeppelin.schemas.model import resolve_model_ref

    hf = hf_llama if model == "hf" else None
    spec = resolve_model_ref(hf) if hf else model_preset(model)
    spec = spec.model_copy(update={"dtype": dtype})
    header, step = _plan(spec, LENGTHS[model], zero, recompute)
    outs = pool.run(_measure, header.model_dump_json(), step.model_dump_json(), zero, recompute, dtype, hf,
                    timeout=240)
    cost = CostModel(header.cluster, spec, header.profile, zero_stage=zero, recompute=recompute)
    for rank, mem in enumerate(outs):
        tokens = mem["activation_tokens"]
        assert tokens == sum(LENGTHS[model]) // WORLD
        predicted = step.prediction.per_unit.memory_gb[rank] * 1e9   # the plan's figure (one rank per unit)
        assert abs(predicted - mem["measured"]) <= TOL * mem["measured"], (rank, predicted, mem)
        comp = cost.memory_components(tokens)
        for name, want in comp.items():
            got, want = mem.get(name, 0), float(want)
            assert abs(want - got) <= TOL * max(got, 1e-3 * mem["measured"]), (rank, name, want, got)
        # activations are a sizeable part of the peak in every case
        assert mem["activations"] + mem["recompute"] >= 0.15 * mem["measured"], mem


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_profiled_activation_memory_equals_the_formulas(dtype):
    """`zeppelin profile`'s measurement (one process, one and two layers, two lengths) gives the
    cost model's per-token figures for every recompute mode."""
    from zeppelin.runtime.profiler import measure_activation_memory

    spec = model_preset("tiny").model_copy(update={"dtype": dtype})
    got = measure_activation_memory(spec, torch.device("cpu"))
    for mode, v in got.items():
        want = CostModel(cluster_preset("local-cpu:1x4"), spec, recompute=mode).activation_split
        assert v["activations"] == pytest.approx(want[0], rel=1e-3) and v["recompute"] == pytest.approx(want[1], rel=1e-3)


def test_ring_attention_holds_what_the_model_charges(pool):
    """Sequences split over rings of two ranks (te-cp, cp=2) hold the same per token as local ones:
    each rank keeps its chunk's Q, K, V, output and log-sum-exp (the received K/V blocks are not
    kept for the backward)."""
    from tests.runtime.test_runtime_dist import planner_step

    spec = model_preset("small")
    header = make_header(cluster_preset("local-cpu:1x4"), spec, 1, planner="te-cp")
    header = header.model_copy(update={"zero_stage": 2})
    step = planner_step("te-cp", header, [512] * 4, 0, cp=2)
    assert all(g.kind == "ring" for mb in step.microbatches for g in mb.groups)
    outs = pool.run(_measure, header.model_dump_json(), step.model_dump_json(), 2, "none", "fp32", None,
                    timeout=240)
    cost = CostModel(header.cluster, spec, header.profile, zero_stage=2)
    for mem in outs:
        assert mem["activation_tokens"] == 512
        want = float(sum(cost.memory_components(512).values()))
        assert abs(want - mem["measured"]) <= TOL * mem["measured"], (want, mem)
