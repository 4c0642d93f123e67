"""``zeppelin plan --explain``: the tier thresholds of a cluster and model, in tokens per sequence.

Every threshold is a length a sequence of the plan can be compared with: the lengths by tier that
the plan summary prints (:func:`zeppelin.planner.sim.summary.summary_lines`) are in the same unit,
and :func:`plan_against_thresholds` lines the two up once the plan is made.

The ring thresholds are crossovers of the analytic prediction the planner ranks its whole-step
candidates with (:func:`~zeppelin.planner.costmodel.predict.microbatch_terms`), each measured on a
step holding one sequence split over one tier's span (:func:`one_sequence_step`): the simulator
plays the same step out, and tests/planner/test_explain.py holds the two within 10% of each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.sim.summary import PlanSummary
from zeppelin.schemas.plan import StepPlan

__all__ = ["RingCrossover", "explain_text", "hf_modules_note", "moe_note", "one_sequence_step", "plan_against_thresholds",
           "ring_crossover"]

#: a ring "hides" its transfers when its exposed communication is at most this share of its attention time
HIDDEN = 1e-3
_L_MAX = 1 << 24  # search ceiling (16M tokens)


def _wrap(text: str, indent: str = "", width: int = 80) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


def one_sequence_step(ctx: PlanContext, L: int, G: int, tier: str, routed: bool = True) -> StepPlan:
    """A step of one sequence of ``L`` tokens cut zigzag over units ``0 .. G-1`` (``tier``: their
    span, ``intra`` inside node 0, ``inter`` over whole nodes, routed over the nodes' NICs or direct)."""
    from zeppelin.schemas.layout import zigzag_ranges
    from zeppelin.schemas.plan import Group, MicroBatch, Placement, Sequence

    units = list(range(G))
    mb = MicroBatch(groups=[Group(kind="ring", tier=tier, units=units)],
                    placements=[Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(L, G))],
                    queues=[[0] if u < G else [] for u in range(ctx.num_units)])
    if tier == "inter":
        from zeppelin.planner.zeppelin.routing import plan_routes

        mb = mb.model_copy(update={"routes": plan_routes(ctx, mb, enable=routed)})
    return StepPlan(step=0, sequences=[Sequence(sample_id=0, length=int(L))], microbatches=[mb])


def ring_exposure(ctx: PlanContext, L: int, G: int, tier: str, routed: bool = True) -> float:
    """Predicted exposed ring communication of :func:`one_sequence_step` over its attention time
    (the slowest unit of the ring; the step's data-parallel collectives are not counted)."""
    from zeppelin.planner.costmodel.predict import microbatch_terms

    st = one_sequence_step(ctx, L, G, tier, routed)
    t = microbatch_terms(ctx, [int(L)], st.microbatches[0], routed)
    exposed = t.exposed[:G]
    if ctx.tp > 1:  # the units' TP-SP collectives are no part of the ring
        exposed = exposed - ctx.model.num_layers * np.asarray(ctx.cost.tp_exposed_comm(t.tokens[:G]))
    att = float(t.attn[:G].max())
    return float(exposed.max()) / att if att > 0 else 0.0


@dataclass
class RingCrossover:
    """Where a ring over ``G`` units of one tier hides its transfers (lengths in tokens)."""

    G: int
    tier: str
    routed: bool
    #: from this length on every longer sequence hides its transfers (None: none up to the ceiling)
    threshold: int | None
    #: the shortest exposed length (None: no length is exposed); exposed from here to the threshold
    exposed_from: int | None
    #: the largest exposed share of the ring's attention time on the search grid
    worst: float


