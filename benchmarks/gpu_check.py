"""First light on one CUDA GPU: zeppelin's kernels, a whole training step, its memory and its cost
model, measured in one run (<= 8 minutes) that writes one JSON and a short table.

    bash benchmarks/gpu_check.sh                      # on the GPU machine (installs from ./wheelhouse)
    python benchmarks/gpu_check.py --dry-run          # on CPU: every code path at tiny sizes

Sections (each guarded: a failure is recorded in the JSON with its error and the others still run;
a global time budget, ``--budget-s``, skips what no longer fits):

* ``environment``: device, driver, torch / CUDA versions, packages, the dispatch's view of the device;
* ``kernels``: the runtime's local varlen attention forward+backward (``local_attention``, kernel
  picked by runtime/kernels.py) vs PyTorch's own fused kernels on the same packs (``varlen_attn``,
  and ``scaled_dot_product_attention`` with the flash backend, sequences of one length batched),
  short-heavy and long packs, TFLOP/s; ring blocks (diagonal and fully visible chunk pairs, forward
  and backward from an external log-sum-exp) vs the local kernel on one sequence of the same length;
  bf16 vs fp32 error of every block kind (varlen, diag, full, mask, and windowed varlen / diag /
  mask), with the kernel each call actually ran (recorded at the dispatch's entry points);
* ``whole_step``: a 1B-class Hugging Face Llama config (random weights) planned with ``zeppelin
  plan`` and run by ``zeppelin run --report-json`` on one rank (FSDP2 with one shard, bf16,
  selective recompute) on the shipped sample's length mix (real-text-like), 64K tokens per step:
  tokens/s, MFU, peak memory vs the plan's prediction, measured vs predicted time per phase;
* ``cost_model``: ``zeppelin profile`` of the same model on this device (saved to the output
  folder), the same steps planned with it, and the prediction error of that plan on the measured
  steps (next to the error of the preset curves);
* ``two_ranks``: a 2-rank ring step with ``--verify`` on this one device: the runtime's own path
  (NCCL), then gloo for CPU and CUDA tensors (each collective probed first); what fails is recorded.

``--dry-run`` runs every section on CPU at tiny sizes (kernels on their CPU paths, the step on the
CPU engine, a ``--smoke`` profile, 2 gloo ranks): figures meaningless, code paths real.
Output: ``$OUT`` (or ``--out``): ``gpu_check.json``, ``gpu_check.txt`` (the table), the profile
(``profile.json`` and its ``.raw.json``) and ``gpu_check.log`` (every command's output).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GLOO_SHIM = HERE / "gpu_check_gloo"  # a sitecustomize that turns the ranks' process groups into gloo
SECTIONS = ("environment", "kernels", "whole_step", "cost_model", "two_ranks")

#: sizes per mode: GPU figures, and the dry run's tiny sizes (same code paths)
SIZES = {
    "gpu": dict(heads=32, kv_heads=8, head_dim=64, pack_tokens=65536, long_len=16384,
                chunks=[4096, 8192, 16384, 32768], err_len=2048, window=512, repeats=5,
                step_tokens=65536, max_seq_len=32768, steps=4, ring_tokens=16384, ring_max_len=8192,
                profile_grid=[]),
    "dry": dict(heads=4, kv_heads=2, head_dim=16, pack_tokens=512, long_len=128,
                chunks=[64], err_len=64, window=24, repeats=1,
                step_tokens=512, max_seq_len=256, steps=2, ring_tokens=256, ring_max_len=128,
                profile_grid=["--smoke"]),
}

#: a 1B-class Llama (Llama-3.2-1B's shapes), random weights; bf16 compute
LLAMA_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=True, hidden_act="silu", torch_dtype="bfloat16")
#: the dry run's model, and the two-rank check's (fp32: the CPU has no fast bf16)
LLAMA_TINY = dict(LLAMA_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096,
                  torch_dtype="float32")


class OutOfTime(Exception):
    """The global budget has no room for this part."""


class Check:
    """Shared state of one run: mode, sizes, folders, the budget and the command log."""

    def __init__(self, args):
        self.dry = args.dry_run
        self.size = SIZES["dry" if self.dry else "gpu"]
        self.t0 = time.monotonic()
        self.budget = args.budget_s or (1200.0 if self.dry else 420.0)
        self.out = Path(args.out or os.environ.get("OUT") or "gpu_check_out").resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="zeppelin-gpu-check-"))
        self.log = open(self.out / "gpu_check.log", "w")  # noqa: SIM115 (closed by main)
        self.results: dict = {}
        self.step: dict | None = None  # the whole step's plan, model, report and metrics (cost_model reuses them)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def need(self, seconds: float, what: str) -> None:
        if self.left() < seconds:
            raise OutOfTime(f"{what}: {self.left():.0f} s of the {self.budget:.0f} s budget left, needs ~{seconds:.0f}")

    def cluster(self, ranks: int = 1) -> str:
        """The cluster preset of this device (``h100``, or ``zeppelin-c`` for an H200; ``local-cpu``
        on the dry run) with ``ranks`` GPUs on one node."""
        if self.dry:
            return f"local-cpu:1x{ranks}"
        name = self.results.get("environment", {}).get("device", "")
        return f"{'zeppelin-c' if 'H200' in name else 'h100'}:1x{ranks}"

    def zeppelin(self, *args: str, env: dict | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
        """``zeppelin ARGS`` as a subprocess (the installed CLI of this tree), logged; raises with
        the command's last error line when it fails."""
        t = min(timeout or self.left(), self.left())
        if t < 5:
            raise OutOfTime(f"zeppelin {args[0]}: the budget is spent")
        cmd = [sys.executable, "-c", "from zeppelin.planner.cli import main; main()", *map(str, args)]
        self.log.write(f"\n$ zeppelin {' '.join(map(str, args))}\n")
        self.log.flush()
        t1 = time.monotonic()
        try:
            r = subprocess.run(cmd, cwd=self.work, env=env, capture_output=True, text=True, timeout=t, check=False)
        except subprocess.TimeoutExpired as e:
            raise OutOfTime(f"zeppelin {args[0]} did not finish within {t:.0f} s") from e
        self.log.write(r.stdout + r.stderr + f"[exit {r.returncode} after {time.monotonic() - t1:.1f} s]\n")
        self.log.flush()
        if r.returncode != 0:
            lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
            errs = [ln for ln in lines if "error" in ln.lower()]
            raise RuntimeError(f"zeppelin {args[0]} exited {r.returncode}: {(errs or lines or ['no output'])[-1].strip()}")
        return r


