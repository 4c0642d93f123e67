"""NIC routing: topology graph, water-filling router, route validation."""

from collections import Counter

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.zeppelin.routing import build_topology, nic_load_table, plan_routes, route_problems
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.common import InputError
from zeppelin.schemas.layout import zigzag_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Group, MicroBatch, Placement, Route, RoutePath
from zeppelin.schemas.profile import default_profile


def ctx_for(cluster="zeppelin-a", model="llama-7b", tp=1) -> PlanContext:
    c = cluster_preset(cluster)
    return PlanContext(c, model_preset(model), default_profile(c.name), tp=tp)


def ring_mb(ctx: PlanContext, rings: list[list[int]], lengths: list[int]) -> MicroBatch:
    """Inter-node rings (one sequence each, zigzag) plus a local group for every other unit."""
    n = ctx.num_units
    groups = [Group(kind="ring", tier="inter", units=r) for r in rings]
    pls = [Placement(seq=i, group=i, scheme="zigzag", ranges=zigzag_ranges(L, len(r)))
           for i, (r, L) in enumerate(zip(rings, lengths))]
    queues = [[] for _ in range(n)]
    for gi, r in enumerate(rings):
        for u in r:
            queues[u].append(gi)
    for u in range(n):
        if not queues[u]:
            groups.append(Group(kind="local", tier="local", units=[u]))
            queues[u].append(len(groups) - 1)
    return MicroBatch(groups=groups, placements=pls, queues=queues)


# ------------------------------------------------------------------------------ topology


def test_topology_cluster_a_shape():
    c = cluster_preset("zeppelin-a")  # 2 nodes x 8 A800, 4 NICs per node, 2 GPUs per NIC
    g = build_topology(c)
    kinds = Counter(d["kind"] for _, d in g.nodes(data=True))
    assert kinds == {"gpu": 16, "nvswitch": 2, "host": 2, "pcie": 8, "nic": 8, "fabric": 1}
    # per node: 8 gpu-hub, 8 gpu-pcie, 4 nic-pcie, 4 nic-fabric, 4 pcie-host
    assert g.number_of_edges() == 2 * 28
    assert g.nodes["gpu:9"]["nic"] == "node1/nic0" and g.nodes["gpu:9"]["node"] == 1
    assert g.has_edge("gpu:0", "pcie:0:0") and g.has_edge("gpu:1", "pcie:0:0")
    assert g.has_edge("pcie:0:0", "nic:node0/nic0") and not g.has_edge("pcie:0:0", "nic:node0/nic1")
    assert g.edges["nic:node0/nic3", "fabric"]["bandwidth_GBps"] == 25.0
    assert g.edges["gpu:3", "nvswitch:0"] == {"kind": "nvlink", "bandwidth_GBps": 200.0}
    # GPUs of one node talk over NVLink; across nodes through their NICs and the fabric
    assert nx.shortest_path(g, "gpu:0", "gpu:5") == ["gpu:0", "nvswitch:0", "gpu:5"]
    assert nx.shortest_path(g, "gpu:2", "gpu:10") == [
        "gpu:2", "pcie:0:1", "nic:node0/nic1", "fabric", "nic:node1/nic1", "pcie:1:1", "gpu:10"]


def test_topology_cluster_c_one_nic_per_gpu_and_units():
    c = cluster_preset("zeppelin-c")  # 8 x 400 Gb/s NICs, NVSwitch
    g = build_topology(c, tp=2)
    kinds = Counter(d["kind"] for _, d in g.nodes(data=True))
    assert kinds["nic"] == 16 and kinds["gpu"] == 16 and kinds["pcie"] == 16
    for r in range(16):
        nic = f"nic:node{r // 8}/nic{r % 8}"
        assert g.nodes[f"gpu:{r}"]["unit"] == r // 2
        assert nx.shortest_path_length(g, f"gpu:{r}", nic) == 2
    assert g.edges["gpu:0", "nvswitch:0"] == {"kind": "nvswitch", "bandwidth_GBps": 450.0}
    assert g.edges["nic:node1/nic7", "fabric"]["bandwidth_GBps"] == 50.0
    with pytest.raises(InputError, match="tp=3 must divide gpus_per_node=8"):
        build_topology(c, tp=3)


# ------------------------------------------------------------------------------ routing


def max_load(t: dict[str, float]) -> float:
    return max(t.values())


