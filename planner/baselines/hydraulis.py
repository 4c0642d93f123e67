"""Hydraulis (Li, Fu et al., SIGMOD 2026) as a planner: heterogeneous replicas, two-stage assignment.

Per step:

1. *parallel strategy*: candidate replica configurations mix model replicas of different tensor-
   parallel degrees (``tp_degrees``, default 1, 2, 4, 8 where they divide a node and the heads): the
   largest degree is one whose memory holds the step's longest sequence, ``k`` replicas of it
   (k = 1, 2, 4, ...) and the remaining GPUs as replicas of a smaller degree. Each candidate is
   scored by its stage-1 dispatch; the best one is used. Replicas are aligned blocks of GPU ranks,
   largest degree first; the plan's units are these replicas (``StepPlan.replicas``).
   *Context parallelism*: when the step's longest sequence fits no single replica (not even one of
   the largest degree ``D``, e.g. tp=8 = one node), the candidates hold ``k`` CP replicas instead:
   a CP replica is ``cp`` replicas of degree ``D`` (aligned, consecutive) that run their sequences
   as zigzag rings over those ``cp`` units (group ``ring``, tier ``inter`` when it spans nodes),
   with the smallest power-of-two ``cp`` whose per-unit zigzag share of the longest sequence fits;
   the remaining GPUs are replicas of one degree as above. Option ``cp=false`` turns this off.
2. *stage 1, dispatch*: a CP replica counts as one replica whose cost for a sequence is the time of
   one of its units: ring attention with its exposed communication
   (:meth:`CostModel.ring_attention_time`, rounds priced by their block sizes) plus the linear
   modules and TP communication on the unit's ``L / cp`` tokens, and whose memory is per unit (the
   sequence's zigzag share). Sequences that fit only the largest replicas go first, among those; then
   every sequence (most expensive first) goes to the replica where it finishes earliest, i.e. that
   minimises the resulting maximum cost. Randomised greedy with restarts (perturbed order, random
   choice among near-best replicas); the best makespan wins.
3. *stage 2, packing*: per replica, sequences are packed into micro-batches by an ILP minimising the
   largest micro-batch time under the token capacity, for several micro-batch counts ``v``; the
   count minimising the pipeline time ``(max + c) * (pp - 1 + v)`` (pp = 1 here, ``c`` the fixed
   cost of a micro-batch) is kept. Greedy LPT packing is the warm start and the fallback. A CP
   replica packs like any replica, under the capacity of one unit. The ILPs run under
   deterministic limits (``milp_nodes`` nodes each, at most ``milp_solves`` per step, the rest
   packed by LPT; :mod:`zeppelin.planner.core.solver`): the same plan under any load.

The prediction uses one cost model per TP degree (:func:`predict_replicas`), since units differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from zeppelin.planner.baselines import milp as bl_milp
from zeppelin.planner.baselines.common import (
    StepBuilder,
    Timer,
    ceil_div,
    check_capacity,
    pow2_sizes,
    seq_label,
)
from zeppelin.planner.core.base import PlanContext, Planner, PlanningError, register, zigzag_share
from zeppelin.planner.core.options import INTS, PlannerOptions, option
from zeppelin.planner.core.solver import SolveLimits, merge_status
from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.planner.costmodel.predict import predict_replicas
from zeppelin.schemas.plan import Replica, Sequence, SolverInfo, StepPlan

MILP_SOLVES = 4  # packing ILPs per step (deterministic budget; LPT packing for the rest)
MILP_NODES = 50  # branch-and-bound nodes per ILP


def _cost_models(ctx: PlanContext, degrees: list[int]) -> dict[int, CostModel]:
    return {t: ctx.cost_for(t) for t in degrees}


def tp_comm_time(cm: CostModel, tokens) -> np.ndarray:
    """Whole-model exposed TP-SP communication of a replica holding ``tokens`` tokens (the shared
    cost model's collective sites, with the context's ``tp_overlap`` mode)."""
    T = np.asarray(tokens, dtype=np.float64)
    if cm.tp <= 1:
        return np.zeros_like(T)
    return cm.model.num_layers * cm.tp_exposed_comm(T)




def replica_nic_sharers(ctx: PlanContext, ranks: list[int]) -> int:
    """GPUs of one replica that share a NIC (each TP rank sends its K/V shard over its own NIC)."""
    count: dict[str, int] = {}
    for g in ranks:
        nic = ctx.cluster.nic_of(g)
        count[nic] = count.get(nic, 0) + 1
    return max(count.values())


def cp_seq_cost(ctx: PlanContext, cm: CostModel, L, cp: int, tier: str, nic_sharers: float = 1.0) -> np.ndarray:
    """Stage-1 cost of sequences ``L`` on a CP replica of ``cp`` units (each a replica of ``cm.tp``
    GPUs): the time of one unit - zigzag ring attention incl. its exposed communication, linear
    modules and TP communication on ``L / cp`` tokens, over every layer, plus the LM head."""
    L = np.asarray(L, dtype=np.float64)
    share = L / cp
    per_layer = cm.ring_attention_time(L, cp, tier, nic_sharers) + cm.linear_time(share)
    return ctx.model.num_layers * per_layer + cm.head_time(share) + tp_comm_time(cm, share)


def _dispatch(cost: np.ndarray, fits: np.ndarray, big: np.ndarray, rng, restarts: int) -> tuple[float, list[int]]:
    """Stage 1. cost[i, r]: time of sequence i on replica r; fits[i, r]: memory allows it;
    big[r]: replica r is of the largest degree. Returns (makespan, replica per sequence)."""
    n_seq, n_rep = cost.shape
    only_big = ~(fits & ~big[None, :]).any(axis=1)
    base = cost.min(axis=1)
    best = None
    for attempt in range(restarts):
        noise = rng.uniform(0.9, 1.1, n_seq) if attempt else np.ones(n_seq)
        order = sorted(range(n_seq), key=lambda i: (not only_big[i], -base[i] * noise[i], i))
        load = np.zeros(n_rep)
        out = [0] * n_seq
        for i in order:
            finish = np.where(fits[i], load + cost[i], np.inf)
            if attempt:
                near = np.flatnonzero(finish <= finish.min() * 1.02)
                r = int(rng.choice(near))
            else:
                r = int(np.argmin(finish))
            out[i] = r
            load[r] += cost[i, r]
        span = float(load.max())
        if best is None or span < best[0]:
            best = (span, out)
    return best


def _lpt_pack(items: list[int], c: dict[int, float], L: dict[int, int], cap: int, v: int) -> list[list[int]] | None:
    """Greedy packing into v micro-batches: most expensive first to the cheapest bin with room."""
    bins: list[list[int]] = [[] for _ in range(v)]
    load, held = [0.0] * v, [0] * v
    for i in sorted(items, key=lambda k: (-c[k], k)):
        room = [m for m in range(v) if held[m] + L[i] <= cap]
        if not room:
            return None
        m = min(room, key=lambda m: (load[m], m))
        bins[m].append(i)
        load[m] += c[i]
        held[m] += L[i]
    return bins


def _pack_ilp(items, c, L, cap, v, start, limits):
    import pulp

    order = sorted(items, key=lambda k: (-c[k], k))
    prob = pulp.LpProblem("hydraulis_pack", pulp.LpMinimize)
    z = bl_milp.new_var(prob, "z", lowBound=0)
    prob += z
    x = {}
    for a, i in enumerate(order):
        for m in range(min(v, a + 1)):  # symmetry breaking: the a-th item uses one of the first a+1 bins
            x[i, m] = bl_milp.new_var(prob, f"x_{i}_{m}", cat="Binary")
        prob += pulp.lpSum(x[i, m] for m in range(min(v, a + 1))) == 1
    for m in range(v):
        prob += pulp.lpSum(c[i] * x[i, mm] for (i, mm) in x if mm == m) <= z
        prob += pulp.lpSum(L[i] * x[i, mm] for (i, mm) in x if mm == m) <= cap
    warm = None
    if start is not None:
        # relabel the greedy bins so that they respect the symmetry-breaking order
        pos = {i: a for a, i in enumerate(order)}
        bins = sorted((b for b in start if b), key=lambda b: min(pos[i] for i in b))
        warm = {var: 0.0 for var in x.values()}
        ok = True
        for m, b in enumerate(bins):
            for i in b:
                if (i, m) not in x:
                    ok = False
                else:
                    warm[x[i, m]] = 1.0
        warm[z] = max(sum(c[i] for i in b) for b in bins)
        warm = warm if ok else None
    res = bl_milp.solve(prob, limits, warm)
    if not res.has_solution:
        return None, res
    bins = [[] for _ in range(v)]
    for (i, m), var in x.items():
        if bl_milp.value(var) > 0.5:
            bins[m].append(i)
    if sorted(j for b in bins for j in b) != sorted(items) or any(sum(L[i] for i in b) > cap for b in bins):
        return None, res
    return bins, res


@dataclass(frozen=True)
class HydraulisOptions(PlannerOptions):
    tp_degrees: tuple[int, ...] = option(INTS, (1, 2, 4, 8), "TP degrees of the replicas (those dividing the GPUs "
                                         "per node and the heads are used)", minimum=1)
    milp_solves: int = option(int, MILP_SOLVES, "packing ILPs per step; LPT packing for the rest", minimum=0)
    restarts: int = option(int, 8, "randomised restarts of the dispatch to replicas", minimum=1)
    mb_search: int = option(int, 3, "micro-batch counts searched per replica", minimum=1)
    cp: bool = option(bool, True, "ring a sequence no replica holds over several replicas of the largest degree")
    milp_nodes: int = option(int, MILP_NODES, "branch-and-bound nodes per ILP", minimum=0)
    milp_iterations: int = option(int, 20000, "simplex iterations per ILP", minimum=0)
    time_limit: float | None = option(float, None, "optional wall-clock safety net per ILP, seconds (off by "
                                      "default; a step that hits it is not reproducible)", above=0.0)


@register
class Hydraulis(Planner):
    name = "hydraulis"
    Options = HydraulisOptions
    description = ("Hydraulis: heterogeneous model replicas (mixed TP degrees) with two-stage assignment: "
                   "randomised greedy dispatch to replicas, then ILP packing into micro-batches")

    def _degrees(self, ctx: PlanContext) -> list[int]:
        want = sorted(set(self.opts.tp_degrees))
        raw = ",".join(map(str, want))
        md = ctx.model
        out = [t for t in want if t >= 1 and ctx.cluster.gpus_per_node % t == 0 and md.tp_splits_heads(t)]
        if not out:
            raise PlanningError(f"hydraulis: none of tp_degrees={raw!r} divides the {ctx.cluster.gpus_per_node} "
                                f"GPUs per node, the {md.num_heads} query and the {md.num_kv_heads} "
                                f"key/value heads")
        return out

    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        t = Timer()
        check_capacity(ctx, self.name)
        o = self.opts
        degrees = self._degrees(ctx)
        cms = _cost_models(ctx, degrees)
        L = np.array([s.length for s in sequences], dtype=np.int64)
        kinds = _replica_kinds(ctx, cms, degrees, L, sequences, o.cp)
        configs = _configs(ctx.cluster.world_size, degrees, kinds)
        rng = np.random.default_rng([ctx.seed, step])
        scored = sorted(((_evaluate(kinds, cfg, rng, 1)[0], a, cfg) for a, cfg in enumerate(configs)))
        _, _, cfg = scored[0]
        span, owner = _evaluate(kinds, cfg, rng, o.restarts)
        replicas, units_of = _replicas(cfg)
        # stage 2: per replica, pack into micro-batches
        packing = _Packing(SolveLimits(nodes=o.milp_nodes, iterations=o.milp_iterations, wall_s=o.time_limit),
                           budget=o.milp_solves)
        plans = [_pack_replica(ctx, packing, kinds, cms, r, cfg[r], [i for i in range(len(sequences)) if owner[i] == r],
                               o.mb_search) for r in range(len(cfg))]
        b = StepBuilder(ctx, sequences, self.name, n_units=len(replicas),
                        capacity=[cms[r.tp].token_capacity for r in replicas], replicas=replicas)
        for r, bins in enumerate(plans):
            for k, bin_ in enumerate(bins):
                for i in sorted(bin_, key=lambda i: -L[i]):
                    b.place(k, "ring" if len(units_of[r]) > 1 else "local", units_of[r], i)
        notes = {"replica_tp": [r.tp for r in replicas], "dispatch_makespan_s": span,
                 "configs_scored": len(configs), "microbatches": b.num_microbatches}
        if kinds.cp > 1:
            notes["cp_replicas"] = [units for units in units_of if len(units) > 1]
        plan = b.finish(step, packing.solver_info(o.milp_solves, t.elapsed), predict=predict_replicas,
                        replicas=replicas, notes=notes)
        plan.solver.time_s = t.elapsed
        return plan


@dataclass
class _Kinds:
    """The step's dispatch replica kinds, keyed ``(degree, cp)`` (``cp`` units of that degree ringing
    their sequences; ``cp`` 1: a plain replica): each one's per-sequence cost, tokens per unit and
    token capacity per unit. ``cp``: the units of the step's CP replica kind (1: none);
    ``big_degrees``: the degrees whose single replica holds the step's longest sequence."""

    cp: int
    big_degrees: list[int]
    cost: dict[tuple[int, int], np.ndarray]
    size: dict[tuple[int, int], np.ndarray]
    cap: dict[tuple[int, int], int]


