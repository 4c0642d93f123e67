"""Candidate family ``tp-replicas``: replicas of a larger tensor-parallel degree than the context's
(Hydraulis' freedom).

Replicas of degree ``hi`` (or context-parallel replicas of ``cp`` of them where the step's longest
sequence fits no replica) for the long sequences and of degree ``lo`` for the rest, each sequence
to the replica where it finishes earliest, each replica's share cut into micro-batches
longest-first under its memory. Also plans the steps whose longest sequence the context's own
units cannot hold (:func:`replicas_hold`).
"""

from __future__ import annotations

import numpy as np

from zeppelin.planner.core.base import PlanContext, pow2_sizes, zigzag_share
from zeppelin.planner.core.builder import StepBuilder
from zeppelin.planner.costmodel.predict import predict_replicas
from zeppelin.planner.zeppelin.families.common import (
    best_dispatches,
    dispatch,
    dispatch_bound,
    group_counts,
    pack_bins,
    refine,
)
from zeppelin.planner.zeppelin.protocols import Candidate
from zeppelin.schemas.plan import Replica, Sequence, SolverInfo
from zeppelin.schemas.runnable import model_runs_tp

name = "tp-replicas"


def candidates(ctx: PlanContext, step: int, sequences: list[Sequence], limit: float | None = None,
               routing: bool = True, top: int = 2) -> list[Candidate]:
    """The family's best ``top`` configurations (``limit``: none scored above it)."""
    return tp_replicas(ctx, step, sequences, top=top, limit=limit)


def _tp_comm(ctx: PlanContext, cm, tokens: np.ndarray) -> np.ndarray:
    if cm.tp <= 1:
        return np.zeros_like(tokens)
    return ctx.model.num_layers * cm.tp_exposed_comm(tokens)


def tp_replicas(ctx: PlanContext, step: int, sequences: list[Sequence], top: int = 2, limit: float | None = None):
    degrees = _replica_degrees(ctx)
    if len(degrees) < 2:
        return []
    L = np.array([s.length for s in sequences], dtype=np.int64)
    got = _replica_types(ctx, degrees, L)
    if got is None:
        return []
    types, long_types = got
    configs = _replica_configs(ctx, degrees, long_types)
    keyed = [_keyed(types, cfg) for cfg in configs]

    def run(a):
        return dispatch(*keyed[a][1:])

    def bound(a):
        keys, c, f, cnt = keyed[a]
        return dispatch_bound(c, f, cnt, {x: t[0] * t[1] for x, t in enumerate(keys)})

    refined = []
    for _, a, _, owner, loads in best_dispatches(list(range(len(configs))), run, bound, top + 1, limit):
        keys, c, f, _ = keyed[a]
        span, owner = refine(c, f, owner, loads)
        refined.append((span, a, keys, configs[a], owner))
    scored = sorted(refined, key=lambda x: (x[0], x[1]))
    return [Candidate(span, a, (lambda keys=keys, cfg=cfg, owner=owner:
                                _build(ctx, step, sequences, types, keys, cfg, owner)))
            for span, a, keys, cfg, owner in scored[:top]]


