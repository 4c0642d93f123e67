"""FlexSP, Hydraulis and tensor-parallel Zeppelin plans run for real on 4 gloo ranks and equal the
single-process reference.

* FlexSP: Ulysses groups of sizes 4, 2 and 1 mixed over two micro-batches (hand plan, so the mix
  is guaranteed) and the ``flexsp`` planner's own output on a memory-tight cluster;
* Hydraulis: replicas of TP 2 and TP 1 in one job (the ``hydraulis`` planner's output, and a hand
  plan where the TP-2 replica sits out a micro-batch and two TP-1 replicas share a ring);
* Zeppelin with ``tp=2``: the planner's output and a hand plan with a remapped linear layout, each
  in the three TP overlap modes none / slicing / commfuse.

Each case checks the loss on every rank, the final hidden states of every token (gathered from the
ranks' sequence shards) and every parameter gradient against
:func:`zeppelin.runtime.model.reference_step` (fp32, norm-wise relative error <= 1e-5), and that
every rank ends with the same all-reduced gradient.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.clusters import cluster_preset  # local-cpu over fast links
from zeppelin.schemas.common import content_hash
from zeppelin.schemas.layout import contiguous_ranges, zigzag_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import (
    Group,
    InputHashes,
    MicroBatch,
    Placement,
    PlanHeader,
    RemapInfo,
    Replica,
    Sequence,
    StepPlan,
    structural_problems,
)
from zeppelin.schemas.profile import default_profile

from tests.runtime.test_runtime_dist import _dist_step, token_balanced
from tests.support.numerics import assert_matches_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORLD = 4
TOL = 1e-5
MODES = ("none", "slicing", "commfuse")


def seed_header(cluster, model, num_steps: int, planner: str, tp: int = 1, tp_overlap: str = "none",
                seed: int = 0) -> PlanHeader:
    profile = default_profile(cluster.name, cluster.device)
    return PlanHeader(planner=planner, num_steps=num_steps, world_size=cluster.world_size, seed=seed, tp=tp,
                      tp_overlap=tp_overlap, cluster=cluster, model=model, profile=profile,
                      hashes=InputHashes(cluster=content_hash(cluster), model=content_hash(model),
                                         profile=content_hash(profile), manifest="synthetic"))


def tight_cluster(memory_gb: float = 0.505):
    """local-cpu:1x4 whose processes hold a few hundred tokens (FlexSP then needs micro-batches)."""
    base = cluster_preset("local-cpu:1x4")
    return base.model_copy(update={"gpu": base.gpu.model_copy(update={"memory_gb": memory_gb})})


# FlexSP's memory: about 190 tokens per process (model states charged as FSDP holds them), so its MILP
# needs Ulysses groups of 2 and 4 processes and two micro-batches for the step below
FLEXSP_GB = 0.504


def planned_step(name: str, header: PlanHeader, lens: list[int], k: int = 0, **options) -> StepPlan:
    from zeppelin.planner.core.base import PlanContext, get_planner

    ctx = PlanContext(cluster=header.cluster, model=header.model, profile=header.profile, tp=header.tp,
                      tp_overlap=header.tp_overlap, seed=header.seed)
    seqs = [Sequence(sample_id=1000 + 50 * k + i, length=L) for i, L in enumerate(lens)]
    return get_planner(name, **options).plan_step(ctx, k, seqs)


# ---------------------------------------------------------------------------------------------
# hand plans
# ---------------------------------------------------------------------------------------------


def flexsp_hand_step(k: int = 0) -> StepPlan:
    """Micro-batch 0: one Ulysses group of 4 (uneven contiguous ranges, one rank of a short
    sequence empty). Micro-batch 1: Ulysses groups of 2, 1 and 1 (ranks 2,3 / 0 / 1 - the pair is
    not the first aligned block)."""
    lens = [61, 3, 29, 17, 8, 11, 5]
    seqs = [Sequence(sample_id=300 + 10 * k + i, length=L) for i, L in enumerate(lens)]
    mb0 = MicroBatch(groups=[Group(kind="ulysses", tier="intra", units=[0, 1, 2, 3])],
                     placements=[Placement(seq=0, group=0, scheme="contiguous", ranges=contiguous_ranges(61, 4)),
                                 Placement(seq=1, group=0, scheme="contiguous", ranges=contiguous_ranges(3, 4))],
                     queues=[[0], [0], [0], [0]])
    g1 = [Group(kind="ulysses", tier="intra", units=[3, 2]), Group(kind="ulysses", tier="local", units=[0]),
          Group(kind="ulysses", tier="local", units=[1])]
    pl1 = [Placement(seq=2, group=0, scheme="contiguous", ranges=contiguous_ranges(29, 2)),
           Placement(seq=3, group=0, scheme="contiguous", ranges=contiguous_ranges(17, 2)),
           Placement(seq=4, group=1, ranges=[[[0, 8]]]), Placement(seq=5, group=1, ranges=[[[0, 11]]]),
           Placement(seq=6, group=2, ranges=[[[0, 5]]])]
    mb1 = MicroBatch(groups=g1, placements=pl1, queues=[[1], [2], [0], [0]])
    return StepPlan(step=k, sequences=seqs, microbatches=[mb0, mb1])


def hydraulis_hand_step(k: int = 0) -> StepPlan:
    """Replicas [0,1] (TP 2), [2], [3]. Micro-batch 0: the TP-2 replica holds two sequences,
    replica 1 one, replica 2 nothing. Micro-batch 1: the TP-2 replica holds nothing (its TP
    collectives see an empty buffer) while replicas 1 and 2 share a zigzag ring."""
    lens = [40, 9, 23, 30, 6]
    seqs = [Sequence(sample_id=500 + 10 * k + i, length=L) for i, L in enumerate(lens)]
    reps = [Replica(ranks=[0, 1], tp=2), Replica(ranks=[2], tp=1), Replica(ranks=[3], tp=1)]
    mb0 = MicroBatch(groups=[Group(kind="local", tier="local", units=[u]) for u in range(2)],
                     placements=[Placement(seq=0, group=0, ranges=[[[0, 40]]]),
                                 Placement(seq=1, group=0, ranges=[[[0, 9]]]),
                                 Placement(seq=2, group=1, ranges=[[[0, 23]]])],
                     queues=[[0], [1], []])
    mb1 = MicroBatch(groups=[Group(kind="ring", tier="intra", units=[2, 1]),
                             Group(kind="local", tier="local", units=[1])],
                     placements=[Placement(seq=3, group=0, scheme="zigzag", ranges=zigzag_ranges(30, 2)),
                                 Placement(seq=4, group=1, ranges=[[[0, 6]]])],
                     queues=[[], [0, 1], [0]])
    return StepPlan(step=k, sequences=seqs, replicas=reps, microbatches=[mb0, mb1])


def tp2_hand_step(k: int = 0) -> StepPlan:
    """Two units of TP 2 on 4 ranks: a ring over both units, a reversed-order ring, local groups,
    an odd-length sequence; micro-batch 0 remaps to a token-balanced linear layout (the remap
    moves the column-parallel outputs of TP rank t between the units' TP ranks t)."""
    lens = [45, 19, 7, 12, 3, 26, 1]
    seqs = [Sequence(sample_id=700 + 10 * k + i, length=L) for i, L in enumerate(lens)]
    g0 = [Group(kind="ring", tier="intra", units=[0, 1]), Group(kind="ring", tier="intra", units=[1, 0]),
          Group(kind="local", tier="local", units=[0]), Group(kind="local", tier="local", units=[1])]
    pl0 = [Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(45, 2)),
           Placement(seq=1, group=1, scheme="zigzag", ranges=zigzag_ranges(19, 2)),
           Placement(seq=2, group=2, ranges=[[[0, 7]]]), Placement(seq=3, group=2, ranges=[[[0, 12]]]),
           Placement(seq=4, group=3, ranges=[[[0, 3]]])]
    mb0 = MicroBatch(groups=g0, placements=pl0, queues=[[0, 1, 2], [0, 1, 3]],
                     linear_layout=token_balanced([[i, 0, lens[i]] for i in range(5)], 2),
                     remap=RemapInfo(enabled=True, reason="test"))
    mb1 = MicroBatch(groups=[Group(kind="local", tier="local", units=[0]), Group(kind="local", tier="local", units=[1])],
                     placements=[Placement(seq=5, group=0, ranges=[[[0, 26]]]),
                                 Placement(seq=6, group=1, ranges=[[[0, 1]]])],
                     queues=[[0], [1]])
    return StepPlan(step=k, sequences=seqs, microbatches=[mb0, mb1])


