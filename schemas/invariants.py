"""Plan invariants that need no cost model: the one list every reader of a plan checks.

Each invariant is a small function ``check(header, step) -> list[str]`` (human-readable problems,
empty: the step satisfies it) with a name, in :data:`INVARIANTS`, in the order they run:

* ``coverage``   (:func:`structural_problems`) indices name things that exist (units, groups,
                 sequences, NICs), queues and groups agree, every route is a transfer its ring makes,
                 predictions have one entry per unit, and every token of every sequence is covered
                 exactly once in the attention layout and, where a micro-batch remaps, in the linear
                 layout. Every plan read checks it (:class:`zeppelin.schemas.plan.PlanReader`); the
                 other invariants index freely once it holds.
* ``ring-order`` (:func:`ring_order_problems`) zigzag-cut sequences follow the 2G layout of their
                 ring order, and the units' queues order shared groups the same way: the union of
                 the queues is acyclic, so no two units wait on each other in opposite orders (what
                 makes a run free of deadlocks).
* ``kinds``      (:func:`kind_family_problems`) a unit runs one family of attention groups per
                 micro-batch: Ulysses and usp groups, or rings / all-gathers (local work goes with
                 either).
* ``heads``      (:func:`head_problems`) a usp group's rows split the query heads of a unit evenly
                 (u divides them), and a stated ``kv_replication`` is the number of row positions
                 each KV head lands on (u / KV heads of a unit when u exceeds them, else 1).
* ``tp``         (:func:`tp_problems`) an attention group joins units of one tensor-parallel
                 degree, and so do the proxies relaying its transfers.
* ``relays``     (:func:`relay_problems`) a usp group's routed transfers are relayed only by units
                 of their own column ring.
* ``routes``     (:func:`step_route_problems`) every node-crossing transfer of an inter-node ring
                 (a ring group's, a usp group's column rings') has exactly one route, carrying what
                 its source holds, over proxies on the right nodes and their own NICs.

Entry points: :func:`plan_problems` (every invariant, each problem prefixed by its name; ``zeppelin
validate`` adds the checks that need the cost model, such as memory) and :func:`runtime_problems`
(the invariants the runtime relies on to execute a step; the attention engine refuses a step that
breaks one).

This module imports the plan types only for annotations, so that ``plan.py`` can import it.
"""

from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .layout import ranges_tokens, usp_ranges, zigzag_ranges

if TYPE_CHECKING:  # pragma: no cover
    from .cluster import ClusterSpec
    from .plan import MicroBatch, PlanHeader, Replica, StepPlan

_GROUP = operator.attrgetter("group")

__all__ = [
    "INVARIANTS",
    "RUNTIME_INVARIANTS",
    "Invariant",
    "group_ring_edges",
    "group_rings",
    "head_problems",
    "inter_ring_transfers",
    "kv_replication",
    "kind_family_problems",
    "plan_problems",
    "relay_problems",
    "ring_edges",
    "ring_order_problems",
    "route_problems",
    "runtime_problems",
    "step_route_problems",
    "structural_problems",
    "tp_problems",
]


def _where(step: StepPlan, mbi: int) -> str:
    return f"step {step.step} microbatch {mbi}"


def _nic_nodes(cluster: ClusterSpec) -> dict[str, int]:
    """Every NIC of the cluster by its global name (``node<k>/<id>``), with its node."""
    return {f"node{k}/{n.id}": k for k in range(cluster.num_nodes) for n in cluster.nics}


def ring_edges(units: Sequence[int]) -> set[tuple[int, int]]:
    """The transfers a ring makes: each unit sends to the next in ring order (the last to the first)."""
    n = len(units)
    return {(units[i], units[(i + 1) % n]) for i in range(n)}


def group_rings(g) -> list[list[int]]:
    """The rings a group's K/V blocks travel: a ring group's one ring; a usp group's column rings
    (Ulysses position j of every row, in row order: ``units[j::u]``); none for other kinds."""
    if g.kind == "ring":
        return [list(g.units)]
    if g.kind == "usp" and g.shape is not None and g.shape[0] >= 1 and len(g.units) % g.shape[0] == 0:
        u = g.shape[0]
        return [list(g.units[j::u]) for j in range(u)]
    return []


