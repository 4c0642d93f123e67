"""The Zeppelin planner (DESIGN.md section 5): tiers, two-level assignment, queues, routes, remap.

Per training step:

1. **Micro-batches.** When the step's tokens do not fit the units' activation memory at once,
   the sequences are split into the fewest micro-batches that fit (gradient accumulation),
   balancing work across them.
2. **Tiers / spans** (:mod:`.tiering`): each sequence gets a span G (1 = local, 2..U = ring inside a
   node, whole nodes = ring across nodes) from memory and the cost crossovers.
3. **Level 1** (:func:`.assign.pack` over nodes): inter-node sequences take the least-loaded
   ``k`` nodes, intra-node groups and local sequences fill node buckets so nodes carry equal cost
   within their token capacity.
4. **Level 2** (the same packer over the units of each node, with the inter-node work as
   preload): intra-node groups take G units, local sequences fill the rest.
   A unit's cost = ring attention incl. exposed communication (or L^2 attention when local) +
   linear work per token - the same model :func:`.predict.predict_step` evaluates.
5. **Groups, queues.** One ring group per split sequence, cut into 2G zigzag chunks
   (:func:`zigzag_ranges`); ring order follows the topology (units of a node contiguous, each
   node entered once, so a ring crosses the network only ``k`` times; successive inter-node rings
   enter each node at a different unit so their boundary hops use different NICs). Each unit's
   queue: inter groups, then intra, then its local group - in one global group order, so no two
   units wait on each other in opposite orders.
6. **Routes** and **remap** (``routing.py``, ``remap.py`` of this package), then the prediction.
7. **Candidate families** (``families.py``): Ulysses groups that keep their units for the whole
   step, FLOP-share rings beside local units, replicas of a larger tensor-parallel degree. Each
   family scores its configurations by its own per-group time; the best (those that can beat the
   tiered plan) are built and priced by the same prediction, and the fastest candidate of all wins
   (ties: the tiered plan). On clusters of at most ``simulate_max_units`` units the simulator
   judges instead. Option ``families`` (``all``, ``none`` or a comma list). Beyond
   ``families_max_units`` (256) units only ``large_families`` (FLOP-share) are built, and beyond
   ``attention_max_units`` (256) the attention-balanced remap layout is not a candidate; beyond
   ``node_cp_max_units`` (2,048) neither are the node-CP layout nor node-major micro-batches
   (latency: at 4,096 GPUs each costs as much as the tiered search, and FLOP-share takes their
   place).
   A step with a sequence longer than the context's units hold together runs on replicas of a
   larger TP degree when they hold it.

Registered variants: ``zeppelin`` (everything), ``zeppelin-no-routing``, ``zeppelin-no-remap``,
``zeppelin-tiers-only`` (neither routing nor remapping) - the paper's ablation.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np

from zeppelin.planner.core.base import PlanContext, Planner, PlanningError, register
from zeppelin.planner.core.builder import record as _record
from zeppelin.planner.core.solver import WALL_CLOCK, SolveLimits, merge_status
from zeppelin.planner.costmodel.predict import coupled_components, microbatch_terms, predict_from_terms
from zeppelin.planner.zeppelin import families as families_mod
from zeppelin.planner.zeppelin.assign import PackInfeasible, PackResult, pack
from zeppelin.planner.zeppelin.select import select
from zeppelin.planner.zeppelin.tiering import Tiering, zigzag_max_tokens_array
from zeppelin.schemas.layout import contiguous_ranges, zigzag_ranges
from zeppelin.schemas.plan import (
    Group,
    MicroBatch,
    Placement,
    RemapInfo,
    Route,
    RoutePath,
    Sequence,
    SolverInfo,
    StepPlan,
)


def _optional(module: str):
    import importlib

    try:
        return importlib.import_module(f"zeppelin.planner.zeppelin.{module}")
    except ModuleNotFoundError as e:
        if e.name == f"zeppelin.planner.zeppelin.{module}":
            return None
        raise


def _fam_list(spec: str) -> tuple[str, ...]:
    known = families_mod.FAMILIES
    if spec in ("all", ""):
        return known
    if spec == "none":
        return ()
    out = tuple(x.strip() for x in spec.split(",") if x.strip())
    bad = [x for x in out if x not in known]
    if bad:
        raise PlanningError(f"families option: unknown family {bad[0]!r} (known: {', '.join(known)}, all, none)")
    return out


def _lpt_with_room(items: list[int], bins: int, room: float, weight: list[float], size: list[float]):
    """Each item in the given order to the least-loaded bin (by ``weight``) whose ``size`` total
    stays within ``room`` (ties: lowest bin). Returns the bin of each item (in ``items`` order), or
    None when an item fits no bin."""
    heap = [(0.0, b) for b in range(bins)]
    tok = [0.0] * bins
    out = []
    for i in items:
        aside = []
        while heap and tok[heap[0][1]] + size[i] > room:
            aside.append(heapq.heappop(heap))
        if not heap:
            return None
        ld, b = heapq.heappop(heap)
        out.append(b)
        tok[b] += size[i]
        heapq.heappush(heap, (ld + weight[i], b))
        for e in aside:
            heapq.heappush(heap, e)
    return out


# Deterministic ILP work per step: at most ILP_SOLVES packing ILPs, each stopped after ILP_NODES
# branch-and-bound nodes (about the 0.05 s wall-clock budget this replaced, on an idle 2-core machine)
ILP_SOLVES = 1
ILP_NODES = 10


@dataclass
class _MBStats:
    results: list[PackResult] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=lambda: {"local": 0, "intra": 0, "inter": 0})
    unit_loads: np.ndarray | None = None
    level2_lb: float = 0.0


@register
class ZeppelinPlanner(Planner):
    name = "zeppelin"
    description = "Zeppelin: hierarchical tiers, two-level ILP/greedy assignment, NIC routing, remapping"
    routing = True
    remap = True
    option_names = ("ilp", "ilp_nodes", "ilp_iterations", "ilp_budget_calls", "time_limit", "solver", "tol",
                    "max_ilp_vars_nodes", "max_ilp_vars_units", "select", "simulate_max_units", "intra",
                    "families", "families_max_units", "family_margin", "large_families",
                    "attention_max_units", "node_cp_max_units")

    def __init__(self, **options):
        super().__init__(**options)
        self.ilp = str(options.get("ilp", "auto"))
        if self.ilp not in ("auto", "always", "never"):
            raise PlanningError(f"ilp option must be auto, always or never (got {self.ilp!r})")
        # the packing ILP runs under deterministic work limits (same plan on any machine, under any
        # load); ``time_limit`` is only an optional wall-clock safety net per solve (None: off)
        wall = options.get("time_limit")
        wall = None if wall is None else float(wall)
        if wall is not None and not wall > 0:
            raise PlanningError(f"--time-limit must be positive (got {wall:g})")
        self.limits = SolveLimits(nodes=int(options.get("ilp_nodes", ILP_NODES)),
                                  iterations=int(options.get("ilp_iterations", 20000)), wall_s=wall)
        self.solver = str(options.get("solver", "highs"))
        if self.solver not in ("highs", "cbc"):
            raise PlanningError(f"solver must be highs or cbc (got {self.solver!r})")
        self.tol = float(options.get("tol", 0.01))
        # the ILP runs where it pays: small instances whose greedy solution is not provably close
        self.max_ilp_vars_nodes = int(options.get("max_ilp_vars_nodes", 600))
        self.max_ilp_vars_units = int(options.get("max_ilp_vars_units", 400))
        # how the whole-step candidates are chosen: "predict" (the analytic prediction), "simulate"
        # (the event-driven simulator of planner/sim/simulate.py, which sees ring pipeline waits and
        # NIC contention the prediction approximates; ~0.1-0.2 s per candidate at 64 GPUs), or
        # "auto": simulate when the step is small (at most ``simulate_max_units`` units; at 64 GPUs
        # the pass costs ~1 s per step, past the 0.1 s planning-latency target)
        self.select = str(options.get("select", "auto"))
        if self.select not in ("auto", "predict", "simulate"):
            raise PlanningError(f"select option must be auto, predict or simulate (got {self.select!r})")
        self.simulate_max_units = int(options.get("simulate_max_units", 16))
        # ILP solves per step shared by every candidate layout (``ilp=always``: no budget)
        self.ilp_budget_calls = int(options.get("ilp_budget_calls", ILP_SOLVES))
        self._ilp_left = 0
        self._wall_hit = False
        # how a sequence split inside a node runs: "auto" - a zigzag ring or Ulysses (all-to-all to
        # head shards), whichever the cost model prices lower for that sequence; "ring" - always a
        # ring (the published design)
        self.intra = str(options.get("intra", "auto"))
        if self.intra not in ("auto", "ring"):
            raise PlanningError(f"intra option must be auto or ring (got {self.intra!r})")
        # the whole-step candidate families of families.py (comma list, or "none"), tried on clusters
        # of at most ``families_max_units`` units; beyond, for planning latency, ``large_families``
        fam = str(options.get("families", "all"))
        self.families = _fam_list(fam)
        self.families_max_units = int(options.get("families_max_units", 256))
        self.family_margin = float(options.get("family_margin", 0.05))
        self.large_families = _fam_list(str(options.get("large_families", "flop-share")))
        self.attention_max_units = int(options.get("attention_max_units", 256))
        self.node_cp_max_units = int(options.get("node_cp_max_units", 2048))
        self._sims: dict[int, object] = {}
        self._tiering: dict[int, Tiering] = {}
        self._tables: dict = {}

    # ------------------------------------------------------------------ helpers
    def _family_names(self, only=None) -> list[str]:
        """The families tried for a step (``only``: of these alone); Ulysses groups need ``intra=auto``."""
        return [f for f in self.families if not (f == "ulysses-groups" and self.intra == "ring")  # rings only
                and (only is None or f in only)]

    def tiering(self, ctx: PlanContext) -> Tiering:
        t = self._tiering.get(id(ctx))
        if t is None or t.ctx is not ctx:
            t = self._tiering[id(ctx)] = Tiering(ctx)
        return t

    def _simulator(self, ctx: PlanContext):
        from zeppelin.planner.sim.simulate import Simulator

        sim = self._sims.get(id(ctx))
        if sim is None or sim.ctx is not ctx:
            sim = self._sims[id(ctx)] = Simulator(ctx)
        return sim

    # ILP work per step: every candidate layout may call the packing ILP; together they share a
    # budget of ``ilp_budget_calls`` solves, each under ``self.limits`` (``ilp=always``: no budget).
    # Counted in solves, not seconds, so that the plan does not depend on the machine's load.
    def _ilp_mode(self) -> str:
        if self.ilp == "always":
            return "always"
        return self.ilp if self._ilp_left > 0 else "never"

    def _ilp_spent(self, r) -> None:
        self._ilp_left -= getattr(r, "ilp_runs", 0)
        self._wall_hit = self._wall_hit or getattr(r, "status", "") == WALL_CLOCK

    def _routed_nics(self, ctx: PlanContext) -> int:
        return len(ctx.cluster.nics) if self.routing else 1

    def check_feasible(self, ctx: PlanContext, sequences: list[Sequence]) -> None:
        tg = self.tiering(ctx)
        if tg.cap <= 0:
            c = ctx.cost
            raise PlanningError(
                f"model {ctx.model.name} does not fit on {ctx.cluster.gpu.name}: model states take "
                f"{c.model_state_bytes() / 1e9:.1f} GB of {c.gpu_capacity_bytes / 1e9:.1f} GB usable "
                f"(try --zero-stage 3 or --tp)")
        for i, s in enumerate(sequences):
            if tg.min_span(s.length) is None:
                if self._replicas_hold(ctx, sequences):
                    return  # replicas of a larger TP degree hold it (families.tp_replicas plans the step)
                raise PlanningError(
                    f"sequence {i} (sample {s.sample_id}) has {s.length:,} tokens, more than the whole cluster "
                    f"can hold ({tg.n} units x {tg.cap:,} tokens = {tg.n * tg.cap:,}); lower --max-seq-len "
                    f"or use more GPUs / --zero-stage 3")

    def _replicas_hold(self, ctx: PlanContext, sequences: list[Sequence]) -> bool:
        """Whether the tp-replicas family (on) can hold every sequence of the step."""
        if "tp-replicas" not in self.families or ctx.num_units > self.families_max_units:
            return False
        return families_mod.tp_replicas.replicas_hold(ctx, max(s.length for s in sequences))

    def _oversize_step(self, ctx: PlanContext, step: int, sequences: list[Sequence], t0: float) -> StepPlan:
        """A step with a sequence longer than the context's units can hold together, planned on
        replicas of a larger tensor-parallel degree (whose model states take less of each GPU)."""
        plan = select(ctx, step, sequences, [], self._family_names(only=("tp-replicas",)), bound=None,
                      routing=self.routing, simulator=self._judge(ctx), t0=t0)
        if plan is None:
            raise PlanningError(f"step {step}: no replica layout of a larger tensor-parallel degree holds its "
                                f"longest sequence ({max(s.length for s in sequences):,} tokens)")
        return plan

    def _judge(self, ctx: PlanContext):
        """The simulator where it judges the candidates (``select``), else None (the prediction)."""
        if self.select == "simulate" or (self.select == "auto" and ctx.num_units <= self.simulate_max_units):
            return self._simulator(ctx)
        return None

    # ------------------------------------------------------------------ main entry
    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        # a step at 1,024 GPUs allocates ~10^5 small containers (groups, placements, ranges) and
        # frees none until it returns: the cyclic collector's passes over them are pure overhead
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            return self._plan_step(ctx, step, sequences)
        finally:
            # span tables serve one step's candidate layouts (tens of MB each at 4,096 GPUs): none
            # outlives its step, so a long plan file streams with one step's memory
            self._tables.clear()
            if gc_was_on:
                gc.enable()

    def _plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        t0 = time.perf_counter()
        self._ilp_left = self.ilp_budget_calls
        self._wall_hit = False  # did any ILP of this step stop at the wall-clock safety net?
        if not sequences:
            raise PlanningError(f"step {step} has no sequences")
        self.check_feasible(ctx, sequences)
        tg = self.tiering(ctx)
        if any(tg.min_span(s.length) is None for s in sequences):
            return self._oversize_step(ctx, step, sequences, t0)
        lengths = np.array([s.length for s in sequences], dtype=np.int64)
        n = ctx.num_units
        budget = n * tg.cap
        # fewest micro-batches that fit with 10% slack (never more than one per sequence)
        M = max(1, min(len(sequences), math.ceil(int(lengths.sum()) / (0.9 * budget))))
        last_err = None
        simulate = self.select == "simulate" or (self.select == "auto" and n <= self.simulate_max_units)
        found: list[tuple[list, float]] = []  # whole-step candidates: (built micro-batches, predicted time)
        while M <= len(sequences):
            parts = self._split_microbatches(ctx, lengths, M, budget)
            if parts is None:
                M += 1
                continue
            # two whole-step searches, the faster by the prediction wins: (1) tiered spans, per
            # micro-batch the better of balancing total cost or attention with a remap; (2) node-CP
            # without remap in every micro-batch (a te-cp-like layout inside zeppelin's search
            # space): nodes then never wait for each other, so one micro-batch's hot node can be
            # another's cold one, and no unit waits on partners from rings of assorted widths
            best_built, best_t, best_mode = None, float("inf"), 0
            for mode, (floors, balances) in enumerate(self._modes(ctx)):
                if (mode > 0 and best_built is not None and n > 256
                        and not self._coupling_waste(best_built, best_t)):
                    # large clusters, for planning latency: the tiered plan loses (almost) nothing
                    # to waits, so node-CP is unlikely to beat it
                    break
                try:
                    built, t = self._whole_step(ctx, tg, sequences, lengths, parts, floors, balances)
                except PackInfeasible as e:
                    last_err = e
                    continue
                found.append((built, t))
                if t < best_t:
                    best_built, best_t, best_mode = built, t, mode
            if (len(parts) > 1 and ctx.cluster.num_nodes > 1 and ctx.units_per_node > 1
                    and n <= self.node_cp_max_units):
                # node-major micro-batches: with no barrier between micro-batches, what must balance
                # is each node's whole step, not each micro-batch; assign sequences to nodes for the
                # whole step, then cut each node's share into micro-batches that fit its memory
                nm = self._node_major(ctx, tg, lengths, len(parts))
                # (beyond 32 units, for planning latency: only the layout family that won above, its
                # micro-batches balanced on total cost: without the attention-balanced node-major
                # layout no plan of the RESULTS grid changed, and none of 72 steps at 64 / 128 GPUs
                # drawn as the quality benchmark draws them got slower)
                modes = self._modes(ctx) if n <= 32 else [(self._modes(ctx)[best_mode][0], ["total"])]
                for floors, balances in (modes if nm is not None else []):
                    try:
                        built, t = self._whole_step(ctx, tg, sequences, lengths, nm[0], floors, balances, nm[1])
                        found.append((built, t))
                        if t < best_t:
                            best_built, best_t = built, t
                    except PackInfeasible as e:
                        last_err = last_err or e
            if best_built is None:
                M += 1
                continue
            if simulate and M < len(sequences) and min(len(b) for b, _ in found) == M:
                # the simulator judges one more micro-batch too (it may run rings more smoothly)
                M += 1
                continue
            break
        if not found:  # every sequence fits alone (checked above), so this means a packing failure
            raise PlanningError(f"step {step}: no feasible assignment found ({last_err})")
        own = []
        for built, _ in (found if simulate else [min(found, key=lambda c: c[1])]):
            plan = StepPlan(step=step, sequences=list(sequences), microbatches=[b[0] for b in built])
            # the prediction from the candidate's terms: the same as predict_step(ctx, plan)
            plan.prediction = predict_from_terms(ctx, lengths, [b[2] for b in built])
            own.append((plan, self._finisher([b[1] for b in built])))
        # the candidate families, judged the same way; ties keep the tiered plan
        if n <= self.families_max_units:
            # a family configuration whose own score is this far above the best tiered candidate
            # (without the all-reduce) is not built: it would not win
            bound = min(t for _, t in found) * (1 + self.family_margin)
            fams = self._family_names()
        else:
            # large clusters: the cheap families only, always built (FLOP-share's own score is coarse
            # where rings span many nodes, so it does not prune)
            bound, fams = None, self._family_names(only=self.large_families)
        return select(ctx, step, sequences, own, fams, bound=bound, routing=self.routing,
                      simulator=self._judge(ctx) if simulate else None, t0=t0, wall_hit=self._wall_hit)

    def _finisher(self, stats: list[_MBStats]):
        def finish(plan: StepPlan, elapsed: float) -> None:
            plan.solver = self._solver_info(stats, elapsed)
            tiers = {"local": 0, "intra": 0, "inter": 0}
            for st in stats:
                for k, v in st.tiers.items():
                    tiers[k] += v
            plan.notes = {"tiers": tiers, "microbatches": len(plan.microbatches)}
        return finish

    # ------------------------------------------------------------------ micro-batches
    def _split_microbatches(self, ctx: PlanContext, lengths: np.ndarray, M: int, budget: int) -> list[list[int]] | None:
        if M == 1:
            return [list(range(len(lengths)))] if lengths.sum() <= budget else None
        work = ctx.cost.work(lengths)
        order = np.argsort(-work, kind="stable").tolist()
        wl, Ll = work.tolist(), lengths.tolist()
        toks = [0] * M
        parts: list[list[int]] = [[] for _ in range(M)]
        # least work among the micro-batches with room; ties: fewest tokens, lowest index (a heap
        # of (work, tokens, index); entries without room are set aside and put back)
        heap = [(0.0, 0, j) for j in range(M)]
        for i in order:
            L = Ll[i]
            aside = []
            while heap and heap[0][1] + L > budget:
                aside.append(heapq.heappop(heap))
            if not heap:
                return None
            w, t, j = heapq.heappop(heap)
            parts[j].append(int(i))
            toks[j] = t + L
            heapq.heappush(heap, (w + wl[i], t + L, j))
            for e in aside:
                heapq.heappush(heap, e)
        if any(not p for p in parts):
            return None
        return [sorted(p) for p in parts]

    def _whole_step(self, ctx: PlanContext, tg: Tiering, sequences: list[Sequence], lengths: np.ndarray,
                    parts: list[list[int]], floors, balances, fixed_nodes: dict[int, int] | None = None):
        """Plan every micro-batch of a step, coarse ones first, each balanced on top of the per-unit
        load the earlier ones left (per unit, the step is the sum of its micro-batch periods, a
        period including the waits for the unit's coupled partners). Returns (built micro-batches,
        predicted time without the all-reduce); raises :class:`PackInfeasible`."""
        carry = np.zeros(ctx.num_units)
        built = [None] * len(parts)
        for k in sorted(range(len(parts)), key=lambda k: -max(lengths[i] for i in parts[k])):
            mb, st, terms = self._best_microbatch(ctx, tg, sequences, parts[k], carry, floors, balances,
                                                  fixed_nodes=fixed_nodes)
            carry = carry + terms.period
            built[k] = (mb, st, terms)
        return built, float(carry.max())

    def _node_major(self, ctx: PlanContext, tg: Tiering, lengths: np.ndarray, M: int):
        """Whole-step node assignment for the node-CP layout: sequences to nodes by work (LPT, each
        node holding at most ``M`` micro-batches of tokens), then each node's share cut into ``M``
        micro-batches that fit its units' memory (work-balanced). Returns (micro-batches, node of
        each sequence), or None where a sequence needs more than one node or nothing fits."""
        N, upn, cap = ctx.cluster.num_nodes, ctx.units_per_node, tg.cap
        per_tok = zigzag_max_tokens_array(lengths, upn).astype(np.float64)  # tokens per unit, node-wide split
        if per_tok.max() > cap:
            return None
        # weight: a sequence's per-unit time on a node when split over all of it (the span table's
        # ring / Ulysses price: small blocks and all-to-alls included) - what node loads add up to
        Ls = np.asarray(lengths, dtype=np.float64)
        c, layers = ctx.cost, ctx.model.num_layers
        ring, exp, uly = tg.split_prices(Ls, upn, "intra", ulysses=self.intra == "auto")
        att = ring + exp if uly is None else np.minimum(ring + exp, uly[0] + uly[1])
        T_avg = max(float(Ls.sum()) / ctx.num_units, 1.0)
        lin_rate = float(layers * c.linear_time(T_avg) + c.head_time(T_avg)) / T_avg
        w = layers * att + lin_rate * Ls / upn
        wl, pt = w.tolist(), per_tok.tolist()
        order = np.argsort(-w, kind="stable").tolist()
        node = _lpt_with_room(order, N, M * cap, wl, pt)
        if node is None:
            return None
        by_node: list[list[int]] = [[] for _ in range(N)]
        for i, nd in zip(order, node):  # heaviest first within each node
            by_node[nd].append(i)
        parts: list[list[int]] = [[] for _ in range(M)]
        for nd in range(N):
            mbs = _lpt_with_room(by_node[nd], M, cap, wl, pt)
            if mbs is None:
                return None
            for i, k in zip(by_node[nd], mbs):
                parts[k].append(i)
        node_of = dict(zip(order, node))
        parts = [sorted(p) for p in parts if p]
        return parts, {i: node_of[i] for i in range(len(lengths))}

    # ------------------------------------------------------------------ one micro-batch
    def _coupling_waste(self, built, t: float) -> bool:
        """Whether the units of a planned step lose more than ``tol`` of it waiting for partners."""
        busy = sum(b[2].busy for b in built)
        return t - float(busy.max()) > self.tol * t

    def _modes(self, ctx: PlanContext) -> list[tuple[list, list[str]]]:
        """(span floors, balance objectives) of each whole-step search (see :meth:`_plan_step`)."""
        # (the attention-balanced layout with a remap is a candidate up to ``attention_max_units``
        # units: beyond, for planning latency, the FLOP-share family takes its place)
        balances = ["total"] + (["attention"] if self.remap and _optional("remap") is not None
                                and ctx.num_units <= self.attention_max_units else [])
        if ctx.units_per_node <= 1 or ctx.num_units > self.node_cp_max_units:
            return [([None], balances)]
        node_cp = ctx.units_per_node - 1  # index of Span(units_per_node, "intra")
        return [([None], balances), ([node_cp], ["total"])]

    def _best_microbatch(self, ctx: PlanContext, tg: Tiering, sequences: list[Sequence], idx: list[int],
                         carry: np.ndarray, floors: list | None = None, balances: list[str] | None = None,
                         fixed_nodes: dict[int, int] | None = None):
        """Candidate layouts, the faster by the prediction (``carry`` + the period) wins:

        * spans from the tiers (``floor`` None) or node-CP (``floor``: every splittable sequence
          that fits on one node takes a ring over the whole node, sequences balanced over nodes);
        * balance the total per-unit cost (attention + linear work in the attention layout), no
          remap - the linear modules run where attention ran;
        * (remap layer on) balance attention alone and let the remap even out the linear tokens
          (the remap layer itself drops the remap when it does not pay).

        Returns the micro-batch, its stats and its prediction terms (:func:`.predict.microbatch_terms`;
        their ``period`` is the predicted per-unit time without the step's gradient all-reduce,
        waits for coupled units included)."""
        cands = []
        err = None
        # nodes filled to the last token can leave their units no room for rings of assorted
        # widths: then level 1 keeps some token slack per node (before the caller falls back to
        # one more micro-batch, which costs far more)
        for fill in (1.0, 0.95, 0.9) if ctx.cluster.num_nodes > 1 else (1.0,):
            for floor in floors if floors is not None else [None]:
                for bal in balances if balances is not None else ["total"]:
                    try:
                        cands.append(self._plan_microbatch(ctx, tg, sequences, idx, carry, balance=bal, floor=floor,
                                                           node_fill=fill, fixed_nodes=fixed_nodes))
                    except PackInfeasible as e:
                        err = err or e
            if cands:
                break
        if not cands:
            raise err
        best = None
        lengths = [s.length for s in sequences]
        for mb, st in cands:
            terms = microbatch_terms(ctx, lengths, mb)
            t = float((carry + terms.period).max())
            if best is None or t < best[0]:
                best = (t, mb, st, terms)
        return best[1], best[2], best[3]

    def _plan_microbatch(self, ctx: PlanContext, tg: Tiering, sequences: list[Sequence], idx: list[int],
                         carry: np.ndarray, balance: str = "total", floor: int | None = None,
                         node_fill: float = 1.0, fixed_nodes: dict[int, int] | None = None):
        """One candidate layout. ``node_fill``: the share of a node's token capacity level 1 may
        fill (below 1 when a node filled to the last token left its units no room for its rings)."""
        cost = ctx.cost
        layers = ctx.model.num_layers
        n, upn, N = ctx.num_units, ctx.units_per_node, ctx.cluster.num_nodes
        cap = tg.cap
        rn = self._routed_nics(ctx)
        Ls = np.array([sequences[i].length for i in idx], dtype=np.float64)
        T_avg = max(float(Ls.sum()) / n, 1.0)
        lin_rate = float(layers * cost.linear_time(T_avg) + cost.head_time(T_avg)) / T_avg
        if balance == "attention":
            lin_rate = 0.0
        # spans: target = balanced per-unit load, refined once with the chosen spans' costs
        # Ulysses is offered to the node-CP layout (whole-node splits, where its all-to-all replaces a
        # ring of small blocks); the tiered layout keeps rings, whose transfers local work can fill
        # (measured: tiered rings-only plans predict faster than tiered plans mixing in Ulysses)
        uly = self.intra == "auto" and floor is not None
        key = (id(tg), rn, uly, Ls.tobytes())
        tb = self._tables.get(key)
        if tb is None:
            tb = tg.span_table(Ls, rn, ulysses=uly)
            if len(self._tables) >= 4:  # a few live tables: this micro-batch's candidate layouts
                self._tables.clear()
            self._tables[key] = tb
        T_all = tb.times(lin_rate)
        target = float(T_all[0].sum()) / n
        cols = np.arange(len(Ls))
        for _ in range(2):
            k = tg.choose_span_index(tb, target, lin_rate)
            unit_t = T_all[k, cols]
            target = float((unit_t * tb.G[k]).sum()) / n
        if floor is not None:
            # the node-CP candidate: every sequence long enough to split spans at least ``floor``
            k = np.where(tb.F[floor] & (Ls >= 2 * tb.G[floor]), floor, np.maximum(k, floor * (Ls >= 2 * tb.G[floor])))
            unit_t = T_all[k, cols]
        spans = [tg.spans[x] for x in k]
        kidx = np.array(k, dtype=np.int64)  # span index per sequence (the fallback below may widen it)
        st = _MBStats()
        Gk = np.array([tg.spans[x].G for x in range(len(tg.spans))], dtype=np.int64)[k]
        inter_k = np.array([s.tier == "inter" for s in tg.spans], dtype=bool)[k]
        per_tok = zigzag_max_tokens_array(Ls, Gk).astype(np.float64)

        # ---- level 1: nodes
        node_of: list[list[int]] = [[0] for _ in idx]  # nodes of each sequence
        if N > 1 and fixed_nodes is not None and not inter_k.any():
            # the whole step's node assignment was made up front (node-major micro-batches)
            node_of = [[fixed_nodes[i]] for i in idx]
        elif N > 1:
            w1 = np.where(inter_k, np.array([sp.nodes for sp in tg.spans], dtype=np.int64)[k], 1)
            c1 = unit_t * np.where(inter_k, upn, Gk)
            k1 = per_tok * np.where(inter_k, upn, Gk)
            r1 = pack(carry.reshape(N, upn).sum(axis=1), np.zeros(N), c1, k1, w1, float(cap * upn) * node_fill,
                      ilp=self._ilp_mode(), limits=self.limits, tol=self.tol, solver=self.solver,
                      max_ilp_vars=self.max_ilp_vars_nodes)
            self._ilp_spent(r1)
            st.results.append(r1)
            node_of = r1.bins
        # ---- level 2: units inside each node
        unit_of: list[list[int]] = [[] for _ in idx]
        inter_js = [j for j, s in enumerate(spans) if s.tier == "inter"]
        pre = np.array(carry, dtype=np.float64)
        pre_tok = np.zeros(n)
        for j in inter_js:
            for nd in node_of[j]:
                pre[nd * upn:(nd + 1) * upn] += unit_t[j]
                pre_tok[nd * upn:(nd + 1) * upn] += per_tok[j]
        by_node: dict[int, list[int]] = {}
        for j, s in enumerate(spans):
            if s.tier != "inter":
                by_node.setdefault(node_of[j][0], []).append(j)
        node_results: dict[int, PackResult] = {}
        for nd in range(N):
            js = by_node.get(nd, [])
            sl = slice(nd * upn, (nd + 1) * upn)
            try:
                r2 = pack(pre[sl], pre_tok[sl], unit_t[js], per_tok[js],
                          np.array([spans[j].G for j in js], dtype=np.int64), float(cap), ilp="never")
            except PackInfeasible:
                # the node's tokens fit (level 1 checked), but its rings of assorted widths leave
                # no G units with room together: widen them to the whole node (equal shares on
                # every unit, like static CP inside the node) - first the rings, then every
                # sequence long enough to split - before the caller falls back to more micro-batches
                r2 = None
                whole = upn - 1  # index of Span(upn, "intra") in tg.spans
                for min_len in (None, 2 * upn):
                    for j in js:
                        if (spans[j].G > 1 if min_len is None else Ls[j] >= min_len) and upn > 1:
                            spans[j] = tg.spans[whole]
                            kidx[j] = whole
                            unit_t[j] = T_all[whole, j]
                            per_tok[j] = float(zigzag_max_tokens_array(Ls[j:j + 1], [upn])[0])
                    try:
                        r2 = pack(pre[sl], pre_tok[sl], unit_t[js], per_tok[js],
                                  np.array([spans[j].G for j in js], dtype=np.int64), float(cap), ilp="never")
                        break
                    except PackInfeasible:
                        if min_len is not None:
                            raise
            node_results[nd] = r2
        # polish with the ILP only the nodes that set the step's maximum
        # (node-CP: rings take whole nodes, so the units of a node carry near-equal loads already)
        if self.ilp != "never" and node_results and floor is None:
            lb = max(r.lower_bound for r in node_results.values())
            top = max(r.makespan for r in node_results.values())
            for nd, r2 in node_results.items():
                hot = r2.makespan > (1 + self.tol) * lb and r2.makespan >= top * (1 - self.tol)
                if self._ilp_mode() != "never" and (self.ilp == "always" or (hot and r2.gap > self.tol)):
                    js = by_node.get(nd, [])
                    sl = slice(nd * upn, (nd + 1) * upn)
                    node_results[nd] = pack(pre[sl], pre_tok[sl], unit_t[js], per_tok[js],
                                            np.array([spans[j].G for j in js], dtype=np.int64), float(cap),
                                            ilp="always" if self.ilp == "always" else "auto",
                                            limits=self.limits, tol=self.tol, solver=self.solver,
                                            max_ilp_vars=self.max_ilp_vars_units)
                    self._ilp_spent(node_results[nd])
        loads = np.zeros(n)
        for nd, r2 in node_results.items():
            loads[nd * upn:(nd + 1) * upn] = r2.loads
            for jj, j in enumerate(by_node.get(nd, [])):
                unit_of[j] = [nd * upn + b for b in r2.bins[jj]]
            st.results.append(r2)
        st.unit_loads = loads
        for sp in spans:
            st.tiers[sp.tier] += 1
        st.level2_lb = max((r.lower_bound for r in node_results.values()), default=0.0)

        # ---- groups, placements, queues
        groups: list[Group] = []
        placements: list[Placement] = []
        inter_count = np.zeros(N, dtype=np.int64)
        gpn_nic = max(1, ctx.cluster.gpus_per_node // len(ctx.cluster.nics))
        for j in sorted(inter_js, key=lambda j: -Ls[j]):
            units: list[int] = []
            for nd in sorted(node_of[j]):
                rot = int(inter_count[nd]) * max(1, gpn_nic // ctx.tp) % upn
                inter_count[nd] += 1
                base = list(range(nd * upn, (nd + 1) * upn))
                units += base[rot:] + base[:rot]
            groups.append(_record(Group, kind="ring", tier="inter", units=units))
            placements.append(_record(Placement, seq=idx[j], group=len(groups) - 1, scheme="zigzag",
                                        ranges=zigzag_ranges(int(Ls[j]), len(units)), padded_length=None))
        # intra-node splits on the same units share one group (one ring / one all-to-all per round
        # for all of them: fewer, larger transfers, one latency); inter rings stay one per sequence
        # (each enters its nodes at a different unit, spreading the boundary hops over the NICs)
        uly_of = self._kind_families(n, upn, spans, kidx, tb, unit_of, node_of, inter_js)
        shared: dict[tuple, int] = {}
        for j in sorted((j for j, s in enumerate(spans) if s.tier == "intra"), key=lambda j: -Ls[j]):
            units = sorted(unit_of[j])
            uly = uly_of.get(j, False)
            key = ("ulysses" if uly else "ring", tuple(units))
            gi = shared.get(key)
            if gi is None:
                groups.append(_record(Group, kind=key[0], tier="intra", units=units))
                gi = shared[key] = len(groups) - 1
            if uly:
                placements.append(_record(Placement, seq=idx[j], group=gi, scheme="contiguous",
                                            ranges=contiguous_ranges(int(Ls[j]), len(units)), padded_length=None))
            else:
                placements.append(_record(Placement, seq=idx[j], group=gi, scheme="zigzag",
                                            ranges=zigzag_ranges(int(Ls[j]), len(units)), padded_length=None))
        local_by_unit: dict[int, list[int]] = {}
        for j, s in enumerate(spans):
            if s.tier == "local":
                local_by_unit.setdefault(unit_of[j][0], []).append(j)
        for u in sorted(local_by_unit):
            groups.append(_record(Group, kind="local", tier="local", units=[u]))
            for j in sorted(local_by_unit[u], key=lambda j: -Ls[j]):
                placements.append(_record(Placement, seq=idx[j], group=len(groups) - 1, scheme="whole",
                                                           ranges=[[[0, int(Ls[j])]]], padded_length=None))
        queues: list[list[int]] = [[] for _ in range(n)]
        for gi, g in enumerate(groups):  # global order: inter, intra, local
            for u in g.units:
                queues[u].append(gi)
        # built from validated parts; model_construct skips re-validating thousands of records
        mb = MicroBatch.model_construct(groups=groups, placements=placements, queues=queues, linear_layout=None,
                                        remap=RemapInfo(), routes=[])
        mb.routes = self._routes(ctx, mb)
        layout, info = self._remap(ctx, sequences, mb, enable=self.remap and balance == "attention")
        mb.linear_layout = layout
        mb.remap = info
        return mb, st

    @staticmethod
    def _kind_families(n: int, upn: int, spans, kidx, tb, unit_of, node_of, inter_js) -> dict[int, bool]:
        """Which intra-node splits run as Ulysses. The runtime runs one kind family per unit and
        micro-batch (Ulysses, or rings and local work), so units linked by split groups decide
        together: all their splits as Ulysses (only where every one can be, and no inter-node ring
        touches them) or all as rings, whichever the span table prices lower in sum."""
        if tb.U is None:
            return {}
        intra_js = [j for j, s in enumerate(spans) if s.tier == "intra"]
        members: dict[int, list[int]] = {}
        for j in inter_js:
            members[j] = [nd * upn + b for nd in node_of[j] for b in range(upn)]
        for j in intra_js:
            members[j] = list(unit_of[j])
        label = coupled_components(n, members.values())
        comp: dict[int, list[int]] = {}
        for j in intra_js:
            comp.setdefault(int(label[members[j][0]]), []).append(j)
        blocked = {int(label[members[j][0]]) for j in inter_js}
        out: dict[int, bool] = {}
        for root, js in comp.items():
            ring = sum(float(tb.R[kidx[j], j]) for j in js)
            uly = sum(float(tb.Q[kidx[j], j]) for j in js)
            choose = root not in blocked and np.isfinite(uly) and uly < ring
            for j in js:
                out[j] = bool(choose)
        return out

    # ------------------------------------------------------------------ routing / remap
    def _routes(self, ctx: PlanContext, mb: MicroBatch) -> list[Route]:
        routing = _optional("routing")
        if routing is not None:
            return routing.plan_routes(ctx, mb, enable=self.routing)
        return direct_routes(ctx, mb)

    def _remap(self, ctx: PlanContext, sequences: list[Sequence], mb: MicroBatch, enable: bool):
        remap = _optional("remap")
        if remap is None:
            return None, RemapInfo(enabled=False, reason="remap layer not available in this build")
        if self.remap and not enable:
            return None, RemapInfo(enabled=False, reason="layout balanced on attention + linear cost; "
                                                         "a remap would not pay")
        return remap.plan_remap(ctx, sequences, mb, enable=enable)

    # ------------------------------------------------------------------ solver record
    def _solver_info(self, stats: list[_MBStats], elapsed: float) -> SolverInfo:
        results = [r for st in stats for r in st.results]
        names = {r.solver for r in results}
        name = "highs" if "highs" in names else "cbc" if "cbc" in names else "greedy"
        ilp_runs = [r for r in results if r.solver in ("highs", "cbc")]
        status = merge_status([r.status for r in ilp_runs])
        if self._wall_hit or any(r.status == WALL_CLOCK for r in results):
            status = WALL_CLOCK  # a greedy fallback after the safety net fired: the step depends on the load
        # gap of the unit assignment: the hottest unit vs the best any assignment could do
        gaps = []
        for st in stats:
            if st.unit_loads is not None and len(st.unit_loads):
                mk = float(st.unit_loads.max())
                gaps.append(max(mk - st.level2_lb, 0.0) / mk if mk > 0 else 0.0)
        reasons = []
        for r in results:
            if r.fallback_reason and r.fallback_reason not in reasons:
                reasons.append(r.fallback_reason)
        return SolverInfo(name=name, status=status, gap=max(gaps) if gaps else 0.0, time_s=elapsed,
                          fallback_reason="; ".join(reasons[:3]) if reasons else None)


def direct_routes(ctx: PlanContext, mb: MicroBatch) -> list[Route]:
    """Single-path routes for every inter-node hop of the inter-tier ring groups (no proxies)."""
    upn = ctx.units_per_node
    cost = ctx.cost
    held: dict[tuple[int, int], int] = {}
    for p in mb.placements:
        g = mb.groups[p.group]
        if g.tier != "inter" or len(g.units) < 2:
            continue
        for pos, u in enumerate(g.units):
            held[(p.group, u)] = held.get((p.group, u), 0) + sum(e - s for s, e in p.ranges[pos])
    routes = []
    for gi, g in enumerate(mb.groups):
        if g.tier != "inter" or len(g.units) < 2:
            continue
        G = len(g.units)
        for pos, src in enumerate(g.units):
            dst = g.units[(pos + 1) % G]
            if src // upn == dst // upn:
                continue
            tok = held.get((gi, src), 0)
            nic_s = ctx.cluster.nic_of(src * ctx.tp)
            nic_d = ctx.cluster.nic_of(dst * ctx.tp)
            routes.append(Route(group=gi, src=src, dst=dst, tokens=tok, bytes=int(cost.kv_bytes(tok)),
                                paths=[RoutePath(via_src=src, via_dst=dst, nic_src=nic_s, nic_dst=nic_d,
                                                 tokens=tok)]))
    return routes


@register
class ZeppelinNoRouting(ZeppelinPlanner):
    name = "zeppelin-no-routing"
    description = "Zeppelin without the NIC routing layer (direct ring transfers)"
    routing = False


@register
class ZeppelinNoRemap(ZeppelinPlanner):
    name = "zeppelin-no-remap"
    description = "Zeppelin without the remapping layer (linear modules use the attention layout)"
    remap = False


@register
class ZeppelinTiersOnly(ZeppelinPlanner):
    name = "zeppelin-tiers-only"
    description = "Zeppelin tiers and assignment only: no routing, no remapping"
    routing = False
    remap = False
