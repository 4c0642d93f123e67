"""The analytic cost model (docs/DESIGN.md, "Cost model"), vectorised over arrays of lengths.

All times are seconds, sizes are tokens, bytes are bytes. Per-layer quantities are for one
transformer layer; ``*_model`` helpers multiply by the number of layers and add embeddings and the
LM head. A *unit* is one data-parallel replica of ``tp`` GPUs (``tp == 1``: one GPU).

Formulas (h hidden, g KV heads, d head dim, f FFN, m = 3 for SwiGLU / 2 for GELU):

* linear FLOPs, forward, per layer:   2 * T * (h*(h + 2*g*d) + h*h + m*h*f)
* attention FLOPs, forward, causal:   2 * L^2 * h          (QK^T and PV, half masked)
* with a sliding window w:            4 * (L*w - w^2/2) * h once L > w (the visible pairs); a
  model mixing window and full layers: the mean over its layer types, so ``num_layers x`` a
  per-layer time is their sum; rings priced block by block (:meth:`CostModel.ring_window_rounds`)
* mixture of experts: linear FLOPs of the active experts (top-k + shared), memory of all of them
* backward = ``backward_linear_factor`` (2.0) / ``backward_attention_factor`` (2.5) x forward
* kernel time = overhead + FLOPs / (peak * eff_max * n / (n + n_half))
* link time   = alpha + bytes / bandwidth
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from zeppelin.schemas.cluster import ClusterSpec
from zeppelin.schemas.model import ModelSpec
from zeppelin.schemas.profile import CostProfile, KernelEfficiency, LinkCost, default_profile

ArrayLike = "np.ndarray | float | int"

def _arr(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def causal_prefix(x, ks, ke) -> np.ndarray:
    """Causal (q, k) pairs with q < x, ks <= k < ke and k <= q, as areas (continuous positions)."""
    x, ks, ke = _arr(x), _arr(ks), _arr(ke)
    lk = np.maximum(ke - ks, 0.0)
    m = np.clip(x - ks, 0.0, lk)
    return m * m / 2.0 + np.maximum(x - ke, 0.0) * lk


def window_pairs_between(qs, qe, ks, ke, window: int | None) -> np.ndarray:
    """Visible (q, k) pairs of queries ``[qs, qe)`` over keys ``[ks, ke)`` of one sequence: causal,
    and with a window ``w`` only ``q - w < k`` (the pairs with ``k <= q - w`` are those of the
    queries shifted back by ``w``)."""
    out = causal_prefix(qe, ks, ke) - causal_prefix(qs, ks, ke)
    if window is not None:
        out = out - (causal_prefix(_arr(qe) - window, ks, ke) - causal_prefix(_arr(qs) - window, ks, ke))
    return np.maximum(out, 0.0)


def window_pairs(L, window: int | None) -> np.ndarray:
    """Visible (q, k) pairs of a whole sequence of length ``L``: ``L^2/2`` causal; with a window
    ``w`` the first ``w`` queries see everything before them and every later one sees ``w`` keys:
    ``L*w - w^2/2`` once ``L > w``."""
    L = _arr(L)
    if window is None:
        return L * L / 2.0
    return np.where(L <= window, L * L / 2.0, L * window - window * window / 2.0)


def ring_position_ranges(L, G: int, contiguous) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per ring position, its ``(start, end)`` ranges over sequences of lengths ``L`` (arrays):
    zigzag (chunks i and 2G-1-i of 2G) or, where ``contiguous``, one range of L/G (the second
    range empty)."""
    L = _arr(L)
    c = L / (2.0 * G)
    z = np.zeros_like(L)
    out = []
    for i in range(G):
        a0 = np.where(contiguous, 2 * i * c, i * c)
        a1 = np.where(contiguous, 2 * (i + 1) * c, (i + 1) * c)
        b0 = np.where(contiguous, z, (2 * G - 1 - i) * c)
        b1 = np.where(contiguous, z, (2 * G - i) * c)
        out.append([(a0, a1), (b0, b1)])
    return out


def eval_fit(fit, n) -> np.ndarray:
    """Seconds of a measured :class:`~zeppelin.schemas.profile.PolyFit` at sizes ``n``.

    Without ``points``: the polynomial. With them: the polynomial times its measured correction,
    i.e. the ratio measured / polynomial interpolated linearly over log n between the measured
    points (constant beyond them). It passes through every measurement: kernels on real hardware
    have steps a quadratic cannot follow (cache sizes, kernel tiling), while the polynomial keeps
    the growth beyond the measured range. Points that lie on the polynomial change nothing."""
    n = _arr(n)
    c = list(fit.coeffs) + [0.0] * (3 - len(fit.coeffs))
    poly = np.maximum(c[0] + c[1] * n + c[2] * n * n, 0.0)
    pts = fit.points
    if not pts:
        return poly
    xs = np.array([p[0] for p in pts], dtype=np.float64)
    ys = np.array([p[1] for p in pts], dtype=np.float64)
    at = np.maximum(c[0] + c[1] * xs + c[2] * xs * xs, 1e-30)
    ratio = np.interp(np.log(np.maximum(n, 1e-9)), np.log(xs), ys / at)
    return poly * ratio


