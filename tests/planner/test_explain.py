"""``plan --explain``: its ring thresholds against the simulator, one sequence per tier; the plan's
units by TP degree; whole-step families named where they split short sequences; MoE limits."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.zeppelin_steps import make_ctx
from zeppelin.planner.sim.simulate import Simulator
from zeppelin.planner.tools.explain import HIDDEN, explain_text, one_sequence_step, ring_crossover

# (G, tier, routed) per tier on a 2-node cluster of 8 GPUs per node
_TIERS = ((2, "intra", False), (8, "intra", False), (16, "inter", False), (16, "inter", True))


def _simulated_exposure(ctx, sim, L: int, G: int, tier: str, routed: bool) -> float:
    """The simulator's exposed ring communication of one sequence over its attention time."""
    r = sim.simulate_step(one_sequence_step(ctx, L, G, tier, routed))
    exposed = max(u.exposed_comm_s - r.allreduce_s for u in r.units)
    return exposed / max(u.attention_s for u in r.units)


@pytest.mark.parametrize("model", ["llama-7b", "llama3-8b"])
def test_thresholds_match_the_simulated_crossover(model):
    """Each tier's threshold (and the start of its exposed window) is the simulator's crossover of
    one sequence on that span within 10%; a tier said to hide at every length hides in the
    simulator at lengths from 2G to 1M tokens."""
    ctx = make_ctx("h100:2", model)
    sim = Simulator(ctx)
    seen = set()
    for G, tier, routed in _TIERS:
        x = ring_crossover(ctx, G, tier, routed)
        ex = lambda L: _simulated_exposure(ctx, sim, int(L), G, tier, routed)  # noqa: E731
        if x.exposed_from is None:
            assert all(ex(L) <= HIDDEN for L in np.geomspace(2 * G, 1 << 20, 6)), (model, G, tier, routed)
            seen.add("every length")
            continue
        assert x.threshold is not None
        assert ex(0.9 * x.threshold) > HIDDEN and ex(1.1 * x.threshold) <= HIDDEN, (model, G, tier, routed, x)
        assert ex(2 * x.threshold) <= HIDDEN
        assert ex(1.1 * x.exposed_from) > HIDDEN and ex(0.9 * x.exposed_from) <= HIDDEN, (model, G, tier, routed, x)
        seen.add("window")
    assert seen == {"every length", "window"}  # both cases occur on these two models


def test_grouped_query_attention_hides_where_full_kv_does_not():
    """llama-7b (32 K/V heads) exposes a ring of 8 over NVLink between ~4K and ~8.4K tokens, where
    llama3-8b (8 K/V heads: a quarter of the bytes) hides at every length: below the kernels'
    efficiency knee a round's compute grows linearly with L, like its transfer, so the K/V bytes
    per token decide, not L. The explanation says so."""
    a = ring_crossover(make_ctx("h100:2", "llama-7b"), 8, "intra")
    b = ring_crossover(make_ctx("h100:2", "llama3-8b"), 8, "intra")
    assert 3_000 < a.exposed_from < a.threshold < 10_000 and a.worst < 0.05
    assert b.exposed_from is None and b.worst <= HIDDEN
    text = explain_text(make_ctx("h100:2", "llama-7b"))
    assert f"inside a node, 8 units, nvswitch 450 GB/s:   from {a.threshold:,} tokens" in text
    assert f"exposed {a.exposed_from:,} to {a.threshold - 1:,} tokens, up to 3% of attention time" in text
    flat = " ".join(text.split())
    assert "30 us launch cost per call, efficiency n/(n+1,024) of its peak" in flat
    assert "a model with fewer K/V heads (grouped-query attention) may hide at every length" in flat
    assert max(len(line) for line in text.splitlines()) <= 80
