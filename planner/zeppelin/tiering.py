"""Tiering: where a sequence should run, derived from the cost model (docs/DESIGN.md, "Zeppelin").

A sequence is *local* (whole on one unit, no communication), *intra* (zigzag ring over 2..U
units of one node, NVLink) or *inter* (zigzag ring over all units of k >= 2 nodes, NICs).
Nothing here is a hand-typed length: every threshold is a crossover of two cost-model curves,
found by bisection on the model of the given cluster, model and profile:

* **memory**: the longest sequence one unit can hold (activation tokens after model states),
  one node can hold, and the whole cluster can hold;
* **ring hiding**: for a ring over G units, each of the G-1 rounds computes one chunk pair while
  the next K/V block travels. Splitting is free (no exposed communication) only when the round's
  compute ``attn(L)/G^2`` covers its transfer ``alpha + 3*KV(L/G)/bandwidth``. Attention grows with
  L^2 and the transfer with L, so there is one crossover length per (G, link) - over NVLink for the
  intra tier, over one NIC (or all NICs of a node, with routing) for the inter tier.

Per step the planner then chooses each sequence's span G (:meth:`Tiering.choose_span`): the
smallest span that fits in memory and brings the sequence's per-unit time under the step's
balanced per-unit load; and, when the ring hides its communication at a larger span, a larger
span so that no single piece is coarser than a fraction of the per-unit load (fine pieces pack
evenly). Spans above one node take whole nodes and are the inter tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from zeppelin.planner.core.base import PlanContext

#: a piece of work should be at most this fraction of the per-unit load, when splitting is free
GRANULARITY = 0.25
#: splitting counts as free when it adds at most this fraction of exposed communication
FREE_WASTE = 0.02
#: ... and when the span's units together spend at most this fraction more compute on the
#: sequence's attention than one unit would: a ring's blocks (a Ulysses shard's heads) are smaller
#: than the sequence's, so its kernels run less efficiently, the more so the shorter the sequence
FREE_COMPUTE = 0.15
_L_MAX = 1 << 26  # search ceiling for crossovers (67M tokens)


def _waste(G: int, compute, whole):
    """The compute G units spend on a sequence's attention (``compute`` each) beyond one unit's
    ``whole``, as a fraction of it (inf where the sequence has no attention)."""
    whole = np.asarray(whole, dtype=np.float64)
    return np.where(whole > 0, G * np.asarray(compute, dtype=np.float64) / np.maximum(whole, 1e-30) - 1.0, np.inf)


def zigzag_max_tokens(L: int, G: int) -> int:
    """Most tokens any ring position holds when ``L`` is cut into 2G zigzag chunks."""
    if G <= 1:
        return int(L)
    q, r = divmod(int(L), 2 * G)
    if r >= G + 1:
        return 2 * q + 2
    return 2 * q + (1 if r >= 1 else 0)


def zigzag_max_tokens_array(L, G) -> np.ndarray:
    """:func:`zigzag_max_tokens` element-wise over arrays of lengths and span sizes."""
    L = np.asarray(L).astype(np.int64)
    G = np.broadcast_to(np.asarray(G, dtype=np.int64), L.shape)
    Gs = np.maximum(G, 1)
    q, r = np.divmod(L, 2 * Gs)
    split = np.where(r >= Gs + 1, 2 * q + 2, 2 * q + (r >= 1))
    return np.where(G <= 1, L, split).astype(np.int64)


def _first_true(pred, lo: int = 1, hi: int = _L_MAX) -> int | None:
    """Smallest L in [lo, hi] from which ``pred`` holds for every longer length (checked on a
    geometric grid, then refined by bisection). Tiny lengths can satisfy a crossover predicate
    spuriously (fixed kernel overheads dominate), so the search runs down from the top."""
    grid = np.unique(np.geomspace(lo, hi, 400).astype(np.int64))
    ok = [bool(pred(int(x))) for x in grid]
    if not ok[-1]:
        return None
    k = len(ok) - 1
    while k > 0 and ok[k - 1]:
        k -= 1
    if k == 0:
        return int(grid[0])
    a, b = int(grid[k - 1]), int(grid[k])  # pred(a) false, pred(b) true
    while b - a > 1:
        mid = (a + b) // 2
        if pred(mid):
            b = mid
        else:
            a = mid
    return b


#: a span table of at least this many sequences is priced once per distinct length where those are
#: at most :data:`DISTINCT_LENGTHS_SHARE` of the sequences (copying columns costs far less than
#: pricing them; below these, finding the distinct lengths would cost more than it saves)
DISTINCT_LENGTHS_MIN = 2048
DISTINCT_LENGTHS_SHARE = 0.75


@dataclass
class Span:
    """How one sequence is split: ``G`` units; inter tier spans ``nodes`` whole nodes."""

    G: int
    tier: str  # local | intra | inter
    nodes: int = 1


@dataclass
class SpanTable:
    L: np.ndarray
    A: np.ndarray  # (spans, seqs) attention seconds per unit, all layers
    F: np.ndarray  # fits in memory
    E: np.ndarray  # exposed communication / attention compute
    G: np.ndarray  # span sizes
    U: np.ndarray | None = None  # (spans, seqs): the span runs as Ulysses (all-to-all), not a ring
    R: np.ndarray | None = None  # (spans, seqs): A as a ring (set when U is)
    Q: np.ndarray | None = None  # (spans, seqs): A as Ulysses, inf where the span cannot be Ulysses
    V: np.ndarray | None = None  # (spans, seqs): A as a usp group (Tiering.usp_prices), once asked
    W: np.ndarray | None = None  # (spans, seqs): the span's compute over the sequence's attention / one unit's, - 1
    #   (always set by Tiering.span_table; a default only because the fields before it have them)
    #: priced per sequence (a :class:`DistinctSpanTable` holds the table of the distinct lengths)
    distinct = None

    def times(self, lin_rate: float) -> np.ndarray:
        """Per-unit busy time: attention + linear work on the unit's L/G tokens."""
        return self.A + lin_rate * self.L[None, :] / self.G[:, None]


