"""Heterogeneous Ulysses groups (sizes 4, then 2, 1, 1 concurrently, in one step on 4 gloo ranks) vs a float64
single-process reference: outputs and Q/K/V gradients, with GQA, head counts not divisible by the
group size, fewer KV heads than ranks, and a position that gets no query head at all."""

from __future__ import annotations

import pytest
import torch

from zeppelin.runtime.attn.reference import reference_attention
from zeppelin.runtime.attn.schedule import ulysses_spec
from zeppelin.runtime.attn.ulysses import UlyssesSpec, head_split
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.common import InputError, content_hash
from zeppelin.schemas.layout import contiguous_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import (
    Group,
    InputHashes,
    MicroBatch,
    Placement,
    PlanHeader,
    Sequence,
    StepPlan,
    structural_problems,
)
from zeppelin.schemas.profile import default_profile

from tests.support.numerics import assert_matches_reference

WORLD = 4  # ranks of the module's process pool (the `pool` fixture of tests/conftest.py)
D = 4
TOL = 1e-5
# (Hq, Hkv): 4/2 cuts KV groups over 4 ranks; 6/3 splits 2,2,1,1; 3/1 leaves rank 3 of the 4-group
# without a query head; 5/5 splits 3,2 over the pair
HEADS = [(4, 2), (6, 3), (3, 1), (5, 5)]


def make_header() -> PlanHeader:
    c = cluster_preset("local-cpu:2x2")
    m = model_preset("tiny")
    p = default_profile(c.name, "cpu")
    return PlanHeader(planner="test", num_steps=1, world_size=4, cluster=c, model=m, profile=p,
                      hashes=InputHashes(cluster=content_hash(c), model=content_hash(m),
                                         profile=content_hash(p), manifest="sha256:0"))


LENGTHS = [13, 3, 7, 9, 4, 6, 5]
# micro-batch 0: one group of 4 (sequences 0-2); micro-batch 1: groups of 2, 1 and 1 side by side
MB_OF = [0, 0, 0, 1, 1, 1, 1]
GROUP_OF = [0, 0, 0, 0, 0, 1, 2]


def mixed_step() -> StepPlan:
    groups = [[Group(kind="ulysses", tier="inter", units=[0, 1, 2, 3])],
              [Group(kind="ulysses", tier="intra", units=[1, 0]),  # ring order differs from rank order
               Group(kind="ulysses", tier="local", units=[2]),
               Group(kind="ulysses", tier="local", units=[3])]]
    queues = [[[0], [0], [0], [0]], [[0], [0], [1], [2]]]
    mbs = []
    for m in range(2):
        pl = [Placement(seq=i, group=g, scheme="contiguous",
                        ranges=contiguous_ranges(L, len(groups[m][g].units)))
              for i, (L, g) in enumerate(zip(LENGTHS, GROUP_OF)) if MB_OF[i] == m]
        mbs.append(MicroBatch(groups=groups[m], placements=pl, queues=queues[m]))
    return StepPlan(step=0, sequences=[Sequence(sample_id=i, length=L) for i, L in enumerate(LENGTHS)],
                    microbatches=mbs)


def _tensors(hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    out = []
    for L in LENGTHS:
        out.append({n: torch.randn(L, h, D, generator=g, dtype=torch.float64)
                    for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("w", hq))})
    return out


def _local_rows(spec: UlyssesSpec, seq_ids, t, name):
    return torch.cat([t[i][name][s:e] for i, per_pos in zip(seq_ids, spec.seqs)
                      for s, e in per_pos[spec.pos]])


