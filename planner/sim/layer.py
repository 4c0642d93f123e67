"""The simulator's layer model: the task graph of one transformer layer (fwd + bwd) of one
micro-batch, built on an :class:`~zeppelin.planner.sim.engine.Engine` (attention groups in queue
order: local blocks, ring rounds and their K/V transfers, all-gathers, Ulysses all-to-alls; the
remap into the linear layout, the linear modules, the remap back), and what the units and NICs did
once it has run.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.planner.sim.engine import Engine
from zeppelin.planner.sim.results import Interval
from zeppelin.schemas.layout import merged_ranges, ranges_tokens
from zeppelin.schemas.plan import MicroBatch, Placement, Replica, StepPlan

if TYPE_CHECKING:
    from zeppelin.planner.sim.simulate import Simulator

__all__ = ["LayerGraph"]

_INF = float("inf")


def _prefix_pairs(x: np.ndarray, ks: np.ndarray, ke: np.ndarray) -> np.ndarray:
    """Number of causal (q, k) pairs with q < x, ks <= k < ke and k <= q."""
    lk = ke - ks
    m = np.clip(x - ks, 0, lk)
    return m * (m + 1) / 2.0 + np.maximum(x - ke, 0) * lk


class LayerGraph:
    """The task graph of one transformer layer (fwd + bwd) of one micro-batch."""

    def __init__(self, sim: Simulator, step: StepPlan, mb: MicroBatch, reps: list[Replica], compute: bool = True,
                 window: int | None = None):
        self.sim, self.step, self.mb, self.reps = sim, step, mb, reps
        #: the layer's attention window (None: full causal attention)
        self.window = window
        #: False: kernel times are not priced (every compute task takes no time): the graph is built
        #: for its transfers only (:meth:`Simulator.nic_traffic`)
        self.compute = compute
        self.n = len(reps)
        self.engine = Engine(sim.capacity)
        self.node = [sim.cluster.node_of(r.ranks[0]) for r in reps]
        self.attn_tasks: dict[int, list[int]] = defaultdict(list)  # unit -> compute tasks of attention
        self.links: list[tuple[int, int]] = []  # coupled unit pairs
        self.linear_tokens = np.zeros(self.n, dtype=np.int64)

    # ------------------------------------------------------------------ transfers
    def _gpu_flow(self, ga: int, gb: int, nbytes: float, deps, cat: str, units: tuple, work: float | None = None,
                  latency_mult: float = 1.0, nic_a: str | None = None, nic_b: str | None = None) -> int:
        """One GPU-to-GPU flow over the intra link (same node) or the two NICs (different nodes)."""
        sim, cl = self.sim, self.sim.cluster
        if cl.node_of(ga) == cl.node_of(gb):
            if ga == gb:
                return self.engine.mark(deps)
            return self.engine.flow(nbytes, (f"gtx{ga}", f"grx{gb}"), sim.intra_alpha * latency_mult, deps,
                                    work=work, cat=cat + "-intra", units=units)
        na = nic_a or cl.nic_of(ga)
        nb = nic_b or cl.nic_of(gb)
        if sim.nic_shared:
            res, cap = (f"ntx:{na}", f"nrx:{nb}"), _INF
        else:
            res, cap = (), sim.nic_bw
        return self.engine.flow(nbytes, res, sim.nic_alpha * latency_mult, deps, work=work, cap=cap,
                                cat=cat + "-inter", units=units, nics=(na, nb))

    def transfer(self, a: int, b: int, per_gpu_bytes: float, deps, cat: str, *, route=None,
                 work_factor: float = 1.0, latency_mult: float = 1.0) -> int:
        """Unit ``a`` -> unit ``b``: one flow per tensor-parallel rank (each moves its shard)."""
        ra, rb = self.reps[a].ranks, self.reps[b].ranks
        self.links.append((a, b))
        deps = list(deps)
        if route is not None and self.node[a] != self.node[b]:
            return self._routed(a, b, per_gpu_bytes, deps, cat, route, work_factor)
        ends = []
        for k, ga in enumerate(ra):
            gb = rb[k % len(rb)]
            ends.append(self._gpu_flow(ga, gb, per_gpu_bytes, deps, cat, (a, b), work=per_gpu_bytes * work_factor,
                                       latency_mult=latency_mult))
        tid = ends[0] if len(ends) == 1 else self.engine.mark(ends)
        return tid

    def _routed(self, a: int, b: int, per_gpu_bytes: float, deps, cat: str, route, work_factor: float) -> int:
        """dispatch (src -> proxy, NVLink) -> NIC transfer (proxy -> proxy) -> combine (proxy -> dst)."""
        ends = []
        total = route.tokens
        for p in route.paths:
            if p.tokens <= 0 or total <= 0:
                continue
            share = per_gpu_bytes * p.tokens / total
            ra, rb = self.reps[a].ranks, self.reps[b].ranks
            pa, pb = self.reps[p.via_src].ranks, self.reps[p.via_dst].ranks
            self.links += [(a, p.via_src), (p.via_src, p.via_dst), (p.via_dst, b)]
            for k, ga in enumerate(ra):
                d = list(deps)
                gpa = pa[k % len(pa)]
                gpb = pb[k % len(pb)]
                gb = rb[k % len(rb)]
                if gpa != ga:
                    d = [self._gpu_flow(ga, gpa, share, d, "dispatch", (a, p.via_src), work=share * work_factor)]
                one_nic = len(pa) == 1 and len(pb) == 1
                d = [self._gpu_flow(gpa, gpb, share, d, cat, (p.via_src, p.via_dst), work=share * work_factor,
                                    nic_a=p.nic_src if one_nic else None, nic_b=p.nic_dst if one_nic else None)]
                if gpb != gb:
                    d = [self._gpu_flow(gpb, gb, share, d, "combine", (p.via_dst, b), work=share * work_factor)]
                ends.append(d[0])
        tid = self.engine.mark(ends) if ends else self.engine.mark(deps)
        return tid

    # ------------------------------------------------------------------ attention blocks
    def _block_times(self, pls: list[Placement], G: int, cost: CostModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per placement p, position i, round r: fwd+bwd time of i's queries against the K/V of
        position (i - r) mod G (one kernel call); also tokens per (p, position) and call counts."""
        P = len(pls)
        R = max(1, max(len(rs) for p in pls for rs in p.ranges))
        qs = np.zeros((P, G, R))
        qe = np.zeros((P, G, R))
        for pi, p in enumerate(pls):
            for i, rs in enumerate(p.ranges):
                for k, (s, e) in enumerate(rs):
                    qs[pi, i, k], qe[pi, i, k] = s, e
        tok = (qe - qs).sum(axis=2)  # (P, G)
        j = (np.arange(G)[:, None] - np.arange(G)[None, :]) % G  # [i, r] -> source position
        q_start = qs[:, :, None, :, None]
        q_end = qe[:, :, None, :, None]
        k_start = qs[:, j][:, :, :, None, :]
        k_end = qe[:, j][:, :, :, None, :]
        causal = _prefix_pairs(q_end, k_start, k_end) - _prefix_pairs(q_start, k_start, k_end)
        pairs = causal
        w = self.window
        if w is not None:  # the pairs with k <= q - w: those of the queries shifted back by w
            pairs = causal - (_prefix_pairs(q_end - w, k_start, k_end) - _prefix_pairs(q_start - w, k_start, k_end))
        lq = np.broadcast_to(q_end - q_start, pairs.shape)
        lk = np.broadcast_to(k_end - k_start, pairs.shape)
        nz = (pairs > 0) & (lq > 0) & (lk > 0)
        if not self.compute:
            return np.zeros((P, G, G)), tok, nz.sum(axis=(3, 4))
        same_start = np.broadcast_to(q_start, pairs.shape) == np.broadcast_to(k_start, pairs.shape)
        square = nz & same_start & (lq == lk)
        diag = square & (pairs >= causal)
        wdiag = square & ~diag  # a diagonal the window cuts: a causal square of its pair count
        full = nz & ~square & (pairs >= lq * lk)
        part = nz & ~square & ~full
        t = np.zeros(pairs.shape)
        if diag.any():
            t[diag] = cost.attn_block_time(lq[diag], lq[diag], causal=True)
        if full.any():
            t[full] = cost.attn_block_time(lq[full], lk[full], causal=False)
        if part.any():
            t[part] = cost.attn_block_time(lq[part], pairs[part] / lq[part], causal=False)
        if wdiag.any():
            e = np.sqrt(2.0 * pairs[wdiag])
            t[wdiag] = cost.attn_block_time(e, e, causal=True)
        calls = nz.sum(axis=(3, 4))  # pieces per (p, i, r)
        tt = t.sum(axis=(3, 4)) - np.maximum(calls - 1, 0) * self.sim.attn_overhead
        # the overhead comes from the whole-sequence fit, the pieces from the block fit: where
        # pieces cost less than it, fusing them still costs at least the largest one
        tt = np.maximum(tt, t.max(axis=(3, 4)))
        return tt, tok, calls

    def _local_times(self, pls: list[Placement], tp: int) -> list[float]:
        """Per placement of a local group on a unit of ``tp`` GPUs, its attention time. A placement
        of one token range is one causal square whose time depends on its length alone (and the
        layer's window): kept in the simulator's ``whole_block_times`` across steps."""
        cost = self.sim.cost_for(tp)
        if not self.compute or any(len(p.ranges[0]) != 1 for p in pls):
            tt, _, _ = self._block_times(pls, 1, cost)
            return [float(x) for x in tt[:, 0, 0]]
        cache = self.sim.whole_block_times
        keys = [(tp, self.window, p.ranges[0][0][1] - p.ranges[0][0][0]) for p in pls]
        miss = [i for i, k in enumerate(keys) if k not in cache]
        if miss:
            for i, t in zip(miss, self._whole_block_times([pls[i] for i in miss], cost)):
                cache[keys[i]] = float(t)
        return [cache[k] for k in keys]

    def _whole_block_times(self, pls: list[Placement], cost: CostModel) -> np.ndarray:
        """:meth:`_block_times` of placements on one unit that each hold one token range: one
        causal square per placement (the same values, without the pairwise arrays)."""
        se = np.array([p.ranges[0][0] for p in pls], dtype=np.float64).reshape(-1, 2)
        qs, qe = se[:, 0], se[:, 1]
        lq = qe - qs
        causal = _prefix_pairs(qe, qs, qe) - _prefix_pairs(qs, qs, qe)
        pairs = causal
        w = self.window
        if w is not None:
            pairs = causal - (_prefix_pairs(qe - w, qs, qe) - _prefix_pairs(qs - w, qs, qe))
        nz = (pairs > 0) & (lq > 0)
        diag = nz & (pairs >= causal)
        wdiag = nz & ~diag
        t = np.zeros(len(pls))
        if diag.any():
            t[diag] = cost.attn_block_time(lq[diag], lq[diag], causal=True)
        if wdiag.any():
            e = np.sqrt(2.0 * pairs[wdiag])
            t[wdiag] = cost.attn_block_time(e, e, causal=True)
        return t

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        mb, eng = self.mb, self.engine
        n = self.n
        by_group: dict[int, list[Placement]] = defaultdict(list)
        for p in mb.placements:
            by_group[p.group].append(p)
        qpos: dict[tuple[int, int], int] = {}
        for u, q in enumerate(mb.queues):
            for k, g in enumerate(q):
                qpos[(u, g)] = k
        routes = {(r.group, r.src, r.dst): r for r in mb.routes}
        for gi, g in enumerate(mb.groups):
            pls = by_group.get(gi, [])
            if not pls:
                continue
            U = g.units
            G = len(U)
            if not self.compute and len({self.node[u] for u in U}) == 1:
                continue  # (counting NIC traffic: a group inside one node moves nothing over a NIC)
            if g.kind == "local" or G == 1:
                self._local(U[0], pls, qpos.get((U[0], gi), 0))
            elif g.kind == "ring":
                self._ring(gi, U, pls, qpos, routes)
            elif g.kind == "allgather":
                self._allgather(gi, U, pls, qpos, routes)
            elif g.kind == "usp":
                self._usp(gi, g, pls, qpos, routes)
            else:
                self._ulysses(gi, U, pls, qpos)
        # linear modules and remap
        attn_done = {u: eng.mark(self.attn_tasks.get(u, [])) for u in range(n)}
        att = mb.attention_layout(n)
        lin = mb.linear_layout if mb.linear_layout is not None else att
        lin_tok = np.array([sum(e - s for _, s, e in lin[u]) for u in range(n)], dtype=np.int64)
        self.attention_layout = att
        self.linear_tokens = lin_tok
        moves = self._remap_moves() if mb.linear_layout is not None else {}
        in_deps: dict[int, list[int]] = defaultdict(list)
        # values per token moved: to the attention layout / back to the linear layout (ModelSpec.remap_payload)
        to_attn_w, to_lin_w = self.sim.ctx.model.remap_widths()
        hidden_dev = to_lin_w * self.sim.ctx.model.dtype_bytes
        for (a, b), tokens in moves.items():
            nb = 2.0 * tokens * hidden_dev / self.reps[a].tp  # activations fwd + their gradients bwd
            f = self._remap_transfer(a, b, nb, [attn_done[a], attn_done[b]])
            in_deps[b].append(f)
            in_deps[a].append(f)
        lin_task = {}
        for u in range(n):
            cost = self.sim.cost_for(self.reps[u].tp)
            dur = self.sim.token_time("linear", self.reps[u].tp, lin_tok[u])
            lin_task[u] = eng.compute(u, dur, (10**9, 0), [attn_done[u]] + in_deps.get(u, []), cat="linear")
            extra = self._recompute_time(cost, u, dur)
            if extra > 0:  # the forward the micro-batch's recomputation runs again in the backward
                lin_task[u] = eng.compute(u, extra, (10**9, 0), [lin_task[u]], cat="recompute")
            if cost.tp > 1:  # TP-SP all-gathers / reduce-scatters the GEMMs cannot hide (per overlap mode)
                tp_exp = float(cost.tp_exposed_comm(lin_tok[u]))
                if tp_exp > 0:
                    lin_task[u] = eng.compute(u, tp_exp, (10**9, 1), [lin_task[u]], cat="tp-comm")
        for (a, b), tokens in moves.items():
            nb = 2.0 * tokens * to_attn_w * self.sim.ctx.model.dtype_bytes / self.reps[b].tp
            self._remap_transfer(b, a, nb, [lin_task[a], lin_task[b]])
        self.lin_task = lin_task

    def _recompute_time(self, cost, u: int, linear_s: float) -> float:
        """The forward unit ``u``'s recomputation runs again in this layer: its attention compute
        (the layer's attention tasks) and ``linear_s`` priced by the micro-batch's choice."""
        mode = self.mb.recompute_of(u)  # (its own in the micro-batch's recompute_units, else the micro-batch's)
        if (mode or cost.global_recompute) == "none":
            return 0.0
        tasks = self.engine.tasks
        attn = sum(tasks[t].dur for t in self.attn_tasks.get(u, ()) if tasks[t].kind == "compute")
        return float(cost.recompute_extra_time(mode, attn, linear_s))

    def _remap_transfer(self, a: int, b: int, nbytes: float, deps) -> int:
        """One remap move (``nbytes``: its forward and backward passes together). With a profile
        that measured the runtime's remap exchange, each pass takes what the profile says one
        exchange of half the bytes costs (a delay, not a flow on the links); else a transfer."""
        cost = self.sim.cost_for(self.reps[a].tp)
        if not cost.remap_measured:
            return self.transfer(a, b, nbytes, deps, "remap")
        self.links.append((a, b))
        cls = "intra" if self.node[a] == self.node[b] else "inter"
        dur = 2.0 * float(cost.remap_exchange_time(nbytes / 2.0, cls))
        return self.engine.flow(0.0, (), dur, deps, work=0.0, cat=f"remap-{cls}", units=(a, b))

    def _local(self, u: int, pls: list[Placement], qp: int) -> None:
        prev = []
        for pi, t in enumerate(self._local_times(pls, self.reps[u].tp)):
            tid = self.engine.compute(u, t, (qp, pi), prev, cat="attention")
            self.attn_tasks[u].append(tid)
            prev = [tid]

    def _ring(self, gi: int, U: list[int], pls: list[Placement], qpos, routes, share: tuple[float, float] = (1.0, 1.0),
              start: list[list[int]] | None = None) -> list[int]:
        """A ring's rounds and K/V transfers. ``share``: the part of a unit's (query heads, K/V
        heads) it computes on and moves (a usp column: 1/u of the query heads, 1/u of the K/V or
        one KV head where replicated); ``start``: per position, what its first round waits for.
        Returns each position's last round."""
        G = len(U)
        eng = self.engine
        costs = [self.sim.cost_for(self.reps[u].tp) for u in U]
        tt, tok, calls = self._block_times(pls, G, costs[0])
        tt = tt * share[0]
        c0 = costs[0]
        # [owner position, round]: some position computes on the owner's block in that round; a
        # block travels on only while a later round still needs it (windows end rings early)
        uses = np.zeros((G, G), dtype=bool)
        for r in range(G):
            for i in range(G):
                uses[(i - r) % G, r] = bool(calls[:, i, r].sum() > 0)
        still = np.zeros((G, G), dtype=bool)  # [owner, r]: needed in a round after r
        for r in range(G - 2, -1, -1):
            still[:, r] = still[:, r + 1] | uses[:, r + 1]
        Lp = np.array([sum(e - s for rs in p.ranges for s, e in rs) for p in pls], dtype=float)
        meas = c0.ring_compute_measured(Lp, G) if self.compute else None
        if meas is not None:  # each sequence's blocks scaled so that its slowest position takes as measured
            per_pos = tt.sum(axis=2).max(axis=1)
            tt = tt * np.where(per_pos > 0, meas / np.maximum(per_pos, 1e-30), 1.0)[:, None, None]
        sync = c0.ring_sync(G)
        if sync:  # the exchanges' cost beyond compute, once per round of the group, rounds 1..G-1
            tt[:, :, 1:] += sync / len(pls)
        if len({c.tp for c in costs}) > 1 and self.compute:  # mixed TP degrees: time each position with its own model
            tts = [self._block_times(pls, G, c)[0] for c in costs]
            comp = np.stack([tts[i].sum(axis=0)[i] for i in range(G)])
        else:
            comp = tt.sum(axis=0)  # (G, G)
        pos_tok = tok.sum(axis=0)  # tokens per position
        comp_t = [[-1] * G for _ in range(G)]
        send = [[-1] * max(G - 1, 0) for _ in range(G)]
        for r in range(G):
            for i in range(G):
                u = U[i]
                deps = list(start[i]) if start is not None and r == 0 else []
                if r >= 1:
                    deps.append(comp_t[i][r - 1])
                    deps.append(send[(i - 1) % G][r - 1])
                comp_t[i][r] = eng.compute(u, float(comp[i, r]), (qpos.get((u, gi), 0), r), deps, cat="attention")
                self.attn_tasks[u].append(comp_t[i][r])
            if r == G - 1:
                break
            for i in range(G):
                k = (i + 1) % G
                deps = []
                if r >= 1:
                    deps += [send[(i - 1) % G][r - 1], comp_t[k][r - 1], send[k][r - 1]]
                src_pos = (i - r) % G
                if not still[src_pos, r]:  # no later position sees this block: the ring does not send it
                    send[i][r] = eng.mark(deps)
                    continue
                nb = float(costs[i].ring_round_bytes(pos_tok[src_pos])) * share[1]
                send[i][r] = self.transfer(U[i], U[k], nb, deps, "ring", route=routes.get((gi, U[i], U[k])))
        return [comp_t[i][G - 1] for i in range(G)]

    def _allgather(self, gi: int, U: list[int], pls: list[Placement], qpos, routes) -> None:
        G = len(U)
        eng = self.engine
        cost = self.sim.cost_for(self.reps[U[0]].tp)
        tt, tok, calls = self._block_times(pls, G, cost)
        # one call per placement against the gathered K/V: drop the per-round launch overheads
        rounds = (calls > 0).sum(axis=2)  # (P, G)
        comp = tt.sum(axis=2) - np.maximum(rounds - 1, 0) * self.sim.attn_overhead  # (P, G)
        comp = np.maximum(comp, tt.max(axis=2)).sum(axis=0)  # (as in _block_times: at least the largest call)
        pos_tok = tok.sum(axis=0)
        total = float(pos_tok.sum())
        flows = []
        for i in range(G):
            k = (i + 1) % G
            others = total - float(pos_tok[k])
            nb = 3.0 * float(cost.kv_bytes(others))  # K,V gather fwd; K,V gather + dK,dV reduce-scatter bwd
            flows.append(self.transfer(U[i], U[k], nb, [], "allgather", route=routes.get((gi, U[i], U[k])),
                                       latency_mult=3.0 * (G - 1)))
        done = eng.mark(flows)
        for i, u in enumerate(U):
            tid = eng.compute(u, float(comp[i]), (qpos.get((u, gi), 0), 0), [done], cat="attention")
            self.attn_tasks[u].append(tid)

    def _a2a(self, U: list[int], held: list[float], per_tok: float, deps_of) -> dict[int, list[int]]:
        """One all-to-all over units ``U`` (position i holds ``held[i]`` tokens of ``per_tok``
        bytes and keeps 1/G of them); per position, its flows."""
        G = len(U)
        out: dict[int, list[int]] = defaultdict(list)
        node_of = self.sim.cluster.node_of
        if not self.compute and len({node_of(g) for x in U for g in self.reps[x].ranks}) == 1:
            return out  # (counting NIC traffic: an all-to-all inside one node moves nothing over a NIC)
        eff = self.sim.cost_for(self.reps[U[0]].tp).profile.alltoall_efficiency.get(str(G), 1.0)
        for i in range(G):
            for k in range(G):
                if i == k:
                    continue
                f = self.transfer(U[i], U[k], held[i] * per_tok / G, deps_of(i, k), "ulysses", work_factor=1.0 / eff,
                                  latency_mult=float(G - 1))
                out[i].append(f)
                out[k].append(f)
        return out

    def _usp(self, gi: int, g, pls: list[Placement], qpos, routes) -> None:
        """A usp group: each row's all-to-all (replicated K/V), a ring per column on 1/u of the
        heads over the rows' chunks (its node-crossing hops along their routes), each row's all-to-all
        back."""
        u, r = g.shape
        U = g.units
        cost = self.sim.cost_for(self.reps[U[0]].tp)
        rep = cost.kv_replication(u)
        per_tok = cost.ulysses_bytes_per_token(u)
        held = [sum(ranges_tokens(p.ranges[i]) for p in pls) for i in range(u * r)]
        first: dict[int, list[int]] = {}
        for i in range(r):
            got = self._a2a(U[i * u:(i + 1) * u], held[i * u:(i + 1) * u], per_tok, lambda a, b: [])
            for j in range(u):
                first[i * u + j] = got.get(j, [])
        chunks = [p.model_copy(update={"ranges": [merged_ranges(rg for jj in range(u) for rg in p.ranges[i * u + jj])
                                                  for i in range(r)]}) for p in pls]
        last: dict[int, int] = {}
        for j in range(u):
            col = [i * u + j for i in range(r)]
            ends = self._ring(gi, [U[x] for x in col], chunks, qpos, routes, (1.0 / u, rep / u),
                              [first[x] for x in col])
            last.update(zip(col, ends))
        for i in range(r):
            row = list(range(i * u, (i + 1) * u))
            got = self._a2a([U[x] for x in row], [held[x] for x in row], per_tok,
                            lambda a, b, row=row: [last[row[a]], last[row[b]]])
            for j, x in enumerate(row):
                self.attn_tasks[U[x]].append(self.engine.mark(got.get(j, [])))

    def _ulysses(self, gi: int, U: list[int], pls: list[Placement], qpos) -> None:
        G = len(U)
        eng = self.engine
        cost = self.sim.cost_for(self.reps[U[0]].tp)
        lengths = np.array([float(p.padded_length or self.step.sequences[p.seq].length) for p in pls])
        t_att = float(np.sum(cost.ulysses_attn_time(lengths, G))) if self.compute else 0.0  # 1/G of the heads
        held = [sum(ranges_tokens(p.ranges[i]) for p in pls) for i in range(G)]
        per_tok = cost.ulysses_bytes_per_token(G)  # (replicated K/V heads where G exceeds them)

        def a2a(deps_of) -> dict[int, list[int]]:
            return self._a2a(U, held, per_tok, deps_of)

        first = a2a(lambda i, k: [])
        comps = {}
        for i, u in enumerate(U):
            comps[i] = eng.compute(u, t_att, (qpos.get((u, gi), 0), 0), first.get(i, []), cat="attention")
            self.attn_tasks[u].append(comps[i])
        second = a2a(lambda i, k: [comps[i], comps[k]])
        for i, u in enumerate(U):
            self.attn_tasks[u].append(eng.mark(second.get(i, [])))

    def _remap_moves(self) -> dict[tuple[int, int], int]:
        """Tokens each (attention owner -> linear owner) pair must move."""
        mb = self.mb
        owners: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for u in range(self.n):
            for q, s, e in self.attention_layout[u]:
                owners[q].append((s, e, u))
        for segs in owners.values():
            segs.sort()
        moves: dict[tuple[int, int], int] = defaultdict(int)
        for v in range(self.n):
            for q, s, e in mb.linear_layout[v]:
                for a, b, u in owners.get(q, ()):
                    if b <= s:
                        continue
                    if a >= e:
                        break
                    ov = min(e, b) - max(s, a)
                    if ov > 0 and u != v:
                        moves[(u, v)] += ov
        return dict(moves)

    # ------------------------------------------------------------------ results
    def unit_results(self):
        n = self.n
        tasks = self.engine.tasks
        f = np.zeros(n)
        comp_a = np.zeros(n)
        comp_l = np.zeros(n)
        iv: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for t in tasks:
            if t.kind == "compute":
                if t.cat in ("linear", "recompute"):  # recomputation is charged as the predictor does
                    comp_l[t.unit] += t.dur
                elif t.cat != "tp-comm":  # exposed TP communication counts as exposed, not busy
                    comp_a[t.unit] += t.dur
                f[t.unit] = max(f[t.unit], t.end)
            elif t.kind == "flow":
                for u in t.units:
                    f[u] = max(f[u], t.end)
                    if t.end > t.start:
                        iv[u].append((t.start, t.end))
        comm = np.array([_union_length(iv.get(u, [])) for u in range(n)])
        # coupled components (union-find over every pair that exchanged data)
        parent = list(range(n))

        def find(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for a, b in self.links:
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[ra] = rb
        comps: dict[int, list[int]] = defaultdict(list)
        for u in range(n):
            comps[find(u)].append(u)
        return f, comp_a, comp_l, comm, list(comps.values())

    def _nic_flows(self):
        for t in self.engine.tasks:
            if t.kind == "flow" and t.nics:
                yield t

    def nic_bytes(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for t in self._nic_flows():
            out[t.nics[0]] += t.nbytes
            out[t.nics[1]] += t.nbytes
        return dict(out)

    def nic_traffic(self) -> dict[tuple[str, str], float]:
        """Bytes through each NIC by transfer kind: ``{(kind, nic): bytes}`` (sent + received)."""
        out: dict[tuple[str, str], float] = defaultdict(float)
        for t in self._nic_flows():
            kind = t.cat.removesuffix("-inter")
            out[(kind, t.nics[0])] += t.nbytes
            out[(kind, t.nics[1])] += t.nbytes
        return dict(out)

    def nic_busy(self) -> dict[str, float]:
        iv: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for t in self._nic_flows():
            if t.end > t.bw_start:
                iv[t.nics[0]].append((t.bw_start, t.end))
                iv[t.nics[1]].append((t.bw_start, t.end))
        return {k: _union_length(v) for k, v in iv.items()}

    def intervals(self) -> list[Interval]:
        out = []
        for t in self.engine.tasks:
            if t.kind == "compute" and t.end > t.start:
                out.append(Interval(t.unit, t.start, t.end, t.cat, "compute"))
            elif t.kind == "flow" and t.end > t.start:
                for u in t.units:
                    out.append(Interval(u, t.start, t.end, t.cat, "comm"))
        return out


def _union_length(iv: list[tuple[float, float]]) -> float:
    if not iv:
        return 0.0
    iv = sorted(iv)
    total, cs, ce = 0.0, iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > ce:
            total += ce - cs
            cs, ce = s, e
        elif e > ce:
            ce = e
    return total + ce - cs
