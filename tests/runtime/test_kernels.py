"""Kernel dispatch (runtime/kernels.py): the table, every path against the math reference and a
float64 ground truth, one varlen call per rank, no host syncs on the hot path, GQA accuracy in
bf16, and the GPU benchmark's refusal without CUDA.

The CUDA kernels cannot run here: their Python glue (layouts, cumulative lengths, log-sum-exp
formats, GQA folding) runs on CPU against fakes that implement each aten/flash-attn op's
documented contract with the float32 math kernel; the real kernels run in the ``gpu`` tests.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeppelin.runtime.kernels as kern
from zeppelin.runtime.attn.blocks import attention_block, attention_block_backward
from zeppelin.runtime.attn.local import LocalPack, local_attention
from zeppelin.runtime.attn.merge import merge_partial
from zeppelin.runtime.attn.reference import reference_attention
from zeppelin.runtime.attn.ring import RingSpec, ring_backward, ring_forward
from zeppelin.runtime.attn.transport import Transport
from zeppelin.runtime.engine import local_sequences

from tests.support.numerics import max_abs_errs

WORLD = 4  # ranks of the module's process pool (the `pool` fixture of tests/conftest.py)
ROOT = Path(__file__).resolve().parents[2]
HQ, HKV, D = 4, 2, 16


def _inputs(lens, seed=0, hq=HQ, hkv=HKV, d=D, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return tuple(torch.randn(t, h, d, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hkv, hkv, hq))


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _reference(lens, q, k, v, do):
    q, k, v = (x.double().clone().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v, _cu(lens))
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do.double()))


# ---------------------------------------------------------------------------------------------
# fakes of the CUDA kernels' contracts (CPU, float32 math inside)
# ---------------------------------------------------------------------------------------------


def _seq_mask(lq, lk, causal, bottom_right, device):
    if not causal:
        return None
    shift = lk - lq if bottom_right else 0
    return torch.arange(lk, device=device).unsqueeze(0) <= torch.arange(lq, device=device).unsqueeze(1) + shift


class Fakes:
    """aten ``_flash_attention_forward/_backward`` (varlen form), ``_efficient_attention_forward/
    _backward`` (cu_seqlens form) and flash-attn's ``_flash_attn_varlen_forward/_backward``, as
    their contracts state them; counts calls; checks the argument formats the kernels require."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.log: list[tuple[str, tuple[int, ...]]] = []  # (op, sequence lengths) of aten flash calls

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def _spans(self, cu):
        assert cu.dtype == torch.int32 and cu.dim() == 1
        b = cu.tolist()
        return list(itertools.pairwise(b))

    def _varlen_fwd(self, q, k, v, cu_q, cu_k, causal, scale, bottom_right):
        out = torch.zeros_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        for (qs, qe), (ks, ke) in zip(self._spans(cu_q), self._spans(cu_k)):
            if qe == qs:
                continue
            m = _seq_mask(qe - qs, ke - ks, causal, bottom_right, q.device)
            o, l_ = kern.math_forward(q[qs:qe], k[ks:ke], v[ks:ke], m, scale)
            out[qs:qe], lse[:, qs:qe] = o.to(q.dtype), l_
        return out, lse

    def _varlen_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, causal, scale, bottom_right):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (qs, qe), (ks, ke) in zip(self._spans(cu_q), self._spans(cu_k)):
            if qe == qs:
                continue
            m = _seq_mask(qe - qs, ke - ks, causal, bottom_right, q.device)
            a, b, c = kern.math_backward(dout[qs:qe], q[qs:qe], k[ks:ke], v[ks:ke], out[qs:qe], lse[:, qs:qe], m, scale)
            dq[qs:qe], dk[ks:ke], dv[ks:ke] = a.to(q.dtype), b.to(k.dtype), c.to(v.dtype)
        return dq, dk, dv

    # aten flash (varlen): lse [H, total_q]; FA2's causal mask is aligned bottom-right
    def aten_flash_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                       scale=None):
        self._count("aten_flash_fwd")
        self.log.append(("fwd", tuple(e - s for s, e in self._spans(cu_q))))
        assert q.dim() == 3 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and dropout_p == 0.0
        assert max_q == max(e - s for s, e in self._spans(cu_q))
        assert all(e > s for s, e in self._spans(cu_q)), "an empty sequence reached the kernel"
        out, lse = self._varlen_fwd(q, k, v, cu_q, cu_k, is_causal, scale, True)
        return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)

    def aten_flash_bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused,
                       *, scale=None):
        self._count("aten_flash_bwd")
        self.log.append(("bwd", tuple(e - s for s, e in self._spans(cu_q))))
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert out.dtype == dout.dtype == q.dtype and rng.dtype == torch.uint64
        return self._varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, is_causal, scale, True)

    # aten memory-efficient (cu_seqlens): BMHK with B=1, no GQA, lse [nseq, H, pad32(max_q)]
    def eff_fwd(self, q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type, compute_lse, *, scale=None):
        self._count("eff_fwd")
        assert q.dim() == 4 and q.shape[0] == 1 and k.shape[2] == q.shape[2] and bias is None and compute_lse
        spans = self._spans(cu_q)
        out, flat = self._varlen_fwd(q[0], k[0], v[0], cu_q, cu_k, mask_type == 1, scale, False)
        pad = -(-max_q // 32) * 32
        lse = torch.full((len(spans), q.shape[2], pad), float("inf"))
        for i, (s, e) in enumerate(spans):
            lse[i, :, : e - s] = flat[:, s:e]
        return out.unsqueeze(0), lse, torch.empty(()), torch.empty(()), max_q, max_k

    def eff_bwd(self, dout, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, lse, dropout_p, seed, offset, mask_type,
                bias_requires_grad, *, scale=None):
        self._count("eff_bwd")
        spans = self._spans(cu_q)
        assert lse.shape == (len(spans), q.shape[2], -(-max_q // 32) * 32) and k.shape[2] == q.shape[2]
        flat = torch.empty((q.shape[2], q.shape[1]), dtype=torch.float32)
        for i, (s, e) in enumerate(spans):
            flat[:, s:e] = lse[i, :, : e - s]
        dq, dk, dv = self._varlen_bwd(dout[0], q[0], k[0], v[0], out[0], flat, cu_q, cu_k, mask_type == 1, scale,
                                      False)
        return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0), torch.empty(0)

    # flash-attn >= 2.6 keyword API
    def fa_fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size_left=-1,
               window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
        self._count("fa_fwd")
        out, lse = self._varlen_fwd(q, k, v, cu_q, cu_k, causal, softmax_scale, True)
        return out, lse, None, torch.zeros(2, dtype=torch.int64)

    def fa_bwd(self, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale,
               causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
               zero_tensors=False):
        self._count("fa_bwd")
        a, b, c = self._varlen_bwd(dout, q, k, v, out, softmax_lse, cu_q, cu_k, causal, softmax_scale, True)
        dq.copy_(a)
        dk.copy_(b)
        dv.copy_(c)
        return torch.empty(0)


@pytest.fixture
def fakes(monkeypatch):
    """Route every fused-kernel entry point to :class:`Fakes` (the CPU op stays real)."""
    f = Fakes()
    real = kern._ops()
    ops = dict(real)
    ops.update(flash_fwd=f.aten_flash_fwd, flash_bwd=f.aten_flash_bwd, eff_fwd=f.eff_fwd, eff_bwd=f.eff_bwd)
    monkeypatch.setattr(kern, "_ops", lambda: ops)
    monkeypatch.setattr(kern, "_flash_attn_fns", lambda: (f.fa_fwd, f.fa_bwd, True))
    return f


def _force(monkeypatch, kernel):
    """Dispatch every non-mask block and varlen pack to ``kernel`` (as a CUDA device would)."""
    real = kern.choose
    monkeypatch.setattr(kern, "choose", lambda dev, dt, kind, d: "math" if kind == "mask" else kernel)
    return real


# ---------------------------------------------------------------------------------------------
# the dispatch table
# ---------------------------------------------------------------------------------------------

H100 = kern.CudaCaps(capability=(9, 0), flash_attn=True, aten_flash=True, aten_efficient=True)
H100_NO_FA = kern.CudaCaps(capability=(9, 0), flash_attn=False, aten_flash=True, aten_efficient=True)
V100 = kern.CudaCaps(capability=(7, 0), flash_attn=False, aten_flash=False, aten_efficient=True)
NO_SDPA = kern.CudaCaps(capability=(8, 0), flash_attn=False, aten_flash=False, aten_efficient=False)
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32

TABLE = [
    # caps, device, dtype, kind, head_dim -> kernel
    (H100, "cuda", bf16, "diag", 128, "flash_attn"),
    (H100, "cuda", bf16, "full", 64, "flash_attn"),
    (H100, "cuda", fp16, "varlen", 128, "flash_attn"),
    (H100, "cuda", bf16, "mask", 128, "math"),
    (H100, "cuda", fp32, "diag", 128, "math"),
    (H100, "cuda", bf16, "diag", 100, "math"),  # D % 8 != 0: no fused kernel takes it as is
    (H100, "cuda", bf16, "diag", 512, "math"),
    (H100_NO_FA, "cuda", bf16, "diag", 128, "aten_flash"),
    (H100_NO_FA, "cuda", bf16, "varlen", 128, "aten_flash"),
    (V100, "cuda", fp16, "full", 64, "aten_efficient"),
    (V100, "cuda", fp16, "varlen", 64, "aten_efficient"),
    (V100, "cuda", bf16, "varlen", 64, "math"),  # bf16 needs sm80
    (NO_SDPA, "cuda", bf16, "diag", 64, "math"),
    (None, "cpu", bf16, "diag", 64, "cpu_flash"),
    (None, "cpu", fp32, "varlen", 64, "cpu_flash"),
    (None, "cpu", torch.float64, "full", 64, "cpu_flash"),
    (None, "cpu", fp32, "mask", 64, "math"),
    (None, "meta", bf16, "diag", 64, "math"),
]


@pytest.mark.parametrize("caps,device,dtype,kind,d,want", TABLE)
def test_dispatch_table(monkeypatch, caps, device, dtype, kind, d, want):
    def fake_caps(dev):
        assert dev.type == "cuda"
        return caps

    monkeypatch.setattr(kern, "cuda_caps", fake_caps)
    assert kern.choose(torch.device(device), dtype, kind, d) == want
    assert kern.has_varlen(torch.device(device), dtype, d) == (
        kern.choose(torch.device(device), dtype, "varlen", d) in ("flash_attn", "aten_flash", "aten_efficient")
    )


def test_dispatch_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown block kind 'band'"):
        kern.choose(torch.device("cpu"), fp32, "band", 16)


def test_flash_attn_older_than_2_6_is_not_used(monkeypatch):
    import types

    def old_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, return_softmax, block_table):
        raise AssertionError("not called")

    mod = types.ModuleType("flash_attn.flash_attn_interface")
    mod._flash_attn_varlen_forward = old_fwd
    mod._flash_attn_varlen_backward = Fakes().fa_bwd
    pkg = types.ModuleType("flash_attn")
    pkg.flash_attn_interface = mod
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", mod)
    kern._flash_attn_fns.cache_clear()
    try:
        assert kern._flash_attn_fns() is None
        mod._flash_attn_varlen_forward = Fakes().fa_fwd
        kern._flash_attn_fns.cache_clear()
        fns = kern._flash_attn_fns()
        assert fns == (mod._flash_attn_varlen_forward, mod._flash_attn_varlen_backward, True)  # bwd takes softcap

        class CustomOp:  # flash-attn >= 2.7 wraps its entry points in torch.library.custom_op
            def __init__(self, fn):
                self._init_fn = fn

            def __call__(self, *a, **kw):
                return self._init_fn(*a, **kw)

        mod._flash_attn_varlen_forward = CustomOp(Fakes().fa_fwd)
        kern._flash_attn_fns.cache_clear()
        assert kern._flash_attn_fns() == (mod._flash_attn_varlen_forward, mod._flash_attn_varlen_backward, True)
    finally:
        kern._flash_attn_fns.cache_clear()


# the positional arguments runtime/kernels.py passes to each aten op, in order, then its keywords
ATEN_CALLS = {
    "_flash_attention_forward": (["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                                  "is_causal", "return_debug_mask"], ["scale"]),
    "_flash_attention_backward": (["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
                                   "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused"], ["scale"]),
    "_efficient_attention_forward": (["query", "key", "value", "bias", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                      "max_seqlen_k", "dropout_p", "custom_mask_type", "compute_log_sumexp"],
                                     ["scale"]),
    "_efficient_attention_backward": (["grad_out_", "query", "key", "value", "bias", "out", "cu_seqlens_q",
                                       "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "logsumexp", "dropout_p",
                                       "philox_seed", "philox_offset", "custom_mask_type", "bias_requires_grad"],
                                      ["scale"]),
    "_scaled_dot_product_flash_attention_for_cpu": (["query", "key", "value", "dropout_p", "is_causal"], ["scale"]),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (["grad_out", "query", "key", "value", "out",
                                                              "logsumexp", "dropout_p", "is_causal"], ["scale"]),
}


@pytest.mark.parametrize("op", sorted(ATEN_CALLS))
def test_aten_op_schemas_match_the_calls(op):
    """The installed torch's schema of every aten op the dispatch calls: the positional arguments
    in the order the glue passes them, then the keywords it uses; every other argument optional."""
    schema = getattr(torch.ops.aten, op).default._schema
    positional, keywords = ATEN_CALLS[op]
    args = schema.arguments
    assert [a.name for a in args[: len(positional)]] == positional
    assert all(not a.kwarg_only for a in args[: len(positional)])
    rest = {a.name: a for a in args[len(positional):]}
    for kw in keywords:
        assert kw in rest and rest[kw].kwarg_only
    assert all(a.has_default_value() for n, a in rest.items()), op
    # the glue reads (out, lse) of a forward and (dq, dk, dv) of a backward first
    assert len(schema.returns) >= (3 if "backward" in op else 2)
    if not op.endswith("backward"):
        assert schema.returns[0].name == "output"


# ---------------------------------------------------------------------------------------------
# every path against the math reference (fp32 <= 1e-5) and float64
# ---------------------------------------------------------------------------------------------

BLOCKS = [("diag", 23, 23), ("full", 17, 29), ("full", 31, 8)]


@pytest.mark.parametrize("kernel", ["cpu_flash", "aten_flash", "aten_efficient", "flash_attn"])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)])
def test_block_kernels_equal_math_fp32(fakes, kernel, hq, hkv):
    for kind, tq, tk in BLOCKS:
        q, _, _, do = _inputs([tq], seed=tq, hq=hq, hkv=hkv, dtype=fp32)
        _, k, v, _ = _inputs([tk], seed=tk + 1, hq=hq, hkv=hkv, dtype=fp32)
        causal = kind == "diag"
        ref_o, ref_l = kern.block_forward("math", q, k, v, causal, 0.3)
        o, l_ = kern.block_forward(kernel, q, k, v, causal, 0.3)
        assert o.shape == q.shape and l_.shape == (hq, tq) and l_.dtype == fp32
        assert max(max_abs_errs((o, l_), (ref_o, ref_l))) <= 1e-5, (kernel, kind)
        ref_g = kern.block_backward("math", do, q, k, v, ref_o, ref_l, causal, 0.3)
        got = kern.block_backward(kernel, do, q, k, v, ref_o, ref_l, causal, 0.3)
        assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
        assert max(max_abs_errs(got, ref_g)) <= 1e-5, (kernel, kind)


