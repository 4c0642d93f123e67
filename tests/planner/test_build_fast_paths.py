"""The faster ways the planner builds and prices a micro-batch give exactly what the plain ones do.

Building a micro-batch writes one record per local sequence (:func:`.builder.local_records`
beside :func:`.builder.record`), and pricing it passes over every placement and route several
times (held tokens, Ulysses copies, NIC loads, the inter-node rounds). Each test below keeps the
plain way as a reference - one record and one Python step per item, in the order the sums were
taken - and asserts the fast one equal to it bit for bit: the plans the planner writes are
compared byte for byte across changes."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pytest

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.core.builder import local_records, record
from zeppelin.planner.costmodel import predict
from zeppelin.planner.zeppelin import groups as zgroups
from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
from zeppelin.planner.zeppelin.recompute import held_tokens
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.layout import ranges_tokens, split_even, zigzag_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Group, MicroBatch, Placement, Sequence
from zeppelin.schemas.profile import default_profile


def _same_record(a, b) -> bool:
    """Field by field, in the same order, the same fields set."""
    return (type(a) is type(b) and list(a.__dict__.items()) == list(b.__dict__.items())
            and a.__pydantic_fields_set__ == b.__pydantic_fields_set__
            and a.__pydantic_extra__ is None and b.__pydantic_extra__ is None
            and a.__pydantic_private__ is None and b.__pydantic_private__ is None
            and a.model_dump_json() == b.model_dump_json())


def test_local_records_are_the_records_record_builds():
    seqs, units, lengths = [5, 9, 2, 7, 1], [3, 3, 4, 8, 8], [100, 90, 7, 12, 12]
    groups, placements = local_records(seqs, units, lengths, 10)
    want_g = [record(Group, kind="local", tier="local", units=[u]) for u in (3, 4, 8)]
    want_p = [record(Placement, seq=s, group=g, scheme="whole", ranges=[[[0, L]]], padded_length=None)
              for s, g, L in zip(seqs, [10, 10, 11, 12, 12], lengths)]
    assert len(groups) == 3 and len(placements) == 5
    assert all(_same_record(a, b) for a, b in zip(groups + placements, want_g + want_p))


def test_local_placements_share_their_field_set_safely():
    """Every field of a local placement is set, so they share one set: assigning a field (which
    adds its name to the set) leaves it, and every placement's fields, as they were."""
    _, placements = local_records([0, 1], [0, 1], [10, 20], 0)
    placements[0].padded_length = 16
    assert placements[1].model_fields_set == set(Placement.model_fields)
    assert placements[0].model_fields_set == set(Placement.model_fields)
    assert placements[1].padded_length is None


@dataclass
class _Span:
    tier: str


def _local_groups_reference(idx, Ls, spans, unit_of, groups, placements) -> None:
    """One local group per unit (units in order), its sequences longest first, one record each."""
    lengths = Ls.tolist()
    local_by_unit: dict[int, list[int]] = {}
    for j, s in enumerate(spans):
        if s.tier == "local":
            local_by_unit.setdefault(unit_of[j][0], []).append(j)
    for u in sorted(local_by_unit):
        groups.append(record(Group, kind="local", tier="local", units=[u]))
        gi = len(groups) - 1
        for j in sorted(local_by_unit[u], key=lambda j: -lengths[j]):
            placements.append(record(Placement, seq=idx[j], group=gi, scheme="whole",
                                     ranges=[[[0, int(lengths[j])]]], padded_length=None))


