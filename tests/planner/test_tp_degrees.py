"""Every planner makes only tensor-parallel degrees the model's query and key/value heads allow.

Each registered planner plans one small step of every preset model on small clusters (four CPU
ranks for the CPU models; one node of 8 GPUs for every model, where TP-8 divides the node but not
every model's key/value heads; two nodes of 4 for two models); every
step must pass the plan invariants and the runnability check ``zeppelin run`` applies
(:func:`zeppelin.schemas.runnable.step_problem`). The seed case, Hydraulis on ``tiny`` (4 query, 2
key/value heads) on ``local-cpu:1x4``, is also planned and run with ``--verify`` through the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.runtime.test_runtime_dist import make_header
from zeppelin.planner.core.base import PLANNERS, PlanContext, get_planner
from zeppelin.planner.tools.validate import step_problems
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.model import MODEL_PRESETS, model_preset
from zeppelin.schemas.plan import Sequence
from zeppelin.schemas.runnable import step_problem

CPU_MODELS = ("tiny", "tiny-mha", "tiny-window", "small")
# the CPU models on four CPU ranks (tiny also on two nodes of two); every model on one node of 8
# H200s (TP-8 divides the node, not every model's heads); two models on two nodes of 4
CASES = ([(m, "local-cpu:1x4") for m in CPU_MODELS] + [("tiny", "local-cpu:2x2")]
         + [(m, "zeppelin-c:1") for m in MODEL_PRESETS]
         + [(m, "zeppelin-c:2x4") for m in ("qwen3-30b-a3b", "llama-30b")])


def _planners() -> list[str]:
    get_planner("zeppelin")  # imports every planner module
    return sorted(PLANNERS)


def _lengths(cap: int) -> list[int]:
    """A small step: a few sequences, the longest at most half of what one GPU holds."""
    top = max(16, min(cap // 2, 1024))
    return [top, top // 2, top // 4, top // 8, 16, 16]


@pytest.mark.parametrize("model, cluster", CASES)
def test_every_planner_makes_runnable_tp_degrees(model, cluster):
    cl, spec = cluster_preset(cluster), model_preset(model)
    header = make_header(cl, spec, 1)
    header = header.model_copy(update={"zero_stage": 3})
    ctx = PlanContext(cluster=cl, model=spec, profile=header.profile, zero_stage=3)
    seqs = [Sequence(sample_id=i, length=L) for i, L in enumerate(_lengths(ctx.cost.token_capacity))]
    degrees = set()
    for name in _planners():
        step = get_planner(name).plan_step(ctx, 0, seqs)
        assert step_problem(header, step) is None, (name, step_problem(header, step))
        assert step_problems(ctx, header, step) == [], (name, step_problems(ctx, header, step))
        degrees |= {r.tp for r in step.replicas or []}
    assert all(spec.tp_splits_heads(d) for d in degrees), degrees


def test_hydraulis_only_offers_degrees_dividing_both_head_counts():
    from zeppelin.planner.baselines.hydraulis import Hydraulis

    cl = cluster_preset("h100:1")
    for model, want in (("tiny", [1, 2]), ("qwen3-30b-a3b", [1, 2, 4]), ("llama-30b", [1, 2, 4]),
                        ("llama3-8b", [1, 2, 4, 8])):
        ctx = PlanContext(cluster=cl, model=model_preset(model), profile=make_header(cl, model_preset(model), 1).profile)
        assert Hydraulis()._degrees(ctx) == want, model


def test_plan_refuses_a_tp_degree_that_splits_the_key_value_heads(tmp_path):
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in [64, 128] * 8))
    p = _zeppelin(["plan", "-m", "m.jsonl", "-c", "local-cpu:1x4", "--model", "tiny", "--tp", "4", "--steps", "1",
                   "--tokens-per-step", "256", "-q", "-o", "p.jsonl"], tmp_path)
    assert (p.returncode, p.stderr) == (2, "zeppelin: error: --tp 4 does not divide the model's 4 query and "
                                           "2 key/value heads\n")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m.jsonl"]


def _zeppelin(args, cwd, timeout=300):
    from tests.runtime.test_hf import ZEPPELIN

    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([ZEPPELIN, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hydraulis_tiny_plans_and_runs_verified(tmp_path):
    """The regression: Hydraulis on ``tiny`` over 4 CPU ranks made a TP-4 replica (4 does not divide
    its 2 key/value heads); now it plans only degrees the heads allow (TP-1/TP-2 replicas of the 4
    ranks; under the local-cpu preset's measured gloo links TP-1 on this mix) and ``run --verify``
    passes."""
    from zeppelin.schemas.plan import PlanReader

    lengths = [96, 200, 300, 520, 2000, 4000] * 8  # before the fix: step 0 had a TP-4 replica
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in lengths))
    p = _zeppelin(["plan", "--planner", "hydraulis", "-m", "m.jsonl", "-c", "local-cpu:1x4", "--model", "tiny",
                   "--steps", "1", "--tokens-per-step", "4096", "-q", "-o", "p.jsonl"], tmp_path)
    assert p.returncode == 0, p.stderr
    tps = [r.tp for s in PlanReader(tmp_path / "p.jsonl") for r in s.replicas]
    assert set(tps) <= {1, 2} and sum(tps) == 4, tps
    p = _zeppelin(["run", "p.jsonl", "--verify", "--progress", "none"], tmp_path)
    assert p.returncode == 0, p.stderr
