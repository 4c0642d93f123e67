"""Communication costs of the analytic cost model: links, ring exchanges and what the rounds'
compute hides of them, all-to-alls (Ulysses), all-gather context parallelism, the remap between the
attention and linear layouts, the data-parallel collectives (gradient all-reduce, FSDP) and
tensor-parallel (TP-SP) collectives. A mixin of :class:`~zeppelin.planner.costmodel.cost.CostModel`.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from zeppelin.planner.costmodel.compute import as_array, eval_fit
from zeppelin.schemas.profile import LinkCost


class CommCosts:
    """Link and collective times of one unit (see :mod:`zeppelin.planner.costmodel.cost`)."""

    # ---------------------------------------------------------------- links
    @cached_property
    def _gpus_per_nic(self) -> int:
        """The most GPUs of a node that send through one NIC."""
        return max(len(self.cluster.gpus_on_nic(n.id)) for n in self.cluster.nics)

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
        b = as_array(nbytes)
        return np.where(b > 0, lk.alpha_s + b * as_array(sharers) / (lk.bandwidth_GBps * 1e9), 0.0)

    def p2p_seconds(self, nbytes: float, cls: str = "intra") -> float:
        """:meth:`p2p_time` of one transfer, unshared, as a Python float (the same IEEE operations:
        for loops over many transfers, where a numpy call per transfer costs more than its arithmetic)."""
        lk = self.link(cls)
        return lk.alpha_s + nbytes * 1.0 / (lk.bandwidth_GBps * 1e9) if nbytes > 0 else 0.0

    def tier_link(self, tier: str) -> str:
        return "inter" if tier == "inter" else "intra"

    @property
    def act_bytes(self) -> int:
        return self.model.dtype_bytes

    def kv_bytes(self, tokens) -> np.ndarray:
        """Bytes of K and V for ``tokens`` tokens (one layer), this unit's TP share."""
        return as_array(tokens) * 2 * self.model.kv_dim * self.act_bytes / self.tp

    def hidden_bytes(self, tokens) -> np.ndarray:
        return as_array(tokens) * self.model.hidden * self.act_bytes / self.tp

    # ---------------------------------------------------------------- rings: exchanges, exposure
    def ring_round_bytes(self, chunk_tokens) -> np.ndarray:
        """Bytes one rank sends per ring round, fwd + bwd, one layer: K,V forward; K,V + dK,dV backward."""
        return 3.0 * self.kv_bytes(chunk_tokens)

    def ring_round_bytes_of(self, chunk_tokens: float) -> float:
        """:meth:`ring_round_bytes` of one chunk as a Python float (the same IEEE operations)."""
        return 3.0 * (float(chunk_tokens) * 2 * self.model.kv_dim * self.act_bytes / self.tp)

    def ring_sync(self, G: int):
        """Measured seconds one ring round's exchanges add beyond compute (fits.ring_sync_s); None without it."""
        f = self._fits
        if f is None or str(G) not in f.ring_sync_s:
            return None
        return float(f.ring_sync_s[str(G)])

    def ring_exchanges(self, L, G: int) -> np.ndarray:
        """K/V exchanges a ring of G units posts per layer (the layer types' mean): G - 1 for full
        causal attention, fewer where a window leaves later rounds nothing to compute."""
        L = as_array(L)
        if self.window_mix is None or G <= 1:
            return np.full(np.shape(L), float(max(G - 1, 0)))
        return self._mixed(lambda w: self._ring_rounds(L, G, w)[1])

    def ring_attention_time(self, L, G: int, tier: str = "intra", nic_sharers: float = 1.0) -> np.ndarray:
        """Per-layer fwd+bwd time of ring attention of whole sequences L over G units (zigzag).

        Round r's compute overlaps the transfer of the K/V block round r+1 needs; a transfer that
        takes longer than the compute it hides behind is exposed."""
        L = as_array(L)
        if G <= 1:
            return self.attn_time(L)
        return self.ring_compute_time(L, G) + self.ring_exposed_comm(L, G, tier, nic_sharers)

    def ring_exposed_comm(self, L, G: int, tier: str = "intra", nic_sharers: float = 1.0) -> np.ndarray:
        """Per-layer exposed communication of a zigzag ring: the G-1 transfers hide behind rounds
        0 .. G-2 (round 0 first, then G-2 regular rounds)."""
        L = as_array(L)
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
        out = np.zeros(np.shape(as_array(L)))
        for r in range(G - 1):
            out = out + np.where(r < nex, np.maximum(comm - rounds[r], 0.0), 0.0)
        return out

    def ring_round_exposure(self, comm, t0, tr, G: int, exchanges=None) -> np.ndarray:
        """Exposed time of a ring of G units whose per-round transfer takes ``comm`` and whose round
        0 / later rounds compute ``t0`` / ``tr``: the G-1 transfers hide behind rounds 0 .. G-2.
        A measured profile's per-round exchange cost (``ring_sync``) replaces the transfer model."""
        sync = self.ring_sync(G)
        if exchanges is not None:  # a windowed ring posts fewer exchanges than G - 1
            ex = as_array(exchanges)
            if sync is not None:
                return ex * sync
            return np.where(ex > 0, np.maximum(comm - t0, 0.0) + np.maximum(ex - 1, 0.0) * np.maximum(comm - tr, 0.0),
                            0.0)
        if sync is not None:  # profiled: what the runtime's exchanges cost beyond compute, per round
            return np.broadcast_to(np.float64((G - 1) * sync), np.shape(comm)).copy()
        return np.maximum(comm - t0, 0.0) + (G - 2) * np.maximum(comm - tr, 0.0)

    # ---------------------------------------------------------------- Ulysses, all-gather CP, remap
    def alltoall_time(self, bytes_per_rank, G: int, cls: str = "intra") -> np.ndarray:
        """All-to-all where each rank holds ``bytes_per_rank`` and keeps 1/G of it."""
        if G <= 1:
            return np.zeros_like(as_array(bytes_per_rank))
        eff = self.profile.alltoall_efficiency.get(str(G), 1.0)
        lk = self.link(cls)
        nbytes = as_array(bytes_per_rank)
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

    def ulysses_bytes_per_token(self, G: int) -> float:
        """Bytes one rank's all-to-all moves per token it holds, one direction of one layer's forward:
        Q and O (``hidden`` each) and K, V - ``kv_replication(G)`` times where the G positions of a
        Ulysses row outnumber the unit's KV heads (each position receives a whole KV head)."""
        m = self.model
        return (2 * m.hidden + 2 * m.kv_dim * self.kv_replication(G)) * self.act_bytes / self.tp

    def ulysses_comm_time(self, tokens_per_rank, G: int, cls: str = "intra") -> np.ndarray:
        """Per-layer fwd+bwd: 4 all-to-alls (Q,K,V in, O out) forward and 4 backward, the K/V heads
        replicated where G exceeds them (:meth:`ulysses_bytes_per_token`; the backward returns as
        many dK/dV, summed to their owners)."""
        return 2.0 * self.alltoall_time(as_array(tokens_per_rank) * self.ulysses_bytes_per_token(G), G, cls)

    def kv_replication(self, u: int) -> float:
        """Row positions each KV head lands on when u positions split a unit's heads (1: none)."""
        return max(1.0, u / max(1, self.model.num_kv_heads // self.tp))

    def ring_hop_share(self, g) -> tuple[int, float]:
        """``(rounds, K/V share)`` of one hop of a group's ring: a ring of G units sends whole blocks
        G - 1 rounds; a usp group's column ring (:func:`zeppelin.schemas.invariants.group_rings`)
        sends, r - 1 rounds, its position's heads of its row's block: ``kv_replication(u) / u`` of
        the K/V (one KV head where replicated)."""
        if g.kind == "usp" and g.shape is not None:
            u, r = g.shape
            return r - 1, self.kv_replication(u) / u
        return len(g.units) - 1, 1.0

    def usp_ring_sharers(self, u: int, ring_cls: str) -> float:
        """Transfers sharing one NIC in a round of a usp group's rings: the u columns' hops leave
        every node at once, one per GPU of the row, each GPU on its own NIC."""
        if ring_cls != "inter" or not self.profile.nic_shared_by_concurrent_transfers:
            return 1.0
        return float(min(self._gpus_per_nic, u * self.tp))

    def usp_seq_time(self, L, u: int, r: int, ring_cls: str) -> np.ndarray:
        """Per sequence ``L`` alone on a usp group of u x r: per-layer fwd+bwd attention on 1/u of
        the heads plus its ring's exposed K/V transfers (the rows' all-to-alls excluded: they
        scale with a unit's tokens, see :meth:`ulysses_comm_time`)."""
        L = as_array(L)
        t0, tr = self.ring_round_compute(L, r)
        t0, tr = t0 / u, tr / u
        if r <= 1:
            return t0
        comm = self.p2p_time(self.ring_round_bytes(L / r) * self.kv_replication(u) / u, ring_cls,
                             self.usp_ring_sharers(u, ring_cls))
        ex = self.ring_exchanges(L, r) if self.window_mix is not None else None
        return t0 + (r - 1) * tr + self.ring_round_exposure(comm, t0, tr, r, ex)

    def usp_terms(self, L, u: int, r: int, row_cls: str, ring_cls: str, round_time: float | None = None,
                  floor: float = 0.0) -> tuple[float, float, float]:
        """Per-layer fwd+bwd ``(attention, communication, exposed)`` of one position of a usp group
        of u x r over sequences ``L``: the rows' all-to-alls (replicated K/V; in the exposed time,
        nothing overlaps them), and a ring over r positions on 1/u of the heads (its rounds'
        compute, its K/V blocks of 1/u of the heads - one KV head when u exceeds them - hidden
        behind the rounds as a ring's are). ``round_time``: a round's transfer as the group's
        routes make it (their NIC flows, proxies' hops; default: direct, every column's hop on its
        own GPU's NIC); ``floor``: the least time the rings' crossings take over the layer (the
        busiest NIC side they use), which the ring's rounds cannot beat."""
        L = as_array(L)
        tot = float(np.sum(L))
        kv_frac = self.kv_replication(u) / u
        a2a = float(self.ulysses_comm_time(tot / (u * r), u, row_cls)) if u > 1 else 0.0
        t0, tr = self.ring_round_compute(L, r)
        g_t0, g_tr = float(np.sum(t0)) / u, float(np.sum(tr)) / u
        if r <= 1:
            return g_t0, a2a, a2a
        ex = float(np.max(self.ring_exchanges(L, r))) if self.window_mix is not None else None
        comm = round_time if round_time is not None else float(
            self.p2p_time(self.ring_round_bytes(tot / r) * kv_frac, ring_cls, self.usp_ring_sharers(u, ring_cls)))
        att = g_t0 + (r - 1) * g_tr
        exposed = max(float(self.ring_round_exposure(comm, g_t0, g_tr, r, ex)), floor - att)
        return att, a2a + comm * (r - 1 if ex is None else ex), a2a + exposed

    def allgather_kv_time(self, tokens_per_rank, G: int, cls: str = "intra") -> np.ndarray:
        """Per-layer fwd+bwd of all-gather CP: all-gather K,V forward; all-gather + reduce-scatter dK,dV backward."""
        if G <= 1:
            return np.zeros_like(as_array(tokens_per_rank))
        lk = self.link(cls)
        b = self.kv_bytes(tokens_per_rank) * (G - 1)
        return 3.0 * (lk.alpha_s * (G - 1) + b / (lk.bandwidth_GBps * 1e9))

    def remap_time(self, max_tokens_moved_per_unit, cls: str = "intra") -> np.ndarray:
        """Per-layer fwd+bwd: two all-to-alls of hidden activations forward, two backward (a
        ``remap_payload: qkv`` model moves Q, K and V to the attention layout and the attention
        output back, and the same widths in backward)."""
        to_attn, to_lin = self.model.remap_widths()
        tok = as_array(max_tokens_moved_per_unit)
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
            nb = as_array(nbytes)
            return np.where(nb > 0, a + b * nb, 0.0)
        return self.p2p_time(nbytes, cls)

    # ---------------------------------------------------------------- data parallelism (all-reduce, FSDP)
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
    def fsdp_measured_s(self) -> float | None:
        """Seconds FSDP2 adds to each micro-batch at this plan's ZeRO stage, as the profile measured
        them (``fits.fsdp_microbatch_s``); None without that measurement. The runtime shards every
        parameter over all ranks whatever the units' TP degree, so a TP unit without a measurement
        of its own takes the TP-1 fits' one."""
        for f in (self._fits, self._fits_tp1):
            if f is not None and f.fsdp_microbatch_s:
                return f.fsdp_microbatch_s.get("3" if self.zero_stage >= 3 else "1")
        return None

    @property
    def fsdp_microbatch_s(self) -> float | None:
        """Seconds FSDP2 adds to each micro-batch: the profile's measurement
        (:attr:`fsdp_measured_s`) when it has one, else the collectives priced from the links'
        bandwidth (:meth:`fsdp_comm_s`); None at ZeRO-0 (replicated weights: one all-reduce per
        step) or on one GPU. One unit of several TP ranks pays it too: FSDP2's mesh spans every
        rank, TP ranks included."""
        if self.zero_stage < 1 or self.cluster.world_size <= 1:
            return None
        fs = self.fsdp_measured_s
        return float(fs) if fs is not None else self.fsdp_comm_s()

    def fsdp_collective_time(self, whole_bytes: float, calls: int = 1) -> float:
        """``calls`` all-gathers (or reduce-scatters) over FSDP's shard group - every rank of the
        cluster, as the runtime's mesh spans them (TP ranks included) - of tensors of
        ``whole_bytes`` in all, each rank holding 1/W of them: as NCCL runs it hierarchically,
        each node's GPUs exchange with their peers on the other nodes through all of the node's
        NICs ((N-1)/N of the bytes into each node), then the GPUs of a node among themselves over
        the intra-node links ((g-1)/g of the bytes into each GPU); one node: a ring over the
        intra-node links. Each call waits its links' latency once per ring hop."""
        W = self.cluster.world_size
        if W <= 1 or whole_bytes <= 0:
            return 0.0
        nodes = self.cluster.num_nodes if W > self.cluster.gpus_per_node else 1
        g = W // nodes
        intra = self.intra_link
        t = (g - 1) / g * whole_bytes / (intra.bandwidth_GBps * 1e9) + calls * (g - 1) * intra.alpha_s
        if nodes > 1:
            t += ((nodes - 1) / nodes * whole_bytes / (self.cluster.node_nic_bandwidth_GBps * 1e9)
                  + calls * (nodes - 1) * self.inter_link.alpha_s)
        return float(t)

    @cached_property
    def fsdp_terms(self) -> tuple[float, float, float]:
        """FSDP2's collectives in one micro-batch, priced from the links' bandwidth, as
        ``(exposed, forward, backward)`` seconds: every FSDP unit (each decoder block; the root:
        embedding, final norm, LM head) all-gathers its parameters in the compute dtype before its
        forward, at ZeRO-3 each block again before its backward (the root is not re-sharded after
        the forward), and reduce-scatters its fp32 gradients after its backward. FSDP2 prefetches
        the next block's all-gather while a block computes and reduce-scatters a block's gradients
        while the next one runs its backward: ``exposed`` is what no compute can hide (the root's
        collectives, the first block's all-gathers, the last block's reduce-scatter);
        ``forward``/``backward`` are the other blocks' collectives, one block's per layer, which
        a layer's forward / backward compute hides (:meth:`fsdp_exposed_s`)."""
        m = self.model
        c = self.compute_bytes
        block = m.params_per_layer()
        root = m.num_params() - m.num_layers * block
        ag = self.fsdp_collective_time(c * block)
        rs = self.fsdp_collective_time(4.0 * block)
        ag_bwd = ag if self.zero_stage >= 3 else 0.0
        exposed = (self.fsdp_collective_time(c * root) + self.fsdp_collective_time(4.0 * root)
                   + ag + ag_bwd + rs)
        rest = max(m.num_layers - 1, 0)
        return exposed, rest * ag, rest * (ag_bwd + rs)

    def fsdp_comm_s(self) -> float:
        """Every FSDP2 collective of one micro-batch, none hidden (:meth:`fsdp_terms`)."""
        return float(sum(self.fsdp_terms))

    def fsdp_overlaps(self) -> bool:
        """Whether FSDP2's prefetched collectives run beside the kernels: on a GPU they run on their
        own streams; on the CPU, FSDP2's copies into and out of the gathered buffers run on the
        thread that computes and gloo's transfers share its cores."""
        return self.cluster.device == "cuda"

    def fsdp_exposed_s(self, compute_s: float | None = None) -> float:
        """What FSDP2 adds to a micro-batch whose layers compute for ``compute_s`` seconds in all
        (forward + backward, the slowest unit: FSDP couples every unit): the profile's measurement
        when it has one (:attr:`fsdp_measured_s`), else the collectives priced from the links
        (:meth:`fsdp_terms`), a layer's forward (a third of its compute) hiding the next block's
        all-gather and its backward (two thirds) the collectives of the block after it, where the
        device overlaps them (:meth:`fsdp_overlaps`; ``compute_s`` None: nothing hidden)."""
        fs = self.fsdp_measured_s
        if fs is not None:
            return float(fs)
        exposed, fwd, bwd = self.fsdp_terms
        if compute_s is None or not self.fsdp_overlaps():
            return exposed + fwd + bwd
        per_layer = float(compute_s) / max(self.model.num_layers, 1)
        rest = max(self.model.num_layers - 1, 0)
        return (exposed + max(fwd - rest * per_layer / 3.0, 0.0)
                + max(bwd - rest * 2.0 * per_layer / 3.0, 0.0))

    def step_collectives_time(self, microbatches: int = 1, num_units: int | None = None,
                              compute_s=None) -> float:
        """The step's data-parallel collectives, charged to every unit: at ZeRO 1-3 what FSDP2 adds
        to each of the step's micro-batches (:meth:`fsdp_exposed_s`; ``compute_s``: each
        micro-batch's layer compute, which hides FSDP2's prefetched collectives), at ZeRO-0 the
        gradient all-reduce once (:meth:`grad_allreduce_time`)."""
        if self.fsdp_microbatch_s is None:
            return self.grad_allreduce_time(num_units)
        if compute_s is None:
            return microbatches * self.fsdp_exposed_s()
        return float(sum(self.fsdp_exposed_s(c) for c in compute_s))

    # ---------------------------------------------------------------- tensor parallelism (TP-SP)
    TP_SITES = 8  # collective sites per layer: AG before QKV and MLP-in, RS after O and MLP-out; x2 for backward

    SLICING_CHUNKS = 4

    def tp_site_times(self, tokens) -> tuple[np.ndarray, np.ndarray]:
        """(communication, GEMM) time of one TP-SP collective site (all-gather or reduce-scatter
        of the unit's tokens around a column-/row-parallel GEMM), per layer."""
        T = as_array(tokens)
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
            T = as_array(tokens)
            extra = eval_fit(f.linear_tp_comm[mode], T, 1) - eval_fit(f.linear, T, 1)
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
