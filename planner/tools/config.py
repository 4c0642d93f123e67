"""The options of ``zeppelin plan``, ``compare`` and ``demo``, each declared once.

Every flag of the three commands is a :class:`Flag` here: its spellings, type, default, help and
check. The *planning flags* (:data:`PLANNING`: the inputs, the sampler, the parallel layout and
memory setting, the planner options) are shared by the three commands; a command that wants another
default or help takes a variant (:meth:`Flag.but`) of the one declaration. From these come

* the typed configs :data:`PlanConfig`, :data:`CompareConfig` and :data:`DemoConfig` (pydantic
  models, one field per flag) and their checks, with one-line messages (:meth:`Config.check`);
* the parameters of the three commands (the generator in ``zeppelin.planner.cli.common``; no command
  module declares a planning flag, which ``tests/cli/test_cli_surface.py`` enforces);
* the options each planner gets: a flag that sets a planner option (``--ilp``, ``--time-limit``,
  ...) names it and the ``Options`` class it belongs to (:class:`SetsOption`); a planner takes it
  when its own ``Options`` declares that option, so no planner is recognised by its name.
  ``-O NAME=VALUE`` (``plan``) and ``-O PLANNER.NAME=VALUE`` (``compare``, ``demo``) set any other
  option, typed and checked by the planner's ``Options``.

This module imports nothing heavy: the command line builds its parameters from it at start-up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from pydantic import BaseModel, ConfigDict, create_model

from zeppelin.planner.core.options import PlannerOptions
from zeppelin.planner.tools.demo import DEMO_STAGES
from zeppelin.planner.zeppelin.options import ZeppelinOptions
from zeppelin.schemas.common import (
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    MAX_WORKERS,
    InputError,
    check_float,
    check_int,
)
from zeppelin.schemas.plan import OVERFLOW_MODES, RECOMPUTE_MODES, ZERO_STAGES

__all__ = ["COMMANDS", "PLANNING", "CompareConfig", "Config", "DemoConfig", "Flag", "PlanConfig", "SetsOption",
           "config_model"]


def _or(values) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


@dataclass(frozen=True)
class SetsOption:
    """A flag that sets planner option ``name`` of every planner whose ``Options`` declares it (and,
    with ``owner``, derives from that class). ``always``: passed at its default too (the plan header
    then records it); else only when the flag's value is not its default."""

    name: str
    owner: type[PlannerOptions] | None = None
    always: bool = False

    def applies_to(self, options: type[PlannerOptions]) -> bool:
        return self.name in options.names() and (self.owner is None or issubclass(options, self.owner))


@dataclass(frozen=True)
class Flag:
    """One command-line option: the config field ``name`` and its declaration."""

    name: str
    flags: tuple[str, ...]          # the long name first
    kind: type                      # str, int, float, bool (a switch, off by default) or Path
    default: Any                    # ...: required
    help: str
    choices: tuple | None = None
    lo: float | None = None         # the range (ints: check_int, floats: check_float)
    hi: float | None = None
    lo_open: bool = False
    below: str | None = None        # replaces the message of a value under ``lo`` ({flag}, {lo}, {value})
    metavar: str | None = None
    multiple: bool = False          # repeatable: a list of strings
    hidden: bool = False            # an old spelling kept for one release
    eager: bool = False             # acts at once and exits (its callback is the command's); no config field
    sets: SetsOption | None = None

    @property
    def flag(self) -> str:
        return self.flags[0]

    def but(self, **changes: Any) -> Flag:
        """This flag with another default, help or range (one command's variant of a shared flag)."""
        return dataclasses.replace(self, **changes)

    @property
    def annotation(self) -> Any:
        if self.multiple:
            return list[str]
        return self.kind if self.default is not None else Optional[self.kind]  # noqa: UP045 (typer reads it)

    def check(self, value: Any) -> None:
        """One-line InputError for a value out of range or not among the choices (None: not given)."""
        if value is None or self.kind is bool or self.multiple:
            return
        if self.choices is not None and value not in self.choices:
            raise InputError(f"{self.flag} must be {_or(self.choices)} (got {value!r})")
        if self.below is not None and value < self.lo:
            raise InputError(self.below.format(flag=self.flag, lo=self.lo, value=value))
        if self.kind is int and self.lo is not None:
            check_int(self.flag, value, int(self.lo), None if self.hi is None else int(self.hi))
        elif self.kind is float and self.lo is not None:
            check_float(self.flag, value, self.lo, self.hi, lo_open=self.lo_open)