# ---------------------------------------------------------------------------------------------
# the distributed side (one step per rank: test_runtime_dist._dist_step)
# ---------------------------------------------------------------------------------------------


def check(pool, header: PlanHeader, step: StepPlan, seed: int = 0, tp_overlap: str | None = None) -> list[dict]:
    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.model import LlamaModel, reference_step

    assert structural_problems(header, step) == []
    outs = pool.run(_dist_step, header.model_dump_json(), step.model_dump_json(), seed, tp_overlap, timeout=150)
    model = LlamaModel(header.model, seed=seed)
    ref = reference_step(model, step.sequences, TokenSource(header.model.vocab_size, header.seed))
    for o in outs:
        assert_matches_reference(o["loss"], ref["loss"], TOL, "loss")
    sums = [o["grad_sum"] for o in outs]
    assert max(sums) - min(sums) <= 1e-9 * max(sums)
    for name, g in outs[0]["grads"].items():
        assert_matches_reference(g, ref["grads"][name], TOL, f"gradient of {name}")
    # every real token's final hidden state, from the sequence shards of every rank, exactly once
    seen = {i: 0 for i in range(len(step.sequences))}
    for o in outs:
        for segs, h in o["hidden"]:
            row = 0
            for q, s, e in segs:
                n = min(e, step.sequences[q].length) - s
                if n > 0:
                    assert_matches_reference(h[row:row + n], ref["hidden"][q][s:s + n], TOL,
                                             f"hidden states of sequence {q} rows {s}:{e}")
                    seen[q] += n
                row += e - s
    assert seen == {i: s.length for i, s in enumerate(step.sequences)}
    assert sum(o["tokens"] for o in outs) == sum(s.padded_length or step.sequences[s.seq].length
                                                 for mb in step.microbatches for s in mb.placements)
    return outs


