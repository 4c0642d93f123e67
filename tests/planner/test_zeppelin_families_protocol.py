"""docs/ARCHITECTURE.md, "Adding a candidate family": the example family there, registered by its
one registry line, is offered every step and wins a step where its plan is the fastest."""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.zeppelin import families
from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
from zeppelin.planner.zeppelin.select import select
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Sequence
from zeppelin.schemas.profile import default_profile

ROOT = Path(__file__).resolve().parents[2]


def _example_family(tmp_path):
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = page[page.index("## Adding a candidate family"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    path = tmp_path / "example_local.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("example_local", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_example_family_is_offered_and_can_win(tmp_path, monkeypatch):
    example = _example_family(tmp_path)
    monkeypatch.setitem(families.REGISTRY, example.name, example)  # the one registry line
    offered = []
    real = example.candidates

    def spy(*a, **k):
        got = real(*a, **k)
        offered.append(got)
        return got

    monkeypatch.setattr(example, "candidates", spy)
    cl = cluster_preset("zeppelin-a:1x4")
    ctx = PlanContext(cl, model_preset("llama-7b"), default_profile(cl.name, cl.device))
    seqs = [Sequence(sample_id=i, length=n) for i, n in enumerate([4096, 2048, 2048, 1024, 1024, 512])]
    plan = ZeppelinPlanner(families="all").plan_step(ctx, 0, seqs)  # "all" includes it
    assert offered and offered[0][0].score > 0
    assert sorted(p.seq for mb in plan.microbatches for p in mb.placements) == list(range(len(seqs)))
    # judged alone, the example's plan is the step's plan, recorded by select
    alone = select(ctx, 0, seqs, [], [example.name], margin=None, routing=True, t0=time.perf_counter())
    assert alone.notes["family"] == "example-local" and alone.solver.name == "greedy"
    assert all(g.kind == "local" for mb in alone.microbatches for g in mb.groups)
