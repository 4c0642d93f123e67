"""Analytic per-step prediction shared by every planner (fills ``StepPlan.prediction``).

This is the closed-form model the planners optimise against: per unit, attention groups in queue
order (a ring group costs one local block plus G-1 rounds of max(compute, transfer)), linear
modules on the unit's linear-layout tokens, remap all-to-alls, and the gradient all-reduce. A
unit's rings overlap each other's compute; a ring's inter-node round moves its flows through the
sending and receiving sides of the NICs they cross, and no ring is faster than the busiest NIC side
it crosses. The event-driven simulator (``zeppelin simulate``), the reference, plays the same step
out with explicit per-round timelines.
"""

from __future__ import annotations

import math

from collections import defaultdict
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np

from zeppelin.planner.costmodel.context import PlanContext, PlanningError
from zeppelin.schemas.invariants import kv_replication
from zeppelin.schemas.layout import ranges_tokens
from zeppelin.schemas.plan import MicroBatch, Prediction, RankLoads, StepPlan

_GROUP = attrgetter("group")
_RANGES = attrgetter("ranges")
_UNITS = attrgetter("units")
_SEQ = attrgetter("seq")
_KIND = attrgetter("kind")
_PADDED = attrgetter("padded_length")


def placement_groups(mb: MicroBatch) -> np.ndarray:
    """Per placement of ``mb``, the index of its group."""
    return np.fromiter(map(_GROUP, mb.placements), dtype=np.int64, count=len(mb.placements))


def nic_loads(ctx: PlanContext, mb: MicroBatch, routed: bool = True) -> dict[str, float]:
    """Bytes each NIC sends+receives per step for the micro-batch's inter-node ring transfers."""
    ro, un = route_nic_loads(ctx, mb.groups, mb.routes, routed=routed, unrouted=not routed)
    return ro if routed else un


#: the last :func:`route_nic_loads` call's (context, its cost model, groups, routes, flags) and
#: result: the router prices its routes once, and the micro-batch's prediction asks again for the
#: same lists
_LAST_NIC_LOADS: list = []


def route_nic_loads(ctx: PlanContext, groups, routes, routed: bool = True,
                    unrouted: bool = True) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`nic_loads` of a micro-batch's ``groups`` and ``routes`` along the routes' paths
    (``routed``) and direct (``unrouted``), in one pass over the routes (an empty dict where not
    asked for). Asked again for the very same lists (routes are never changed in place), the
    last answer is handed out again (copies)."""
    if _LAST_NIC_LOADS:
        c, cm, g, r, flags, (ro, un) = _LAST_NIC_LOADS[0]
        if c is ctx and cm is ctx.cost and g is groups and r is routes and flags == (routed, unrouted):
            return dict(ro), dict(un)
    ro, un = _route_nic_loads(ctx, groups, routes, routed, unrouted)
    _LAST_NIC_LOADS[:] = [(ctx, ctx.cost, groups, routes, (routed, unrouted), (ro, un))]
    return dict(ro), dict(un)


def _route_nic_loads(ctx: PlanContext, groups, routes, routed: bool,
                     unrouted: bool) -> tuple[dict[str, float], dict[str, float]]:
    cost, L = ctx.cost, ctx.model.num_layers
    ro: dict[str, float] = defaultdict(float)
    un: dict[str, float] = defaultdict(float)
    upn = ctx.units_per_node
    hops: dict[int, tuple[int, float]] = {}  # group -> its ring hop's (rounds, share): one per group
    nics: dict[int, str] = {}  # unit -> its NIC
    # (CostModel.ring_round_bytes_of's operations, in its order: a call per route costs more)
    kv, act, tp = cost.model.kv_dim, cost.act_bytes, cost.tp
    for r in routes:
        hop = hops.get(r.group)
        if hop is None:
            hop = hops[r.group] = cost.ring_hop_share(groups[r.group])
        rounds, share = hop
        total = 3.0 * (float(r.tokens) * 2 * kv * act / tp) * share * rounds * L
        if routed:
            for p in r.paths:
                part = total * (p.tokens / r.tokens if r.tokens else 0.0)
                ro[p.nic_src] += part
                ro[p.nic_dst] += part
        if unrouted:
            for u in (r.src, r.dst):
                nic = nics.get(u)
                if nic is None:
                    nic = nics[u] = _unit_nic(ctx, u, upn)
                un[nic] += total
    return dict(ro), dict(un)


def _unit_nic(ctx: PlanContext, unit: int, upn: int) -> str:
    rank = unit * ctx.tp
    return ctx.cluster.nic_of(rank)


def _route_flows(ctx: PlanContext, mb: MicroBatch, routed: bool):
    """Per inter-node route: its NIC flows of one ring round as the simulator makes them, one per
    path and tensor-parallel rank: ``(route, path or None, tokens, sending NIC, receiving NIC)``.
    A unit's TP ranks each move their shard over their own GPU's NIC (several ranks of a unit may
    share one); a route without paths (or unrouted) goes direct between the units' ranks."""
    cl, tp = ctx.cluster, ctx.tp
    for r in mb.routes:
        if routed and r.paths:
            for p in r.paths:
                if not p.tokens:
                    continue
                for k in range(tp):
                    if tp == 1:
                        yield r, p, p.tokens, p.nic_src, p.nic_dst
                    else:
                        yield r, p, p.tokens, cl.nic_of(p.via_src * tp + k), cl.nic_of(p.via_dst * tp + k)
        else:
            for k in range(tp):
                yield r, None, r.tokens, cl.nic_of(r.src * tp + k), cl.nic_of(r.dst * tp + k)


