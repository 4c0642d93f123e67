"""Runtime remap (attention layout <-> token-balanced linear layout) and the process-group cache.

The distributed tests run on 4 gloo processes and compare against a single-process reference that
builds each unit's buffers directly from whole sequences (no use of the remap code).
"""

from __future__ import annotations

import pytest
import torch

from zeppelin.runtime.groups import aligned_blocks, plan_rank_sets
from zeppelin.runtime.remap import remap_pieces
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.common import InputError, content_hash
from zeppelin.schemas.layout import contiguous_ranges, split_even, zigzag_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import (
    Group,
    InputHashes,
    MicroBatch,
    Placement,
    PlanHeader,
    Replica,
    Sequence,
    StepPlan,
    structural_problems,
)
from zeppelin.schemas.profile import default_profile

WORLD = 4  # ranks of the module's process pool (the `pool` fixture of tests/conftest.py)
HID = 6


def make_header(cluster="local-cpu:2x2", tp=1, num_steps=1) -> PlanHeader:
    c = cluster_preset(cluster)
    m = model_preset("tiny")
    p = default_profile(c.name, "cpu")
    return PlanHeader(planner="test", num_steps=num_steps, world_size=c.world_size, tp=tp, cluster=c, model=m,
                      profile=p, hashes=InputHashes(cluster=content_hash(c), model=content_hash(m),
                                                    profile=content_hash(p), manifest="sha256:0"))


def balanced_linear_layout(lengths: list[int], units: int) -> list[list[list[int]]]:
    """Token-balanced layout: all tokens in sequence order, cut into `units` near-equal parts."""
    out: list[list[list[int]]] = [[] for _ in range(units)]
    sizes = split_even(sum(lengths), units)
    u, room = 0, sizes[0]
    for seq, L in enumerate(lengths):
        pos = 0
        while pos < L:
            while room == 0:
                u += 1
                room = sizes[u]
            n = min(room, L - pos)
            out[u].append([seq, pos, pos + n])
            pos += n
            room -= n
    return out


def three_tier_step(remap: bool = True, units: int = 4) -> StepPlan:
    """Inter-node ring over 4 units, intra-node ring over units 2,3, local sequences on 0 and 1;
    the linear layout interleaves sequences in reverse order so most tokens move."""
    lengths = [37, 9, 5, 301, 23]
    seqs = [Sequence(sample_id=i, length=L) for i, L in enumerate(lengths)]
    groups = [Group(kind="ring", tier="inter", units=[0, 1, 2, 3]),
              Group(kind="ring", tier="intra", units=[2, 3]),
              Group(kind="local", tier="local", units=[0]), Group(kind="local", tier="local", units=[1])]
    pl = [Placement(seq=3, group=0, scheme="zigzag", ranges=zigzag_ranges(301, 4)),
          Placement(seq=0, group=1, scheme="zigzag", ranges=zigzag_ranges(37, 2)),
          Placement(seq=4, group=1, scheme="zigzag", ranges=zigzag_ranges(23, 2)),
          Placement(seq=1, group=2, ranges=[[[0, 9]]]), Placement(seq=2, group=3, ranges=[[[0, 5]]])]
    lin = None
    if remap:
        rev = balanced_linear_layout(lengths[::-1], units)
        lin = [[[len(lengths) - 1 - s, a, b] for s, a, b in segs] for segs in rev]
    mb = MicroBatch(groups=groups, placements=pl, queues=[[0, 2], [0, 3], [0, 1], [0, 1]], linear_layout=lin)
    return StepPlan(step=0, sequences=seqs, microbatches=[mb])


def tp2_step() -> StepPlan:
    """Two units of TP=2 (ranks {0,1} and {2,3}): a ring over both units and a local sequence."""
    lengths = [40, 11]
    seqs = [Sequence(sample_id=i, length=L) for i, L in enumerate(lengths)]
    groups = [Group(kind="ring", tier="inter", units=[0, 1]), Group(kind="local", tier="local", units=[1])]
    pl = [Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(40, 2)),
          Placement(seq=1, group=1, ranges=[[[0, 11]]])]
    mb = MicroBatch(groups=groups, placements=pl, queues=[[0], [0, 1]],
                    linear_layout=balanced_linear_layout(lengths, 2))
    return StepPlan(step=0, sequences=seqs, microbatches=[mb])


def _seq_tensors(step: StepPlan, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.length, HID, generator=g, dtype=torch.float64) for s in step.sequences]


def _gather(tensors, segs):
    return torch.cat([tensors[q][a:b] for q, a, b in segs])


def _reference_bytes(header: PlanHeader, step: StepPlan, rank: int, elem_bytes: int) -> dict[str, int]:
    """Bytes this rank sends (forward + backward), from a token-by-token map of both layouts."""
    mb = step.microbatches[0]
    reps = header.replicas(step)
    where_att, where_lin = {}, {}
    for u in range(len(reps)):
        for q, a, b in mb.attention_segments(u):
            for t in range(a, b):
                where_att[(q, t)] = u
        for q, a, b in mb.linear_segments(u):
            for t in range(a, b):
                where_lin[(q, t)] = u
    me = next(u for u, r in enumerate(reps) if rank in r.ranks)
    ti = reps[me].ranks.index(rank)
    out = {"intra": 0, "inter": 0}
    node = header.cluster.node_of
    for tok, u in where_att.items():
        v = where_lin[tok]
        for src, dst in ((u, v), (v, u)):  # forward sends att->lin, backward lin->att
            if src == me and dst != me:
                peer = reps[dst].ranks[ti]
                out["intra" if node(peer) == node(rank) else "inter"] += HID * elem_bytes
    return out


