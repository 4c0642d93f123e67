"""Remapping between the attention layout and a token-balanced layout for the linear modules.

Attention wants a cost-balanced layout (cost grows with L^2), the linear modules (QKV/O
projections, MLP, embeddings, LM head) want equal tokens per unit (their cost is linear in tokens).
:func:`plan_remap` computes the token-balanced *linear layout* from the attention layout with the
fewest and cheapest moves, and decides whether the remap pays for itself.

Targets
-------
``N`` tokens over ``n`` units: every unit gets ``N // n`` or ``N // n + 1`` tokens; the ``N % n``
extra tokens go to the units holding the most tokens already (this minimises the total surplus
``sum_u max(0, A_u - t_u)``, which is the number of tokens that must move: each extra token given
to a unit above the floor cancels one token of surplus, which no other choice does better).

Transfer matrix (a transportation problem)
------------------------------------------
Surplus units ``s_u = A_u - t_u > 0`` supply, deficit units ``d_v = t_v - A_v > 0`` demand. The
cost of moving a token is 0 if it stays, ``c_intra`` between units of one node, ``c_inter``
between nodes, with ``0 < c_intra < c_inter``. With this two-level cost the greedy below is
optimal:

1. inside every node, match surplus to deficit (north-west corner: any matching works, the
   cost is the same);
2. match what is left across nodes.

Proof: the total moved ``M = sum s_u`` is fixed by the targets, and any feasible plan must move
at least ``X = sum_k max(0, S_k - D_k)`` tokens out of nodes (node ``k``'s net surplus cannot be
absorbed inside it). The greedy moves exactly ``X`` between nodes and ``M - X`` inside nodes, so
its cost ``c_intra (M - X) + c_inter X`` is the minimum. Tokens stay in place wherever possible:
a unit sends only its surplus (the tail of its attention buffer, so its segments stay
contiguous), and each unit sends or receives, never both.

Decision
--------
Predicted saving = ``max_u f(A_u) - max_u f(t_u)`` with
``f(T) = layers * linear_time(T) + head_time(T)`` (the linear modules follow the linear layout,
and so do embeddings and the LM head). Remap cost = ``layers * max(remap_time(m_intra, 'intra'),
remap_time(m_inter, 'inter'))`` where ``m_intra`` is the most tokens one unit moves inside its
node and ``m_inter`` the most tokens one NIC carries between nodes (units sharing a NIC share
it). The remap is enabled only when the saving exceeds the cost.
"""

from __future__ import annotations

from collections import defaultdict

from zeppelin.planner.core.base import PlanContext, PlanningError
from zeppelin.planner.costmodel.predict import remap_link_loads
from zeppelin.schemas.plan import MicroBatch, RemapInfo, Sequence

__all__ = ["attention_layout", "balanced_targets", "merge_segments", "plan_remap", "transfer_matrix"]


def balanced_targets(held: list[int]) -> list[int]:
    """Token target per unit: ``N // n`` or one more, the extras to the units holding the most."""
    n = len(held)
    total = sum(held)
    q, r = divmod(total, n)
    t = [q] * n
    for u in sorted(range(n), key=lambda u: (-held[u], u))[:r]:
        t[u] += 1
    return t