def _route_round_time(ctx: PlanContext, mb: MicroBatch, routed: bool) -> tuple[dict[int, float], dict[int, float]]:
    """Per inter-node ring group: (its transfer time of one round, the least time its crossings
    take over the layer).

    A round's flows of one group run together: a NIC's sending or receiving side (two separate
    links, as in the simulator) moves the bytes of every flow of the round crossing it, when the
    profile says concurrent transfers share a NIC; a routed round adds its dispatch and combine hops
    over NVLink, each through one port that carries every path's share. Flows of different groups meet only when their rounds coincide, so they do not slow
    each other's rounds - but every NIC side must move, over the layer, the bytes of every round of
    every group crossing it: a group takes at least as long as the busiest NIC side it crosses."""
    cost = ctx.cost
    shared = ctx.profile.nic_shared_by_concurrent_transfers
    groups, tp = mb.groups, ctx.tp
    hop: dict[int, tuple[int, float]] = {}  # per group: (rounds, K/V share)
    for r in mb.routes:
        if r.group not in hop:
            hop[r.group] = cost.ring_hop_share(groups[r.group])
    # (CostModel.ring_round_bytes_of's and p2p_seconds' operations, in their order: a call per flow
    # costs more than its arithmetic)
    kv, act, cost_tp = cost.model.kv_dim, cost.act_bytes, cost.tp
    intra, inter = cost.link("intra"), cost.link("inter")
    a_intra, bw_intra, a_inter, bw_inter = intra.alpha_s, intra.bandwidth_GBps, inter.alpha_s, inter.bandwidth_GBps
    flows = []
    # per route: the bytes its source GPU dispatches to proxies and its destination GPU combines
    # from them (one NVLink port each way, shared by all of the route's paths)
    spread: dict[int, list] = {}
    for r, p, tokens, a, b in _route_flows(ctx, mb, routed):
        g = r.group
        nbytes = 3.0 * (float(tokens) * 2 * kv * act / cost_tp) * hop[g][1]
        flows.append((g, nbytes, a, b))
        if p is not None:
            d = spread.get(id(r))
            if d is None:
                d = spread[id(r)] = [g, 0.0, 0.0]
            d[1] += nbytes * (p.via_src != r.src) / tp
            d[2] += nbytes * (p.via_dst != r.dst) / tp
    hops: dict[int, float] = defaultdict(float)  # per group: the slowest dispatch + combine of a round
    for g, out_b, in_b in spread.values():
        t = ((a_intra + out_b * 1.0 / (bw_intra * 1e9) if out_b > 0 else 0.0)
             + (a_intra + in_b * 1.0 / (bw_intra * 1e9) if in_b > 0 else 0.0))
        hops[g] = max(hops[g], t)
    own_tx: dict[tuple, float] = defaultdict(float)
    own_rx: dict[tuple, float] = defaultdict(float)
    busy_tx: dict[str, float] = defaultdict(float)
    busy_rx: dict[str, float] = defaultdict(float)
    if shared:
        for g, nbytes, a, b in flows:
            own_tx[g, a] += nbytes
            own_rx[g, b] += nbytes
            alone = (a_inter + nbytes * 1.0 / (bw_inter * 1e9) if nbytes > 0 else 0.0) * hop[g][0]
            busy_tx[a] += alone
            busy_rx[b] += alone
    out: dict[int, float] = defaultdict(float)
    floor: dict[int, float] = defaultdict(float)
    for g, nbytes, a, b in flows:
        load = max(own_tx[g, a], own_rx[g, b]) if shared else nbytes
        out[g] = max(out[g], (a_inter + load * 1.0 / (bw_inter * 1e9) if load > 0 else 0.0) + hops.get(g, 0.0))
        floor[g] = max(floor[g], busy_tx.get(a, 0.0), busy_rx.get(b, 0.0))
    return out, floor


def usp_row_sizes(ctx: PlanContext) -> list[int]:
    """Ulysses degrees u of a usp row: powers of two >= 2 dividing a node's units and the heads
    per unit, K/V heads replicated by a whole factor where u exceeds them."""
    m, upn = ctx.model, ctx.units_per_node
    out, u = [], 2
    while u <= upn:
        if upn % u == 0 and kv_replication(m.num_heads, m.num_kv_heads, ctx.tp, u) is not None:
            out.append(u)
        u *= 2
    return out