def _remap_worker(rank, world, header_json, step_json, seed, dtype_name):
    from zeppelin.runtime.remap import Remapper

    header = PlanHeader.model_validate_json(header_json)
    step = StepPlan.model_validate_json(step_json)
    dtype = getattr(torch, dtype_name)
    reps = header.replicas(step)
    unit = next(u for u, r in enumerate(reps) if rank in r.ranks)
    mb = step.microbatches[0]
    xs = [t.to(dtype) for t in _seq_tensors(step, seed)]
    ws = [t.to(dtype) for t in _seq_tensors(step, seed + 1)]
    rm = Remapper(header, step, 0, rank)
    x_att = _gather(xs, mb.attention_segments(unit)).requires_grad_(True)
    y_lin = rm.to_linear(x_att)
    (y_lin * _gather(ws, mb.linear_segments(unit))).sum().backward()
    x_lin = _gather(xs, mb.linear_segments(unit)).requires_grad_(True)
    y_att = rm.to_attention(x_lin)
    (y_att * _gather(ws, mb.attention_segments(unit))).sum().backward()
    return dict(y_lin=y_lin.detach(), g_att=x_att.grad, y_att=y_att.detach(), g_lin=x_lin.grad,
                stats=dict(rm.stats), enabled=rm.enabled, moved=rm.tokens_moved)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["three_tier", "tp2", "no_layout"])
def test_remap_matches_single_process_permutation(pool, case):
    if case == "three_tier":
        header, step = make_header(), three_tier_step()
    elif case == "tp2":
        header, step = make_header(tp=2), tp2_step()
    else:
        header, step = make_header(), three_tier_step(remap=False)
    assert structural_problems(header, step) == []
    dtype = torch.float32 if case != "tp2" else torch.bfloat16
    outs = pool.run(_remap_worker, header.model_dump_json(), step.model_dump_json(), 7,
                     str(dtype).split(".")[1],
                     timeout=60)
    mb = step.microbatches[0]
    reps = header.replicas(step)
    xs = [t.to(dtype) for t in _seq_tensors(step, 7)]
    ws = [t.to(dtype) for t in _seq_tensors(step, 8)]
    for rank, o in enumerate(outs):
        unit = next(u for u, r in enumerate(reps) if rank in r.ranks)
        att, lin = mb.attention_segments(unit), mb.linear_segments(unit)
        # pure data movement: bit-identical, in any dtype
        assert torch.equal(o["y_lin"], _gather(xs, lin))
        assert torch.equal(o["g_att"], _gather(ws, att))
        assert torch.equal(o["y_att"], _gather(xs, att))
        assert torch.equal(o["g_lin"], _gather(ws, lin))
        esize = torch.empty(0, dtype=dtype).element_size()
        ref = _reference_bytes(header, step, rank, esize)
        if case == "no_layout":
            assert not o["enabled"] and o["stats"]["intra"] == o["stats"]["inter"] == 0
        else:
            # two remaps (to_linear, to_attention), each forward + backward
            assert o["stats"]["intra"] == 2 * ref["intra"] and o["stats"]["inter"] == 2 * ref["inter"]
    if case == "three_tier":
        assert outs[0]["stats"]["inter"] > 0 and outs[0]["stats"]["intra"] > 0
        assert outs[0]["moved"] > 0


def test_remap_pieces_cover_layouts_and_reject_mismatch():
    step = three_tier_step()
    mb = step.microbatches[0]
    att = [mb.attention_segments(u) for u in range(4)]
    lin = [mb.linear_segments(u) for u in range(4)]
    pieces = remap_pieces(att, lin)
    assert sum(p.tokens for p in pieces) == step.tokens
    # every piece points at the same tokens in both buffers
    xs = _seq_tensors(step, 3)
    bufs_a = [_gather(xs, s) for s in att]
    bufs_l = [_gather(xs, s) for s in lin]
    for p in pieces:
        assert torch.equal(bufs_a[p.src][p.src_row:p.src_row + p.tokens],
                           bufs_l[p.dst][p.dst_row:p.dst_row + p.tokens])
        assert torch.equal(bufs_a[p.src][p.src_row:p.src_row + p.tokens], xs[p.seq][p.start:p.end])
    bad = [list(map(list, s)) for s in lin]
    bad[0][0][2] -= 1  # drop one token of the first linear segment of unit 0
    with pytest.raises(InputError, match=r"remap: .*sequence 4"):
        remap_pieces(att, bad, "step 0 microbatch 0: ")
    msg = "^remap: sequence 9 is in only one of the attention and linear layouts$"
    with pytest.raises(InputError, match=msg):
        remap_pieces(att, [s + ([[9, 0, 3]] if i == 0 else []) for i, s in enumerate(lin)])