def run_section(chk: Check, name: str, fn) -> None:
    """Run one section; whatever it raises is recorded and the next section still runs."""
    t = time.monotonic()
    print(f"[gpu_check] {name} ... ({chk.left():.0f} s of the budget left)", file=sys.stderr, flush=True)
    try:
        res = {"ok": True, **fn(chk)}
    except OutOfTime as e:
        res = {"ok": False, "skipped": str(e)}
    except Exception as e:  # noqa: BLE001 - recorded, the next section runs
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    res["seconds"] = round(time.monotonic() - t, 2)
    chk.results[name] = res
    print(f"[gpu_check] {name}: {'ok' if res['ok'] else res.get('error') or res.get('skipped')} "
          f"({res['seconds']} s)", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ environment
def section_environment(chk: Check) -> dict:
    import importlib.metadata as md

    import torch

    from zeppelin.runtime import kernels

    cuda = torch.cuda.is_available()
    if not cuda and not chk.dry:
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False); use --dry-run on CPU")
    dev = torch.device("cuda" if cuda and not chk.dry else "cpu")
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)",
           "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "dry_run": chk.dry, "packages": {}}
    for name in ("transformers", "safetensors", "tokenizers", "numpy", "triton", "pydantic", "pulp", "highspy",
                 "typer", "rich", "networkx", "pyarrow", "flash-attn"):
        with contextlib.suppress(md.PackageNotFoundError):
            res["packages"][name] = md.version(name)
    if dev.type == "cuda":
        caps = kernels.cuda_caps(dev)
        props = torch.cuda.get_device_properties(dev)
        res.update(capability=list(caps.capability), multiprocessors=props.multi_processor_count,
                   memory_bytes=props.total_memory, fused_backends={"flash_attn": caps.flash_attn,
                   "aten_flash": caps.aten_flash, "aten_efficient": caps.aten_efficient})
        with contextlib.suppress(Exception):
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20, check=False)
            res["nvidia_smi"] = q.stdout.strip()
    res["dispatch"] = {dt: {k: kernels.choose(dev, getattr(torch, dt), k, chk.size["head_dim"])
                            for k in ("diag", "full", "varlen", "mask")} for dt in ("bfloat16", "float16", "float32")}
    return res


