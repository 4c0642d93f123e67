"""The options of the Zeppelin planner and its ablations (:class:`ZeppelinOptions`).

The single source of their names, types, ranges, defaults and help: the planner, ``zeppelin plan
--list-options`` and the ``zeppelin plan`` flags that set them (``--ilp``, ``--ilp-nodes``,
``--time-limit``, ``--solver``, ``--intra``, ``--families``) read them from here. The families
named by ``families`` / ``large_families`` are checked against ``families.py`` by the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeppelin.planner.core.options import PlannerOptions, option
from zeppelin.planner.zeppelin.tiering import FREE_COMPUTE

# Deterministic ILP work per step: at most ILP_SOLVES packing ILPs, each stopped after ILP_NODES
# branch-and-bound nodes (the same plan on any machine, under any load)
ILP_SOLVES = 1
ILP_NODES = 10

_LIMITS = "solver node and iteration limits must be >= 0"


def _time_limit_error(value: float) -> Exception:
    from zeppelin.planner.costmodel.context import PlanningError

    return PlanningError(f"--time-limit must be positive (got {value:g})")


@dataclass(frozen=True)
class ZeppelinOptions(PlannerOptions):
    ilp: str = option(str, "auto", "where the packing ILP runs: auto (where it pays), always, never",
                      choices=("auto", "always", "never"))
    ilp_nodes: int = option(int, ILP_NODES, "branch-and-bound nodes per ILP solve (a deterministic limit: the "
                            "same plan on any machine, under any load)", minimum=0, error=_LIMITS)
    ilp_iterations: int = option(int, 20000, "simplex iterations per ILP solve (a deterministic limit)",
                                 minimum=0, error=_LIMITS)
    ilp_budget_calls: int = option(int, ILP_SOLVES, "ILP solves per step, shared by every candidate layout "
                                   "(ilp=always: no budget)", minimum=0)
    time_limit: float | None = option(float, None, "optional wall-clock safety net per ILP solve, seconds (off by "
                                      "default; a step that hits it is marked non-reproducible)", above=0.0,
                                      error=_time_limit_error)
    solver: str = option(str, "highs", "ILP solver: highs (CBC as fallback) or cbc", choices=("highs", "cbc"))
    tol: float = option(float, 0.01, "relative tolerance of the packing: a greedy solution this close to its "
                        "lower bound needs no ILP, and units may lose this share of a step waiting for partners", minimum=0.0)
    max_ilp_vars_nodes: int = option(int, 600, "largest node-level packing (variables) the ILP is tried on",
                                     minimum=0)
    max_ilp_vars_units: int = option(int, 400, "largest unit-level packing (variables) the ILP is tried on",
                                     minimum=0)
    select: str = option(str, "auto", "how whole-step candidates are chosen: predict (the analytic prediction), "
                         "simulate (the event-driven simulator), auto (simulate on at most simulate_max_units "
                         "units)", choices=("auto", "predict", "simulate"))
    simulate_max_units: int = option(int, 16, "select=auto: the largest cluster (units) the simulator judges",
                                     minimum=0)
    intra: str = option(str, "auto", "how a sequence split inside a node runs: auto (zigzag ring or Ulysses "
                        "all-to-all, whichever the cost model prices lower) or ring (rings only, as published)",
                        choices=("auto", "ring"))
    inter: str = option(str, "auto", "how a sequence split over whole nodes runs: auto (a zigzag ring, or a usp "
                        "group - Ulysses rows inside the nodes, a ring of rows - where the prediction finds it "
                        "faster) or ring (rings only, as published)", choices=("auto", "ring"))
    usp_spans: str = option(str, "on", "with inter=auto, stage 1 prices a span over whole nodes as the cheaper of a "
                            "ring and a usp group and keeps the nodes of the sequences it gives one free of rings "
                            "(on), or as a ring (off: a layout's rings still run as usp groups where faster)",
                            choices=("on", "off"))
    split_waste: float = option(float, FREE_COMPUTE, "stage 1 splits a sequence further for balance only where its "
                                "units together spend at most this share more compute on its attention than one unit "
                                "would (a ring's smaller blocks, a Ulysses shard's heads); a micro-batch that nearly "
                                "fills its units' memory, or has fewer sequences than units, splits regardless",
                                minimum=0.0)
    families: str = option(str, "all", "whole-step candidate families beside the tiered search: all, none, or a "
                           "comma list of ulysses-groups, flop-share, tp-replicas, wide-rings, usp-groups, long-blocks")
    families_max_units: int = option(int, 256, "beyond this many units only large_families are built", minimum=0)
    family_margin: float = option(float, 0.05, "a family configuration whose own score is more than this share above "
                                  "the best tiered candidate is not built", minimum=0.0)
    family_gap: float = option(float, 0.05, "on clusters of more than 32 units the families are searched only "
                               "for steps whose best tiered candidate is predicted more than this share above the "
                               "step's lower bound (0: always)", minimum=0.0)
    search_gap: float = option(float, 0.05, "on clusters of 33 to 256 units whose micro-batches are coupled (FSDP), "
                               "node-major's whole-step layouts are searched first, and the micro-batch-major ones "
                               "only for steps whose node-major plan is predicted more than this share above the "
                               "step's lower bound (node-CP's only where the tiered plan is too; 0: always)",
                               minimum=0.0)
    large_families: str = option(str, "flop-share", "the families built beyond families_max_units units (same "
                                 "values as families)")
    attention_max_units: int = option(int, 256, "beyond this many units the attention-balanced remap layout is "
                                      "not a candidate", minimum=0)
    node_cp_max_units: int = option(int, 16384, "beyond this many units neither the node-CP layout nor node-major "
                                    "micro-batches are candidates", minimum=0)