def transfer_matrix(held: list[int], targets: list[int], units_per_node: int) -> list[tuple[int, int, int]]:
    """Minimum-cost moves ``(src, dst, tokens)`` from ``held`` to ``targets`` (see module docstring)."""
    supply = {u: held[u] - targets[u] for u in range(len(held)) if held[u] > targets[u]}
    demand = {u: targets[u] - held[u] for u in range(len(held)) if held[u] < targets[u]}
    moves: list[tuple[int, int, int]] = []

    def match(srcs: list[int], dsts: list[int]) -> None:
        i = j = 0
        while i < len(srcs) and j < len(dsts):
            a, b = srcs[i], dsts[j]
            x = min(supply[a], demand[b])
            if x > 0:
                moves.append((a, b, x))
                supply[a] -= x
                demand[b] -= x
            if supply[a] == 0:
                i += 1
            if demand[b] == 0:
                j += 1

    by_node_s: dict[int, list[int]] = defaultdict(list)
    by_node_d: dict[int, list[int]] = defaultdict(list)
    for u in sorted(supply):
        by_node_s[u // units_per_node].append(u)
    for u in sorted(demand):
        by_node_d[u // units_per_node].append(u)
    for k in sorted(by_node_s):
        match(by_node_s[k], by_node_d.get(k, []))
    match([u for u in sorted(supply) if supply[u] > 0], [u for u in sorted(demand) if demand[u] > 0])
    return moves


def merge_segments(segs: list[list[int]]) -> list[list[int]]:
    """Drop empty segments and merge consecutive ones that continue each other."""
    out: list[list[int]] = []
    for q, s, e in segs:
        if e <= s:
            continue
        if out and out[-1][0] == q and out[-1][2] == s:
            out[-1][2] = e
        else:
            out.append([q, s, e])
    return out


def _take_tail(segs: list[list[int]], x: int) -> tuple[list[list[int]], list[list[int]]]:
    """Split a buffer into (kept head, last ``x`` tokens), both as segment lists in order."""
    kept = [list(s) for s in segs]
    tail: list[list[int]] = []
    while x > 0:
        q, s, e = kept[-1]
        take = min(x, e - s)
        tail.insert(0, [q, e - take, e])
        if take == e - s:
            kept.pop()
        else:
            kept[-1][2] = e - take
        x -= take
    return kept, tail


def _take_head(segs: list[list[int]], x: int) -> tuple[list[list[int]], list[list[int]]]:
    """Split ``segs`` into (first ``x`` tokens, rest)."""
    head: list[list[int]] = []
    rest = [list(s) for s in segs]
    while x > 0:
        q, s, e = rest[0]
        take = min(x, e - s)
        head.append([q, s, s + take])
        if take == e - s:
            rest.pop(0)
        else:
            rest[0][1] = s + take
        x -= take
    return head, rest


def plan_remap(ctx: PlanContext, sequences: list[Sequence], mb: MicroBatch,
               enable: bool = True) -> tuple[list[list[list[int]]] | None, RemapInfo]:
    """The token-balanced linear layout of a micro-batch and the decision to use it.

    Returns ``(layout, info)``: ``layout`` is, per unit, ``[seq, start, end]`` segments (kept
    tokens first in attention order, then received ones; adjacent ranges merged), or ``None``
    when the remap is skipped; ``info`` records the decision and its numbers.
    """
    n = ctx.num_units
    if len(mb.queues) != n:
        raise PlanningError(f"micro-batch has {len(mb.queues)} queues for {n} units")
    for p in mb.placements:
        if not 0 <= p.seq < len(sequences):
            raise PlanningError(f"placement names sequence {p.seq} but the step has {len(sequences)}")
    ng = len(mb.groups)
    for u, q in enumerate(mb.queues):
        for g in q:
            if not 0 <= g < ng or u not in mb.groups[g].units:
                raise PlanningError(f"unit {u} queues group {g} it is not a member of")
    if not enable:
        return None, RemapInfo(enabled=False, reason="remapping disabled by the planner options")
    att = [merge_segments(segs) for segs in mb.attention_layout(n)]
    held = [sum(e - s for _, s, e in segs) for segs in att]
    if sum(held) == 0:
        return None, RemapInfo(enabled=False, reason="the micro-batch holds no tokens")
    targets = balanced_targets(held)
    per_node = ctx.units_per_node
    moves = transfer_matrix(held, targets, per_node)
    if not moves:
        return None, RemapInfo(
            enabled=False,
            reason=f"the attention layout is already token-balanced ({max(held)} tokens at most per unit)",
            predicted_saving_s=0.0,
        )
    cost = ctx.cost
    layers = ctx.model.num_layers

    def lin(tokens: list[int]) -> float:
        f = layers * cost.linear_time(tokens) + cost.head_time(tokens)
        return float(f.max())

    saving = lin(held) - lin(targets)
    moved = sum(x for _, _, x in moves)
    moved_inter = sum(x for a, b, x in moves if a // per_node != b // per_node)
    intra_u, inter_nic = remap_link_loads(ctx, moves)
    m_intra = int(intra_u.max())
    m_inter = max(inter_nic.values(), default=0)
    remap_s = layers * max(float(cost.remap_time(m_intra, "intra")), float(cost.remap_time(m_inter, "inter")))
    numbers = (f"saves {saving * 1e3:.3f} ms of linear-layer imbalance, costs {remap_s * 1e3:.3f} ms "
               f"({moved} tokens moved, {moved_inter} between nodes)")
    if saving <= remap_s:
        return None, RemapInfo(enabled=False, reason=f"remap skipped: it {numbers}",
                               predicted_saving_s=saving)
    # build the layout: senders give the tail of their buffer, receivers append what arrives
    out_of: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for a, b, x in moves:
        out_of[a].append((b, x))
    layout = [list(segs) for segs in att]
    incoming: dict[int, list[list[int]]] = defaultdict(list)
    for a in sorted(out_of):
        kept, tail = _take_tail(att[a], held[a] - targets[a])
        layout[a] = kept
        for b, x in out_of[a]:
            piece, tail = _take_head(tail, x)
            incoming[b].extend(piece)
    for b, segs in incoming.items():
        layout[b] = att[b] + segs
    layout = [merge_segments(segs) for segs in layout]
    return layout, RemapInfo(enabled=True, reason=f"remap enabled: it {numbers}", tokens_moved=moved,
                             tokens_moved_inter=moved_inter, predicted_saving_s=saving)
