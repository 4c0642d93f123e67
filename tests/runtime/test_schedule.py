"""Attention schedules compiled from planned steps without any process group: every rank's tasks
follow its unit's queue in one global order, every peer relation is mutual, routes' proxies relay,
and a step that breaks a runtime invariant is refused with the invariant's message."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch.distributed as dist

from zeppelin.planner.core import registry  # noqa: F401  (every built-in planner registers itself)
from zeppelin.planner.core.base import PlanContext, get_planner
from zeppelin.planner.tools.validate import step_problems
from zeppelin.runtime.attn.schedule import PHASES, compile_schedule
from tests.support.clusters import cluster_preset  # local-cpu over fast links
from zeppelin.schemas.common import InputError
from zeppelin.schemas.layout import zigzag_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import (
    Group,
    InputHashes,
    MicroBatch,
    Placement,
    PlanHeader,
    Route,
    RoutePath,
    Sequence,
    StepPlan,
)
from zeppelin.schemas.profile import default_profile


def _ctx(cluster: str, model: str) -> PlanContext:
    c = cluster_preset(cluster)
    return PlanContext(c, model_preset(model), default_profile(c.name))


def _header(ctx: PlanContext, planner: str) -> PlanHeader:
    return PlanHeader(planner=planner, num_steps=1, world_size=ctx.cluster.world_size, tp=ctx.tp,
                      cluster=ctx.cluster, model=ctx.model, profile=ctx.profile,
                      hashes=InputHashes(cluster="-", model="-", profile="-", manifest="-"))


def _lengths(ctx: PlanContext, seed: int) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    cap = ctx.cost.token_capacity
    lengths = [*np.clip(rng.lognormal(7, 1, 60).astype(int), 16, 6000), cap * 9, cap * 3]
    return [Sequence(sample_id=i, length=int(x)) for i, x in enumerate(lengths)]


@pytest.fixture(scope="module")
def planned():
    """(header, step) of the Zeppelin planner's tiered search (overlapping rings, routes through
    proxies) and of two baselines (te-cp: one ring size; flexsp: Ulysses groups)."""
    out = {}
    ctx = _ctx("zeppelin-a", "llama-7b")
    for name, opts in (("zeppelin", {"families": "none", "ilp_nodes": 50}), ("te-cp", {}),
                       ("flexsp", {"milp_nodes": 50})):
        step = get_planner(name, **opts).plan_step(ctx, 0, _lengths(ctx, 11))
        header = _header(ctx, name)
        assert step_problems(ctx, header, step) == []
        out[name] = (header, step)
    return out


def _schedules(header, step, mbi):
    return {r: compile_schedule(header, step, mbi, r) for r in range(header.world_size)}


@pytest.mark.parametrize("name", ["zeppelin", "te-cp", "flexsp"])
def test_every_rank_runs_its_queue_in_one_global_order(planned, name):
    assert not dist.is_initialized()
    header, step = planned[name]
    for mbi, mb in enumerate(step.microbatches):
        sch = _schedules(header, step, mbi)
        for s in sch.values():
            members = [t for t in s.tasks if t.kind != "relay"]
            # the unit's queue, as a set; its rows are the unit's attention buffer
            assert sorted(t.group for t in members) == sorted(mb.queues[s.unit])
            assert s.rows == sum(e - b for _, b, e in mb.attention_segments(s.unit))
            in_queue_order = sorted(members, key=lambda t: mb.queues[s.unit].index(t.group))
            ends = [0] + [t.row1 for t in in_queue_order]
            assert [t.row0 for t in in_queue_order] == ends[:-1] and ends[-1] == s.rows
            # inter before intra before local, groups in index order: one order every rank shares
            keys = [(PHASES.index(t.tier), t.group) for t in s.tasks]
            assert keys == sorted(keys)
        # any two ranks meet their common groups in the same order (no cross waits)
        for a, b in itertools.combinations(sch.values(), 2):
            common = {t.group for t in a.tasks} & {t.group for t in b.tasks}
            assert [t.group for t in a.tasks if t.group in common] == [t.group for t in b.tasks if t.group in common]


@pytest.mark.parametrize("name", ["zeppelin", "te-cp", "flexsp"])
def test_peers_are_mutual_and_follow_rings_and_routes(planned, name):
    header, step = planned[name]
    kinds = set()
    for mbi, mb in enumerate(step.microbatches):
        sch = _schedules(header, step, mbi)
        tasks = {(r, t.group): t for r, s in sch.items() for t in s.tasks}
        for (rank, g), t in tasks.items():
            kinds.add(t.kind)
            for peer in t.peers():
                assert (peer, g) in tasks and rank in tasks[(peer, g)].peers(), (rank, g, peer)
            group = mb.groups[g]
            if t.kind == "ring" and not t.routes and len(group.units) > 1:
                p, G = t.spec.pos, len(t.spec.ranks)
                assert t.peers() == {t.spec.ranks[(p - 1) % G], t.spec.ranks[(p + 1) % G]}
            if t.kind == "ulysses":
                assert t.peers() == set(t.spec.ranks) - {rank}
        # every proxy of a routed path relays (or is a member of) its ring
        for r in mb.routes:
            for p in r.paths:
                for u in (p.via_src, p.via_dst):
                    assert (u, r.group) in tasks
                    if u not in mb.groups[r.group].units:
                        assert tasks[(u, r.group)].kind == "relay"
    assert {"zeppelin": "ring", "te-cp": "ring", "flexsp": "ulysses"}[name] in kinds


def test_proxies_outside_a_ring_relay_it_in_its_place():
    """local-cpu:2x2 (units 0, 1 on node 0; 2, 3 on node 1): ring [0, 2] sends 0->2 half direct, half
    through proxies 1 -> 3, which are no members; unit 1 also runs a local sequence."""
    c = cluster_preset("local-cpu:2x2")
    header = PlanHeader(planner="hand", num_steps=1, world_size=4, cluster=c, model=model_preset("tiny"),
                        profile=default_profile(c.name, "cpu"),
                        hashes=InputHashes(cluster="-", model="-", profile="-", manifest="-"))
    path = lambda a, b, n: RoutePath(via_src=a, via_dst=b, nic_src=f"node{a // 2}/nic0", nic_dst=f"node{b // 2}/nic0",
                                     tokens=n)
    mb = MicroBatch(
        groups=[Group(kind="ring", tier="inter", units=[0, 2]), Group(kind="local", tier="local", units=[1]),
                Group(kind="local", tier="local", units=[3])],
        placements=[Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(40, 2)),
                    Placement(seq=1, group=1, ranges=[[[0, 9]]]), Placement(seq=2, group=2, ranges=[[[0, 5]]])],
        queues=[[0], [1], [0], [2]],
        routes=[Route(group=0, src=0, dst=2, tokens=20, bytes=1, paths=[path(0, 2, 10), path(1, 3, 10)]),
                Route(group=0, src=2, dst=0, tokens=20, bytes=1, paths=[path(2, 0, 20)])])
    step = StepPlan(step=0, sequences=[Sequence(sample_id=i, length=n) for i, n in enumerate((40, 9, 5))],
                    microbatches=[mb])
    sch = _schedules(header, step, 0)
    assert [s.order() for s in sch.values()] == [[("ring", 0)], [("relay", 0), ("ring", 1)], [("ring", 0)],
                                                  [("relay", 0), ("ring", 2)]]
    assert [sorted(s.tasks[0].peers()) for s in sch.values()] == [[1, 2], [0, 3], [0, 3], [1, 2]]
    assert [s.rows for s in sch.values()] == [20, 9, 20, 5]


def test_a_step_breaking_a_runtime_invariant_is_refused(planned):
    header, step = planned["zeppelin"]
    mbi, ri = next((i, j) for i, mb in enumerate(step.microbatches) for j, r in enumerate(mb.routes)
                   if len(mb.groups[r.group].units) > 2)
    bad = step.model_copy(deep=True)
    r = bad.microbatches[mbi].routes[ri]
    units = bad.microbatches[mbi].groups[r.group].units
    r.dst = next(u for u in units if u not in (r.src, units[(units.index(r.src) + 1) % len(units)]))
    with pytest.raises(InputError) as e:
        compile_schedule(header, bad, mbi, 0)
    assert str(e.value) == (f"step 0 microbatch {mbi}: route {r.src}->{r.dst} is not a ring transfer of group "
                            f"{r.group} (ring {units})")
    with pytest.raises(InputError, match=r"^step 0 has \d+ micro-batches, asked for 99$"):
        compile_schedule(header, step, 99, 0)
