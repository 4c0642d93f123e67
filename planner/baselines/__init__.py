"""The systems zeppelin is compared with, as planners writing the standard plan format.

Every planner here subclasses :class:`zeppelin.planner.core.base.Planner`, registers itself with
:func:`~zeppelin.planner.core.base.register`, and follows its published description (docs/DESIGN.md,
"Published systems") with its best-known setting:

``packed-dp``     :mod:`.packed`        token-balanced packing per unit, every sequence local.
``te-cp``         :mod:`.static_sp`     TransformerEngine / Megatron ring CP: one CP size for the run.
``te-cp-tuned``   :mod:`.static_sp`     the same with the CP size tuned per step.
``llama3-cp``     :mod:`.static_sp`     the same layout with LLaMA-3 all-gather K/V attention.
``ulysses``       :mod:`.static_sp`     DeepSpeed-Ulysses static all-to-all sequence parallelism.
``hybrid-dp``     :mod:`.hybrid_dp`     FLOP-based Hybrid DP (local short sequences, ring CP for the rest).
``megatron-dcp``  :mod:`.megatron_dcp`  Megatron-Core dynamic CP (``BalancedCPScheduler``).
``flexsp``        :mod:`.flexsp`        FlexSP's MILP over heterogeneous Ulysses groups.
``hydraulis``     :mod:`.hydraulis`     Hydraulis' heterogeneous replicas + two-stage assignment.
``usp``           :mod:`.usp`           USP (long-context-attention): fixed Ulysses u x ring r groups.

:mod:`.common` holds the step builder and packing helpers they share, :mod:`.milp` the sparse MILP
model FlexSP and Hydraulis solve. Baselines never import the Zeppelin planner.

Boilerplate, alike in several modules on purpose: the import lists of :mod:`.common`'s functions; a
planner's ``Options`` dataclass and class header (``@register``, ``name``, ``Options``,
``description``, and the first lines of ``plan_step``: ``Timer()`` and ``check_capacity``); and the
solver-limit options (``milp_nodes``, ``milp_iterations``, ``time_limit``) that FlexSP and
Hydraulis each declare with their own defaults and help.
"""

from zeppelin.planner.baselines import (  # noqa: F401  (importing a module registers its planners)
    flexsp,
    hybrid_dp,
    hydraulis,
    megatron_dcp,
    packed,
    static_sp,
    usp,
)