def group_ring_edges(g) -> set[tuple[int, int]]:
    """The transfers of every ring of a group (:func:`group_rings`)."""
    return {e for ring in group_rings(g) for e in ring_edges(ring)}


# ---------------------------------------------------------------------------------------------
# coverage: indices, queues, routes' references, predictions, token coverage
# ---------------------------------------------------------------------------------------------


def replica_problems(header: PlanHeader, reps: list[Replica]) -> list[str]:
    ranks = sorted(r for rep in reps for r in rep.ranks)
    if ranks != list(range(header.world_size)):
        return [f"replicas do not cover GPU ranks 0..{header.world_size - 1} exactly once"]
    return []


def index_problems(header: PlanHeader, step: StepPlan, mbi: int, mb: MicroBatch, n_units: int) -> list[str]:
    """One micro-batch's indices name things that exist, and its queues and groups agree."""
    where = _where(step, mbi)
    if len(mb.queues) != n_units:
        return [f"{where}: {len(mb.queues)} queues for {n_units} units"]
    probs = [f"{where}: group {gi} names unit {u} (have {n_units})"
             for gi, g in enumerate(mb.groups) for u in g.units if not 0 <= u < n_units]
    if probs:
        return probs
    probs += route_reference_problems(header, mb, n_units, where)
    probs += recompute_problems(header, mb, where)
    for u, q in enumerate(mb.queues):
        for g in q:
            if not 0 <= g < len(mb.groups) or u not in mb.groups[g].units:
                probs.append(f"{where}: unit {u} queues group {g} it is not a member of")
    for gi, g in enumerate(mb.groups):
        for u in g.units:
            if gi not in mb.queues[u]:
                probs.append(f"{where}: unit {u} is in group {gi} but does not queue it (ring order broken)")
    nseq = len(step.sequences)
    for p in mb.placements:
        if not 0 <= p.seq < nseq:
            probs.append(f"{where}: placement names sequence {p.seq} (step has {nseq})")
        if not 0 <= p.group < len(mb.groups):
            probs.append(f"{where}: sequence {p.seq} placed in missing group {p.group}")
        elif len(p.ranges) != len(mb.groups[p.group].units):
            probs.append(f"{where}: sequence {p.seq} has ranges for {len(p.ranges)} ring positions, "
                         f"group {p.group} has {len(mb.groups[p.group].units)}")
    return probs


def recompute_problems(header: PlanHeader, mb: MicroBatch, where: str) -> list[str]:
    """A micro-batch names its recomputation (and its units' own, ``recompute_units``) only in a
    plan whose header says ``per-microbatch``; ``full:k`` recomputes fewer layers than the model has
    (all of them: ``full``); every unit listed is one of the micro-batch's, in ascending order, once,
    under a choice other than the micro-batch's own."""
    named = ([mb.recompute] if mb.recompute is not None else []) + list(mb.recompute_units or {})
    if not named:
        return []
    if header.recompute != "per-microbatch":
        what = f"recompute {mb.recompute!r}" if mb.recompute is not None else "recompute_units"
        return [f"{where}: says {what} but the plan's header says recompute "
                f"{header.recompute!r} for every micro-batch (per-microbatch lets each say its own)"]
    for mode in named:
        _, sep, k = mode.partition(":")
        if sep and int(k) >= header.model.num_layers:
            return [f"{where}: recompute {mode!r} names {k} layers, the model has {header.model.num_layers} "
                    f"(all of them: 'full')"]
    seen: set[int] = set()
    n = len(mb.queues)
    for mode, us in (mb.recompute_units or {}).items():
        if mode == (mb.recompute or "none"):
            return [f"{where}: recompute_units lists units for {mode!r}, the micro-batch's own choice"]
        if any(b <= a for a, b in zip(us, us[1:])) or any(not 0 <= u < n for u in us) or seen.intersection(us):
            return [f"{where}: recompute_units must list units of the micro-batch (0..{n - 1}) in ascending "
                    f"order, each once"]
        seen.update(us)
    return []