def test_remapper_refuses_mismatched_layout_with_step_context():
    from zeppelin.runtime.remap import Remapper

    step = three_tier_step()
    mb = step.microbatches[0]
    mb.linear_layout[1] = mb.linear_layout[1][:-1]
    with pytest.raises(InputError, match=r"^step 0 microbatch 0: remap: "):
        Remapper(make_header(), step, 0, 0)
    with pytest.raises(InputError, match=r"^step 0: micro-batch 3 does not exist \(step has 1\)$"):
        Remapper(make_header(), step, 3, 0)


# ---------------------------------------------------------------------------------------------
# group cache
# ---------------------------------------------------------------------------------------------


def test_aligned_blocks_are_flexsp_pool():
    assert aligned_blocks(4) == [[0, 1], [2, 3], [0, 1, 2, 3]]
    blocks = aligned_blocks(16)
    assert len(blocks) == 8 + 4 + 2 + 1
    for r in range(16):
        assert sum(r in b for b in blocks) == 4  # log2(16)
    assert aligned_blocks(6) == [[0, 1], [2, 3], [4, 5], [0, 1, 2, 3]]


def test_plan_rank_sets_cover_tp_ulysses_and_replicas():
    h = make_header(cluster="local-cpu:2x4", tp=2)  # 8 ranks, 4 units of 2
    sets = plan_rank_sets(h)
    assert (0, 1) in sets and (6, 7) in sets  # TP groups
    assert (0, 2) in sets and (1, 3) in sets  # unit block {0,1}, per TP index
    assert (0, 2, 4, 6) in sets and (1, 3, 5, 7) in sets
    # a Hydraulis step (TP 1 and TP 2 replicas) and a non-aligned Ulysses group
    step = StepPlan(step=0, sequences=[Sequence(sample_id=0, length=8)],
                    replicas=[Replica(ranks=[0, 1], tp=2), Replica(ranks=[2], tp=1), Replica(ranks=[3], tp=1),
                              Replica(ranks=[4, 5, 6, 7], tp=4)],
                    microbatches=[MicroBatch(groups=[Group(kind="ulysses", tier="intra", units=[1, 2])],
                                             placements=[Placement(seq=0, group=0, scheme="contiguous",
                                                                   ranges=contiguous_ranges(8, 2))],
                                             queues=[[], [0], [0], []])])
    sets2 = plan_rank_sets(h, [step])
    assert (4, 5, 6, 7) in sets2 and (2, 3) in sets2
    assert sets2[:len(sets)] == sets  # deterministic order, header sets first


def _cache_worker(rank, world):
    import torch.distributed as dist

    from zeppelin.runtime.groups import GroupCache, GroupNotCreatedError

    cache = GroupCache(world)
    out = {"n": len(cache), "created": cache.created}
    pg = cache.get([rank ^ 1, rank])
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=pg)
    out["pair_sum"] = t.item()
    out["single"] = cache.get([rank]) is None
    out["world"] = cache.get(range(world)) is dist.group.WORLD
    try:
        cache.get([0, 3] if rank in (0, 3) else [1, 2])
        out["err"] = None
    except GroupNotCreatedError as e:
        out["err"] = str(e)
    return out


@pytest.mark.timeout(60)
def test_group_cache_creates_blocks_once_and_refuses_unknown(pool):
    outs = pool.run(_cache_worker, timeout=40)
    for rank, o in enumerate(outs):
        assert o["created"] == 3 and o["n"] == 2  # {0,1},{2,3},{0..3}; member of its pair and the world
        assert o["pair_sum"] == float(rank + (rank ^ 1))
        assert o["single"] and o["world"]
        pair = [0, 3] if rank in (0, 3) else [1, 2]
        assert o["err"] == (f"process group {pair} was not pre-created at start-up "
                            "(the plan does not name it); groups are created once, collectively, "
                            "before training — add it to GroupCache(extra=...)")



_EXIT_SCRIPT = """
import gc, sys
import torch.distributed as dist
from zeppelin.runtime.groups import GroupCache, set_default_cache
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
set_default_cache(GroupCache(1))
gc.disable()  # (cycles wait for a collection, as after a training loop)

class Holder:  # a garbage cycle holding the process group, as a model's FSDP state does
    def __init__(self):
        self.me, self.pg = self, dist.group.WORLD
    def __del__(self):
        print("collected while finalizing:", sys.is_finalizing(), flush=True)

Holder()
dist.destroy_process_group()
"""


def test_process_groups_left_in_cycles_are_collected_before_the_interpreter_finalizes(tmp_path):
    """A script that installs the runtime's group cache and ends with garbage cycles holding a
    process group: they are collected at exit while the interpreter is alive (an ``atexit`` hook
    of ``set_default_cache``). Collected during finalisation, a gloo group's worker thread cannot
    take the GIL and aborts the process ("terminate called without an active exception"), as
    examples/torchtitan_llama.py did at the end of about half its runs."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "collected while finalizing: False" in out.stdout, (out.stdout, out.stderr)