@pytest.mark.parametrize("kernel", ["cpu_flash", "aten_flash", "aten_efficient", "flash_attn", "math"])
def test_varlen_kernels_equal_float64_reference_fp32(fakes, kernel):
    lens = [10, 1, 0, 37, 3, 64]  # an empty sequence and a single token included
    q, k, v, do = _inputs(lens, seed=5, dtype=fp32)
    ref = _reference(lens, q, k, v, do)
    b = tuple(_cu(lens))
    o, l_ = kern.varlen_forward(kernel, q, k, v, b, 0.25)
    got = kern.varlen_backward(kernel, do, q, k, v, o, l_, b, 0.25)
    assert max(max_abs_errs((o, *got), ref)) <= 1e-5, kernel


def test_every_block_kind_through_attention_block_equals_math(monkeypatch):
    # the public block API on CPU (diag / full on the CPU flash op, partial masks on math)
    lens = [40]
    q, k, v, do = _inputs(lens, seed=9, dtype=fp32)
    for qr, kr, kind in [((10, 20), (10, 20), "diag"), ((20, 30), (0, 12), "full"), ((10, 20), (5, 15), "mask")]:
        qs, ks = slice(*qr), slice(*kr)
        o, l_ = attention_block(q[qs], k[ks], v[ks], qr, kr)
        mask = kern.causal_mask(10, kr[1] - kr[0], qr[0], kr[0], q.device)
        ro, rl = kern.math_forward(q[qs], k[ks], v[ks], mask, D**-0.5)
        assert max(max_abs_errs((o, l_), (ro, rl))) <= 1e-5, kind
        g = attention_block_backward(do[qs], q[qs], k[ks], v[ks], ro, rl, qr, kr)
        rg = kern.math_backward(do[qs], q[qs], k[ks], v[ks], ro, rl, mask, D**-0.5)
        assert max(max_abs_errs(g, rg)) <= 1e-5, kind