def route_reference_problems(header: PlanHeader, mb: MicroBatch, n_units: int, where: str) -> list[str]:
    """Every index and name a route uses exists: its group, its endpoints (neighbours in the group's
    ring), its proxies (units) and its NICs (of the plan's cluster)."""
    probs = []
    nics = _nic_nodes(header.cluster)
    for ri, r in enumerate(mb.routes):
        if not 0 <= r.group < len(mb.groups):
            probs.append(f"{where}: route {ri} names missing group {r.group}")
            continue
        members = mb.groups[r.group].units
        bad_end = False
        for end, u in (("source", r.src), ("destination", r.dst)):
            if not 0 <= u < n_units:  # (a unit outside the group: the ring-transfer check below)
                probs.append(f"{where}: route {ri} {end} {u} is not a unit of group {r.group}")
                bad_end = True
        if not bad_end and (r.src, r.dst) not in group_ring_edges(mb.groups[r.group]):
            probs.append(f"{where}: route {r.src}->{r.dst} is not a ring transfer of group {r.group} "
                         f"(ring {members})")
        for path in r.paths:
            for end, u in (("source", path.via_src), ("destination", path.via_dst)):
                if not 0 <= u < n_units:
                    probs.append(f"{where}: route {ri} {end} proxy {u} is not a unit (have {n_units})")
            for nic in (path.nic_src, path.nic_dst):
                if nic not in nics:
                    probs.append(f"{where}: route {ri} uses NIC {nic!r}, which the cluster does not have")
    return probs


def prediction_problems(header: PlanHeader, step: StepPlan, n_units: int) -> list[str]:
    """A prediction has one entry per unit and names only the cluster's NICs."""
    pred = step.prediction
    if pred is None:
        return []
    probs = []
    for name in type(pred.per_unit).model_fields:
        got = len(getattr(pred.per_unit, name))
        if got != n_units:
            probs.append(f"step {step.step}: prediction per_unit.{name} has {got} entries for {n_units} units")
    nics = _nic_nodes(header.cluster)
    for field in ("nic_bytes", "nic_bytes_unrouted"):
        for k in getattr(pred, field):
            if k not in nics:
                probs.append(f"step {step.step}: prediction {field} names NIC {k!r}, which the cluster does not have")
    return probs


def coverage_problems(step: StepPlan, n_units: int, limit: int = 20) -> list[str]:
    """Every token of every sequence exactly once in the attention layout and, for sequences of a
    micro-batch that remaps, exactly once in its linear layout (indices already checked)."""
    probs: list[str] = []
    nseq = len(step.sequences)
    att: dict[int, list[tuple[int, int]]] = {}
    lin: dict[int, list[tuple[int, int]]] = {}
    placed_in: dict[int, int] = {}
    for mbi, mb in enumerate(step.microbatches):
        for p in mb.placements:
            if p.seq in placed_in:
                probs.append(f"step {step.step}: sequence {p.seq} placed twice")
            placed_in[p.seq] = mbi
            for rs in p.ranges:
                for r in rs:
                    if len(r) != 2 or r[0] < 0 or r[1] < r[0]:
                        probs.append(f"step {step.step}: sequence {p.seq} has a bad range {r}")
                    else:
                        att.setdefault(p.seq, []).append((r[0], r[1]))
        if mb.linear_layout is not None:
            if len(mb.linear_layout) != n_units:
                probs.append(f"step {step.step} microbatch {mbi}: linear layout has {len(mb.linear_layout)} units")
            for segs in mb.linear_layout:
                for sg in segs:
                    if len(sg) != 3:
                        probs.append(f"step {step.step}: bad linear segment {sg}")
                        continue
                    lin.setdefault(sg[0], []).append((sg[1], sg[2]))
                    if placed_in.get(sg[0], mbi) != mbi:
                        probs.append(f"step {step.step}: sequence {sg[0]} remapped across micro-batches")
    pad = {p.seq: p.padded_length for mb in step.microbatches for p in mb.placements}
    remapped = {i for i, mbi in placed_in.items() if step.microbatches[mbi].linear_layout is not None}
    for name, cover, wanted in (("attention", att, range(nseq)), ("linear", lin, sorted(remapped))):
        for k in cover:
            if not 0 <= k < nseq:
                probs.append(f"step {step.step}: {name} layout names sequence {k} (step has {nseq})")
        for i in wanted:
            seq = step.sequences[i]
            if i not in cover:
                probs.append(f"step {step.step}: sequence {i} (sample {seq.sample_id}) has no {name} placement")
                continue
            end = pad.get(i) or seq.length
            if pad.get(i) is not None and pad[i] < seq.length:
                probs.append(f"step {step.step}: sequence {i} padded_length {pad[i]} < length {seq.length}")
            pos = 0
            for s, e in sorted(x for x in cover[i] if x[1] > x[0]):
                if s < pos:
                    probs.append(f"step {step.step}: {name} layout covers tokens {s}..{min(e, pos) - 1} "
                                 f"of sequence {i} twice")
                    break
                if s > pos:
                    probs.append(f"step {step.step}: {name} layout misses tokens {pos}..{s - 1} of sequence {i}")
                    break
                pos = e
            else:
                if pos != end:
                    what = "misses" if pos < end else "runs past"
                    probs.append(f"step {step.step}: {name} layout {what} the end of sequence {i} "
                                 f"(covers {pos} of {end} tokens)")
        if len(probs) >= limit:
            break
    return probs


