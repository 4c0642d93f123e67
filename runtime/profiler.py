"""`zeppelin profile` measurements, run on every rank under torchrun.

    torchrun --nproc-per-node N -m zeppelin.runtime.profiler --model small -o profile.json [--quick]

Measures, with warm-up and repeated timing (CUDA events on GPU, perf_counter on CPU), all ranks
at once so that shared resources (CPU cores, memory bandwidth, NICs) are loaded as in training:

* attention forward+backward of one layer over a grid of sequence lengths (the local kernel),
  of n x n blocks with every key visible (a ring round's off-diagonal chunk pair),
  and one ring round (a K/V block exchange between ring neighbours concurrent with a block's
  compute) for each group size;
* the runtime's decoder layer without its attention (linear modules, norms, RoPE, residuals) and
  the embedding + LM head + loss, forward+backward, over a grid of token counts;
* the same layer under tensor parallelism (TP-SP, :mod:`zeppelin.runtime.tp`) for every TP degree
  the ranks of a node allow, its compute alone and with each ``--tp-overlap`` mode's collectives;
* the activation memory per token of the runtime's model for each recompute mode (what the
  forward keeps for the backward, what one recomputation holds), counted as the executor does;
* the AdamW step and the gradient all-reduce over the model's parameters (as the executor does);
* what FSDP2 adds to each micro-batch of the whole model (gathers, reduce-scatters), by ZeRO stage;
* one exchange of the runtime's remap beside a GEMM, by tokens moved (what it adds to compute);
* point-to-point latency/bandwidth for each pair class (same node, other node), all-to-all and
  all-gather by group size, and whether two concurrent transfers out of one node share a NIC;
* the topology (``nvidia-smi topo -m``, ``/sys/class/infiniband``; on CPU the local-cpu layout).

Rank 0 fits the :class:`CostProfile` (``zeppelin.planner.costmodel.profile_fit``) and writes it atomically
together with the raw measurements and per-point fit errors.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from zeppelin.schemas.common import InputError
from zeppelin.schemas.io.safefiles import atomic_write_text
from zeppelin.schemas.model import ModelSpec, model_preset

# tp_lin / tp_reps: the TP layer's grid, timed once per TP degree in four variants (its compute
# and the three overlap modes); the quick grid keeps that to a few seconds on 2 CPU ranks
QUICK = dict(att=[16, 32, 64, 128, 256, 512, 1024, 2048], lin=[64, 256, 1024, 2048, 4096],
             tp_lin=[256, 1024, 2048, 4096], tp_reps=2,
             p2p=[2**10, 2**14, 2**17, 2**20, 2**22], remap=[16, 128, 512, 2048], fsdp=512, reps=5,
             warmup=1, recompute_tokens=None)
FULL = dict(att=[16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
            lin=[64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
            tp_lin=[64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384], tp_reps=10,
            p2p=[2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24], remap=[16, 64, 256, 1024, 4096, 16384],
            fsdp=1024, reps=10, warmup=3)
# on a GPU the full grid reaches the sizes a GPU's micro-batches have (32K-token sequences and
# linear layouts): beyond its largest point the cost model scales the last measurement by the
# kernel's work, so the largest point should be one at which the GPU runs at its full rate
# (GPU timings vary little between passes: half the CPU's)
FULL_CUDA = dict(FULL, att=FULL["att"] + [16384, 32768], lin=FULL["lin"] + [32768], reps=5, warmup=2)
# the fewest points each fit takes, timed twice: seconds on a CPU, for checking that profiling runs
# end to end (benchmarks/gpu_check.py --dry-run); its fits are rough
SMOKE = dict(att=[64, 128, 256, 512], lin=[64, 256, 1024], tp_lin=[256, 1024, 2048], tp_reps=1,
             p2p=[2**10, 2**14, 2**17], remap=[16, 128, 512], fsdp=256, mem=(32, 64), reps=2, warmup=1,
             recompute_tokens=None)


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps: int, warmup: int) -> float:
        """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` runs."""
        return self.sweep([fn], reps, warmup)[0]

    def _once(self, fn) -> float:
        if self.cuda:
            # one untimed call first, without a synchronisation: the GPU is still busy with it
            # when the timed call's kernels are queued, as in a step whose host runs ahead of the
            # device layer after layer; timed alone, a call would count the host's launch latency
            fn()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def sweep(self, fns, reps: int, warmup: int, sync=None) -> list[float]:
        """Median seconds of each of ``fns`` over ``reps`` passes that run every function once, in
        turn (after ``warmup`` passes). Round-robin rather than one size after the other: a burst of
        load on a shared machine then slows every grid point a little instead of one point a lot,
        which would bend the fitted curve. ``sync`` (e.g. a barrier) runs before each pass."""
        times: list[list[float]] = [[] for _ in fns]
        for i in range(warmup + reps):
            if sync is not None:
                sync()
            for k, fn in enumerate(fns):
                t = self._once(fn)
                if i >= warmup:
                    times[k].append(t)
        return [statistics.median(ts) for ts in times]


def _dtype(model: ModelSpec) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[model.dtype]


def _attention_fn(q, k, v):
    try:
        from zeppelin.runtime.attn.local import local_attention  # the runtime's own kernel
    except ImportError:  # pragma: no cover - attention engine not installed
        local_attention = None
    L = q.shape[0]
    if local_attention is not None:
        cu = torch.tensor([0, L], dtype=torch.int32, device=q.device)
        return local_attention(q, k, v, cu)
    rep = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(rep, 1).transpose(0, 1)
    vv = v.repeat_interleave(rep, 1).transpose(0, 1)
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True).transpose(0, 1)


# tokens per timed pack of short sequences (see measure_attention), and the most sequences in one
PACK_TOKENS = 2048
PACK_MAX = 64


# on a GPU a pack as large as a micro-batch's local work: the engine's call costs the host a few
# milliseconds whatever it holds, which a micro-batch pays once per layer, not once per sequence
PACK_TOKENS_CUDA = 65536
PACK_MAX_CUDA = 512


def pack_count(L: int, cuda: bool = False) -> int:
    """How many sequences of length ``L`` one timed pack holds (``cuda``: on a GPU)."""
    tokens, most = (PACK_TOKENS_CUDA, PACK_MAX_CUDA) if cuda else (PACK_TOKENS, PACK_MAX)
    return max(1, min(most, tokens // max(int(L), 1)))


def measure_attention(model: ModelSpec, lengths, dev, timer, reps, warmup):
    """Forward+backward of whole sequences of each length through the engine's own path for a
    rank's local (one-rank) group (:func:`zeppelin.runtime.engine.local_sequences`).

    Short sequences are timed in packs of :func:`pack_count` sequences of that length (distinct
    tensors, one engine call), and the pack's time is divided by its size: the engine pays a fixed
    cost per sequence (task, slicing, accumulators, kernel call) and works on data that is not
    cache-resident, both of which one short sequence timed over and over on the same hot tensors
    misses. Returns ``(seconds per sequence, sequences per pack)`` per length."""
    from zeppelin.runtime.engine import local_sequences

    dt = _dtype(model)
    rank = dist.get_rank()
    counts = [pack_count(L, dev.type == "cuda") for L in lengths]

    def make(L, n):
        T = L * n
        q = torch.randn(T, model.num_heads, model.head_dim, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(T, model.num_kv_heads, model.head_dim, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(T, model.num_kv_heads, model.head_dim, device=dev, dtype=dt, requires_grad=True)
        g = torch.randn(T, model.num_heads, model.head_dim, device=dev, dtype=dt)

        def step():
            local_sequences(q, k, v, [L] * n, rank=rank).backward(g)
            q.grad = k.grad = v.grad = None

        return step

    t = timer.sweep([make(L, n) for L, n in zip(lengths, counts)], reps, warmup, sync=dist.barrier)
    return [x / n for x, n in zip(t, counts)], counts


def measure_attention_block(model: ModelSpec, sizes, dev, timer, reps, warmup):
    """Forward+backward of an n x n block whose keys all precede its queries (a ring round's
    off-diagonal chunk pair) through the runtime's block kernels, for each n."""
    from zeppelin.runtime.attn.blocks import attention_block, attention_block_backward

    dt = _dtype(model)

    def make(n):
        q = torch.randn(n, model.num_heads, model.head_dim, device=dev, dtype=dt)
        k = torch.randn(n, model.num_kv_heads, model.head_dim, device=dev, dtype=dt)
        v = torch.randn(n, model.num_kv_heads, model.head_dim, device=dev, dtype=dt)
        g = torch.randn(n, model.num_heads, model.head_dim, device=dev, dtype=dt)
        qr, kr = (n, 2 * n), (0, n)

        def step():
            o, lse = attention_block(q, k, v, qr, kr)
            attention_block_backward(g, q, k, v, o, lse, qr, kr)

        return step

    return timer.sweep([make(n) for n in sizes], reps, warmup, sync=dist.barrier)


def _stand_in_layout(T: int, dev, tp=None):
    """A layout of ``T`` tokens whose attention is an elementwise stand-in (Q + K + V, K/V repeated
    over the query heads): what the runtime's modules cost around the attention kernel."""
    from zeppelin.runtime.model import Layout

    class _StandIn(Layout):
        def __init__(self):
            self.attn_positions = torch.arange(T, device=dev)
            self.tp = tp

        def attention(self, q, k, v):
            r = q.shape[1] // k.shape[1]
            return q + k.repeat_interleave(r, 1) + v.repeat_interleave(r, 1)

    return _StandIn()


def measure_model_parts(model: ModelSpec, tokens, dev, timer, reps, warmup):
    """The runtime's own modules, forward+backward, over a grid of token counts:

    * one decoder layer (:class:`zeppelin.runtime.model.Block`: norms, Q/K/V/O, RoPE, residuals,
      SwiGLU/GELU MLP) with its attention replaced by an elementwise stand-in, i.e. everything the
      runtime's ``linear`` phase spends per layer;
    * the model without layers: embedding, final norm, LM head and the loss (once per model).

    Returns (layer seconds per token count, ``(token counts, head seconds)``): on a GPU the head
    only where its fp32 logits' forward and backward (``16 V`` bytes per token) take at most half
    of the device's memory."""
    from zeppelin.runtime.model import LlamaModel, compute_dtype, rope_tables

    lm = LlamaModel(model.model_copy(update={"num_layers": 1})).to(dev)
    blk = lm.layers[0]
    lm.layers = torch.nn.ModuleList()
    dt = compute_dtype(model)

    def make(T):
        lay = _stand_in_layout(T, dev)
        cos, sin = rope_tables(lay.attn_positions, model.head_dim, model.rope_theta)
        x = torch.randn(T, model.hidden, device=dev, dtype=dt, requires_grad=True)
        g = torch.randn(T, model.hidden, device=dev, dtype=dt)
        toks = torch.randint(model.vocab_size, (T,), device=dev)

        def layer():
            blk(x, cos, sin, lay, None).backward(g)
            x.grad = None
            blk.zero_grad(set_to_none=True)

        def head():
            loss, _ = lm(toks, toks, lay)
            loss.backward()
            lm.zero_grad(set_to_none=True)

        return [layer, head]

    cap = torch.cuda.get_device_properties(dev).total_memory / 2 if dev.type == "cuda" else float("inf")
    head_tokens = [T for T in tokens if 16.0 * model.vocab_size * T <= cap] or [min(tokens)]
    jobs = [(part, fn) for T in tokens for part, fn in zip(("layer", "head"), make(T))
            if part == "layer" or T in head_tokens]
    t = timer.sweep([fn for _, fn in jobs], reps, warmup, sync=dist.barrier)
    lin = [x for (part, _), x in zip(jobs, t) if part == "layer"]
    head = [x for (part, _), x in zip(jobs, t) if part == "head"]
    return lin, (head_tokens, head)


def tp_degrees(gpn: int, model: ModelSpec) -> list[int]:
    """TP degrees the profiler measures: powers of two from 2 up to the ranks of a node (a TP group
    lives inside one node) that the model's query heads allow."""
    out, G = [], 2
    while G <= gpn and G <= model.num_heads:
        out.append(G)
        G *= 2
    return out


class _NoComm:
    """Short-circuits the TP collectives of :mod:`zeppelin.runtime.tp` while active: all-gathers
    return the rank's own rows repeated, reduce-scatters return the rank's rows unreduced, ring
    steps post nothing and receive a buffer of zeros of the right shape. What is left is the TP
    layer's compute (its GEMMs on the rank's shards, gathers into the full buffer, slicing and
    copies) without any communication or wait."""

    def __enter__(self):
        from zeppelin.runtime import tp as tpmod

        self.mod = tpmod
        self.saved = (tpmod._all_gather_rows, tpmod._reduce_scatter_rows, tpmod._p2p)

        def all_gather(x, rows, g, async_op=False):
            m = max(rows)
            src = x if x.shape[0] == m else torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])
            out = src.repeat(g.size, *([1] * (x.dim() - 1)))

            def finish():
                parts = [out[j * m: j * m + rows[t]] for j, t in enumerate(g.group_order)]
                res = [None] * g.size
                for t, part in zip(g.group_order, parts):
                    res[t] = part
                return torch.cat(res)

            return finish

        def reduce_scatter(p, rows, g, async_op=False):
            off = sum(rows[: g.pos])
            out = p[off: off + rows[g.pos]].clone()
            return lambda: out

        def p2p(send, send_to, recv_shape, recv_from, like):
            # zeros, not uninitialised memory: stray denormals would slow the GEMMs that follow
            return [], torch.zeros(recv_shape, dtype=like.dtype, device=like.device)

        tpmod._all_gather_rows, tpmod._reduce_scatter_rows, tpmod._p2p = all_gather, reduce_scatter, p2p
        return self

    def __exit__(self, *exc):
        self.mod._all_gather_rows, self.mod._reduce_scatter_rows, self.mod._p2p = self.saved
        return False


def measure_tp_layer(model: ModelSpec, tokens, gpn: int, dev, timer, reps, warmup, modes=None):
    """The runtime's decoder layer under TP-SP (:meth:`zeppelin.runtime.model.Block.forward` with a
    :class:`~zeppelin.runtime.model.TPContext`: column-parallel Q/K/V and gate/up, row-parallel O
    and down, attention replaced by the elementwise stand-in of :func:`measure_model_parts`),
    forward+backward, for each TP degree of :func:`tp_degrees`: every rank takes part, in groups of
    G consecutive ranks (all groups at once, as in training; ranks left over idle), each group
    holding ``T`` tokens of a unit's linear buffer split near-evenly over its ranks.

    ``compute``: with the collectives short-circuited (:class:`_NoComm`); then per ``--tp-overlap``
    mode (``modes``, default all) with the real collectives of that mode. Per G:
    ``{"compute": [[T, s]...], "<mode>": [[T, s]...]}``, seconds of the slowest rank."""
    from zeppelin.runtime.model import LlamaModel, TPContext, compute_dtype, rope_tables
    from zeppelin.runtime.tp import OVERLAP_MODES, TPGroup
    from zeppelin.schemas.layout import split_even

    world, rank = dist.get_world_size(), dist.get_rank()
    dt = compute_dtype(model)
    lm = LlamaModel(model.model_copy(update={"num_layers": 1})).to(dev)
    blk = lm.layers[0]
    modes = list(modes or OVERLAP_MODES)
    out: dict[str, dict[str, list]] = {}
    for G in tp_degrees(gpn, model):
        base = rank // G * G
        member = base + G <= world
        groups = [dist.new_group(list(range(b, b + G))) for b in range(0, world - G + 1, G)]
        grp = TPGroup(ranks=list(range(base, base + G)), rank=rank, pg=groups[rank // G]) if member else None

        def make(T, mode):
            if not member:
                return lambda: None
            lay = _stand_in_layout(T, dev, TPContext(grp, split_even(T, G), mode))
            rows = lay.tp.rows[grp.pos]
            cos, sin = rope_tables(lay.attn_positions, model.head_dim, model.rope_theta)
            x = torch.randn(rows, model.hidden, device=dev, dtype=dt, requires_grad=True)
            g = torch.randn(rows, model.hidden, device=dev, dtype=dt)

            def layer():
                blk(x, cos, sin, lay, None).backward(g)
                x.grad = None
                blk.zero_grad(set_to_none=True)

            return layer

        with _NoComm():
            comp = timer.sweep([make(T, "none") for T in tokens], reps, warmup, sync=dist.barrier)
        per_mode = {m: timer.sweep([make(T, m) for T in tokens], reps, warmup, sync=dist.barrier) for m in modes}
        vals = comp + [s for m in modes for s in per_mode[m]]
        tt = torch.tensor([x if member else 0.0 for x in vals], dtype=torch.float64)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        got = [float(x) for x in tt]
        n = len(tokens)
        row = {"compute": [[T, s] for T, s in zip(tokens, got[:n])]}
        for i, m in enumerate(modes):
            row[m] = [[T, s] for T, s in zip(tokens, got[n * (i + 1): n * (i + 2)])]
        out[str(G)] = row
    return out


MEMORY_TOKENS = (128, 256)  # two lengths: the slope is per token, free of per-step constants


def measure_activation_memory(model: ModelSpec, dev, tokens=MEMORY_TOKENS) -> dict[str, dict[str, float]]:
    """Activation bytes per token of the runtime's model for each recompute mode: one forward and
    backward of one sequence (local attention) at two lengths, counted as the executor counts
    them (:class:`zeppelin.runtime.fsdp.SavedActivations`: what the forward keeps, what one
    recomputation holds). Measured with one and two layers - layers are identical, so the whole
    model is ``layers x (two - one) + the rest`` without building it; the recomputation is per
    layer. Returns ``{mode: {"activations": bytes per token, "recompute": bytes per token}}``."""
    from zeppelin.runtime.attn.local import local_attention
    from zeppelin.runtime.fsdp import RECOMPUTE_MODES, SavedActivations, apply_recompute
    from zeppelin.runtime.model import Layout, LlamaModel

    class _Local(Layout):
        def __init__(self, T):
            self.attn_positions = torch.arange(T, device=dev)

        def attention(self, q, k, v):
            return local_attention(q, k, v, [0, q.shape[0]])

    def held(layers: int, mode: str, T: int) -> tuple[int, int]:
        lm = LlamaModel(model.model_copy(update={"num_layers": layers})).to(dev)
        tracker = SavedActivations()
        apply_recompute(lm, mode, tracker)
        tracker.watch_blocks(lm)
        toks = torch.randint(model.vocab_size, (T,), device=dev)
        with tracker.hooks():  # labels apart from the inputs, as the executor has them
            loss, _ = lm(toks, toks.roll(-1), _Local(T))
        loss.backward()
        return tracker.release()[0], tracker.recompute_peak

    out = {}
    t1, t2 = tokens
    for mode in RECOMPUTE_MODES:
        per = {}
        for layers in (1, 2):
            (a1, r1), (a2, r2) = held(layers, mode, t1), held(layers, mode, t2)
            per[layers] = ((a2 - a1) / (t2 - t1), (r2 - r1) / (t2 - t1))
        layer = per[2][0] - per[1][0]
        out[mode] = {"activations": max(model.num_layers * layer + per[1][0] - layer, 0.0),
                     "recompute": max(per[2][1], 0.0)}
    return out


RECOMPUTE_TIME_TOKENS = 1024  # one sequence; the quick and smoke grids leave the measurement out (too noisy
# at their sizes on a CPU: the cost model then prices the forward each mode runs again from the kernels)


def measure_recompute_time(model: ModelSpec, dev, timer, reps, warmup, tokens: int = RECOMPUTE_TIME_TOKENS
                           ) -> dict[str, float]:
    """The time each recompute mode adds to the forward and backward of the decoder layers, as a
    fraction of their time without it (``ActivationMemory.time_factor``): one sequence of
    ``tokens`` through the runtime's model of one and of two layers (the difference is one layer;
    the head is left out), each mode on two layers. Returns ``{mode: fraction}``."""
    from zeppelin.runtime.attn.local import local_attention
    from zeppelin.runtime.fsdp import RECOMPUTE_MODES, apply_recompute
    from zeppelin.runtime.model import Layout, LlamaModel

    class _Local(Layout):
        def __init__(self, T):
            self.attn_positions = torch.arange(T, device=dev)

        def attention(self, q, k, v):
            return local_attention(q, k, v, [0, q.shape[0]])

    toks = torch.randint(model.vocab_size, (tokens,), device=dev)
    lay = _Local(tokens)

    def step_of(layers: int, mode: str):
        lm = LlamaModel(model.model_copy(update={"num_layers": layers}), seed=0).to(dev)
        apply_recompute(lm, mode)

        def run():
            loss, _ = lm(toks, toks.roll(-1), lay)
            loss.backward()
            lm.zero_grad(set_to_none=True)

        return run

    cases = [(1, "none"), *((2, m) for m in RECOMPUTE_MODES)]
    t = dict(zip(cases, timer.sweep([step_of(*c) for c in cases], reps, warmup, sync=dist.barrier)))
    layers_s = 2 * max(t[(2, "none")] - t[(1, "none")], 1e-12)
    # noise can make the one-layer difference tiny: the fraction stays within the profile's bound
    return {m: min(max((t[(2, m)] - t[(2, "none")]) / layers_s, 0.0), 10.0) for m in RECOMPUTE_MODES if m != "none"}


def _model_grads(model: ModelSpec, dev):
    from zeppelin.runtime.model import LlamaModel

    lm = LlamaModel(model).to(dev)
    params = list(lm.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def measure_optimizer(model: ModelSpec, dev, timer, reps, warmup) -> tuple[float, int]:
    """The runtime's AdamW step (same settings as the executor) over the model's parameters;
    returns (seconds, parameter count)."""
    params = _model_grads(model, dev)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    dist.barrier()
    return timer(opt.step, reps, warmup), sum(p.numel() for p in params)


def measure_grad_allreduce(model: ModelSpec, dev, reps, warmup) -> dict[str, float]:
    """The executor's gradient all-reduce (flatten, SUM all-reduce, copy back) over aligned groups
    of each power-of-two size; per size the time of the rank that waited least (the others also
    wait for the last rank to arrive)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grads = [p.grad for p in _model_grads(model, dev)]
    out: dict[str, float] = {}
    G = 2
    while G <= world:
        grp = dist.new_group(list(range(G)))
        times = []
        for i in range(warmup + reps):
            dist.barrier()
            t0 = time.perf_counter()
            if rank < G:
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=grp)
                off = 0
                for g in grads:
                    g.copy_(flat[off:off + g.numel()].view_as(g))
                    off += g.numel()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        tt = torch.tensor([statistics.median(times) if rank < G else float("inf")], dtype=torch.float64)
        dist.all_reduce(tt, op=dist.ReduceOp.MIN)
        out[str(G)] = float(tt)
        G *= 2
    return out


def _pingpong(a: int, b: int, nbytes: int, dev, reps: int, warmup: int, stat=min) -> float | None:
    """One-way time between ranks a and b (half the round trip), ``stat`` of the repetitions (the
    fastest by default: a busy machine's scheduling only ever adds to a transfer, and a link's
    alpha-beta fit needs the transfer's own cost); None on ranks not involved."""
    rank = dist.get_rank()
    buf = torch.empty(max(nbytes // 4, 1), dtype=torch.float32, device=dev)
    if rank not in (a, b):
        return None
    peer = b if rank == a else a
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        if rank == a:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) / 2)
    return stat(times)


def measure_p2p(pairs: dict[str, tuple[int, int]], sizes, dev, reps, warmup, stat=min, attempts: int = 3):
    """Per link class, the one-way time of each message size. Where a smaller message came out slower
    than the largest (a busy machine delayed every repetition of it), the series is measured again,
    up to ``attempts`` times in all, each size keeping its fastest (every rank decides alike: the
    times are all-reduced)."""
    res: dict[str, list[float]] = {}
    for cls, (a, b) in pairs.items():
        best: list[float] | None = None
        for _ in range(max(1, attempts)):
            ts = []
            for n in sizes:
                dist.barrier()
                t = _pingpong(a, b, n, dev, reps, warmup, stat)
                tt = torch.tensor([t if t is not None else 0.0], dtype=torch.float64)
                dist.all_reduce(tt, op=dist.ReduceOp.MAX)
                ts.append(float(tt))
            best = ts if best is None else [min(x, y) for x, y in zip(best, ts)]
            if max(best[:-1], default=0.0) <= best[-1]:
                break
        res[cls] = best
    return res


def measure_concurrent_inter(gpn: int, nbytes: int, dev, reps, warmup) -> float | None:
    """Ratio of per-transfer time with two concurrent node0->node1 transfers vs one (2 = shared NIC)."""
    world = dist.get_world_size()
    if world < 2 * gpn or gpn < 2:
        return None
    single = measure_p2p({"x": (0, gpn)}, [nbytes], dev, reps, warmup, statistics.median, 1)["x"][0]
    # (a median, as the concurrent transfers' below: the ratio compares like with like)
    rank = dist.get_rank()
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)
    pairs = {0: gpn, 1: gpn + 1, gpn: 0, gpn + 1: 1}
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        t0 = time.perf_counter()
        if rank in pairs:
            if rank < gpn:
                dist.send(buf, pairs[rank])
                dist.recv(buf, pairs[rank])
            else:
                dist.recv(buf, pairs[rank])
                dist.send(buf, pairs[rank])
        if i >= warmup:
            times.append((time.perf_counter() - t0) / 2)
    tt = torch.tensor([statistics.median(times) if rank in pairs else 0.0], dtype=torch.float64)
    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    return float(tt) / single if single > 0 else None


def measure_collectives(nbytes: int, dev, reps, warmup) -> dict[str, dict[str, float]]:
    """All-to-all and all-gather time over aligned groups of each power-of-two size (first group)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    out: dict[str, dict[str, float]] = {"alltoall": {}, "allgather": {}}
    G = 2
    while G <= world:
        grp = dist.new_group(list(range(G)))
        n = max(nbytes // 4 // G * G, G)
        x = torch.randn(n, device=dev)
        y = torch.empty_like(x)
        parts = [torch.empty(n // G, device=dev) for _ in range(G)]
        for name in ("alltoall", "allgather"):
            t = None
            if rank < G:
                def op():
                    if name == "alltoall":
                        dist.all_to_all_single(y, x, group=grp)
                    else:
                        dist.all_gather(parts, x[: n // G].contiguous(), group=grp)
                try:
                    t = Timer(dev)(op, reps, warmup)
                except (RuntimeError, ValueError):  # e.g. a backend without all-to-all
                    t = None
            tt = torch.tensor([t if t is not None else -1.0], dtype=torch.float64)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            if float(tt) > 0:
                out[name][str(G)] = float(tt)
        G *= 2
    return out


def measure_ring_round(model: ModelSpec, lengths, nodes_gpn: int, dev, reps, warmup) -> dict[str, list]:
    """One ring round per group size G: each rank of ranks 0..G-1 sends its K/V block (L/G tokens)
    to the next and receives from the previous while computing a full block of attention."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dt = _dtype(model)
    res: dict[str, list] = {}
    G = 2
    while G <= world:
        row = []
        for L in lengths:
            n = max(L // G, 1)
            q = torch.randn(n, model.num_heads, model.head_dim, device=dev, dtype=dt)
            kv = torch.randn(2, n, model.num_kv_heads, model.head_dim, device=dev, dtype=dt)
            recv = torch.empty_like(kv)
            t = None
            if rank < G:
                nxt, prv = (rank + 1) % G, (rank - 1) % G

                def rnd():
                    ops = [dist.P2POp(dist.isend, kv, nxt), dist.P2POp(dist.irecv, recv, prv)]
                    works = dist.batch_isend_irecv(ops)
                    _attention_fn(q, kv[0], kv[1])
                    for w in works:
                        w.wait()
                t = Timer(dev)(rnd, reps, warmup)
            tt = torch.tensor([t if t is not None else 0.0], dtype=torch.float64)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            row.append([L, float(tt)])
        res[str(G)] = row
        G *= 2
    return res


def measure_remap_exchange(model: ModelSpec, moved, dev, timer, reps, warmup) -> list[list[float]]:
    """What one exchange of the runtime's remap (:class:`zeppelin.runtime.remap.Remapper`: one
    ``batch_isend_irecv`` with the partner, the local rows copied meanwhile, then the wait) adds to
    the compute around it, for each count of tokens moved: ranks in pairs (0-1, 2-3, ...) run a
    decoder-layer-sized GEMM and then the exchange, and the same GEMM alone; the difference is the
    exchange with its waits, as training meets it (partners that also compute, a loaded machine).
    Returns ``[[bytes per direction, seconds], ...]`` of the slowest rank; empty on an odd world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2 or world % 2:
        return []
    dt = _dtype(model)
    peer = rank ^ 1
    T = max(moved)
    w = torch.randn(model.hidden, model.hidden, device=dev, dtype=dt)
    x = torch.randn(2 * T, model.hidden, device=dev, dtype=dt)

    def make(m, exchange):
        send_rows = torch.arange(m, device=dev)
        keep_rows = torch.arange(m, 2 * T, device=dev)
        out = torch.empty_like(x)

        def step():
            y = x @ w
            if exchange:
                buf = y.index_select(0, send_rows)
                rb = torch.empty_like(buf)
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, rb, peer)])
                out.index_copy_(0, keep_rows, y.index_select(0, keep_rows))
                for wk in works:
                    wk.wait()
                out.index_copy_(0, send_rows, rb)
            return y

        return step

    tot = timer.sweep([make(m, True) for m in moved], reps, warmup, sync=dist.barrier)
    comp = timer.sweep([make(m, False) for m in moved], reps, warmup, sync=dist.barrier)
    tt = torch.tensor([max(a - b, 0.0) for a, b in zip(tot, comp)], dtype=torch.float64)
    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    width = model.hidden * torch.tensor([], dtype=dt).element_size()
    return [[float(m * width), float(s)] for m, s in zip(moved, tt)]


def measure_fsdp_microbatch(model: ModelSpec, tokens: int, dev, timer, reps, warmup) -> dict[str, float]:
    """What FSDP2 adds to each micro-batch of the runtime's model, by ZeRO stage: the whole model
    (its attention replaced by an elementwise stand-in) forward+backward on ``tokens`` tokens per
    rank, sharded over every rank as the executor shards it (:func:`zeppelin.runtime.fsdp.shard_model`:
    parameters gathered before the forward, and for ZeRO-3 again before the backward; gradients
    reduce-scattered after every micro-batch's backward), minus the same model unsharded. On a CPU
    both run under the executor's memory probe (:class:`~zeppelin.runtime.fsdp.SavedActivations`,
    which scans the whole parameters an FSDP model holds at every saved tensor), as ``zeppelin run``
    runs them. Seconds of the slowest rank per micro-batch, keys '1' (ZeRO-1 and 2 run alike) and
    '3'."""
    import copy

    from zeppelin.runtime.fsdp import SavedActivations, dp_mesh, shard_model
    from zeppelin.runtime.model import LlamaModel

    world = dist.get_world_size()
    lay = _stand_in_layout(tokens, dev)
    toks = torch.randint(model.vocab_size, (tokens,), device=dev)
    base = LlamaModel(model, seed=0).to(dev)
    mesh = dp_mesh(world, dev.type)

    def make(m):
        def step():
            loss, _ = m(toks, toks, lay)
            loss.backward()
            m.zero_grad(set_to_none=True)

        return step

    sharded = {str(z): shard_model(copy.deepcopy(base), mesh, z) for z in (1, 3)}
    names = ["plain", *sharded]
    steps = [make(base), *(make(m) for m in sharded.values())]
    if dev.type != "cuda":  # the executor's memory probe, as it runs on a CPU: plain (replicated) and FSDP
        steps = [_probed(f, SavedActivations(m if z != "plain" else None), m)
                 for f, z, m in zip(steps, names, [base, *sharded.values()])]
    t = timer.sweep(steps, reps, warmup, sync=dist.barrier)
    tt = torch.tensor([max(x - t[0], 0.0) for x in t[1:]], dtype=torch.float64)
    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    return {z: float(v) for z, v in zip(names[1:], tt)}


def _probed(step, tracker, model):
    """``step`` run as the executor runs a micro-batch on a CPU: under ``tracker``'s hooks."""
    tracker.watch_blocks(model)

    def run():
        with tracker.hooks():
            step()
        tracker.release()

    return run


class _Arrived:
    """A finished exchange that hands over a block of the right shape (see :class:`_Loopback`)."""

    def __init__(self, block):
        self.block = block

    def start(self):
        return self

    def finish(self, idle=None):
        return self.block


class _Loopback:
    """A ring transport whose exchanges complete at once with a block of the shape the ring
    predecessor would send: the ring's compute (blocks, merges, accumulators) without its
    communication."""

    def __init__(self, rank: int):
        self.rank = rank
        self._blocks: dict = {}

    def exchange(self, transfers, payload, row_shape, dtype, device):
        rows = next((n for _, dst, n in transfers if dst == self.rank), 0)
        key = (rows, tuple(row_shape), dtype)
        if key not in self._blocks:
            self._blocks[key] = torch.randn((rows, *row_shape), dtype=dtype, device=device)
        return _Arrived(self._blocks[key])


def ring_group_sizes(world: int, gpn: int) -> list[int]:
    """Ring sizes the profiler measures: every size up to a node (planners form rings of any size
    there, e.g. 3 of 4 ranks), powers of two beyond it."""
    sizes = set(range(2, min(world, gpn) + 1))
    G = 2
    while G <= world:
        sizes.add(G)
        G *= 2
    return sorted(sizes)


def measure_ring_attention(model: ModelSpec, lengths, gpn: int, dev, timer, reps, warmup) -> dict[str, dict[str, list]]:
    """The runtime's ring attention (:func:`zeppelin.runtime.attn.ring.ring_forward` +
    ``ring_backward``) of one zigzag-split sequence of each length, forward+backward, for each
    group size G of :func:`ring_group_sizes`: every rank takes part, in rings of G consecutive
    ranks (all rings at once, so the machine is loaded as in training; ranks left over idle). ``total``: with the real exchanges (what a ring costs the
    runtime, waits included); ``compute``: the same ring with its exchanges short-circuited
    (:class:`_Loopback`), i.e. the compute alone. Per G: ``{"total": [[L, s]...], "compute": ...}``,
    seconds of the slowest rank."""
    from zeppelin.runtime.attn.ring import RingSpec, ring_backward, ring_forward
    from zeppelin.runtime.attn.transport import Transport
    from zeppelin.schemas.layout import zigzag_ranges

    world, rank = dist.get_world_size(), dist.get_rank()
    dt = _dtype(model)
    out: dict[str, dict[str, list]] = {}
    for G in ring_group_sizes(world, gpn):
        base = rank // G * G
        member = base + G <= world
        Ls = [L for L in lengths if L >= 4 * G]
        real = Transport(rank=rank)
        loop = _Loopback(rank)

        def make(L, tr):
            if not member:
                return lambda: None
            spec = RingSpec(ranks=list(range(base, base + G)), pos=rank - base, seqs=[zigzag_ranges(L, G)])
            n = spec.rows(rank - base)
            q = torch.randn(n, model.num_heads, model.head_dim, device=dev, dtype=dt)
            k = torch.randn(n, model.num_kv_heads, model.head_dim, device=dev, dtype=dt)
            v = torch.randn(n, model.num_kv_heads, model.head_dim, device=dev, dtype=dt)
            g = torch.randn(n, model.num_heads, model.head_dim, device=dev, dtype=dt)

            def step():
                o, lse = ring_forward(q, k, v, spec, tr)
                ring_backward(g, q, k, v, o, lse, spec, tr)

            return step

        tot = timer.sweep([make(L, real) for L in Ls], reps, warmup, sync=dist.barrier)
        comp = timer.sweep([make(L, loop) for L in Ls], reps, warmup, sync=dist.barrier)
        tt = torch.tensor([x if member else 0.0 for x in tot + comp], dtype=torch.float64)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        vals = [float(x) for x in tt]
        out[str(G)] = {"total": [[L, s] for L, s in zip(Ls, vals[:len(Ls)])],
                       "compute": [[L, s] for L, s in zip(Ls, vals[len(Ls):])]}
    return out


def detect_topology(world: int, nodes: int) -> dict:
    info: dict = {"device": "cuda" if torch.cuda.is_available() else "cpu", "hostname": platform.node()}
    if torch.cuda.is_available() and shutil.which("nvidia-smi"):
        try:
            text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
            from zeppelin.planner.costmodel.profile_fit import infiniband_devices, parse_nvidia_smi_topo

            topo = parse_nvidia_smi_topo(text)
            info.update(gpus_per_node=topo.num_gpus, nvswitch=topo.nvswitch, nics=topo.nics,
                        gpu_nic=topo.gpu_nic, nic_rates_GBps=infiniband_devices(),
                        gpu_name=torch.cuda.get_device_name(0),
                        gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / 1e9)
        except (OSError, subprocess.SubprocessError, InputError) as e:
            info["topology_error"] = str(e)
    else:
        info.update(gpus_per_node=world // nodes, nodes=nodes, cpu_count=os.cpu_count())
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="zeppelin.runtime.profiler")
    ap.add_argument("--model", default="small")
    ap.add_argument("--nodes", type=int, default=1, help="how many 'nodes' the processes form (local-cpu)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the smallest grids (seconds; rough fits)")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--cluster-name", default="")
    a = ap.parse_args(argv)
    # torch renames these collectives; the TP timings call them through the runtime's own layer,
    # and the rename's notice (once per rank and name) is not for the user of `zeppelin profile`
    import warnings

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            r"is deprecated", category=FutureWarning)

    model = model_preset(a.model) if not a.model.endswith(".json") else ModelSpec.model_validate_json(open(a.model).read())
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=_dt.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world % a.nodes:
        if rank == 0:
            print(f"zeppelin: error: --nodes {a.nodes} does not divide {world} processes", file=sys.stderr)
        dist.destroy_process_group()
        return 2

    def say(msg):
        if rank == 0:
            print(f"[profile] {msg}", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    grid_name = "smoke" if a.smoke else "quick" if a.quick else "full"
    say(f"{world} ranks ({a.nodes} node(s) x {world // a.nodes}), model {model.name}, {grid_name} grid")
    raw = _measure(model, {"smoke": SMOKE, "quick": QUICK, "full": FULL_CUDA if cuda else FULL}[grid_name], a.nodes,
                   dev, say)
    if rank == 0:
        from zeppelin.planner.costmodel.profile_fit import build_profile

        raw["elapsed_s"] = time.perf_counter() - t_start
        prof, report = build_profile(raw, model, cluster_name=a.cluster_name)
        doc = json.loads(prof.model_dump_json())
        atomic_write_text(a.output, json.dumps(doc, indent=2) + "\n")
        atomic_write_text(a.output + ".raw.json", json.dumps(dict(raw, fit_report=report), indent=2) + "\n")
        print(json.dumps(report))
        say(f"wrote {a.output} (raw measurements: {a.output}.raw.json) in {time.perf_counter() - t_start:.1f} s")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _measure(model: ModelSpec, grid: dict, nodes: int, dev: torch.device, say) -> dict:
    """Every measurement of the profile on this machine (collective), as the raw record the fit reads."""
    world = dist.get_world_size()
    gpn = world // nodes
    reps, warm = grid["reps"], grid["warmup"]
    timer = Timer(dev)
    say("attention forward+backward ...")
    att, att_packs = measure_attention(model, grid["att"], dev, timer, reps, warm)
    blocks = grid["att"][:-1]
    say("attention blocks of ring rounds (every key visible) ...")
    att_block = measure_attention_block(model, blocks, dev, timer, reps, warm)
    say("decoder layer without attention, and embedding + LM head + loss, forward+backward ...")
    lin, (head_tokens, head) = measure_model_parts(model, grid["lin"], dev, timer, reps, warm)
    tp_lin = {}
    if world > 1 and tp_degrees(gpn, model):
        say(f"decoder layer without attention under tensor parallelism (TP {', '.join(map(str, tp_degrees(gpn, model)))}) ...")
        tp_lin = measure_tp_layer(model, grid["tp_lin"], gpn, dev, timer, grid["tp_reps"], warm)
    say("activation memory per token by recompute mode ...")
    act_mem = measure_activation_memory(model, dev, grid.get("mem", MEMORY_TOKENS))
    rec_tokens = grid.get("recompute_tokens", RECOMPUTE_TIME_TOKENS)
    if rec_tokens:
        say("the time each recompute mode adds ...")
        for mode, frac in measure_recompute_time(model, dev, timer, reps, warm, rec_tokens).items():
            act_mem[mode]["time_factor"] = frac
    say("optimizer step and gradient all-reduce ...")
    opt_s, nparams = measure_optimizer(model, dev, timer, reps, warm)
    ar = measure_grad_allreduce(model, dev, reps, warm) if world > 1 else {}
    pairs = {}
    if gpn >= 2:
        pairs["intra"] = (0, 1)
    if nodes >= 2:
        pairs["inter"] = (0, gpn)
    say(f"point-to-point {', '.join(pairs) or '(single rank: none)'} ...")
    p2p = measure_p2p(pairs, grid["p2p"], dev, reps, warm) if pairs else {}
    say("all-to-all / all-gather by group size ...")
    coll = measure_collectives(grid["p2p"][-1], dev, reps, warm) if world > 1 else {"alltoall": {}, "allgather": {}}
    say("ring rounds by group size ...")
    ring = measure_ring_round(model, grid["att"][-3:], gpn, dev, reps, warm) if world > 1 else {}
    say("the runtime's ring attention by group size ...")
    # rings carry the sequences too long for one rank: measure them up to twice the longest local length
    ring_lengths = [*grid["att"], 2 * grid["att"][-1]]
    ring_att = measure_ring_attention(model, ring_lengths, gpn, dev, timer, reps, warm) if world > 1 else {}
    say("what FSDP2 adds to each micro-batch, by ZeRO stage ...")
    fsdp_mb = measure_fsdp_microbatch(model, grid["fsdp"], dev, timer, reps, warm) if world > 1 else {}
    say("the runtime's remap exchange by tokens moved ...")
    remap_ex = measure_remap_exchange(model, grid["remap"], dev, timer, reps, warm) if world > 1 else []
    share = measure_concurrent_inter(gpn, grid["p2p"][-1], dev, reps, warm) if nodes >= 2 else None
    return dict(model=model.name, dtype=model.dtype, world=world, nodes=nodes, attention_lengths=grid["att"],
                attention_s=att, attention_pack_counts=att_packs, attention_block_sizes=blocks,
                attention_block_s=att_block, linear_tokens=grid["lin"], linear_s=lin, head_tokens=head_tokens,
                head_s=head, tp_linear_s=tp_lin,
                optimizer_s=opt_s, num_params=nparams, grad_allreduce_s=ar, p2p_bytes=grid["p2p"], p2p_s=p2p,
                collectives_s=coll, collective_bytes=grid["p2p"][-1], ring_round_s=ring,
                ring_attention_s=ring_att, remap_exchange_s=remap_ex, fsdp_microbatch_s=fsdp_mb,
                activation_memory=act_mem, concurrent_inter_ratio=share, topology=detect_topology(world, nodes))


if __name__ == "__main__":
    sys.exit(main())
