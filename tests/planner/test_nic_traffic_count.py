"""Counting a plan's NIC traffic without running its simulation (``Simulator.nic_traffic``, what
``zeppelin plan``'s summary prints) gives the bytes per NIC and kind that the simulation moves:
groups inside one node and the all-to-alls of usp rows inside a node are skipped there (they cross
no NIC), every node-crossing ring, usp column, all-gather and remap flow is counted, routed or
direct (the cases run usp groups, TP-1 and TP-2)."""

from __future__ import annotations

import pytest

from tests.support.zeppelin_steps import grid_step
from zeppelin.planner.core.base import get_planner
from zeppelin.planner.sim.simulate import Simulator

CASES = [
    # (cluster, model, tp, mix, gpus, step), planner
    (("zeppelin-c", "llama-7b", 1, "long", 64, 0), "zeppelin"),
    (("zeppelin-a", "llama-13b", 2, "mixed", 64, 1), "zeppelin"),
    (("zeppelin-a", "llama-7b", 1, "mixed", 32, 0), "te-cp"),
    (("zeppelin-c", "llama-7b", 1, "mixed", 64, 2), "zeppelin-no-routing"),
    # a remap across nodes beside inter- and intra-node rings
    (("zeppelin-a", "llama-7b", 1, "short", 32, 2), "zeppelin"),
]


@pytest.mark.parametrize("cell, planner", CASES)
def test_counted_traffic_is_the_simulated_traffic(cell, planner):
    ctx, seqs = grid_step(*cell)
    plan = get_planner(planner).plan_step(ctx, cell[-1], seqs)
    sim = Simulator(ctx)
    counted = sim.nic_traffic(plan)
    simulated = sim.simulate_step(plan).nic_traffic
    assert counted.keys() == simulated.keys()
    assert sum(sum(v.values()) for v in counted.values()) > 0  # (the case crosses nodes)
    for kind, by_nic in simulated.items():
        assert counted[kind].keys() == by_nic.keys()
        for nic, b in by_nic.items():
            assert counted[kind][nic] == pytest.approx(b, rel=1e-9)
