"""Single-process tests of the runtime's model, token inputs and checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zeppelin.runtime.checkpoint import (
    latest_checkpoint,
    load_checkpoint_tensors,
    read_checkpoint_state,
    rng_state,
    save_checkpoint,
)
from zeppelin.runtime.data import IGNORE_INDEX, TokenSource, predicted_tokens, synthetic_tokens
from zeppelin.runtime.model import (
    LlamaModel,
    PhaseTimer,
    ReferenceLayout,
    apply_rope,
    reference_attention,
    reference_step,
    rope_tables,
)
from zeppelin.schemas.common import InputError
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Sequence


def test_synthetic_tokens_are_counter_based():
    full = synthetic_tokens(7, 0, 100, seed=3, vocab=50)
    assert full.dtype == np.int64 and full.min() >= 0 and full.max() < 50
    # any slice equals the slice of the whole sequence: ranks build their chunks independently
    assert np.array_equal(synthetic_tokens(7, 33, 71, seed=3, vocab=50), full[33:71])
    assert not np.array_equal(synthetic_tokens(8, 0, 100, seed=3, vocab=50), full)
    assert not np.array_equal(synthetic_tokens(7, 0, 100, seed=4, vocab=50), full)
    # an arithmetic progression mod vocab with ~10% random positions: learnable, not trivial
    seq = synthetic_tokens(11, 0, 20_000, seed=0, vocab=101)
    diffs = np.diff(seq) % 101
    stride = np.bincount(diffs).argmax()
    assert stride != 0 and 0.75 < float(np.mean(diffs == stride)) < 0.86  # P(both clean) = 0.81
    strides = {int(np.bincount(np.diff(synthetic_tokens(i, 0, 200, seed=0, vocab=101)) % 101).argmax())
               for i in range(20)}
    assert strides == {1, 2, 3, 4}  # samples differ in stride, a small one (learnable by a small model)


def test_segments_labels_positions_and_padding():
    src = TokenSource(vocab=97, seed=1)
    seqs = [Sequence(sample_id=5, length=10), Sequence(sample_id=9, length=4)]
    full0 = synthetic_tokens(5, 0, 10, seed=1, vocab=97)
    full1 = synthetic_tokens(9, 0, 4, seed=1, vocab=97)
    # a middle chunk, the tail chunk, and seq 1 with two padding positions (padded_length 6)
    b = src.segments(seqs, [[0, 3, 6], [0, 8, 10], [1, 2, 6]])
    assert b.seg_lengths == [3, 2, 4]
    assert b.positions.tolist() == [3, 4, 5, 8, 9, 2, 3, 4, 5]
    assert b.tokens.tolist() == full0[3:6].tolist() + full0[8:10].tolist() + full1[2:4].tolist() + [0, 0]
    # the label of a chunk's last token is the next token of the same sequence (held elsewhere)
    assert b.labels.tolist() == (full0[4:7].tolist() + [full0[9], IGNORE_INDEX]
                                 + [full1[3], IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX])
    assert predicted_tokens(seqs) == 9 + 3


def test_manifest_token_ids_are_used_and_checked():
    ids = {0: [1, 2, 3, 4], 1: [5, 6]}
    src = TokenSource(vocab=10, tokens_fn=lambda i: ids[i])
    seqs = [Sequence(sample_id=0, length=4), Sequence(sample_id=1, length=2)]
    b = src.segments(seqs, [[0, 1, 4], [1, 0, 2]])
    assert b.tokens.tolist() == [2, 3, 4, 5, 6]
    assert b.labels.tolist() == [3, 4, IGNORE_INDEX, 6, IGNORE_INDEX]
    bad = TokenSource(vocab=4, tokens_fn=lambda i: ids[i])
    with pytest.raises(InputError, match=r"^sample 0: token id 4 is outside the model's vocabulary \(0\.\.3\)$"):
        bad.segments(seqs, [[0, 0, 4]])
    short = TokenSource(vocab=10, tokens_fn=lambda i: [1, 2])
    with pytest.raises(InputError, match=r"^sample 0: the manifest holds 2 token ids, the plan uses 4$"):
        short.segments(seqs, [[0, 0, 4]])


def test_reference_attention_matches_sdpa_gqa():
    torch.manual_seed(0)
    lens = [1, 7, 12]
    T = sum(lens)
    q, k, v = torch.randn(T, 6, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    out = reference_attention(q, k, v, lens)
    pos = 0
    for L in lens:
        qs = q[pos:pos + L].transpose(0, 1)[None]
        ks = k[pos:pos + L].repeat_interleave(3, dim=1).transpose(0, 1)[None]
        vs = v[pos:pos + L].repeat_interleave(3, dim=1).transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[pos:pos + L], ref, rtol=1e-5, atol=1e-6)
        pos += L


def test_rope_is_a_rotation_with_relative_scores():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    # scores depend only on the distance: (q at 5, k at 2) == (q at 103, k at 100)
    def score(pq, pk):
        cq, sq = rope_tables(torch.tensor([pq]), 16, 10000.0)
        ck, sk = rope_tables(torch.tensor([pk]), 16, 10000.0)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())
    assert math.isclose(score(5, 2), score(103, 100), rel_tol=1e-4)
    c, s = rope_tables(torch.tensor([7]), 16, 10000.0)
    assert math.isclose(float(apply_rope(q, c, s).norm()), float(q.norm()), rel_tol=1e-6)


def test_model_positions_restart_per_sequence_and_loss_is_token_mean():
    spec = model_preset("tiny")
    model = LlamaModel(spec, seed=0)
    src = TokenSource(spec.vocab_size, seed=2)
    seqs = [Sequence(sample_id=1, length=9), Sequence(sample_id=2, length=14)]
    ref = reference_step(model, seqs, src)
    # each sequence alone gives the same hidden states as packed with the other
    for i, s in enumerate(seqs):
        alone = reference_step(model, [s], src)
        torch.testing.assert_close(alone["hidden"][0], ref["hidden"][i], rtol=1e-5, atol=1e-6)
    # the loss is the mean token cross-entropy over predicted tokens, computed independently
    total, n = 0.0, 0
    for i, s in enumerate(seqs):
        ids = torch.from_numpy(synthetic_tokens(s.sample_id, 0, s.length, seed=2, vocab=spec.vocab_size))
        logits = F.linear(ref["hidden"][i], model.lm_head.detach())
        total += float(F.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
        n += s.length - 1
    assert math.isclose(ref["loss"], total / n, rel_tol=1e-6)
    assert abs(ref["loss"] - math.log(spec.vocab_size)) < 0.1  # fresh init: near-uniform predictions
    # every parameter receives a gradient
    assert set(ref["grads"]) == {n for n, _ in model.named_parameters()}
    assert all(float(g.abs().max()) > 0 for g in ref["grads"].values())


def test_init_is_deterministic_and_seeded():
    spec = model_preset("tiny")
    a, b, c = LlamaModel(spec, seed=5), LlamaModel(spec, seed=5), LlamaModel(spec, seed=6)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc)


def test_phase_timer_leaves_values_and_gradients_unchanged():
    spec = model_preset("tiny-mha")
    model = LlamaModel(spec, seed=0)
    src = TokenSource(spec.vocab_size, seed=0)
    seqs = [Sequence(sample_id=0, length=12), Sequence(sample_id=3, length=5)]
    batch = src.segments(seqs, [[0, 0, 12], [1, 0, 5]])
    toks, labels = torch.from_numpy(batch.tokens), torch.from_numpy(batch.labels)

    class CountingTimer(PhaseTimer):
        """A PhaseTimer that also keeps every span it adds."""

        def __init__(self) -> None:
            super().__init__()
            self.spans: dict[str, list[float]] = {}

        def add(self, name: str, dt: float) -> None:
            self.spans.setdefault(name, []).append(dt)
            super().add(name, dt)

    outs = []
    for timer in (None, CountingTimer()):
        model.zero_grad(set_to_none=True)
        loss, _ = model(toks, labels, ReferenceLayout([12, 5]), timer)
        loss.backward()
        outs.append((float(loss.detach()), [p.grad.clone() for p in model.parameters()], timer))
    assert outs[0][0] == outs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
    timer = outs[1][2]
    # per layer: the attention once forward and once backward; the (identity) remaps to and from the
    # attention layout twice each way; every span is a positive time and the totals are their sums
    n = spec.num_layers
    assert {k: len(v) for k, v in timer.spans.items()} == {"attention": 2 * n, "remap": 4 * n}
    assert all(dt > 0 for v in timer.spans.values() for dt in v)
    assert timer.totals == pytest.approx({k: sum(v) for k, v in timer.spans.items()}, rel=1e-12)
    assert not timer._open.get("attention") and not timer._open.get("remap")  # every span closed


def test_checkpoint_roundtrip_and_plan_mismatch(tmp_path):
    """A single-process DCP checkpoint: written atomically, read back into a fresh model and
    optimizer exactly; its JSON state is checked against the plan and the world size."""
    spec = model_preset("tiny")
    model = LlamaModel(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.1 * (i + 1))
    opt.step()
    assert latest_checkpoint(tmp_path) is None
    path = save_checkpoint(tmp_path, next_step=3, model=model, optimizer=opt, rng_states=[rng_state()] * 2,
                           plan_hash="sha256:aaaa", world_size=2, rank=0,
                           extra={"hyperparameters": {"lr": 1e-2, "weight_decay": 0.0, "seed": 0}})
    assert path.name == "ckpt-000003" and latest_checkpoint(tmp_path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000003", "latest"]  # no temp directory left
    st = read_checkpoint_state(path, plan_hash="sha256:aaaa", world_size=2)
    assert st["next_step"] == 3
    fresh = LlamaModel(spec, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint_tensors(path, fresh, fresh_opt)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
    assert torch.equal(fresh_opt.state[fresh.embed]["exp_avg"], opt.state[model.embed]["exp_avg"])
    with pytest.raises(InputError, match=r"checkpoint was written for another plan \(plan header sha256:aaaa, "
                                         r"this plan sha256:bbbb\)$"):
        read_checkpoint_state(path, plan_hash="sha256:bbbb", world_size=2)
    with pytest.raises(InputError, match=r"checkpoint was written by 2 ranks, this job has 4$"):
        read_checkpoint_state(path, plan_hash="sha256:aaaa", world_size=4)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "state.json").write_bytes(b"not a checkpoint")
    with pytest.raises(InputError, match=r"state\.json: checkpoint state: malformed JSON at line 1 column 1"):
        read_checkpoint_state(tmp_path / "junk", plan_hash="x", world_size=1)
