"""The Zeppelin planner (docs/DESIGN.md, "Zeppelin"): tiers, two-level assignment, queues, routes, remap.

Per training step, the planner's own whole-step searches (:mod:`.step_searches`: ``tiered``,
``node-cp``, ``node-major``) plan the fewest micro-batches that fit, each micro-batch laid out by
the tiered pipeline (:mod:`.tiered`: spans, node assignment, unit assignment; :mod:`.groups`:
groups, queues, routes, remap). The candidate families (:mod:`.families`: Ulysses groups,
FLOP-share rings, replicas of a larger tensor-parallel degree, whole-node rings for a step's longest
sequences) propose layouts of their own shapes, and :func:`.select.select` picks the step's plan
among all of them, by the simulator on clusters of at most ``simulate_max_units`` units, else by the
prediction with its few best confirmed by the simulator (on clusters of at most
``select.CONFIRM_MAX_UNITS`` units); ties keep the tiered plan.
Option ``families`` (``all``, ``none`` or a comma list). Beyond ``families_max_units`` units only
``large_families`` are built, beyond ``attention_max_units`` the attention-balanced remap layout
is not a candidate, and beyond ``node_cp_max_units`` neither are the node-CP layout nor
node-major micro-batches (for planning latency: FLOP-share takes their place); beyond 256 units a
step of several coupled micro-batches that node-major plans is planned by it alone, without the
families (``step_searches.NODE_MAJOR_FIRST_UNITS``), and from 33 units up alone when its plan is
predicted within ``search_gap`` of the step's lower bound (node-CP runs only where the tiered
plan is not either); beyond 32 units the families are not
searched for a step whose tiered plan is predicted within ``family_gap`` of its lower bound. A step with a
sequence longer than the context's units hold together runs on replicas of a larger TP degree
when they hold it.

Registered variants: ``zeppelin`` (everything), ``zeppelin-no-routing``, ``zeppelin-no-remap``,
``zeppelin-tiers-only`` (neither routing nor remapping) - the paper's ablation.
"""

from __future__ import annotations

import gc
import time
from functools import partial

import numpy as np

from zeppelin.planner.core.base import PlanContext, Planner, PlanningError, register
from zeppelin.planner.core.solver import SolveLimits
from zeppelin.planner.costmodel.predict import forced_microbatches, lower_bounds
from zeppelin.planner.zeppelin import families as families_mod
from zeppelin.planner.zeppelin import recompute as recompute_mod
from zeppelin.planner.zeppelin.options import ZeppelinOptions
from zeppelin.planner.zeppelin.select import BUILD_ALL_MAX_UNITS, CONFIRM_MAX_UNITS, MODE_CONFIRM_MAX_UNITS, select
from zeppelin.planner.zeppelin.step_searches import search_step
from zeppelin.planner.zeppelin.step_state import StepState
from zeppelin.planner.zeppelin.tiering import Tiering
from zeppelin.schemas.plan import Sequence, StepPlan


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


