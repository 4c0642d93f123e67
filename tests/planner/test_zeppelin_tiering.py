"""Tiering: memory thresholds and hide crossovers from the cost model, the spans it chooses, the
zigzag share of a span."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.zeppelin_steps import make_ctx, seqs_of
from zeppelin.planner.zeppelin.tiering import Tiering, zigzag_max_tokens
from zeppelin.schemas.layout import zigzag_ranges


def test_zigzag_max_tokens_matches_layout():
    for L in (1, 7, 15, 16, 17, 100, 1001, 4097):
        for G in (1, 2, 3, 4, 8):
            want = max(sum(e - s for s, e in rs) for rs in zigzag_ranges(L, G))
            assert zigzag_max_tokens(L, G) == want, (L, G)


def test_zigzag_max_tokens_array_matches_scalar():
    from zeppelin.planner.zeppelin.tiering import zigzag_max_tokens_array

    L = np.arange(0, 1200)
    for G in (1, 2, 3, 8, 16, 64):
        expect = [zigzag_max_tokens(int(x), G) for x in L]
        assert zigzag_max_tokens_array(L, np.full(len(L), G)).tolist() == expect
    # mixed spans in one call, e.g. 100 tokens over 4 units: 8 chunks of 12/13 -> a position holds 25
    assert zigzag_max_tokens_array([100, 100, 7], [1, 4, 8]).tolist() == [100, 25, 1]


def test_memory_thresholds_come_from_cost_model():
    ctx = make_ctx()
    tg = Tiering(ctx)
    c = ctx.cost
    # independent recomputation: (usable memory - model states) / activation bytes per token
    free = (80.0 - 4.0) * 1e9 - c.model_state_bytes()
    assert tg.memory_thresholds["unit"] == int(free / c.activation_bytes_per_token)
    assert tg.memory_thresholds["node"] == 8 * tg.memory_thresholds["unit"]
    assert tg.memory_thresholds["cluster"] == 16 * tg.memory_thresholds["unit"]


def test_hide_threshold_is_the_crossover():
    ctx = make_ctx()
    tg = Tiering(ctx)
    c = ctx.cost
    ov = c.profile.attention.overhead_s
    for G, tier in ((4, "intra"), (8, "intra"), (16, "inter")):
        th = tg.hide_threshold(G, tier)
        assert th is not None

        def hidden(L, G=G, tier=tier):
            # round 0: two causal diagonal chunks + one full block; later rounds: two full blocks of
            # L/(2G) tokens, each round one call; the transfer of the next K/V block must fit in both
            ch = L / (2 * G)
            t0 = 2 * c.attn_block_time(ch, ch, causal=True) + c.attn_block_time(ch, ch) - 2 * ov
            tr = 2 * c.attn_block_time(ch, ch) - ov
            comm = c.p2p_time(c.ring_round_bytes(L / G), c.tier_link(tier))
            return comm <= t0 and comm <= tr

        assert hidden(th), (G, tier, th)
        if th > 2 * G:  # above the search floor: one token shorter is exposed
            assert not hidden(th - 1), (G, tier, th)
        else:  # the whole range hides (launch overheads cover tiny transfers)
            assert all(hidden(x) for x in (2 * G, 100, 1000, 5000)), (G, tier)
        assert all(hidden(x) for x in (th * 2, th * 10))
    # a slower link needs longer sequences to hide its transfer; more NICs need shorter ones
    assert tg.hide_threshold(16, "inter") > tg.hide_threshold(8, "intra")
    assert tg.hide_threshold(16, "inter", 4) < tg.hide_threshold(16, "inter", 1)


def test_explain_prints_computed_thresholds():
    """The memory thresholds are the tiering's; the ring thresholds (crossovers of the prediction,
    tests/planner/test_explain.py) agree within 10% with the tiering's zero-exposure crossovers its
    span choice uses, for the NVLink ring and the one-NIC ring."""
    from zeppelin.planner.tools.explain import explain_text, ring_crossover

    ctx = make_ctx("zeppelin-c")
    tg = Tiering(ctx)
    text = " ".join(explain_text(ctx).split())
    assert f"one unit holds {tg.memory_thresholds['unit']:,} tokens" in text
    for G, tier in ((8, "intra"), (16, "inter")):
        th = ring_crossover(ctx, G, tier, routed=False).threshold
        assert f"from {th:,} tokens" in text
        assert th == pytest.approx(tg.hide_threshold(G, tier), rel=0.1)


def test_choose_span_rules():
    ctx = make_ctx()
    tg = Tiering(ctx)
    lin = 1e-4
    # short sequence, large target: stays local
    assert tg.choose_span(512, 100.0, lin).tier == "local"
    # longer than a unit's memory: split at least enough to fit
    L = tg.cap * 3
    s = tg.choose_span(L, 1e9, lin)
    assert s.G >= 3 and zigzag_max_tokens(L, s.G) <= tg.cap
    # longer than a node: inter tier over whole nodes
    s = tg.choose_span(tg.cap * 8 + 1000, 1e9, lin)
    assert s.tier == "inter" and s.G == 16 and s.nodes == 2
    # vectorised version agrees
    Ls = np.array([100, 3000, 9000, 20000, 60000, 100000])
    for target in (0.5, 5.0, 50.0):
        a = tg.choose_spans(Ls, target, lin, 4)
        b = [tg.choose_span(int(x), target, lin, 4) for x in Ls]
        assert [(x.G, x.tier) for x in a] == [(x.G, x.tier) for x in b]


def test_a_split_that_wastes_compute_is_not_free():
    """The refinement splits a sequence whose piece is coarse (above GRANULARITY of the balanced
    load) only where the split is free: its communication hides AND its units together spend at most
    FREE_COMPUTE more compute on the attention than one unit (a ring's blocks are smaller than the
    sequence's). A 2K-token sequence on 2 units wastes far more (stays whole, though its ring would
    hide); an 8K one wastes less (split); the vectorised rule agrees."""
    from zeppelin.planner.zeppelin import tiering as T

    tg = Tiering(make_ctx())
    lin = 1e-4
    two = tg.spans[1]
    assert (two.G, two.tier) == (2, "intra")
    for L, split in ((2048, False), (8192, True)):
        t1 = float(tg.per_unit_time(L, tg.spans[0], lin))
        target = 0.5 * t1 / T.GRANULARITY  # the whole sequence is within the load, its piece coarse
        assert t1 <= target
        assert t1 > T.GRANULARITY * target
        assert tg.exposed_fraction(L, two) <= T.FREE_WASTE  # (its ring on 2 units hides)
        assert (tg.compute_waste(L, two) > T.FREE_COMPUTE) is not split
        assert (tg.choose_span(L, target, lin).G > 1) is split
        table = tg.span_table(np.array([float(L)]))
        assert table.W[1, 0] == pytest.approx(tg.compute_waste(L, two))
        assert (int(tg.choose_span_index(table, target, lin)[0]) > 0) is split
        assert int(tg.choose_span_index(table, target, lin, free_compute=1e9)[0]) > 0  # (unbounded: split)


def _repeating_lengths(n: int, seed: int) -> np.ndarray:
    """``n`` lengths from a long-tailed mix, rounded so that many repeat."""
    rng = np.random.default_rng(seed)
    body = rng.lognormal(7.0, 1.0, n)
    tail = (rng.pareto(1.2, n) + 1.0) * 4096
    L = np.clip(np.where(rng.random(n) < 0.1, tail, body), 16, 131072)
    return (np.round(L / 64) * 64).clip(16).astype(np.float64)


@pytest.mark.parametrize("ulysses", [False, True])
def test_a_table_priced_per_distinct_length_equals_one_priced_per_sequence(ulysses):
    """A micro-batch of thousands of sequences is priced once per distinct length: every entry,
    the unit times and the usp prices equal those priced per sequence, bit for bit."""
    from zeppelin.planner.zeppelin.tiering import DISTINCT_LENGTHS_MIN, DistinctSpanTable

    ctx = make_ctx("zeppelin-c:4")
    tg = Tiering(ctx)
    L = _repeating_lengths(DISTINCT_LENGTHS_MIN + 100, 3)
    got, want = tg.span_table(L, 2, ulysses=ulysses), tg._span_table(L, 2, ulysses)
    assert isinstance(got, DistinctSpanTable) and len(got.distinct[0].L) < len(L) / 2
    for name in ("A", "F", "E", "U", "R", "Q", "W"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), name
    assert np.array_equal(got.times(3e-7), want.times(3e-7))
    assert np.array_equal(tg.usp_prices(got), tg.usp_prices(want))


@pytest.mark.parametrize("floor", [None, 7])
@pytest.mark.parametrize("balance", ["total", "attention"])
def test_stage_one_chooses_per_distinct_length_as_per_sequence(monkeypatch, balance, floor):
    """Stage 1's choices made once per distinct length (from a table priced so) equal those made
    per sequence: each depends on its sequence's length alone, the targets' sums on every one."""
    import zeppelin.planner.zeppelin.tiering as tiering_mod
    from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
    from zeppelin.planner.zeppelin.step_state import StepState
    from zeppelin.planner.zeppelin.tiered import choose_spans

    ctx = make_ctx("zeppelin-c:4")
    seqs = seqs_of(_repeating_lengths(12 * ctx.num_units, 5))
    planner = ZeppelinPlanner()
    got = []
    for least in (10**9, 64):  # per sequence; then per distinct length from 64 sequences up
        monkeypatch.setattr(tiering_mod, "DISTINCT_LENGTHS_MIN", least)
        state = StepState(options=planner, ctx=ctx, tiering=planner.tiering(ctx), sequences=seqs,
                          lengths=np.array([s.length for s in seqs]), ilp_left=planner.ilp_budget_calls)
        sp = choose_spans(state, list(range(len(seqs))), balance, floor)
        got.append((sp.table.distinct is not None, [(x.G, x.tier) for x in sp.spans], sp.unit_time.tolist(),
                    sp.tokens_per_unit.tolist(), None if sp.usp is None else sp.usp.tolist(), sp.bounded,
                    sp.times[:, sp.time_cols].tolist()))
    assert not got[0][0] and got[1][0]
    assert got[0][1:] == got[1][1:]
    if floor is None:  # (local, intra and inter spans chosen; node-CP: every sequence spans its node)
        assert len(set(got[0][1])) >= 3