def test_two_ring_units_on_one_nic_spread_over_idle_nics():
    ctx = ctx_for()
    # ring 0 -> 8 -> 1 -> 9 -> 0: every hop crosses nodes; units 0,1 share node0/nic0 and 8,9 node1/nic0
    mb = ring_mb(ctx, [[0, 8, 1, 9]], [65536])
    direct = plan_routes(ctx, mb, enable=False)
    routed = plan_routes(ctx, mb)
    assert [(r.src, r.dst, r.tokens) for r in routed] == [(0, 8, 16384), (8, 1, 16384), (1, 9, 16384), (9, 0, 16384)]
    assert all(len(r.paths) == 1 and (r.paths[0].via_src, r.paths[0].via_dst) == (r.src, r.dst) for r in direct)
    # K,V bytes of llama-7b: 2 x 4096 x 2 bytes per token per layer
    assert [r.bytes for r in routed] == [16384 * 16384] * 4
    un = nic_load_table(ctx, mb.model_copy(update={"routes": direct}), routed=False)
    ro = nic_load_table(ctx, mb.model_copy(update={"routes": routed}), routed=True)
    # hand-computed: nic0 of each node sends 2 and receives 2 blocks per round, 3 rounds, fwd+bwd x3, 32 layers
    assert un == {"node0/nic0": 4 * 3 * 16384 * 16384 * 3 * 32, "node1/nic0": 4 * 3 * 16384 * 16384 * 3 * 32}
    # the two transfers per node and direction spread evenly over the 4 NICs: 4x lower peak
    assert max_load(ro) == max_load(un) / 4
    assert sorted(ro) == [f"node{k}/nic{i}" for k in range(2) for i in range(4)]
    assert len(set(ro.values())) == 1
    for r in routed:
        assert sum(p.tokens for p in r.paths) == r.tokens
        for p in r.paths:  # proxies are idle units, never other ring members
            assert p.via_src == r.src or p.via_src not in (0, 1, 8, 9)
            assert p.via_dst == r.dst or p.via_dst not in (0, 1, 8, 9)
    assert route_problems(ctx, mb.model_copy(update={"routes": routed})) == []
    assert route_problems(ctx, mb.model_copy(update={"routes": direct})) == []
    # nic_load_table routes the micro-batch itself when it has no routes yet
    assert nic_load_table(ctx, mb, routed=True) == ro
    assert nic_load_table(ctx, mb, routed=False) == un


def test_no_split_when_the_nvlink_hops_cost_more_than_they_save():
    ctx = ctx_for()
    # one token per round: the NVLink latency of dispatch/combine exceeds the NIC time saved
    tiny = plan_routes(ctx, ring_mb(ctx, [[0, 8]], [2]))
    assert [len(r.paths) for r in tiny] == [1, 1]
    big = plan_routes(ctx, ring_mb(ctx, [[0, 8]], [8192]))
    assert [len(r.paths) for r in big] == [4, 4]
    # the pay-off rule on the numbers: 1 token on the NIC vs 3/4 of it saved per round
    cost = ctx.cost
    nic_saved = 0.75 * cost.ring_round_bytes(1) / (cost.inter_link.bandwidth_GBps * 1e9)
    assert nic_saved < cost.p2p_time(cost.ring_round_bytes(1), "intra")


def test_balanced_nics_are_left_alone():
    ctx = ctx_for("zeppelin-c")  # one NIC per GPU
    # every node-crossing hop of the ring uses a different NIC: nothing to gain
    mb = ring_mb(ctx, [[0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]], [262144])
    routed = plan_routes(ctx, mb)
    assert all(len(r.paths) == 1 and r.paths[0].via_src == r.src for r in routed)
    assert len(routed) == 16


def test_intra_node_hops_of_inter_groups_are_not_routed():
    ctx = ctx_for()
    mb = ring_mb(ctx, [[0, 1, 8, 9]], [4096])
    assert [(r.src, r.dst) for r in plan_routes(ctx, mb)] == [(1, 8), (9, 0)]
    # intra-node and local groups give no routes
    mb2 = MicroBatch(groups=[Group(kind="ring", tier="intra", units=[0, 1])],
                     placements=[Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(100, 2))],
                     queues=[[0], [0]] + [[] for _ in range(14)])
    assert plan_routes(ctx, mb2) == [] and nic_load_table(ctx, mb2, routed=True) == {}


def test_tensor_parallel_units_use_their_first_gpus_nic():
    ctx = ctx_for("zeppelin-c", tp=2)  # 8 units; unit u's NIC is that of GPU 2u
    mb = ring_mb(ctx, [[0, 4, 1, 5]], [65536])
    routed = plan_routes(ctx, mb)
    nics = {p.nic_src for r in routed for p in r.paths} | {p.nic_dst for r in routed for p in r.paths}
    assert nics <= {f"node{k}/nic{i}" for k in range(2) for i in (0, 2, 4, 6)}
    assert len(nics) == 8  # every usable NIC carries a share
    assert route_problems(ctx, mb.model_copy(update={"routes": routed})) == []
    # with tp=2 each unit sends its K/V heads share: bytes halve
    assert routed[0].bytes == 16384 * 16384 // 2


# ------------------------------------------------------------------------------ validation


def _bad(ctx, mb, routes):
    return route_problems(ctx, mb.model_copy(update={"routes": routes}))


