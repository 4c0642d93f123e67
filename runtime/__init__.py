"""zeppelin's PyTorch runtime: execute zeppelin plans, in ``zeppelin run`` or in your own loop.

The public API (documented in docs/API.md, versioned by ``API_VERSION``) is re-exported here from
:mod:`zeppelin.runtime.api`:

``open_plan``, ``PlanSteps``, ``StepContext``, ``MicroBatch``, ``AttentionContext``, ``attention``,
``to_attention_layout``, ``to_linear_layout``, ``register_hf_attention``, ``build_step``,
``API_VERSION``, ``PLAN_FORMAT``, ``IGNORE_INDEX``, ``InputError``.

Every other module of this package is private: its names may change in any release. The names are
loaded on first use, so ``import zeppelin.runtime`` stays cheap (no torch import).
"""

from __future__ import annotations

from .public import PUBLIC_NAMES

__all__ = list(PUBLIC_NAMES)


def __getattr__(name: str):
    if name in __all__:
        from . import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
