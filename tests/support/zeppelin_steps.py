"""Steps, contexts and plan checks the Zeppelin planner's test files share (tests/planner/test_zeppelin_*.py)."""

from __future__ import annotations

import numpy as np

from zeppelin.planner.core.base import PlanContext
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.layout import zigzag_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import PlanHeader, Sequence, structural_problems
from zeppelin.schemas.profile import default_profile


def make_ctx(cluster="zeppelin-a", model="llama-7b", **kw) -> PlanContext:
    cl = cluster_preset(cluster)
    return PlanContext(cl, model_preset(model), default_profile(cl.name, cl.device), **kw)


def seqs_of(lengths) -> list[Sequence]:
    return [Sequence(sample_id=i, length=int(x)) for i, x in enumerate(lengths)]


def header_for(ctx: PlanContext, steps=1) -> PlanHeader:
    from zeppelin.planner.core.driver import make_header
    from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
    from zeppelin.schemas.plan import SamplerConfig

    return make_header(ctx, ZeppelinPlanner(), None, SamplerConfig(tokens_per_step=1), steps)


def check_plan(ctx, plan, lengths):
    """The plan's structure: every sequence once, rings cut zigzag, no unit past its token capacity,
    queues inter before intra before local, inter rings entering each node once."""
    hdr = header_for(ctx)
    assert structural_problems(hdr, plan) == []
    # every sequence exactly once
    placed = sorted(p.seq for mb in plan.microbatches for p in mb.placements)
    assert placed == list(range(len(lengths)))
    cap = ctx.cost.token_capacity
    if plan.replicas is not None:  # a tp-replicas plan: units are replicas of their own TP degree
        cap = np.array([ctx.cost_for(r.tp).token_capacity for r in plan.replicas])
    for mb in plan.microbatches:
        held = np.zeros(len(mb.queues))
        for p in mb.placements:
            g = mb.groups[p.group]
            if g.kind == "ring":
                assert p.ranges == zigzag_ranges(lengths[p.seq], len(g.units))
            for pos, u in enumerate(g.units):
                held[u] += sum(e - s for s, e in p.ranges[pos])
        # a unit that recomputes (its micro-batch's choice, or its own) holds what that choice lets it
        mine = np.array([ctx.cost.recompute_capacity(mb.recompute_of(u)) if mb.recompute_of(u) not in (None, "none")
                         else (cap[u] if np.ndim(cap) else cap) for u in range(len(mb.queues))])
        assert (held <= mine).all()
        # queues: inter before intra before local
        rank = {"inter": 0, "intra": 1, "local": 2}
        for q in mb.queues:
            tiers = [rank[mb.groups[g].tier] for g in q]
            assert tiers == sorted(tiers)
        # inter rings: units of a node contiguous, each node entered once (units of the context's
        # TP degree; a tp-replicas plan's rings join whole replicas)
        upn = ctx.units_per_node
        for g in (mb.groups if plan.replicas is None else []):
            if g.tier == "inter":
                nodes = [u // upn for u in g.units]
                changes = sum(1 for a, b in zip(nodes, nodes[1:] + nodes[:1]) if a != b)
                assert changes == len(set(nodes))
            elif g.tier == "intra":
                assert len({u // upn for u in g.units}) == 1


def grid_step(cluster: str, model: str, tp: int, mix: str, gpus: int, k: int):
    """Step ``k`` of a docs/RESULTS.md grid cell (same sampler settings as benchmarks/bench_compare.py)."""
    from zeppelin.planner.core.sampler import sample_steps
    from zeppelin.planner.tools.compare import mix_dataset
    from zeppelin.schemas.plan import SamplerConfig

    cl = cluster_preset(f"{cluster}:{gpus // 8}")
    ctx = PlanContext(cl, model_preset(model), default_profile(cl.name, cl.device), tp=tp)
    cfg = SamplerConfig(tokens_per_step=16384 * gpus, seed=0, max_seq_len=131072)
    return ctx, sample_steps(mix_dataset(mix), cfg, k + 1)[k]


def valid_plan(ctx, plan):
    """Every invariant ``zeppelin validate`` checks, and every sequence placed once."""
    from zeppelin.planner.tools.validate import step_problems

    assert step_problems(ctx, header_for(ctx), plan) == []
    assert sorted(p.seq for mb in plan.microbatches for p in mb.placements) == list(range(len(plan.sequences)))


def record_results(monkeypatch, obj, name: str) -> list:
    """Wraps ``obj.name`` (for the test) so that every result it returns is also appended to the
    list returned."""
    seen = []
    real = getattr(obj, name)

    def spy(*a, **k):
        r = real(*a, **k)
        seen.append(r)
        return r

    monkeypatch.setattr(obj, name, spy)
    return seen


def latency_steps_64(n: int):
    """The latency benchmark's first ``n`` steps at 64 GPUs (cluster C, 8 nodes)."""
    return latency_steps(64, n)


def latency_steps(gpus: int, n: int):
    """The latency benchmark's first ``n`` steps at ``gpus`` GPUs (cluster C, 8 a node; 8 sequences
    per GPU of its mixed lengths, one generator for all steps)."""
    rng = np.random.default_rng(gpus)
    steps = []
    for _ in range(n):
        body = rng.lognormal(7.0, 1.0, 8 * gpus)
        tail = (rng.pareto(1.2, 8 * gpus) + 1.0) * 4096
        L = np.clip(np.where(rng.random(8 * gpus) < 0.1, tail, body).astype(np.int64), 16, 131072)
        steps.append(seqs_of(L))
    return steps
