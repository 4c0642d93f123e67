"""Sliding-window attention: local varlen, chunk-pair blocks and rings against transformers' own
eager attention with its sliding-window mask (float64 reference), and the ring's skipped work:
blocks wholly outside the window are never computed and their K/V never sent.

The multi-process cases share one world of 4 gloo ranks (module fixture).
"""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_attention import _inputs
from tests.support.numerics import max_abs_errs
from zeppelin.runtime.attn import blocks as _blocks
from zeppelin.runtime.attn.blocks import block_kind
from zeppelin.runtime.attn.local import local_attention
from zeppelin.runtime.attn.ring import RingSpec, ring_attention
from zeppelin.runtime.attn.transport import Transport
from zeppelin.schemas.layout import contiguous_ranges, zigzag_ranges

WORLD = 4
HQ, HKV, D = 4, 2, 16  # the shapes of test_attention's _inputs


def hf_sliding_reference(q, k, v, do, lens, window):
    """transformers' eager attention (Mistral's) with transformers' sliding-window causal mask,
    one sequence at a time: ``(out, dq, dk, dv)``."""
    from types import SimpleNamespace

    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay
    from transformers.models.mistral.modeling_mistral import eager_attention_forward

    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    module = SimpleNamespace(num_key_value_groups=HQ // HKV, training=False)
    visible = and_masks(causal_mask_function, sliding_window_overlay(window))
    outs, pos = [], 0
    for n in lens:
        i = torch.arange(n)
        m = visible(0, 0, i[:, None], i[None, :])
        bias = torch.zeros(n, n, dtype=q.dtype).masked_fill(~m, torch.finfo(q.dtype).min)[None, None]
        sl = slice(pos, pos + n)
        o, _ = eager_attention_forward(module, q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None],
                                       v[sl].transpose(0, 1)[None], bias, scaling=D ** -0.5, dropout=0.0)
        outs.append(o[0])
        pos += n
    out = torch.cat(outs, 0)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


def test_block_kind_with_window():
    # queries 8..12 over keys 0..4, window 4: q - 4 < k needs k > 4: nothing visible
    assert block_kind((8, 12), (0, 4), 4) == "skip"
    assert block_kind((8, 12), (0, 4), None) == "full"
    assert block_kind((8, 12), (4, 8), 4) == "mask"  # the window cuts the pair
    assert block_kind((8, 12), (6, 8), 8) == "full"  # every key inside every query's window
    assert block_kind((0, 8), (0, 8), 8) == "diag"
    assert block_kind((0, 9), (0, 9), 8) == "mask"


@pytest.mark.parametrize("window", [1, 5, 16])
def test_local_windowed_matches_transformers(window):
    lens = [37, 5, 64]
    q, k, v, do = _inputs(lens, seed=3)
    ref = hf_sliding_reference(q, k, v, do, lens, window)
    ql, kl, vl = (x.float().requires_grad_() for x in (q, k, v))
    cu = [0, 37, 42, 106]
    out = local_attention(ql, kl, vl, cu, window=window)
    got = (out.detach(), *torch.autograd.grad(out, (ql, kl, vl), do.float()))
    assert max(max_abs_errs(got, ref)) <= 1e-5


def _ring_case(rank, world, lens, layout, window, seed):
    q, k, v, do = _inputs(lens, seed=seed)
    seqs = [(zigzag_ranges if layout == "zigzag" else contiguous_ranges)(n, world) for n in lens]
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    rows = [i for si, s in enumerate(seqs) for b, e in s[rank] for i in range(offs[si] + b, offs[si] + e)]
    idx = torch.tensor(rows, dtype=torch.long)
    spec = RingSpec(ranks=list(range(world)), pos=rank, seqs=seqs, window=window)
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = _blocks.attention_block, _blocks.attention_block_backward
    import zeppelin.runtime.attn.ring as ring_mod

    def count_fwd(*a, **kw):
        calls["forward"] += 1
        return fwd(*a, **kw)

    def count_bwd(*a, **kw):
        calls["backward"] += 1
        return bwd(*a, **kw)

    ring_mod.attention_block, ring_mod.attention_block_backward = count_fwd, count_bwd
    try:
        tr = Transport()
        ql, kl, vl = (x[idx].float().requires_grad_() for x in (q, k, v))
        out = ring_attention(ql, kl, vl, spec, tr)
        grads = torch.autograd.grad(out, (ql, kl, vl), do[idx].float())
    finally:
        ring_mod.attention_block, ring_mod.attention_block_backward = fwd, bwd
    return {"rows": idx, "out": out.detach(), "grads": [x.detach() for x in grads], "messages": tr.stats["messages"],
            "calls": calls}