# ---------------------------------------------------------------------------------------- kernels
def _device(chk: Check):
    import torch

    return torch.device("cpu" if chk.dry or not torch.cuda.is_available() else "cuda")


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up (CUDA events on a GPU)."""
    sys.path.insert(0, str(HERE))
    import bench_gpu  # the GPU benchmark's timer (CUDA events / perf_counter)
    import torch

    return bench_gpu._timer(torch, fn, repeats)


def _grad_step(fn, q, k, v, do):
    """``fn(q, k, v)`` forward and backward on leaf copies (what one training step asks of it)."""
    import torch

    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

    def run():
        torch.autograd.grad(fn(q, k, v), (q, k, v), do)

    return run


def _torch_varlen(hq: int, hkv: int):
    """PyTorch's own fused varlen attention (``torch.nn.attention.varlen.varlen_attn``), causal, as
    ``f(q, k, v, cu, max_len)``; None where this torch has none."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = "enable_gqa" in params
    if gqa:
        kw["enable_gqa"] = True

    def f(q, k, v, cu, mx):
        if not gqa and hkv != hq:
            k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        return varlen_attn(q, k, v, cu, cu, mx, mx, **kw)

    return f


def _sdpa_groups(q, k, v, do, lens):
    """The pack in PyTorch's SDPA layout: sequences of one length batched ``[B, H, L, D]``
    (built once, outside the timing)."""
    import torch

    starts, pos = {}, 0
    for n in lens:
        starts.setdefault(n, []).append(pos)
        pos += n
    groups = []
    for n, ss in starts.items():
        groups.append(tuple(torch.stack([x[s:s + n] for s in ss]).transpose(1, 2).contiguous() for x in (q, k, v, do)))
    return groups


