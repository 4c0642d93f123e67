"""The planner's two extension points (planner/zeppelin/protocols.py) and their registries: the
documented example family (docs/ARCHITECTURE.md, "Adding a candidate family"), registered by its one
registry line, is offered every step and wins a step where its plan is the fastest; every family
and every whole-step search holds to its protocol; a registered step search runs per micro-batch
count and its layouts come back as candidates."""

from __future__ import annotations

import importlib.util
import inspect
import re
import time
from pathlib import Path

import numpy as np

from tests.support.zeppelin_steps import record_results
from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.zeppelin import families, step_searches
from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
from zeppelin.planner.zeppelin.protocols import Candidate, Family, StepSearch
from zeppelin.planner.zeppelin.select import select
from zeppelin.planner.zeppelin.step_state import StepState
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
    offered = record_results(monkeypatch, example, "candidates")
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


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def test_every_family_and_step_search_holds_to_its_protocol():
    """Every registered family and whole-step search has a unique non-empty ``name`` and the
    protocol's function with the protocol's parameters (names, order, defaults), and each registry
    is keyed or ordered by those names."""
    for registry, protocol, function in ((list(families.REGISTRY.values()), Family, "candidates"),
                                         (list(step_searches.REGISTRY), StepSearch, "search")):
        want = _parameters(getattr(protocol, function))
        names = [m.name for m in registry]
        assert all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names)
        for module in registry:
            assert _parameters(getattr(module, function)) == want, f"{module.__name__}.{function}"
    assert list(families.REGISTRY) == [f.name for f in families.REGISTRY.values()]
    assert [s.name for s in step_searches.REGISTRY] == ["tiered", "node-cp", "node-major"]


def test_a_registered_step_search_runs_per_micro_batch_count_and_its_layouts_become_candidates(monkeypatch):
    """A step search registered by one line is run for every micro-batch count tried, after the
    ones before it, with the step's state, that count's micro-batches and the count's Round; what
    it offers comes back from ``search_step`` as a :class:`Candidate` scored by its predicted
    time, with the tiered plans' solver record."""
    calls, offered = [], []

    class Spy:
        name = "spy"

        @staticmethod
        def search(state, parts, found):
            calls.append((len(parts), len(found.found), sorted(i for p in parts for i in p)))
            built, t = found.found[0]
            found.offer(built, t * 0.5)  # the same layout again, better by its own account
            offered.append(t * 0.5)

    monkeypatch.setattr(step_searches, "REGISTRY", (*step_searches.REGISTRY, Spy))
    cl = cluster_preset("zeppelin-a:1x4")
    ctx = PlanContext(cl, model_preset("llama-7b"), default_profile(cl.name, cl.device))
    seqs = [Sequence(sample_id=i, length=n) for i, n in enumerate([4096, 2048, 2048, 1024, 1024, 512])]
    planner = ZeppelinPlanner(families="none")
    state = StepState(options=planner, ctx=ctx, tiering=planner.tiering(ctx), sequences=seqs,
                      lengths=np.array([s.length for s in seqs]), ilp_left=planner.ilp_budget_calls)
    got = step_searches.search_step(state, 0, simulate=False)
    assert calls and all(c[2] == list(range(len(seqs))) and c[1] >= 1 for c in calls)
    assert all(isinstance(c, Candidate) and c.finish is not None for c in got)
    assert [c.index for c in got] == list(range(len(got)))
    spy = got[-1]
    assert spy.score == offered[-1]
    plan = spy.build()
    assert sorted(p.seq for mb in plan.microbatches for p in mb.placements) == list(range(len(seqs)))
    spy.finish(plan, 0.25)
    assert plan.solver.time_s == 0.25 and "tiers" in plan.notes