# ---------------------------------------------------------------------------------------------
# one varlen call per rank
# ---------------------------------------------------------------------------------------------

LENS = [9, 30, 1, 17, 5]


@pytest.mark.parametrize("kernel,fwd,bwd", [("aten_flash", "aten_flash_fwd", "aten_flash_bwd"),
                                            ("flash_attn", "fa_fwd", "fa_bwd"),
                                            ("aten_efficient", "eff_fwd", "eff_bwd")])
def test_engine_local_sequences_run_as_one_varlen_call(fakes, monkeypatch, kernel, fwd, bwd):
    _force(monkeypatch, kernel)
    q, k, v, do = _inputs(LENS, seed=2, dtype=fp32)
    ref = _reference(LENS, q, k, v, do)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = local_sequences(qq, kk, vv, LENS)  # the engine's path for a rank's one-rank groups
    grads = torch.autograd.grad(out, (qq, kk, vv), do)
    assert fakes.calls == {fwd: 1, bwd: 1}
    assert max(max_abs_errs((out, *grads), ref)) <= 1e-5


def test_local_attention_one_call_each_way(fakes, monkeypatch):
    _force(monkeypatch, "aten_flash")
    q, k, v, do = _inputs(LENS, seed=3, dtype=fp32)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = local_attention(qq, kk, vv, _cu(LENS))  # the Ulysses path
    grads = torch.autograd.grad(out, (qq, kk, vv), do)
    assert fakes.calls == {"aten_flash_fwd": 1, "aten_flash_bwd": 1}
    assert max(max_abs_errs((out, *grads), _reference(LENS, q, k, v, do))) <= 1e-5