def _sdpa_step(groups, hq: int, hkv: int):
    """Forward+backward of every batched group through ``scaled_dot_product_attention`` with the
    flash backend (CUDA; the CPU flash kernel on the dry run): GQA native where the backend takes
    it (tried once, before the timing), else K/V expanded to the query heads."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [tuple(x.detach().requires_grad_() for x in g[:3]) + (g[3],) for g in groups]
    r = hq // hkv
    mode = {"gqa": "native" if r > 1 else "mha"}

    def one(q, k, v, do):
        if mode["gqa"] == "expanded":
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=r > 1)
        torch.autograd.grad(o, (q, k, v), do)

    def run():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            for g in leaves:
                one(*g)

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            one(*leaves[0])
    except RuntimeError:
        mode["gqa"] = "expanded"
    return run, mode


def _guarded(fn, *args) -> dict:
    """``fn(*args)``, or ``{"error": ...}`` when it raises (the other items of a part still run)."""
    try:
        return fn(*args)
    except OutOfTime:
        raise
    except Exception as e:  # noqa: BLE001 - recorded per item
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        return {"error": f"{type(e).__name__}: {msg}", "traceback": traceback.format_exc()[-1500:]}


def _bf16_tensors(dev, rows: int, s: dict, seed: int):
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(rows, h, s["head_dim"], device=dev, dtype=torch.bfloat16, generator=g)
            for h in (s["heads"], s["kv_heads"], s["kv_heads"], s["heads"])]


def _local_pack(chk: Check, lens: list[int], tv) -> dict:
    sys.path.insert(0, str(HERE))
    from bench_gpu import causal_flops

    from zeppelin.runtime.attn.local import local_attention, local_kernel

    s = chk.size
    hq, hkv = s["heads"], s["kv_heads"]
    q, k, v, do = _bf16_tensors(_device(chk), sum(lens), s, 0)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    fl = causal_flops(lens, hq, s["head_dim"])
    row = {"sequences": len(lens), "tokens": sum(lens), "max_len": max(lens), "kernel": local_kernel(q)}
    t = _timed(_grad_step(lambda a, b, c: local_attention(a, b, c, cu), q, k, v, do), s["repeats"])
    row.update(runtime_s=t, runtime_tflops=fl / t / 1e12)
    run, mode = _sdpa_step(_sdpa_groups(q, k, v, do, lens), hq, hkv)
    t = _timed(run, s["repeats"])
    row.update(sdpa_flash_s=t, sdpa_flash_tflops=fl / t / 1e12, sdpa_gqa=mode["gqa"], sdpa_calls=len(set(lens)))
    row["torch_varlen"] = _guarded(_varlen_row, tv, q, k, v, do, cu, max(lens), fl, s["repeats"])
    best = max([row["sdpa_flash_tflops"]] + [row["torch_varlen"].get("tflops", 0.0)])
    row["runtime_vs_best_torch"] = row["runtime_tflops"] / best
    return row


def kernel_local_vs_torch(chk: Check) -> dict:
    """Local varlen attention fwd+bwd through the runtime vs PyTorch's fused kernels, same packs."""
    sys.path.insert(0, str(HERE))
    from bench_gpu import long_pack, short_heavy_pack

    s = chk.size
    packs = {"short-heavy": short_heavy_pack(s["pack_tokens"]), "long": long_pack(s["pack_tokens"], s["long_len"])}
    if chk.dry:  # the dry run's pack: the generator's lengths scaled to its tokens
        packs["short-heavy"] = [max(4, n // 16) for n in short_heavy_pack(s["pack_tokens"] * 16)][:24]
    tv = _torch_varlen(s["heads"], s["kv_heads"])
    out = {}
    for name, lens in packs.items():
        chk.need(20, f"kernels/{name}")
        out[name] = _guarded(_local_pack, chk, lens, tv)
    return out


def _varlen_row(tv, q, k, v, do, cu, mx, fl, repeats) -> dict:
    import torch

    if tv is None:
        return {"error": "this torch has no torch.nn.attention.varlen.varlen_attn"}
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    t = _timed(_grad_step(lambda a, b, c: tv(a, b, c, cu_t, mx), q, k, v, do), repeats)
    return {"s": t, "tflops": fl / t / 1e12}


def _ring_block(chk: Check, n: int) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    from bench_gpu import causal_flops

    from zeppelin.runtime.attn.blocks import attention_block, attention_block_backward
    from zeppelin.runtime.attn.local import local_attention

    s = chk.size
    hq, d = s["heads"], s["head_dim"]
    q, k, v, do = _bf16_tensors(_device(chk), 2 * n, s, n)
    row = {}
    for kind, kr in (("full", (0, n)), ("diag", (n, 2 * n))):
        qa, ka, va, da = q[n:], k[kr[0]:kr[1]], v[kr[0]:kr[1]], do[n:]
        o, lse = attention_block(qa, ka, va, (n, 2 * n), kr)
        o = o.to(torch.bfloat16)

        def run(qa=qa, ka=ka, va=va, da=da, kr=kr, o=o, lse=lse):
            attention_block(qa, ka, va, (n, 2 * n), kr)
            attention_block_backward(da, qa, ka, va, o, lse, (n, 2 * n), kr)

        t = _timed(run, s["repeats"])
        row[kind] = {"s": t, "tflops": 4.0 * n * n * hq * d * 3.5 * (0.5 if kind == "diag" else 1.0) / t / 1e12}
    t = _timed(_grad_step(lambda a, b, c: local_attention(a, b, c, [0, n]), q[:n], k[:n], v[:n], do[:n]), s["repeats"])
    row["local_tflops"] = causal_flops([n], hq, d) / t / 1e12
    for kind in ("full", "diag"):
        row[kind]["vs_local"] = row[kind]["tflops"] / row["local_tflops"]
    return row


def kernel_ring_blocks(chk: Check) -> dict:
    """Diagonal and fully visible n x n chunk pairs, forward + backward from an external (given)
    out / log-sum-exp, vs the local kernel on one causal sequence of n tokens."""
    out = {}
    for n in chk.size["chunks"]:
        chk.need(15, f"kernels/ring block {n}")
        out[str(n)] = _guarded(_ring_block, chk, n)
    return out


@contextlib.contextmanager
def kernel_spy():
    """Record which kernel each call of the dispatch's entry points ran: ``(entry, kernel)`` pairs."""
    from zeppelin.runtime import kernels as K

    seen: list[tuple[str, str]] = []
    real = {n: getattr(K, n) for n in ("block_forward", "varlen_forward", "band_forward", "math_forward")}

    def wrap(name, fn):
        def spy(*a, **kw):
            seen.append((name, a[0] if name in ("block_forward", "varlen_forward") else name.split("_")[0]))
            return fn(*a, **kw)
        return spy

    for n, fn in real.items():
        setattr(K, n, wrap(n, fn))
    try:
        yield seen
    finally:
        for n, fn in real.items():
            setattr(K, n, fn)


def _error_cases(n: int, w: int) -> dict:
    """Block kinds as ``(q rows, k rows, window)`` over one sequence of 2n tokens (None: varlen)."""
    return {"varlen": None, "diag": ((n, 2 * n), (n, 2 * n), None), "full": ((n, 2 * n), (0, n), None),
            "mask": ((n, 2 * n), (n // 2, n // 2 + n), None), "varlen_window": "window",
            "diag_window": ((n, 2 * n), (n, 2 * n), w), "mask_window": ((n, 2 * n), (0, n), w)}


def _run_case(case, q, k, v, do, lens, w):
    """Forward + backward of one case: out, dq, dk, dv (float32), and the kernels that ran."""
    from zeppelin.runtime.attn.blocks import attention_block, attention_block_backward
    from zeppelin.runtime.attn.local import local_backward, local_forward

    with kernel_spy() as seen:
        if case is None or case == "window":
            win = w if case == "window" else None
            cu = [0]
            for m in lens:
                cu.append(cu[-1] + m)
            o, lse = local_forward(q, k, v, cu, window=win)
            grads = local_backward(do, q, k, v, o, lse, cu, window=win)
        else:
            (a, b), (c, e), win = case
            qa, ka, va, da = q[a:b], k[c:e], v[c:e], do[a:b]
            o, lse = attention_block(qa, ka, va, (a, b), (c, e), window=win)
            grads = attention_block_backward(da, qa, ka, va, o.to(q.dtype), lse, (a, b), (c, e), window=win)
    return [x.float() for x in (o, *grads)], sorted({f"{e}:{kern}" for e, kern in seen})


def _error_row(case, base, lens, w) -> dict:
    got, k16 = _run_case(case, *base, lens, w)
    ref, k32 = _run_case(case, *(x.float() for x in base), lens, w)
    row = {"kernel_bf16": k16, "kernel_fp32": k32}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        err = (a - b).abs().max().item()
        row[name] = {"max_abs": err, "rel": err / max(b.abs().max().item(), 1e-30)}
    row["worst_rel"] = max(row[x]["rel"] for x in ("out", "dq", "dk", "dv"))
    return row


def kernel_errors(chk: Check) -> dict:
    """bf16 vs fp32 of every block kind, windowed ones included: max |bf16 - fp32| of out, dQ,
    dK, dV, absolute and relative to the fp32 result's largest value; the kernels each ran."""
    import torch

    s, dev = chk.size, _device(chk)
    n, w = s["err_len"], s["window"]
    g = torch.Generator(device="cpu").manual_seed(1)
    base = [torch.randn(2 * n, h, s["head_dim"], generator=g).to(torch.bfloat16).to(dev)
            for h in (s["heads"], s["kv_heads"], s["kv_heads"], s["heads"])]
    lens = [n, n // 2, n // 2]  # the varlen cases: three sequences over the 2n rows
    out = {}
    for kind, case in _error_cases(n, w).items():
        chk.need(10, f"kernels/error {kind}")
        out[kind] = _guarded(_error_row, case, base, lens, w)
    return out


def section_kernels(chk: Check) -> dict:
    """The three parts; the section is ok when every item of every part ran."""
    res: dict = {}
    for part, fn in (("local", kernel_local_vs_torch), ("ring_blocks", kernel_ring_blocks), ("errors", kernel_errors)):
        try:
            res[part] = fn(chk)
        except OutOfTime as e:
            res[part] = {"skipped": str(e)}
    bad = [f"{p}: skipped" for p, r in res.items() if "skipped" in r]
    bad += [f"{p}/{k}: {v['error']}" for p, r in res.items() for k, v in r.items() if isinstance(v, dict) and "error" in v]
    if bad:
        res.update(ok=False, error="; ".join(bad)[:1000])
    return res


# ------------------------------------------------------------------------------------- whole step
def _model_dir(chk: Check, name: str, config: dict) -> Path:
    d = chk.work / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    return d


def _plan(chk: Check, out: str, model: str, cluster: str, tokens: int, max_len: int, steps: int, *extra: str) -> Path:
    path = chk.work / out
    chk.zeppelin("plan", "-c", cluster, "--model", model, "--steps", steps, "--tokens-per-step", tokens,
                 "--max-seq-len", max_len, "--seed", 0, "-q", "-o", path, *extra)
    return path


def _step_summary(report: dict, metrics: list[dict]) -> dict:
    """The figures of a run: tokens/s, MFU, memory vs prediction, time per phase vs prediction
    (medians over the steps after the first, which pays one-time warm-up costs)."""
    import statistics

    rows = [r for r in report["steps"] if not r["first"]] or report["steps"]
    recs = [m for m in metrics if m["step"] in {r["step"] for r in rows}]
    phases = {}
    for ph in rows[0]["measured_s"]:
        ms = statistics.median(r["measured_s"][ph] for r in rows)
        ps = statistics.median(r["predicted_s"][ph] for r in rows)
        phases[ph] = {"measured_s": ms, "predicted_s": ps, "error": (ps - ms) / ms if ms > 0 else None}
    mem = report["summary"].get("memory") or {}
    peak = max((max(m.get("peak_memory_bytes") or [0]) for m in recs), default=0)
    pred = mem.get("peak_predicted_bytes")
    return {
        "steps_measured": len(rows), "tokens_per_step": [m["tokens"] for m in recs],
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in recs),
        "mfu": statistics.median(m["mfu"] for m in recs) if all("mfu" in m for m in recs) else None,
        "model_tflops": statistics.median(m["model_tflops"] for m in recs) if all("model_tflops" in m for m in recs)
        else None,
        "peak_memory_bytes": peak, "predicted_memory_bytes": pred,
        "memory_measured_over_predicted": peak / pred if pred else None,
        "memory_model_ratio": mem.get("median_ratio"), "memory_components": mem.get("peak_step_components"),
        "phases": phases, "step_error": report["summary"]["step_after_first"],
        "profile": report.get("profile"),
    }


def _run_plan(chk: Check, plan: Path, model: str, tag: str, *extra: str, env=None,
              timeout: float | None = None) -> tuple[dict, list[dict]]:
    metrics, rep = chk.work / f"{tag}.metrics.jsonl", chk.work / f"{tag}.report.json"
    chk.zeppelin("run", plan, "--model", model, "--progress", "none", "--metrics", metrics, "--report-json", rep,
                 *extra, env=env, timeout=timeout)
    if not tag.startswith("ring2"):  # the steps' report (per step and phase) beside the JSON
        (chk.out / rep.name).write_text(rep.read_text())
    return json.loads(rep.read_text()), [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]


def section_whole_step(chk: Check) -> dict:
    s = chk.size
    cfg = LLAMA_TINY if chk.dry else LLAMA_1B
    mdir = _model_dir(chk, "llama", cfg)
    chk.need(60, "whole step")
    plan = _plan(chk, "step.plan.jsonl", f"hf:{mdir}", chk.cluster(1), s["step_tokens"], s["max_seq_len"], s["steps"],
                 "--recompute", "selective", "--zero-stage", "1")
    report, metrics = _run_plan(chk, plan, f"hf:{mdir}", "step")
    chk.step = {"plan": plan, "model_dir": mdir, "report": report, "metrics": metrics}
    res = {"model": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "intermediate_size", "vocab_size", "torch_dtype")},
           "cluster": chk.cluster(1), "recompute": "selective", "dp": "fsdp (one shard)", "zero_stage": 1,
           "data": "the shipped sample manifest (long-tailed, real-text-like lengths)"}
    res.update(_step_summary(report, metrics))
    return res


# ------------------------------------------------------------------------------------- cost model
def _same_steps(a: Path, b: Path) -> bool:
    """Whether two plans run the same work (sequences, replicas, micro-batches' groups and
    placements), whatever their predictions."""
    def work(p):
        out = []
        for line in p.read_text().splitlines():
            d = json.loads(line)
            if d.get("kind") == "step":
                mbs = [{k: mb.get(k) for k in ("groups", "placements", "queues", "linear_layout", "routes")}
                       for mb in d["microbatches"]]
                out.append((d["sequences"], d.get("replicas"), mbs))
        return out

    return work(a) == work(b)


def section_cost_model(chk: Check) -> dict:
    from zeppelin.schemas.model import resolve_model_ref

    step = chk.step
    mdir = step["model_dir"] if step else _model_dir(chk, "llama", LLAMA_TINY if chk.dry else LLAMA_1B)
    spec = chk.work / "model.json"
    spec.write_text(resolve_model_ref(f"hf:{mdir}").model_dump_json(indent=1))
    prof = chk.out / "profile.json"
    chk.need(60, "profile")
    t = time.monotonic()
    chk.zeppelin("profile", "-o", prof, "--nproc", 1, "--model", spec, "--cluster-name", chk.cluster(1), "--no-check",
                 *chk.size["profile_grid"])
    res = {"profile": str(prof.name), "profile_raw": f"{prof.name}.raw.json", "profile_s": time.monotonic() - t}
    s = chk.size
    plan = _plan(chk, "measured.plan.jsonl", f"hf:{mdir}", chk.cluster(1), s["step_tokens"], s["max_seq_len"],
                 s["steps"], "--recompute", "selective", "--zero-stage", "1", "--profile", prof)
    if step and _same_steps(step["plan"], plan):
        from zeppelin.planner.sim.report import report_for_plan

        metrics = chk.work / "step.metrics.jsonl"
        report, recs = report_for_plan(plan, metrics), step["metrics"]
        res["measured_steps"] = "the whole-step run's (the plan with the profile runs the same work)"
    else:
        report, recs = _run_plan(chk, plan, f"hf:{mdir}", "measured")
        res["measured_steps"] = "a run of the plan made with the profile (its work differs from the preset's plan)"
    res["with_profile"] = _step_summary(report, recs)
    if step:
        res["with_preset"] = {"step_error": step["report"]["summary"]["step_after_first"],
                              "phases": _step_summary(step["report"], step["metrics"])["phases"]}
    return res


# -------------------------------------------------------------------------------------- two ranks
PROBE = r"""
import os, sys, torch, torch.distributed as dist
dev = torch.device(sys.argv[1])
dist.init_process_group(sys.argv[2])
r, w = dist.get_rank(), dist.get_world_size()
if r == 0:
    print("backend", dist.get_backend(), flush=True)
x = torch.full((1024,), float(r + 1), device=dev)
ops = {
 "all_reduce": lambda: dist.all_reduce(x.clone()),
 "broadcast": lambda: dist.broadcast(x.clone(), 0),
 "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(w * 1024, device=dev), x),
 "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(1024 // w, device=dev), x),
 "send_recv": lambda: [op.wait() for op in dist.batch_isend_irecv(
     [dist.P2POp(dist.isend, x, (r + 1) % w), dist.P2POp(dist.irecv, torch.empty_like(x), (r - 1) % w)])],
}
say = print if r == 0 else (lambda *a, **k: None)  # rank 0 reports (two writers would interleave)
for name, op in ops.items():
    say("start", name, flush=True)
    try:
        op()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        say("ok", name, flush=True)
    except Exception as e:
        say("failed", name, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", flush=True)
dist.destroy_process_group()
"""


def _shim_env(backend: str) -> dict:
    """The environment that makes every process group of a process ``backend`` (gpu_check_gloo)."""
    env = dict(os.environ, ZEPPELIN_GPU_CHECK_BACKEND=backend)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GLOO_SHIM), os.environ.get("PYTHONPATH")]))
    return env