def _usp_shapes(ctx: PlanContext, length: int, wide: bool = False) -> list[tuple[int, int]]:
    """The usp shapes ``(u, r)`` whose units hold a sequence of ``length`` tokens: Ulysses rows of
    u units inside a node (u a power of two dividing a node's units and the heads, K/V heads
    replicated by a whole factor where u exceeds them), a ring of r >= 2 rows, from the fewest rows
    that hold it to twice as many (``wide``: and every power of two beyond; within the cluster)."""
    cost, n = ctx.cost, ctx.num_units
    out = []
    for u in usp_row_sizes(ctx):
        r0 = max(2, -(-length // (u * max(int(cost.ulysses_capacity(u)), 1))))
        rs = set(range(r0, min(n // u, 2 * r0) + 1))
        q = 2
        while wide and q <= n // u:
            rs |= {q} if q >= r0 else set()
            q *= 2
        out += [(u, r) for r in sorted(rs)]
    return out


def _attention_device_time(ctx: PlanContext, lengths: np.ndarray) -> np.ndarray:
    """Per sequence, the least device time (summed over units, one layer) its attention can take:
    whole on one unit when it fits; a sequence longer than a unit holds must be split over at least
    ``ceil(L / capacity)`` units, as a ring (G x per-unit round compute: its blocks are smaller than the
    sequence), as Ulysses inside a node (G x a head shard), or as a usp group of u x r units (a ring
    of r positions, each on 1/u of the heads: r x a ring position's compute, its blocks those of a
    ring of r), communication not counted (it may overlap other work)."""
    cost = ctx.cost
    L = np.asarray(lengths, dtype=np.float64)
    out = np.asarray(cost.attn_time(L), dtype=np.float64).copy()
    cap = max(int(cost.token_capacity), 1)
    big = np.flatnonzero(L > cap)
    if len(big) == 0:
        return out
    n, upn = ctx.num_units, ctx.units_per_node
    heads = ctx.model.num_heads // ctx.tp
    # the sequences that may take the same group sizes are priced together: the fewest units that
    # hold one, and per usp row size the fewest rows
    Lb = L[big].astype(np.int64)
    keys = [np.minimum(n, -(-Lb // cap))]
    for u in usp_row_sizes(ctx):
        keys.append(np.maximum(2, -(-Lb // (u * max(int(cost.ulysses_capacity(u)), 1)))))
    kinds, which = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)
    for q in range(len(kinds)):
        idx = big[np.flatnonzero(which.reshape(-1) == q)]
        Lq = L[idx]
        g0 = int(kinds[q][0])
        best = np.full(len(idx), np.inf)
        for G in range(max(2, g0), min(n, 2 * g0) + 1):
            best = np.minimum(best, G * cost.ring_compute_time(Lq, G))
            if G <= upn and heads % G == 0:
                best = np.minimum(best, G * cost.ulysses_attn_time(Lq, G))
        for u, r in _usp_shapes(ctx, int(Lq[0])):  # u x r units: a ring of r positions on 1/u of the heads each
            best = np.minimum(best, r * cost.ring_compute_time(Lq, r))
        out[idx] = np.where(np.isfinite(best), np.maximum(out[idx], best), out[idx])
    return out


_BOUNDS: list[tuple] = []  # the last few (context, its cost model, lengths) priced, with their bounds


def lower_bounds(ctx: PlanContext, lengths: np.ndarray, microbatches: int | None = None) -> tuple[float, float]:
    """(work bound, longest-sequence bound) in seconds (remembered for the last few steps: every
    candidate plan of a step is predicted against the same bounds). ``microbatches``: the fewest
    micro-batches any plan of the step runs (None: those memory forces, :func:`forced_microbatches`)."""
    m = forced_microbatches(ctx, lengths) if microbatches is None else max(1, int(microbatches))
    key = np.asarray(lengths, dtype=np.float64).tobytes()
    for c, cm, k, mk, v in _BOUNDS:
        if c is ctx and cm is ctx.cost and k == key and mk == m:
            return v
    v = _lower_bounds(ctx, lengths, m)
    _BOUNDS.insert(0, (ctx, ctx.cost, key, m, v))
    del _BOUNDS[4:]
    return v


def forced_microbatches(ctx: PlanContext, lengths, cap: float | None = None) -> int:
    """The fewest micro-batches that can hold the step's tokens: every unit holds at most its token
    capacity in each micro-batch (both layouts), under the most frugal recomputation the context
    may choose (``full`` where it chooses per micro-batch or per unit, else its own mode);
    ``cap``: that many tokens a unit instead."""
    cost = ctx.cost
    if cap is None:
        cap = cost.recompute_capacity("full") if cost.chooses_recompute or ctx.unit_recompute else cost.token_capacity
    total = float(np.sum(lengths))
    if cap <= 0 or ctx.num_units <= 0:
        return 1
    return max(1, math.ceil(total / (ctx.num_units * cap) - 1e-12))


def _lower_bounds(ctx: PlanContext, lengths: np.ndarray, m: int = 1) -> tuple[float, float]:
    """(work bound, longest-sequence bound) in seconds.

    The work bound prices attention per sequence and the linear modules on an even share of the
    step's tokens (kernels are priced on the tokens a unit holds), in ``m`` micro-batches (the
    fewest the plan may run: each pays the linear kernels' and the head's fixed cost, and under
    FSDP its own collectives - an even split pays least of them, the costs being affine in the
    tokens and the collectives' exposed part convex in the compute hiding them). Both include the
    gradient all-reduce, which every plan pays in full under this model (it is charged as exposed
    communication to every unit), so a plan can reach its bound."""
    cost = ctx.cost
    n = ctx.num_units
    # attention of every sequence, plus the linear modules on an even share of the step's tokens
    # (linear kernels are priced on the tokens a unit holds, as predict_step does, not per sequence)
    share = float(np.sum(lengths)) / n / m
    lin = m * (ctx.model.num_layers * float(cost.linear_time(share)) + float(cost.head_time(share)))
    work = ctx.model.num_layers * float(np.sum(_attention_device_time(ctx, lengths))) / n + lin
    ar = cost.step_collectives_time(m, n, [work / m] * m)  # (FSDP's prefetched collectives hide behind it)
    work += ar
    Lmax = int(lengths.max())
    best = float("inf")
    G = 1
    while G <= n:
        if Lmax / G <= max(cost.token_capacity, 1) or G == n:
            tier = "intra" if G <= ctx.units_per_node else "inter"
            # inter-node hops at best spread over every NIC of the node (routing), at no dispatch cost
            share = 1.0 / len(ctx.cluster.nics) if tier == "inter" else 1.0
            t = ctx.model.num_layers * float(cost.ring_attention_time(Lmax, G, tier, share)
                                             + cost.linear_time(Lmax / G))
            t += float(cost.head_time(Lmax / G))
            best = min(best, t)
        G *= 2
    for u, r in _usp_shapes(ctx, Lmax, wide=True):
        # a usp group: its rows' all-to-alls, its ring's compute on 1/u of the heads (its transfers
        # may hide behind that compute), the linear modules on its share
        att, _, _ = cost.usp_terms(np.array([float(Lmax)]), u, r, "intra", "inter" if u * r > ctx.units_per_node
                                   else "intra")
        share = Lmax / (u * r)
        a2a = float(cost.ulysses_comm_time(share, u, "intra"))
        t = ctx.model.num_layers * (att + a2a + float(cost.linear_time(share))) + float(cost.head_time(share))
        best = min(best, t)
    return work, best + cost.step_collectives_time(1, n, [best])


@dataclass
class MBTerms:
    """One micro-batch's contribution to a step's prediction (per unit, seconds / tokens)."""

    attn: np.ndarray
    lin: np.ndarray
    comm: np.ndarray
    exposed: np.ndarray
    tokens: np.ndarray  # linear-layout tokens
    mem_tokens: np.ndarray  # max(attention-layout tokens, linear-layout tokens)
    nic_routed: dict[str, float]
    nic_unrouted: dict[str, float]
    #: per unit: the micro-batch's time on the unit once coupling is charged - every unit of a set of
    #: units that exchange data (ring / all-gather / all-to-all partners, remap peers) waits, every
    #: layer, for the slowest of the set; plus the unit's own LM head. None: not computed (= busy)
    coupled: np.ndarray | None = None
    #: the micro-batch's own recomputation (``MicroBatch.recompute``; None: the plan's global mode)
    recompute: str | None = None
    #: each recomputation choice of the micro-batch with the units that run it (:func:`recompute_modes`)
    recompute_modes: list | None = None

    @property
    def busy(self) -> np.ndarray:
        """Per-unit time of this micro-batch (without the step's gradient all-reduce)."""
        return self.attn + self.lin + self.exposed

    @property
    def period(self) -> np.ndarray:
        """Per-unit time of this micro-batch including the waits for coupled units."""
        return self.busy if self.coupled is None else self.coupled


def coupled_components(n: int, pairs) -> np.ndarray:
    """Component label of each of ``n`` units, given iterables of units that exchange data."""
    parent = list(range(n))  # (a list: numpy scalar indexing costs more than the search)

    def find(x: int) -> int:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    for us in pairs:
        it = iter(us)
        first = next(it, None)
        if first is None:
            continue
        ra = find(int(first))
        for u in it:
            rb = find(int(u))
            if rb != ra:
                parent[rb] = ra
    return np.fromiter((find(u) for u in range(n)), dtype=np.int64, count=n)


def microbatch_components(ctx: PlanContext, n: int, links) -> np.ndarray:
    """Component label of each of ``n`` units in one micro-batch: the units that wait for each
    other every layer. Under FSDP (:attr:`PlanContext.microbatches_coupled`) every unit waits for
    the slowest, each layer; else the units that exchange data (``links``) do."""
    if ctx.microbatches_coupled:
        return np.zeros(n, dtype=np.int64)
    return coupled_components(n, links)


def component_max(labels: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per unit: the maximum of ``x`` over the unit's component."""
    m = np.full(len(x), -np.inf)
    np.maximum.at(m, labels, x)
    return m[labels]


def _attention_exposure(n: int, gu: np.ndarray, gi_rep: np.ndarray, t_att: np.ndarray, t_exp: np.ndarray,
                        is_ring: np.ndarray) -> np.ndarray:
    """Per unit, per layer: the communication its attention stream waits for.

    A ring's transfers run while the unit computes anything else it holds (the stream runs, among
    ready tasks, the earliest in queue order, so the other groups' blocks fill a ring's waits): a
    unit's rings expose only what the longest of them, alone, takes beyond all of the unit's
    attention compute. All-to-all and all-gather exchanges block their own compute and add up."""
    att_u = np.bincount(gu, weights=t_att[gi_rep], minlength=n)
    ring_rep = is_ring[gi_rep]
    longest = np.zeros(n)
    np.maximum.at(longest, gu[ring_rep], (t_att + t_exp)[gi_rep][ring_rep])
    other = np.bincount(gu, weights=np.where(is_ring, 0.0, t_exp)[gi_rep], minlength=n)
    return np.maximum(longest - att_u, 0.0) + other


def _group_sum(pg: np.ndarray, pL: np.ndarray, G: np.ndarray, mask: np.ndarray, price) -> np.ndarray:
    """Per group, the sum over its placements of ``price(lengths, group size)`` (groups in ``mask``;
    evaluated once per distinct group size, vectorised over the placements)."""
    out = np.zeros(len(pL))
    pG = G[pg]
    sel_any = mask[pg]
    for Gv in np.unique(pG[sel_any]):
        sel = (pG == Gv) & sel_any
        out[sel] = price(pL[sel], int(Gv))
    return np.bincount(pg, weights=out, minlength=len(G))


@dataclass
class _GroupArrays:
    """A micro-batch's placements and groups as arrays: per placement its group ``pg`` and (padded)
    length ``pL``; per group its size ``G``, kind, whether it is local / a ring, the sum of its
    placements' attention time ``g_att`` and lengths ``g_len``, whether it has any ``g_has``, and its
    ``units``."""

    pg: np.ndarray
    pL: np.ndarray
    G: np.ndarray
    kind: list[str]
    is_local: np.ndarray
    is_ring: np.ndarray
    g_att: np.ndarray
    g_len: np.ndarray
    g_has: np.ndarray
    units: list  # per group, its units
    _by_group: tuple | None = None

    @classmethod
    def of(cls, cost, seq_lengths, mb: MicroBatch, pg: np.ndarray | None = None) -> _GroupArrays:
        groups = mb.groups
        ng = len(groups)
        pls = mb.placements
        pg = placement_groups(mb) if pg is None else pg
        pads = list(map(_PADDED, pls))
        if any(pads):
            pL = np.fromiter(((p.padded_length or seq_lengths[p.seq]) for p in pls), dtype=np.float64, count=len(pls))
        else:  # (no placement padded: every length is its sequence's, gathered from all of them at once)
            seqs = np.fromiter(map(_SEQ, pls), dtype=np.int64, count=len(pls))
            pL = np.asarray(seq_lengths, dtype=np.float64)[seqs]
        # per group: sum of attention time and of lengths of its placements
        g_att = np.bincount(pg, weights=cost.attn_time(pL), minlength=ng) if len(pls) else np.zeros(ng)
        g_len = np.bincount(pg, weights=pL, minlength=ng) if len(pls) else np.zeros(ng)
        g_has = np.bincount(pg, minlength=ng) > 0 if len(pls) else np.zeros(ng, dtype=bool)
        units = list(map(_UNITS, groups))
        G = np.fromiter(map(len, units), dtype=np.float64, count=ng)
        kind = list(map(_KIND, groups))
        is_local = np.fromiter((k == "local" for k in kind), dtype=bool, count=ng) | (G == 1)
        is_ring = np.fromiter((k == "ring" for k in kind), dtype=bool, count=ng) & ~is_local
        return cls(pg=pg, pL=pL, G=G, kind=kind, is_local=is_local, is_ring=is_ring, g_att=g_att, g_len=g_len,
                   g_has=g_has, units=units)

    def lengths_of(self, gi: int) -> np.ndarray:
        """The (padded) lengths of group ``gi``'s placements, in placement order (``pL[pg == gi]``)."""
        if self._by_group is None:  # (placements sorted by group, stably: each group's in order)
            order = np.argsort(self.pg, kind="stable")
            self._by_group = (order, np.searchsorted(self.pg[order], np.arange(len(self.G) + 1)))
        order, bounds = self._by_group
        return self.pL[order[bounds[gi]:bounds[gi + 1]]]


def _held_tokens(mb: MicroBatch, n: int, pg: np.ndarray | None = None) -> np.ndarray:
    """Per unit: the tokens it holds in the micro-batch's attention layout (``pg``: its
    :func:`placement_groups`, where known)."""
    units_of = list(map(_UNITS, mb.groups))
    held = np.zeros(n)
    h_units: list[int] = []
    h_toks: list[int] = []
    add_unit, add_toks = h_units.append, h_toks.append
    for g, rs in zip(map(_GROUP, mb.placements) if pg is None else pg.tolist(), map(_RANGES, mb.placements)):
        if len(rs) == 1:  # (a local sequence: most placements)
            add_unit(units_of[g][0])
            r0 = rs[0]
            if len(r0) == 1:
                s, e = r0[0]
                add_toks(e - s)
            else:
                add_toks(ranges_tokens(r0))
        else:
            h_units += units_of[g][:len(rs)]
            h_toks += map(ranges_tokens, rs)
    if h_units:
        held += np.bincount(np.asarray(h_units, dtype=np.int64), weights=np.asarray(h_toks, dtype=np.float64),
                            minlength=n)
    return held


def attention_tokens(mb: MicroBatch, n: int, pg: np.ndarray | None = None) -> np.ndarray:
    """Per unit: the tokens it holds in the micro-batch's attention layout (of ``n`` units; ``pg``:
    its :func:`placement_groups`, where known)."""
    return _held_tokens(mb, n, pg)


def ulysses_held_tokens(mb: MicroBatch, n: int, costs, pg: np.ndarray | None = None) -> np.ndarray | None:
    """Per unit: the tokens it holds in Ulysses rows of two or more positions (Ulysses groups, usp
    groups' rows), each counted :meth:`ulysses_weight` times (replicated K/V heads on top) by the
    cost model of its group's units (``costs``: one for every unit, or a list per unit); None: the
    micro-batch has none. ``pg``: the micro-batch's :func:`placement_groups`, where known."""
    groups = mb.groups
    w = {gi: g.row_size() for gi, g in enumerate(groups) if g.kind in ("ulysses", "usp")}
    w = {gi: (costs[groups[gi].units[0]] if isinstance(costs, list) else costs).ulysses_weight(u)
         for gi, u in w.items() if u > 1}
    if not w:
        return None
    held = np.zeros(n)
    pls = mb.placements
    pg = placement_groups(mb) if pg is None else pg
    for i in np.flatnonzero(np.isin(pg, list(w))).tolist():  # (in placement order: the sums' order)
        p = pls[i]
        for u, rs in zip(groups[p.group].units, p.ranges):
            if 0 <= u < n:
                held[u] += ranges_tokens(rs) * w[p.group]
    return held


def layout_memory_tokens(cost, mb: MicroBatch, held: np.ndarray, lin_held: np.ndarray,
                         pg: np.ndarray | None = None) -> np.ndarray:
    """Per unit: the token-equivalents its memory holds in the micro-batch: its attention-layout
    tokens (Ulysses members' extra copies counted), or with a remap both layouts' tokens, each at
    its share of a token's bytes (:attr:`CostModel.remap_split`), and the copies whole (``pg``:
    the micro-batch's :func:`placement_groups`, where known)."""
    uly = ulysses_held_tokens(mb, len(held), cost, pg)
    att = held if uly is None else cost.layout_tokens(held, uly)
    if mb.linear_layout is not None:  # each layout holds its own part of every layer; Ulysses rows'
        # extra copies are whole tensors beside them (not a share of a token's bytes)
        return cost.remap_tokens(held, lin_held) + (att - held)
    return np.maximum(att, lin_held)


def _ring_terms(cost, mb: MicroBatch, ga: _GroupArrays, inter_round: dict[int, float], nic_floor: dict[int, float],
                t_att: np.ndarray, t_comm: np.ndarray, t_exp: np.ndarray) -> None:
    """Fills the ring groups' attention, communication and exposed time per layer."""
    groups, pg, pL, G, is_ring = mb.groups, ga.pg, ga.pL, ga.G, ga.is_ring
    ng = len(groups)
    Gr = G[is_ring]
    # per placement: round-0 and later-round compute of its zigzag blocks (as the simulator
    # prices them), summed per group: a round computes the blocks of every sequence of the group
    pG, on_ring = G[pg], is_ring[pg]
    p_t0, p_tr = np.zeros(len(pL)), np.zeros(len(pL))
    for Gv in np.unique(pG[on_ring]):  # (both rounds priced in one call per ring size)
        sel = (pG == Gv) & on_ring
        p_t0[sel], p_tr[sel] = cost.ring_round_compute(pL[sel], int(Gv))
    g_t0 = np.bincount(pg, weights=p_t0, minlength=ng)[is_ring]
    g_tr = np.bincount(pg, weights=p_tr, minlength=ng)[is_ring]
    comm_round = np.asarray(cost.p2p_time(cost.ring_round_bytes(ga.g_len[is_ring] / Gr), "intra"), dtype=np.float64)
    comm_round = np.array(comm_round, dtype=np.float64, copy=True).reshape(-1)
    ring_ids = np.flatnonzero(is_ring)
    for k, gi in enumerate(ring_ids):
        if groups[gi].tier == "inter" and int(gi) in inter_round:
            comm_round[k] = inter_round[int(gi)]
    t_att[is_ring] = g_t0 + (Gr - 1) * g_tr
    g_ex = None
    if cost.window_mix is not None:  # windowed layers: a ring posts only the exchanges its window needs
        p_ex = np.zeros(len(pL))
        for Gv in np.unique(pG[on_ring]):
            sel = (pG == Gv) & on_ring
            p_ex[sel] = cost.ring_exchanges(pL[sel], int(Gv))
        g_ex_all = np.zeros(ng)
        np.maximum.at(g_ex_all, pg, p_ex)
        g_ex = g_ex_all[is_ring]
    t_comm[is_ring] = comm_round * ((Gr - 1) if g_ex is None else g_ex)
    for Gv in np.unique(Gr):
        sel = Gr == Gv
        t_exp[ring_ids[sel]] = cost.ring_round_exposure(comm_round[sel], g_t0[sel], g_tr[sel], int(Gv),
                                                        None if g_ex is None else g_ex[sel])
    for gi, t in nic_floor.items():  # a ring is no faster than the busiest NIC side it crosses
        if is_ring[gi]:
            t_exp[gi] = max(t_exp[gi], t - t_att[gi])


def _collective_terms(cost, mb: MicroBatch, ga: _GroupArrays, inter_round: dict[int, float],
                      nic_floor: dict[int, float], t_att: np.ndarray, t_comm: np.ndarray, t_exp: np.ndarray) -> None:
    """Fills the Ulysses, usp and all-gather groups' attention, communication and exposed time per
    layer (a usp group's ring rounds as its routes make them: ``inter_round``, ``nic_floor``)."""
    groups, G, is_local, is_ring = mb.groups, ga.G, ga.is_local, ga.is_ring
    is_uly = np.fromiter((k == "ulysses" for k in ga.kind), dtype=bool, count=len(groups)) & ~is_local
    if is_uly.any() and len(mb.placements):
        # head shards: whole sequences on 1/G of the heads (CostModel.ulysses_attn_time)
        t_att[is_uly] = _group_sum(ga.pg, ga.pL, G, is_uly, cost.ulysses_attn_time)[is_uly]
    for gi in np.flatnonzero(~is_local & ~is_ring):
        g = groups[gi]
        Gi = G[gi]
        if g.kind == "allgather":
            t_att[gi] = ga.g_att[gi] / Gi
            t_comm[gi] = t_exp[gi] = float(cost.allgather_kv_time(ga.g_len[gi] / Gi, int(Gi), cost.tier_link(g.tier)))
        elif g.kind == "usp":
            u, r = g.shape
            Ls = ga.lengths_of(int(gi))
            t_att[gi], t_comm[gi], t_exp[gi] = cost.usp_terms(Ls, u, r, cost.tier_link(usp_row_tier(g, cost)),
                                                               cost.tier_link(g.tier), inter_round.get(int(gi)),
                                                               nic_floor.get(int(gi), 0.0))
        else:  # ulysses
            t_comm[gi] = t_exp[gi] = float(cost.ulysses_comm_time(ga.g_len[gi] / Gi, int(Gi), cost.tier_link(g.tier)))


def usp_row_tier(g, cost) -> str:
    """``intra`` when every row of a usp group sits on one node (the all-to-all stays on the
    intra-node links), else ``inter``."""
    u = g.shape[0]
    rows = [g.units[i:i + u] for i in range(0, len(g.units), u)]
    return "intra" if all(len({cost.node_of_unit(x) for x in row}) == 1 for row in rows) else "inter"


def _attention_sets(mb: MicroBatch, n: int):
    """Per unit, the token ranges of each sequence it holds in the attention layout; per sequence,
    the units holding some of it."""
    groups = mb.groups
    att_sets: list[dict[int, list[tuple[int, int]]]] = [defaultdict(list) for _ in range(n)]
    for p in mb.placements:
        units = groups[p.group].units
        for pos, rs in enumerate(p.ranges):
            for s, e in rs:
                if e > s:
                    att_sets[units[pos]][p.seq].append((s, e))
    seq_units: dict[int, set[int]] = defaultdict(set)
    for p in mb.placements:
        for pos, rs in enumerate(p.ranges):
            if any(e > s for s, e in rs):
                seq_units[p.seq].add(groups[p.group].units[pos])
    return att_sets, seq_units


def _linear_terms(ctx: PlanContext, mb: MicroBatch, held: np.ndarray, comm: np.ndarray, exposed: np.ndarray):
    """The linear modules, the LM head, TP-SP and remap communication of each unit:
    ``(linear-layout tokens, head, linear, comm, exposed, coupled unit sets)``."""
    cost, n, layers = ctx.cost, ctx.num_units, ctx.model.num_layers
    if mb.linear_layout is None:
        lin_held = held.copy()
    else:
        lin_held = np.array([sum(e - s for _, s, e in segs) for segs in mb.linear_layout], dtype=np.float64)
    head = np.asarray(cost.head_time(lin_held), dtype=np.float64)
    lin = layers * cost.linear_time(lin_held) + head
    links: list = [g.units for g in mb.groups if len(g.units) > 1]
    if ctx.tp > 1:
        t_tp = layers * cost.tp_exposed_comm(lin_held)
        comm = comm + t_tp
        exposed = exposed + t_tp
    if mb.linear_layout is not None:
        att_sets, seq_units = _attention_sets(mb, n)
        t_remap = layers * _remap_times(ctx, mb.linear_layout, att_sets, seq_units, links)
        comm = comm + t_remap
        exposed = exposed + t_remap
    lin = np.asarray(lin, dtype=np.float64)
    return lin_held, head, lin, comm, exposed, links


def microbatch_terms(ctx: PlanContext, seq_lengths, mb: MicroBatch, routed: bool = True,
                     pg: np.ndarray | None = None, held: np.ndarray | None = None) -> MBTerms:
    """Per-unit terms of one micro-batch; ``seq_lengths[i]`` is the length of the step's sequence i.
    ``pg`` (its :func:`placement_groups`) and ``held`` (its :func:`attention_tokens`): where the
    caller knows them.

    Vectorised over placements and groups: plans have thousands of units and sequences."""
    cost = ctx.cost
    n = ctx.num_units
    layers = ctx.model.num_layers
    groups = mb.groups
    ng = len(groups)
    inter_round, nic_floor = _route_round_time(ctx, mb, routed)
    ga = _GroupArrays.of(cost, seq_lengths, mb, pg)
    held = _held_tokens(mb, n, ga.pg) if held is None else held
    t_att = np.zeros(ng)
    t_comm = np.zeros(ng)
    t_exp = np.zeros(ng)
    t_att[ga.is_local] = ga.g_att[ga.is_local]
    if ga.is_ring.any():
        _ring_terms(cost, mb, ga, inter_round, nic_floor, t_att, t_comm, t_exp)
    _collective_terms(cost, mb, ga, inter_round, nic_floor, t_att, t_comm, t_exp)
    for a in (t_att, t_comm, t_exp):
        a[~ga.g_has] = 0.0
    # ---- scatter group terms to their units
    gu = np.fromiter(chain.from_iterable(ga.units), dtype=np.int64)
    gi_rep = np.repeat(np.arange(ng), ga.G.astype(np.int64))
    attn = layers * np.bincount(gu, weights=t_att[gi_rep], minlength=n)
    comm = layers * np.bincount(gu, weights=t_comm[gi_rep], minlength=n)
    exposed = layers * _attention_exposure(n, gu, gi_rep, t_att, t_exp, ga.is_ring)
    # ---- linear modules, TP, remap
    lin_held, head, lin, comm, exposed, links = _linear_terms(ctx, mb, held, comm, exposed)
    modes = recompute_modes(mb, n)
    for mode, mask in modes:  # the forward each unit's recomputation runs again
        if (mode or cost.global_recompute) != "none":
            extra = cost.recompute_extra_time(mode, attn, lin - head)
            lin = lin + (extra if mask is None else np.where(mask, extra, 0.0))
    # coupling: partners meet every layer, so per layer a unit waits for its component's slowest
    # member (the LM head runs once per micro-batch, after the last layer, on each unit's own tokens);
    # under FSDP every unit is one component (:attr:`PlanContext.microbatches_coupled`)
    labels = microbatch_components(ctx, n, links)
    coupled = component_max(labels, attn + lin - head + exposed) + head
    nic_r, nic_u = route_nic_loads(ctx, groups, mb.routes)
    return MBTerms(attn=attn, lin=lin, comm=comm, exposed=exposed,
                   tokens=lin_held.astype(np.int64), mem_tokens=layout_memory_tokens(cost, mb, held, lin_held, ga.pg),
                   nic_routed=nic_r, nic_unrouted=nic_u,
                   coupled=coupled, recompute=mb.recompute, recompute_modes=modes)


def recompute_modes(mb: MicroBatch, n: int) -> list[tuple[str | None, np.ndarray | None]]:
    """The micro-batch's recomputation choices with the units that run each: ``(choice, mask)``;
    one ``(MicroBatch.recompute, None)`` (every unit) where it lists no units of their own."""
    if not mb.recompute_units:
        return [(mb.recompute, None)]
    rest = np.ones(n, dtype=bool)
    out = []
    for mode, units in mb.recompute_units.items():
        mask = np.zeros(n, dtype=bool)
        mask[np.asarray(units, dtype=np.int64)] = True
        rest &= ~mask
        out.append((mode, mask))
    return [(mb.recompute, rest)] + out


def predict_from_terms(ctx: PlanContext, lengths, terms: list[MBTerms]) -> Prediction:
    """Step prediction from its micro-batches' terms (:func:`microbatch_terms`)."""
    cost = ctx.cost
    n = ctx.num_units
    attn = np.zeros(n)
    lin = np.zeros(n)
    comm = np.zeros(n)
    exposed = np.zeros(n)
    tokens = np.zeros(n, dtype=np.int64)
    mem_tokens = np.zeros(n)
    nic_r: dict[str, float] = defaultdict(float)
    nic_u: dict[str, float] = defaultdict(float)
    period = np.zeros(n)
    for t in terms:
        period += t.period
        attn += t.attn
        lin += t.lin
        comm += t.comm
        exposed += t.exposed
        tokens += t.tokens
        mem_tokens = np.maximum(mem_tokens, t.mem_tokens)
        for k, v in t.nic_routed.items():
            nic_r[k] += v
        for k, v in t.nic_unrouted.items():
            nic_u[k] += v
    # FSDP2's prefetched collectives hide behind each micro-batch's layers (the slowest unit's)
    ar = cost.step_collectives_time(len(terms), n, [float(t.period.max()) for t in terms] if n else None)
    comm += ar
    exposed += ar
    total = attn + lin + exposed
    work_b, long_b = lower_bounds(ctx, np.asarray(lengths, dtype=np.float64))
    return Prediction(
        # units that exchange data (under FSDP: every unit) wait for each other every layer of
        # every micro-batch
        step_time_s=float(max((period + ar).max(), total.max())),
        lower_bound_s=max(work_b, long_b),
        work_bound_s=work_b,
        longest_bound_s=long_b,
        per_unit=RankLoads(
            attention_s=attn.tolist(), linear_s=lin.tolist(), comm_s=comm.tolist(),
            exposed_comm_s=exposed.tolist(), total_s=total.tolist(),
            tokens=tokens.tolist(), memory_gb=(_peak_memory_bytes(cost, terms, mem_tokens) / 1e9).tolist(),
        ),
        nic_bytes=dict(nic_r),
        nic_bytes_unrouted=dict(nic_u),
    )


def _peak_memory_bytes(cost, terms: list[MBTerms], mem_tokens: np.ndarray) -> np.ndarray:
    """Per unit, the most bytes any micro-batch holds: under one global mode, the bytes of the most
    tokens held; with choices per micro-batch, the most over the micro-batches of each one's own."""
    if all(t.recompute is None and len(t.recompute_modes or ()) <= 1 for t in terms):
        return np.asarray(cost.memory_bytes(mem_tokens), dtype=np.float64)
    return np.max([_recompute_memory(cost, t) for t in terms], axis=0)


def _recompute_memory(cost, t: MBTerms) -> np.ndarray:
    """Per unit, the peak bytes of one micro-batch under its unit's choice (the choices' masks
    partition the units)."""
    out = np.zeros(len(t.mem_tokens))
    for mode, mask in t.recompute_modes or [(t.recompute, None)]:
        got = np.asarray(cost.recompute_memory_bytes(t.mem_tokens, mode), dtype=np.float64)
        if mask is None:
            return got
        out[mask] = got[mask]
    return out


def predict_step(ctx: PlanContext, step: StepPlan, routed: bool = True) -> Prediction:
    """Prediction of one step. Steps whose units are replicas of mixed TP degree (Hydraulis plans,
    ``step.replicas`` set) are predicted per replica with one cost model per TP degree."""
    if step.replicas is not None and (any(r.tp != ctx.tp for r in step.replicas) or any(
            g.kind == "ring" and g.tier == "inter" and not mb.routes for mb in step.microbatches for g in mb.groups)):
        # replica plans' inter-node rings run direct, one flow per TP rank (no routes)
        return predict_replicas(ctx, step)
    lengths = [s.length for s in step.sequences]
    return predict_from_terms(ctx, lengths, [microbatch_terms(ctx, lengths, mb, routed) for mb in step.microbatches])


def remap_link_loads(ctx: PlanContext, moves) -> tuple[np.ndarray, dict[str, int]]:
    """Link loads of remap moves ``(src, dst, tokens)``: per unit, the tokens it sends or receives
    inside its node; per NIC direction (``out:<nic>`` / ``in:<nic>``), the tokens crossing nodes
    through it (the units sharing a NIC share it)."""
    upn, tp, cl = ctx.units_per_node, ctx.tp, ctx.cluster
    intra = np.zeros(ctx.num_units)
    nic_io: dict[str, int] = defaultdict(int)
    for a, b, x in moves:
        if a // upn == b // upn:
            intra[a] += x
            intra[b] += x
        else:
            nic_io["out:" + cl.nic_of(a * tp)] += x
            nic_io["in:" + cl.nic_of(b * tp)] += x
    return intra, nic_io


def _remap_times(ctx: PlanContext, layout, att_sets, seq_units, links: list) -> np.ndarray:
    """Per unit, per layer: the remap all-to-alls it takes part in, priced as the remap decision
    prices them (:func:`zeppelin.planner.zeppelin.remap.plan_remap`, over :func:`remap_link_loads`):
    its tokens inside its node over the intra-node link, and, when it sends or receives across
    nodes, the busiest direction of the NICs its moves cross (its own and its partners'). Adds each
    receiver's senders to ``links`` (they meet every layer)."""
    moves: list[tuple[int, int, int]] = []
    for u in range(ctx.num_units):
        for seg in layout[u]:
            if _overlap_out(seg, att_sets[u]) <= 0:
                continue
            q, s, e = seg
            srcs = seq_units.get(q, ())
            links.append([u, *srcs])
            for v in srcs:
                x = sum(max(0, min(e, b) - max(s, a)) for a, b in att_sets[v].get(q, ())) if v != u else 0
                if x > 0:
                    moves.append((v, u, x))
    intra, nic_io = remap_link_loads(ctx, moves)
    cost, upn, cl, tp = ctx.cost, ctx.units_per_node, ctx.cluster, ctx.tp
    t = np.asarray(cost.remap_time(intra, "intra"), dtype=np.float64)
    # a move across nodes crosses its sender's NIC and its receiver's (out, then in on the way
    # back): it ends when the busier of the two has carried its load, and both units wait for it
    nics: dict[int, set[str]] = defaultdict(set)
    for a, b, _ in moves:
        if a // upn != b // upn:
            pair = {cl.nic_of(a * tp), cl.nic_of(b * tp)}
            nics[a] |= pair
            nics[b] |= pair
    for u in sorted(nics):
        load = max(max(nic_io.get("out:" + nic, 0), nic_io.get("in:" + nic, 0)) for nic in nics[u])
        t[u] = max(t[u], float(cost.remap_time(load, "inter")))
    return t


def _overlap_out(seg: list[int], have: dict[int, list[tuple[int, int]]]) -> int:
    """Tokens of ``seg`` not already held (i.e. that must arrive by remap)."""
    q, s, e = seg
    inside = sum(max(0, min(e, b) - max(s, a)) for a, b in have.get(q, ()))
    return (e - s) - inside


def _replica_ring_sharers(ctx: PlanContext, reps, mb: MicroBatch, has: set[int]) -> dict[int, int]:
    """Per inter-node ring group over replica units: the most transfers sharing one NIC in a round.
    Every TP rank of a unit sends its K/V shard to the same TP rank of the ring successor over its
    own NIC (as the simulator and the runtime move them), so a NIC carries one flow per GPU on it."""
    cl = ctx.cluster
    tx: dict[str, int] = defaultdict(int)
    rx: dict[str, int] = defaultdict(int)
    hops: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for gi, g in enumerate(mb.groups):
        if g.kind != "ring" or g.tier != "inter" or gi not in has:
            continue
        G = len(g.units)
        for i in range(G):
            ra, rb = reps[g.units[i]].ranks, reps[g.units[(i + 1) % G]].ranks
            for k, ga in enumerate(ra):
                gb = rb[k % len(rb)]
                if cl.node_of(ga) == cl.node_of(gb):
                    continue
                na, nb = cl.nic_of(ga), cl.nic_of(gb)
                tx[na] += 1
                rx[nb] += 1
                hops[gi].append((na, nb))
    return {gi: max(max(tx[a], rx[b]) for a, b in hs) for gi, hs in hops.items()}


class _ReplicaTotals:
    """Per unit, what a replica step's micro-batches add up (:func:`predict_replicas`)."""

    def __init__(self, n: int):
        self.attn, self.lin, self.tokens = np.zeros(n), np.zeros(n), np.zeros(n, dtype=np.int64)
        self.mem_tok = np.zeros(n)
        self.tpc = np.zeros(n)
        self.ring_comm, self.ring_exp = np.zeros(n), np.zeros(n)
        self.period = np.zeros(n)


def _replica_groups(ctx: PlanContext, step: StepPlan, mb: MicroBatch, cms: dict, tot: _ReplicaTotals,
                    held: np.ndarray, a_mb: np.ndarray, e_mb: np.ndarray) -> list:
    """Adds the attention of a micro-batch's groups over replica units (whole sequences on one
    replica, zigzag rings over replicas of one TP degree); returns the rings' unit sets."""
    reps = step.replicas
    layers = ctx.model.num_layers
    attn = tot.attn
    by_group: dict[int, list] = defaultdict(list)
    for p in mb.placements:
        by_group[p.group].append(p)
    sharers = _replica_ring_sharers(ctx, reps, mb, set(by_group))
    links = []
    for gi, pls in by_group.items():
        g = mb.groups[gi]
        Ls = np.array([float(p.padded_length or step.sequences[p.seq].length) for p in pls])
        if g.kind == "local" and len(g.units) == 1:
            u = g.units[0]
            for x in Ls:
                a_mb[u] += layers * float(cms[reps[u].tp].attn_time(x))
                attn[u] += layers * float(cms[reps[u].tp].attn_time(x))
                held[u] += x
            continue
        tps = {reps[u].tp for u in g.units}
        if g.kind != "ring" or len(tps) != 1:
            raise PlanningError("hydraulis: internal error: replica plans hold whole sequences or zigzag "
                                "rings over replicas of one TP degree only")
        cm, G = cms[tps.pop()], len(g.units)
        t0, tr = cm.ring_round_compute(Ls, G)
        g_t0, g_tr = float(np.sum(t0)), float(np.sum(tr))
        comm = float(cm.p2p_time(cm.ring_round_bytes(float(Ls.sum()) / G), cm.tier_link(g.tier),
                                 sharers.get(gi, 1)))
        exp = float(cm.ring_round_exposure(comm, g_t0, g_tr, G))
        for pos, u in enumerate(g.units):
            a_mb[u] += layers * (g_t0 + (G - 1) * g_tr)
            attn[u] += layers * (g_t0 + (G - 1) * g_tr)
            e_mb[u] += layers * exp
            tot.ring_comm[u] += layers * comm * (G - 1)
            held[u] += sum(e - s for p in pls for s, e in p.ranges[pos])
        links.append(g.units)
    return links


def _replica_microbatch(ctx: PlanContext, step: StepPlan, mb: MicroBatch, cms: dict, tot: _ReplicaTotals) -> None:
    """Adds one micro-batch of a replica step to ``tot``."""
    reps = step.replicas
    n = len(reps)
    layers = ctx.model.num_layers
    held = np.zeros(n)
    a_mb, e_mb = np.zeros(n), np.zeros(n)
    links = _replica_groups(ctx, step, mb, cms, tot, held, a_mb, e_mb)
    lin_mb, head_mb, tp_mb = np.zeros(n), np.zeros(n), np.zeros(n)
    for u in range(n):
        cm = cms[reps[u].tp]
        head_mb[u] = float(cm.head_time(held[u]))
        lin_mb[u] = float(layers * cm.linear_time(held[u]) + cm.head_time(held[u]))
        if cm.global_recompute != "none":  # the forward its recomputation runs again
            lin_mb[u] += float(cm.recompute_extra_time(None, a_mb[u], lin_mb[u] - head_mb[u]))
        tp_mb[u] = float(cm.model.num_layers * cm.tp_exposed_comm(held[u])) if cm.tp > 1 else 0.0
    tot.ring_exp += e_mb
    tot.lin += lin_mb
    tot.tpc += tp_mb
    # ring members meet every layer: each waits for the slowest of its ring(s)
    labels = microbatch_components(ctx, n, links)
    tot.period += component_max(labels, a_mb + e_mb + lin_mb - head_mb + tp_mb) + head_mb
    tot.tokens += held.astype(np.int64)
    tot.mem_tok = np.maximum(tot.mem_tok, held)


def predict_replicas(ctx: PlanContext, step: StepPlan) -> Prediction:
    """Analytic prediction of a step whose units are replicas of different TP degrees: whole
    sequences on one replica, or zigzag rings over replicas of one degree (Hydraulis' CP replicas),
    priced as :func:`microbatch_terms` prices rings (per-round block compute, transfers hidden
    behind the round they overlap); ring members wait for each other every layer."""
    reps = step.replicas
    cms = {t: ctx.cost_for(t) for t in sorted({r.tp for r in reps})}
    n = len(reps)
    tot = _ReplicaTotals(n)
    for mb in step.microbatches:
        _replica_microbatch(ctx, step, mb, cms, tot)
    attn, lin, tokens, mem_tok, period = tot.attn, tot.lin, tot.tokens, tot.mem_tok, tot.period
    m = len(step.microbatches)
    hide = [float(period.max()) / m] * m if n and m else None  # (an even share of the layers' time)
    ar = np.array([cms[r.tp].step_collectives_time(m, n, hide) for r in reps])
    # units wait for each other where rings couple them, or every unit under FSDP
    rings = ctx.microbatches_coupled or any(g.kind == "ring" for mb in step.microbatches for g in mb.groups)
    comm = ar + tot.tpc + tot.ring_comm
    exposed = ar + tot.tpc + tot.ring_exp
    total = attn + lin + exposed
    lengths = np.array([s.length for s in step.sequences], dtype=np.float64)
    # bounds for the best TP degree used (a larger degree shortens the longest sequence), in the
    # fewest micro-batches any of the degrees forces (replicas of mixed degrees hold between them)
    ctxs = [PlanContext(ctx.cluster, ctx.model, ctx.profile, tp=d, zero_stage=ctx.zero_stage,
                        recompute=ctx.recompute) for d in sorted(cms)]
    fewest = min(forced_microbatches(c, lengths) for c in ctxs)
    work_b, long_b = min((lower_bounds(c, lengths, fewest) for c in ctxs), key=lambda wb: max(wb))
    return Prediction(
        step_time_s=float(max((period + ar).max(), total.max()) if rings else total.max()),
        lower_bound_s=max(work_b, long_b),
        work_bound_s=work_b,
        longest_bound_s=long_b,
        per_unit=RankLoads(
            attention_s=[float(x) for x in attn], linear_s=[float(x) for x in lin], comm_s=[float(x) for x in comm],
            exposed_comm_s=[float(x) for x in exposed], total_s=[float(x) for x in total],
            tokens=[int(x) for x in tokens],
            memory_gb=[float(cms[reps[u].tp].memory_bytes(mem_tok[u])) / 1e9 for u in range(n)],
        ),
    )