# ---------------------------------------------------------------------------------------------
# FlexSP
# ---------------------------------------------------------------------------------------------


def test_flexsp_mixed_ulysses_groups_two_microbatches(pool):
    header = seed_header(cluster_preset("local-cpu:1x4"), model_preset("tiny"), 1, "flexsp")
    step = flexsp_hand_step()
    sizes = [sorted(len(g.units) for g in mb.groups) for mb in step.microbatches]
    assert sizes == [[4], [1, 1, 2]]
    outs = check(pool, header, step)
    # the Ulysses pair {2,3} was pre-created at start-up (it is not an aligned pow2 block of units 0..1)
    assert (2, 3) in outs[2]["groups"] and (2, 3) in outs[3]["groups"]


def test_flexsp_planner_plan_matches_reference(pool):
    header = seed_header(tight_cluster(FLEXSP_GB), model_preset("tiny"), 1, "flexsp")
    step = planned_step("flexsp", header, [400, 300, 150, 90, 60, 45, 29, 17, 13, 11, 9, 7, 5, 3, 2, 1])
    assert {(g.kind, len(g.units)) for mb in step.microbatches for g in mb.groups} == {("ulysses", 2), ("ulysses", 4)}
    check(pool, header, step, seed=5)


# ---------------------------------------------------------------------------------------------
# Hydraulis
# ---------------------------------------------------------------------------------------------


def test_hydraulis_planner_mixed_tp_replicas(pool):
    header = seed_header(cluster_preset("local-cpu:1x4"), model_preset("tiny"), 1, "hydraulis", tp_overlap="commfuse")
    step = planned_step("hydraulis", header, [400, 150, 90, 60, 45, 29, 17, 13, 11, 9, 7, 5, 3, 2, 1],
                        tp_degrees="1,2")
    assert sorted(r.tp for r in step.replicas) == [1, 1, 2]
    check(pool, header, step, seed=2)