def _zeppelin(name: str, flag: str, always: bool = True) -> Flag:
    """A flag that sets a Zeppelin option: its default and help from :class:`ZeppelinOptions`."""
    spec = ZeppelinOptions.spec(name)
    return Flag(name, (flag,), spec.kind, spec.default, f"zeppelin: {spec.help}",
                sets=SetsOption(name, ZeppelinOptions, always))


# ------------------------------------------------------------------ the planning flags
MANIFEST = Flag("manifest", ("--manifest", "-m"), str, None,
                "dataset manifest: file, directory, glob or *.manifest.json (default: the shipped sample)")
CLUSTER = Flag("cluster", ("--cluster", "-c"), str, ...,
               "cluster preset (zeppelin-a, zeppelin-a:4, local-cpu:2x2, ...) or JSON file")
MODEL = Flag("model", ("--model",), str, ..., "model preset (llama-7b, tiny, ...), JSON file or hf:DIR (a Hugging "
             "Face model directory, docs/HF.md)")
PROFILE = Flag("profile", ("--profile",), str, None,
               "cost profile JSON from `zeppelin profile`, or a shipped measured one (h200-measured: one H200, "
               "Llama-3.2-1B's kernels; docs/PROFILING.md) (default: the preset curves of the cluster's GPU)")
FORCE_PROFILE = Flag("force_profile", ("--force-profile",), bool, False,
                     "use --profile even when it was measured on another kind of device or for another model")
LENGTH_FIELD = Flag("length_field", ("--length-field",), str, None,
                    "manifest field/column holding each sample's length (default: length)")
IDS_FIELD = Flag("ids_field", ("--ids-field",), str, None,
                 "manifest field/column holding token-id lists (the length is their count)")
TEXT_FIELD = Flag("text_field", ("--text-field",), str, None,
                  "manifest field/column holding raw text (needs --tokenizer)")
TOKENIZER = Flag("tokenizer", ("--tokenizer",), str, None,
                 "for --text-field: whitespace, bytes or a Hugging Face tokenizer.json (file or directory)")
#: the flags that say how a manifest is read (every command reading one takes them)
FIELD_FLAGS = (LENGTH_FIELD, IDS_FIELD, TEXT_FIELD, TOKENIZER)

TOKENS_PER_STEP = Flag("tokens_per_step", ("--tokens-per-step",), int, None,
                       "token budget of a step (default: what the cluster's activation memory holds at once - a "
                       "GPU's token capacity after model states x the data-parallel units; docs/CONCEPTS.md)",
                       lo=1, hi=MAX_TOKENS)
SEQS_PER_STEP = Flag("seqs_per_step", ("--seqs-per-step",), int, None, "sequences per step", lo=1, hi=2**31)
STEPS = Flag("steps", ("--steps",), int, 10, "number of steps to sample and plan", lo=1, hi=MAX_STEPS)
SEED = Flag("seed", ("--seed",), int, 0, "sampler (shuffle) seed", lo=0, hi=MAX_SEED)
NO_SHUFFLE = Flag("no_shuffle", ("--no-shuffle",), bool, False, "take samples in manifest order")
MAX_SEQ_LEN = Flag("max_seq_len", ("--max-seq-len",), int, None,
                   "longest sequence to train on; longer samples are truncated (default: the longest sample)",
                   lo=1, hi=2**31)
OVERFLOW = Flag("overflow", ("--overflow",), str, OVERFLOW_MODES[0],
                f"longer samples: {_or(OVERFLOW_MODES)}", choices=OVERFLOW_MODES)

