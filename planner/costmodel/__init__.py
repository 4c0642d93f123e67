"""The analytic cost model and what is built on it.

``cost``         per-unit kernel, communication and memory costs (docs/DESIGN.md, "Cost model");
``context``      :class:`PlanContext` (cluster + model + profile bound to their cost model) and
                 :class:`PlanningError`;
``predict``      a step plan's per-rank loads and predicted step time, from the cost model;
``profile_fit``  fits a :class:`~zeppelin.schemas.profile.CostProfile` to measurements.

:class:`~zeppelin.planner.costmodel.cost.CostModel` is a facade over three parts, one mixin each:
``compute`` (kernel FLOPs and times, the compute of ring rounds), ``comm`` (links, ring exchanges,
all-to-alls, remap, data- and tensor-parallel collectives) and ``memory`` (peak bytes per GPU by
component).
"""
