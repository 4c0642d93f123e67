"""The ``--verify`` reference is exact and memory-bounded; peak memory is measured per step.

* :func:`zeppelin.runtime.model.reference_attention` (tiled, recomputing) against float64 autograd
  attention with an explicit softmax, forward and gradients, GQA and several sequences, with tiles
  small enough that every sequence is cut into many;
* :func:`zeppelin.runtime.model.reference_step` never materialises a score matrix larger than its
  tile budget (every tensor created during the step is recorded), and matches the same model run
  un-checkpointed through plain attention;
* :class:`zeppelin.runtime.memory.StepMemory` reports a step's own high-water mark, not the
  process's lifetime peak.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeppelin.runtime import model as zmodel
from zeppelin.runtime.data import TokenSource, predicted_tokens
from zeppelin.runtime.memory import StepMemory
from zeppelin.runtime.model import Layout, LlamaModel, reference_attention, reference_step
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Sequence


def _naive(q, k, v, lengths):
    rep = q.shape[1] // k.shape[1]
    outs, pos = [], 0
    for L in lengths:
        qs = q[pos:pos + L].transpose(0, 1)
        ks = k[pos:pos + L].repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[pos:pos + L].repeat_interleave(rep, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[2])
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
        pos += L
    return torch.cat(outs)


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "fused"])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2)])
def test_reference_attention_matches_float64(hq, hkv, tiled):
    g = torch.Generator().manual_seed(0)
    lengths = [37, 1, 120, 64]
    T, d = sum(lengths), 16
    q, k, v, do = (torch.randn(T, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    want = _naive(*(x.requires_grad_() for x in (q, k, v)), lengths)
    gw = torch.autograd.grad(want, (q, k, v), do)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    # tiles of a few rows: every long sequence is cut into many
    out = reference_attention(q32, k32, v32, lengths, tile_scores=hq * 128 * 5, tiled=tiled)
    got = torch.autograd.grad(out, (q32, k32, v32), do.float())
    assert (out.double() - want).abs().max() <= 1e-5
    for a, b in zip(got, gw):
        assert (a.double() - b).abs().max() <= 2e-5 * max(1.0, b.abs().max().item())
    # float64 inputs are computed in float64
    out64 = reference_attention(q.detach(), k.detach(), v.detach(), lengths, tile_scores=64, tiled=tiled)
    assert (out64 - want).abs().max() <= 1e-12


class _Largest(TorchDispatchMode):
    """The largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


class _PlainLayout(Layout):
    def __init__(self, lengths):
        self.lengths = lengths
        self.attn_positions = torch.cat([torch.arange(L) for L in lengths])

    def attention(self, q, k, v):
        return _naive(q, k, v, self.lengths).to(q.dtype)


def test_reference_step_is_exact_and_never_holds_a_score_matrix(monkeypatch):
    spec = model_preset("tiny")  # 4 query heads, hidden 64, FFN 176, vocabulary 256
    model = LlamaModel(spec, seed=0)
    src = TokenSource(spec.vocab_size, 0)
    seqs = [Sequence(sample_id=i, length=L) for i, L in enumerate([700, 33, 5])]
    budget = 4 * 700 * 8  # 8 query rows of the longest sequence per tile
    monkeypatch.setattr(zmodel, "REFERENCE_TILE_SCORES", budget)
    monkeypatch.setattr(zmodel, "REFERENCE_LOSS_ROWS", 256)
    mode = _Largest()
    with mode:
        ref = reference_step(model, seqs, src)
    scores = spec.num_heads * 700 * 700
    # nothing near one sequence's score matrix: at most a tile, or one activation of the step
    assert mode.largest <= max(budget, sum(s.length for s in seqs) * spec.ffn_hidden), mode.largest
    assert mode.largest < scores / 10
    # the same model, un-checkpointed, plain attention, one cross-entropy
    lengths = [s.length for s in seqs]
    batch = src.segments(seqs, [[i, 0, L] for i, L in enumerate(lengths)])
    tokens, labels = torch.from_numpy(batch.tokens), torch.from_numpy(batch.labels)
    loss_sum, h = model(tokens, labels, _PlainLayout(lengths))
    loss = loss_sum / predicted_tokens(seqs)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert abs(ref["loss"] - float(loss.detach())) <= 1e-6 * abs(float(loss.detach()))
    for (name, _), g in zip(model.named_parameters(), grads):
        r = ref["grads"][name]
        assert (r - g).norm() <= 1e-5 * g.norm(), name
    assert torch.allclose(torch.cat([ref["hidden"][i] for i in range(3)]), h.detach(), atol=1e-5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM / clear_refs are Linux")
def test_step_memory_is_the_steps_own_peak():
    mem = StepMemory(torch.device("cpu"))
    mem.reset()
    big = np.ones(40_000_000)  # 320 MB
    first = mem.peak()
    del big
    mem.reset()
    small = np.ones(1_000_000)
    second = mem.peak()
    del small
    assert mem.source == "vmhwm"
    assert first - second >= 250e6, (first, second)