def structural_problems(header: PlanHeader, step: StepPlan, limit: int = 20) -> list[str]:
    """The ``coverage`` invariant: what every plan read checks (empty: the step satisfies it).
    Indices come first; predictions and token coverage are checked only once every index holds."""
    reps = header.replicas(step)
    n_units = len(reps)
    probs = replica_problems(header, reps)
    for mbi, mb in enumerate(step.microbatches):
        probs += index_problems(header, step, mbi, mb, n_units)
        if len(probs) >= limit:
            return probs[:limit]
    if probs:
        return probs[:limit]
    probs += prediction_problems(header, step, n_units)
    probs += coverage_problems(step, n_units, limit)
    return probs[:limit]


# ---------------------------------------------------------------------------------------------
# ring-order, kinds, tp
# ---------------------------------------------------------------------------------------------


def zigzag_problems(step: StepPlan, mbi: int, mb: MicroBatch) -> list[str]:
    """Sequences cut as zigzag chunks: ring position i holds chunks i and 2G-1-i of 2G."""
    probs = []
    for p in mb.placements:
        if p.scheme != "zigzag":
            continue
        g = mb.groups[p.group]
        G = len(g.units)
        L = p.padded_length or step.sequences[p.seq].length
        if g.kind == "usp" and g.shape is not None:
            if [[list(r) for r in rs] for rs in p.ranges] != usp_ranges(L, g.shape[0], g.shape[1]):
                probs.append(f"{_where(step, mbi)}: sequence {p.seq} is not cut into 2r={2 * g.shape[1]} zigzag "
                             f"chunks split over the {g.shape[0]} positions of each row of usp group {p.group}")
            continue
        want = zigzag_ranges(L, G)
        if [[list(r) for r in rs] for rs in p.ranges] != want:
            probs.append(f"{_where(step, mbi)}: sequence {p.seq} is not cut into 2G={2 * G} zigzag chunks in ring "
                         f"order of group {p.group} (position i must hold chunks i and 2G-1-i)")
    return probs


def queue_order_problems(step: StepPlan, mbi: int, mb: MicroBatch) -> list[str]:
    """The union of every unit's queue order is acyclic: a ring waits only on rings every member
    finished before it."""
    succ: dict[int, set[int]] = defaultdict(set)
    indeg: dict[int, int] = defaultdict(int)
    nodes: set[int] = set()
    for q in mb.queues:
        nodes.update(q)
        for a, b in itertools.pairwise(q):
            if b not in succ[a]:
                succ[a].add(b)
                indeg[b] += 1
    ready = [g for g in nodes if indeg[g] == 0]
    seen = 0
    while ready:
        g = ready.pop()
        seen += 1
        for h in succ[g]:
            indeg[h] -= 1
            if indeg[h] == 0:
                ready.append(h)
    if seen == len(nodes):
        return []
    stuck = sorted(g for g in nodes if indeg[g] > 0)[:6]
    return [(f"{_where(step, mbi)}: units queue groups {stuck} in conflicting orders "
             "(their rings would wait on each other)")]


def ring_order_problems(header: PlanHeader, step: StepPlan) -> list[str]:
    """The ``ring-order`` invariant: zigzag layouts and acyclic queue orders, per micro-batch."""
    return [p for mbi, mb in enumerate(step.microbatches)
            for p in zigzag_problems(step, mbi, mb) + queue_order_problems(step, mbi, mb)]


