"""NIC routing of inter-node ring transfers (Zeppelin's routing layer).

Static GPU->NIC affinity makes the ring members of inter-node groups saturate their own NICs while
the NICs of GPUs busy with local work stay idle. A routed cross-node send is *dispatch* (scatter the
K/V block over NVLink to proxy units on the source node) -> *parallel transfer* over the proxies'
NICs -> *combine* (gather on the destination node through proxy units there).

The topology (:func:`build_topology`) is a networkx graph: ``gpu:<rank>`` - ``nvswitch:<node>``
(the intra-node fabric, NVSwitch or an NVLink mesh modelled as a hub), ``gpu:<rank>`` -
``pcie:<node>:<k>`` - ``nic:node<k>/<id>`` - ``fabric`` (the non-blocking inter-node network), and
``pcie:<node>:<k>`` - ``host:<node>`` (the CPU root complex, used only when a GPU's NIC hangs off
another PCIe switch).

Routing algorithm (:func:`plan_routes`)
---------------------------------------
NICs are full duplex, so the send direction of a node's NICs carries only that node's outgoing
transfers and the receive direction only its incoming ones. The problem therefore splits into one
independent sub-problem per (node, direction): spread the bytes homed on the node's NICs (the NIC
of each transfer's source / destination unit) over every NIC of the node that a unit uses,
minimising the most loaded NIC. A NIC's load is its busy time over the step:
``sum_t tokens_t * (G_t - 1)`` (ring rounds) scaled by the per-token K/V bytes and divided by the
NIC's bandwidth. Any transfer can use any NIC of its node (all GPUs of a node see each other over
NVLink), so the minimum of the max load is exactly the water level
``T* = total load / total bandwidth``; it is reached by moving the excess ``L_n - T* bw_n`` of each
over-full NIC to under-full ones, and no assignment reaching ``T*`` moves fewer bytes (every NIC
above the level must shed at least its excess). That is *exact water-filling*; it needs no LP and
runs in O(transfers + NICs) per node.

The excess of a NIC is taken from its transfers in proportion to their size, so each transfer's
dispatch/combine hop (an NVLink copy) is as short as possible. The hop costs time
(``ctx.cost.p2p_time(..., 'intra')`` per ring round); a node-direction is routed only when
``T* + longest hop < T_direct`` (with ``bw_nvlink > bw_nic``, the completion time ``T + hop(T)``
grows with ``T``, so if routing pays at all, it pays most at the water level). The send and
receive splits of one transfer are then paired into paths: the unrouted part goes directly
(``via_src == src``, ``via_dst == dst``), the rest through proxies. A proxy on NIC ``m`` is the unit
using ``m`` that is least busy with communication: units that are not ring members of inter-node
groups first, then units outside any multi-unit group, ties rotated so that several proxied
pieces do not pile onto one GPU.

usp groups: each column ring's node-crossing hops are transfers too, weighted by their share of
the K/V (one position's heads: :meth:`CostModel.ring_hop_share`). The runtime relays a usp
transfer only inside its column ring, so such a transfer may use only the NICs of its ring's units
on the node (:func:`_spread_columns`: on top of the other transfers' loads, largest first, each
raised to the lowest level its NICs reach; kept when the NVLink hop costs less than the busiest
NIC gains).

With tensor parallelism a unit is ``tp`` GPUs; its NIC is the NIC of its first GPU
(``ctx.cluster.nic_of(u * tp)``), as in :func:`zeppelin.planner.costmodel.predict.nic_loads`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.core.builder import direct_routes, record
from zeppelin.schemas.cluster import ClusterSpec
from zeppelin.schemas.invariants import group_rings, inter_ring_transfers
from zeppelin.schemas.invariants import route_problems as invariant_route_problems
from zeppelin.schemas.plan import MicroBatch, Route, RoutePath

if TYPE_CHECKING:  # pragma: no cover
    import networkx as nx

__all__ = ["build_topology", "inter_transfers", "nic_load_table", "plan_routes", "route_problems", "unit_nic"]


# ---------------------------------------------------------------------------------------------
# Topology
# ---------------------------------------------------------------------------------------------


def _nic_switch(cluster: ClusterSpec) -> dict[str, int]:
    return {n.id: (n.pcie_switch if n.pcie_switch is not None else i) for i, n in enumerate(cluster.nics)}


def build_topology(cluster: ClusterSpec, tp: int = 1) -> nx.Graph:
    """The cluster as an undirected networkx graph (every node alike).

    Nodes carry ``kind`` (gpu, nvswitch, pcie, host, nic, fabric) and ``node``; GPU nodes also
    ``rank``, ``unit`` (``rank // tp``) and ``nic`` (the global NIC name of their affinity).
    Edges carry ``kind`` and ``bandwidth_GBps`` (per direction). PCIe edges are given the bandwidth
    of the NIC they lead to: the cluster spec does not describe PCIe separately, and on the
    GPU->NIC path of GPUDirect RDMA the NIC is the bottleneck.
    """
    import networkx as nx

    if tp < 1 or cluster.gpus_per_node % tp:
        from zeppelin.schemas.common import InputError

        raise InputError(f"tp={tp} must divide gpus_per_node={cluster.gpus_per_node}")
    g = nx.Graph(name=cluster.name, tp=tp)
    g.add_node("fabric", kind="fabric", node=None)
    nic_sw = _nic_switch(cluster)
    nic_bw = {n.id: n.bandwidth_GBps for n in cluster.nics}
    gpn = cluster.gpus_per_node
    if cluster.gpu_pcie_switch is not None:
        gpu_sw = list(cluster.gpu_pcie_switch)
    else:
        gpu_sw = [nic_sw[cluster.gpu_nic[i]] for i in range(gpn)]
    switches = sorted(set(gpu_sw) | set(nic_sw.values()))
    link = cluster.intra_link
    for k in range(cluster.num_nodes):
        hub = f"nvswitch:{k}"
        host = f"host:{k}"
        g.add_node(hub, kind="nvswitch", node=k)
        g.add_node(host, kind="host", node=k)
        sw_bw: dict[int, float] = defaultdict(float)
        for n in cluster.nics:
            sw_bw[nic_sw[n.id]] = max(sw_bw[nic_sw[n.id]], n.bandwidth_GBps)
        for s in switches:
            g.add_node(f"pcie:{k}:{s}", kind="pcie", node=k)
            g.add_edge(f"pcie:{k}:{s}", host, kind="pcie",
                       bandwidth_GBps=sw_bw.get(s) or max(nic_bw.values()))
        for n in cluster.nics:
            name = f"nic:node{k}/{n.id}"
            g.add_node(name, kind="nic", node=k, bandwidth_GBps=n.bandwidth_GBps)
            g.add_edge(name, f"pcie:{k}:{nic_sw[n.id]}", kind="pcie", bandwidth_GBps=n.bandwidth_GBps)
            g.add_edge(name, "fabric", kind="network", bandwidth_GBps=n.bandwidth_GBps)
        for i in range(gpn):
            r = k * gpn + i
            gn = f"gpu:{r}"
            g.add_node(gn, kind="gpu", node=k, rank=r, unit=r // tp, nic=cluster.nic_of(r))
            g.add_edge(gn, hub, kind=link.kind, bandwidth_GBps=link.bandwidth_GBps)
            g.add_edge(gn, f"pcie:{k}:{gpu_sw[i]}", kind="pcie", bandwidth_GBps=nic_bw[cluster.gpu_nic[i]])
    return g


# ---------------------------------------------------------------------------------------------
# Transfers
# ---------------------------------------------------------------------------------------------


def unit_nic(ctx: PlanContext, unit: int) -> str:
    """Global NIC name (``node<k>/<id>``) a unit uses: that of its first GPU rank."""
    return ctx.cluster.nic_of(unit * ctx.tp)


class _NicOf(dict):
    """Memoised :func:`unit_nic` for one call."""

    def __init__(self, ctx: PlanContext):
        super().__init__()
        self.ctx = ctx

    def __missing__(self, unit: int) -> str:
        v = self[unit] = unit_nic(self.ctx, unit)
        return v


@dataclass
class _Transfer:
    group: int
    src: int
    dst: int
    tokens: int
    rounds: int  # G - 1 ring rounds (load weight)
    share: float = 1.0  # of a token's K/V per ring round (a usp column ring's heads: CostModel.ring_hop_share)
    ring: list[int] | None = None  # a usp column ring: only its units relay the transfer (None: any unit)
    send: dict[int, int] = field(default_factory=dict)  # proxy unit -> tokens (src side)
    recv: dict[int, int] = field(default_factory=dict)  # proxy unit -> tokens (dst side)

    @property
    def weight(self) -> float:
        """NIC load of the transfer per token: its rounds times its share of the K/V."""
        return self.rounds * self.share


def inter_transfers(ctx: PlanContext, mb: MicroBatch) -> list[tuple[int, int, int, int]]:
    """``(group, src, dst, tokens)`` of every node-crossing ring neighbour pair of inter groups."""
    return [(t.group, t.src, t.dst, t.tokens) for t in _transfers(ctx, mb)]


def _transfers(ctx: PlanContext, mb: MicroBatch) -> list[_Transfer]:
    """The node-crossing ring transfers of the inter-node ring groups and of the usp groups' column
    rings (the plan invariant's list, :func:`zeppelin.schemas.invariants.inter_ring_transfers`),
    each with its ring's rounds and share of the K/V (a usp transfer also with its column ring)."""
    per_node = ctx.units_per_node
    node_of_unit = [u // per_node for u in range(ctx.num_units)]
    out = []
    column_ring: dict[int, dict[int, list[int]]] = {}  # usp group -> unit -> its column ring (read only)
    for (gi, s, d), tokens in inter_ring_transfers(mb, node_of_unit).items():
        g = mb.groups[gi]
        rounds, share = ctx.cost.ring_hop_share(g)
        ring = None
        if g.kind == "usp":
            if gi not in column_ring:
                column_ring[gi] = {u: x for x in group_rings(g) for u in x}
            ring = column_ring[gi][s]
        out.append(_Transfer(gi, s, d, tokens, rounds, share, ring))
    return out


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


class _Node:
    """Per-node facts used by the router: the NICs units use and the proxy candidates on each
    (``bw``: each NIC's bandwidth by its id in the cluster spec)."""

    def __init__(self, ctx: PlanContext, k: int, bw: dict[str, float], nic_of: _NicOf):
        per_node = ctx.units_per_node
        self.units_on: dict[str, list[int]] = defaultdict(list)
        self.units = range(k * per_node, (k + 1) * per_node)
        for u in self.units:
            self.units_on[nic_of[u]].append(u)
        self.nics = sorted(self.units_on)
        self.bw = {n: bw[n.split("/", 1)[1]] for n in self.nics}
        self.cands: dict[str, list[int]] | None = None  # (sorted when a proxy is first asked for)
        self._rr: dict[str, int] = defaultdict(int)

    def proxy(self, nic: str, inter_members: set[int], busy: set[int]) -> int:
        if self.cands is None:  # proxy candidates, best first: not an inter ring member, then not in any
            # multi-unit group
            self.cands = {n: sorted(us, key=lambda u: (u in inter_members, u in busy, u))
                          for n, us in self.units_on.items()}
        cands = self.cands[nic]
        best = (cands[0] in inter_members, cands[0] in busy)
        tied = [u for u in cands if (u in inter_members, u in busy) == best]
        u = tied[self._rr[nic] % len(tied)]
        self._rr[nic] += 1
        return u


def _spread(ctx: PlanContext, node: _Node, items: list[tuple[_Transfer, int]], side: str,
            inter_members: set[int], busy: set[int], nic_of: _NicOf, consts: tuple[float, float, float]) -> None:
    """Water-fill one (node, direction): ``items`` are (transfer, home unit) pairs; ``consts``:
    :func:`_link_consts`."""
    if not items:  # (no load: nothing to move)
        return
    round_b = consts[0]  # bytes per token per ring round (fwd + bwd), one layer
    secs = _nic_secs(ctx, node, consts)
    load: dict[str, float] = {n: 0.0 for n in node.nics}
    on: dict[str, list[_Transfer]] = defaultdict(list)
    for t, home in items:
        n = nic_of[home]
        load[n] += t.tokens * t.weight
        on[n].append(t)
    tot_bw = sum(node.bw.values())
    level = sum(load.values()) / tot_bw  # tokens*rounds per GB/s
    t_dir = max(secs(load[n], n) for n in node.nics)
    t_lvl = max(secs(level * node.bw[n], n) for n in node.nics)
    if len(node.nics) < 2 or t_dir <= t_lvl * (1 + 1e-9):
        return
    # tokens each transfer moves off its home NIC (excess taken in proportion to size)
    moves: list[tuple[_Transfer, int]] = []
    for n in node.nics:
        excess = load[n] - level * node.bw[n]
        if excess <= 0:
            continue
        frac = excess / load[n]
        for t in on[n]:
            x = min(t.tokens, round(frac * t.tokens))
            if x > 0:
                moves.append((t, x))
    if not moves:
        return
    # NVLink dispatch (or combine) of the moved part, every ring round of every layer: alpha + bytes / bw
    nv = ctx.cost.intra_link
    hop = max((nv.alpha_s + x * t.share * round_b / (nv.bandwidth_GBps * 1e9)) * t.rounds * ctx.model.num_layers
              for t, x in moves)
    if t_lvl + hop >= t_dir:  # the NVLink dispatch/combine would eat the gain
        return
    deficit = {n: level * node.bw[n] - load[n] for n in node.nics if level * node.bw[n] - load[n] > 0}
    recv_order = sorted(deficit, key=lambda n: -deficit[n])
    moves.sort(key=lambda tx: -tx[0].tokens * tx[0].weight)
    j = 0
    for t, x in moves:
        parts = t.send if side == "send" else t.recv
        home = t.src if side == "send" else t.dst
        left = x
        while left > 0 and j < len(recv_order):
            n = recv_order[j]
            cap = deficit[n] / t.weight
            piece = min(left, max(1, round(cap)))
            deficit[n] -= piece * t.weight
            if deficit[n] <= 0.5 * t.weight:
                j += 1
            u = node.proxy(n, inter_members, busy)
            parts[u] = parts.get(u, 0) + piece
            left -= piece
        parts[home] = parts.get(home, 0) - (x - left)  # what did not fit stays at home


def _link_consts(ctx: PlanContext) -> tuple[float, float, float]:
    """``(bytes per token per ring round (fwd + bwd, one layer), the inter-node link's bandwidth,
    the first NIC's bandwidth)``: what :func:`_nic_secs` and the spreads price loads with."""
    return (float(ctx.cost.ring_round_bytes(1)), float(ctx.cost.inter_link.bandwidth_GBps),
            ctx.cluster.nics[0].bandwidth_GBps)


def _nic_secs(ctx: PlanContext, node: _Node, consts: tuple[float, float, float]):
    """``secs(load, nic)``: a NIC's busy time over the step for a load of tokens x rounds x share
    (``consts``: :func:`_link_consts`)."""
    kvb = consts[0] * ctx.model.num_layers
    ref_bw, nic0_bw = consts[1], consts[2]

    def secs(load_tokens: float, nic: str) -> float:
        return load_tokens * kvb / (ref_bw * node.bw[nic] / nic0_bw * 1e9)

    return secs


def _spread_columns(ctx: PlanContext, node: _Node, items: list[tuple[_Transfer, int]], side: str,
                    base: dict[str, float], nic_of: _NicOf, consts: tuple[float, float, float]) -> None:
    """Water-fill one (node, direction) for usp transfers, each only over the NICs of its column
    ring's units on the node (the runtime relays a usp transfer inside its column ring), on top of
    the loads ``base`` of the node's other transfers: largest first, each raised to the lowest
    common level its NICs reach; kept when the NVLink dispatch (or combine) costs less than the
    busiest NIC gains, else every transfer goes direct (``consts``: :func:`_link_consts`)."""
    # the NICs each transfer may use: its home unit's and those of its column ring's units here
    # (a transfer with no other moves nothing, and leaves the loads as they were)
    movable = []
    for t, home in items:
        mine = {nic_of[home]: home}
        for u in t.ring or []:
            if u in node.units and nic_of[u] not in mine:
                mine[nic_of[u]] = u
        if len(mine) >= 2:
            movable.append((t, home, mine))
    if not movable:
        return
    secs = _nic_secs(ctx, node, consts)
    load = {n: base.get(n, 0.0) for n in node.nics}
    for t, home in items:
        load[nic_of[home]] += t.tokens * t.weight
    t_dir = max(secs(load[n], n) for n in node.nics)
    nv, round_b = ctx.cost.intra_link, consts[0]
    hop, moved = 0.0, []
    for t, home, mine in sorted(movable, key=lambda x: (-x[0].tokens * x[0].weight, x[1])):
        w = t.tokens * t.weight
        load[nic_of[home]] -= w
        level = _water_level([load[n] for n in mine], [node.bw[n] for n in mine], w)
        parts = {u: int(max(0.0, level * node.bw[n] - load[n]) / t.weight) for n, u in mine.items() if u != home}
        parts = {u: x for u, x in parts.items() if x > 0}
        parts[home] = t.tokens - sum(parts.values())
        for u, x in parts.items():
            load[nic_of[u]] += x * t.weight
        if len(parts) > 1:
            moved.append((t, parts))
            hop = max(hop, (nv.alpha_s + (t.tokens - parts[home]) * t.share * round_b / (nv.bandwidth_GBps * 1e9))
                      * t.rounds * ctx.model.num_layers)
    if not moved or max(secs(load[n], n) for n in node.nics) + hop >= t_dir:
        return
    for t, parts in moved:
        (t.send if side == "send" else t.recv).update(parts)


def _water_level(loads: list[float], bws: list[float], w: float) -> float:
    """The level ``x`` (load per unit of bandwidth) with ``sum(max(0, x bw - load)) = w``."""
    order = sorted(range(len(loads)), key=lambda i: loads[i] / bws[i])
    fill, bw = w, 0.0
    for k, i in enumerate(order):
        fill += loads[i]
        bw += bws[i]
        level = fill / bw
        if k + 1 == len(order) or level <= loads[order[k + 1]] / bws[order[k + 1]]:
            return level
    return 0.0


def plan_routes(ctx: PlanContext, mb: MicroBatch, enable: bool = True) -> list[Route]:
    """One :class:`Route` per node-crossing neighbour pair of every inter-node ring group.

    ``enable=False`` gives the direct routes (one path over the pair's own NICs:
    :func:`zeppelin.planner.core.builder.direct_routes`). See the module docstring for the
    algorithm and why it is exact.
    """
    if not enable:
        return direct_routes(ctx, mb)
    cost = ctx.cost
    transfers = _transfers(ctx, mb)
    if not transfers:
        return []
    per_node = ctx.units_per_node
    nic_of = _NicOf(ctx)
    for t in transfers:
        t.send = {t.src: t.tokens}
        t.recv = {t.dst: t.tokens}
    inter_members = {u for g in mb.groups if g.tier == "inter" and g.kind in ("ring", "usp") for u in g.units}
    busy = {u for g in mb.groups if len(g.units) > 1 for u in g.units}
    sends: dict[int, list[tuple[_Transfer, int]]] = defaultdict(list)
    recvs: dict[int, list[tuple[_Transfer, int]]] = defaultdict(list)
    for t in transfers:
        sends[t.src // per_node].append((t, t.src))
        recvs[t.dst // per_node].append((t, t.dst))
    nodes: dict[int, _Node] = {}
    bw = {n.id: n.bandwidth_GBps for n in ctx.cluster.nics}
    consts = _link_consts(ctx)
    for side, table in (("send", sends), ("recv", recvs)):
        for k, items in table.items():
            if k not in nodes:
                nodes[k] = _Node(ctx, k, bw, nic_of)
            rings = [x for x in items if x[0].ring is None]
            _spread(ctx, nodes[k], rings, side, inter_members, busy, nic_of, consts)
            if len(rings) < len(items):  # usp transfers, over their column rings' NICs beside the rings' loads
                base: dict[str, float] = defaultdict(float)
                for t, _ in rings:
                    for u, x in (t.send if side == "send" else t.recv).items():
                        base[nic_of[u]] += x * t.weight
                _spread_columns(ctx, nodes[k], [x for x in items if x[0].ring is not None], side, base, nic_of,
                                consts)
    nbytes = cost.kv_bytes(np.array([t.tokens for t in transfers], dtype=np.float64)).tolist()
    routes = [_route(t, int(b * t.share), _pair(nic_of, t)) for t, b in zip(transfers, nbytes)]
    # whole-token splits of tiny transfers can load a NIC more than the direct paths: never worse
    from zeppelin.planner.costmodel.predict import route_nic_loads

    ro, un = route_nic_loads(ctx, mb.groups, routes)
    if max(ro.values(), default=0) > max(un.values(), default=0) * (1 + 1e-9):
        return direct_routes(ctx, mb)
    return routes


def _route(t: _Transfer, nbytes: int, paths: list[RoutePath]) -> Route:
    """``Route(group=.., src=.., dst=.., tokens=.., bytes=nbytes, paths=paths)`` of transfer ``t``,
    recorded without re-validating what the router derived itself (every field given: the fields
    are set as validation sets them); raises ``ValueError`` where the paths' tokens do not add up,
    as the record's own check does."""
    if sum(p.tokens for p in paths) != t.tokens:
        raise ValueError(f"route {t.src}->{t.dst}: path tokens do not add up to {t.tokens}")
    return record(Route, group=t.group, src=t.src, dst=t.dst, tokens=t.tokens, bytes=nbytes, paths=paths)


def _pair(nic_of: _NicOf, t: _Transfer) -> list[RoutePath]:
    """Pair the send-side and receive-side splits of a transfer into paths (direct part first)."""
    if len(t.send) == 1 and len(t.recv) == 1 and t.tokens > 0 and t.send.get(t.src) == t.tokens == t.recv.get(t.dst):
        return [_path(nic_of, t.src, t.dst, t.tokens)]  # (unrouted: the direct path alone)
    s = {u: x for u, x in t.send.items() if x > 0}
    r = {u: x for u, x in t.recv.items() if x > 0}
    paths: list[RoutePath] = []

    def add(a: int, b: int, x: int) -> None:
        paths.append(_path(nic_of, a, b, x))

    direct = min(s.get(t.src, 0), r.get(t.dst, 0))
    if direct:
        add(t.src, t.dst, direct)
        s[t.src] -= direct
        r[t.dst] -= direct
    sl = [[u, x] for u, x in s.items() if x > 0]
    rl = [[u, x] for u, x in r.items() if x > 0]
    i = j = 0
    while i < len(sl) and j < len(rl):
        x = min(sl[i][1], rl[j][1])
        add(sl[i][0], rl[j][0], x)
        sl[i][1] -= x
        rl[j][1] -= x
        i += sl[i][1] == 0
        j += rl[j][1] == 0
    return paths


def _path(nic_of: _NicOf, a: int, b: int, x: int) -> RoutePath:
    """``RoutePath(via_src=a, via_dst=b, nic_src=.., nic_dst=.., tokens=x)`` over the units' own NICs,
    recorded without re-validation (every field given, of its type)."""
    return record(RoutePath, via_src=a, via_dst=b, nic_src=nic_of[a], nic_dst=nic_of[b], tokens=x)


def nic_load_table(ctx: PlanContext, mb: MicroBatch, routed: bool) -> dict[str, float]:
    """Bytes per NIC (send + receive) over the step for the micro-batch's inter-node transfers.

    Uses ``mb.routes`` when set; otherwise routes the micro-batch first (``enable=routed``).
    """
    from zeppelin.planner.costmodel.predict import nic_loads

    if not mb.routes:
        routes = plan_routes(ctx, mb, enable=routed)
        if not routes:
            return {}
        mb = mb.model_copy(update={"routes": routes})
    return nic_loads(ctx, mb, routed=routed)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def route_problems(ctx: PlanContext, mb: MicroBatch) -> list[str]:
    """Problems with a micro-batch's routes (empty = valid): the plan invariant
    :func:`zeppelin.schemas.invariants.route_problems`, for units of ``ctx.tp`` GPUs."""
    return invariant_route_problems(ctx.cluster, [u * ctx.tp for u in range(ctx.num_units)], mb)