def test_cpu_runs_one_kernel_call_per_sequence(monkeypatch):
    # the CPU flash op is not varlen: the engine's local path calls it once per sequence each way
    seen = {"f": 0, "b": 0}
    real = kern._ops()
    ops = dict(real)
    ops["cpu_fwd"] = lambda *a, **kw: seen.__setitem__("f", seen["f"] + 1) or real["cpu_fwd"](*a, **kw)
    ops["cpu_bwd"] = lambda *a, **kw: seen.__setitem__("b", seen["b"] + 1) or real["cpu_bwd"](*a, **kw)
    monkeypatch.setattr(kern, "_ops", lambda: ops)
    q, k, v, do = _inputs(LENS, seed=4, dtype=fp32)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = local_sequences(qq, kk, vv, LENS)
    grads = torch.autograd.grad(out, (qq, kk, vv), do)
    assert seen == {"f": len(LENS), "b": len(LENS)}
    assert max(max_abs_errs((out, *grads), _reference(LENS, q, k, v, do))) <= 1e-5


def test_local_pack_of_scattered_rows(fakes, monkeypatch):
    # local sequences at non-adjacent rows of a buffer (other groups' rows in between): one call,
    # exact results at the pack's rows, every other row untouched
    _force(monkeypatch, "aten_flash")
    lens = [7, 12, 4]
    T = 40
    spans = [(3, 10), (15, 27), (30, 34)]
    q, k, v, do = _inputs([T], seed=8, dtype=fp32)
    tasks = [(a, b, RingSpec(ranks=[0], pos=0, seqs=[[[[0, b - a]]]])) for a, b in spans]
    pack = LocalPack.of(tasks, q)
    assert pack is not None and pack.bounds == (0, 7, 19, 23)
    out = torch.full_like(q, 7.0)
    lse = torch.full((HQ, T), 7.0)
    pack.forward(q, k, v, out, lse, None)
    dq, dk, dv = (torch.full_like(x, 7.0) for x in (q, k, v))
    pack.backward(do, q, k, v, out, lse, dq, dk, dv, None)
    assert fakes.calls == {"aten_flash_fwd": 1, "aten_flash_bwd": 1}
    idx = torch.tensor([i for a, b in spans for i in range(a, b)])
    rest = torch.tensor([i for i in range(T) if i not in set(idx.tolist())])
    ref = _reference(lens, q[idx], k[idx], v[idx], do[idx])
    assert max(max_abs_errs((out[idx], dq[idx], dk[idx], dv[idx]), ref)) <= 1e-5
    for x in (out, dq, dk, dv):
        assert torch.equal(x[rest], torch.full_like(x[rest], 7.0))
    # ranges out of order within a sequence: no pack (per-sequence ring tasks handle it)
    odd = [(0, 10, RingSpec(ranks=[0], pos=0, seqs=[[[[5, 10], [0, 5]]]]))]
    assert LocalPack.of(odd, q) is None
    # no varlen kernel (CPU): no pack
    monkeypatch.setattr(kern, "choose", lambda *a: "cpu_flash")
    assert LocalPack.of(tasks, q) is None