def kind_family_problems(header: PlanHeader, step: StepPlan) -> list[str]:
    """The ``kinds`` invariant: the runtime runs one family of attention groups per unit and
    micro-batch (Ulysses all-to-all groups, or rings / all-gathers; local work goes with either)."""
    probs = []
    for mbi, mb in enumerate(step.microbatches):
        for u, q in enumerate(mb.queues):
            kinds = {mb.groups[g].kind for g in q}
            if kinds & {"ulysses", "usp"} and kinds & {"ring", "allgather"}:
                probs.append(f"{_where(step, mbi)}: unit {u} runs Ulysses and ring groups in one micro-batch "
                             "(the runtime runs one family per unit: Ulysses, or rings/all-gathers)")
    return probs


def kv_replication(num_heads: int, num_kv_heads: int, tp: int, u: int) -> int | None:
    """Row positions each KV head lands on when a Ulysses row of ``u`` units splits the heads of a
    unit of tensor-parallel degree ``tp`` (1: no replication); None when ``u`` does not split the
    unit's query heads evenly or exceeds its KV heads by no whole factor."""
    hq, hkv = num_heads // tp, max(1, num_kv_heads // tp)
    if u < 1 or hq % u:
        return None
    if u <= hkv:
        return 1
    return u // hkv if u % hkv == 0 else None


def head_problems(header: PlanHeader, step: StepPlan) -> list[str]:
    """The ``heads`` invariant: usp rows split a unit's query heads evenly, and every stated
    ``kv_replication`` is what the row's size implies (:func:`kv_replication`)."""
    reps = header.replicas(step)
    m = header.model
    probs = []
    for mbi, mb in enumerate(step.microbatches):
        for gi, g in enumerate(mb.groups):
            if g.kind not in ("ulysses", "usp") or (g.kind == "ulysses" and g.kv_replication is None):
                continue
            tp = reps[g.units[0]].tp
            u = g.row_size()
            want = kv_replication(m.num_heads, m.num_kv_heads, tp, u)
            if want is None:
                probs.append(f"{_where(step, mbi)}: group {gi} splits the {m.num_heads // tp} query heads of a unit "
                             f"over {u} positions per row; a {g.kind} row needs a size that divides them (and is "
                             f"a multiple of the {max(1, m.num_kv_heads // tp)} KV heads when larger)")
            elif g.kv_replication != want:
                probs.append(f"{_where(step, mbi)}: group {gi} states kv_replication {g.kv_replication}, but rows "
                             f"of {u} positions over {max(1, m.num_kv_heads // tp)} KV heads replicate each "
                             f"{want}x")
    return probs


def tp_problems(header: PlanHeader, step: StepPlan) -> list[str]:
    """The ``tp`` invariant: each rank of a unit attends over its own head shard with the ranks of
    the same tensor-parallel index in the other units, so a group's units (and the proxies relaying
    its transfers) have one tensor-parallel degree."""
    reps = header.replicas(step)
    probs = []
    for mbi, mb in enumerate(step.microbatches):
        where = _where(step, mbi)
        for gi, g in enumerate(mb.groups):
            tps = sorted({reps[u].tp for u in g.units})
            if len(tps) > 1:
                probs.append(f"{where}: group {gi} joins units of tensor-parallel degrees {tps}; an attention "
                             "group needs units of one tensor-parallel degree")
        for r in mb.routes:
            tp = reps[mb.groups[r.group].units[0]].tp
            for u in sorted({u for p in r.paths for u in (p.via_src, p.via_dst)}):
                if reps[u].tp != tp:
                    probs.append(f"{where}: unit {u} (tp={reps[u].tp}) relays a transfer of group {r.group}, "
                                 f"whose units have tp={tp}")
    return probs


# ---------------------------------------------------------------------------------------------
# routes
# ---------------------------------------------------------------------------------------------


