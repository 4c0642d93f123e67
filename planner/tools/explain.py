"""``zeppelin plan --explain``: the tier thresholds of a cluster and model, in tokens per sequence.

Every threshold is a length a sequence of the plan can be compared with: the lengths by tier that
the plan summary prints (:func:`zeppelin.planner.sim.summary.summary_lines`) are in the same unit,
and :func:`plan_against_thresholds` lines the two up once the plan is made.
"""

from __future__ import annotations

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.sim.summary import PlanSummary

__all__ = ["explain_text", "plan_against_thresholds"]


def _wrap(text: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, 80)


def _from(th: int | None, units: int) -> str:
    if th is None:
        return "never (at no length up to the search ceiling)"
    # below 2G tokens a zigzag split leaves units empty: the crossover is then "any length"
    return f"from {th:,} tokens" + (" (any length)" if th <= 2 * units else "")


def explain_text(ctx: PlanContext) -> str:
    """The thresholds and how they were derived (the Zeppelin planner's :class:`Tiering`)."""
    from zeppelin.planner.zeppelin.tiering import FREE_WASTE, GRANULARITY, Tiering

    tg = Tiering(ctx)
    c, cl, m = tg.cost, ctx.cluster, ctx.model
    s = tg.summary()
    mem = s["memory"]
    lines = [
        f"Tier thresholds for {m.name} on {cl.name} ({cl.num_nodes} nodes x {cl.gpus_per_node} GPUs,",
        f"tp={ctx.tp}: {tg.n} units, {tg.upn} per node), in tokens per sequence",
        "",
        (f"Memory (activations after model states, ZeRO stage {ctx.zero_stage}: "
         f"{c.model_state_bytes() / 1e9:.1f} GB states,"),
        f"{c.activation_bytes_per_token / 1e6:.3f} MB per token):",
        f"  one unit holds    {mem['unit']:>11,} tokens: longer sequences are split over units",
        f"  one node holds    {mem['node']:>11,} tokens: longer sequences are split across nodes",
        f"  the cluster holds {mem['cluster']:>11,} tokens: longer sequences cannot be trained",
        "",
        *_wrap("A split hides its ring transfers when a round's compute attn(L)/G^2 covers the K/V transfer "
               "alpha + 3*KV(L/G)/bandwidth (attention ~ L^2, transfer ~ L): for sequences of L tokens"),
    ]
    bw_i = c.intra_link.bandwidth_GBps
    for g, th in s["intra_hide"].items():
        lines.append(f"  {'inside a node, ' + g + ' units, ' + cl.intra_link.kind + f' {bw_i:g} GB/s:':<45}"
                     f"{_from(th, int(g))}")
    if tg.num_nodes >= 2:
        G = 2 * tg.upn
        bw_n = c.inter_link.bandwidth_GBps
        nn = len(cl.nics)
        eff = bw_n / tg.inter_sharers(nn)
        lines.append(f"  {f'across nodes, {G} units, one NIC ({bw_n:g} GB/s):':<45}"
                     f"{_from(s['inter_hide_one_nic'], G)}")
        lines.append(f"  {f'across nodes, {G} units, routed over {nn} NICs*:':<45}"
                     f"{_from(s['inter_hide_routed'], G)}")
        lines.append(f"  * {eff:.0f} GB/s effective: a NIC carries its node's outgoing and incoming")
        lines.append("    pieces, and each piece pays an NVLink dispatch and combine")
    else:
        lines.append("  across nodes: a single node, no inter-node tier")
    lines += [
        "",
        *_wrap("Per step each sequence takes the smallest span that fits in memory and whose per-unit time "
               "is below the step's balanced per-unit load (total work / units); when the ring hides its "
               f"communication (exposed <= {FREE_WASTE:.0%}), it is split further until each piece is at most "
               f"{GRANULARITY:.0%} of that load. Spans above one node take whole nodes (inter tier); the rest "
               "stay inside a node (intra tier) or on one unit (local). A plan may also take a whole-step "
               "family (FLOP share, Ulysses groups) when it is faster: its tiers are counted by the units "
               "each group spans, like every plan's."),
    ]
    return "\n".join(lines)


def plan_against_thresholds(ctx: PlanContext, counts: PlanSummary) -> list[str]:
    """The plan's lengths by tier beside the thresholds that bound them (``--explain`` with ``-o``)."""
    from zeppelin.planner.zeppelin.tiering import Tiering

    tg = Tiering(ctx)
    s = tg.summary()
    mem = s["memory"]
    out = ["This plan against the thresholds (tokens per sequence):"]
    lo_hi = counts.lengths
    if "local" in lo_hi:
        out.append(f"  whole on one unit: {counts.sequences['local']:,} sequences, up to {lo_hi['local'][1]:,} "
                   f"(one unit holds {mem['unit']:,})")
    if "intra" in lo_hi:
        a, b = lo_hi["intra"]
        out.append(f"  split inside a node: {counts.sequences['intra']:,} sequences, {a:,} to {b:,} "
                   f"(one node holds {mem['node']:,})")
    if "inter" in lo_hi:
        a, b = lo_hi["inter"]
        th = s.get("inter_hide_routed")
        out.append(f"  split across nodes: {counts.sequences['inter']:,} sequences, {a:,} to {b:,}")
        if th is not None:
            out.append(f"    (transfers hidden from {th:,}, routed over {len(ctx.cluster.nics)} NICs)")
    return out
