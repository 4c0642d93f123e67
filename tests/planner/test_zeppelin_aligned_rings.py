"""Rings on aligned blocks (families/aligned_rings.py): micro-batches by first fit and for
coupling, the local search on placements."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.zeppelin_steps import make_ctx
from zeppelin.planner.core.base import zigzag_share
from zeppelin.planner.zeppelin.families.common import token_slope


def test_coupled_fit_keeps_a_narrow_ring_off_the_micro_batch_its_wider_block_waits_in():
    """By hand, units 0-3 (capacity 34,000 tokens): a four-unit ring A (3.6 s, 21,000 tokens per
    unit), a two-unit ring B on units 0-1 (1.2 s, 12,000) and local C on unit 2 (2.0 s, 23,000) and D
    on unit 3 (1.8 s, 22,000). First fit puts B beside A (it fits), so units 2-3 wait for it there
    (4.8 s) and then run C and D in the second micro-batch: 6.8 s. Chosen for coupling, B goes to the
    second micro-batch with C and D: 3.6 + 2.0 = 5.6 s."""
    from zeppelin.planner.zeppelin.families import aligned_rings as R

    where = [([0, 1, 2, 3], 21000), ([0, 1], 12000), ([2], 23000), ([3], 22000)]
    tl = [3.6, 1.2, 2.0, 1.8]
    order = [0, 1, 2, 3]
    ff = R.first_fit(4, 34000, order, where)
    assert ff == ([(0, 0), (1, 0), (2, 1), (3, 1)], 2)
    assert R.coupled_time(4, where, tl, *ff) == pytest.approx(6.8)
    cf = R.coupled_fit(4, 34000, order, where, tl, ff[1])
    assert cf == ([(0, 0), (1, 1), (2, 1), (3, 1)], 2)
    assert R.coupled_time(4, where, tl, *cf) == pytest.approx(5.6)
    # started with one micro-batch, it opens a second only for what has no room in the first
    assert R.coupled_fit(4, 34000, order, where, tl, 1) == ([(0, 0), (1, 0), (2, 1), (3, 1)], 2)


def test_coupled_fit_respects_token_capacity_on_random_placements():
    """On random aligned placements: every sequence placed once, no unit past the capacity in any
    micro-batch, no more micro-batches than first fit's unless one had no room."""
    from zeppelin.planner.zeppelin.families import aligned_rings as R

    rng = np.random.default_rng(5)
    n, cap = 16, 1000
    for _ in range(40):
        where, tl = [], []
        for _ in range(int(rng.integers(5, 40))):
            G = int(2 ** rng.integers(0, 4))
            s0 = G * int(rng.integers(0, n // G))
            where.append((list(range(s0, s0 + G)), int(rng.integers(50, 700))))
            tl.append(float(rng.random()))
        order = sorted(range(len(where)), key=lambda i: (-len(where[i][0]), -tl[i], i))
        ff = R.first_fit(n, cap, order, where)
        fit, m = R.coupled_fit(n, cap, order, where, tl, ff[1])
        assert [i for i, _ in fit] == order
        held = np.zeros((m, n), dtype=np.int64)
        for i, k in fit:
            held[k, where[i][0]] += where[i][1]
        assert held.max() <= cap
        assert m >= ff[1] and (m == ff[1] or all(held[:ff[1]].max(axis=1) > 0))


def test_flop_share_local_search_lowers_the_top_load_and_keeps_blocks_aligned():
    """settle_blocks on random FLOP-share placements: the top load never rises, the loads it leaves
    are those of the placement it returns, and every ring sits on an aligned block of its size
    holding its zigzag share."""
    from zeppelin.planner.zeppelin.families import aligned_rings as R

    ctx = make_ctx("zeppelin-c:4", "llama-7b")
    cm, n, cap = ctx.cost, ctx.num_units, ctx.cost.token_capacity
    layers = ctx.model.num_layers
    rng = np.random.default_rng(3)
    for trial in range(12):
        L = np.minimum(rng.lognormal(8.5, 1.4, int(rng.integers(20, 120))).astype(np.int64) + 64, 4 * cap)
        Lf = L.astype(np.float64)
        slope = token_slope(ctx, cm, max(float(Lf.sum()) / n, 2.0))
        sizes = np.ones(len(L), dtype=np.int64)
        for i in range(len(L)):
            while zigzag_share(L[i:i + 1], int(sizes[i]))[0] > cap:
                sizes[i] *= 2
            if rng.random() < 0.2 and sizes[i] < n:
                sizes[i] *= 2

        def t_of(i, G, Lf=Lf, slope=slope):
            if G == 1:
                return float(layers * cm.attn_time(Lf[i:i + 1])[0] + slope * Lf[i])
            tier = "inter" if G > ctx.units_per_node else "intra"
            return float(layers * cm.ring_attention_time(Lf[i:i + 1], G, tier)[0] + slope * Lf[i] / G)

        t_unit = np.array([t_of(i, int(sizes[i])) for i in range(len(L))])
        load = np.zeros(n)
        where = []
        for i in range(len(L)):
            G = int(sizes[i])
            s0 = G * int(rng.integers(0, n // G))
            share = int(zigzag_share(L[i:i + 1], G)[0])
            where.append((list(range(s0, s0 + G)), share))
            load[s0:s0 + G] += t_unit[i]
        w, sz, ld, t = list(where), sizes.copy(), load.copy(), t_unit.copy()
        top = float(ld.max())
        R.settle_blocks(ctx, L, Lf, slope, sz, t, w, ld, n, 200)
        assert ld.max() <= top * (1 + 1e-12)
        again = np.zeros(n)
        for i, (units, share) in enumerate(w):
            G = len(units)
            assert G == sz[i] and units == list(range(units[0], units[0] + G)) and units[0] % G == 0
            assert share == zigzag_share(L[i:i + 1], G)[0] <= cap
            assert t[i] == pytest.approx(t_of(i, G))
            again[units] += t[i]
        assert again == pytest.approx(ld)