def inter_ring_transfers(mb: MicroBatch, node_of_unit: Sequence[int]) -> dict[tuple[int, int, int], int]:
    """``(group, src, dst) -> tokens`` of every node-crossing ring transfer of the inter-node ring
    groups and of the column rings of inter-node usp groups: the tokens the source position holds
    (a usp position: its whole row's, which its row's all-to-all gathers for its heads; a transfer
    of no tokens needs no route)."""
    held: dict[int, list[int]] = {}
    inter = {gi for gi, g in enumerate(mb.groups) if g.kind in ("ring", "usp") and g.tier == "inter"}
    pls = mb.placements
    # (the placements of those groups, in order, picked without a Python step per placement)
    for p in itertools.compress(pls, map(inter.__contains__, map(_GROUP, pls))):
        g = mb.groups[p.group]
        row = held.setdefault(p.group, [0] * len(g.units))
        for pos in range(min(len(g.units), len(p.ranges))):
            row[pos] += ranges_tokens(p.ranges[pos])
    out: dict[tuple[int, int, int], int] = {}
    for gi, g in enumerate(mb.groups):
        if g.tier != "inter":
            continue
        pos = {x: i for i, x in enumerate(g.units)}
        u = g.shape[0] if g.kind == "usp" else 1
        tokens = held.get(gi, [0] * len(g.units))
        for ring in group_rings(g):
            G = len(ring)
            for i in range(G if G >= 2 else 0):
                s, d = ring[i], ring[(i + 1) % G]
                row = pos[s] // u * u  # (a ring position's block: its usp row's tokens)
                held_s = sum(tokens[row:row + u])
                if node_of_unit[s] != node_of_unit[d] and held_s > 0:
                    out[(gi, s, d)] = held_s
    return out


def route_problems(cluster: ClusterSpec, first_ranks: Sequence[int], mb: MicroBatch) -> list[str]:
    """Problems with a micro-batch's routes (empty: valid); ``first_ranks[u]``: unit ``u``'s first
    GPU rank, whose node and NIC are the unit's.

    Every route is a node-crossing ring transfer of an inter-node ring group carrying the tokens
    its source holds; every such transfer has exactly one route; each path's proxies are units on
    the source / destination node, its NICs exist and are the proxies' own NICs, and the path
    tokens add up. The hops follow: the cluster model joins every GPU of a node to the others over
    the intra-node link and to each NIC of its node over PCIe, and every NIC to the fabric.
    """
    probs: list[str] = []
    n_units = len(first_ranks)
    node = [cluster.node_of(r) for r in first_ranks]
    nic_node = _nic_nodes(cluster)
    expected = inter_ring_transfers(mb, node)
    seen: set[tuple[int, int, int]] = set()
    for r in mb.routes:
        where = f"route {r.src}->{r.dst} of group {r.group}"
        if not 0 <= r.group < len(mb.groups):
            probs.append(f"{where}: no such group (micro-batch has {len(mb.groups)})")
            continue
        g = mb.groups[r.group]
        if g.kind not in ("ring", "usp") or g.tier != "inter":
            probs.append(f"{where}: group is a {g.tier} {g.kind} group, not an inter-node ring")
            continue
        if len(g.units) < 2 or (r.src, r.dst) not in group_ring_edges(g):
            probs.append(f"{where}: {r.dst} is not the ring successor of {r.src}")
            continue
        if not (0 <= r.src < n_units and 0 <= r.dst < n_units):
            probs.append(f"{where}: names a unit the step does not have (have {n_units})")
            continue
        if node[r.src] == node[r.dst]:
            probs.append(f"{where}: both units are on node {node[r.src]} (not an inter-node transfer)")
            continue
        key = (r.group, r.src, r.dst)
        if key in seen:
            probs.append(f"{where}: routed twice")
        seen.add(key)
        want = expected.get(key, 0)
        if r.tokens != want:
            probs.append(f"{where}: carries {r.tokens} tokens but unit {r.src} holds {want} in the group")
        if sum(p.tokens for p in r.paths) != r.tokens:
            probs.append(f"{where}: path tokens add up to {sum(p.tokens for p in r.paths)}, not {r.tokens}")
        for p in r.paths:
            for side, end, via, nic in (("source", r.src, p.via_src, p.nic_src),
                                        ("destination", r.dst, p.via_dst, p.nic_dst)):
                problem = _proxy_problem(cluster, first_ranks, node, nic_node, side, end, via, nic)
                if problem:
                    probs.append(f"{where}: {problem}")
                    break
    for key in sorted(set(expected) - seen):
        probs.append(f"group {key[0]}: inter-node transfer {key[1]}->{key[2]} has no route")
    return probs