@dataclass
class CostModel:
    cluster: ClusterSpec
    model: ModelSpec
    profile: CostProfile = field(default=None)  # type: ignore[assignment]
    tp: int = 1
    zero_stage: int = 1
    tp_overlap: str = "none"
    recompute: str = "none"
    _rounds_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.profile is None:
            self.profile = default_profile(self.cluster.name, self.cluster.device)
        if self.tp < 1 or self.cluster.gpus_per_node % self.tp:
            raise ValueError(f"tp={self.tp} must divide gpus_per_node={self.cluster.gpus_per_node}")

    # ---------------------------------------------------------------- basic quantities
    @property
    def peak_flops(self) -> float:
        return (self.profile.peak_tflops or self.cluster.gpu.peak_tflops) * 1e12

    @property
    def num_units(self) -> int:
        return self.cluster.world_size // self.tp

    @property
    def units_per_node(self) -> int:
        return self.cluster.gpus_per_node // self.tp

    @cached_property
    def _gpus_per_nic(self) -> int:
        """The most GPUs of a node that send through one NIC."""
        return max(len(self.cluster.gpus_on_nic(n.id)) for n in self.cluster.nics)

    def node_of_unit(self, unit: int) -> int:
        return unit // self.units_per_node

    @cached_property
    def _mlp_mult(self) -> int:
        return 3 if self.model.mlp == "swiglu" else 2

    @cached_property
    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token per layer of all linear modules (an MoE layer: the experts a token
        runs, top-k plus the shared one, and the router)."""
        m = self.model
        if not m.is_moe and m.head_size is None:
            return 2.0 * (m.hidden * (m.hidden + 2 * m.kv_dim) + m.hidden * m.hidden
                          + self._mlp_mult * m.hidden * m.ffn_hidden)
        ffn = m.mlp_ffn_params(active=True)
        router = m.hidden * m.num_experts
        return 2.0 * (m.hidden * (m.q_dim + 2 * m.kv_dim) + m.q_dim * m.hidden + self._mlp_mult * m.hidden * ffn
                      + router)

    def linear_flops_fwd(self, tokens) -> np.ndarray:
        return _arr(tokens) * self.linear_flops_per_token

    def attn_flops_fwd(self, L) -> np.ndarray:
        """Forward FLOPs of causal attention over sequences of length ``L`` (per layer, full causal)."""
        L = _arr(L)
        return 2.0 * L * L * self.model.q_dim

    def attn_block_flops_fwd(self, lq, lk, causal: bool = False) -> np.ndarray:
        """Forward FLOPs of ``lq`` queries attending to ``lk`` keys (full block, or causal diagonal)."""
        f = 4.0 * _arr(lq) * _arr(lk) * self.model.q_dim
        return f / 2.0 if causal else f

    # ---------------------------------------------------------------- attention pattern
    @cached_property
    def window_mix(self) -> tuple[tuple[int | None, float], ...] | None:
        """``(window, share of the layers)`` per layer type of a model with sliding-window layers
        (None: every layer full causal, the plain formulas). Per-layer attention quantities of
        such a model are these layer types' weighted mean, so ``num_layers x`` a per-layer time is
        the sum over the layer types."""
        counts = self.model.window_counts()
        if set(counts) == {None}:
            return None
        n = self.model.num_layers
        return tuple((w, c / n) for w, c in sorted(counts.items(), key=lambda x: (x[0] is None, x[0] or 0)))

    def _mixed(self, fn) -> np.ndarray:
        """``sum_w share_w * fn(w)`` over the layer types."""
        return sum(share * _arr(fn(w)) for w, share in self.window_mix)

    def ring_contiguous(self, L, G: int) -> np.ndarray:
        """Where a ring of G units over sequences ``L`` cuts them contiguously rather than zigzag:
        a model whose every layer is windowed, once a position's share L/G covers the window (each
        position then needs the K/V of its predecessor only: one neighbour exchange, and the work
        is balanced without zigzag's pairing). Full-attention layers need the zigzag balance."""
        L = _arr(L)
        counts = self.model.window_counts()
        if G <= 1 or None in counts:
            return np.zeros(np.shape(L), dtype=bool)
        return L >= G * float(self.model.sliding_window)

    # ---------------------------------------------------------------- compute time
    def _eff(self, k: KernelEfficiency, n) -> np.ndarray:
        n = np.maximum(_arr(n), 1.0)
        return k.eff_max * n / (n + k.n_half)

    @cached_property
    def _fits(self):
        return self.profile.fits_for(self.model.name, self.model.dtype, self.tp)

    @cached_property
    def _fits_tp1(self):
        """The profiled model's TP=1 fits (for a TP unit: what it is derived from where the profile
        has no fit of the unit's own TP degree)."""
        return self.profile.fits_for(self.model.name, self.model.dtype, 1)

    @cached_property
    def _tp_unmeasured(self) -> bool:
        """A TP unit priced from a measured profile that has the model's TP=1 linear fit but none
        of this TP degree (docs/PROFILING.md, "Tensor parallelism")."""
        f1 = self._fits_tp1
        return (self.tp > 1 and f1 is not None and f1.linear is not None
                and (self._fits is None or self._fits.linear is None))

    def attn_time(self, L) -> np.ndarray:
        """Attention fwd+bwd time per layer of whole sequences of length ``L`` on one unit (a
        windowed layer: the full causal time at the length with its pair count, ``sqrt(2 * pairs)``)."""
        if self.window_mix is None:
            return self._attn_time_full(L)
        L = _arr(L)
        return self._mixed(lambda w: self._attn_time_full(np.sqrt(2.0 * window_pairs(L, w))))

    def _attn_time_full(self, L) -> np.ndarray:
        L = _arr(L)
        if self._fits is not None and self._fits.attention is not None:
            return np.where(L > 0, eval_fit(self._fits.attention, L), 0.0)
        k = self.profile.attention
        fl = self.attn_flops_fwd(L) * (1.0 + self.profile.backward_attention_factor) / self.tp
        return np.where(L > 0, k.overhead_s + fl / (self.peak_flops * self._eff(k, L)), 0.0)

    def ulysses_attn_time(self, L, G: int) -> np.ndarray:
        """fwd+bwd time per layer of one Ulysses shard: whole sequences ``L`` on 1/G of the heads.

        The shard does 1/G of the FLOPs with 1/G of the parallel work (query blocks x heads), which
        is what a whole-head kernel over ``L/sqrt(G)`` tokens does: same FLOPs (~L^2/G), same
        parallelism as its geometric-mean size. So a short sequence split over many head shards
        runs at the efficiency of a small kernel, as on a GPU with few heads per rank."""
        L = _arr(L)
        if G <= 1:
            return self.attn_time(L)
        if self.window_mix is None:
            return self.attn_time(L / np.sqrt(G))
        return self._mixed(lambda w: self._attn_time_full(np.sqrt(2.0 * window_pairs(L, w) / G)))

    def attn_block_time(self, lq, lk, causal: bool = False) -> np.ndarray:
        """fwd+bwd time of one attention block (a ring round's chunk pair) per layer."""
        lq, lk = _arr(lq), _arr(lk)
        if not causal and self._fits is not None and self._fits.attention_block is not None:
            # measured directly: a block with every key visible, at its geometric-mean size
            n = np.sqrt(np.maximum(lq * lk, 0.0))
            return np.where(lq * lk > 0, eval_fit(self._fits.attention_block, n), 0.0)
        if self._fits is not None and self._fits.attention is not None:
            # scale the whole-sequence fit by the block's share of a causal L x L square
            equiv_len = np.sqrt(np.maximum(lq * lk * (1.0 if causal else 2.0), 0.0))
            return np.where(lq * lk > 0, self._attn_time_full(equiv_len), 0.0)
        k = self.profile.attention
        if not causal and self.profile.attention_block is not None:
            k = self.profile.attention_block
        fl = self.attn_block_flops_fwd(lq, lk, causal) * (1.0 + self.profile.backward_attention_factor) / self.tp
        n = np.sqrt(np.maximum(lq * lk, 1.0))
        return np.where(lq * lk > 0, k.overhead_s + fl / (self.peak_flops * self._eff(k, n)), 0.0)

    def linear_time(self, tokens) -> np.ndarray:
        """fwd+bwd time per layer of every linear module for ``tokens`` tokens on one unit."""
        T = _arr(tokens)
        if self._fits is not None and self._fits.linear is not None:
            return np.where(T > 0, eval_fit(self._fits.linear, T), 0.0)
        if self._tp_unmeasured:
            # no measurement of this TP degree: each rank is charged the whole unit's TP=1 layer
            # (no compute gain from the split), an upper bound. The runtime's TP layer (weight
            # shards sliced and cast per call, gathered buffers, smaller GEMMs) gains far less
            # than the degree on some machines (gloo CPU ranks), so the TP=1 time's share would
            # be optimistic; the bound keeps a planner from choosing an unmeasured TP degree for
            # speed (it still may for memory)
            return np.where(T > 0, eval_fit(self._fits_tp1.linear, T), 0.0)
        k = self.profile.linear
        fl = self.linear_flops_fwd(T) * (1.0 + self.profile.backward_linear_factor) / self.tp
        return np.where(T > 0, k.overhead_s + fl / (self.peak_flops * self._eff(k, T)), 0.0)

    def head_time(self, tokens) -> np.ndarray:
        """Embedding + LM head + loss, fwd+bwd (once per model, not per layer)."""
        T = _arr(tokens)
        if self._fits is not None and self._fits.head is not None:
            return np.where(T > 0, eval_fit(self._fits.head, T), 0.0)
        f1 = self._fits_tp1
        if self.tp > 1 and f1 is not None and f1.head is not None:
            # TP-SP runs the embedding, final norm, LM head and loss whole on each rank's
            # sequence shard: the measured head at a shard's tokens
            return np.where(T > 0, eval_fit(f1.head, T / self.tp), 0.0)
        fl = 2.0 * T * self.model.hidden * self.model.vocab_size * (1.0 + self.profile.backward_linear_factor)
        k = self.profile.linear
        return np.where(T > 0, k.overhead_s + fl / self.tp / (self.peak_flops * self._eff(k, T)), 0.0)

    def seq_compute_time(self, L) -> np.ndarray:
        """Whole-model fwd+bwd compute of sequences kept local on one unit (attention + linear)."""
        L = _arr(L)
        return self.model.num_layers * (self.attn_time(L) + self.linear_time(L)) + self.head_time(L)

    def work(self, L) -> np.ndarray:
        """Device-seconds of work of sequences of length L, summed over layers (for balancing)."""
        return self.seq_compute_time(L)

    # ---------------------------------------------------------------- communication
    @cached_property
    def intra_link(self) -> LinkCost:
        if self.profile.intra is not None:
            return self.profile.intra
        li = self.cluster.intra_link
        return LinkCost(alpha_s=li.latency_us * 1e-6, bandwidth_GBps=li.bandwidth_GBps)

    @cached_property
    def inter_link(self) -> LinkCost:
        """One NIC's achieved bandwidth and latency."""
        if self.profile.inter is not None:
            return self.profile.inter
        n = self.cluster.nics[0]
        return LinkCost(alpha_s=n.latency_us * 1e-6, bandwidth_GBps=n.bandwidth_GBps)

    def link(self, cls: str) -> LinkCost:
        return self.intra_link if cls == "intra" else self.inter_link

    def p2p_time(self, nbytes, cls: str = "intra", sharers=1) -> np.ndarray:
        """alpha + bytes / (bandwidth / sharers) for a transfer on link class ``intra``/``inter``."""
        lk = self.link(cls)
        b = _arr(nbytes)
        return np.where(b > 0, lk.alpha_s + b * _arr(sharers) / (lk.bandwidth_GBps * 1e9), 0.0)

    @property
    def act_bytes(self) -> int:
        return self.model.dtype_bytes

    def kv_bytes(self, tokens) -> np.ndarray:
        """Bytes of K and V for ``tokens`` tokens (one layer), this unit's TP share."""
        return _arr(tokens) * 2 * self.model.kv_dim * self.act_bytes / self.tp

    def hidden_bytes(self, tokens) -> np.ndarray:
        return _arr(tokens) * self.model.hidden * self.act_bytes / self.tp

    def ring_round_bytes(self, chunk_tokens) -> np.ndarray:
        """Bytes one rank sends per ring round, fwd + bwd, one layer: K,V forward; K,V + dK,dV backward."""
        return 3.0 * self.kv_bytes(chunk_tokens)

    def tier_link(self, tier: str) -> str:
        return "inter" if tier == "inter" else "intra"

    @property
    def attn_call_overhead(self) -> float:
        """Fixed cost of one attention kernel call (the constant of the measured fit, else the
        preset's launch overhead); pieces fused into one call pay it once."""
        if self._fits is not None and self._fits.attention is not None:
            return float(self._fits.attention.coeffs[0])
        return float(self.profile.attention.overhead_s)

    def ring_round_compute(self, L, G: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer fwd+bwd compute of one unit of a ring of G units over sequences ``L``:
        ``(round 0, the mean later round)`` (the later rounds sum to ``(G - 1) x`` the second). A
        model with windowed layers: the layer types' mean of :meth:`ring_window_rounds`."""
        if self.window_mix is None:
            return self._ring_round_compute_full(L, G)
        L = _arr(L)
        first = self._mixed(lambda w: self._ring_rounds(L, G, w)[0][0])
        later = self._mixed(lambda w: sum(self._ring_rounds(L, G, w)[0][1:]) / max(G - 1, 1))
        return first, later

    def _ring_rounds(self, L, G: int, window: int | None):
        """``(per-round compute, exchanges)`` of one layer type (None: full causal, zigzag)."""
        if window is None and self.window_mix is not None:
            t0, tr = self._ring_round_compute_full(L, G)
            return [t0] + [tr] * (G - 1), np.full(np.shape(_arr(L)), float(G - 1))
        L = _arr(L)
        key = (G, window, L.shape, L.tobytes())
        hit = self._rounds_cache.get(key)
        if hit is None:
            if len(self._rounds_cache) >= 512:  # a planner asks about the same few length sets repeatedly
                self._rounds_cache.clear()
            hit = self._rounds_cache[key] = self.ring_window_rounds(L, G, window)
        return hit

    def ring_window_rounds(self, L, G: int, window: int | None) -> tuple[list[np.ndarray], np.ndarray]:
        """A ring of G units over sequences ``L`` of one layer type, block by block: per round r,
        the compute of its slowest position (queries of position i over the K/V of position
        i - r: each range pair priced by its visible pairs, pieces of one round one call), and the
        number of K/V exchanges the ring posts. A block is passed on only while a later position
        still sees some of it, so with a window the rounds (and exchanges) past its reach vanish:
        with contiguous cuts (:meth:`ring_contiguous`) one exchange, to the neighbour."""
        L = _arr(L)
        shape = np.shape(L)
        contiguous = self.ring_contiguous(L, G) if window is not None else np.zeros(shape, dtype=bool)
        pos = ring_position_ranges(L, G, contiguous)
        # [range a or b][start/end][position] arrays of shape (G, *shape)
        rng = [[np.stack([pos[i][a][k] for i in range(G)]) for k in (0, 1)] for a in (0, 1)]
        overhead = np.where(L > 0, self.attn_call_overhead, 0.0)
        rounds: list[np.ndarray] = []
        needed_at = []  # per round: (G, *shape) whether position i computes on the block it holds
        for r in range(G):
            j = (np.arange(G) - r) % G
            t = np.zeros((G,) + shape)
            calls = np.zeros((G,) + shape)
            for a in (0, 1):
                qs, qe = rng[a]
                lq = qe - qs
                for b in (0, 1):
                    ks, ke = rng[b][0][j], rng[b][1][j]
                    n = window_pairs_between(qs, qe, ks, ke, window)
                    vis = (n > 0) & (lq > 0)
                    if r == 0 and a == b:  # a diagonal: causal (and maybe windowed) square
                        e = np.sqrt(2.0 * n)
                        tb = self.attn_block_time(e, e, causal=True)
                    else:
                        tb = self.attn_block_time(lq, np.where(lq > 0, n / np.maximum(lq, 1e-30), 0.0))
                    t = t + np.where(vis, tb, 0.0)
                    calls = calls + vis
            t = t - np.maximum(calls - 1, 0) * overhead
            needed_at.append((calls > 0).any(axis=0))
            rounds.append(t.max(axis=0))
        # exchanges posted: rounds 0 .. (the last round any block is still needed) - 1
        last = np.zeros(shape)
        for r in range(1, G):
            last = np.where(needed_at[r], float(r), last)
        return rounds, last

    def _ring_round_compute_full(self, L, G: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer fwd+bwd compute of one unit of a zigzag ring of G units over sequences ``L``:
        ``(round 0, each later round)``.

        A sequence is cut into 2G chunks of c = L/(2G) tokens; position i holds chunks i and
        2G-1-i. Round 0 computes the two causal diagonal chunks and one full c x c block; every
        later round computes two full c x c blocks (the causal mask leaves exactly two of the four
        chunk pairs visible). Each block is priced at its own size — small blocks run at the
        efficiency of small kernels — and the pieces of one round are one call (one overhead),
        exactly as the simulator prices them."""
        L = _arr(L)
        chunk = L / (2.0 * G)
        diag = self.attn_block_time(chunk, chunk, causal=True)
        full = self.attn_block_time(chunk, chunk, causal=False)
        overhead = np.where(chunk > 0, self.attn_call_overhead, 0.0)
        first, later = 2.0 * diag + full - 2.0 * overhead, 2.0 * full - overhead
        measured = self.ring_compute_measured(L, G)
        if measured is not None:  # the runtime's ring as profiled; the block model only splits it into rounds
            modelled = first + (G - 1) * later
            scale = np.where(modelled > 0, measured / np.maximum(modelled, 1e-30), 1.0)
            first, later = first * scale, later * scale
        return first, later

    def ring_compute_measured(self, L, G: int):
        """The profile's measured compute of the runtime's zigzag ring of G units (fits.ring_compute,
        slowest position, fwd+bwd per layer, exchanges short-circuited) at lengths L; None without it."""
        f = self._fits
        fit = f.ring_compute.get(str(G)) if f is not None else None
        if fit is None:
            return None
        L = _arr(L)
        return np.where(L > 0, eval_fit(fit, L), 0.0)

    def ring_sync(self, G: int):
        """Measured seconds one ring round's exchanges add beyond compute (fits.ring_sync_s); None without it."""
        f = self._fits
        if f is None or str(G) not in f.ring_sync_s:
            return None
        return float(f.ring_sync_s[str(G)])

    def ring_compute_time(self, L, G: int) -> np.ndarray:
        """Per-layer fwd+bwd compute of one unit of a zigzag ring (all G rounds), no communication."""
        if G <= 1:
            return self.attn_time(L)
        t0, tr = self.ring_round_compute(L, G)
        return t0 + (G - 1) * tr

    def ring_exchanges(self, L, G: int) -> np.ndarray:
        """K/V exchanges a ring of G units posts per layer (the layer types' mean): G - 1 for full
        causal attention, fewer where a window leaves later rounds nothing to compute."""
        L = _arr(L)
        if self.window_mix is None or G <= 1:
            return np.full(np.shape(L), float(max(G - 1, 0)))
        return self._mixed(lambda w: self._ring_rounds(L, G, w)[1])

    def ring_attention_time(self, L, G: int, tier: str = "intra", nic_sharers: float = 1.0) -> np.ndarray:
        """Per-layer fwd+bwd time of ring attention of whole sequences L over G units (zigzag).

        Round r's compute overlaps the transfer of the K/V block round r+1 needs; a transfer that
        takes longer than the compute it hides behind is exposed."""
        L = _arr(L)
        if G <= 1:
            return self.attn_time(L)
        return self.ring_compute_time(L, G) + self.ring_exposed_comm(L, G, tier, nic_sharers)

    def ring_exposed_comm(self, L, G: int, tier: str = "intra", nic_sharers: float = 1.0) -> np.ndarray:
        """Per-layer exposed communication of a zigzag ring: the G-1 transfers hide behind rounds
        0 .. G-2 (round 0 first, then G-2 regular rounds)."""
        L = _arr(L)
        if G <= 1:
            return np.zeros_like(L)
        comm = self.p2p_time(self.ring_round_bytes(L / G), self.tier_link(tier), nic_sharers)
        if self.window_mix is not None:
            return np.where(L > 0, self._mixed(lambda w: self._window_exposure(L, G, w, comm)), 0.0)
        t0, tr = self.ring_round_compute(L, G)
        return np.where(L > 0, self.ring_round_exposure(comm, t0, tr, G), 0.0)

    def _window_exposure(self, L, G: int, window: int | None, comm) -> np.ndarray:
        """Exposed time of one layer type's ring: exchange r hides behind round r's compute, and
        only the exchanges the ring posts count."""
        rounds, nex = self._ring_rounds(L, G, window)
        sync = self.ring_sync(G)
        if sync is not None:
            return nex * sync
        out = np.zeros(np.shape(_arr(L)))
        for r in range(G - 1):
            out = out + np.where(r < nex, np.maximum(comm - rounds[r], 0.0), 0.0)
        return out

    def ring_round_exposure(self, comm, t0, tr, G: int, exchanges=None) -> np.ndarray:
        """Exposed time of a ring of G units whose per-round transfer takes ``comm`` and whose round
        0 / later rounds compute ``t0`` / ``tr``: the G-1 transfers hide behind rounds 0 .. G-2.
        A measured profile's per-round exchange cost (``ring_sync``) replaces the transfer model."""
        sync = self.ring_sync(G)
        if exchanges is not None:  # a windowed ring posts fewer exchanges than G - 1
            ex = _arr(exchanges)
            if sync is not None:
                return ex * sync
            return np.where(ex > 0, np.maximum(comm - t0, 0.0) + np.maximum(ex - 1, 0.0) * np.maximum(comm - tr, 0.0),
                            0.0)
        if sync is not None:  # profiled: what the runtime's exchanges cost beyond compute, per round
            return np.broadcast_to(np.float64((G - 1) * sync), np.shape(comm)).copy()
        return np.maximum(comm - t0, 0.0) + (G - 2) * np.maximum(comm - tr, 0.0)

    def alltoall_time(self, bytes_per_rank, G: int, cls: str = "intra") -> np.ndarray:
        """All-to-all where each rank holds ``bytes_per_rank`` and keeps 1/G of it."""
        if G <= 1:
            return np.zeros_like(_arr(bytes_per_rank))
        eff = self.profile.alltoall_efficiency.get(str(G), 1.0)
        lk = self.link(cls)
        nbytes = _arr(bytes_per_rank)
        per_node = self.units_per_node
        if cls != "inter" or G <= per_node:
            return lk.alpha_s * (G - 1) + nbytes * (G - 1) / G / (lk.bandwidth_GBps * 1e9 * eff)
        # A group over several nodes: each rank's shares for ranks on its own node go over the
        # intra-node link, the rest through its NIC, which the node's other GPUs in the group
        # use at the same time. Node-contiguous groups: the unit in the smallest node share
        # sends the most across nodes.
        smallest_share = G % per_node or per_node
        li = self.intra_link
        t_intra = nbytes * (min(G, per_node) - 1) / G / (li.bandwidth_GBps * 1e9 * eff)
        sharers = (min(self._gpus_per_nic, smallest_share * self.tp)
                   if self.profile.nic_shared_by_concurrent_transfers else 1)
        t_inter = nbytes * (G - smallest_share) * sharers / G / (lk.bandwidth_GBps * 1e9 * eff)
        return max(li.alpha_s, lk.alpha_s) * (G - 1) + np.maximum(t_intra, t_inter)

    def ulysses_comm_time(self, tokens_per_rank, G: int, cls: str = "intra") -> np.ndarray:
        """Per-layer fwd+bwd: 4 all-to-alls (Q,K,V in, O out) forward and 4 backward."""
        m = self.model
        per = _arr(tokens_per_rank) * (2 * m.hidden + 2 * m.kv_dim) * self.act_bytes / self.tp
        return 2.0 * self.alltoall_time(per, G, cls)

    def allgather_kv_time(self, tokens_per_rank, G: int, cls: str = "intra") -> np.ndarray:
        """Per-layer fwd+bwd of all-gather CP: all-gather K,V forward; all-gather + reduce-scatter dK,dV backward."""
        if G <= 1:
            return np.zeros_like(_arr(tokens_per_rank))
        lk = self.link(cls)
        b = self.kv_bytes(tokens_per_rank) * (G - 1)
        return 3.0 * (lk.alpha_s * (G - 1) + b / (lk.bandwidth_GBps * 1e9))

    def remap_time(self, max_tokens_moved_per_unit, cls: str = "intra") -> np.ndarray:
        """Per-layer fwd+bwd: two all-to-alls of hidden activations forward, two backward (a
        ``remap_payload: qkv`` model moves Q, K and V to the attention layout and the attention
        output back, and the same widths in backward)."""
        to_attn, to_lin = self.model.remap_widths()
        tok = _arr(max_tokens_moved_per_unit)
        a = self.remap_exchange_time(tok * to_attn * self.act_bytes / self.tp, cls)
        b = self.remap_exchange_time(tok * to_lin * self.act_bytes / self.tp, cls)
        return 2.0 * (a + b)

    @property
    def remap_measured(self) -> bool:
        """Whether the profile measured the runtime's remap exchange (``fits.remap_exchange``)."""
        return self._fits is not None and self._fits.remap_exchange is not None

    def remap_exchange_time(self, nbytes, cls: str = "intra") -> np.ndarray:
        """One remap exchange of ``nbytes`` per rank (one direction, one pass): the profile's
        measured exchange (``fits.remap_exchange``: what it adds to the compute around it, waits
        included) when it has one, else a point-to-point transfer on the link."""
        if self.remap_measured:
            a, b = self._fits.remap_exchange
            nb = _arr(nbytes)
            return np.where(nb > 0, a + b * nb, 0.0)
        return self.p2p_time(nbytes, cls)

    def grad_allreduce_time(self, num_units: int | None = None) -> float:
        """Gradient all-reduce across the ``n`` data-parallel units, as NCCL does it on a cluster:
        hierarchical — reduce-scatter inside each node over the intra-node links, an all-reduce
        of each node's shards across nodes that spreads over all of the node's NICs (one
        replica's gradient crosses each node's NICs 2(N-1)/N times), then an all-gather inside
        the node. On one node, a ring over the intra-node links. Not overlapped with backward
        (an upper bound: DDP-style bucketing hides part of it)."""
        n = num_units or self.num_units
        if n <= 1:
            return 0.0
        if self._fits is not None and str(n) in self._fits.grad_allreduce_s:  # measured for this model
            return float(self._fits.grad_allreduce_s[str(n)])
        shard = self.model.num_params() / self.tp * self.act_bytes   # one GPU's gradient bytes
        intra = self.intra_link
        nodes = self.cluster.num_nodes if n > self.units_per_node else 1
        in_node = min(n, self.units_per_node) if nodes > 1 else n     # units of one intra-node ring
        t = (2.0 * (in_node - 1) / in_node * shard / (intra.bandwidth_GBps * 1e9)
             + 2 * (in_node - 1) * intra.alpha_s)
        if nodes > 1:
            replica = shard * self.tp                                # a full replica's gradient
            t += (2.0 * (nodes - 1) / nodes * replica / (self.cluster.node_nic_bandwidth_GBps * 1e9)
                  + 2 * (nodes - 1) * self.inter_link.alpha_s)
        return float(t)

    @property
    def fsdp_microbatch_s(self) -> float | None:
        """Seconds FSDP2 adds to each micro-batch at this plan's ZeRO stage, as the profile measured
        them (``fits.fsdp_microbatch_s``); None without that measurement, at ZeRO-0 (replicated
        weights: one all-reduce per step) or on one unit."""
        f = self._fits
        if f is None or not f.fsdp_microbatch_s or self.zero_stage < 1 or self.num_units <= 1:
            return None
        return f.fsdp_microbatch_s.get("3" if self.zero_stage >= 3 else "1")

    def step_collectives_time(self, microbatches: int = 1, num_units: int | None = None) -> float:
        """The step's data-parallel collectives, charged to every unit: the gradient all-reduce once
        (:meth:`grad_allreduce_time`), or, with a profile that measured what FSDP2 adds to each
        micro-batch (gathers and reduce-scatters of the runtime's FSDP path, waits included), that
        cost for each of the step's micro-batches."""
        fs = self.fsdp_microbatch_s
        if fs is not None:
            return microbatches * float(fs)
        return self.grad_allreduce_time(num_units)

    def optimizer_time(self) -> float:
        """The AdamW step of one rank (every rank updates its whole replica shard, P / tp
        parameters): measured for the profiled model, else scaled per parameter; 0 when the
        profile has no optimizer measurement (presets)."""
        if self._fits is not None and self._fits.optimizer_s is not None:
            return float(self._fits.optimizer_s)
        if self.profile.optimizer_s_per_param is not None:
            return float(self.model.num_params() / self.tp * self.profile.optimizer_s_per_param)
        return 0.0

    # ---------------------------------------------------------------- tensor parallelism (TP-SP)
    TP_SITES = 8  # collective sites per layer: AG before QKV and MLP-in, RS after O and MLP-out; x2 for backward
    SLICING_CHUNKS = 4

    def tp_site_times(self, tokens) -> tuple[np.ndarray, np.ndarray]:
        """(communication, GEMM) time of one TP-SP collective site (all-gather or reduce-scatter
        of the unit's tokens around a column-/row-parallel GEMM), per layer."""
        T = _arr(tokens)
        if self.tp <= 1:
            z = np.zeros_like(T)
            return z, z
        lk = self.intra_link  # a TP group lives inside one node
        nbytes = T * self.model.hidden * self.act_bytes * (self.tp - 1) / self.tp
        comm = np.where(T > 0, lk.alpha_s * (self.tp - 1) + nbytes / (lk.bandwidth_GBps * 1e9), 0.0)
        gemm = self.linear_time(T) / self.TP_SITES
        return comm, gemm

    def tp_exposed_comm(self, tokens, mode: str | None = None) -> np.ndarray:
        """Exposed TP-SP communication per layer (fwd+bwd) for ``--tp-overlap`` mode:

        * ``none``: every collective is exposed;
        * ``slicing``: k chunks, chunk i's transfer overlaps chunk i+1's GEMM; the last chunk's
          transfer is always exposed (the tail), plus whatever transfer the GEMMs cannot hide;
        * ``commfuse``: tp-1 P2P steps, each overlapping one shard's GEMM; exposed
          = sum over steps of max(0, transfer - GEMM); no tail.

        A profile with this TP degree's fits (``linear_tp_comm[mode]``) replaces the model: the
        measured layer with the mode's collectives minus the measured layer's compute alone.
        """
        mode = mode or self.tp_overlap
        comm, gemm = self.tp_site_times(tokens)
        if self.tp <= 1:
            return comm
        f = self._fits
        if f is not None and f.linear is not None and mode in f.linear_tp_comm:
            # measured: the TP-SP layer with this mode's collectives minus its compute alone
            T = _arr(tokens)
            extra = eval_fit(f.linear_tp_comm[mode], T) - eval_fit(f.linear, T)
            return np.where(T > 0, np.maximum(extra, 0.0), 0.0)
        if mode == "none":
            per_site = comm
        elif mode == "slicing":
            k = self.SLICING_CHUNKS
            per_site = comm / k + (k - 1) / k * np.maximum(comm - gemm, 0.0)
        elif mode == "commfuse":
            steps = self.tp - 1
            per_site = steps * np.maximum(comm / steps - gemm / self.tp, 0.0)
        else:
            raise ValueError(f"unknown tp overlap mode {mode!r} (none, slicing, commfuse)")
        return self.TP_SITES * per_site

    # ---------------------------------------------------------------- memory
    # What one rank holds at its peak (the start of the backward), by component, as the runtime
    # allocates it (docs/RUNTIME.md, "Memory model"). ``c``: bytes of a compute-dtype element;
    # master weights, gradients and AdamW moments are fp32 whatever ``c`` is.
    MEMORY_COMPONENTS = ("params", "grads", "optimizer", "unsharded", "activations", "recompute")

    @property
    def compute_bytes(self) -> int:
        return self.model.dtype_bytes

    @cached_property
    def _hf_modules(self) -> bool:
        """Hugging Face decoders (``remap_payload: qkv``) have their own norm and rotary forms."""
        return self.model.remap_payload == "qkv"

    def norm_bytes_per_token(self) -> float:
        """What autograd keeps of one RMSNorm per token: the fp32 input (the input itself in
        fp32) and its inverse RMS; the runtime's norm keeps the fp32 normalised rows and its
        compute-dtype output, a Hugging Face norm the normalised rows cast back to ``c`` and
        its output: ``(8 + c) h + 4`` / ``(4 + 2c) h + 4``."""
        h, c = self.model.hidden, self.compute_bytes
        return ((4 + 2 * c) if self._hf_modules else (8 + c)) * h + 4.0

    def layer_activation_parts(self) -> dict[str, float]:
        """Bytes autograd keeps per token of one decoder layer without recomputation, by part:

        * ``norms``: two RMSNorms (:meth:`norm_bytes_per_token`);
        * ``attention``: rotated Q and K, V and the attention output in ``c``, the fp32
          log-sum-exp per head: ``c (2 h + 2 g d) + 4 heads`` (no L^2 term: the kernels are
          flash-style);
        * ``mlp``: SwiGLU keeps gate, its SiLU, up and their product ``4 c f``; GELU ``2 c f``.

        The residual stream, RoPE rotations by constant tables and the casts keep nothing."""
        m, c = self.model, self.compute_bytes
        mlp = (4 if m.mlp == "swiglu" else 2) * c * m.mlp_ffn_params(active=True)
        if m.is_moe:  # the router's fp32 logits and probabilities, the token's copy per expert it runs
            mlp += 8 * m.num_experts + c * m.hidden * m.experts_per_token
        attn = c * (2 * m.q_dim + 2 * m.kv_dim) + 4.0 * m.num_heads
        if m.qk_norm:  # the normed queries and keys beside their inputs
            attn += c * (m.q_dim + m.kv_dim)
        parts = {"norms": 2 * self.norm_bytes_per_token(), "attention": attn, "mlp": float(mlp)}
        measured = self.profile.activation_bytes_per_token_layer
        if measured:  # a whole-layer figure: keep the analytic split
            scale = measured / sum(parts.values())
            parts = {k: v * scale for k, v in parts.items()}
        return parts

    def head_activation_bytes(self) -> float:
        """Per token, once per model: the final norm, the fp32 log-softmax of the logits
        (``4 V``), token ids and labels (int64) and the rotary tables (fp32 cos/sin of ``d/2``
        each; Hugging Face: ``c`` of ``d`` each)."""
        m, c = self.model, self.compute_bytes
        rope = 2 * c * m.head_dim if self._hf_modules else 4.0 * m.head_dim
        return self.norm_bytes_per_token() + 4.0 * m.vocab_size + 16.0 + rope

    @cached_property
    def activation_split(self) -> tuple[float, float]:
        """Bytes per token held (``activations``, ``recompute``) for this recompute mode:

        * ``none``: every layer's parts and the head;
        * ``selective`` (each MLP recomputed): every layer without its MLP (the MLP's input
          stays: checkpoint keeps it), the head; in the backward one MLP's parts again;
        * ``full`` (each block recomputed): each block's input ``c h`` and the head; in the
          backward one layer's parts, less its fp32 input where that is the block input itself.

        A profile that measured this model's figures (``fits.activation_memory``) replaces them."""
        f = self._fits
        got = f.activation_memory.get(self.recompute) if f is not None else None
        if got is not None:
            return got.activations, got.recompute
        m, c = self.model, self.compute_bytes
        parts = self.layer_activation_parts()
        layer = sum(parts.values())
        head = self.head_activation_bytes()
        L, tp = m.num_layers, self.tp
        if self.recompute == "none":
            act, rec = L * layer + head, 0.0
        elif self.recompute == "selective":
            act, rec = L * (layer - parts["mlp"]) + head, parts["mlp"]
        elif self.recompute == "full":
            act, rec = L * c * m.hidden + head, layer - (4.0 * m.hidden if c == 4 else 0.0)
        else:
            raise ValueError(f"unknown recompute mode {self.recompute!r} (none, selective, full)")
        return act / tp, rec / tp

    @cached_property
    def activation_bytes_per_token(self) -> float:
        """Activation memory per token held, all layers: what the forward keeps plus what one
        recomputation holds in the backward (:attr:`activation_split`)."""
        act, rec = self.activation_split
        return act + rec

    def model_state_components(self, dp: int | None = None) -> dict[str, float]:
        """Parameter, gradient, optimizer and whole-parameter bytes per GPU by ZeRO stage
        (``P`` parameters of this GPU's TP share, ``N``-way data parallel), as the runtime's
        FSDP2 holds them (docs/RUNTIME.md, "ZeRO stages"):

        * ZeRO-0 (``--dp replicate``): fp32 weights ``4 P``, gradients ``4 P``, Adam moments
          ``8 P`` whole; ``unsharded``: in a compute dtype narrower than fp32, the casts of the
          weight matrices the forward keeps (none inside recomputed modules);
        * ZeRO-1, 2 and 3: ``4 P / N``, ``4 P / N``, ``8 P / N``. FSDP reduce-scatters each
          block's gradient as soon as the backward has produced it, so ZeRO-1 runs with
          ZeRO-2's holdings and is charged exactly those;
        * ``unsharded`` (ZeRO-1/2): every whole compute-dtype weight ``c P``, kept between
          forward and backward; ZeRO-3: the root module (embedding, head, final norm: FSDP does
          not re-shard the root after forward) and two blocks (the one in its backward and the
          one prefetched). Both: the whole gradients not yet reduce-scattered at the peak, the
          LM head's (from the start of the backward) and one block's, in ``c``.
        """
        dp = dp or self.num_units
        m, tp = self.model, self.tp
        P = m.num_params() / tp
        c = self.compute_bytes
        block = m.params_per_layer() / tp
        root = (m.num_params() - m.num_layers * m.params_per_layer()) / tp
        out = (m.vocab_size * m.hidden + m.hidden) / tp        # LM head (or tied embedding) + final norm
        if self.zero_stage == 0:
            copies = 0.0
            if c < 4:
                h, kv, f = m.hidden, m.kv_dim, m.ffn_hidden
                attn_w = h * (h + 2 * kv) + h * h
                mlp_w = (3 if m.mlp == "swiglu" else 2) * h * f
                kept = {"none": attn_w + mlp_w, "selective": attn_w, "full": 0}[self.recompute]
                copies = c * (m.num_layers * kept + m.vocab_size * h) / tp
            return {"params": 4.0 * P, "grads": 4.0 * P, "optimizer": 8.0 * P, "unsharded": copies}
        pending = c * (out + block)
        whole = c * P if self.zero_stage in (1, 2) else c * (root + 2 * block)
        return {"params": 4.0 * P / dp, "grads": 4.0 * P / dp, "optimizer": 8.0 * P / dp,
                "unsharded": whole + pending}

    def model_state_bytes(self, dp: int | None = None) -> float:
        """Everything but the activations: :meth:`model_state_components` summed."""
        return float(sum(self.model_state_components(dp).values()))

    def memory_components(self, tokens_held) -> dict[str, np.ndarray]:
        """Predicted peak bytes of one GPU holding ``tokens_held`` tokens, by component (the
        names the runtime's metrics measure: ``MEMORY_COMPONENTS``)."""
        T = _arr(tokens_held)
        act, rec = self.activation_split
        out = {k: np.full_like(T, v) for k, v in self.model_state_components().items()}
        out["activations"] = T * act
        out["recompute"] = np.where(T > 0, T * rec, 0.0)
        return out

    @cached_property
    def gpu_capacity_bytes(self) -> float:
        return (self.cluster.gpu.memory_gb - self.profile.memory_reserved_gb) * 1e9

    @cached_property
    def token_capacity(self) -> int:
        """Tokens one GPU (unit member) can hold for activations after model states."""
        free = self.gpu_capacity_bytes - self.model_state_bytes()
        return max(int(free / self.activation_bytes_per_token), 0)

    def memory_bytes(self, tokens_held) -> np.ndarray:
        """Predicted peak bytes of one GPU holding ``tokens_held`` tokens (all components)."""
        return self.model_state_bytes() + _arr(tokens_held) * self.activation_bytes_per_token

    # ---------------------------------------------------------------- bounds
    def best_time_of_sequence(self, L: int, max_units: int | None = None) -> float:
        """Lower bound on one sequence's step time: its work spread perfectly over the units
        it may use (at least enough to hold it), ignoring communication."""
        n = max_units or self.num_units
        return float(self.work(L) / n) if n else float("inf")