def _replica_kinds(ctx: PlanContext, cms: dict[int, CostModel], degrees: list[int], L: np.ndarray,
                   sequences: list[Sequence], use_cp: bool) -> _Kinds:
    """The replica kinds of a step: one per degree, and a CP replica of the largest degree ``D``
    (the fewest replicas whose zigzag share of the longest sequence fits) where no single replica
    holds the longest sequence. Raises :class:`PlanningError` where nothing holds it."""
    cap = {d: cms[d].token_capacity for d in degrees}
    world = ctx.cluster.world_size
    Lmax_i = int(np.argmax(L))
    big_degrees = [d for d in degrees if cap[d] >= L[Lmax_i]]
    D = degrees[-1]
    cp = 1  # units per CP replica (1: no CP replica in this step)
    if not big_degrees:
        sizes = [g for g in pow2_sizes(world // D) if g > 1] if use_cp else []
        fit = [g for g in sizes if zigzag_share(L[Lmax_i], g) <= cap[D]]
        if not fit:
            where = (f"the largest replica (tp={D}, context-parallel over {sizes[-1]} of them) holds "
                     f"{sizes[-1] * cap[D]}" if sizes else f"the largest replica (tp={D}) holds {cap[D]}")
            raise PlanningError(f"{seq_label(Lmax_i, sequences[Lmax_i])} does not fit hydraulis: {where} tokens")
        cp = fit[0]
    seq_cost = {(d, 1): cms[d].seq_compute_time(L.astype(np.float64)) + tp_comm_time(cms[d], L) for d in degrees}
    size = {(d, 1): L for d in degrees}
    cap_of = {(d, 1): cap[d] for d in degrees}
    if cp > 1:
        ranks = list(range(cp * D))
        tier = "inter" if ctx.cluster.node_of(ranks[0]) != ctx.cluster.node_of(ranks[-1]) else "intra"
        sharers = replica_nic_sharers(ctx, list(range(D))) if tier == "inter" else 1
        seq_cost[(D, cp)] = cp_seq_cost(ctx, cms[D], L, cp, tier, sharers)
        size[(D, cp)] = zigzag_share(L, cp)
        cap_of[(D, cp)] = cap[D]
    return _Kinds(cp=cp, big_degrees=big_degrees, cost=seq_cost, size=size, cap=cap_of)


def _configs(world: int, degrees: list[int], kinds: _Kinds) -> list[tuple]:
    """Candidate configurations: k replicas of degree ``hi`` (it holds the longest sequence; or k CP
    replicas of the largest degree), the rest of degree ``lo``; each a tuple of replica kinds."""
    configs = []
    cp, D = kinds.cp, degrees[-1]
    for hi, c in ([(D, cp)] if cp > 1 else [(d, 1) for d in kinds.big_degrees]):
        for lo in (d for d in degrees if d <= hi):
            for k in pow2_sizes(world // (hi * c)):
                rest = world - k * hi * c
                if rest % lo:
                    continue
                cfg = tuple([(hi, c)] * k + [(lo, 1)] * (rest // lo))
                if cfg not in configs:
                    configs.append(cfg)
    return configs


def _evaluate(kinds: _Kinds, cfg: tuple, rng, n_restarts: int) -> tuple[float, list[int]]:
    """Stage 1 on a configuration: (makespan, replica per sequence)."""
    cost = np.stack([kinds.cost[r] for r in cfg], axis=1)
    fits = np.stack([kinds.size[r] <= kinds.cap[r] for r in cfg], axis=1)
    if kinds.cp > 1:
        big = np.array([c > 1 for _, c in cfg])
    else:
        tps = np.array([d for d, _ in cfg])
        big = tps == tps.max()
    return _dispatch(cost, fits, big, rng, n_restarts)


def _replicas(cfg: tuple) -> tuple[list[Replica], list[list[int]]]:
    """Replicas as aligned blocks of ranks, largest degree first (a CP replica: ``cp`` consecutive
    ones), and the units of each replica kind of ``cfg``."""
    replicas, units_of, r0 = [], [], 0
    for d, c in cfg:
        units_of.append(list(range(len(replicas), len(replicas) + c)))
        for _ in range(c):
            replicas.append(Replica(ranks=list(range(r0, r0 + d)), tp=d))
            r0 += d
    return replicas, units_of


@dataclass
class _Packing:
    """Stage 2's state over a step's replicas: the ILP budget left, the ILP results, the
    (replica, micro-batch count) pairs packed by LPT past the budget and why a fallback ran."""

    limits: SolveLimits
    budget: int
    results: list = field(default_factory=list)
    skipped: int = 0
    fallback: str | None = None

    def bins(self, items: list[int], c: dict, Ld: dict, cap: int, v: int):
        """``items`` packed into ``v`` micro-batches: by the ILP (LPT its warm start) within the
        budget or where LPT finds no packing, else by LPT; None where neither packs them."""
        greedy = _lpt_pack(items, c, Ld, cap, v)
        if self.budget > 0 or greedy is None:  # (past the budget only where LPT found no packing)
            bins, res = _pack_ilp(items, c, Ld, cap, v, greedy, self.limits)
            self.results.append(res)
            self.budget -= 1
        else:
            bins, res = greedy, None
            self.skipped += 1
        if bins is None:
            bins = greedy
            if res.has_solution is False and greedy is not None:
                self.fallback = "ILP found no packing within its limits for some replicas: greedy kept"
        return bins

    def solver_info(self, milp_solves: int, elapsed: float) -> SolverInfo:
        if not self.results:
            return SolverInfo(name="greedy", status="ok", time_s=elapsed)
        status = merge_status([x.status for x in self.results])
        gaps = [x.gap for x in self.results]
        fallback = self.fallback
        if self.skipped:
            fallback = (fallback + "; " if fallback else "") + (
                f"ILP budget ({milp_solves} solves) spent: LPT packing for "
                f"{self.skipped} more (replica, micro-batch count) pair(s)")
        return SolverInfo(name=self.results[0].solver, status=status,
                          gap=None if any(g is None for g in gaps) else max(gaps), time_s=elapsed,
                          fallback_reason=fallback)


def _pack_replica(ctx: PlanContext, packing: _Packing, kinds: _Kinds, cms: dict[int, CostModel], r: int,
                  kind: tuple[int, int], items: list[int], v_span: int) -> list[list[int]]:
    """Stage 2 for replica ``r`` (of ``kind``, holding sequences ``items``): the micro-batches, of
    ``v_span`` counts from the fewest that fit, minimising ``(max + c) * v``."""
    c = {i: float(kinds.cost[kind][i]) for i in items}
    Ld = {i: int(kinds.size[kind][i]) for i in items}  # tokens per unit (a CP replica: zigzag share)
    cap_r = kinds.cap[kind]
    v_min = max(1, ceil_div(sum(Ld.values()), cap_r))
    d, cpr = kind
    cm = cms[d]
    const = float(ctx.model.num_layers * cm.linear_time(1e-9) + cm.head_time(1e-9))  # fixed cost c
    if not items:
        return []
    if v_min == 1 or len(items) == 1:
        return [list(items)]
    best = None
    for v in range(v_min, v_min + v_span):
        if best is not None and (sum(c.values()) / v + const) * v >= best[0]:
            break  # (max + c) * v >= (mean + c) * v can no longer win
        bins = packing.bins(items, c, Ld, cap_r, v)
        if bins is None:
            continue
        zmax = max(sum(c[i] for i in b) for b in bins)
        score = (zmax + const) * v
        if best is None or score < best[0]:
            best = (score, [b for b in bins if b])
    if best is None:
        d_items = sum(Ld.values())
        what = f"tp={d}" if cpr == 1 else f"tp={d}, cp={cpr}; tokens per unit"
        raise PlanningError(f"hydraulis: replica {r} ({what}) cannot pack its {d_items} tokens into "
                            f"{v_min}..{v_min + v_span - 1} micro-batches of {cap_r} tokens")
    return best[1]
