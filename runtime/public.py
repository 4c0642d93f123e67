"""The names of the runtime's public API (docs/API.md), declared once: :mod:`zeppelin.runtime.api`
defines them and ``zeppelin.runtime`` re-exports them, loading ``api`` on first use."""

PUBLIC_NAMES = (
    "API_VERSION",
    "IGNORE_INDEX",
    "InputError",
    "PLAN_FORMAT",
    "AttentionContext",
    "MicroBatch",
    "PlanSteps",
    "StepContext",
    "attention",
    "build_step",
    "open_plan",
    "register_hf_attention",
    "to_attention_layout",
    "to_linear_layout",
)