@register
class ZeppelinPlanner(Planner):
    name = "zeppelin"
    description = "Zeppelin: hierarchical tiers, two-level ILP/greedy assignment, NIC routing, remapping"
    routing = True
    remap = True
    Options = ZeppelinOptions
    #: called with every candidate plan a step builds (see :func:`.select.select`); None: none
    collector = None
    #: ``--recompute auto``: a choice per micro-batch (:mod:`.recompute`)
    chooses_recompute = True

    def __init__(self, **options):
        super().__init__(**options)  # checks and types the options: self.opts
        o = self.opts
        self.ilp = o.ilp
        # the packing ILP runs under deterministic work limits (same plan on any machine, under any
        # load); ``time_limit`` is only an optional wall-clock safety net per solve (None: off)
        self.limits = SolveLimits(nodes=o.ilp_nodes, iterations=o.ilp_iterations, wall_s=o.time_limit)
        self.solver = o.solver
        self.tol = o.tol
        # the ILP runs where it pays: small instances whose greedy solution is not provably close
        self.max_ilp_vars_nodes = o.max_ilp_vars_nodes
        self.max_ilp_vars_units = o.max_ilp_vars_units
        # how the whole-step candidates are chosen: "predict" (the analytic prediction), "simulate"
        # (the event-driven simulator of planner/sim/simulate.py, which sees ring pipeline waits and
        # NIC contention the prediction approximates), or "auto": simulate when the step is small
        # (at most ``simulate_max_units`` units), where the simulator's cost per candidate is small
        self.select = o.select
        self.simulate_max_units = o.simulate_max_units
        # ILP solves per step shared by every candidate layout (``ilp=always``: no budget)
        self.ilp_budget_calls = o.ilp_budget_calls
        # how a sequence split inside a node runs: "auto" - a zigzag ring or Ulysses (all-to-all to
        # head shards), whichever the cost model prices lower for that sequence; "ring" - always a
        # ring (the published design)
        self.intra = o.intra
        # how a sequence split over whole nodes runs: "auto" - a zigzag ring, or a usp group over the
        # same units where the prediction finds the micro-batch faster (tiered.best_microbatch);
        # "ring" - always a ring (the published design)
        self.inter = o.inter
        # whether stage 1 prices spans over whole nodes as usp groups too (tiered.choose_spans)
        self.usp_spans = o.usp_spans
        # the compute a split for balance may waste (tiered.choose_spans)
        self.split_waste = o.split_waste
        # the whole-step candidate families of families/ (comma list, or "none"), tried on clusters
        # of at most ``families_max_units`` units; beyond, for planning latency, ``large_families``
        self.families = _fam_list(o.families)
        self.families_max_units = o.families_max_units
        self.family_margin = o.family_margin
        # beyond BUILD_ALL_MAX_UNITS units, the families' search (which then costs more than the
        # tiered one) only for steps whose tiered plan leaves more than this share above the bound
        self.family_gap = o.family_gap
        # from 33 to 256 units, node-major first and alone for a step it plans within this share of
        # the bound (step_searches.NEAR_BOUND_MIN_UNITS)
        self.search_gap = o.search_gap
        self.large_families = _fam_list(o.large_families)
        self.attention_max_units = o.attention_max_units
        self.node_cp_max_units = o.node_cp_max_units
        self._sims: dict[int, object] = {}
        self._tiering: dict[int, Tiering] = {}

    # ------------------------------------------------------------------ caches across steps
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

    def _judge(self, ctx: PlanContext):
        """The simulator where it judges the candidates (option ``select``), else None (the prediction)."""
        if self.select == "simulate" or (self.select == "auto" and ctx.num_units <= self.simulate_max_units):
            return self._simulator(ctx)
        return None

    def _confirmer(self, ctx: PlanContext):
        """The function making the simulator that judges or confirms the candidates
        (:func:`.select.select`); None with ``select=predict`` (the prediction alone)."""
        return None if self.select == "predict" else partial(self._simulator, ctx)

    def _mode_judges(self, ctx: PlanContext) -> tuple:
        """How ``--recompute auto`` judges its plans under each mode (:func:`.recompute.plan_step`),
        as ``(score, confirm)``: where :func:`.select.select` judges a step's candidates by the
        simulator or confirms the best by it (clusters of at most ``select.CONFIRM_MAX_UNITS``
        units), the simulator scores every plan; on clusters of at most
        ``select.MODE_CONFIRM_MAX_UNITS`` units the prediction scores them and the simulator confirms
        the close ones; beyond, or with ``select=predict``, the prediction alone. Judged by the
        prediction, one micro-batch with recomputation would win over two without where the
        simulator, which plays out the second micro-batch's waits, ranks them the other way."""
        if self.select == "predict":
            return None, None
        sim = self._simulator(ctx)
        timed = lambda p: sim.simulate_step(p).step_time_s  # noqa: E731
        if self._judge(ctx) is not None or ctx.num_units <= CONFIRM_MAX_UNITS:
            return timed, None
        if ctx.num_units <= MODE_CONFIRM_MAX_UNITS:
            return None, timed
        return None, None

    def _family_names(self, only=None) -> list[str]:
        """The families tried for a step (``only``: of these alone); Ulysses groups need ``intra=auto``."""
        return [f for f in self.families if not (f == "ulysses-groups" and self.intra == "ring")  # rings only
                and (only is None or f in only)]

    # ------------------------------------------------------------------ feasibility
    def check_feasible(self, ctx: PlanContext, sequences: list[Sequence]) -> None:
        tiering = self.tiering(ctx)
        if tiering.cap <= 0:
            c = ctx.cost
            raise PlanningError(
                f"model {ctx.model.name} does not fit on {ctx.cluster.gpu.name}: model states take "
                f"{c.model_state_bytes() / 1e9:.1f} GB of {c.gpu_capacity_bytes / 1e9:.1f} GB usable "
                f"(try {'--zero-stage 3 or ' if ctx.zero_stage < 3 else ''}more GPUs: every GPU keeps whole "
                f"parameters whatever the TP degree)")
        if tiering.min_span(max((s.length for s in sequences), default=0)) is not None:
            return  # (a span holding the longest holds every shorter one)
        for i, s in enumerate(sequences):
            if tiering.min_span(s.length) is None:
                if self._replicas_hold(ctx, sequences):
                    return  # replicas of a larger TP degree hold it (the tp-replicas family plans the step)
                raise PlanningError(
                    f"sequence {i} (sample {s.sample_id}) has {s.length:,} tokens, more than the whole cluster "
                    f"can hold ({tiering.n} units x {tiering.cap:,} tokens = {tiering.n * tiering.cap:,}); "
                    f"lower --max-seq-len or use more GPUs{' / --zero-stage 3' if ctx.zero_stage < 3 else ''}")

    def _replicas_hold(self, ctx: PlanContext, sequences: list[Sequence]) -> bool:
        """Whether the tp-replicas family (on) can hold every sequence of the step."""
        if "tp-replicas" not in self.families or ctx.num_units > self.families_max_units:
            return False
        return families_mod.tp_replicas.replicas_hold(ctx, max(s.length for s in sequences))

    # ------------------------------------------------------------------ main entry
    def plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        # a step on a large cluster allocates very many small containers (groups, placements,
        # ranges) and frees none until it returns: the cyclic collector's passes over them are pure
        # overhead
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            if recompute_mod.chooses(ctx):
                return recompute_mod.plan_step(ctx, step, sequences, self._plan_step, *self._mode_judges(ctx))
            return self._plan_step(ctx, step, sequences)
        finally:
            if gc_was_on:
                # the step's survivors (its plan: tens of thousands of records at scale) go straight
                # to the oldest generation (freeze, then unfreeze): re-enabled, the collector's next
                # young pass would otherwise walk every one of them once, a large share of the
                # step's time on big clusters; cycles among them are still found by the next full
                # collection
                gc.freeze()
                gc.unfreeze()
                gc.enable()

    def _plan_step(self, ctx: PlanContext, step: int, sequences: list[Sequence]) -> StepPlan:
        t0 = time.perf_counter()
        if not sequences:
            raise PlanningError(f"step {step} has no sequences")
        self.check_feasible(ctx, sequences)
        tiering = self.tiering(ctx)
        lengths = np.array([s.length for s in sequences], dtype=np.int64)
        if tiering.min_span(int(lengths.max())) is None:
            return self._oversize_step(ctx, step, sequences, t0)
        state = StepState(options=self, ctx=ctx, tiering=tiering, sequences=sequences, lengths=lengths,
                          ilp_left=self.ilp_budget_calls)
        judge = self._judge(ctx)
        own = search_step(state, step, simulate=judge is not None)
        own, suffices = self._tiered_suffices(ctx, own, lengths, tiering.cap)
        if suffices:
            margin, names = None, []
        elif ctx.num_units <= self.families_max_units:
            margin, names = self.family_margin, self._family_names()
        elif state.node_major_led:
            # node-major micro-batches at scale (step_searches.NODE_MAJOR_FIRST_UNITS): FLOP-share's
            # rings lose to them by 25-30% of the step and cost as much to build
            margin, names = None, []
        else:
            # large clusters: the cheap families only, always built (FLOP-share's own score is coarse
            # where rings span many nodes, so it does not prune)
            margin, names = None, self._family_names(only=self.large_families)
        return select(ctx, step, sequences, own, names, margin=margin, routing=self.routing,
                      simulator=self._confirmer(ctx), simulate_all=judge is not None, t0=t0,
                      wall_hit=state.wall_hit, collector=self.collector)

    def _tiered_suffices(self, ctx: PlanContext, own: list, lengths: np.ndarray, cap: int) -> tuple[list, bool]:
        """Whether the families are not searched for this step: on clusters of more than
        :data:`.select.BUILD_ALL_MAX_UNITS` units, where their searches cost more than the tiered
        one, when the best tiered candidate's plan is predicted within ``family_gap`` of the lower
        bound of the fewest micro-batches of ``cap`` tokens a unit (the context's memory; under
        ``--recompute auto`` each global mode's pass has its own, while the step's bound counts the
        fewest recomputation allows - a plan of the pass in fewer, its units recomputing beyond
        ``cap``, pays that recomputation): what a family could still gain is less than what every
        plan pays above that bound (splits, exposure; docs/BENCHMARKS.md, "Planner latency").
        Returns the candidates (the one built for this hands its plan on) and the verdict."""
        if not own or ctx.num_units <= BUILD_ALL_MAX_UNITS or self.family_gap <= 0:
            return own, False
        best = min(own, key=lambda c: (c.score, c.index))
        try:
            plan = best.build()
        except PlanningError:
            return own, False
        own = [c._replace(build=lambda plan=plan: plan) if c is best else c for c in own]
        L = lengths.astype(np.float64)
        bound = max(lower_bounds(ctx, L, microbatches=forced_microbatches(ctx, L, cap)))
        return own, plan.prediction.step_time_s <= (1 + self.family_gap) * bound

    def _oversize_step(self, ctx: PlanContext, step: int, sequences: list[Sequence], t0: float) -> StepPlan:
        """A step with a sequence longer than the context's units can hold together, planned on
        replicas of a larger tensor-parallel degree (whose model states take less of each GPU)."""
        plan = select(ctx, step, sequences, [], self._family_names(only=("tp-replicas",)), margin=None,
                      routing=self.routing, simulator=self._confirmer(ctx),
                      simulate_all=self._judge(ctx) is not None, t0=t0, collector=self.collector)
        if plan is None:
            raise PlanningError(f"step {step}: no replica layout of a larger tensor-parallel degree holds its "
                                f"longest sequence ({max(s.length for s in sequences):,} tokens)")
        return plan


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
