"""Compute costs of the analytic cost model: kernel FLOPs and times per layer (attention, linear
modules, the embedding and LM head), sliding-window layer types, the per-round compute of a ring,
the optimizer step. A mixin of :class:`~zeppelin.planner.costmodel.cost.CostModel`, which holds the
cluster, model, profile and parallel degrees these methods read.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from zeppelin.schemas.profile import KernelEfficiency


def as_array(x) -> np.ndarray:
    """``x`` as a float64 array (the cost model's formulas are vectorised over lengths)."""
    return np.asarray(x, dtype=np.float64)


def causal_prefix(x, ks, ke) -> np.ndarray:
    """Causal (q, k) pairs with q < x, ks <= k < ke and k <= q, as areas (continuous positions)."""
    x, ks, ke = as_array(x), as_array(ks), as_array(ke)
    lk = np.maximum(ke - ks, 0.0)
    m = np.clip(x - ks, 0.0, lk)
    return m * m / 2.0 + np.maximum(x - ke, 0.0) * lk


def window_pairs_between(qs, qe, ks, ke, window: int | None) -> np.ndarray:
    """Visible (q, k) pairs of queries ``[qs, qe)`` over keys ``[ks, ke)`` of one sequence: causal,
    and with a window ``w`` only ``q - w < k`` (the pairs with ``k <= q - w`` are those of the
    queries shifted back by ``w``)."""
    out = causal_prefix(qe, ks, ke) - causal_prefix(qs, ks, ke)
    if window is not None:
        out = out - (causal_prefix(as_array(qe) - window, ks, ke) - causal_prefix(as_array(qs) - window, ks, ke))
    return np.maximum(out, 0.0)


def window_pairs(L, window: int | None) -> np.ndarray:
    """Visible (q, k) pairs of a whole sequence of length ``L``: ``L^2/2`` causal; with a window
    ``w`` the first ``w`` queries see everything before them and every later one sees ``w`` keys:
    ``L*w - w^2/2`` once ``L > w``."""
    L = as_array(L)
    if window is None:
        return L * L / 2.0
    return np.where(L <= window, L * L / 2.0, L * window - window * window / 2.0)


def ring_position_ranges(L, G: int, contiguous) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per ring position, its ``(start, end)`` ranges over sequences of lengths ``L`` (arrays):
    zigzag (chunks i and 2G-1-i of 2G) or, where ``contiguous``, one range of L/G (the second
    range empty)."""
    L = as_array(L)
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


def eval_fit(fit, n, growth: float) -> np.ndarray:
    """Seconds of a measured :class:`~zeppelin.schemas.profile.PolyFit` at sizes ``n``.

    Without ``points``: the polynomial. With them: inside their range the polynomial times its
    measured correction, i.e. the ratio measured / polynomial interpolated linearly over log n
    between the measured points (constant below the first). It passes through every measurement:
    kernels on real hardware have steps a quadratic cannot follow (cache sizes, kernel tiling).
    Beyond the largest point the last measurement grows as the kernel's work does, ``n**growth``
    (``1`` for token-wise modules, ``2`` for attention): a large kernel runs at a saturated rate,
    while the polynomial's shape there reflects the small sizes' fixed costs (on a GPU the launch
    floor of the small points bends a relative-error fit into a spurious ``n^2`` for linear layers
    and a missing one for attention)."""
    n = as_array(n)
    c = list(fit.coeffs) + [0.0] * (3 - len(fit.coeffs))
    poly = np.maximum(c[0] + c[1] * n + c[2] * n * n, 0.0)
    pts = fit.points
    if not pts:
        return poly
    xs = np.array([p[0] for p in pts], dtype=np.float64)
    ys = np.array([p[1] for p in pts], dtype=np.float64)
    at = np.maximum(c[0] + c[1] * xs + c[2] * xs * xs, 1e-30)
    ratio = np.interp(np.log(np.maximum(n, 1e-9)), np.log(xs), ys / at)
    beyond = ys[-1] * (np.maximum(n, xs[-1]) / xs[-1]) ** growth
    return np.where(n > xs[-1], beyond, poly * ratio)


class ComputeCosts:
    """Kernel FLOPs and fwd+bwd times of one unit (see :mod:`zeppelin.planner.costmodel.cost`)."""

    # ---------------------------------------------------------------- flops
    @property
    def peak_flops(self) -> float:
        return (self.profile.peak_tflops or self.cluster.gpu.peak_tflops) * 1e12

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
        return as_array(tokens) * self.linear_flops_per_token

    def attn_flops_fwd(self, L) -> np.ndarray:
        """Forward FLOPs of causal attention over sequences of length ``L`` (per layer, full causal)."""
        L = as_array(L)
        return 2.0 * L * L * self.model.q_dim

    def attn_block_flops_fwd(self, lq, lk, causal: bool = False) -> np.ndarray:
        """Forward FLOPs of ``lq`` queries attending to ``lk`` keys (full block, or causal diagonal)."""
        f = 4.0 * as_array(lq) * as_array(lk) * self.model.q_dim
        return f / 2.0 if causal else f

    # ---------------------------------------------------------------- attention pattern
    @cached_property
    def _window_counts(self) -> dict[int | None, int]:
        """The model's layers per attention window (asked for by every ring priced)."""
        return self.model.window_counts()

    @cached_property
    def window_mix(self) -> tuple[tuple[int | None, float], ...] | None:
        """``(window, share of the layers)`` per layer type of a model with sliding-window layers
        (None: every layer full causal, the plain formulas). Per-layer attention quantities of
        such a model are these layer types' weighted mean, so ``num_layers x`` a per-layer time is
        the sum over the layer types."""
        counts = self._window_counts
        if set(counts) == {None}:
            return None
        n = self.model.num_layers
        return tuple((w, c / n) for w, c in sorted(counts.items(), key=lambda x: (x[0] is None, x[0] or 0)))

    def _mixed(self, fn) -> np.ndarray:
        """``sum_w share_w * fn(w)`` over the layer types."""
        return sum(share * as_array(fn(w)) for w, share in self.window_mix)

    def ring_contiguous(self, L, G: int) -> np.ndarray:
        """Where a ring of G units over sequences ``L`` cuts them contiguously rather than zigzag:
        a model whose every layer is windowed, once a position's share L/G covers the window (each
        position then needs the K/V of its predecessor only: one neighbour exchange, and the work
        is balanced without zigzag's pairing). Full-attention layers need the zigzag balance."""
        L = as_array(L)
        if G <= 1 or None in self._window_counts:
            return np.zeros(np.shape(L), dtype=bool)
        return L >= G * float(self.model.sliding_window)

    # ---------------------------------------------------------------- compute time
    def _eff(self, k: KernelEfficiency, n) -> np.ndarray:
        n = np.maximum(as_array(n), 1.0)
        return k.eff_max * n / (n + k.n_half)

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
        L = as_array(L)
        return self._mixed(lambda w: self._attn_time_full(np.sqrt(2.0 * window_pairs(L, w))))

    def _attn_time_full(self, L) -> np.ndarray:
        L = as_array(L)
        if self._fits is not None and self._fits.attention is not None:
            return np.where(L > 0, eval_fit(self._fits.attention, L, 2), 0.0)
        k = self.profile.attention
        fl = self.attn_flops_fwd(L) * (1.0 + self.profile.backward_attention_factor) / self.tp
        return np.where(L > 0, k.overhead_s + fl / (self.peak_flops * self._eff(k, L)), 0.0)

    def ulysses_attn_time(self, L, G: int) -> np.ndarray:
        """fwd+bwd time per layer of one Ulysses shard: whole sequences ``L`` on 1/G of the heads.

        The shard does 1/G of the FLOPs with 1/G of the parallel work (query blocks x heads), which
        is what a whole-head kernel over ``L/sqrt(G)`` tokens does: same FLOPs (~L^2/G), same
        parallelism as its geometric-mean size. So a short sequence split over many head shards
        runs at the efficiency of a small kernel, as on a GPU with few heads per rank."""
        L = as_array(L)
        if G <= 1:
            return self.attn_time(L)
        if self.window_mix is None:
            return self.attn_time(L / np.sqrt(G))
        return self._mixed(lambda w: self._attn_time_full(np.sqrt(2.0 * window_pairs(L, w) / G)))

    def attn_block_time(self, lq, lk, causal: bool = False) -> np.ndarray:
        """fwd+bwd time of one attention block (a ring round's chunk pair) per layer."""
        lq, lk = as_array(lq), as_array(lk)
        if not causal and self._fits is not None and self._fits.attention_block is not None:
            # measured directly: a block with every key visible, at its geometric-mean size
            n = np.sqrt(np.maximum(lq * lk, 0.0))
            return np.where(lq * lk > 0, eval_fit(self._fits.attention_block, n, 2), 0.0)
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
        T = as_array(tokens)
        if self._fits is not None and self._fits.linear is not None:
            return np.where(T > 0, eval_fit(self._fits.linear, T, 1), 0.0)
        if self._tp_unmeasured:
            # no measurement of this TP degree: each rank is charged the whole unit's TP=1 layer
            # (no compute gain from the split), an upper bound. The runtime's TP layer (weight
            # shards sliced and cast per call, gathered buffers, smaller GEMMs) gains far less
            # than the degree on some machines (gloo CPU ranks), so the TP=1 time's share would
            # be optimistic; the bound keeps a planner from choosing an unmeasured TP degree for
            # speed (it still may for memory)
            return np.where(T > 0, eval_fit(self._fits_tp1.linear, T, 1), 0.0)
        k = self.profile.linear
        fl = self.linear_flops_fwd(T) * (1.0 + self.profile.backward_linear_factor) / self.tp
        return np.where(T > 0, k.overhead_s + fl / (self.peak_flops * self._eff(k, T)), 0.0)

    def head_time(self, tokens) -> np.ndarray:
        """Embedding + LM head + loss, fwd+bwd (once per model, not per layer)."""
        T = as_array(tokens)
        if self._fits is not None and self._fits.head is not None:
            return np.where(T > 0, eval_fit(self._fits.head, T, 1), 0.0)
        f1 = self._fits_tp1
        if self.tp > 1 and f1 is not None and f1.head is not None:
            # TP-SP runs the embedding, final norm, LM head and loss whole on each rank's
            # sequence shard: the measured head at a shard's tokens
            return np.where(T > 0, eval_fit(f1.head, T / self.tp, 1), 0.0)
        fl = 2.0 * T * self.model.hidden * self.model.vocab_size * (1.0 + self.profile.backward_linear_factor)
        k = self.profile.linear
        return np.where(T > 0, k.overhead_s + fl / self.tp / (self.peak_flops * self._eff(k, T)), 0.0)

    def seq_compute_time(self, L) -> np.ndarray:
        """Whole-model fwd+bwd compute of sequences kept local on one unit (attention + linear)."""
        L = as_array(L)
        return self.model.num_layers * (self.attn_time(L) + self.linear_time(L)) + self.head_time(L)

    def work(self, L) -> np.ndarray:
        """Device-seconds of work of sequences of length L, summed over layers (for balancing)."""
        return self.seq_compute_time(L)

    def optimizer_time(self) -> float:
        """The AdamW step of one rank (every rank updates its whole replica shard, P / tp
        parameters): measured for the profiled model, else scaled per parameter; 0 when the
        profile has no optimizer measurement (presets)."""
        if self._fits is not None and self._fits.optimizer_s is not None:
            return float(self._fits.optimizer_s)
        if self.profile.optimizer_s_per_param is not None:
            return float(self.model.num_params() / self.tp * self.profile.optimizer_s_per_param)
        return 0.0

    # ---------------------------------------------------------------- ring rounds (compute only)
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
        L = as_array(L)
        first = self._mixed(lambda w: self._ring_rounds(L, G, w)[0][0])
        later = self._mixed(lambda w: sum(self._ring_rounds(L, G, w)[0][1:]) / max(G - 1, 1))
        return first, later

    def _ring_rounds(self, L, G: int, window: int | None):
        """``(per-round compute, exchanges)`` of one layer type (None: full causal, zigzag)."""
        if window is None and self.window_mix is not None:
            t0, tr = self._ring_round_compute_full(L, G)
            return [t0] + [tr] * (G - 1), np.full(np.shape(as_array(L)), float(G - 1))
        L = as_array(L)
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
        L = as_array(L)
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
        L = as_array(L)
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
        L = as_array(L)
        return np.where(L > 0, eval_fit(fit, L, 2), 0.0)

    def ring_compute_time(self, L, G: int) -> np.ndarray:
        """Per-layer fwd+bwd compute of one unit of a zigzag ring (all G rounds), no communication."""
        if G <= 1:
            return self.attn_time(L)
        t0, tr = self.ring_round_compute(L, G)
        return t0 + (G - 1) * tr

    # ---------------------------------------------------------------- bounds
    def best_time_of_sequence(self, L: int, max_units: int | None = None) -> float:
        """Lower bound on one sequence's step time: its work spread perfectly over the units
        it may use (at least enough to hold it), ignoring communication."""
        n = max_units or self.num_units
        return float(self.work(L) / n) if n else float("inf")
