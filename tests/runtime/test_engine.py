"""AttentionEngine on hand-built plans for local-cpu:2x2 (2 "nodes" x 2 processes), vs a float64
single-process reference per sequence; routed vs direct transfers must be bit-identical."""

from __future__ import annotations

import pytest
import torch

from zeppelin.runtime.attn.reference import reference_attention
from zeppelin.runtime.engine import AttentionEngine
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.common import InputError, content_hash
from zeppelin.schemas.layout import contiguous_ranges, zigzag_ranges
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
    structural_problems,
)
from zeppelin.schemas.profile import default_profile

HQ, HKV, D = 4, 2, 8
WORLD = 4  # ranks of the module's process pool (the `pool` fixture of tests/conftest.py)
LENS = [53, 30, 19, 12, 7, 1, 9, 26]


def _header(cluster="local-cpu:2x2"):
    c = cluster_preset(cluster)
    m = model_preset("tiny")
    p = default_profile(c.name, "cpu")
    return PlanHeader(
        planner="test",
        num_steps=1,
        world_size=c.world_size,
        cluster=c,
        model=m,
        profile=p,
        hashes=InputHashes(
            cluster=content_hash(c), model=content_hash(m), profile=content_hash(p), manifest="sha256:0"
        ),
    )


def _path(a, b, tokens):
    return RoutePath(
        via_src=a, via_dst=b, nic_src=f"node{a // 2}/nic0", nic_dst=f"node{b // 2}/nic0", tokens=tokens
    )


def _step(routed: bool) -> StepPlan:
    """Units 0,1 on node 0 and 2,3 on node 1.

    group 0: inter ring [0, 2] (seqs 0, 1)  routes 0->2 split direct + via proxies 1->3 (non-members),
                                              2->0 entirely via 3->1
    group 1: inter ring [3, 1] (seq 2)       route 3->1 via proxies 2->0 (members of group 0)
    group 2: intra ring [2, 3] (seq 3)
    groups 3..5: local on units 0, 1, 3 (seqs 4..7)
    Unit 3 queues its groups out of phase order: the engine still runs inter -> intra -> local.
    """
    seqs = [Sequence(sample_id=i, length=n) for i, n in enumerate(LENS)]
    groups = [
        Group(kind="ring", tier="inter", units=[0, 2]),
        Group(kind="ring", tier="inter", units=[3, 1]),
        Group(kind="ring", tier="intra", units=[2, 3]),
        Group(kind="local", tier="local", units=[0]),
        Group(kind="local", tier="local", units=[1]),
        Group(kind="local", tier="local", units=[3]),
    ]
    pl = [
        Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(53, 2)),
        Placement(seq=1, group=0, scheme="contiguous", ranges=contiguous_ranges(30, 2)),
        Placement(seq=2, group=1, scheme="zigzag", ranges=zigzag_ranges(19, 2)),
        Placement(seq=3, group=2, scheme="zigzag", ranges=zigzag_ranges(12, 2)),
        Placement(seq=4, group=3, ranges=[[[0, 7]]]),
        Placement(seq=5, group=3, ranges=[[[0, 1]]]),
        Placement(seq=6, group=4, ranges=[[[0, 9]]]),
        Placement(seq=7, group=5, ranges=[[[0, 26]]]),
    ]
    routes = []
    if routed:
        routes = [
            Route(group=0, src=0, dst=2, tokens=42, bytes=0, paths=[_path(0, 2, 17), _path(1, 3, 25)]),
            Route(group=0, src=2, dst=0, tokens=42, bytes=0, paths=[_path(3, 1, 42)]),
            Route(group=1, src=3, dst=1, tokens=10, bytes=0, paths=[_path(2, 0, 10)]),
        ]
    mb = MicroBatch(groups=groups, placements=pl, queues=[[0, 3], [1, 4], [0, 2], [5, 2, 1]], routes=routes)
    return StepPlan(step=0, sequences=seqs, microbatches=[mb])


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENS:
        out.append(tuple(torch.randn(n, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ)))
    return out  # per sequence: q, k, v, dout


def _gather(segs, per_seq, i):
    return torch.cat([per_seq[s][i][a:b] for s, a, b in segs], 0)


