"""What one rank runs for a plan's micro-batch: its attention tasks in execution order, compiled
from the plan alone (no process group, no tensors), so that every rank derives the same global
order and the order can be tested without starting one.

Order. Tasks run in phases inter -> intra -> local (the slowest communication starts first);
inside a phase, groups in increasing group index. Every rank derives the same order from the plan,
which makes the P2P schedule free of deadlocks: a rank waiting inside group g only waits on ranks
that have finished every group ordered before g.

Tasks. ``ring``: a ring, all-gather (run with the same exact ring schedule) or local (one-rank
ring) group this rank's unit belongs to; ``ulysses``: a Ulysses group; ``usp``: a 2-D (Ulysses x
ring) group (:mod:`.usp`); ``relay``: a ring this
rank's unit is not a member of but relays routed transfers for, as a proxy.

Units and tensor parallelism: plans name units; this rank is TP index ``t`` of its unit, and its
rings use TP index ``t`` of every unit (each TP rank attends over its own head shard).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from zeppelin.schemas.common import InputError
from zeppelin.schemas.invariants import runtime_problems
from zeppelin.schemas.plan import PlanHeader, StepPlan

from .ring import RingSpec
from .transport import RouteTable, hop_chain
from .ulysses import UlyssesSpec
from .usp import UspSpec

__all__ = ["PHASES", "Schedule", "Task", "compile_schedule"]

PHASES = ("inter", "intra", "local")


@dataclass(frozen=True)
class Task:
    """One group's work on one rank. ``row0:row1``: the group's rows in the rank's attention buffer
    (empty for a relay); ``routes``: the group's routed transfers in global ranks (empty: every
    transfer goes direct)."""

    group: int
    kind: str  # "ring" | "relay" | "ulysses" | "usp"
    tier: str
    rank: int
    spec: RingSpec | UlyssesSpec | UspSpec
    row0: int
    row1: int
    routes: RouteTable

    def peers(self) -> set[int]:
        """The ranks this task may send to or receive from."""
        ranks = self.spec.ranks
        if self.kind == "ulysses":
            return set(ranks) - {self.rank}
        if self.kind == "usp":
            return self.spec.peers
        out: set[int] = set()
        G = len(ranks)
        if G < 2:
            return out
        for i in range(G):
            src, dst = ranks[i], ranks[(i + 1) % G]
            paths = self.routes.get((src, dst))
            chains = [hop_chain(src, a, b, dst) for a, b, _ in paths] if paths else [[src, dst]]
            for chain in chains:
                for a, b in itertools.pairwise(chain):
                    if a == self.rank:
                        out.add(b)
                    if b == self.rank:
                        out.add(a)
        return out


@dataclass(frozen=True)
class Schedule:
    """One rank's attention work for one micro-batch of one step, in execution order."""

    step: int
    microbatch: int
    rank: int
    unit: int
    rows: int  # rows of the rank's attention buffer
    tasks: tuple[Task, ...]

    def order(self) -> list[tuple[str, int]]:
        """``(kind, group)`` in execution order."""
        return [(t.kind, t.group) for t in self.tasks]


def compile_schedule(header: PlanHeader, step: StepPlan, mb_index: int, rank: int) -> Schedule:
    """The schedule of GPU ``rank`` for micro-batch ``mb_index`` of ``step``. Raises InputError when
    the step breaks an invariant the runtime relies on
    (:func:`zeppelin.schemas.invariants.runtime_problems`)."""
    if not 0 <= mb_index < len(step.microbatches):
        raise InputError(f"step {step.step} has {len(step.microbatches)} micro-batches, asked for {mb_index}")
    where = f"step {step.step} microbatch {mb_index}"
    reps = header.replicas(step)
    unit = next((u for u, rp in enumerate(reps) if rank in rp.ranks), None)
    if unit is None:
        raise InputError(f"{where}: rank {rank} belongs to no unit of the plan")
    problems = runtime_problems(header, step)
    if problems:
        raise InputError(problems[0])
    mb = step.microbatches[mb_index]
    t = reps[unit].ranks.index(rank)
    my_tp = reps[unit].tp

    def grank(u: int) -> int:
        return reps[u].ranks[t]

    # routes of the groups of this rank's tensor-parallel degree (groups of units of another degree
    # never share attention work or proxies with this rank)
    routes: dict[int, RouteTable] = {}
    for r in mb.routes:
        if reps[mb.groups[r.group].units[0]].tp != my_tp:
            continue
        routes.setdefault(r.group, {})[(grank(r.src), grank(r.dst))] = [
            (grank(p.via_src), grank(p.via_dst), p.tokens) for p in r.paths
        ]
    by_group: dict[int, list[list[list[list[int]]]]] = {}
    for p in mb.placements:
        by_group.setdefault(p.group, []).append(p.ranges)
    # rows of each of my groups in the attention buffer (queue order)
    offsets: dict[int, tuple[int, int]] = {}
    off = 0
    for gi in mb.queues[unit]:
        pos = mb.groups[gi].units.index(unit)
        n = sum(max(0, e - s) for rngs in by_group.get(gi, ()) for s, e in rngs[pos])
        offsets[gi] = (off, off + n)
        off += n
    tasks: list[tuple[tuple[int, int], Task]] = []
    for gi, g in enumerate(mb.groups):
        mine = gi in offsets
        relays = gi in routes and any(rank in (a, b) for paths in routes[gi].values() for a, b, _ in paths)
        if not (mine or relays):
            continue
        seqs = by_group.get(gi, [])
        ranks = [grank(u) for u in g.units]
        key = (PHASES.index(g.tier), gi)
        rt = routes.get(gi, {})
        if mine:
            r0, r1 = offsets[gi]
            pos = g.units.index(unit)
            if g.kind == "usp":
                tasks.append((key, Task(gi, "usp", g.tier, rank,
                                        UspSpec(ranks=ranks, shape=tuple(g.shape), pos=pos, seqs=seqs), r0, r1, rt)))
            elif g.kind == "ulysses":
                tasks.append((key, Task(gi, "ulysses", g.tier, rank, UlyssesSpec(ranks=ranks, pos=pos, seqs=seqs),
                                        r0, r1, rt)))
            else:
                tasks.append((key, Task(gi, "ring", g.tier, rank, RingSpec(ranks=ranks, pos=pos, seqs=seqs),
                                        r0, r1, rt)))
        else:
            tasks.append((key, Task(gi, "relay", g.tier, rank, RingSpec(ranks=ranks, pos=None, seqs=seqs), 0, 0, rt)))
    tasks.sort(key=lambda x: x[0])
    return Schedule(step=step.step, microbatch=mb_index, rank=rank, unit=unit, rows=off,
                    tasks=tuple(task for _, task in tasks))


def ulysses_spec(header: PlanHeader, step: StepPlan, mb_index: int, group_index: int, rank: int) -> UlyssesSpec:
    """The spec of Ulysses group ``group_index`` of a micro-batch for GPU ``rank`` (its TP index
    picks, in every unit of the group, the rank with the same TP index), as the rank's schedule has it."""
    tasks = compile_schedule(header, step, mb_index, rank).tasks
    spec = next((t.spec for t in tasks if t.group == group_index and t.kind == "ulysses"), None)
    if spec is None:
        raise InputError(f"step {step.step} microbatch {mb_index}: rank {rank} is not in group {group_index}")
    return spec
