"""The ``usp`` group kind in the plan format: its shape and stated K/V replication, their layout
(:func:`usp_ranges`) and the ``heads`` invariant; plans without it keep their bytes."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.common import content_hash
from zeppelin.schemas.invariants import INVARIANTS, kv_replication, plan_problems, runtime_problems
from zeppelin.schemas.layout import usp_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Group, InputHashes, MicroBatch, Placement, PlanHeader, Sequence, StepPlan
from zeppelin.schemas.profile import default_profile


def _header(model="tiny"):
    c, m = cluster_preset("local-cpu:2x2"), model_preset(model)
    p = default_profile(c.name, "cpu")
    return PlanHeader(planner="test", num_steps=1, world_size=4, cluster=c, model=m, profile=p,
                      hashes=InputHashes(cluster=content_hash(c), model=content_hash(m), profile=content_hash(p),
                                         manifest="sha256:0"))


def _step(group: Group, L: int = 20, ranges=None) -> StepPlan:
    u, r = group.shape or (len(group.units), 1)
    rg = ranges if ranges is not None else usp_ranges(L, u, r)
    pl = Placement(seq=0, group=0, scheme="zigzag" if group.kind == "usp" else "contiguous", ranges=rg)
    return StepPlan(step=0, sequences=[Sequence(sample_id=0, length=L)],
                    microbatches=[MicroBatch(groups=[group], placements=[pl], queues=[[0]] * 4)])


def _problems(h, step):
    """Every invariant but ``routes`` (these steps' usp groups cross nodes unrouted)."""
    return plan_problems(h, step, names=[i.name for i in INVARIANTS if i.name != "routes"])


def test_usp_ranges_rows_of_zigzag_chunks():
    # r=2: row 0 holds chunks 0 and 3 of 4, row 1 chunks 1 and 2; each split over the row's u=2
    assert usp_ranges(16, 2, 2) == [[[0, 2], [12, 14]], [[2, 4], [14, 16]], [[4, 6], [8, 10]], [[6, 8], [10, 12]]]
    assert usp_ranges(10, 2, 2, "contiguous") == [[[0, 3]], [[3, 5]], [[5, 8]], [[8, 10]]]
    with pytest.raises(ValueError, match=r"^usp groups cut sequences zigzag or contiguous, not 'whole'$"):
        usp_ranges(10, 2, 2, "whole")


def test_group_shape_and_replication_are_validated():
    g = Group(kind="usp", tier="inter", units=[0, 1, 2, 3], shape=[2, 2], kv_replication=1)
    assert g.row_size() == 2 and g.model_dump()["shape"] == [2, 2]
    for kw, msg in [({"shape": [2, 2]}, "a usp group states its shape [u, r] and its kv_replication"),
                    ({"shape": [4, 2], "kv_replication": 2}, "usp group shape [4, 2] does not arrange its 4 units")]:
        with pytest.raises(ValidationError, match=re.escape(msg)):
            Group(kind="usp", tier="inter", units=[0, 1, 2, 3], **kw)
    with pytest.raises(ValidationError, match="a ring group has no shape"):
        Group(kind="ring", tier="inter", units=[0, 1], shape=[1, 2])
    with pytest.raises(ValidationError, match="a ring group has no kv_replication"):
        Group(kind="ring", tier="inter", units=[0, 1], kv_replication=1)


def test_groups_without_the_new_fields_serialise_as_before():
    g = Group(kind="ulysses", tier="intra", units=[0, 1])
    assert g.model_dump(mode="json") == {"kind": "ulysses", "tier": "intra", "units": [0, 1]}
    assert Group(kind="ulysses", tier="intra", units=[0, 1], kv_replication=2).model_dump()["kv_replication"] == 2


def test_heads_invariant():
    assert kv_replication(4, 2, 1, 4) == 2 and kv_replication(4, 2, 1, 2) == 1
    assert kv_replication(4, 2, 1, 3) is None and kv_replication(6, 4, 1, 6) is None
    h = _header()  # tiny: 4 query heads, 2 KV heads
    ok = Group(kind="usp", tier="inter", units=[0, 1, 2, 3], shape=[2, 2], kv_replication=1)
    assert _problems(h, _step(ok)) == []
    wrong = Group(kind="usp", tier="inter", units=[0, 1, 2, 3], shape=[2, 2], kv_replication=2)
    assert _problems(h, _step(wrong)) == [
        "heads: step 0 microbatch 0: group 0 states kv_replication 2, but rows of 2 positions over 2 KV heads "
        "replicate each 1x"]
    uly = Group(kind="ulysses", tier="inter", units=[0, 1, 2, 3], kv_replication=1)
    assert _problems(h, _step(uly, ranges=[[[0, 5]], [[5, 10]], [[10, 15]], [[15, 20]]])) == [
        "heads: step 0 microbatch 0: group 0 states kv_replication 1, but rows of 4 positions over 2 KV heads "
        "replicate each 2x"]
    four = Group(kind="usp", tier="inter", units=[0, 1, 2, 3], shape=[4, 1], kv_replication=1)
    assert _problems(_header("small"), _step(four)) == []  # 8 heads / 4 KV heads: u=4, no replication
    three = Group(kind="usp", tier="inter", units=[0, 1, 2], shape=[3, 1], kv_replication=1)
    step = _step(three, ranges=usp_ranges(20, 3, 1))
    step.microbatches[0].queues = [[0], [0], [0], []]
    assert _problems(h, step) == [
        "heads: step 0 microbatch 0: group 0 splits the 4 query heads of a unit over 3 positions per row; a usp "
        "row needs a size that divides them (and is a multiple of the 2 KV heads when larger)"]


def test_zigzag_usp_layout_is_checked():
    g = Group(kind="usp", tier="inter", units=[0, 1, 2, 3], shape=[2, 2], kv_replication=1)
    step = _step(g, ranges=usp_ranges(20, 2, 2, "contiguous"))  # declared zigzag
    assert _problems(_header(), step) == [
        "ring-order: step 0 microbatch 0: sequence 0 is not cut into 2r=4 zigzag chunks split over the 2 "
        "positions of each row of usp group 0"]


def test_usp_column_rings_crossing_nodes_have_routes_relayed_inside_the_column():
    from zeppelin.schemas.plan import Route, RoutePath

    h = _header()
    g = Group(kind="usp", tier="inter", units=[0, 1, 2, 3], shape=[2, 2], kv_replication=1)
    step = _step(g)  # rows [0, 1] and [2, 3] on the two nodes; column rings [0, 2] and [1, 3]
    nic = h.cluster.nic_of

    def route(s, d, via=None):  # each row holds 10 of the 20 tokens: what its positions send per round
        a = s if via is None else via
        return Route(group=0, src=s, dst=d, tokens=10, bytes=1,
                     paths=[RoutePath(via_src=a, via_dst=d, nic_src=nic(a), nic_dst=nic(d), tokens=10)])

    assert plan_problems(h, step, names=["routes"]) == [
        f"routes: step 0 microbatch 0: group 0: inter-node transfer {s}->{d} has no route"
        for s, d in [(0, 2), (1, 3), (2, 0), (3, 1)]]
    step.microbatches[0].routes = [route(0, 2), route(1, 3), route(2, 0), route(3, 1)]
    assert plan_problems(h, step) == []
    step.microbatches[0].routes[0] = route(0, 2, via=1)  # unit 1 runs the other column's ring
    want = ("step 0 microbatch 0: unit 1 relays transfer 0->2 of usp group 0, outside the transfer's column "
            "ring [0, 2]")
    assert plan_problems(h, step) == [f"relays: {want}"]
    assert runtime_problems(h, step) == [want]
    step.microbatches[0].routes[0] = Route(group=0, src=0, dst=3, tokens=10, bytes=1, paths=[
        RoutePath(via_src=0, via_dst=3, nic_src=nic(0), nic_dst=nic(3), tokens=10)])
    assert plan_problems(h, step, names=["routes"])[0] == ("routes: step 0 microbatch 0: route 0->3 of group 0: "
                                                           "3 is not the ring successor of 0")
