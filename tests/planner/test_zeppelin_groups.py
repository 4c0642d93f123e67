"""Groups, queues, routes and the remap of a micro-batch (groups.py): Ulysses groups inside a node,
and the ablations that leave out routing or remapping."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.zeppelin_steps import check_plan, header_for, make_ctx, seqs_of
from zeppelin.planner.core.base import PlanningError
from zeppelin.planner.zeppelin.planner import (
    ZeppelinNoRemap,
    ZeppelinNoRouting,
    ZeppelinPlanner,
    ZeppelinTiersOnly,
)
from zeppelin.planner.zeppelin.tiering import Tiering
from zeppelin.schemas.layout import contiguous_ranges


def test_intra_node_ulysses_option():
    """intra=auto may run a sequence split inside a node as Ulysses (all-to-all to head shards) where
    the cost model prices it below the ring: never slower than rings only, by the prediction, and
    the Ulysses groups stay inside a node with head counts they divide."""
    from zeppelin.planner.sim.simulate import Simulator

    for cluster, mix_seed in (("zeppelin-a", 3), ("zeppelin-c", 6)):
        ctx = make_ctx(cluster)
        tg = Tiering(ctx)
        rng = np.random.default_rng(mix_seed)
        lengths = list(np.clip(rng.lognormal(8.5, 1.2, 90).astype(int), 16, 60000)) + [tg.cap * 3]
        ring = ZeppelinPlanner(intra="ring", families="none").plan_step(ctx, 0, seqs_of(lengths))
        auto = ZeppelinPlanner(intra="auto", families="none").plan_step(ctx, 0, seqs_of(lengths))
        check_plan(ctx, auto, lengths)
        assert auto.prediction.step_time_s <= ring.prediction.step_time_s * 1.001
        kinds = {g.kind for mb in ring.microbatches for g in mb.groups}
        assert "ulysses" not in kinds
        uly = [(mb, g) for mb in auto.microbatches for g in mb.groups if g.kind == "ulysses"]
        assert uly, "the auto plan uses no Ulysses group on a mix of medium sequences"
        heads = ctx.model.num_heads // ctx.tp
        for mb, g in uly:
            assert g.tier == "intra" and len({u // ctx.units_per_node for u in g.units}) == 1
            assert heads % len(g.units) == 0
        for mb in auto.microbatches:
            for p in mb.placements:
                if mb.groups[p.group].kind == "ulysses":
                    assert p.scheme == "contiguous"
                    assert p.ranges == contiguous_ranges(lengths[p.seq], len(mb.groups[p.group].units))
        # one kind family per unit and micro-batch (what the runtime runs)
        from zeppelin.schemas.invariants import kind_family_problems

        assert kind_family_problems(header_for(ctx), auto) == []
        # the prediction is the simulator's verdict, within a few percent
        sim = Simulator(ctx).simulate_step(auto)
        assert sim.step_time_s == pytest.approx(auto.prediction.step_time_s, rel=0.05)
    with pytest.raises(PlanningError, match="intra option must be auto or ring"):
        ZeppelinPlanner(intra="tree")


def test_ablation_variants_differ_only_in_routing_and_remap():
    ctx = make_ctx()
    tg = Tiering(ctx)
    lengths = [tg.cap * 10, 3000, 2500, 800, 600, 500] * 3
    plans = {cls.name: cls(families="none").plan_step(ctx, 0, seqs_of(lengths))
             for cls in (ZeppelinPlanner, ZeppelinNoRouting, ZeppelinNoRemap, ZeppelinTiersOnly)}
    for name, plan in plans.items():
        check_plan(ctx, plan, lengths)
        for mb in plan.microbatches:
            if name in ("zeppelin-no-routing", "zeppelin-tiers-only"):
                assert all(len(r.paths) == 1 and r.paths[0].via_src == r.src for r in mb.routes)
            if name in ("zeppelin-no-remap", "zeppelin-tiers-only"):
                assert mb.linear_layout is None
    assert any(mb.routes for mb in plans["zeppelin"].microbatches)