def _run(pool, lens, layout, window, seed=0):
    res = pool.run(_ring_case, lens, layout, window, seed, timeout=120)
    t = sum(lens)
    out = torch.full((t, HQ, D), float("nan"), dtype=torch.float64)
    dq = torch.full_like(out, float("nan"))
    dk = torch.full((t, HKV, D), float("nan"), dtype=torch.float64)
    dv = torch.full_like(dk, float("nan"))
    for r in res:
        i = r["rows"]
        out[i], dq[i], dk[i], dv[i] = (x.double() for x in (r["out"], *r["grads"]))
    return (out, dq, dk, dv), res


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("window", [7, 24])
def test_windowed_ring_matches_transformers_eager(pool, layout, window):
    # sequences several windows long split over 4 ranks, one shorter than the window, GQA 4:2
    lens = [150, 23, 97]
    got, _ = _run(pool, lens, layout, window, seed=window)
    q, k, v, do = _inputs(lens, seed=window)
    ref = hf_sliding_reference(q, k, v, do, lens, window)
    assert not any(torch.isnan(x).any() for x in got), "some rows were not produced"
    errs = max_abs_errs(got, ref)
    assert max(errs) <= 1e-5, errs


@pytest.mark.timeout(240)
def test_windowed_ring_skips_blocks_and_exchanges(pool):
    # one sequence of 160 tokens, contiguous quarters of 40 >= window 16: each position needs only
    # its predecessor's K/V. Forward: 3 K/V sends (position 3's block reaches nobody); backward:
    # the same 3 K/V sends and 3 dK/dV returns; the full ring sends 4 x 3 forward, 4 x 3 + 4 x 4 backward.
    _, win = _run(pool, [160], "contiguous", 16)
    _, full = _run(pool, [160], "contiguous", None)
    assert sum(r["messages"] for r in win) == 3 + 3 + 3
    assert sum(r["messages"] for r in full) == 12 + 12 + 16
    # kernel calls: position 0 its diagonal only, the others the diagonal and the predecessor's block
    assert [r["calls"]["forward"] for r in win] == [1, 2, 2, 2]
    assert [r["calls"]["backward"] for r in win] == [1, 2, 2, 2]
    assert [r["calls"]["forward"] for r in full] == [1, 2, 3, 4]


def _ulysses_case(rank, world, lens, window, seed):
    import torch.distributed as dist

    from zeppelin.runtime.attn.ulysses import UlyssesSpec, ulysses_attention

    q, k, v, do = _inputs(lens, seed=seed)
    seqs = [contiguous_ranges(n, world) for n in lens]
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    rows = [i for si, s in enumerate(seqs) for b, e in s[rank] for i in range(offs[si] + b, offs[si] + e)]
    idx = torch.tensor(rows, dtype=torch.long)
    spec = UlyssesSpec(ranks=list(range(world)), pos=rank, seqs=seqs)
    ql, kl, vl = (x[idx].float().requires_grad_() for x in (q, k, v))
    out = ulysses_attention(ql, kl, vl, spec, group=dist.group.WORLD, window=window)
    grads = torch.autograd.grad(out, (ql, kl, vl), do[idx].float())
    return {"rows": idx, "out": out.detach(), "grads": [x.detach() for x in grads]}


@pytest.mark.timeout(240)
def test_windowed_ulysses_matches_transformers_eager(pool):
    lens, window = [150, 23, 97], 11
    res = pool.run(_ulysses_case, lens, window, 5, timeout=120)
    q, k, v, do = _inputs(lens, seed=5)
    ref = hf_sliding_reference(q, k, v, do, lens, window)
    got = [torch.full_like(x, float("nan")) for x in ref]
    for r in res:
        for g, x in zip(got, (r["out"], *r["grads"])):
            g[r["rows"]] = x.double()
    assert max(max_abs_errs(got, ref)) <= 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_window_kernels_match_the_banded_path(dtype):
    """flash-attn's / PyTorch's flash window arguments (local varlen and a windowed diagonal pair)
    against the float32 banded path, forward and backward."""
    lens, window = [300, 7, 129], 64
    q, k, v, do = (x.float() for x in _inputs(lens, seed=9))
    cu = [0, 300, 307, 436]
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = local_attention(*ref_in, cu, window=window)
    ref_g = torch.autograd.grad(ref, ref_in, do)
    dev = [x.cuda().to(dtype).requires_grad_() for x in (q, k, v)]
    out = local_attention(*dev, cu, window=window)
    g = torch.autograd.grad(out, dev, do.cuda().to(dtype))
    errs = max_abs_errs([out.float().cpu(), *(x.float().cpu() for x in g)], [ref, *ref_g])
    assert max(errs) <= (3e-2 if dtype == torch.bfloat16 else 5e-3), errs
    qd, kd, vd = (x.cuda().to(dtype) for x in (q[:300], k[:300], v[:300]))
    o, _ = _blocks.attention_block(qd, kd, vd, (0, 300), (0, 300), window=window)
    assert max_abs_errs([o.float().cpu()], [ref[:300].detach()])[0] <= 3e-2