class DistinctSpanTable:
    """A :class:`SpanTable` of sequences ``L`` priced once per distinct length: ``distinct`` is
    ``(the table of the distinct lengths, each sequence's column in it)``. Its entries are those of
    the table priced per sequence (each is a function of its span and its sequence's length alone);
    a whole (spans, sequences) array is made on first use, and callers that can work on the distinct
    columns use ``distinct`` instead."""

    _EXPANDED = ("A", "F", "E", "U", "R", "Q", "W")

    def __init__(self, L: np.ndarray, base: SpanTable, cols: np.ndarray):
        self.L, self.G, self.distinct, self.V = L, base.G, (base, cols), None

    def __getattr__(self, name: str):
        if name not in DistinctSpanTable._EXPANDED:
            raise AttributeError(name)
        base, cols = self.distinct
        x = getattr(base, name)
        x = None if x is None else x[:, cols]
        setattr(self, name, x)  # (found as an attribute from now on)
        return x

    def times(self, lin_rate: float) -> np.ndarray:
        base, cols = self.distinct
        return base.times(lin_rate)[:, cols]


class Tiering:
    def __init__(self, ctx: PlanContext):
        self.ctx = ctx
        self.cost = ctx.cost
        self.layers = ctx.model.num_layers
        self.upn = ctx.units_per_node
        self.num_nodes = ctx.cluster.num_nodes
        self.n = ctx.num_units
        self.cap = int(self.cost.token_capacity)
        # candidate spans: 1..U inside a node, then whole nodes
        self.spans = [Span(1, "local")] + [Span(g, "intra") for g in range(2, self.upn + 1)]
        ks = sorted({k for k in range(2, min(self.num_nodes, 8) + 1)}
                    | {1 << e for e in range(1, self.num_nodes.bit_length()) if (1 << e) <= self.num_nodes}
                    | ({self.num_nodes} if self.num_nodes >= 2 else set()))
        self.spans += [Span(k * self.upn, "inter", k) for k in ks]

    # ------------------------------------------------------------------ cost of one placement
    def inter_sharers(self, routed_nics: int = 1) -> float:
        """Effective NIC time factor of one inter-node ring hop (1 = the hop has a NIC to itself).

        Unrouted, a hop uses the boundary unit's own NIC. Routed over ``r`` NICs, each NIC carries
        1/r of the bytes; as in :func:`zeppelin.planner.costmodel.predict.predict_step`, a NIC carrying a
        node's outgoing and incoming pieces counts both (factor 2/r), and each piece pays a
        dispatch and a combine copy over the intra-node link (2/r * nic_bw / intra_bw)."""
        if routed_nics <= 1:
            return 1.0
        c = self.cost
        ratio = c.inter_link.bandwidth_GBps / c.intra_link.bandwidth_GBps
        return min(1.0, 2.0 / routed_nics + 2.0 * ratio / routed_nics)

    def per_unit_time(self, L, span: Span, lin_rate: float, routed_nics: int = 1) -> np.ndarray:
        """Predicted busy time (s) on each unit of the span: ring attention incl. exposed
        communication, plus linear work at ``lin_rate`` seconds per token."""
        L = np.asarray(L, dtype=np.float64)
        c = self.cost
        if span.G == 1:
            att = c.attn_time(L)
        else:
            sharers = self.inter_sharers(routed_nics) if span.tier == "inter" else 1.0
            att = c.ring_attention_time(L, span.G, span.tier, sharers)
        return self.layers * att + lin_rate * L / span.G

    def exposed_fraction(self, L: float, span: Span, routed_nics: int = 1) -> float:
        if span.G == 1:
            return 0.0
        c = self.cost
        sharers = self.inter_sharers(routed_nics) if span.tier == "inter" else 1.0
        exp = float(c.ring_exposed_comm(L, span.G, span.tier, sharers))
        base = float(c.ring_compute_time(L, span.G))
        return exp / base if base > 0 else float("inf")

    def compute_waste(self, L: float, span: Span) -> float:
        """How much more compute the span's units spend on a ring over the sequence's attention than
        one unit spends on it whole, as a fraction of the latter."""
        if span.G == 1:
            return 0.0
        c = self.cost
        return float(_waste(span.G, c.ring_compute_time(float(L), span.G), c.attn_time(float(L))))

    # ------------------------------------------------------------------ thresholds
    def hide_threshold(self, G: int, tier: str, routed_nics: int = 1) -> int | None:
        """Shortest length whose ring over G units (tier's link) hides its communication."""
        if G <= 1:
            return 1
        span = Span(G, tier, max(1, G // self.upn))
        return _first_true(lambda L: self.exposed_fraction(L, span, routed_nics) <= 1e-9, 2 * G)

    @cached_property
    def memory_thresholds(self) -> dict[str, int]:
        return {
            "unit": self.cap,
            "node": self.cap * self.upn,
            "cluster": self.cap * self.n,
        }

    def min_span(self, L: int) -> Span | None:
        """Smallest span whose zigzag chunks fit a unit's activation memory (None: nowhere)."""
        for s in self.spans:
            if zigzag_max_tokens(L, s.G) <= self.cap:
                return s
        return None

    def choose_span(self, L: int, target: float, lin_rate: float, routed_nics: int = 1) -> Span:
        """Span for a sequence of length L given the step's balanced per-unit load ``target``."""
        first = None
        chosen = None
        for s in self.spans:
            if zigzag_max_tokens(L, s.G) > self.cap:
                continue
            if first is None:
                first = s
            t = float(self.per_unit_time(L, s, lin_rate, routed_nics))
            if t <= target:
                chosen = s
                break
        if first is None:
            raise ValueError("does not fit")
        if chosen is None:
            # even the widest span cannot bring it under the target: the step is bounded by
            # this sequence; take the span with the least per-unit time
            feas = [s for s in self.spans if zigzag_max_tokens(L, s.G) <= self.cap]
            ts = [float(self.per_unit_time(L, s, lin_rate, routed_nics)) for s in feas]
            return next(s for s, t in zip(feas, ts) if t <= 1.05 * min(ts))
        # refine: while a piece is coarse and splitting further is free, split further (stay in
        # the same tier: going inter-node only when needed)
        idx = self.spans.index(chosen)
        while float(self.per_unit_time(L, self.spans[idx], lin_rate, routed_nics)) > GRANULARITY * target:
            if idx + 1 >= len(self.spans):
                break
            nxt = self.spans[idx + 1]
            if nxt.tier == "inter" and self.spans[idx].tier != "inter":
                break
            if self.exposed_fraction(L, nxt, routed_nics) > FREE_WASTE or self.compute_waste(L, nxt) > FREE_COMPUTE:
                break
            idx += 1
        return self.spans[idx]

    def ulysses_ok(self, G: int) -> bool:
        """Whether an intra-node span of G units may run as Ulysses: G splits the unit's heads evenly."""
        return 2 <= G <= self.upn and (self.ctx.model.num_heads // self.ctx.tp) % G == 0

    def split_prices(self, L, G: int, tier: str, sharers: float = 1.0, ulysses: bool = False):
        """Per-layer prices of splitting sequences ``L`` over G units: (ring compute, ring exposed
        communication, (Ulysses head-shard compute, Ulysses all-to-all) or None where the span may
        not run as Ulysses)."""
        c = self.cost
        base = c.ring_compute_time(L, G)
        exp = c.ring_exposed_comm(L, G, tier, sharers)
        uly = None
        if ulysses and tier == "intra" and self.ulysses_ok(G):
            uly = (c.ulysses_attn_time(L, G), c.ulysses_comm_time(L / G, G, "intra"))
        return base, exp, uly

    def span_table(self, L, routed_nics: int = 1, ulysses: bool = False) -> SpanTable:
        """Per candidate span and sequence: attention time per unit (all layers, incl. exposed
        communication), memory fit and exposed-communication fraction. Independent of the step's
        target and linear rate, so one table serves every refinement of a micro-batch.

        ``ulysses``: an intra-node span may instead run as Ulysses (all-to-all to head shards,
        whole-sequence kernels on H/G heads, communication exposed); the table keeps, per span and
        sequence, the cheaper of the two and marks Ulysses in ``U``.

        Every entry is a function of its span and its sequence's length alone, so where many
        sequences share a length (:data:`DISTINCT_LENGTHS_MIN`) the table is priced once per distinct
        length (:class:`DistinctSpanTable`: each sequence's column is its length's, the same values)."""
        L = np.asarray(L, dtype=np.float64)
        if len(L) >= DISTINCT_LENGTHS_MIN:
            Lu, inv = np.unique(L, return_inverse=True)
            if len(Lu) <= DISTINCT_LENGTHS_SHARE * len(L):
                return DistinctSpanTable(L, self._span_table(Lu, routed_nics, ulysses), inv)
        return self._span_table(L, routed_nics, ulysses)

    def _span_table(self, L: np.ndarray, routed_nics: int, ulysses: bool) -> SpanTable:
        """:meth:`span_table` priced per entry of ``L``."""
        S, m = len(self.spans), len(L)
        Li = L.astype(np.int64)
        A = np.empty((S, m))
        F = np.empty((S, m), dtype=bool)
        E = np.empty((S, m))
        U = np.zeros((S, m), dtype=bool)
        W = np.zeros((S, m))
        R = np.empty((S, m)) if ulysses else None
        Q = np.full((S, m), np.inf) if ulysses else None
        c = self.cost
        attn_L = c.attn_time(L)
        for k, sp in enumerate(self.spans):
            if sp.G == 1:
                A[k] = self.layers * attn_L
                F[k] = Li <= self.cap
                E[k] = 0.0
                if R is not None:
                    R[k] = A[k]
                continue
            sharers = self.inter_sharers(routed_nics) if sp.tier == "inter" else 1.0
            base, exp, uly = self.split_prices(L, sp.G, sp.tier, sharers, ulysses)
            A[k] = self.layers * (base + exp)  # == ring_attention_time
            q, r = np.divmod(Li, 2 * sp.G)
            F[k] = 2 * q + np.where(r >= sp.G + 1, 2, np.where(r >= 1, 1, 0)) <= self.cap
            E[k] = np.where(base > 0, exp / np.maximum(base, 1e-30), np.inf)
            W[k] = _waste(sp.G, base, attn_L)
            if R is not None:
                R[k] = A[k]
            if uly is not None:
                u_comp, u_comm = uly
                better = u_comp + u_comm < base + exp
                Q[k] = self.layers * (u_comp + u_comm)
                U[k] = better
                A[k] = np.where(better, self.layers * (u_comp + u_comm), A[k])
                E[k] = np.where(better, u_comm / np.maximum(u_comp, 1e-30), E[k])
                W[k] = np.where(better, _waste(sp.G, u_comp, attn_L), W[k])
        return SpanTable(L, A, F, E, np.array([sp.G for sp in self.spans], dtype=np.float64), U if ulysses else None, R, Q,
                         W=W)

    def usp_prices(self, table: SpanTable) -> np.ndarray | None:
        """(spans, seqs): per-unit attention seconds (all layers) of each sequence alone on each
        inter-node span run as a usp group instead of a ring (rows of the widest usp row size inside
        each node, as :func:`.groups.as_usp` lays it out; the rows' all-to-alls included); inf on
        the other spans. None where the model allows no usp row. Kept on the table."""
        from zeppelin.planner.costmodel.predict import usp_row_sizes

        rows = usp_row_sizes(self.ctx)
        if table.V is not None or not rows:
            return table.V
        if table.distinct is not None:
            base, cols = table.distinct
            table.V = self.usp_prices(base)[:, cols]
            return table.V
        u, c, L = max(rows), self.cost, table.L
        V = np.full((len(self.spans), len(L)), np.inf)
        for k, sp in enumerate(self.spans):
            if sp.tier == "inter" and sp.G % u == 0:
                V[k] = self.layers * (c.usp_seq_time(L, u, sp.G // u, "inter")
                                      + c.ulysses_comm_time(L / sp.G, u, "intra"))
        table.V = V
        return V

    def choose_spans(self, L, target: float, lin_rate: float, routed_nics: int = 1,
                     table: SpanTable | None = None) -> list[Span]:
        """Vectorised :meth:`choose_span` over an array of lengths (same rule)."""
        table = table if table is not None else self.span_table(L, routed_nics)
        return [self.spans[k] for k in self.choose_span_index(table, target, lin_rate)]

    def choose_span_index(self, table: SpanTable, target: float, lin_rate: float,
                          times: np.ndarray | None = None, free_compute: float | None = None) -> np.ndarray:
        """The spans of :meth:`choose_span`'s rule; ``times``: the per-unit times to compare
        (default ``table.times(lin_rate)``); ``free_compute``: the compute a free split may waste
        (default :data:`FREE_COMPUTE`; infinite: a split whose transfers hide is free)."""
        m = len(table.L)
        S = len(self.spans)
        if m == 0:
            return np.zeros(0, dtype=np.int64)
        F, E, W = table.F, table.E, table.W
        waste = FREE_COMPUTE if free_compute is None else free_compute
        T = table.times(lin_rate) if times is None else times
        if not F.any(axis=0).all():
            raise ValueError("does not fit")
        ok = F & (T <= target)
        has = ok.any(axis=0)
        idx = np.where(has, ok.argmax(axis=0), 0)
        if not has.all():
            # nothing brings it under the target: the step is bounded by this sequence. Take the
            # smallest span within 5% of the least per-unit time (exposed ring communication
            # hardly shrinks with G, so wider spans would only waste device time)
            Tm = np.where(F, T, np.inf)
            near = Tm <= 1.05 * Tm.min(axis=0)[None, :]
            idx = np.where(has, idx, near.argmax(axis=0))
        tiers = np.array([sp.tier == "inter" for sp in self.spans])
        active = has.copy()
        cols = np.arange(m)
        for _ in range(S):
            if not active.any():
                break
            nxt = np.minimum(idx + 1, S - 1)
            step = (active & (idx + 1 < S) & (T[idx, cols] > GRANULARITY * target)
                    & ~(tiers[nxt] & ~tiers[idx]) & (E[nxt, cols] <= FREE_WASTE) & F[nxt, cols]
                    & (W[nxt, cols] <= waste))
            idx = np.where(step, nxt, idx)
            active = step
        return idx

    # ------------------------------------------------------------------ explanation
    def summary(self, routed_nics: int | None = None) -> dict:
        nn = routed_nics if routed_nics is not None else len(self.ctx.cluster.nics)
        out = {
            "memory": self.memory_thresholds,
            "intra_hide": {str(g): self.hide_threshold(g, "intra") for g in (2, self.upn) if 2 <= g <= self.upn},
        }
        if self.num_nodes >= 2:
            G = 2 * self.upn
            out["inter_hide_one_nic"] = self.hide_threshold(G, "inter", 1)
            out["inter_hide_routed"] = self.hide_threshold(G, "inter", nn)
        return out