@pytest.mark.parametrize("seed", range(5))
def test_local_groups_match_one_record_per_sequence(seed):
    rng = random.Random(seed)
    n = 400
    spans = [_Span(rng.choice(["local", "local", "local", "intra"])) for _ in range(n)]
    unit_of = [[rng.randrange(40)] for _ in range(n)]
    Ls = np.array([float(rng.choice([64, 128, rng.randrange(1, 5000)])) for _ in range(n)])  # (ties)
    idx = rng.sample(range(10 * n), n)
    g0 = [record(Group, kind="ring", tier="intra", units=[0, 1])]
    want_g, want_p, got_g, got_p = list(g0), [], list(g0), []
    _local_groups_reference(idx, Ls, spans, unit_of, want_g, want_p)
    local_js = [j for j, s in enumerate(spans) if s.tier == "local"]
    zgroups._local_groups(idx, Ls.tolist(), local_js, unit_of, got_g, got_p)
    assert len(got_g) == len(want_g) and len(got_p) == len(want_p)
    assert all(_same_record(a, b) for a, b in zip(got_g + got_p, want_g + want_p))


@pytest.mark.parametrize("G", [1, 2, 3, 8, 16])
def test_zigzag_ranges_of_whole_numbers_match_the_split(G):
    for length in [*range(70), 4097, 131071, 999_983]:
        sizes = split_even(length, 2 * G)
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        want = [[[0, length]]] if G == 1 else [[[bounds[i], bounds[i + 1]], [bounds[2 * G - 1 - i], bounds[2 * G - i]]]
                                              for i in range(G)]
        assert zigzag_ranges(length, G) == want


# ------------------------------------------------------------------------------------ pricing


@pytest.fixture(scope="module")
def planned():
    """A step planned on 16 nodes of 8 GPUs: inter-node rings (routed), usp groups where faster,
    intra-node splits and local sequences; with each micro-batch's usp conversion too."""
    cl = cluster_preset("zeppelin-c:16")
    ctx = PlanContext(cl, model_preset("llama-7b"), default_profile(cl.name))
    rng = np.random.default_rng(7)
    L = np.clip(np.where(rng.random(1024) < 0.1, (rng.pareto(1.2, 1024) + 1) * 4096, rng.lognormal(7, 1, 1024)),
                16, 128 * 1024).astype(np.int64)
    seqs = [Sequence(sample_id=i, length=int(x)) for i, x in enumerate(L)]
    plan = ZeppelinPlanner().plan_step(ctx, 0, seqs)
    assert any(mb.routes for mb in plan.microbatches)
    return ctx, plan


def _held_reference(mb: MicroBatch, n: int) -> np.ndarray:
    att = np.zeros(n)
    for p in mb.placements:
        units = mb.groups[p.group].units
        for pos, rs in enumerate(p.ranges):
            att[units[pos]] += sum(e - s for s, e in rs)
    return att


def _ulysses_reference(mb: MicroBatch, n: int, cost) -> np.ndarray | None:
    groups = mb.groups
    w = {gi: cost.ulysses_weight(g.row_size()) for gi, g in enumerate(groups)
         if g.kind in ("ulysses", "usp") and g.row_size() > 1}
    if not w:
        return None
    held = np.zeros(n)
    for p in mb.placements:
        if p.group in w:
            for u, rs in zip(groups[p.group].units, p.ranges):
                if 0 <= u < n:
                    held[u] += ranges_tokens(rs) * w[p.group]
    return held


def _with_ulysses(mb: MicroBatch) -> MicroBatch:
    """``mb`` with its intra-node rings as Ulysses groups (their sequences cut contiguously does not
    matter here: the weights and the order of the sums do)."""
    groups = [record(Group, kind="ulysses", tier="intra", units=g.units) if g.kind == "ring" and g.tier == "intra"
              else g for g in mb.groups]
    return MicroBatch.model_construct(groups=groups, placements=mb.placements, queues=mb.queues, routes=mb.routes,
                                      linear_layout=None)


