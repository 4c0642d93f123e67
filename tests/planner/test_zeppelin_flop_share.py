"""The flop-share family (families/flop_share.py): micro-batches chosen for coupling, its ring
sizings, routed inter-node rings."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.zeppelin_steps import grid_step, valid_plan
from zeppelin.planner.zeppelin.families import aligned_rings
from zeppelin.planner.zeppelin.families import flop_share as F
from zeppelin.planner.zeppelin.planner import ZeppelinPlanner


#: usp groups (2-D Ulysses x ring) win these long cells now; the FLOP-share cases leave them out
WITHOUT_USP = "ulysses-groups,flop-share,tp-replicas,wide-rings"


def _first_fit_only(n, cap, order, where, tl, m):
    return aligned_rings.first_fit(n, cap, order, where)


@pytest.mark.parametrize("cell, fine_shares, with_fit, first_fit_only", [
    # long step, rings of at most a quarter share: first fit spills local sequences into a later
    # micro-batch while their ring partners wait in an earlier one (LLaMA-3B: at ZeRO-0 every GPU
    # keeps the whole model's states, which a 7B or 13B model's exceed)
    (("zeppelin-c", "llama-3b", 2, "long", 64, 1), (0.25,), 2.076, 2.173),
])
def test_flop_share_micro_batches_chosen_for_coupling(monkeypatch, cell, fine_shares, with_fit, first_fit_only):
    """LLaMA-3B on cluster C at ZeRO-0, where micro-batches run decoupled and only ring partners
    wait for each other (the coupling the fit models; under FSDP every unit waits, which it does
    not yet): with micro-batches chosen for coupling beside first fit, FLOP-share's plan is
    ``with_fit`` s by the prediction; with first fit alone, ``first_fit_only`` s."""
    from zeppelin.planner.costmodel.context import PlanContext

    monkeypatch.setattr(F, "FINE_SHARES", fine_shares)  # (): whole-share rings alone
    c1, seqs = grid_step(*cell)
    ctx = PlanContext(c1.cluster, c1.model, c1.profile, tp=c1.tp, zero_stage=0)
    assert not ctx.microbatches_coupled
    plan = F.flop_share(ctx, 0, seqs)[0][2]()
    valid_plan(ctx, plan)
    assert len(plan.microbatches) > 1
    assert plan.prediction.step_time_s == pytest.approx(with_fit, abs=0.01)
    monkeypatch.setattr(aligned_rings, "coupled_fit", _first_fit_only)
    fams = F.flop_share(ctx, 0, seqs)
    assert fams[0][2]().prediction.step_time_s == pytest.approx(first_fit_only, abs=0.01)


@pytest.mark.parametrize("cell, fine, whole", [
    (("zeppelin-c", "llama-7b", 1, "long", 32, 0), 2.111, 2.131),
])
def test_flop_share_fine_rings_pack_long_steps_evenly(monkeypatch, cell, fine, whole):
    """Cluster C, long steps: rings of up to a unit's whole share each leave long steps lumpy;
    rings of at most a quarter share, nearly free inside a node, pack evenly: ``fine`` s against
    ``whole`` s (the best plan without them: another family's, or the tiered one)."""
    ctx, seqs = grid_step(*cell)
    monkeypatch.setattr(F, "FINE_SHARES", (0.25,))
    plan = ZeppelinPlanner(families=WITHOUT_USP).plan_step(ctx, 0, seqs)
    valid_plan(ctx, plan)
    assert plan.notes["family"] == "flop-share" and "(rings <= 1/4 share)" in plan.notes["placement"]
    assert plan.prediction.step_time_s == pytest.approx(fine, abs=0.01)
    monkeypatch.setattr(F, "FINE_SHARES", ())
    again = ZeppelinPlanner(families=WITHOUT_USP).plan_step(ctx, 0, seqs)
    assert "share)" not in (again.notes.get("placement") or "")
    assert again.prediction.step_time_s == pytest.approx(whole, abs=0.01)


@pytest.mark.parametrize("cell, frac, ladder, quarter", [
    # long step: rings of at most 1/16 share even it out
    (("zeppelin-c", "llama-7b", 1, "long", 32, 0), 16, 2.0594, 2.1108),
    # short step: half-share rings (fewer, smaller rings) pack best
    (("zeppelin-c", "llama-7b", 1, "short", 32, 3), 2, 1.1736, 1.2326),
])
def test_flop_share_places_every_ring_fraction(monkeypatch, cell, frac, ladder, quarter):
    """Which ring sizing packs a step best depends on its mix: FLOP-share places rings of at most
    1/2, 1/4, 1/8 and 1/16 of a unit's share beside whole-share ones and builds the best. Each cell
    here is won by a different fraction (``ladder`` s by the prediction), against ``quarter`` s
    with the quarter-share sizing alone."""
    ctx, seqs = grid_step(*cell)
    plan = ZeppelinPlanner(families=WITHOUT_USP).plan_step(ctx, cell[-1], seqs)
    valid_plan(ctx, plan)
    assert plan.notes["family"] == "flop-share" and f"(rings <= 1/{frac} share)" in plan.notes["placement"]
    assert plan.prediction.step_time_s == pytest.approx(ladder, abs=0.002)
    monkeypatch.setattr(F, "FINE_SHARES", (0.25,))
    again = ZeppelinPlanner(families=WITHOUT_USP).plan_step(ctx, cell[-1], seqs)
    assert again.prediction.step_time_s == pytest.approx(quarter, abs=0.002)


def test_flop_share_prices_inter_node_rings_as_routed(monkeypatch):
    """FLOP-share routes its inter-node rings' boundary hops over every NIC of their nodes, and
    prices them so: LLaMA-7B on 32 GPUs of cluster C (8 NICs a node), long step 0, plans at 2.059 s
    by the prediction; priced as if each hop had one NIC, its placement loses to the tiered plan
    (2.131 s)."""
    ctx, seqs = grid_step("zeppelin-c", "llama-7b", 1, "long", 32, 0)
    t = aligned_rings.unit_time(ctx, np.array([60000.0]), 1e-5, 8, 1 / 8)
    assert t == pytest.approx(ctx.model.num_layers * ctx.cost.ring_attention_time(np.array([60000.0]), 8, "inter", 1 / 8)
                              + 1e-5 * 60000 / 8)
    plan = ZeppelinPlanner(families=WITHOUT_USP).plan_step(ctx, 0, seqs)
    valid_plan(ctx, plan)
    assert plan.notes["family"] == "flop-share"
    assert any(g.tier == "inter" for mb in plan.microbatches for g in mb.groups)
    assert plan.prediction.step_time_s == pytest.approx(2.0594, abs=0.001)
    one_nic = aligned_rings.unit_time
    monkeypatch.setattr(aligned_rings, "unit_time", lambda ctx, Lf, slope, G, nic_share=1.0: one_nic(ctx, Lf, slope, G))
    again = ZeppelinPlanner(families=WITHOUT_USP).plan_step(ctx, 0, seqs)
    assert "family" not in again.notes and again.prediction.step_time_s == pytest.approx(2.1311, abs=0.001)
