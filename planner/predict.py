"""Analytic per-step prediction shared by every planner (fills ``StepPlan.prediction``).

This is the closed-form model the planners optimise against: per unit, attention groups in queue
order (a ring group costs one local block plus G-1 rounds of max(compute, transfer)), linear
modules on the unit's linear-layout tokens, remap all-to-alls, and the gradient all-reduce. NIC
contention is approximated by counting the transfers that share a NIC. The event-driven simulator
(``zeppelin simulate``) refines this with explicit per-round timelines.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from zeppelin.schemas.layout import ranges_tokens
from zeppelin.schemas.plan import MicroBatch, Prediction, RankLoads, StepPlan

from .base import PlanContext


def nic_loads(ctx: PlanContext, mb: MicroBatch, routed: bool = True) -> dict[str, float]:
    """Bytes each NIC sends+receives per step for the micro-batch's inter-node ring transfers."""
    cost, L = ctx.cost, ctx.model.num_layers
    loads: dict[str, float] = defaultdict(float)
    upn = ctx.units_per_node
    for r in mb.routes:
        G = len(mb.groups[r.group].units)
        total = float(cost.ring_round_bytes(r.tokens)) * (G - 1) * L
        if routed:
            for p in r.paths:
                share = total * (p.tokens / r.tokens if r.tokens else 0.0)
                loads[p.nic_src] += share
                loads[p.nic_dst] += share
        else:
            loads[_unit_nic(ctx, r.src, upn)] += total
            loads[_unit_nic(ctx, r.dst, upn)] += total
    return dict(loads)


def _unit_nic(ctx: PlanContext, unit: int, upn: int) -> str:
    rank = unit * ctx.tp
    return ctx.cluster.nic_of(rank)


def _route_round_time(ctx: PlanContext, mb: MicroBatch, routed: bool) -> dict[int, float]:
    """Per group: the slowest inter-node transfer time of one ring round (with NIC sharing)."""
    cost = ctx.cost
    users: dict[str, int] = defaultdict(int)
    upn = ctx.units_per_node
    for r in mb.routes:
        if routed:
            for p in r.paths:
                if p.tokens:
                    users[p.nic_src] += 1
                    users[p.nic_dst] += 1
        else:
            users[_unit_nic(ctx, r.src, upn)] += 1
            users[_unit_nic(ctx, r.dst, upn)] += 1
    out: dict[int, float] = defaultdict(float)
    for r in mb.routes:
        if routed:
            t = 0.0
            for p in r.paths:
                if not p.tokens:
                    continue
                share = max(users[p.nic_src], users[p.nic_dst])
                t_path = float(cost.p2p_time(cost.ring_round_bytes(p.tokens), "inter", share))
                if p.via_src != r.src or p.via_dst != r.dst:  # dispatch / combine over NVLink
                    t_path += 2 * float(cost.p2p_time(cost.ring_round_bytes(p.tokens), "intra"))
                t = max(t, t_path)
        else:
            share = max(users[_unit_nic(ctx, r.src, upn)], users[_unit_nic(ctx, r.dst, upn)])
            t = float(cost.p2p_time(cost.ring_round_bytes(r.tokens), "inter", share))
        out[r.group] = max(out[r.group], t)
    return out


def lower_bounds(ctx: PlanContext, lengths: np.ndarray) -> tuple[float, float]:
    """(work bound, longest-sequence bound) in seconds.

    The work bound prices attention per sequence and the linear modules on an even share of the
    step's tokens (kernels are priced on the tokens a unit holds). Both include the gradient
    all-reduce, which every plan pays in full under this model (it is
    charged as exposed communication to every unit), so a plan can reach its bound."""
    cost = ctx.cost
    n = ctx.num_units
    ar = cost.grad_allreduce_time(n)
    # attention of every sequence, plus the linear modules on an even share of the step's tokens
    # (linear kernels are priced on the tokens a unit holds, as predict_step does, not per sequence)
    share = float(np.sum(lengths)) / n
    lin = ctx.model.num_layers * float(cost.linear_time(share)) + float(cost.head_time(share))
    work = ctx.model.num_layers * float(np.sum(cost.attn_time(lengths))) / n + lin + ar
    Lmax = int(lengths.max())
    best = float("inf")
    G = 1
    while G <= n:
        if Lmax / G <= max(cost.token_capacity, 1) or G == n:
            tier = "intra" if G <= ctx.units_per_node else "inter"
            # inter-node hops at best spread over every NIC of the node (routing), at no dispatch cost
            share = 1.0 / len(ctx.cluster.nics) if tier == "inter" else 1.0
            t = ctx.model.num_layers * float(cost.ring_attention_time(Lmax, G, tier, share)
                                             + cost.linear_time(Lmax / G))
            t += float(cost.head_time(Lmax / G))
            best = min(best, t)
        G *= 2
    return work, best + ar