TP = Flag("tp", ("--tp",), int, 1, "tensor-parallel degree of a unit", lo=1, hi=256)
ZERO_STAGE = Flag("zero_stage", ("--zero-stage",), int, 1,
                  f"ZeRO stage ({ZERO_STAGES[0]}-{ZERO_STAGES[-1]}) for the memory model", choices=ZERO_STAGES)
RECOMPUTE = Flag("recompute", ("--recompute",), str, "auto",
                 f"auto | {' | '.join(RECOMPUTE_MODES)}: activation recomputation `zeppelin run` will use (sets the "
                 "activation memory per token); auto: zeppelin's planners choose per micro-batch the cheapest "
                 "that fits, the baselines run none", choices=("auto", *RECOMPUTE_MODES))

ILP_NODES = _zeppelin("ilp_nodes", "--ilp-nodes").but(lo=0, below="{flag} must be >= {lo:g} (got {value})")
TIME_LIMIT = Flag("time_limit", ("--time-limit",), float, None,
                  "optional wall-clock safety net per solve, seconds, for the planners that solve ILPs (zeppelin, "
                  "flexsp, hydraulis; off by default: the solvers stop at deterministic limits)",
                  lo=0.0, hi=3600.0, lo_open=True, sets=SetsOption("time_limit"))
ILP = _zeppelin("ilp", "--ilp")
SOLVER = _zeppelin("solver", "--solver")
INTRA = _zeppelin("intra", "--intra")
FAMILIES = _zeppelin("families", "--families", always=False)
OPTION = Flag("option", ("--option", "-O"), str, [], "a planner option, PLANNER.NAME=VALUE (repeatable; "
              "`zeppelin plan --list-options` lists them)", metavar="PLANNER.NAME=VALUE", multiple=True)

#: the flags that describe a planning problem, shared by plan, compare and demo (in this order;
#: the planner-option flags in the order a plan header records the options)
PLANNING = (MANIFEST, CLUSTER, MODEL, PROFILE, FORCE_PROFILE, *FIELD_FLAGS, TOKENS_PER_STEP, SEQS_PER_STEP, STEPS, SEED, NO_SHUFFLE,
            MAX_SEQ_LEN, OVERFLOW, TP, ZERO_STAGE, RECOMPUTE, ILP, ILP_NODES, SOLVER, INTRA, FAMILIES, TIME_LIMIT,
            OPTION)

# ------------------------------------------------------------------ what the commands add
JSON = Flag("json_out", ("--json",), bool, False, "also print the results as JSON (on stdout; the tables then go to "
                                                  "stderr)")
OUTPUT = Flag("output", ("--output", "-o"), Path, None, "write the JSON to this file (the table stays on the terminal)")
WORKERS = Flag("workers", ("--workers", "-j"), int, 0, "worker processes (0: one per CPU)", lo=0, hi=MAX_WORKERS)
PLANNERS = Flag("planners", ("--planners",), str, None, "comma-separated planners (default: all)")
BASELINE = Flag("baseline", ("--baseline",), str, None,
                "the planner closest to what you run today (docs/CONCEPTS.md: te-cp = TransformerEngine/Megatron "
                "CP, ...): the verdict leads with it", metavar="NAME")
PNG = Flag("png", ("--png",), Path, None, "bar charts of step time and speedup")