def _probe(chk: Check, backend: str) -> dict:
    """Each collective the runtime uses, on 2 ranks of this device, the process groups made
    ``backend`` by the same sitecustomize as the step (a crash names the operation it happened in)."""
    dev = "cpu" if chk.dry else "cuda"
    script = chk.work / "probe.py"
    script.write_text(PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), dev, "nccl"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=min(120, chk.left()), cwd=chk.work,
                           env=_shim_env(backend), check=False)
    except subprocess.TimeoutExpired:
        return {"error": "the probe hung (killed after its timeout)"}
    chk.log.write(f"\n$ probe {backend} on {dev}\n{r.stdout}{r.stderr}[exit {r.returncode}]\n")
    ops: dict = {"backend": next((ln.split(" ", 1)[1] for ln in r.stdout.splitlines() if ln.startswith("backend ")), None)}
    for ln in r.stdout.splitlines():
        word, _, rest = ln.partition(" ")
        name, _, why = rest.partition(" ")
        if word in ("ok", "failed"):
            ops[name] = "ok" if word == "ok" else f"failed: {why}"
        elif word == "start":
            ops.setdefault(name, "crashed (the process died in it)")
    return {"exit_code": r.returncode, "ops": ops}


def section_two_ranks(chk: Check) -> dict:
    """A 2-rank ring step with --verify on one device: the runtime's own path (NCCL on a GPU), then
    gloo for CPU and CUDA tensors (the runtime has no switch for it: a sitecustomize sets it), each
    collective probed first. The dry run's ranks are gloo CPU processes: it runs the runtime's path
    and probes the sitecustomize."""
    s = chk.size
    chk.need(40, "two ranks")
    plan = _plan(chk, "ring2.plan.jsonl", "tiny", chk.cluster(2), s["ring_tokens"], s["ring_max_len"], 1,
                 "--planner", "te-cp", "-O", "cp=2")
    res: dict = {"plan": f"{chk.cluster(2)}, model tiny, te-cp with cp=2 (every sequence on a ring of 2), "
                         f"{s['ring_tokens']} tokens, 1 step"}
    attempts = {"runtime": None} if chk.dry else {"runtime": None, "gloo_cuda": "cpu:gloo,cuda:gloo"}
    res["gloo_cuda_probe"] = _probe(chk, "cpu:gloo,cuda:gloo")
    for name, backend in attempts.items():
        try:
            # a rank that cannot start must not hold the budget: 60 s per collective, 150 s in all
            _, metrics = _run_plan(chk, plan, "tiny", f"ring2-{name}", "--verify", "--timeout", "60",
                                        env=_shim_env(backend) if backend else None, timeout=150)
            v = metrics[-1].get("verify") or {}
            res[name] = {"ok": bool(v.get("ok")), "verify": v, "step_time_s": metrics[-1]["step_time_s"],
                         "bytes_sent": metrics[-1].get("bytes_sent")}
        except Exception as e:  # noqa: BLE001 - recorded (a hang too): the point is to learn what fails
            res[name] = {"ok": False, "error": str(e)}
    if not any(res[n]["ok"] for n in attempts):
        res["why_not"] = "no attempt ran a verified 2-rank step on this device (see each attempt's error)"
    return res