def test_route_problems_reports_bad_routes():
    ctx = ctx_for()
    mb = ring_mb(ctx, [[0, 8, 1, 9]], [65536])
    good = plan_routes(ctx, mb, enable=False)
    T = 16384

    def route(src, dst, paths, tokens=T):
        return Route.model_construct(group=0, src=src, dst=dst, tokens=tokens, bytes=tokens * 16384,
                                     paths=[RoutePath.model_construct(via_src=a, via_dst=b, nic_src=ns, nic_dst=nd,
                                                                      tokens=x) for a, b, ns, nd, x in paths])

    ghost = route(0, 8, [(0, 8, "node0/nic9", "node1/nic0", T)])
    assert _bad(ctx, mb, [ghost] + good[1:]) == ["route 0->8 of group 0: NIC 'node0/nic9' does not exist"]
    wrong_node = route(0, 8, [(9, 8, "node1/nic0", "node1/nic0", T)])
    assert _bad(ctx, mb, [wrong_node] + good[1:]) == [
        "route 0->8 of group 0: source proxy 9 is on node 1, not on node 0"]
    not_own = route(0, 8, [(2, 8, "node0/nic0", "node1/nic0", T)])
    assert _bad(ctx, mb, [not_own] + good[1:]) == [
        "route 0->8 of group 0: source proxy 2 uses NIC node0/nic1, not node0/nic0"]
    foreign_nic = route(0, 8, [(0, 8, "node1/nic0", "node1/nic0", T)])
    assert _bad(ctx, mb, [foreign_nic] + good[1:]) == [
        "route 0->8 of group 0: NIC node1/nic0 is not on node 0 of source proxy 0"]
    non_neighbour = route(0, 9, [(0, 9, "node0/nic0", "node1/nic0", T)])
    assert _bad(ctx, mb, [non_neighbour] + good[1:]) == [
        "route 0->9 of group 0: 9 is not the ring successor of 0",
        "group 0: inter-node transfer 0->8 has no route"]
    short = route(0, 8, [(0, 8, "node0/nic0", "node1/nic0", T - 1)])
    assert _bad(ctx, mb, [short] + good[1:]) == ["route 0->8 of group 0: path tokens add up to 16383, not 16384"]
    wrong_tokens = route(0, 8, [(0, 8, "node0/nic0", "node1/nic0", 5)], tokens=5)
    assert _bad(ctx, mb, [wrong_tokens] + good[1:]) == [
        "route 0->8 of group 0: carries 5 tokens but unit 0 holds 16384 in the group"]
    assert _bad(ctx, mb, good + [good[0]]) == ["route 0->8 of group 0: routed twice"]
    bad_unit = route(0, 8, [(0, 99, "node0/nic0", "node1/nic0", T)])
    assert _bad(ctx, mb, [bad_unit] + good[1:]) == ["route 0->8 of group 0: destination proxy 99 is not a unit (have 16)"]


def test_route_problems_wrong_group_kind():
    ctx = ctx_for()
    mb = ring_mb(ctx, [[0, 8, 1, 9]], [65536])
    local_g = next(i for i, g in enumerate(mb.groups) if g.kind == "local")
    r = plan_routes(ctx, mb, enable=False)
    bad = r[0].model_copy(update={"group": local_g})
    assert _bad(ctx, mb, [bad] + r[1:]) == [
        f"route 0->8 of group {local_g}: group is a local local group, not an inter-node ring",
        "group 0: inter-node transfer 0->8 has no route"]


# ------------------------------------------------------------------------------ properties


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_rings_route_validly_and_never_worse(data):
    ctx = ctx_for("zeppelin-a:4")  # 32 units, 4 nodes
    units = data.draw(st.permutations(list(range(32))))
    sizes = data.draw(st.lists(st.integers(2, 8), min_size=1, max_size=4))
    rings, pos = [], 0
    for s in sizes:
        if pos + s > 32:
            break
        rings.append(list(units[pos:pos + s]))
        pos += s
    rings = [r for r in rings if len({u // 8 for u in r}) > 1] or [[0, 8]]
    lengths = data.draw(st.lists(st.integers(1, 200_000), min_size=len(rings), max_size=len(rings)))
    mb = ring_mb(ctx, rings, lengths)
    direct = plan_routes(ctx, mb, enable=False)
    routed = plan_routes(ctx, mb)
    assert [(r.group, r.src, r.dst, r.tokens) for r in routed] == [(r.group, r.src, r.dst, r.tokens) for r in direct]
    assert route_problems(ctx, mb.model_copy(update={"routes": routed})) == []
    for r in routed:
        assert sum(p.tokens for p in r.paths) == r.tokens and all(p.tokens > 0 for p in r.paths)
    un = nic_load_table(ctx, mb.model_copy(update={"routes": direct}), routed=False)
    ro = nic_load_table(ctx, mb.model_copy(update={"routes": routed}), routed=True)
    assert sum(ro.values()) == pytest.approx(sum(un.values()))  # bytes conserved
    assert max(ro.values(), default=0) <= max(un.values(), default=0) * (1 + 1e-9)