PLAN_ONLY = (
    OUTPUT.but(help="plan file to write"),
    Flag("planner", ("--planner",), str, "zeppelin", "planner name (zeppelin, zeppelin-no-routing, zeppelin-no-remap, "
                                                     "zeppelin-tiers-only, baselines)"),
    Flag("list_options", ("--list-options",), bool, False, "list every planner's options and exit", eager=True),
    WORKERS.but(default=1, lo=1, help="plan steps in this many processes"),
    Flag("fmt", ("--format",), str, "jsonl", "jsonl (compact) or pretty (readable, diffable)",
         choices=("jsonl", "pretty")),
    Flag("explain", ("--explain",), bool, False, "print the tier thresholds and how they were derived"),
    Flag("save_case", ("--save-case",), str, None, "also write a `zeppelin check` case DIR/NAME.json from these "
         "flags and its golden plan DIR/NAME.plan (README: plan checks in CI)", metavar="DIR/NAME"),
    JSON.but(help="print the summary as JSON"),
    Flag("quiet", ("--quiet", "-q"), bool, False, "no progress bar or summary"),
    Flag("stream", ("--stream",), bool, False, "write each step as soon as it is planned (with PLAN.chain, the "
         "chained digest of every step, removed at the end), for `zeppelin run PLAN --follow`; the finished plan "
         "is the same bytes"),
)
COMPARE_ONLY = (
    PLANNERS, BASELINE, WORKERS, JSON, OUTPUT, PNG,
    # the spellings of the previous release (planner/cli/common.py: DEPRECATED)
    Flag("dataset", ("--dataset", "-d"), str, None, "old spelling of -m/--manifest", hidden=True),
    Flag("steps_n", ("-n",), int, None, "old spelling of --steps", hidden=True),
    Flag("tokens_per_gpu", ("--tokens-per-gpu",), int, None, "old: tokens per step per GPU (use --tokens-per-step)",
         lo=1, hi=MAX_TOKENS, hidden=True),
    Flag("solver_time_limit", ("--solver-time-limit",), float, None, "old spelling of --time-limit",
         lo=0.0, hi=3600.0, lo_open=True, hidden=True),
)
#: zeppelin and the main baselines: TransformerEngine CP as run (te-cp) and tuned per step, static
#: Ulysses, the FLOP-based hybrid, Megatron's dynamic CP, FlexSP and Hydraulis
DEMO_PLANNERS = ("zeppelin", "te-cp", "te-cp-tuned", "ulysses", "hybrid-dp", "megatron-dcp", "flexsp", "hydraulis")
DEMO_ONLY = (
    Flag("stages", ("--stages",), str, ",".join(DEMO_STAGES),
         f"comma-separated stages to run (available: {', '.join(DEMO_STAGES)})"),
    PLANNERS.but(default=",".join(DEMO_PLANNERS), help="planners of the plan stage"),
    BASELINE.but(help="the planner closest to what you run today: the verdict leads with it (docs/CONCEPTS.md)"),
    PNG.but(default=Path("zeppelin-demo.png"),
            help="where the plan stage writes its picture (per-GPU timeline, speedup bars)"),
    WORKERS.but(hi=1024, help="worker processes of the plan stage (0: one per CPU)"),
    JSON,
    OUTPUT.but(help="write the results as JSON to this file"),
)


def _planning(*first: Flag, **variants: Flag) -> tuple[Flag, ...]:
    """:data:`PLANNING` with some flags replaced by a command's variants (by field name), and the
    flags ``first`` placed after the inputs (manifest, cluster, model)."""
    flags = tuple(variants.get(f.name, f) for f in PLANNING)
    return (*flags[:3], *first, *flags[3:])


#: command -> its flags, in the order of its help
COMMANDS: dict[str, tuple[Flag, ...]] = {
    "plan": (*_planning(*PLAN_ONLY[:2], option=OPTION.but(help="a planner option (repeatable; `--list-options` "
                                                               "lists them)", metavar="NAME=VALUE")),
             *PLAN_ONLY[2:]),
    "compare": (*_planning(manifest=MANIFEST.but(help=MANIFEST.help + "; or a synthetic length mix: short, mixed, "
                                                                      "long, longtail"),
                           cluster=CLUSTER.but(default="zeppelin-a:2"), model=MODEL.but(default="llama-7b")),
                *COMPARE_ONLY),
    "demo": (*_planning(cluster=CLUSTER.but(default="zeppelin-a"), model=MODEL.but(default="llama-7b"),
                        steps=STEPS.but(default=2, hi=10_000)), *DEMO_ONLY),
}


# ------------------------------------------------------------------ the typed configs
def default_tokens_per_step(token_capacity: int, num_units: int) -> int:
    """The one default token budget of a step (``--tokens-per-step``'s help)."""
    return max(int(token_capacity) * int(num_units), 1)