def _proxy_problem(cluster, first_ranks, node, nic_node, side: str, end: int, via: int, nic: str) -> str | None:
    """Why one end of a route path is not a proxy on the endpoint's node using its own NIC."""
    if not 0 <= via < len(first_ranks):
        return f"{side} proxy {via} is not a unit (have {len(first_ranks)})"
    if node[via] != node[end]:
        return f"{side} proxy {via} is on node {node[via]}, not on node {node[end]}"
    if nic not in nic_node:
        return f"NIC {nic!r} does not exist"
    if nic_node[nic] != node[via]:
        return f"NIC {nic} is not on node {node[via]} of {side} proxy {via}"
    own = cluster.nic_of(first_ranks[via])
    if nic != own:
        return f"{side} proxy {via} uses NIC {own}, not {nic}"
    return None


def relay_problems(header: PlanHeader, step: StepPlan) -> list[str]:
    """The ``relays`` invariant: a usp group's routed transfer is relayed only by units of its own
    column ring (the runtime runs each column ring's exchanges among that ring's ranks, members
    relaying for each other; a unit outside it would never post the relay)."""
    probs = []
    for mbi, mb in enumerate(step.microbatches):
        for r in mb.routes:
            g = mb.groups[r.group]
            ring = next((x for x in group_rings(g) if r.src in x), None)
            if g.kind != "usp" or ring is None:
                continue
            for u in sorted({u for p in r.paths for u in (p.via_src, p.via_dst)} - set(ring)):
                probs.append(f"{_where(step, mbi)}: unit {u} relays transfer {r.src}->{r.dst} of usp group "
                             f"{r.group}, outside the transfer's column ring {ring}")
    return probs


def step_route_problems(header: PlanHeader, step: StepPlan) -> list[str]:
    """The ``routes`` invariant for every micro-batch of the step. Replicas of mixed tensor-parallel
    degree (Hydraulis) may run their ring transfers direct, without routes."""
    firsts = [rep.ranks[0] for rep in header.replicas(step)]
    return [f"{_where(step, mbi)}: {p}" for mbi, mb in enumerate(step.microbatches)
            if step.replicas is None or mb.routes
            for p in route_problems(header.cluster, firsts, mb)]


# ---------------------------------------------------------------------------------------------
# the list and its entry points
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Invariant:
    name: str
    check: Callable[[PlanHeader, StepPlan], list[str]]


#: Every invariant that needs no cost model, in the order they run; ``coverage`` first.
INVARIANTS: tuple[Invariant, ...] = (
    Invariant("coverage", structural_problems),
    Invariant("ring-order", ring_order_problems),
    Invariant("kinds", kind_family_problems),
    Invariant("tp", tp_problems),
    Invariant("heads", head_problems),
    Invariant("relays", relay_problems),
    Invariant("routes", step_route_problems),
)

#: What the runtime relies on to execute a step: the indices it follows, the one family of groups
#: a unit runs, rings over ranks of one tensor-parallel index, and usp transfers relayed inside
#: their column rings. (Zigzag layouts and routes are
#: what a plan promises, not what execution needs: the runtime runs any disjoint ranges and sends
#: an unrouted transfer direct.)
RUNTIME_INVARIANTS: tuple[str, ...] = ("coverage", "kinds", "tp", "heads", "relays")


def plan_problems(header: PlanHeader, step: StepPlan, limit: int = 20,
                  names: Sequence[str] | None = None, prefix: bool = True) -> list[str]:
    """Problems of ``step`` with the invariants ``names`` (default: all of :data:`INVARIANTS`), in
    list order; each problem is prefixed with its invariant's name unless ``prefix`` is false. The
    others run only when ``coverage`` holds (they index freely)."""
    probs: list[str] = []
    for inv in INVARIANTS:
        if names is not None and inv.name not in names:
            continue
        found = inv.check(header, step)
        probs += [f"{inv.name}: {p}" for p in found] if prefix else found
        if inv.name == "coverage" and found or len(probs) >= limit:
            break
    return probs[:limit]


def runtime_problems(header: PlanHeader, step: StepPlan, limit: int = 1) -> list[str]:
    """The problems that keep the runtime from executing ``step`` (unprefixed)."""
    return plan_problems(header, step, limit=limit, names=RUNTIME_INVARIANTS, prefix=False)