# ---------------------------------------------------------------------------------------- report
def table(results: dict) -> str:
    """The short table: one line per figure the GPU issue checks (a section whose figures are
    missing says so instead)."""
    lines = [f"{'section':<12} {'figure':<44} value"]

    def add(sec, what, val):
        lines.append(f"{sec:<12} {what:<44} {val}")

    for sec in SECTIONS:
        r = results.get(sec, {})
        if not r.get("ok"):
            add(sec, "FAILED" if "error" in r else "SKIPPED", (r.get("error") or r.get("skipped") or "not run")[:120])
            if sec != "kernels" or "local" not in r:  # the kernels' items that ran still have figures
                continue
        try:
            _table_rows(sec, r, lambda what, val, sec=sec: add(sec, what, val))
        except (KeyError, TypeError, ValueError) as e:
            add(sec, "figures missing", f"{type(e).__name__}: {e}")
    return "\n".join(lines) + "\n"


def _table_rows(sec: str, r: dict, add) -> None:
    if sec == "environment":
        add("device / torch / cuda", f"{r['device']} / {r['torch']} / {r['cuda']}")
        add("dispatch bf16 (diag, full, varlen, mask)", ", ".join(r["dispatch"]["bfloat16"].values()))
    elif sec == "kernels":
        for name, row in r["local"].items():
            if "error" in row:
                continue
            add(f"local {name}: runtime / sdpa / varlen TF/s", f"{row['runtime_tflops']:.1f} / "
                f"{row['sdpa_flash_tflops']:.1f} / {row['torch_varlen'].get('tflops', float('nan')):.1f} "
                f"(ratio {row['runtime_vs_best_torch']:.2f}, {row['kernel']})")
        for n, row in r["ring_blocks"].items():
            if "error" in row:
                continue
            add(f"ring block {n}: full / diag vs local", f"{row['full']['vs_local']:.2f} / {row['diag']['vs_local']:.2f}")
        worst = max(((k, v) for k, v in r["errors"].items() if "worst_rel" in v), key=lambda kv: kv[1]["worst_rel"])
        add("bf16 vs fp32, worst relative error", f"{worst[1]['worst_rel']:.2e} ({worst[0]})")
    elif sec in ("whole_step", "cost_model"):
        st = r if sec == "whole_step" else r["with_profile"]
        if sec == "whole_step":
            add("tokens/s, MFU", f"{st['tokens_per_s']:,.0f}, {'-' if st['mfu'] is None else format(st['mfu'], '.1%')}")
            ratio = st["memory_measured_over_predicted"]
            add("peak memory measured / predicted", "-" if ratio is None else f"{ratio:.3f}")
        err = st["step_error"]["median_abs"]
        add("step time prediction error (median |err|)", "-" if err is None else f"{err:.1%}")
    elif sec == "two_ranks":
        for n in ("runtime", "gloo_cuda"):
            if n in r:
                add(f"2-rank ring --verify ({n})", "ok" if r[n].get("ok") else (r[n].get("error") or "-")[:100])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: every code path, meaningless figures")
    ap.add_argument("--out", help="output folder (default: $OUT, else ./gpu_check_out)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="global time budget in seconds (default 420; the dry run, on a loaded CPU: 1200)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated sections to run")
    args = ap.parse_args(argv)
    chk = Check(args)
    want = [x for x in args.sections.split(",") if x]
    bad = [x for x in want if x not in SECTIONS]
    if bad:
        print(f"zeppelin: error: unknown section {bad[0]!r} (known: {', '.join(SECTIONS)})", file=sys.stderr)
        return 2
    fns = {"environment": section_environment, "kernels": section_kernels, "whole_step": section_whole_step,
           "cost_model": section_cost_model, "two_ranks": section_two_ranks}
    for name in want:
        run_section(chk, name, fns[name])
    doc = {"check": "gpu_check", "dry_run": chk.dry, "budget_s": chk.budget,
           "elapsed_s": round(time.monotonic() - chk.t0, 1), "sections": chk.results}
    (chk.out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    txt = table(chk.results)
    (chk.out / "gpu_check.txt").write_text(txt)
    chk.log.close()
    print(txt, end="")
    print(f"[gpu_check] wrote {chk.out / 'gpu_check.json'} in {doc['elapsed_s']} s", file=sys.stderr)
    return 0 if all(r.get("ok") for r in chk.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
