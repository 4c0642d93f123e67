"""What ``zeppelin run`` can execute, as a check of plan steps (shared by planner, validate and run).

A plan can satisfy every structural invariant (:mod:`.invariants`) and still hold a step the
runtime cannot execute for its model. The planner asks :func:`model_runs_tp` before it makes
tensor-parallel replicas; ``zeppelin validate --model`` and ``zeppelin run`` ask
:func:`step_problem` of every step before step 0, so a plan that passes them runs to its end.

What the runtime executes:

* tensor parallelism (a plan's ``tp`` or a step's replicas of ``tp > 1``) for the runtime's own
  Llama only: a Hugging Face model (``--model hf:DIR``) runs transformers' ``nn.Linear``
  projections unsharded, so its plans are data/sequence/context parallel;
* a TP degree must divide the model's query and key/value head counts (each TP rank holds whole
  heads).

The planner's ModelSpec of ``hf:DIR`` is named ``hf-<model_type>-<digest>``
(:func:`zeppelin.schemas.hf.hf_model_spec`); that name is how a plan records that its model is a
Hugging Face one.
"""

from __future__ import annotations

from .model_spec import ModelSpec

__all__ = ["HF_SPEC_PREFIX", "is_hf_spec", "model_runs_tp", "step_problem"]

HF_SPEC_PREFIX = "hf-"

HF_TP_REASON = "Hugging Face models run plans without tensor parallelism only"


def is_hf_spec(model: ModelSpec) -> bool:
    """Whether a ModelSpec is the planner's spec of an ``hf:DIR`` model."""
    return model.name.startswith(HF_SPEC_PREFIX)


def model_runs_tp(model: ModelSpec, hf: bool | None = None) -> bool:
    """Whether the runtime runs tensor-parallel replicas of this model (``hf``: the run uses a
    Hugging Face model; None: as the spec's name says)."""
    return not (is_hf_spec(model) if hf is None else hf)


def step_problem(header, step, hf: bool | None = None) -> str | None:
    """Why the runtime cannot execute ``step`` of a plan with ``header`` (None: it can). ``hf``: the
    run trains a Hugging Face model (None: as the plan's model name says)."""
    model = header.model
    runs_tp = model_runs_tp(model, hf)
    for u, rep in enumerate(header.replicas(step)):
        if rep.tp == 1:
            continue
        if not runs_tp:
            return f"step {step.step}: replica {u} has tp={rep.tp}; {HF_TP_REASON}"
        if not model.tp_splits_heads(rep.tp):
            return (f"step {step.step}: replica {u} has tp={rep.tp}, which does not divide the model's "
                    f"{model.num_heads} query and {model.num_kv_heads} key/value heads")
    return None
