"""The checks a rank makes before any collective: the plan against the job, ``--model`` and
``--data``; and each step's before it runs. Every refusal is one line (:class:`InputError`)."""

from __future__ import annotations

from zeppelin.schemas.common import InputError, content_hash
from zeppelin.schemas.plan import PlanReader, StepPlan, check_embedded_specs, sample_problems

from ..config import RunConfig
from ..data import TokenSource, load_token_source

__all__ = ["startup_checks", "step_checks"]


def startup_checks(cfg: RunConfig, world_size: int, rank: int = 0) -> tuple[PlanReader, TokenSource, int, int]:
    """Everything a rank can decide alone, before any collective. Returns
    (reader, token source, first step, end step). Raises InputError.

    ``--follow``: the plan is read while it is written (:class:`zeppelin.schemas.io.stream.FollowReader`);
    the checks of each step (:func:`step_checks`) then run when it arrives, before it runs."""
    from zeppelin.schemas.io.stream import open_plan_reader, waiting_line

    cfg.check()  # the options' own bounds (a config may have been changed since it was made)
    reader = open_plan_reader(cfg.plan, follow=cfg.follow, digest=cfg.plan_digest,
                              on_wait=waiting_line if rank == 0 else None, wait_s=cfg.timeout_s)
    header = reader.header
    check_embedded_specs(reader)
    if header.world_size != world_size:
        raise InputError(f"the plan is for {header.world_size} ranks but the job has {world_size} "
                         f"(launch with --nproc-per-node/--nnodes giving {header.world_size} processes)")
    if cfg.model is not None:
        from zeppelin.schemas.model import resolve_model_ref

        spec = resolve_model_ref(cfg.model)
        if spec.attention_pattern() != header.model.attention_pattern():
            raise InputError(f"--model {cfg.model} runs {spec.attention_pattern()} attention but the plan was made for "
                             f"{header.model.attention_pattern()} attention (plan it for this model)")
        if content_hash(spec) != header.hashes.model:
            raise InputError(f"--model {cfg.model} does not match the plan: the plan was made for model "
                             f"{header.model.name!r} (hash {header.hashes.model}, given {content_hash(spec)})")
    own = header.model
    if (cfg.model is None or not cfg.model.startswith("hf:")) and (
            own.sliding_window is not None or own.is_moe or own.qk_norm or own.head_size is not None):
        raise InputError(f"the plan's model {own.name!r} ({own.attention_pattern()} attention"
                         f"{', mixture of experts' if own.is_moe else ''}) runs through transformers: pass "
                         "--model hf:DIR (the runtime's own model is a dense full-attention Llama)")
    if cfg.model is not None and cfg.model.startswith("hf:") and header.tp > 1:
        raise InputError(f"the plan uses tensor parallelism (tp={header.tp}); Hugging Face models run "
                         "data/sequence/context-parallel plans only (plan with --tp 1)")
    if header.tp > header.model.num_heads:
        raise InputError(f"the plan's tensor-parallel degree tp={header.tp} exceeds the model's "
                         f"{header.model.num_heads} attention heads")
    if cfg.export:
        from zeppelin.runtime.hf import export_problem

        why = export_problem(cfg.model, header.model)
        if why:
            raise InputError(why)
    if cfg.data is None and header.manifest.token_ids:
        raise InputError(f"the plan was made from a manifest with token ids ({header.manifest.path}); pass it "
                         "with --data (without it the run would train on synthetic ids)")
    try:
        source, mhash = load_token_source(header.model.vocab_size, header.seed, cfg.data, cfg.data_fields)
    except InputError as e:
        if " not found" not in e.problem or any(cfg.data_fields.values()):
            raise
        raise InputError(f"{e.problem}; read --data with the field flags `zeppelin plan` took (--length-field, "
                         f"--ids-field, or --text-field with --tokenizer)", source=e.source) from None
    if cfg.data is not None and mhash is not None and mhash != header.hashes.manifest:
        raise InputError(f"--data {cfg.data} does not match the plan: the plan was made for manifest hash "
                         f"{header.hashes.manifest}, this one hashes to {mhash}")
    cfg.check_plan(header)  # --steps within the plan, --zero-stage and --recompute as planned
    end = header.num_steps if cfg.steps is None else cfg.steps
    if not cfg.follow:  # every step runs here: checked before step 0
        for k in range(end):
            step_checks(cfg, reader, source, reader.step(k))
    if cfg.hsdp is not None and world_size % cfg.hsdp:
        raise InputError(f"--hsdp {cfg.hsdp} must divide the world size {world_size}")
    cfg.check_inputs(reader, end)  # weights, positions, --export, the metrics file against every input
    return reader, source, 0, end


def step_checks(cfg: RunConfig, reader: PlanReader, source: TokenSource, step: StepPlan, *,
                following: bool = False) -> None:
    """The checks of one step before it runs: the runtime executes it for the model
    (:mod:`zeppelin.schemas.runnable`) and every sample it names is in the manifest (never
    synthetic tokens instead)."""
    from zeppelin.schemas.hf import is_hf_ref
    from zeppelin.schemas.runnable import step_problem

    why = step_problem(reader.header, step, is_hf_ref(cfg.model))
    if why:
        raise InputError(f"zeppelin run cannot execute {why}" + ("" if following else " (nothing was run)"),
                         source=reader.path)
    lengths = getattr(getattr(source, "manifest", None), "lengths", None)
    if lengths is not None:
        probs = sample_problems(step, lengths)
        if probs:
            raise InputError(f"--data {cfg.data}: {probs[0]}")