def _engine_fused_case(rank, world):
    """test_engine's three-tier plan (rings across and inside "nodes", routed, local groups) on
    4 gloo ranks with every block and varlen pack on the aten flash fake."""
    from tests.runtime import test_engine

    f = Fakes()
    ops = dict(kern._ops())
    ops.update(flash_fwd=f.aten_flash_fwd, flash_bwd=f.aten_flash_bwd)
    saved = kern._ops, kern.choose
    kern._ops = lambda: ops
    kern.choose = lambda dev, dt, kind, d: "math" if kind == "mask" else "aten_flash"
    try:
        res = test_engine._engine_case(rank, world, True, torch.float32, 2)
    finally:
        kern._ops, kern.choose = saved
    res["log"] = f.log
    return res


@pytest.mark.timeout(180)
def test_engine_with_rings_runs_local_sequences_as_one_varlen_call_per_rank(pool):
    from tests.runtime.test_engine import LENS as ENGINE_LENS
    from tests.runtime.test_engine import _assemble
    from tests.runtime.test_engine import _reference as engine_reference

    res = pool.run(_engine_fused_case, timeout=120)
    ref = engine_reference(calls=2)
    got = _assemble(res)
    for s in range(len(ENGINE_LENS)):
        for a, want in zip(got[s], ref[s]):
            assert not torch.isnan(a).any()
            assert (a - want).abs().max().item() <= 1e-5, s
    # local (one-rank) groups: rank 0 holds sequences of 7 and 1 tokens, rank 1 one of 9, rank 3 one
    # of 26; two layer calls -> exactly two varlen calls each way holding all of them, and no other
    # call of those sizes (ring blocks are single sequences of other sizes)
    local = {0: (7, 1), 1: (9,), 2: None, 3: (26,)}
    for rank, r in enumerate(res):
        packs = [(op, lens) for op, lens in r["log"] if lens == local[rank]]
        singles = [(op, lens) for op, lens in r["log"] if local[rank] and len(lens) == 1
                   and lens[0] in local[rank] and lens != local[rank]]
        if local[rank] is None:
            assert all(len(lens) == 1 for _, lens in r["log"])
            continue
        assert sorted(packs) == [("bwd", local[rank])] * 2 + [("fwd", local[rank])] * 2, (rank, r["log"])
        assert singles == []
        assert any(len(lens) == 1 for _, lens in r["log"])  # the ring blocks ran on the fused kernel too


