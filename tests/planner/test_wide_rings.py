"""The ``wide-rings`` candidate family: a step set by a few maximum-length sequences gets rings of
whole nodes side by side (within 1.2x its lower bound, by prediction and by simulation), its plans
keep every invariant, and a step near its bound never starts the wide search."""

from __future__ import annotations

import numpy as np
import pytest

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
from zeppelin.planner.core.sampler import sample_steps
from zeppelin.planner.costmodel.predict import lower_bounds
from zeppelin.planner.sim.simulate import Simulator
from zeppelin.planner.tools.compare import mix_dataset
from zeppelin.planner.tools.validate import step_problems
from zeppelin.planner.zeppelin.families import wide_rings
from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
from zeppelin.schemas.plan import SamplerConfig, Sequence

MAX_LEN = 131072


def _ctx(tp: int = 2, zero_stage: int = 3) -> PlanContext:
    """64 A800 (4 NICs per node), LLaMA-13B at tp 2, ZeRO-3, with selective recompute: a
    131,072-token sequence then fits a ring of two whole nodes (without recompute it needs more,
    and three such rings do not fit side by side on eight nodes). At ZeRO-1 every TP rank keeps
    the whole bf16 model, and a ring of two nodes no longer holds it."""
    cl = resolve_cluster("zeppelin-a:8")
    ctx = PlanContext(cl, resolve_model("llama-13b"), resolve_profile(None, cl), tp=tp, seed=0,
                      recompute="selective", zero_stage=zero_stage)
    ctx.max_seq_len = MAX_LEN
    return ctx


def _step(tokens: int, long: int = 3, mix: str = "mixed") -> list[Sequence]:
    """A ``mix`` step of about ``tokens`` tokens, ``long`` of them in maximum-length sequences."""
    cfg = SamplerConfig(tokens_per_step=tokens - long * MAX_LEN, seed=0, max_seq_len=MAX_LEN)
    short = [s for s in sample_steps(mix_dataset(mix), cfg, 1)[0] if s.length < MAX_LEN]
    return [Sequence(sample_id=10**6 + k, length=MAX_LEN) for k in range(long)] + short


def _bound(ctx, seqs) -> float:
    return max(lower_bounds(ctx, np.array([s.length for s in seqs], dtype=np.float64)))


def _header(ctx, seqs):
    from zeppelin.planner.core.driver import make_header

    cfg = SamplerConfig(tokens_per_step=sum(s.length for s in seqs), seed=0, max_seq_len=MAX_LEN)
    return make_header(ctx, ZeppelinPlanner(), None, cfg, 1)


@pytest.fixture(scope="module")
def repro():
    ctx = _ctx()
    seqs = _step(576 * 1024)
    return ctx, seqs, ZeppelinPlanner().plan_step(ctx, 0, seqs)


def test_long_sequences_get_side_by_side_rings_of_whole_nodes(repro):
    """The step's plan is within 1.2x its bound by prediction and by simulation, each maximum-length
    sequence on a group across nodes (long blocks: 1.147x); the wide-rings family's own best puts them
    on disjoint aligned blocks of two whole nodes within 1.45x of the bound, and the planner keeps
    whichever is faster. (The family's best was within 1.2x before FSDP's coupling of micro-batches
    was charged - every unit now waits for the slowest in each micro-batch - then 1.40x with the
    memory model counting the remap and Ulysses layouts, 1.43x with FSDP's collectives priced per
    micro-batch, 1.45x (1.439x) since the bound prices a long sequence's attention on usp groups,
    below any ring's.)"""
    ctx, seqs, plan = repro
    bound = _bound(ctx, seqs)
    sim = Simulator(ctx)
    assert plan.prediction.step_time_s <= 1.2 * bound
    assert sim.simulate_step(plan).step_time_s <= 1.2 * bound
    upn = ctx.units_per_node
    long_rings = [mb.groups[p.group].units for mb in plan.microbatches for p in mb.placements
                  if seqs[p.seq].length == MAX_LEN]
    assert len(long_rings) == 3 and all(len({u // upn for u in r}) >= 2 for r in long_rings)
    best = min(wide_rings.candidates(ctx, 0, seqs, limit=None, top=2), key=lambda c: (c.score, c.index)).build()
    assert best.prediction.step_time_s <= 1.45 * bound
    assert sim.simulate_step(best).step_time_s <= 1.45 * bound
    rings = [mb.groups[p.group].units for mb in best.microbatches for p in mb.placements
             if seqs[p.seq].length == MAX_LEN]
    assert len(rings) == 3 and all(len(u) == 2 * upn and u[0] % (2 * upn) == 0 for u in rings)
    assert len({u for r in rings for u in r}) == 3 * 2 * upn
    assert plan.prediction.step_time_s <= best.prediction.step_time_s


def test_its_plans_keep_every_invariant(repro):
    ctx, seqs, _ = repro
    header = _header(ctx, seqs)
    got = wide_rings.candidates(ctx, 0, seqs, limit=None, top=2)
    assert got
    for c in got:
        plan = c.build()
        assert plan.notes["family"] == "wide-rings"
        assert step_problems(ctx, header, plan) == []


def test_a_step_near_its_bound_does_not_start_the_wide_search(monkeypatch):
    # ZeRO-1: at ZeRO-3 a node holds this step's longest sequence (104,158 tokens) with room to
    # spare, and that sequence alone on one node takes 0.93 of the step's bound, which opens the search
    ctx = _ctx(zero_stage=1)
    seqs = _step(1024 * 1024, long=0)  # no maximum-length sequence: the tiered plan is near the bound
    searched = []
    real = wide_rings._search
    monkeypatch.setattr(wide_rings, "_search", lambda *a, **k: searched.append(1) or real(*a, **k))
    built = []
    planner = ZeppelinPlanner()
    planner.collector = built.append
    plan = planner.plan_step(ctx, 0, seqs)
    # memory makes the step three micro-batches, each waiting for its slowest unit under FSDP,
    # which the bound (one micro-batch) does not see: the tiered plan is chosen, 1.27x the bound
    # by the prediction and 1.25x by the simulator, ahead of FLOP-share's (1.42x)
    assert plan.prediction.step_time_s <= 1.32 * _bound(ctx, seqs)
    sim = Simulator(ctx)
    assert sim.simulate_step(plan).step_time_s == min(sim.simulate_step(p).step_time_s for p in built)
    assert not searched
    # the gate: some sequence on its narrowest ring more than 1/1.1 of the bound
    assert not wide_rings.far_from_bound(np.array([1.0, 9.0]), 10.0)
    assert wide_rings.far_from_bound(np.array([1.0, 9.2]), 10.0)
    # while the repro step searches (in its own context)
    ZeppelinPlanner().plan_step(_ctx(), 0, _step(576 * 1024))
    assert searched