def test_held_tokens_match_the_plain_sums(planned):
    ctx, plan = planned
    n = ctx.num_units
    for mb in plan.microbatches:
        want = _held_reference(mb, n)
        pg = predict.placement_groups(mb)
        for got in (predict.attention_tokens(mb, n), predict.attention_tokens(mb, n, pg), held_tokens(mb, n)):
            assert np.array_equal(got, want)
        for m in (mb, _with_ulysses(mb)):
            want_u = _ulysses_reference(m, n, ctx.cost)
            for got_u in (predict.ulysses_held_tokens(m, n, ctx.cost), predict.ulysses_held_tokens(m, n, ctx.cost, pg)):
                assert (got_u is None) == (want_u is None)
                assert want_u is None or np.array_equal(got_u, want_u)


def _nic_loads_reference(ctx, mb: MicroBatch, routed: bool) -> dict[str, float]:
    cost, L = ctx.cost, ctx.model.num_layers
    loads: dict[str, float] = defaultdict(float)
    for r in mb.routes:
        rounds, share = cost.ring_hop_share(mb.groups[r.group])
        total = cost.ring_round_bytes_of(r.tokens) * share * rounds * L
        if routed:
            for p in r.paths:
                part = total * (p.tokens / r.tokens if r.tokens else 0.0)
                loads[p.nic_src] += part
                loads[p.nic_dst] += part
        else:
            for u in (r.src, r.dst):
                loads[ctx.cluster.nic_of(u * ctx.tp)] += total
    return dict(loads)


def _round_time_reference(ctx, mb: MicroBatch, routed: bool):
    cost = ctx.cost
    shared = ctx.profile.nic_shared_by_concurrent_transfers
    hop = {r.group: cost.ring_hop_share(mb.groups[r.group]) for r in mb.routes}
    flows, spread = [], {}
    for r, p, tokens, a, b in predict._route_flows(ctx, mb, routed):
        nbytes = cost.ring_round_bytes_of(tokens) * hop[r.group][1]
        flows.append((r.group, nbytes, a, b))
        if p is not None:
            d = spread.setdefault(id(r), [r.group, 0.0, 0.0])
            d[1] += nbytes * (p.via_src != r.src) / ctx.tp
            d[2] += nbytes * (p.via_dst != r.dst) / ctx.tp
    hops: dict[int, float] = defaultdict(float)
    for g, out_b, in_b in spread.values():
        hops[g] = max(hops[g], cost.p2p_seconds(out_b, "intra") + cost.p2p_seconds(in_b, "intra"))
    own: dict[tuple, float] = defaultdict(float)
    busy: dict[tuple, float] = defaultdict(float)
    for g, nbytes, a, b in flows:
        if shared:
            own["tx", g, a] += nbytes
            own["rx", g, b] += nbytes
            alone = cost.p2p_seconds(nbytes, "inter") * hop[g][0]
            busy["tx", a] += alone
            busy["rx", b] += alone
    out: dict[int, float] = defaultdict(float)
    floor: dict[int, float] = defaultdict(float)
    for g, nbytes, a, b in flows:
        load = max(own["tx", g, a], own["rx", g, b]) if shared else nbytes
        out[g] = max(out[g], cost.p2p_seconds(load, "inter") + hops.get(g, 0.0))
        floor[g] = max(floor[g], busy.get(("tx", a), 0.0), busy.get(("rx", b), 0.0))
    return out, floor


def _usp_versions(ctx, plan) -> list[MicroBatch]:
    """The plan's micro-batches, and each one's inter-node rings as usp groups (routed again)."""
    out = list(plan.microbatches)

    class _Search:
        sequences = plan.sequences

        class options:
            routing, remap = True, False

    _Search.ctx = ctx
    for mb in plan.microbatches:
        rings = zgroups.usp_rings(ctx, mb)
        if rings:
            out.append(zgroups.as_usp(_Search, mb, rings, remap=False))
    return out