def _replica_types(ctx: PlanContext, degrees: list[int], L: np.ndarray):
    """Replica types by (degree, context-parallel size): each one's per-sequence cost, tokens per
    replica and token capacity, and the types the step's longest sequence fits (a context-parallel
    ring of the largest degree where no single replica holds it). None where nothing holds it."""
    cl, world = ctx.cluster, ctx.cluster.world_size
    cms = {d: ctx.cost_for(d) for d in degrees}
    caps = {d: cms[d].token_capacity for d in degrees}
    Lf = L.astype(np.float64)
    D = degrees[-1]
    cp = 1
    if caps[D] < int(L.max()):
        cp = next((g for g in pow2_sizes(world // D) if g > 1 and zigzag_share(L[L.argmax():][:1], g)[0] <= caps[D]), 0)
        if not cp:
            return None
    types: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, int]] = {}  # (degree, cp): cost, tokens/unit, cap
    for d in degrees:
        types[(d, 1)] = (cms[d].seq_compute_time(Lf) + _tp_comm(ctx, cms[d], Lf), L, caps[d])
    if cp == 1:
        return types, [(d, 1) for d in degrees if caps[d] >= int(L.max())]
    tier = "inter" if cl.node_of(0) != cl.node_of(cp * D - 1) else "intra"
    sharers = 1.0
    if tier == "inter":
        nics: dict[str, int] = {}
        for g in range(D):
            nics[cl.nic_of(g)] = nics.get(cl.nic_of(g), 0) + 1
        sharers = float(max(nics.values()))
    cm = cms[D]
    sh = Lf / cp
    c = ctx.model.num_layers * (cm.ring_attention_time(Lf, cp, tier, sharers) + cm.linear_time(sh)) \
        + cm.head_time(sh) + _tp_comm(ctx, cm, sh)
    types[(D, cp)] = (c, zigzag_share(L, cp), caps[D])
    return types, [(D, cp)]


def _replica_configs(ctx: PlanContext, degrees: list[int], long_types) -> list[dict]:
    """Configurations: ``k`` replicas of a type the longest sequence fits, the rest of a degree no
    larger (the context's own units alone excluded: that is the tiered search's space)."""
    world = ctx.cluster.world_size
    configs = []
    for hi in long_types:
        gpus_hi = hi[0] * hi[1]
        for lo in [d for d in degrees if d <= hi[0]]:
            for k in group_counts(world // gpus_hi):
                rest = world - k * gpus_hi
                if rest % lo:
                    continue
                cfg = {hi: k}
                if rest:
                    cfg[(lo, 1)] = cfg.get((lo, 1), 0) + rest // lo
                if cfg == {(ctx.tp, 1): world // ctx.tp}:
                    continue
                if cfg not in configs:
                    configs.append(cfg)
    return configs


def _keyed(types, cfg):
    """A configuration's replica types in build order, indexed: (keys, cost, fits, counts)."""
    keys = sorted(cfg, key=lambda t: (-t[0] * t[1], -t[1]))
    return (keys, {x: types[t][0] for x, t in enumerate(keys)},
            {x: types[t][1] <= types[t][2] for x, t in enumerate(keys)}, {x: cfg[t] for x, t in enumerate(keys)})


def _build(ctx: PlanContext, step: int, sequences: list[Sequence], types, keys, cfg, owner):
    """The plan of a dispatch: replicas in build order, each one's sequences cut into micro-batches
    longest-first under its memory."""
    replicas: list[Replica] = []
    units_of: dict[tuple[int, int], list[int]] = {}
    r0 = 0
    for x, (d, c) in enumerate(keys):
        for g in range(cfg[(d, c)]):
            units_of[(x, g)] = list(range(len(replicas), len(replicas) + c))
            for _ in range(c):
                replicas.append(Replica(ranks=list(range(r0, r0 + d)), tp=d))
                r0 += d
    members: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(owner):
        members.setdefault(key, []).append(i)
    caps = {t[0]: types[t][2] for t in types}
    b = StepBuilder(ctx, sequences, "zeppelin", n_units=len(replicas), capacity=[caps[r.tp] for r in replicas],
                    replicas=replicas)
    for key in sorted(members):
        c_t, tok, cap_t = types[keys[key[0]]]
        units = units_of[key]
        for k, bin_ in enumerate(pack_bins(members[key], tok, c_t, cap_t)):
            for i in sorted(bin_, key=lambda i: (-sequences[i].length, i)):
                b.place(k, "ring" if len(units) > 1 else "local", units, i)
    desc = " + ".join(f"{cfg[t]} x tp={t[0]}" + (f" cp={t[1]}" if t[1] > 1 else "") for t in keys)
    return b.finish(step, SolverInfo(name="greedy"), predict=predict_replicas, replicas=replicas,
                    notes={"family": "tp-replicas", "replicas": desc})


def _replica_degrees(ctx: PlanContext) -> list[int]:
    """TP degrees of replicas the runtime executes for the model (only the context's own degree for
    a model that runs without tensor parallelism: then the family has nothing to offer)."""
    cl = ctx.cluster
    if not model_runs_tp(ctx.model):
        return [ctx.tp]
    return [d for d in pow2_sizes(cl.gpus_per_node) if d >= ctx.tp and d % ctx.tp == 0
            and cl.gpus_per_node % d == 0 and ctx.model.tp_splits_heads(d)]


def replicas_hold(ctx: PlanContext, length: int) -> bool:
    """Whether replicas of the largest TP degree, context-parallel over as many of them as the
    cluster has, hold a sequence of ``length`` tokens (what :func:`tp_replicas` can plan)."""
    degrees = _replica_degrees(ctx)
    if len(degrees) < 2:
        return False
    D = degrees[-1]
    cap = ctx.cost_for(D).token_capacity
    return any(zigzag_share(np.array([length]), g)[0] <= cap for g in pow2_sizes(ctx.cluster.world_size // D))
