"""GPU benchmark of the runtime's attention kernels (one command, prints one JSON object).

    python benchmarks/bench_gpu.py                # 1B-class shapes (Hq 32, Hkv 8, D 64), bf16

Measures, on one CUDA GPU (CUDA events, median of ``--repeats`` after a warm-up; ``--allow-cpu``
runs the same flow on CPU to test the script, its figures mean nothing):

* ``local``: causal varlen attention forward+backward of whole packs through the runtime
  (:func:`zeppelin.runtime.attn.local.local_attention`, kernel picked by runtime/kernels.py) and
  through ``flash_attn_varlen_func`` on the same pack when flash-attn is installed; TFLOP/s of
  each and their ratio. Packs: ``short-heavy`` (many 128-1K sequences, some up to 8K) and
  ``long`` (16K sequences), ``--pack-tokens`` tokens each.
* ``ring_blocks``: one ring round's chunk pairs — a diagonal (causal) and a fully visible block of
  ``n`` x ``n`` tokens — forward and backward from the merged out/LSE, TFLOP/s, and the ratio to
  the local kernel on one sequence of ``n`` tokens.
* ``ring_accuracy``: a sequence cut into 2G zigzag chunks, every chunk pair computed by the block
  kernels and merged by log-sum-exp (what ring attention does, without the transfers), in bf16,
  against a float32 math reference: max error of out, dQ, dK, dV.
* ``predicted``: per phase (local attention per pack, ring block per size) the cost model's
  time (planner ``CostModel`` on the ``h100`` cluster preset, its default profile) and the ratio
  measured / predicted.
* ``whole_step``: a whole training step of a 1B-class HF config on one GPU — reported as not
  available while the runtime has no ``hf:`` model path.

FLOPs: causal forward 2·L²·Hq·D per sequence (QKᵀ and PV, half visible), backward 2.5x forward;
a fully visible n x n block 4·n²·Hq·D forward. Without CUDA: exits 2 with one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import statistics
import sys
import time


def _die(msg: str) -> None:
    print(f"zeppelin: error: {msg}", file=sys.stderr)
    sys.exit(2)


def short_heavy_pack(tokens: int, seed: int = 0) -> list[int]:
    """Sequence lengths of a short-heavy pack: 80% in [128, 1024], 20% in [1024, 8192]."""
    rng = random.Random(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        n = rng.randint(128, 1024) if rng.random() < 0.8 else rng.randint(1024, 8192)
        lens.append(min(n, tokens - sum(lens)))
    return lens


def long_pack(tokens: int, length: int = 16384) -> list[int]:
    return [length] * max(1, tokens // length)


def causal_flops(lens, hq: int, d: int) -> float:
    return sum(2.0 * n * n * hq * d for n in lens) * 3.5


def _timer(torch, fn, repeats: int) -> float:
    fn()
    if not torch.cuda.is_available():  # --allow-cpu (a test of the script's flow)
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def _cost_model(hq, hkv, d):
    try:
        from zeppelin.planner.cost import CostModel
    except ImportError:
        try:
            from zeppelin.planner.costmodel.cost import CostModel  # type: ignore[no-redef]
        except ImportError:
            return None
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import ModelSpec

    m = ModelSpec(name="llama-1b-class", family="llama", num_layers=16, hidden=hq * d, num_heads=hq,
                  num_kv_heads=hkv, ffn_hidden=8192, vocab_size=128256, mlp="swiglu", dtype="bf16")
    return CostModel(cluster_preset("h100"), m)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--pack-tokens", type=int, default=65536)
    ap.add_argument("--long-length", type=int, default=16384, help="sequence length of the long pack")
    ap.add_argument("--chunks", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--ring-size", type=int, default=4)
    ap.add_argument("--ring-length", type=int, default=8192)
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run on CPU when there is no GPU (tests the script's flow; the figures mean nothing)")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        _die("bench_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")

    from zeppelin.runtime import kernels
    from zeppelin.runtime.attn.blocks import attention_block, attention_block_backward
    from zeppelin.runtime.attn.local import local_attention
    from zeppelin.runtime.attn.merge import merge_partial
    from zeppelin.schemas.layout import zigzag_ranges

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dt = getattr(torch, args.dtype)
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    caps = kernels.cuda_caps(dev) if cuda else None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # noqa: BLE001
        flash_attn_varlen_func = None

    def tensors(T, seed=0):
        g = torch.Generator(device=dev).manual_seed(seed)
        return tuple(torch.randn(T, h, d, device=dev, dtype=dt, generator=g) for h in (hq, hkv, hkv, hq))

    cm = _cost_model(hq, hkv, d)
    result: dict = {
        "benchmark": "bench_gpu",
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu (--allow-cpu: figures meaningless)",
        "capability": list(caps.capability) if caps else None,
        "torch": torch.__version__,
        "flash_attn_installed": flash_attn_varlen_func is not None,
        "shape": {"heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": args.dtype},
        "kernels": {k: kernels.choose(dev, dt, k, d) for k in ("diag", "full", "varlen", "mask")},
        "host": platform.node(),
        "repeats": args.repeats,
    }

    def fwd_bwd(fn, q, k, v, do):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

        def run():
            torch.autograd.grad(fn(q, k, v), (q, k, v), do)

        return run

    # ---- local varlen attention vs flash_attn_varlen_func
    local = {}
    for name, lens in (("short-heavy", short_heavy_pack(args.pack_tokens)), ("long", long_pack(args.pack_tokens, args.long_length))):
        T = sum(lens)
        q, k, v, do = tensors(T)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        fl = causal_flops(lens, hq, d)
        t_rt = _timer(torch, fwd_bwd(lambda a, b, c, cu=cu: local_attention(a, b, c, cu), q, k, v, do), args.repeats)
        entry = {"sequences": len(lens), "tokens": T, "max_len": max(lens), "runtime_s": t_rt,
                 "runtime_tflops": fl / t_rt / 1e12}
        if flash_attn_varlen_func is not None:
            cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
            mx = max(lens)
            def fa(a, b, c, cu_t=cu_t, mx=mx):
                return flash_attn_varlen_func(a, b, c, cu_t, cu_t, mx, mx, causal=True)

            t_fa = _timer(torch, fwd_bwd(fa, q, k, v, do), args.repeats)
            entry.update(flash_attn_s=t_fa, flash_attn_tflops=fl / t_fa / 1e12, runtime_vs_flash_attn=t_fa / t_rt)
        else:
            entry["flash_attn"] = "not installed: no flash_attn_varlen_func to compare with"
        if cm is not None:
            pred = float(sum(cm.attn_time(n) for n in lens))
            entry.update(predicted_s=pred, measured_over_predicted=t_rt / pred)
        local[name] = entry
    result["local"] = local

    # ---- ring blocks (compute of one round's chunk pairs, from the merged out/LSE)
    blocks = {}
    for n in args.chunks:
        q, k, v, do = tensors(2 * n, seed=n)
        qa, ka, va, da = q[n:], k[:n], v[:n], do[n:]
        row = {}
        for kind, qr, kr, kk, vv in (("full", (n, 2 * n), (0, n), ka, va), ("diag", (n, 2 * n), (n, 2 * n), k[n:], v[n:])):
            o, lse = attention_block(qa, kk, vv, qr, kr)
            o = o.to(dt)

            def run(kk=kk, vv=vv, qr=qr, kr=kr, o=o, lse=lse, qa=qa, da=da):
                attention_block(qa, kk, vv, qr, kr)
                attention_block_backward(da, qa, kk, vv, o, lse, qr, kr)

            t = _timer(torch, run, args.repeats)
            fl = 4.0 * n * n * hq * d * 3.5 * (0.5 if kind == "diag" else 1.0)
            row[kind] = {"s": t, "tflops": fl / t / 1e12}
            if cm is not None:
                pred = float(cm.attn_block_time(n, n, causal=kind == "diag"))
                row[kind].update(predicted_s=pred, measured_over_predicted=t / pred)
        t_loc = _timer(torch, fwd_bwd(lambda a, b, c, n=n: local_attention(a, b, c, [0, n]), q[:n], k[:n], v[:n], do[:n]),
                       args.repeats)
        loc_tflops = causal_flops([n], hq, d) / t_loc / 1e12
        row["local_tflops_same_tokens"] = loc_tflops
        for kind in ("full", "diag"):
            row[kind]["vs_local"] = row[kind]["tflops"] / loc_tflops
        blocks[str(n)] = row
    result["ring_blocks"] = blocks

    # ---- bf16 ring (zigzag chunk pairs merged by LSE) vs a float32 reference
    G, L = args.ring_size, args.ring_length
    q, k, v, do = tensors(L, seed=1)
    ranges = zigzag_ranges(L, G)
    chunks = [tuple(r) for pos in ranges for r in pos if r[1] > r[0]]
    out = torch.zeros((L, hq, d), dtype=torch.float32, device=dev)
    lse = torch.full((hq, L), float("-inf"), device=dev)
    for qs, qe in chunks:
        for ks, ke in chunks:
            if ks < qe:
                o, l_ = attention_block(q[qs:qe], k[ks:ke], v[ks:ke], (qs, qe), (ks, ke))
                merge_partial(out[qs:qe], lse[:, qs:qe], o, l_)
    ob = out.to(dt)
    dq = torch.zeros((L, hq, d), dtype=torch.float32, device=dev)
    dk = torch.zeros((L, hkv, d), dtype=torch.float32, device=dev)
    dv = torch.zeros_like(dk)
    for qs, qe in chunks:
        for ks, ke in chunks:
            if ks < qe:
                a, b, c = attention_block_backward(do[qs:qe], q[qs:qe], k[ks:ke], v[ks:ke], ob[qs:qe], lse[:, qs:qe],
                                                   (qs, qe), (ks, ke))
                dq[qs:qe] += a.float()
                dk[ks:ke] += b.float()
                dv[ks:ke] += c.float()
    qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
    ref = local_attention(qf, kf, vf, [0, L])  # float32 math kernel on CUDA
    rg = torch.autograd.grad(ref, (qf, kf, vf), do.float())
    errs = [(a.float() - b).abs().max().item() for a, b in zip((ob, dq, dk, dv), (ref, *rg))]
    result["ring_accuracy"] = {"ring_size": G, "length": L, "reference": "float32 math",
                               "max_abs_err": dict(zip(("out", "dq", "dk", "dv"), errs))}

    # ---- whole step of a 1B-class HF config
    if importlib.util.find_spec("zeppelin.runtime.hf") is None:
        result["whole_step"] = {"available": False,
                                "reason": "the runtime has no hf: model path in this tree (zeppelin run --model hf:DIR)"}
    else:
        result["whole_step"] = {"available": False, "reason": "run `zeppelin run` on an hf: plan; not driven from here"}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
