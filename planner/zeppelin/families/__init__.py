"""The candidate families of the Zeppelin planner beyond its tiered layouts, one module each
(:class:`zeppelin.planner.zeppelin.protocols.Family`), and their registry.

Everything is deterministic (sorted orders, index tie-breaks, no clock). Adding a family: one
module with ``name`` and ``candidates``, and one line in :data:`REGISTRY`. A family imports no other
family: what two share lives in :mod:`.common` (whole-step dispatch over groups, micro-batch bins,
prices) or :mod:`.aligned_rings` (rings on aligned blocks), which are not families. Boilerplate,
alike in every family on purpose: the protocol's ``candidates`` signature and the import list of
the shared functions a family uses.
"""

from __future__ import annotations

from zeppelin.planner.zeppelin.families import (
    flop_share,
    long_blocks,
    tp_replicas,
    ulysses_groups,
    usp_groups,
    wide_rings,
)
from zeppelin.planner.zeppelin.protocols import Family

#: every family by name, in the order the planner tries them (earlier wins ties)
REGISTRY: dict[str, Family] = {f.name: f for f in (ulysses_groups, flop_share, tp_replicas, wide_rings, usp_groups,
                                                long_blocks)}


def names() -> tuple[str, ...]:
    """The registered families' names (the ``families`` option's ``all``)."""
    return tuple(REGISTRY)


def __getattr__(attr: str):
    if attr == "FAMILIES":  # the registered names, read when asked (a family registered later included)
        return names()
    raise AttributeError(attr)
