"""The simulator charges tensor-parallel communication by overlap mode (none / slicing / commfuse)."""

import numpy as np
import pytest

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.sim.simulate import Simulator
from zeppelin.schemas.cluster import ClusterSpec, GPUSpec, LinkSpec, NICSpec
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Group, MicroBatch, Placement, Sequence, StepPlan
from zeppelin.schemas.profile import CostProfile, KernelEfficiency


def _ctx(mode: str, tp: int = 2) -> PlanContext:
    cl = ClusterSpec(name="r", num_nodes=1, gpus_per_node=4, gpu=GPUSpec(name="g", peak_tflops=1.0, memory_gb=10.0),
                     intra_link=LinkSpec(bandwidth_GBps=1.0, latency_us=0.0),
                     nics=[NICSpec(id="n0", bandwidth_GBps=1.0, latency_us=0.0)], gpu_nic=["n0"] * 4)
    prof = CostProfile(linear=KernelEfficiency(eff_max=1.0, n_half=0.0), attention=KernelEfficiency(eff_max=1.0, n_half=0.0),
                       memory_reserved_gb=0.0)
    return PlanContext(cl, model_preset("tiny"), prof, tp=tp, tp_overlap=mode)


def _step(n_units: int) -> StepPlan:
    seqs = [Sequence(sample_id=i, length=4000) for i in range(n_units)]
    groups = [Group(kind="local", tier="local", units=[u]) for u in range(n_units)]
    pls = [Placement(seq=u, group=u, ranges=[[[0, 4000]]]) for u in range(n_units)]
    return StepPlan(step=0, sequences=seqs, microbatches=[MicroBatch(groups=groups, placements=pls,
                                                                      queues=[[u] for u in range(n_units)])])


@pytest.mark.parametrize("mode", ["none", "slicing", "commfuse"])
def test_tp_exposed_communication_by_mode(mode):
    ctx = _ctx(mode)
    no_tp = _ctx("none")
    st = _step(ctx.num_units)
    t = Simulator(ctx).simulate_step(st)
    exposed = ctx.model.num_layers * float(ctx.cost.tp_exposed_comm(4000, mode))
    assert exposed > 0
    # the same plan with the TP collectives free: the difference is exactly the exposed TP communication
    base = ctx.cost.tp_exposed_comm
    try:
        ctx.cost.tp_exposed_comm = lambda tokens, mode=None: np.zeros_like(np.asarray(tokens, dtype=float))
        t0 = Simulator(ctx).simulate_step(st)
    finally:
        ctx.cost.tp_exposed_comm = base
    assert t.step_time_s - t0.step_time_s == pytest.approx(exposed, rel=1e-9)
    assert no_tp.tp == 2


def test_modes_order_with_four_way_tp():
    # TP=4: CommFuse's 3 ring steps each hide a transfer behind a quarter of the GEMM, slicing
    # always leaves its last chunk's transfer exposed, `none` exposes everything
    times = {m: Simulator(_ctx(m, tp=4)).simulate_step(_step(1)).step_time_s for m in ("none", "slicing", "commfuse")}
    assert times["commfuse"] < times["slicing"] < times["none"]