def ring_crossover(ctx: PlanContext, G: int, tier: str, routed: bool = True) -> RingCrossover:
    """The crossover of :func:`ring_exposure` (checked on a geometric grid, refined by bisection)."""
    lo = 2 * G
    grid = np.unique(np.geomspace(lo, _L_MAX, 56).astype(np.int64))
    ex = np.array([ring_exposure(ctx, int(x), G, tier, routed) for x in grid])
    bad = np.flatnonzero(ex > HIDDEN)
    if not len(bad):
        return RingCrossover(G, tier, routed, lo, None, float(ex.max()))
    if bad[-1] == len(grid) - 1:
        return RingCrossover(G, tier, routed, None, int(grid[bad[0]]), float(ex.max()))

    def refine(a: int, b: int, exposed_at_a: bool) -> int:  # first length of [a, b] on b's side
        while b - a > max(1, a // 1000):
            mid = (a + b) // 2
            if (ring_exposure(ctx, mid, G, tier, routed) > HIDDEN) == exposed_at_a:
                a = mid
            else:
                b = mid
        return b

    th = refine(int(grid[bad[-1]]), int(grid[bad[-1] + 1]), True)
    first = int(grid[0]) if bad[0] == 0 else refine(int(grid[bad[0] - 1]), int(grid[bad[0]]), False)
    return RingCrossover(G, tier, routed, th, first, float(ex.max()))


def _from(label: str, x: RingCrossover) -> list[str]:
    """The tier's line, and where it is exposed below its threshold (second line)."""
    if x.threshold is None:
        return [f"  {label:<44} never (up to 16M tokens)",
                f"      exposed from {x.exposed_from:,} tokens, up to {x.worst:.0%} of attention time"]
    if x.exposed_from is None:
        return [f"  {label:<44} at every length"]
    return [f"  {label:<44} from {x.threshold:,} tokens",
            f"      exposed {x.exposed_from:,} to {x.threshold - 1:,} tokens, up to {x.worst:.0%} of attention time"]


def _why_short_hide(ctx: PlanContext) -> list[str]:
    """What hides a short sequence's transfers: the kernels' fixed costs and small-block efficiency."""
    c = ctx.cost
    f = c._fits
    if f is not None and f.attention is not None:
        curve = "the profile's measured attention fit (its constant term included)"
    else:
        k = c.profile.attention
        curve = (f"the preset curve: {k.overhead_s * 1e6:g} us launch cost per call, efficiency "
                 f"n/(n+{k.n_half:,.0f}) of its peak for blocks of n tokens")
    return _wrap(
        "Short sequences hide their transfers too: a round never computes for less than an attention "
        "kernel's fixed cost, against the link's latency (" + f"{c.intra_link.alpha_s * 1e6:g} us NVLink, "
        f"{c.inter_link.alpha_s * 1e6:g} us NIC), and small blocks run far below peak, so below the "
        "efficiency knee a round's compute grows about linearly with L, like its transfer. Whether such a "
        "ring hides then depends on K/V bytes per token against the kernel's speed on small blocks, not "
        "on L: a model with fewer K/V heads (grouped-query attention) may hide at every length where "
        "one with more does not. Kernel times come from " + curve + ".")


def moe_note(experts: int, top_k: int, width: int = 80) -> list[str]:
    """The limits a mixture-of-experts model of ``experts`` experts, ``top_k`` per token, is planned
    under (``--explain``, ``compare``'s verdict); empty for a dense model (no experts)."""
    if not experts:
        return []
    return _wrap(f"MoE ({experts} experts, top-{top_k}): planned without expert "
                 "parallelism (FSDP shards every expert over the ranks; each rank runs the experts its own "
                 "tokens pick) and with experts evenly loaded (a token costs its top-k experts' FLOPs, each "
                 "expert's GEMMs at an even share of the tokens): skewed routing leaves some experts few "
                 "tokens, whose small GEMMs run slower than predicted (docs/HF.md).",
                 width=width)


def _ring_lines(ctx: PlanContext, tg) -> list[str]:
    """One line per tier: the span, its link, where its ring hides its transfers."""
    c, cl = ctx.cost, ctx.cluster
    out = []
    for g in sorted({2, tg.upn}):
        if 2 <= g <= tg.upn:
            x = ring_crossover(ctx, g, "intra")
            label = f"inside a node, {g} units, {cl.intra_link.kind} {c.intra_link.bandwidth_GBps:g} GB/s:"
            out += _from(label, x)
    if tg.num_nodes < 2:
        return out + ["  across nodes: a single node, no inter-node tier"]
    G, nn = 2 * tg.upn, len(cl.nics)
    one = f"across nodes, {G} units, one NIC ({c.inter_link.bandwidth_GBps:g} GB/s):"
    out += _from(one, ring_crossover(ctx, G, "inter", routed=False))
    if nn > 1:
        routed = f"across nodes, {G} units, routed over {nn} NICs:"
        out += _from(routed, ring_crossover(ctx, G, "inter", routed=True))
        out.append("    (routed: each transfer split over the node's NICs through NVLink proxies)")
    return out


def hf_modules_note(ctx: PlanContext) -> list[str]:
    """Why an ``hf:DIR`` model holds another token count than the runtime's own model of the same
    shape (a preset such as llama3-8b): transformers' RMSNorm keeps its normalised rows in the
    compute dtype, the runtime's own norm in fp32 (:meth:`MemoryCosts.norm_bytes_per_token`)."""
    import dataclasses

    if ctx.model.remap_payload != "qkv":
        return []
    own = dataclasses.replace(ctx, model=ctx.model.model_copy(update={"remap_payload": "hidden"})).cost
    here = ctx.cost
    return _wrap(f"(hf:DIR runs transformers' modules, whose RMSNorm keeps its rows in {ctx.model.dtype}: "
                 f"{here.activation_bytes_per_token / 1e6:.3f} MB per token; the runtime's own model of this "
                 f"shape, e.g. a preset, keeps them in fp32: {own.activation_bytes_per_token / 1e6:.3f} MB, "
                 f"{int(own.token_capacity):,} tokens per unit)", indent="  ")


def explain_text(ctx: PlanContext, split_waste: float | None = None) -> str:
    """The thresholds and how they were derived (the Zeppelin planner's :class:`Tiering`);
    ``split_waste``: the planner's option of that name (None: its default)."""
    from zeppelin.planner.zeppelin.tiering import FREE_COMPUTE, FREE_WASTE, GRANULARITY, Tiering

    waste = FREE_COMPUTE if split_waste is None else split_waste

    tg = Tiering(ctx)
    c, cl, m = tg.cost, ctx.cluster, ctx.model
    mem = tg.memory_thresholds
    gpus = f"{ctx.tp} GPU{'s' if ctx.tp > 1 else ''}"
    lines = [
        f"Tier thresholds for {m.name} on {cl.name} ({cl.num_nodes} nodes x {cl.gpus_per_node} GPUs;",
        f"{tg.n} units of TP-{ctx.tp}, {gpus} each, {tg.upn} per node), in tokens per sequence",
        "",
        (f"Memory (activations after model states, ZeRO stage {ctx.zero_stage}: "
         f"{c.model_state_bytes() / 1e9:.1f} GB states,"),
        f"{c.activation_bytes_per_token / 1e6:.3f} MB per token):",
        f"  one unit holds    {mem['unit']:>11,} tokens: longer sequences are split over units",
        f"  one node holds    {mem['node']:>11,} tokens: longer sequences are split across nodes",
        f"  the cluster holds {mem['cluster']:>11,} tokens: longer sequences cannot be trained",
        *hf_modules_note(ctx),
        "",
        *_wrap("A split hides its ring transfers when each round's compute (attention ~ L^2) covers the "
               "K/V block the next round needs (alpha + 3*KV(L/G)/bandwidth, ~ L). Predicted for one "
               f"sequence of L tokens on the span (exposed: more than {HIDDEN:.1%} of its attention time):"),
        *_ring_lines(ctx, tg),
        "",
        *_why_short_hide(ctx),
        "",
        *_wrap("Per step each sequence takes the smallest span that fits in memory and whose per-unit time "
               "is below the step's balanced per-unit load (total work / units); when the ring hides its "
               f"communication (exposed <= {FREE_WASTE:.0%}) and its smaller blocks cost little (its units "
               f"together compute at most {waste:.0%} more than one unit would; option split_waste), it "
               f"is split further until each piece is at most {GRANULARITY:.0%} of that load. Spans above one "
               "node take whole nodes (inter tier); the rest "
               "stay inside a node (intra tier) or on one unit (local). A plan may also take a whole-step "
               "family (FLOP share, Ulysses groups, replicas of a larger TP degree) when it is faster: its "
               "tiers are counted by the units each group spans, like every plan's, so short sequences "
               "can then be split too."),
    ]
    moe = moe_note(m.num_experts, m.experts_per_token)
    return "\n".join(lines + ([""] + moe if moe else []))


_KIND_WORDS = {"ring": "rings", "ulysses": "Ulysses groups (heads split over the group)",
               "allgather": "all-gather groups", "local": "whole on one unit"}


_FAMILY_WORDS = {"ulysses": "Ulysses groups", "allgather": "all-gather groups"}


def _kinds(counts: PlanSummary, tier: str) -> list[str]:
    """Where a tier holds sequences of several group kinds: one line per kind."""
    ks = sorted((k, v) for (t, k), v in counts.by_kind.items() if t == tier)
    if len(ks) < 2:
        return []
    return [f"    in {_KIND_WORDS.get(k, k)}: {n:,}, {lo:,} to {hi:,}" for k, (n, lo, hi) in ks]


def plan_against_thresholds(ctx: PlanContext, counts: PlanSummary) -> list[str]:
    """The plan's lengths by tier beside the thresholds that bound them (``--explain`` with ``-o``)."""
    from zeppelin.planner.sim.summary import units_line
    from zeppelin.planner.zeppelin.tiering import Tiering

    tg = Tiering(ctx)
    mem = tg.memory_thresholds
    out = ["", "This plan against the thresholds (tokens per sequence):"]
    if counts.unit_tps:
        out.append("  " + units_line(counts.unit_tps))
    lo_hi = counts.lengths
    if "local" in lo_hi:
        line = f"  whole on one unit: {counts.sequences['local']:,} sequences, up to {lo_hi['local'][1]:,}"
        by_tp = counts.local_by_tp
        if len(by_tp) > 1:  # units of several TP degrees: each degree holds its own length
            out.append(line)
            out += [f"    on TP-{tp} units: {n:,}, up to {hi:,} (one holds {int(ctx.cost_for(tp).token_capacity):,})"
                    for tp, (n, hi) in sorted(by_tp.items(), reverse=True)]
        else:
            tp = next(iter(by_tp), ctx.tp)
            out.append(line + f" (one unit holds {int(ctx.cost_for(tp).token_capacity):,})")
    if "intra" in lo_hi:
        a, b = lo_hi["intra"]
        out.append(f"  split inside a node: {counts.sequences['intra']:,} sequences, {a:,} to {b:,} "
                   f"(one node holds {mem['node']:,})")
        out += _kinds(counts, "intra")
    if "inter" in lo_hi:
        a, b = lo_hi["inter"]
        out.append(f"  split across nodes: {counts.sequences['inter']:,} sequences, {a:,} to {b:,}")
        out += _kinds(counts, "inter")
    short = sorted({_FAMILY_WORDS.get(k, k) for (t, k) in counts.by_kind if t != "local" and k != "ring"})
    if short:
        out += _wrap("Sequences below the thresholds are split here because a step took a whole-step "
                     "family (" + ", ".join(short) + "): it splits every sequence of a group, short ones "
                     "included, where that prices the step lower than the tiers.", "  ")
    return out