@pytest.mark.parametrize("mode", ["none", "commfuse"])
def test_hydraulis_hand_plan_idle_tp_replica_and_ring(pool, mode):
    header = seed_header(cluster_preset("local-cpu:1x4"), model_preset("tiny"), 1, "hydraulis")
    check(pool, header, hydraulis_hand_step(), seed=4, tp_overlap=mode)


def test_hydraulis_planner_cp_replica_over_tp2_replicas(pool):
    """A sequence longer than a TP-2 replica holds: the planner's CP replica rings it (zigzag) over
    both TP-2 replicas - ring attention between units whose K/V are TP shards."""
    from zeppelin.planner.costmodel.cost import CostModel

    header = seed_header(tight_cluster(), model_preset("tiny"), 1, "hydraulis")
    cap2 = CostModel(header.cluster, header.model, header.profile, tp=2).token_capacity
    step = planned_step("hydraulis", header, [int(1.6 * cap2), 150, 90, 60, 45, 29, 17, 13, 11, 9, 7, 5, 3, 2, 1],
                        tp_degrees="1,2")
    assert [r.tp for r in step.replicas] == [2, 2] and step.notes["cp_replicas"] == [[0, 1]]
    assert {(g.kind, tuple(g.units)) for mb in step.microbatches for g in mb.groups} == {("ring", (0, 1))}
    check(pool, header, step, seed=6)


def test_hydraulis_planner_cp_replica_beside_plain_replicas(pool):
    """TP 1 only: a CP replica of two units rings the long sequence while the two other replicas
    run whole sequences, over two micro-batches."""
    header = seed_header(tight_cluster(), model_preset("tiny"), 1, "hydraulis")
    step = planned_step("hydraulis", header, [451, 250, 200, 150, 90, 60, 45, 29, 17, 13, 11, 9, 7, 5, 3, 2, 1],
                        tp_degrees="1")
    assert step.notes["cp_replicas"] == [[0, 1]] and len(step.microbatches) == 2
    kinds = {(g.kind, tuple(g.units)) for mb in step.microbatches for g in mb.groups}
    assert ("ring", (0, 1)) in kinds and ("local", (2,)) in kinds and ("local", (3,)) in kinds
    check(pool, header, step, seed=7)


# ---------------------------------------------------------------------------------------------
# Zeppelin with tensor parallelism
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_zeppelin_tp2_planner_plan_each_overlap_mode(pool, mode):
    header = seed_header(cluster_preset("local-cpu:2x2"), model_preset("tiny"), 1, "zeppelin", tp=2,
                         tp_overlap=mode)
    step = planned_step("zeppelin", header, [1000, 301, 150, 45, 29, 17, 13, 11, 9, 7, 5, 3, 2, 1])
    assert header.num_units == 2 and any(g.kind == "ring" for mb in step.microbatches for g in mb.groups)
    check(pool, header, step, seed=1)


@pytest.mark.parametrize("mode", MODES)
def test_tp2_hand_plan_remap_rings_each_overlap_mode(pool, mode):
    header = seed_header(cluster_preset("local-cpu:1x4"), model_preset("tiny"), 1, "hand", tp=2)
    # the header says "none": the executor's tp_overlap overrides it (as --tp-overlap does)
    check(pool, header, tp2_hand_step(), seed=6, tp_overlap=mode)


def test_tp4_unit_with_replicated_kv_heads(pool):
    """One unit of TP 4 with 2 KV heads: each KV head serves two TP ranks (gradients summed)."""
    header = seed_header(cluster_preset("local-cpu:1x4"), model_preset("tiny"), 1, "hand", tp=4,
                         tp_overlap="commfuse")
    lens = [33, 7, 1]
    step = StepPlan(step=0, sequences=[Sequence(sample_id=900 + i, length=L) for i, L in enumerate(lens)],
                    microbatches=[MicroBatch(groups=[Group(kind="local", tier="local", units=[0])],
                                             placements=[Placement(seq=i, group=0, ranges=[[[0, L]]])
                                                         for i, L in enumerate(lens)],
                                             queues=[[0]])])
    check(pool, header, step, seed=8)