def _ulysses_worker(rank, world, header_json, step_json):
    from zeppelin.runtime.attn.ulysses import ulysses_attention
    from zeppelin.runtime.groups import GroupCache

    header = PlanHeader.model_validate_json(header_json)
    step = StepPlan.model_validate_json(step_json)
    cache = GroupCache(world, header=header, steps=[step])
    res = {}
    for m, mb in enumerate(step.microbatches):
        gi = mb.queues[rank][0]
        spec = ulysses_spec(header, step, m, gi, rank)
        seq_ids = [p.seq for p in mb.placements if p.group == gi]
        for hq, hkv in HEADS:
            t = _tensors(hq, hkv)
            q, k, v = (_local_rows(spec, seq_ids, t, n).float().requires_grad_(True) for n in ("q", "k", "v"))
            o = ulysses_attention(q, k, v, spec, cache.get(spec.ranks))
            (o * _local_rows(spec, seq_ids, t, "w").float()).sum().backward()
            res[(m, hq, hkv)] = (gi, spec.pos, o.detach(), q.grad, k.grad, v.grad)
    return res


@pytest.mark.timeout(150)
def test_mixed_group_sizes_match_reference(pool):
    header, step = make_header(), mixed_step()
    assert structural_problems(header, step) == []
    outs = pool.run(_ulysses_worker, header.model_dump_json(), step.model_dump_json(), timeout=120)
    checked = 0
    for hq, hkv in HEADS:
        t = _tensors(hq, hkv)
        ref = []  # per sequence: output and grads of q, k, v (whole sequence)
        for i in range(len(LENGTHS)):
            q, k, v = (t[i][n].clone().requires_grad_(True) for n in ("q", "k", "v"))
            o = reference_attention(q, k, v, [0, LENGTHS[i]])
            (o * t[i]["w"]).sum().backward()
            ref.append((o.detach(), q.grad, k.grad, v.grad))
        for rank, out in enumerate(outs):
            for m, mb in enumerate(step.microbatches):
                gi, pos, *got = out[(m, hq, hkv)]
                ranges = {p.seq: p.ranges for p in mb.placements}
                seq_ids = [p.seq for p in mb.placements if p.group == gi]
                for which, name in enumerate(("output", "dq", "dk", "dv")):
                    want = torch.cat([ref[i][which][s:e] for i in seq_ids for s, e in ranges[i][pos]])
                    assert_matches_reference(got[which], want, TOL, f"heads {hq}/{hkv} mb {m} rank {rank} {name}")
                    checked += 1
    assert checked == len(HEADS) * 4 * 2 * 4


def test_head_split_covers_uneven_and_gqa():
    assert head_split(6, 3, 4) == [(0, 2, 0, 1), (2, 4, 1, 2), (4, 5, 2, 3), (5, 6, 2, 3)]
    assert head_split(4, 2, 4) == [(0, 1, 0, 1), (1, 2, 0, 1), (2, 3, 1, 2), (3, 4, 1, 2)]
    assert head_split(3, 1, 4)[3] == (3, 3, 0, 0)
    with pytest.raises(ValueError, match=r"^query heads \(6\) must be a multiple of KV heads \(4\)$"):
        head_split(6, 4, 2)


def test_spec_from_plan_and_errors():
    header, step = make_header(), mixed_step()
    s = ulysses_spec(header, step, 1, 0, 0)
    assert s.ranks == [1, 0] and s.pos == 1 and s.lengths == [9, 4]
    assert s.rows(0) == 5 + 2 and s.rows(1) == 4 + 2
    # gathered rows (position 0 then 1) reordered to whole sequences
    assert s.gather_perm().tolist() == [0, 1, 2, 3, 4, 7, 8, 9, 10, 5, 6, 11, 12]
    with pytest.raises(InputError, match=r"^step 0 microbatch 1: rank 3 is not in group 0$"):
        ulysses_spec(header, step, 1, 0, 3)
    with pytest.raises(ValueError, match=r"^sequence 0 of the Ulysses group is not covered contiguously"):
        UlyssesSpec(ranks=[0, 1], pos=0, seqs=[[[[0, 3]], [[4, 6]]]])