# ---------------------------------------------------------------------------------------------
# no host syncs on the hot path
# ---------------------------------------------------------------------------------------------


class _NoHostSync:
    """Makes every tensor -> host read (item, tolist, int/float/bool of a tensor) raise while armed."""

    NAMES = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch, fakes):
        self.armed = False
        self.hits: list[str] = []
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def guard(t, *a, _real=real, _name=name, **kw):
                if self.armed and not getattr(fakes, "_inside", False):
                    self.hits.append(_name)
                    raise AssertionError(f"host sync: Tensor.{_name}")
                return _real(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, guard)


def test_ring_and_local_hot_paths_have_no_host_sync(fakes, monkeypatch):
    _force(monkeypatch, "aten_flash")

    # the fakes stand in for device kernels: their own host reads do not count
    for name in ("aten_flash_fwd", "aten_flash_bwd"):
        real = getattr(fakes, name)

        def inside(*a, _real=real, **kw):
            fakes._inside = True
            try:
                return _real(*a, **kw)
            finally:
                fakes._inside = False

        setattr(fakes, name, inside)
    ops = dict(kern._ops())
    ops.update(flash_fwd=fakes.aten_flash_fwd, flash_bwd=fakes.aten_flash_bwd)
    monkeypatch.setattr(kern, "_ops", lambda: ops)
    lens = [20, 6, 13]
    q, k, v, do = _inputs(lens, seed=1, dtype=fp32)
    spec = RingSpec(ranks=[0], pos=0, seqs=[[[[0, n // 2], [n // 2, n]]] for n in lens])  # diag + full pairs
    guard = _NoHostSync(monkeypatch, fakes)
    guard.armed = True
    out, lse = ring_forward(q, k, v, spec, Transport(rank=0))
    grads = ring_backward(do, q, k, v, out, lse, spec, Transport(rank=0))
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o2 = local_sequences(qq, kk, vv, lens)
    g2 = torch.autograd.grad(o2, (qq, kk, vv), do)
    guard.armed = False
    assert guard.hits == []
    ref = _reference(lens, q, k, v, do)
    assert max(max_abs_errs((out, *grads), ref)) <= 1e-5
    assert max(max_abs_errs((o2, *g2), ref)) <= 1e-5


# ---------------------------------------------------------------------------------------------
# GQA accuracy in bf16
# ---------------------------------------------------------------------------------------------


def test_gqa_bf16_dkdv_error_within_1_5x_of_expanded_kv():
    """The runtime's GQA backward in bf16 (CPU kernel) against float64, vs the same attention with
    K/V expanded to the query heads by the caller and dK/dV summed over each group in float32."""
    L, hq, hkv, d = 512, 8, 1, 32
    q, k, v, do = _inputs([L], seed=0, hq=hq, hkv=hkv, d=d)
    ref = _reference([L], q, k, v, do)
    qb, kb, vb = (x.to(bf16).requires_grad_() for x in (q, k, v))
    dob = do.to(bf16)
    out = local_attention(qb, kb, vb, [0, L])
    _, dk, dv = torch.autograd.grad(out, (qb, kb, vb), dob)
    chosen = max_abs_errs((dk, dv), ref[2:])
    # the expanded path, built here independently of the runtime's choice
    rep = hq // hkv
    ke, ve = (x.detach().repeat_interleave(rep, 1).requires_grad_() for x in (kb, vb))
    qe = qb.detach().clone().requires_grad_()
    oe = local_attention(qe, ke, ve, [0, L])
    _, dke, dve = torch.autograd.grad(oe, (qe, ke, ve), dob)
    fold = [x.float().view(L, hkv, rep, d).sum(2).to(bf16) for x in (dke, dve)]
    expanded = max_abs_errs(fold, ref[2:])
    for c, e in zip(chosen, expanded):
        assert c <= 1.5 * e, (chosen, expanded)
    assert max(chosen) < 0.1  # and in absolute terms, bf16-sized


# ---------------------------------------------------------------------------------------------
# the GPU benchmark refuses cleanly without CUDA; the real kernels on a GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_gpu_refuses_without_cuda():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py")], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines == ["zeppelin: error: bench_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)"]


def test_bench_gpu_flow_on_cpu():
    # --allow-cpu runs the whole script on CPU (figures meaningless): every section is produced and
    # the bf16 block-by-block ring agrees with the float32 reference
    import json

    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--allow-cpu", "--heads", "2", "--kv-heads", "1",
           "--head-dim", "8", "--pack-tokens", "512", "--long-length", "256", "--chunks", "32", "--repeats", "1",
           "--ring-length", "96"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["local"]) == {"short-heavy", "long"}
    assert out["local"]["long"]["sequences"] == 2 and out["local"]["short-heavy"]["tokens"] == 512
    assert out["local"]["long"]["runtime_tflops"] > 0 and "measured_over_predicted" in out["local"]["long"]
    assert set(out["ring_blocks"]["32"]) == {"full", "diag", "local_tflops_same_tokens"}
    assert max(out["ring_accuracy"]["max_abs_err"].values()) <= 2e-2
    assert out["whole_step"]["available"] is False
    assert out["kernels"] == {"diag": "cpu_flash", "full": "cpu_flash", "varlen": "cpu_flash", "mask": "math"}


def _cuda_kernels():
    if not torch.cuda.is_available():
        return []
    dev = torch.device("cuda")
    caps = kern.cuda_caps(dev)
    ks = [n for n, ok in (("flash_attn", caps.flash_attn), ("aten_flash", caps.aten_flash),
                          ("aten_efficient", caps.aten_efficient)) if ok]
    return ks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernels_match_float64(dtype):
    dev = torch.device("cuda")
    lens = [300, 7, 1024, 64]
    q, k, v, do = _inputs(lens, seed=0, hq=8, hkv=2, d=64)
    ref = _reference(lens, q, k, v, do)
    qc, kc, vc, doc = (x.to(dev, dtype) for x in (q, k, v, do))
    math_o, math_l = kern.varlen_forward("math", qc.float(), kc.float(), vc.float(), tuple(_cu(lens)), 0.125)
    base = max_abs_errs((math_o.cpu(), *kern.varlen_backward("math", doc.float(), qc.float(), kc.float(), vc.float(), math_o,
                                                    math_l, tuple(_cu(lens)), 0.125)), ref)
    for kernel in _cuda_kernels():
        if kernel == "aten_efficient" and dtype == torch.bfloat16 and kern.cuda_caps(dev).capability < (8, 0):
            continue
        o, l_ = kern.varlen_forward(kernel, qc, kc, vc, tuple(_cu(lens)), 0.125)
        g = kern.varlen_backward(kernel, doc, qc, kc, vc, o, l_, tuple(_cu(lens)), 0.125)
        errs = max_abs_errs([x.cpu() for x in (o, *g)], ref)
        assert max(errs) <= 2e-2 * max(1.0, max(x.abs().max().item() for x in ref)), (kernel, errs, base)
        # blocks: a diagonal and a fully visible pair of the 1024-token sequence merge to the whole
        s = 307 + 512
        qa, ka, va = qc[s:s + 512], kc[s - 512:s + 512], vc[s - 512:s + 512]
        o1, l1 = kern.block_forward(kernel, qa, ka[:512], va[:512], False, 0.125)
        o2, l2 = kern.block_forward(kernel, qa, ka[512:], va[512:], True, 0.125)
        acc = torch.zeros(qa.shape, dtype=torch.float32, device=dev)
        lse = torch.full((8, 512), float("-inf"), device=dev)
        merge_partial(acc, lse, o1, l1)
        merge_partial(acc, lse, o2, l2)
        assert (acc.cpu().double() - ref[0][s:s + 512]).abs().max().item() <= 2e-2, kernel