def predict_step(ctx: PlanContext, step: StepPlan, routed: bool = True) -> Prediction:
    """Prediction of one step. Steps whose units are replicas of mixed TP degree (Hydraulis plans,
    ``step.replicas`` set) are predicted per replica with one cost model per TP degree."""
    if step.replicas is not None and any(r.tp != ctx.tp for r in step.replicas):
        from .bl_hydraulis import predict_replicas

        return predict_replicas(ctx, step)
    cost = ctx.cost
    n = ctx.num_units
    layers = ctx.model.num_layers
    lengths = np.array([s.length for s in step.sequences], dtype=np.float64)
    attn = np.zeros(n)
    lin = np.zeros(n)
    comm = np.zeros(n)
    exposed = np.zeros(n)
    tokens = np.zeros(n, dtype=np.int64)
    mem_tokens = np.zeros(n)
    nic_r: dict[str, float] = defaultdict(float)
    nic_u: dict[str, float] = defaultdict(float)
    for mb in step.microbatches:
        inter_round = _route_round_time(ctx, mb, routed)
        per_group: dict[int, list] = defaultdict(list)
        for p in mb.placements:
            per_group[p.group].append(p)
        held = np.zeros(n)
        for gi, g in enumerate(mb.groups):
            G = len(g.units)
            pls = per_group.get(gi, [])
            if not pls:
                continue
            Ls = np.array([(p.padded_length or step.sequences[p.seq].length) for p in pls], dtype=np.float64)
            for pos, u in enumerate(g.units):
                held[u] += sum(ranges_tokens(p.ranges[pos]) for p in pls)
            if g.kind == "local" or G == 1:
                t_att = float(np.sum(cost.attn_time(Ls)))
                t_comm = t_exp = 0.0
            elif g.kind == "ring":
                comp_round = float(np.sum(cost.attn_time(Ls))) / G / G
                if g.tier == "inter" and gi in inter_round:
                    comm_round = inter_round[gi]
                else:
                    per_unit_tokens = float(np.sum(Ls)) / G
                    comm_round = float(cost.p2p_time(cost.ring_round_bytes(per_unit_tokens), "intra"))
                t_att = comp_round * G
                t_comm = comm_round * (G - 1)
                t_exp = (G - 1) * max(comm_round - comp_round, 0.0)
            elif g.kind == "allgather":
                t_att = float(np.sum(cost.attn_time(Ls))) / G
                t_comm = t_exp = float(cost.allgather_kv_time(float(np.sum(Ls)) / G, G, cost.tier_link(g.tier)))
            else:  # ulysses
                t_att = float(np.sum(cost.attn_time(Ls))) / G
                t_comm = t_exp = float(cost.ulysses_comm_time(float(np.sum(Ls)) / G, G, cost.tier_link(g.tier)))
            for u in g.units:
                attn[u] += layers * t_att
                comm[u] += layers * t_comm
                exposed[u] += layers * t_exp
        # one pass over the placements (not one scan per unit: plans have thousands of units)
        if mb.linear_layout is None:
            lin_held = held.copy()
        else:
            lin_held = np.array([sum(e - s for _, s, e in segs) for segs in mb.linear_layout], dtype=np.float64)
        lin += layers * cost.linear_time(lin_held) + cost.head_time(lin_held)
        if ctx.tp > 1:
            t_tp = layers * cost.tp_exposed_comm(lin_held)
            comm += t_tp
            exposed += t_tp
        if mb.linear_layout is not None:
            att_sets: list[dict[int, list[tuple[int, int]]]] = [defaultdict(list) for _ in range(n)]
            for p in mb.placements:
                units = mb.groups[p.group].units
                for pos, rs in enumerate(p.ranges):
                    for s, e in rs:
                        if e > s:
                            att_sets[units[pos]][p.seq].append((s, e))
            moved = np.zeros(n)
            for u in range(n):
                moved[u] = sum(_overlap_out(seg, att_sets[u]) for seg in mb.linear_layout[u])
            t_remap = layers * cost.remap_time(moved)
            comm += t_remap
            exposed += t_remap
        tokens += lin_held.astype(np.int64)
        mem_tokens = np.maximum(mem_tokens, np.maximum(held, lin_held))
        for k, v in nic_loads(ctx, mb, routed=True).items():
            nic_r[k] += v
        for k, v in nic_loads(ctx, mb, routed=False).items():
            nic_u[k] += v
    ar = cost.grad_allreduce_time(n)
    comm += ar
    exposed += ar
    total = attn + lin + exposed
    work_b, long_b = lower_bounds(ctx, lengths)
    return Prediction(
        step_time_s=float(total.max()),
        lower_bound_s=max(work_b, long_b),
        work_bound_s=work_b,
        longest_bound_s=long_b,
        per_unit=RankLoads(
            attention_s=[float(x) for x in attn], linear_s=[float(x) for x in lin], comm_s=[float(x) for x in comm],
            exposed_comm_s=[float(x) for x in exposed], total_s=[float(x) for x in total],
            tokens=[int(x) for x in tokens], memory_gb=[float(x) / 1e9 for x in cost.memory_bytes(mem_tokens)],
        ),
        nic_bytes=dict(nic_r),
        nic_bytes_unrouted=dict(nic_u),
    )


def _segment_set(segs: list[list[int]]) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for q, s, e in segs:
        out[q].append((s, e))
    return out


def _overlap_out(seg: list[int], have: dict[int, list[tuple[int, int]]]) -> int:
    """Tokens of ``seg`` not already held (i.e. that must arrive by remap)."""
    q, s, e = seg
    inside = sum(max(0, min(e, b) - max(s, a)) for a, b in have.get(q, ()))
    return (e - s) - inside