# ---------------------------------------------------------------------------------------------
# usp (Ulysses rows x a ring across them) on the same 4 ranks: one 2x2 group, zigzag and contiguous
# ---------------------------------------------------------------------------------------------

USP_HEADS = [(4, 2), (4, 1), (2, 2), (6, 3)]  # GQA; 2x the KV heads (replicated); MHA; KV groups cut
USP_LENGTHS = [13, 3, 22, 1]


def usp_step() -> StepPlan:
    from zeppelin.schemas.layout import usp_ranges

    g = Group(kind="usp", tier="inter", units=[2, 3, 0, 1], shape=[2, 2], kv_replication=1)
    pl = [Placement(seq=i, group=0, scheme=sch, ranges=usp_ranges(L, 2, 2, sch))
          for i, (L, sch) in enumerate(zip(USP_LENGTHS, ["zigzag", "contiguous", "zigzag", "zigzag"]))]
    return StepPlan(step=0, sequences=[Sequence(sample_id=i, length=L) for i, L in enumerate(USP_LENGTHS)],
                    microbatches=[MicroBatch(groups=[g], placements=pl, queues=[[0]] * 4)])


def _usp_worker(rank, world, header_json, step_json):
    from zeppelin.runtime.attn.schedule import compile_schedule
    from zeppelin.runtime.attn.transport import Transport
    from zeppelin.runtime.attn.usp import usp_attention
    from zeppelin.runtime.groups import GroupCache

    header = PlanHeader.model_validate_json(header_json)
    step = StepPlan.model_validate_json(step_json)
    cache = GroupCache(world, header=header, steps=[step])
    (task,) = compile_schedule(header, step, 0, rank).tasks
    spec = task.spec
    res = {}
    for hq, hkv in USP_HEADS:
        t = _usp_tensors(hq, hkv)
        q, k, v = (_local_rows(spec, range(len(USP_LENGTHS)), t, n).float().requires_grad_(True) for n in "qkv")
        o = usp_attention(q, k, v, spec, cache.get(spec.row.ranks), Transport(rank=rank))
        (o * _local_rows(spec, range(len(USP_LENGTHS)), t, "w").float()).sum().backward()
        res[(hq, hkv)] = (spec.pos, o.detach(), q.grad, k.grad, v.grad)
    return res


def _usp_tensors(hq, hkv):
    g = torch.Generator().manual_seed(hq * 7 + hkv)
    return [{n: torch.randn(L, h, D, generator=g, dtype=torch.float64)
             for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("w", hq))} for L in USP_LENGTHS]


@pytest.mark.timeout(150)
def test_usp_2x2_matches_reference(pool):
    """A 2x2 usp group (rows listed in another order than the ranks) with GQA, 2x the KV heads
    (replicated over a row), MHA and a row split cutting KV groups: outputs and Q/K/V gradients of
    every position equal the float64 reference."""
    header, step = make_header(), usp_step()
    assert structural_problems(header, step) == []
    outs = pool.run(_usp_worker, header.model_dump_json(), step.model_dump_json(), timeout=120)
    ranges = [p.ranges for p in step.microbatches[0].placements]
    for hq, hkv in USP_HEADS:
        t = _usp_tensors(hq, hkv)
        ref = []
        for i, L in enumerate(USP_LENGTHS):
            q, k, v = (t[i][n].clone().requires_grad_(True) for n in "qkv")
            o = reference_attention(q, k, v, [0, L])
            (o * t[i]["w"]).sum().backward()
            ref.append((o.detach(), q.grad, k.grad, v.grad))
        for rank, out in enumerate(outs):
            pos, *got = out[(hq, hkv)]
            for which, name in enumerate(("output", "dq", "dk", "dv")):
                want = torch.cat([ref[i][which][s:e] for i in range(len(USP_LENGTHS)) for s, e in ranges[i][pos]])
                assert_matches_reference(got[which], want, TOL, f"usp heads {hq}/{hkv} rank {rank} {name}")
