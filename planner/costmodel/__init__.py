"""The analytic cost model and what is built on it.

``cost``         :class:`CostModel`, the facade of per-unit kernel, communication and memory costs
                 (DESIGN.md section 4), put together from three parts:
``compute``      kernel FLOPs and times (attention, linear modules, head, ring rounds' compute);
``comm``         links, ring exchanges, all-to-alls, remap, data- and tensor-parallel collectives;
``memory``       peak bytes per GPU by component;
``context``      :class:`PlanContext` (cluster + model + profile bound to their cost model) and
                 :class:`PlanningError`;
``predict``      a step plan's per-rank loads and predicted step time, from the cost model;
``profile_fit``  fits a :class:`~zeppelin.schemas.profile.CostProfile` to measurements.
"""
