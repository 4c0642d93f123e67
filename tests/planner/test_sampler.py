"""StepSampler: determinism, order, budgets, overflow handling, wrap-around, resume."""

from __future__ import annotations

import time

import numpy as np
import pytest

from zeppelin.planner.core.sampler import StepSampler, sample_steps
from zeppelin.schemas.common import InputError
from zeppelin.schemas.io.datasets import Dataset, default_manifest_path, load_manifest
from zeppelin.schemas.plan import SamplerConfig


def ds(lengths) -> Dataset:
    return Dataset(np.asarray(lengths, dtype=np.int64), source="test", format="npy")


def ids(step) -> list[int]:
    return [s.sample_id for s in step]


def reference_steps(lengths, orders, budget, cap, num_steps, max_len=None):
    """Plain-Python statement of the rule: walk the stream, close a step when the next sample
    would break the token budget or the count cap (never leaving a step empty), and never
    let a step hold more samples than one epoch has."""
    stream = [s for order in orders for s in order]
    n = len(orders[0])
    eff = [min(lengths[s], max_len) if max_len else lengths[s] for s in stream]
    out, pos = [], 0
    for _ in range(num_steps):
        step, tok = [], 0
        while True:
            e = eff[pos]
            full = (budget is not None and tok + e > budget) or (cap is not None and len(step) >= cap) or len(step) >= n
            if step and full:
                break
            step.append(stream[pos])
            tok += e
            pos += 1
        out.append(step)
    return out


@pytest.fixture(scope="module")
def sample():
    return load_manifest(default_manifest_path())


def test_in_order_steps_match_reference_rule(sample):
    cfg = SamplerConfig(tokens_per_step=200_000, shuffle=False)
    steps = sample_steps(sample, cfg, 30)
    L = sample.lengths.tolist()
    n = len(L)
    ref = reference_steps(L, [list(range(n))], 200_000, None, 30)
    assert [ids(s) for s in steps] == ref
    flat = [i for s in steps for i in ids(s)]
    assert flat == list(range(len(flat)))  # in order, contiguous, nothing skipped
    for s in steps:
        tok = sum(x.length for x in s)
        assert tok <= 200_000 or len(s) == 1


def test_shuffle_is_deterministic_and_seeded(sample):
    cfg = SamplerConfig(tokens_per_step=100_000, seed=7)
    a = [ids(s) for s in sample_steps(sample, cfg, 10)]
    b = [ids(s) for s in sample_steps(sample, cfg, 10)]
    c = [ids(s) for s in sample_steps(sample, cfg.model_copy(update={"seed": 8}), 10)]
    assert a == b and a != c
    order = np.random.default_rng([7, 0]).permutation(sample.num_samples)
    ref = reference_steps(sample.lengths.tolist(), [order.tolist()], 100_000, None, 10)
    assert a == ref


def test_at_least_one_sample_even_over_budget():
    d = ds([5, 50, 5, 5, 40])
    steps = sample_steps(d, SamplerConfig(tokens_per_step=10, shuffle=False), 4)
    assert [ids(s) for s in steps] == [[0], [1], [2, 3], [4]]
    assert [[x.length for x in s] for s in steps] == [[5], [50], [5, 5], [40]]


def test_seqs_per_step_alone_and_with_tokens():
    d = ds([3] * 10)
    assert [ids(s) for s in sample_steps(d, SamplerConfig(seqs_per_step=4, shuffle=False), 3)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    both = SamplerConfig(seqs_per_step=4, tokens_per_step=7, shuffle=False)
    assert [ids(s) for s in sample_steps(d, both, 3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(InputError, match="^the sampler needs tokens_per_step and/or seqs_per_step$"):
        StepSampler(d, SamplerConfig(shuffle=False))


def test_wrap_around_uses_a_new_permutation_and_covers_each_epoch_once():
    n = 50
    d = ds(np.arange(1, n + 1))
    cfg = SamplerConfig(seqs_per_step=7, seed=3)
    steps = sample_steps(d, cfg, 20)  # 140 samples = 2.8 epochs
    flat = [i for s in steps for i in ids(s)]
    e0, e1 = flat[:n], flat[n:2 * n]
    assert sorted(e0) == sorted(e1) == list(range(n))
    assert e0 != e1
    assert e0 == np.random.default_rng([3, 0]).permutation(n).tolist()
    assert e1 == np.random.default_rng([3, 1]).permutation(n).tolist()


def test_a_step_never_holds_more_than_one_epoch():
    d = ds([1, 1, 1])
    steps = sample_steps(d, SamplerConfig(tokens_per_step=1000, shuffle=False), 2)
    assert [ids(s) for s in steps] == [[0, 1, 2], [0, 1, 2]]


def test_truncate_skip_reject():
    d = ds([4, 20, 6, 30, 2])
    tr = sample_steps(d, SamplerConfig(seqs_per_step=5, shuffle=False, max_seq_len=10), 1)[0]
    assert [(s.sample_id, s.length, s.truncated_from) for s in tr] == [
        (0, 4, None), (1, 10, 20), (2, 6, None), (3, 10, 30), (4, 2, None)]
    # truncated lengths count against the budget
    tb = sample_steps(d, SamplerConfig(tokens_per_step=20, shuffle=False, max_seq_len=10), 2)
    assert [ids(s) for s in tb] == [[0, 1, 2], [3, 4, 0]]
    sk = sample_steps(d, SamplerConfig(seqs_per_step=2, shuffle=False, max_seq_len=10, overflow="skip"), 3)
    assert [ids(s) for s in sk] == [[0, 2], [4, 0], [2, 4]]
    rj = StepSampler(d, SamplerConfig(seqs_per_step=1, shuffle=False, max_seq_len=10, overflow="reject"))
    assert ids(rj.next_step()) == [0]
    with pytest.raises(InputError) as ei:
        rj.next_step()
    assert str(ei.value) == "test: sample 1 has 20 tokens, more than max_seq_len 10 (overflow=reject)"
    with pytest.raises(InputError) as ei:
        StepSampler(ds([20, 30]), SamplerConfig(seqs_per_step=1, max_seq_len=10, overflow="skip"))
    assert str(ei.value) == "test: every sample is longer than max_seq_len 10 (overflow=skip leaves nothing)"


def test_start_sample_resumes_where_a_previous_run_stopped(sample):
    cfg = SamplerConfig(tokens_per_step=300_000, seed=1)
    s = StepSampler(sample, cfg)
    first = [ids(x) for x in s.steps(5)]
    rest = [ids(x) for x in s.steps(5)]
    resumed = StepSampler(sample, cfg.model_copy(update={"start_sample": StepSampler(sample, cfg).position}))
    assert [ids(x) for x in resumed.steps(5)] == first
    pos = sum(len(x) for x in first)
    assert s.position == pos + sum(len(x) for x in rest)
    resumed = StepSampler(sample, cfg.model_copy(update={"start_sample": pos}))
    assert [ids(x) for x in resumed.steps(5)] == rest


def test_millions_of_samples_are_handled_vectorised():
    rng = np.random.default_rng(0)
    big = ds(rng.integers(1, 4096, size=2_000_000))
    t = time.perf_counter()
    steps = sample_steps(big, SamplerConfig(tokens_per_step=1 << 19, seed=0), 3)
    elapsed = time.perf_counter() - t
    assert all(sum(x.length for x in s) <= 1 << 19 for s in steps)
    assert elapsed < 5.0, elapsed