def _engine_case(rank, world, routed, dtype, calls):
    header = _header()
    step = _step(routed)
    assert structural_problems(header, step) == []
    eng = AttentionEngine(header, step, 0, rank)
    segs = step.microbatches[0].attention_segments(rank)
    data = _inputs()
    q, k, v, do = (_gather(segs, data, i).to(dtype) for i in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    outs = []
    for _ in range(calls):  # several layer calls reuse one engine
        outs.append(eng(q, k, v))
    loss = sum((o * do).sum() for o in outs)
    loss.backward()
    return {
        "segs": segs,
        "out": outs[0].detach(),
        "grads": [q.grad, k.grad, v.grad],
        "stats": dict(eng.stats),
        "schedule": eng.schedule(),
    }


def _reference(calls):
    res = []
    for q, k, v, do in _inputs():
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        o = reference_attention(q, k, v, [0, q.shape[0]])
        res.append((o.detach(), *torch.autograd.grad(o, (q, k, v), do * calls)))
    return res


def _assemble(results):
    """Per sequence: out, dq, dk, dv assembled from every rank's segments."""
    per = [
        [torch.full((n, h, D), float("nan"), dtype=torch.float64) for h in (HQ, HQ, HKV, HKV)] for n in LENS
    ]
    for r in results:
        row = 0
        for s, a, b in r["segs"]:
            for i, t in enumerate((r["out"], *r["grads"])):
                per[s][i][a:b] = t[row : row + b - a].double()
            row += b - a
    return per


@pytest.mark.timeout(120)
def test_engine_three_tiers_with_routing_matches_reference(pool):
    ref = _reference(calls=2)
    routed = pool.run(_engine_case, True, torch.float32, 2, timeout=90)
    direct = pool.run(_engine_case, False, torch.float32, 2, timeout=90)
    got_r, got_d = _assemble(routed), _assemble(direct)
    for s in range(len(LENS)):
        for a, b, want in zip(got_r[s], got_d[s], ref[s]):
            assert not torch.isnan(a).any()
            assert torch.equal(a, b), f"sequence {s}: routed and direct results differ"
            assert (a - want).abs().max().item() <= 1e-5, s
    # execution order: inter -> intra -> local, increasing group index; proxies relay in place
    assert [r["schedule"] for r in routed] == [
        [("ring", 0), ("relay", 1), ("ring", 3)],
        [("relay", 0), ("ring", 1), ("ring", 4)],
        [("ring", 0), ("relay", 1), ("ring", 2)],
        [("relay", 0), ("ring", 1), ("ring", 2), ("ring", 5)],
    ]
    assert [r["schedule"] for r in direct] == [
        [("ring", 0), ("ring", 3)],
        [("ring", 1), ("ring", 4)],
        [("ring", 0), ("ring", 2)],
        [("ring", 1), ("ring", 2), ("ring", 5)],
    ]
    # byte counters: the same bytes cross nodes either way; with routes, non-member proxies carry part
    inter = lambda res: [r["stats"]["inter"] for r in res]
    intra = lambda res: [r["stats"]["intra"] for r in res]
    assert sum(inter(routed)) == sum(inter(direct)) > 0
    assert intra(direct) == [0, 0, intra(direct)[2], intra(direct)[3]] and intra(direct)[2] > 0
    # hand count, direct plan, rank 0 (ring [0, 2], G=2; it holds 27 + 15 = 42 rows, rank 2 holds 41):
    # per call: forward K/V round 0 (42 rows) + backward K/V round 0 (42) + dK/dV rounds 0 and 1
    # (42, then rank 2's block: 41), every row 2*HKV*D fp32 values; two layer calls
    assert inter(direct)[0] == 2 * (42 + 42 + 42 + 41) * 2 * HKV * D * 4
    assert inter(direct)[0] > inter(routed)[0] and inter(routed)[1] > 0  # proxy 1 relays 0->2 traffic
    assert sum(intra(routed)) > sum(intra(direct))  # dispatch / combine hops are intra-node


def _bad_route_case(rank, world):
    step = _step(True).model_copy(deep=True)
    step.microbatches[0].routes[0].dst = 1
    step.microbatches[0].routes[0].paths = [_path(0, 1, 42)]
    try:
        AttentionEngine(_header(), step, 0, rank)
    except InputError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_engine_rejects_route_outside_ring(pool):
    msgs = pool.run(_bad_route_case, timeout=30)
    assert msgs == ["step 0 microbatch 0: route 0->1 is not a ring transfer of group 0 (ring [0, 2])"] * 4


def _rows_case(rank, world):
    eng = AttentionEngine(_header(), _step(False), 0, rank)
    x = torch.zeros(eng.rows + 1, HQ, D)
    try:
        eng(x, x[:, :HKV], x[:, :HKV])
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_engine_rejects_wrong_row_count(pool):
    msgs = pool.run(_rows_case, timeout=30)
    assert msgs[0] == "step 0 microbatch 0: rank 0 holds 50 attention rows, got q/k/v with 51/51/51"


@pytest.mark.timeout(120)
def test_engine_bf16_within_tolerance(pool):
    ref = _reference(calls=1)
    res = _assemble(pool.run(_engine_case, True, torch.bfloat16, 1, timeout=90))
    for s in range(len(LENS)):
        for a, want in zip(res[s], ref[s]):
            assert (a - want).abs().max().item() <= 5e-2 * max(1.0, want.abs().max().item()), s


def _ulysses_step() -> StepPlan:
    """Ulysses groups [0, 1] (seqs 0, 1) and [3, 2] (seq 2) plus local work on units 0 and 3."""
    seqs = [Sequence(sample_id=i, length=n) for i, n in enumerate([45, 13, 30, 11, 6])]
    groups = [
        Group(kind="ulysses", tier="intra", units=[0, 1]),
        Group(kind="ulysses", tier="intra", units=[3, 2]),
        Group(kind="local", tier="local", units=[0]),
        Group(kind="local", tier="local", units=[3]),
    ]
    pl = [
        Placement(seq=0, group=0, scheme="contiguous", ranges=contiguous_ranges(45, 2)),
        Placement(seq=1, group=0, scheme="contiguous", ranges=contiguous_ranges(13, 2)),
        Placement(seq=2, group=1, scheme="contiguous", ranges=contiguous_ranges(30, 2)),
        Placement(seq=3, group=2, ranges=[[[0, 11]]]),
        Placement(seq=4, group=3, ranges=[[[0, 6]]]),
    ]
    mb = MicroBatch(groups=groups, placements=pl, queues=[[0, 2], [0], [1], [1, 3]])
    return StepPlan(step=0, sequences=seqs, microbatches=[mb])


def _ulysses_case(rank, world):
    from zeppelin.runtime.groups import GroupCache

    header, step = _header(), _ulysses_step()
    assert structural_problems(header, step) == []
    cache = GroupCache(header=header, steps=[step])
    eng = AttentionEngine(header, step, 0, rank, groups=cache)
    segs = step.microbatches[0].attention_segments(rank)
    g = torch.Generator().manual_seed(1)
    data = [
        tuple(torch.randn(n, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))
        for n in (45, 13, 30, 11, 6)
    ]
    q, k, v, do = (_gather(segs, data, i).float() for i in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = eng(q, k, v)
    (out * do).sum().backward()
    return {"segs": segs, "out": out.detach(), "grads": [q.grad, k.grad, v.grad], "schedule": eng.schedule()}


@pytest.mark.timeout(120)
def test_engine_delegates_ulysses_groups(pool):
    res = pool.run(_ulysses_case, timeout=90)
    assert [r["schedule"] for r in res] == [
        [("ulysses", 0), ("ring", 2)],
        [("ulysses", 0)],
        [("ulysses", 1)],
        [("ulysses", 1), ("ring", 3)],
    ]
    g = torch.Generator().manual_seed(1)
    lens = (45, 13, 30, 11, 6)
    data = [
        tuple(torch.randn(n, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV, HQ))
        for n in lens
    ]
    per = [
        [torch.full((n, h, D), float("nan"), dtype=torch.float64) for h in (HQ, HQ, HKV, HKV)] for n in lens
    ]
    for r in res:
        row = 0
        for s, a, b in r["segs"]:
            for i, t in enumerate((r["out"], *r["grads"])):
                per[s][i][a:b] = t[row : row + b - a].double()
            row += b - a
    for s, (q, k, v, do) in enumerate(data):
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        o = reference_attention(q, k, v, [0, q.shape[0]])
        want = (o.detach(), *torch.autograd.grad(o, (q, k, v), do))
        for got, w in zip(per[s], want):
            assert (got - w).abs().max().item() <= 1e-5, s


def _allgather_case(rank, world):
    header = _header()
    step = _step(False).model_copy(deep=True)
    step.microbatches[0].groups[2] = Group(kind="allgather", tier="intra", units=[2, 3])
    eng = AttentionEngine(header, step, 0, rank)
    segs = step.microbatches[0].attention_segments(rank)
    data = _inputs()
    q, k, v, do = (_gather(segs, data, i).float() for i in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = eng(q, k, v)
    (out * do).sum().backward()
    return {"segs": segs, "out": out.detach(), "grads": [q.grad, k.grad, v.grad]}


@pytest.mark.timeout(120)
def test_engine_allgather_group_is_exact(pool):
    got = _assemble(pool.run(_allgather_case, timeout=90))
    ref = _reference(calls=1)
    for s in range(len(LENS)):
        for a, want in zip(got[s], ref[s]):
            assert (a - want).abs().max().item() <= 1e-5, s


def test_filler_runs_local_work_only_while_communication_is_pending():
    from zeppelin.runtime.engine import _Filler

    ran = []
    f = _Filler(lambda i=i: ran.append(i) for i in range(5))
    polls = iter([False, False, True])  # the exchange completes after two local tasks
    f(lambda: next(polls))
    assert ran == [0, 1] and f.filled == 2
    f(lambda: True)  # already complete: nothing runs
    assert ran == [0, 1]
    f.drain()
    assert ran == [0, 1, 2, 3, 4] and f.filled == 2


def _tp_case(rank, world):
    # tp=2: units 0 = ranks [0, 1], 1 = ranks [2, 3]; TP rank t holds heads [t*H/2, (t+1)*H/2)
    c = cluster_preset("local-cpu:1x4")
    m, p = model_preset("tiny"), default_profile(c.name, "cpu")
    header = PlanHeader(
        planner="test",
        num_steps=1,
        world_size=4,
        tp=2,
        cluster=c,
        model=m,
        profile=p,
        hashes=InputHashes(
            cluster=content_hash(c), model=content_hash(m), profile=content_hash(p), manifest="x"
        ),
    )
    seqs = [Sequence(sample_id=0, length=33), Sequence(sample_id=1, length=8)]
    mb = MicroBatch(
        groups=[Group(kind="ring", tier="intra", units=[1, 0]), Group(kind="local", tier="local", units=[0])],
        placements=[
            Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(33, 2)),
            Placement(seq=1, group=1, ranges=[[[0, 8]]]),
        ],
        queues=[[0, 1], [0]],
    )
    step = StepPlan(step=0, sequences=seqs, microbatches=[mb])
    eng = AttentionEngine(header, step, 0, rank)
    unit, t = rank // 2, rank % 2
    segs = mb.attention_segments(unit)
    data = [tuple(x.float() for x in d) for d in _inputs()[:2]]
    hq, hkv = slice(t * HQ // 2, (t + 1) * HQ // 2), slice(t * HKV // 2, (t + 1) * HKV // 2)
    q = _gather(segs, data, 0)[:, hq].contiguous().requires_grad_()
    k = _gather(segs, data, 1)[:, hkv].contiguous().requires_grad_()
    v = _gather(segs, data, 2)[:, hkv].contiguous().requires_grad_()
    do = _gather(segs, data, 3)[:, hq]
    out = eng(q, k, v)
    (out * do).sum().backward()
    return {
        "segs": segs,
        "t": t,
        "ring_ranks": eng.items[0].spec.ranks,
        "out": out.detach(),
        "grads": [q.grad, k.grad, v.grad],
    }


@pytest.mark.timeout(120)
def test_engine_tensor_parallel_units_ring_over_matching_tp_ranks(pool):
    res = pool.run(_tp_case, timeout=90)
    assert [r["ring_ranks"] for r in res] == [[2, 0], [3, 1], [2, 0], [3, 1]]
    ref = []
    for (q, k, v, do), n in zip(_inputs()[:2], (33, 8)):  # the tp step uses prefixes of length 33 and 8
        q, k, v = (x[:n].clone().requires_grad_() for x in (q, k, v))
        o = reference_attention(q, k, v, [0, n])
        ref.append((o.detach(), *torch.autograd.grad(o, (q, k, v), do[:n])))
    for r in res:
        t = r["t"]
        hq, hkv = slice(t * HQ // 2, (t + 1) * HQ // 2), slice(t * HKV // 2, (t + 1) * HKV // 2)
        row = 0
        for s, a, b in r["segs"]:
            n = b - a
            want = (ref[s][0][a:b, hq], ref[s][1][a:b, hq], ref[s][2][a:b, hkv], ref[s][3][a:b, hkv])
            for got, w in zip((r["out"], *r["grads"]), want):
                assert (got[row : row + n].double() - w).abs().max().item() <= 1e-5, (s, t)
            row += n


def test_local_sequences_matches_reference_and_rejects_bad_lengths():
    """The engine's local path as the profiler times it (one autograd node, one task per sequence)
    gives each sequence's causal attention and gradients, against the float64 reference."""
    from zeppelin.runtime.engine import local_sequences

    g = torch.Generator().manual_seed(3)
    lens = [7, 1, 30, 12]
    T = sum(lens)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (HQ, HKV, HKV))
    dout = torch.randn(T, HQ, D, generator=g)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    local_sequences(qs, ks, vs, lens).backward(dout)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    out_ref = reference_attention(qr, kr, vr, cu)
    out_ref.backward(dout.double())
    with torch.no_grad():
        out = local_sequences(q, k, v, lens)
    torch.testing.assert_close(out.double(), out_ref.detach(), atol=2e-6, rtol=1e-5)
    for a, b in ((qs, qr), (ks, kr), (vs, vr)):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=5e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"do not partition 50 rows into sequences"):
        local_sequences(q, k, v, [7, 1, 30])
    with pytest.raises(ValueError, match=r"do not partition 50 rows into sequences"):
        local_sequences(q, k, v, [7, 0, 31, 12])