class Config(BaseModel):
    """The values of one command's flags, a field per :class:`Flag` of ``COMMANDS[command]``; made
    by :func:`config_model`. :meth:`from_flags` checks every value (one-line InputError)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    command: ClassVar[str] = ""

    @classmethod
    def flags(cls) -> tuple[Flag, ...]:
        return tuple(f for f in COMMANDS[cls.command] if not f.eager)

    @classmethod
    def from_flags(cls, values: dict[str, Any]) -> Config:
        eager = {f.name for f in COMMANDS[cls.command] if f.eager}  # (typer passes them too)
        cfg = cls(**{k: v for k, v in values.items() if k not in eager})
        cfg.check()
        return cfg

    def check(self) -> None:
        for f in self.flags():
            f.check(getattr(self, f.name))

    @property
    def field_flags(self) -> tuple[str | None, ...]:
        """``--length-field``, ``--ids-field``, ``--text-field``, ``--tokenizer`` (how the manifest is read)."""
        return tuple(getattr(self, f.name) for f in FIELD_FLAGS)

    def context(self, cluster: Any, model: Any, profile: Any) -> Any:
        """The planning context of these flags (tp, ZeRO stage, recompute, seed); refused in one line
        when a measured ``--profile`` describes another device or model (unless ``--force-profile``)
        or when the model leaves a GPU no room for activations."""
        from zeppelin.planner.core.base import PlanContext, PlanningError
        from zeppelin.planner.core.inputs import profile_mismatch

        if self.profile is not None and not self.force_profile:
            why = profile_mismatch(profile, self.profile, cluster, self.cluster, model, self.model)
            if why is not None:
                raise InputError(f"{why}; or pass --force-profile to use it anyway")

        try:
            ctx = PlanContext(cluster, model, profile, tp=self.tp, zero_stage=self.zero_stage, seed=self.seed,
                              recompute=self.recompute)
        except ValueError as e:
            raise PlanningError(str(e)) from None
        if ctx.cost.token_capacity < 1:
            raise PlanningError(not_fitting(ctx, self.cluster, self.model))
        return ctx

    def sampler(self, ctx: Any, tokens_per_step: int | None = None) -> Any:
        """The sampler of these flags; without a token or sequence budget, the one default budget."""
        from zeppelin.schemas.plan import SamplerConfig

        tokens = self.tokens_per_step if tokens_per_step is None else tokens_per_step
        if tokens is None and self.seqs_per_step is None:
            if int(ctx.cost.token_capacity) < 1:  # the default budget would be no token at all
                raise InputError(f"model {ctx.model.name} does not fit on cluster {ctx.cluster.name}: no token of "
                                 "activations fits in a GPU's memory beside its share of the weights, so there is no "
                                 "default --tokens-per-step (use more GPUs, a larger --tp or a smaller model)")
            tokens = default_tokens_per_step(ctx.cost.token_capacity, ctx.num_units)
        return SamplerConfig(tokens_per_step=tokens, seqs_per_step=self.seqs_per_step, shuffle=not self.no_shuffle,
                             seed=self.seed, max_seq_len=self.max_seq_len, overflow=self.overflow)

    def beyond_case(self) -> list[str]:
        """The planning flags given (not at their default) that a ``zeppelin check`` case cannot hold."""
        from zeppelin.planner.tools.check import CheckCase

        held = {*CheckCase.model_fields, "manifest", "option", "no_shuffle"}
        planning = {f.name for f in PLANNING}
        return [f.flag for f in self.flags() if f.name in planning and f.name not in held and f.sets is None
                and getattr(self, f.name) != f.default]

    # -------------------------------------------------------------- planner options
    def planner_options(self, planner: str) -> dict[str, Any]:
        """The options ``zeppelin plan`` gives ``planner``: those its flags set, then ``-O NAME=VALUE``."""
        given: dict[str, str] = {}
        for item in self.option:
            name, eq, value = item.partition("=")
            if not eq or not name.strip():
                raise InputError(f"--option must be NAME=VALUE (got {item!r})")
            given[name.strip()] = value
        return self._options_of(planner, given, "")

    def options_by_planner(self, planners: list[str], where: str) -> dict[str, dict[str, Any]]:
        """The options of each of ``planners`` (compare, demo): those the flags set, then
        ``-O PLANNER.NAME=VALUE``; planners left with none are left out. ``where`` names the list."""
        given: dict[str, dict[str, str]] = {}
        for item in self.option:
            key, eq, value = item.partition("=")
            planner, dot, name = key.strip().partition(".")
            if not eq or not dot or not planner or not name:
                raise InputError(f"--option must be PLANNER.NAME=VALUE (got {item!r})")
            if planner not in planners:
                raise InputError(f"--option {key.strip()}: {planner!r} is not among {where} ({', '.join(planners)})")
            given.setdefault(planner, {})[name] = value
        out = {p: self._options_of(p, given.get(p, {}), f"{p}.") for p in planners}
        return {p: o for p, o in out.items() if o}

    def _options_of(self, planner: str, given: dict[str, str], prefix: str) -> dict[str, Any]:
        """The options of one planner: the flags that set one its ``Options`` declares (in their
        order), then ``given`` (typed by its ``Options``; an option with a flag of its own is refused)."""
        from zeppelin.planner.core import registry  # noqa: F401 (imports every planner module: they register)
        from zeppelin.planner.core.base import PLANNERS, get_planner

        if planner not in PLANNERS:
            get_planner(planner)  # the one-line refusal naming the known planners
        options = PLANNERS[planner].Options
        out: dict[str, Any] = {}
        for f in self.flags():
            if f.sets is not None and f.sets.applies_to(options):
                if f.sets.name in given:
                    raise InputError(f"--option {prefix}{f.sets.name}: use {f.flag}")
                value = getattr(self, f.name)
                if f.sets.always or value != f.default:
                    out[f.sets.name] = value
        if given:
            typed = options.parse(planner, given)
            out.update({k: getattr(typed, k) for k in given})
        return out


def not_fitting(ctx: Any, cluster: str, model: str) -> str:
    """Why ``model`` leaves no GPU of ``cluster`` room for a token, and the flags that would make room
    (only those that do: a ZeRO stage, a TP degree within a node, recompute)."""
    from zeppelin.planner.core.base import PlanContext

    cost = ctx.cost
    states, room = cost.model_state_bytes() / 1e9, cost.gpu_capacity_bytes / 1e9
    units = ctx.num_units
    why = (f"model {model} does not fit cluster {cluster}: its model states take {states:.1f} GB of a GPU's "
           f"{room:.1f} GB (ZeRO stage {ctx.zero_stage}, tp {ctx.tp}, {units} data-parallel unit(s)), leaving "
           f"no room for activations")
    tries = [("--zero-stage 3", {"zero_stage": 3})] if ctx.zero_stage < 3 else []
    tp = ctx.tp * 2
    while tp <= ctx.cluster.gpus_per_node:
        tries.append((f"--tp {tp}", {"tp": tp}))
        tp *= 2
    tries += [(f"{'--zero-stage 3 ' if ctx.zero_stage < 3 else ''}--tp {t}", {"zero_stage": 3, "tp": t})
              for _, k in tries if (t := k.get("tp"))]
    setting = {"tp": ctx.tp, "zero_stage": ctx.zero_stage, "recompute": ctx.recompute}
    for flags, change in tries:
        try:
            other = PlanContext(ctx.cluster, ctx.model, ctx.profile, seed=ctx.seed, **{**setting, **change})
        except ValueError:
            continue
        if other.cost.token_capacity >= 1:
            return f"{why}; {flags} leaves {other.cost.token_capacity:,} tokens per GPU"
    return f"{why}; no ZeRO stage or TP degree within a node makes room: use a cluster with more GPUs or more memory"


def config_model(command: str) -> type[Config]:
    """The typed config of ``command``: a pydantic model with a field per flag of ``COMMANDS[command]``."""
    fields = {f.name: (f.annotation, f.default) for f in COMMANDS[command] if not f.eager}
    model = create_model(f"{command.capitalize()}Config", __base__=Config, **fields)
    model.command = command
    return model


PlanConfig = config_model("plan")
CompareConfig = config_model("compare")
DemoConfig = config_model("demo")
