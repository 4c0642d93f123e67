"""The cost model of sliding-window attention, by hand on small cases: a windowed layer's pairs
(``L*w - w^2/2`` once ``L > w``), a mixed local/global model as the sum over its layer types, and
a ring whose window leaves later rounds nothing to compute or send."""

from __future__ import annotations

import numpy as np
import pytest

from zeppelin.planner.costmodel.cost import CostModel, window_pairs, window_pairs_between
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.model import ModelSpec, model_preset


def _spec(**kw) -> ModelSpec:
    return ModelSpec(name="w", num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, ffn_hidden=688,
                     vocab_size=1024, **kw)


def _cm(spec: ModelSpec) -> CostModel:
    return CostModel(cluster_preset("h100"), spec)


def test_window_pairs_by_hand():
    # L <= w: the causal square's half; L > w: w*(w)/2 for the first w queries + w for each later one
    assert window_pairs([4, 8, 16], 4).tolist() == [8.0, 24.0, 56.0]
    assert window_pairs(16, None) == 128.0
    # queries 8..12 over keys 0..8 with w = 4: query q sees (q-4, 8], 12 - q keys: 8 in all
    assert window_pairs_between(8, 12, 0, 8, 4) == 8.0
    assert window_pairs_between(8, 12, 0, 4, 4) == 0.0  # wholly outside the window
    assert window_pairs_between(8, 12, 0, 8, None) == 32.0  # full causal: every key


def test_windowed_attention_time_is_that_of_its_pairs():
    full, win = _cm(_spec()), _cm(_spec(sliding_window=512))
    L = np.array([256.0, 512.0, 65536.0, 262144.0])
    t = win.attn_time(L)
    assert np.allclose(t[:2], full.attn_time(L[:2]))  # within the window: plain causal attention
    want = full.attn_time(np.sqrt(2 * (L[2:] * 512 - 512 ** 2 / 2)))
    assert np.allclose(t[2:], want)
    # the work grows linearly once L >> w: 4x the length costs about 4x (full causal: 16x)
    assert 3 < t[3] / t[2] < 4.5 and full.attn_time(L[3]) / full.attn_time(L[2]) > 15


def test_mixed_local_global_is_the_sum_over_layer_types():
    mixed = _cm(_spec(sliding_window=512, layer_types=["sliding_attention", "full_attention"] * 2))
    full, win = _cm(_spec()), _cm(_spec(sliding_window=512))
    L = np.array([1000.0, 20000.0])
    assert np.allclose(mixed.attn_time(L), (full.attn_time(L) + win.attn_time(L)) / 2)
    assert np.allclose(mixed.seq_compute_time(L), (full.seq_compute_time(L) + win.seq_compute_time(L)) / 2)
    # one layout for both: zigzag rings (the full layers need its balance), whose full layers still
    # exchange every round
    assert not mixed.ring_contiguous(20000.0, 4)
    assert float(mixed.ring_exchanges(20000.0, 4)) == pytest.approx((3 + 3) / 2)


def test_contiguous_windowed_ring_is_a_neighbour_exchange():
    win = _cm(_spec(sliding_window=16))
    G, L = 4, 160.0  # quarters of 40 >= w
    assert win.ring_contiguous(L, G) and not win.ring_contiguous(60.0, G)
    rounds, exchanges = win.ring_window_rounds(np.array([L]), G, 16)
    rounds = [r[0] for r in rounds]
    assert float(exchanges[0]) == 1.0
    # round 0: a 40-token diagonal under a window of 16: 40*16 - 128 = 512 pairs; round 1: the
    # predecessor's block, of which only the last 16 keys are seen by the first 16 queries: 128
    e = np.sqrt(2.0 * 512)
    assert float(rounds[0]) == pytest.approx(float(win.attn_block_time(e, e, causal=True)))
    assert float(rounds[1]) == pytest.approx(float(win.attn_block_time(40.0, 128 / 40.0)))
    assert float(rounds[2]) == float(rounds[3]) == 0.0
    t0, tr = win.ring_round_compute(L, G)
    assert float(t0 + (G - 1) * tr) == pytest.approx(float(rounds[0] + rounds[1]))


