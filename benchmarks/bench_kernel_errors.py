"""Numerical error of every attention kernel path against a float64 reference (prints JSON).

For each dtype (bf16, fp16, fp32) and each kernel path this machine has (runtime/kernels.py:
``cpu_flash`` and ``math`` on CPU; ``flash_attn`` / ``aten_flash`` / ``aten_efficient`` / ``math``
on CUDA), two compositions of one causal sequence of ``--length`` tokens, ``--heads`` query and
``--kv-heads`` KV heads, head dim ``--head-dim``:

* ``varlen``: local attention of the whole sequence (:func:`kernels.varlen_forward` / backward);
* ``ring``: the sequence cut into ``--chunks`` zigzag chunks, every visible chunk pair computed
  by the block kernels (diagonal and fully visible) and merged by log-sum-exp in float32, each
  block's backward from the merged out/LSE, dK/dV accumulated in float32 — ring attention's
  arithmetic without the transfers.

Reported: max abs error of out, dQ, dK, dV vs float64 autograd attention (inputs drawn in float64,
rounded once to the dtype). With GQA on the CPU kernel, both ways of feeding K/V are measured:
``direct`` (KV heads as they are) and ``expanded`` (K/V repeated to the query heads, per-head
dK/dV summed over each group in float32) — the runtime uses the one :func:`kernels.gqa_expand`
names; the median time of the backward of each is reported too.

    python benchmarks/bench_kernel_errors.py [--length 1000 --heads 8 --kv-heads 2 --head-dim 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time

import torch

from zeppelin.runtime import kernels
from zeppelin.runtime.attn.merge import merge_partial
from zeppelin.runtime.attn.reference import reference_attention
from zeppelin.schemas.layout import zigzag_ranges

RUNTIME_GQA_EXPAND = kernels.gqa_expand  # the runtime's choice (the context below overrides it)


@contextlib.contextmanager
def _gqa_mode(mode: str | None):
    """Force the CPU kernel's GQA feeding ('direct' | 'expanded'); None: the runtime's choice."""
    if mode is None:
        yield
        return
    real = kernels.gqa_expand
    kernels.gqa_expand = lambda kern, dt, hq, hkv: (mode == "expanded" and hq != hkv) or (
        kern == "aten_efficient" and hq != hkv)
    try:
        yield
    finally:
        kernels.gqa_expand = real


def _reference(q, k, v, do):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v, [0, q.shape[0]])
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


def _varlen(kernel, q, k, v, do, scale):
    b = (0, q.shape[0])
    o, lse = kernels.varlen_forward(kernel, q, k, v, b, scale)
    return (o, *kernels.varlen_backward(kernel, do, q, k, v, o.to(q.dtype), lse, b, scale))


def _ring(kernel, q, k, v, do, scale, chunks):
    L = q.shape[0]
    spans = sorted(tuple(r) for pos in zigzag_ranges(L, chunks // 2) for r in pos if r[1] > r[0])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], L), float("-inf"), device=q.device)
    pairs = [(a, b) for a in spans for b in spans if b[0] <= a[0]]  # diag (a == b) or fully visible
    for (qs, qe), (ks, ke) in pairs:
        o, l_ = kernels.block_forward(kernel, q[qs:qe], k[ks:ke], v[ks:ke], qs == ks, scale)
        merge_partial(out[qs:qe], lse[:, qs:qe], o, l_)
    ob = out.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for (qs, qe), (ks, ke) in pairs:
        a, b, c = kernels.block_backward(kernel, do[qs:qe], q[qs:qe], k[ks:ke], v[ks:ke], ob[qs:qe], lse[:, qs:qe],
                                         qs == ks, scale)
        dq[qs:qe] += a.float()
        dk[ks:ke] += b.float()
        dv[ks:ke] += c.float()
    return ob, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _bwd_time(kernel, q, k, v, do, scale, repeats):
    b = (0, q.shape[0])
    o, lse = kernels.varlen_forward(kernel, q, k, v, b, scale)
    ts = []
    for _ in range(repeats):
        if q.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        kernels.varlen_backward(kernel, do, q, k, v, o.to(q.dtype), lse, b, scale)
        if q.device.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    L, hq, hkv, d = args.length, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(args.seed)
    q, k, v, do = (torch.randn(L, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    ref = _reference(q, k, v, do)
    scale = d**-0.5
    if dev.type == "cuda":
        caps = kernels.cuda_caps(dev)
        fused = [n for n, ok in (("flash_attn", caps.flash_attn), ("aten_flash", caps.aten_flash),
                                 ("aten_efficient", caps.aten_efficient)) if ok]
    else:
        fused = ["cpu_flash"]
    rows = []
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = [t.to(dev, dt) for t in (q, k, v, do)]
        for kernel in [*fused, "math"]:
            if kernel != "cpu_flash" and kernel != "math" and dt == torch.float32:
                continue  # the fused CUDA kernels take bf16/fp16 only
            modes = ["direct", "expanded"] if kernel == "cpu_flash" and hq != hkv else [None]
            for mode in modes:
                with _gqa_mode(mode):
                    for comp in ("varlen", "ring"):
                        got = _varlen(kernel, *x, scale) if comp == "varlen" else _ring(kernel, *x, scale, args.chunks)
                        err = [(a.double().cpu() - b).abs().max().item() for a, b in zip(got, ref)]
                        row = {"dtype": str(dt).replace("torch.", ""), "kernel": kernel, "composition": comp,
                               "gqa": mode or ("native" if hq != hkv else "mha"),
                               "runtime_choice": mode is None or RUNTIME_GQA_EXPAND(kernel, dt, hq, hkv) == (
                                   mode == "expanded"),
                               "max_abs_err": dict(zip(("out", "dq", "dk", "dv"), err))}
                        if comp == "varlen" and mode is not None:
                            row["backward_s"] = _bwd_time(kernel, *x, scale, args.repeats)
                        rows.append(row)
    print(json.dumps({
        "benchmark": "bench_kernel_errors", "device": str(dev), "host": platform.machine(),
        "torch": torch.__version__, "threads": args.threads,
        "shape": {"length": L, "heads": hq, "kv_heads": hkv, "head_dim": d, "ring_chunks": args.chunks,
                  "seed": args.seed},
        "ref_max_abs": dict(zip(("out", "dq", "dk", "dv"), (t.abs().max().item() for t in ref))),
        "rows": rows,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
