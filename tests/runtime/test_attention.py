"""Attention kernels and exact ring attention vs an independent float64 reference.

The multi-process cases share ONE spawned world of 8 gloo ranks (module fixture); a case with a
ring of G < 8 ranks leaves the other ranks idle.
"""

from __future__ import annotations

import pytest
import torch

from zeppelin.runtime.attn.blocks import attention_block, attention_block_backward
from zeppelin.runtime.attn.local import local_attention
from zeppelin.runtime.attn.merge import merge_partial
from zeppelin.runtime.attn.reference import reference_attention
from zeppelin.runtime.attn.ring import RingSpec, ring_attention
from zeppelin.runtime.attn.transport import Transport
from zeppelin.schemas.layout import contiguous_ranges, zigzag_ranges

from tests.support.numerics import max_abs_errs

HQ, HKV, D = 4, 2, 16


def _inputs(lens, seed=0, hq=HQ, hkv=HKV, d=D):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(t, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(t, hkv, d, generator=g, dtype=torch.float64)
    do = torch.randn(t, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _reference(lens, q, k, v, do):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v, _cu(lens))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return out.detach(), dq, dk, dv


def _naive_single(q, k, v, do, n):
    """Textbook causal attention of one sequence, written independently of the module."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.empty_like(q)
    rows = []
    for i in range(n):
        s = (q[i].unsqueeze(1) * kk[: i + 1].transpose(0, 1)).sum(-1) / q.shape[-1] ** 0.5  # [H, i+1]
        rows.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), vv[: i + 1]))
    out = torch.stack(rows, 0)
    return out.detach(), *torch.autograd.grad(out, (q, k, v), do)


# ---------------------------------------------------------------------------------------------
# single-process kernels
# ---------------------------------------------------------------------------------------------


def test_reference_matches_textbook_attention():
    q, k, v, do = _inputs([13])
    ref = _reference([13], q, k, v, do)
    naive = _naive_single(q, k, v, do, 13)
    for a, b in zip(ref, naive):
        assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)])
def test_local_attention_varlen(dtype, tol):
    lens = [10, 1, 26, 3]
    q, k, v, do = _inputs(lens)
    ref = _reference(lens, q, k, v, do)
    qq, kk, vv = (x.to(dtype).requires_grad_() for x in (q, k, v))
    out = local_attention(qq, kk, vv, torch.tensor(_cu(lens)))
    grads = torch.autograd.grad(out, (qq, kk, vv), do.to(dtype))
    assert out.dtype == dtype
    for got, want in zip((out, *grads), ref):
        assert (got.double() - want).abs().max().item() <= tol


def test_local_attention_rejects_bad_cu_seqlens():
    q, k, v, _ = _inputs([5])
    with pytest.raises(ValueError, match="does not partition 5 rows"):
        local_attention(q, k, v, [0, 3])


def test_blocks_merge_to_full_attention_including_partial_masks():
    # one sequence of 26 tokens; q and k cut differently so pairs are full / diag / masked / partial
    n = 26
    q, k, v, do = _inputs([n], seed=3)
    out_ref, dq_ref, dk_ref, dv_ref = _reference([n], q, k, v, do)
    qf, kf, vf, dof = (x.float() for x in (q, k, v, do))
    q_cuts, k_cuts = [(0, 5), (5, 13), (13, 26)], [(0, 7), (7, 13), (13, 20), (20, 26)]
    out = torch.zeros(n, HQ, D)
    lse = torch.full((HQ, n), float("-inf"))
    for qs, qe in q_cuts:
        for ks, ke in k_cuts:
            o, l_ = attention_block(qf[qs:qe], kf[ks:ke], vf[ks:ke], (qs, qe), (ks, ke))
            merge_partial(out[qs:qe], lse[:, qs:qe], o, l_)
    assert (out.double() - out_ref).abs().max() <= 1e-6
    # lse equals the log-sum-exp of the masked scores (independent computation)
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(HQ // HKV, 1)) / D**0.5
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max() <= 1e-5
    dq, dk, dv = torch.zeros(n, HQ, D), torch.zeros(n, HKV, D), torch.zeros(n, HKV, D)
    for qs, qe in q_cuts:
        for ks, ke in k_cuts:
            a, b, c = attention_block_backward(
                dof[qs:qe], qf[qs:qe], kf[ks:ke], vf[ks:ke], out[qs:qe], lse[:, qs:qe], (qs, qe), (ks, ke)
            )
            dq[qs:qe] += a
            dk[ks:ke] += b
            dv[ks:ke] += c
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert (got.double() - want).abs().max() <= 1e-5


def test_fully_masked_block_is_neutral_in_merge():
    q, k, v, _ = _inputs([8])
    o, l_ = attention_block(q[:4].float(), k[4:].float(), v[4:].float(), (0, 4), (4, 8))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isinf(l_).all()
    acc = torch.randn(4, HQ, D)
    lse = torch.randn(HQ, 4)
    before = acc.clone(), lse.clone()
    merge_partial(acc, lse, o, l_)
    assert torch.equal(acc, before[0]) and torch.equal(lse, before[1])


# ---------------------------------------------------------------------------------------------
# multi-process ring attention
# ---------------------------------------------------------------------------------------------


def _ring_case(rank, world, ring_ranks, lens, layout, dtype, seed, routes, nodes_of):
    if rank not in ring_ranks:
        return None
    g = len(ring_ranks)
    pos = ring_ranks.index(rank)
    q, k, v, do = _inputs(lens, seed=seed)
    seqs = [(zigzag_ranges if layout == "zigzag" else contiguous_ranges)(n, g) for n in lens]
    offs = _cu(lens)
    rows = [i for si, s in enumerate(seqs) for b, e in s[pos] for i in range(offs[si] + b, offs[si] + e)]
    idx = torch.tensor(rows, dtype=torch.long)
    spec = RingSpec(ranks=list(ring_ranks), pos=pos, seqs=seqs)
    tr = Transport(node_of=(lambda r: nodes_of[r]) if nodes_of else None, routes=routes)
    ql, kl, vl = (x[idx].to(dtype).requires_grad_() for x in (q, k, v))
    out = ring_attention(ql, kl, vl, spec, tr)
    grads = torch.autograd.grad(out, (ql, kl, vl), do[idx].to(dtype))
    return {"rows": idx, "out": out.detach(), "grads": [x.detach() for x in grads], "stats": dict(tr.stats)}


def _run_ring(
    pool, ring_ranks, lens, layout="zigzag", dtype=torch.float32, seed=0, routes=None, nodes_of=None
):
    res = pool.run(_ring_case, list(ring_ranks), lens, layout, dtype, seed, routes, nodes_of, timeout=120)
    q, k, v, do = _inputs(lens, seed=seed)
    t = sum(lens)
    out = torch.full((t, HQ, D), float("nan"), dtype=torch.float64)
    dq = torch.full_like(out, float("nan"))
    dk = torch.full((t, HKV, D), float("nan"), dtype=torch.float64)
    dv = torch.full_like(dk, float("nan"))
    for r in res:
        if r is None:
            continue
        i = r["rows"]
        out[i], dq[i], dk[i], dv[i] = (x.double() for x in (r["out"], *r["grads"]))
    return (out, dq, dk, dv), _reference(lens, q, k, v, do), res


WORLD = 8  # ranks of the module's process pool (the `pool` fixture of tests/conftest.py)

# sequence lengths not divisible by 2G, one shorter than 2G (empty chunks), several per ring
RING_CASES = [
    ([0, 1], [37, 5, 64]),
    ([0, 1, 2], [29, 4, 50]),
    ([3, 1, 0, 2], [45, 7, 33]),  # ring order differs from rank order
    (list(range(8)), [61, 9, 100]),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ring_ranks,lens", RING_CASES, ids=[f"G{len(r)}" for r, _ in RING_CASES])
def test_ring_attention_fp32_exact(pool, ring_ranks, lens):
    got, ref, _ = _run_ring(pool, ring_ranks, lens)
    assert not any(torch.isnan(x).any() for x in got), "some rows were not produced"
    errs = max_abs_errs(got, ref)
    assert max(errs) <= 1e-5, errs


@pytest.mark.timeout(120)
def test_ring_attention_contiguous_layout_and_mha(pool):
    # contiguous ranges (partially visible pairs are never produced, but later chunks see all earlier)
    got, ref, _ = _run_ring(pool, [0, 1, 2], [23, 40], layout="contiguous", seed=5)
    assert max(max_abs_errs(got, ref)) <= 1e-5


@pytest.mark.timeout(240)
def test_ring_attention_bf16_error_does_not_grow_with_ring_size(pool):
    lens = [96, 21, 57]
    q, k, v, do = _inputs(lens, seed=7)
    ref = _reference(lens, q, k, v, do)
    # single-process bf16 attention: the tolerance bf16 itself allows
    qq, kk, vv = (x.to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    o = local_attention(qq, kk, vv, _cu(lens))
    base = max_abs_errs(
        (
            o.detach().double(),
            *(g.double() for g in torch.autograd.grad(o, (qq, kk, vv), do.to(torch.bfloat16))),
        ),
        ref,
    )
    errs = {}
    for g in (2, 4, 8):
        got, _, _ = _run_ring(pool, list(range(g)), lens, dtype=torch.bfloat16, seed=7)
        errs[g] = max_abs_errs(got, ref)
        for e, b in zip(errs[g], base):
            assert e <= 2.0 * b + 1e-3, (g, errs[g], base)
    # no growth with the ring: G=8 is within 1.5x of G=2 for out and every gradient
    for e8, e2 in zip(errs[8], errs[2]):
        assert e8 <= 1.5 * e2 + 1e-3, errs


@pytest.mark.timeout(120)
def test_routed_ring_equals_direct_and_counts_bytes(pool):
    # 4 ranks, "nodes" {0,1} {2,3}; ring 0->1->2->3->0; inter transfers 1->2 and 3->0
    nodes_of = {r: r // 2 for r in range(8)}
    lens = [41, 6, 30]
    direct, ref, res_d = _run_ring(pool, [0, 1, 2, 3], lens, seed=11, nodes_of=nodes_of)
    routes = {
        (1, 2): [(1, 2, 3), (0, 3, 5)],  # direct path + dispatch 1->0, transfer 0->3, combine 3->2
        (3, 0): [(2, 1, 1)],  # all through proxies: 3->2, 2->1, 1->0
    }
    routed, _, res_r = _run_ring(pool, [0, 1, 2, 3], lens, seed=11, routes=routes, nodes_of=nodes_of)
    for a, b in zip(direct, routed):
        assert torch.equal(a, b)
    assert max(max_abs_errs(routed, ref)) <= 1e-5
    # bytes: the same total crosses nodes, but routing moves part of it onto proxies' links
    inter_d = sum(r["stats"]["inter"] for r in res_d if r)
    inter_r = sum(r["stats"]["inter"] for r in res_r if r)
    assert inter_d == inter_r > 0
    assert res_d[1]["stats"]["inter"] > res_r[1]["stats"]["inter"] > 0  # rank 1 offloads 5/8 to proxy 0
    assert res_d[0]["stats"]["inter"] == 0 < res_r[0]["stats"]["inter"]  # proxy 0 carries 1->2 traffic
    assert res_r[3]["stats"]["inter"] == 0 and res_r[2]["stats"]["inter"] > 0  # 3->0 leaves via proxy 2


def test_math_path_tiles_exactly(monkeypatch):
    # the float32 math kernel (the reference; partial masks; CUDA float32) computes in
    # query tiles; a tiny tile budget must give the same results as one tile
    import zeppelin.runtime.kernels as kern

    q, k, v, do = (x.float() for x in _inputs([29], seed=4))
    mask = torch.ones(29, 29, dtype=torch.bool).tril()
    whole = kern.math_forward(q, k, v, mask, 0.25)
    gwhole = kern.math_backward(do, q, k, v, whole[0], whole[1], mask, 0.25)
    monkeypatch.setattr(kern, "MATH_TILE_ELEMENTS", 29 * HQ * 3)  # 3 query rows per tile
    assert len(list(kern._q_tiles(29, 29, HQ))) == 10
    tiled = kern.math_forward(q, k, v, mask, 0.25)
    gtiled = kern.math_backward(do, q, k, v, tiled[0], tiled[1], mask, 0.25)
    for a, b in zip((*whole, *gwhole), (*tiled, *gtiled)):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    ref = _reference([29], *(x.double() for x in (q, k, v, do)))
    # scale 0.25 == 1/sqrt(16): the math kernel agrees with the reference
    for got, want in zip((tiled[0], *gtiled), ref):
        assert (got.double() - want).abs().max() <= 1e-5