def test_full_attention_rings_unchanged_by_the_block_model():
    # the block-by-block ring model reproduces the closed zigzag formula for full causal layers
    cm = _cm(_spec())
    L = np.array([4096.0, 50000.0])
    rounds, exchanges = cm.ring_window_rounds(L, 4, None)
    t0, tr = cm.ring_round_compute(L, 4)
    assert np.allclose(rounds[0], t0) and all(np.allclose(r, tr) for r in rounds[1:])
    assert exchanges.tolist() == [3.0, 3.0]


def test_windowed_ring_sends_one_block():
    full, win = _cm(_spec()), _cm(_spec(sliding_window=256))
    L = 65536.0
    assert float(win.ring_exchanges(L, 8)) == 1.0 and float(full.ring_exchanges(L, 8)) == 7.0
    # its little compute hides less of the one transfer, but no more than that transfer is exposed
    one = float(win.p2p_time(win.ring_round_bytes(L / 8), "inter"))
    assert 0 < float(win.ring_exposed_comm(L, 8, "inter")) <= one
    assert float(win.ring_attention_time(L, 8, "inter")) < 0.2 * float(full.ring_attention_time(L, 8, "inter"))


def test_moe_memory_from_all_experts_compute_from_active():
    m = model_preset("mixtral-8x7b")
    assert m.num_params() == pytest.approx(46.7e9, rel=0.01)
    dense = m.model_copy(update={"num_experts": 0, "experts_per_token": 0, "expert_ffn_hidden": 0})
    cm, cd = _cm(m), _cm(dense)
    # a token runs 2 of 8 experts (plus the router): twice a dense layer's MLP FLOPs
    mlp = 2 * 3 * m.hidden * m.ffn_hidden
    assert cm.linear_flops_per_token - cd.linear_flops_per_token == pytest.approx(mlp + 2 * m.hidden * 8)
    assert cm.model_state_bytes() > 5 * cd.model_state_bytes()


@pytest.mark.parametrize("name, params", [("mistral-7b", 7.24e9), ("qwen3-8b", 8.19e9), ("qwen3-30b-a3b", 30.5e9),
                                          ("llama3-8b", 8.03e9)])
def test_presets_match_the_published_sizes(name, params):
    assert model_preset(name).num_params() == pytest.approx(params, rel=0.005)


def test_simulator_prices_the_window_layer_by_layer_type():
    """The same plan simulated for a windowed, a mixed and a full-attention model: the windowed
    one is faster, and the mixed one's attention is the mean of the two (one graph per layer type)."""
    from zeppelin.planner.core.base import PlanContext, get_planner
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_profile
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.schemas.plan import Sequence

    cl = resolve_cluster("zeppelin-a:2")
    full = model_preset("llama3-8b").model_copy(update={"vocab_size": 32000})
    win = full.model_copy(update={"sliding_window": 1024})
    mixed = full.model_copy(update={"sliding_window": 1024,
                                    "layer_types": ["sliding_attention", "full_attention"] * 16})
    seqs = [Sequence(sample_id=i, length=n) for i, n in enumerate([30000, 9000, 4000, 2500, 1200, 800] * 3)]
    ctxs = {k: PlanContext(cl, m, resolve_profile(None, cl), tp=1, seed=0)
            for k, m in (("full", full), ("win", win), ("mixed", mixed))}
    sp = get_planner("hybrid-dp").plan_step(ctxs["full"], 0, seqs)
    res = {k: Simulator(c).simulate_step(sp) for k, c in ctxs.items()}
    att = {k: sum(u.attention_s for u in r.units) for k, r in res.items()}
    assert res["win"].step_time_s < res["full"].step_time_s
    assert att["win"] < 0.5 * att["full"]
    assert att["mixed"] == pytest.approx((att["win"] + att["full"]) / 2, rel=1e-9)