# ---------------------------------------------------------------------------------------------
# `zeppelin run --verify` end to end (the acceptance): 4 gloo ranks, through torchrun
# ---------------------------------------------------------------------------------------------


def _zeppelin_run(plan: Path, *args: str):
    import os
    import subprocess

    exe = str(Path(sys.executable).parent / "zeppelin")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([exe, "run", str(plan), "--verify", "--progress", "none", *args], capture_output=True,
                          text=True, env=env, timeout=240, check=False)


_VERIFY_OK = r"zeppelin run: --verify max relative differences: .* \(tolerance 1e-05\) - ok"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("system", ["flexsp", "hydraulis", "zeppelin-tp2-commfuse"])
def test_zeppelin_run_verify_seed_system_plans(tmp_path, system):
    import re

    from zeppelin.schemas.plan import write_plan

    lens = [400, 150, 90, 60, 45, 29, 17, 13, 11, 9, 7, 5, 3, 2, 1]
    extra: tuple[str, ...] = ()
    if system == "flexsp":
        header = seed_header(tight_cluster(FLEXSP_GB), model_preset("tiny"), 1, "flexsp")
        step = planned_step("flexsp", header, [400, 300, 150, 90, 60, 45, 29, 17, 13, 11, 9, 7, 5, 3, 2, 1])
        assert {(g.kind, len(g.units)) for mb in step.microbatches for g in mb.groups} == {("ulysses", 2), ("ulysses", 4)}
    elif system == "hydraulis":
        header = seed_header(cluster_preset("local-cpu:1x4"), model_preset("tiny"), 1, "hydraulis",
                             tp_overlap="commfuse")
        step = planned_step("hydraulis", header, lens, tp_degrees="1,2")
        assert sorted(r.tp for r in step.replicas) == [1, 1, 2]
    else:
        # the plan's header says "none"; --tp-overlap commfuse overrides it for the run
        header = seed_header(cluster_preset("local-cpu:2x2"), model_preset("tiny"), 1, "zeppelin", tp=2)
        step = planned_step("zeppelin", header, [1000, *lens[1:]])
        extra = ("--tp-overlap", "commfuse")
    plan = tmp_path / f"{system}.jsonl"
    write_plan(plan, header, [step])
    p = _zeppelin_run(plan, *extra)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(_VERIFY_OK, p.stdout), p.stdout
    if system != "flexsp":
        assert "TP overlap commfuse" in p.stdout, p.stdout
    else:
        assert "TP overlap" not in p.stdout


def test_startup_refuses_more_tp_ranks_than_heads(tmp_path):
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks
    from zeppelin.schemas.common import InputError
    from zeppelin.schemas.plan import write_plan

    header = seed_header(cluster_preset("local-cpu:1x8"), model_preset("tiny"), 1, "hand", tp=8)
    step = StepPlan(step=0, sequences=[Sequence(sample_id=0, length=8)],
                    microbatches=[MicroBatch(groups=[Group(kind="local", tier="local", units=[0])],
                                             placements=[Placement(seq=0, group=0, ranges=[[[0, 8]]])],
                                             queues=[[0]])])
    plan = tmp_path / "tp8.jsonl"
    write_plan(plan, header, [step])
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan=str(plan)), 8)
    assert str(e.value) == "the plan's tensor-parallel degree tp=8 exceeds the model's 4 attention heads"
    header = header.model_copy(update={"tp": 2})
    write_plan(plan, header, [step.model_copy(update={"microbatches": [step.microbatches[0].model_copy(
        update={"queues": [[0], [], [], []]})]})])
    startup_checks(RunConfig(plan=str(plan), tp_overlap="slicing"), 8)  # accepted
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan=str(plan), tp_overlap="ring"), 8)
    assert str(e.value) == "--tp-overlap must be none, slicing or commfuse (got 'ring')"