def test_nic_loads_and_rounds_match_the_plain_loops(planned):
    ctx, plan = planned
    mbs = _usp_versions(ctx, plan)
    assert any(g.kind == "usp" and mb.routes for mb in mbs for g in mb.groups)
    for mb in mbs:
        for routed in (True, False):
            want = _nic_loads_reference(ctx, mb, routed)
            got = predict.nic_loads(ctx, mb, routed)
            assert list(got.items()) == list(want.items())
            assert list(predict.route_nic_loads(ctx, mb.groups, mb.routes)[0 if routed else 1].items()) == list(
                want.items())
            w_out, w_floor = _round_time_reference(ctx, mb, routed)
            g_out, g_floor = predict._route_round_time(ctx, mb, routed)
            assert list(g_out.items()) == list(w_out.items()) and list(g_floor.items()) == list(w_floor.items())


def test_group_lengths_match_a_mask_per_group(planned):
    ctx, plan = planned
    lengths = [s.length for s in plan.sequences]
    for mb in _usp_versions(ctx, plan):
        ga = predict._GroupArrays.of(ctx.cost, lengths, mb)
        want = np.fromiter(((p.padded_length or lengths[p.seq]) for p in mb.placements), dtype=np.float64,
                           count=len(mb.placements))
        assert np.array_equal(ga.pL, want)
        for gi in range(len(mb.groups)):
            assert np.array_equal(ga.lengths_of(gi), ga.pL[ga.pg == gi])


def test_ring_cuts_asked_per_ring_size_match_one_question_per_ring():
    """:func:`.groups._ring_cuts` asks the cost model once per ring size: the same answer as one
    question per ring, for a windowed model (some rings cut contiguously) and a full-attention one."""
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.schemas.model import ModelSpec

    rng = random.Random(3)
    lengths = [rng.randrange(2, 9000) for _ in range(300)]
    sizes = [rng.choice([2, 3, 4, 8]) for _ in lengths]
    for window in (512, None):
        spec = ModelSpec(name="w", num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, ffn_hidden=688,
                         vocab_size=1024, sliding_window=window)

        class _Ctx:
            cost = CostModel(cluster_preset("h100"), spec)

        want = [bool(_Ctx.cost.ring_contiguous(L, G)) for L, G in zip(lengths, sizes)]
        assert zgroups._ring_cuts(_Ctx, lengths, sizes) == want
        assert (window is None) != any(want)


def test_nic_loads_asked_again_for_the_same_lists_are_the_loads(planned):
    """``route_nic_loads`` hands out its last answer again only for the very same context, groups,
    routes and flags - copies, so a caller changing one changes nothing later - and prices any other
    lists afresh, equal contents included."""
    ctx, plan = planned
    mbs = [mb for mb in _usp_versions(ctx, plan) if mb.routes]
    assert len(mbs) >= 2
    for mb in mbs:
        want = [list(_nic_loads_reference(ctx, mb, r).items()) for r in (True, False)]
        first = predict.route_nic_loads(ctx, mb.groups, mb.routes)
        assert [list(d.items()) for d in first] == want
        first[0].clear()
        first[1]["x"] = 1.0
        again = predict.route_nic_loads(ctx, mb.groups, mb.routes)
        assert [list(d.items()) for d in again] == want
        again[0].clear()
        assert [list(d.items()) for d in predict.route_nic_loads(ctx, mb.groups, mb.routes)] == want
        assert [list(d.items()) for d in predict.route_nic_loads(ctx, list(mb.groups), list(mb.routes))] == want
        assert predict.route_nic_loads(ctx, mb.groups, mb.routes, unrouted=False)[1] == {}
    # another micro-batch's lists right after: its own loads, not the last answer
    a, b = mbs[0], mbs[-1]
    predict.route_nic_loads(ctx, a.groups, a.routes)
    assert list(predict.route_nic_loads(ctx, b.groups, b.routes)[0].items()) == list(
        _nic_loads_reference(ctx, b, True).items())
    assert predict.route_nic_loads(ctx, a.groups, b.routes[:1]) != predict.route_nic_loads(ctx, a.groups, a.routes)
