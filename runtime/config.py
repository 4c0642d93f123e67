"""The options of ``zeppelin run``, each declared once.

:class:`RunConfig` holds what every rank needs (``python -m zeppelin.runtime PLAN [options]``) and
:class:`LaunchConfig` what only ``zeppelin run`` itself uses (torchrun's process layout and
rendezvous, the report after the job). Each field is made with :func:`flag`: its command-line
flag, type, default, help and check. From these fields come

* the checks, with one-line messages (:meth:`RunConfig.check`, run when a config is made),
* the parameters of the ``zeppelin run`` command (``zeppelin.planner.cli.run``),
* the worker's command line: :meth:`RunConfig.to_argv` (what the launcher passes to the ranks)
  and :func:`build_parser` (what a rank parses; torchrun can also start ranks by hand).

This module imports nothing heavy (no torch): the command line imports it before any process starts.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from zeppelin.runtime.optim import LR_SCHEDULES
from zeppelin.schemas.common import MAX_SEED, MAX_STEPS, MAX_TIMEOUT_S, InputError, check_float, check_int

__all__ = [
    "DEVICES",
    "DP_MODES",
    "DTYPES",
    "NAN_POLICIES",
    "PROGRESS_MODES",
    "RECOMPUTE_MODES",
    "TP_OVERLAP_MODES",
    "FlagSpec",
    "LaunchConfig",
    "RunConfig",
    "build_parser",
    "flag",
    "flag_specs",
]

PROGRESS_MODES = ("auto", "rich", "plain", "none")
DEVICES = ("auto", "cpu", "cuda")
TP_OVERLAP_MODES = ("none", "slicing", "commfuse")
DP_MODES = ("fsdp", "replicate")
DTYPES = ("fp32", "bf16")
RECOMPUTE_MODES = ("none", "selective", "full", "per-microbatch")
NAN_POLICIES = ("stop", "skip")


def _or(values) -> str:
    values = list(values)
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


@dataclass(frozen=True)
class FlagSpec:
    """One option: the field's name and what :func:`flag` declared."""

    name: str
    flags: tuple[str, ...]       # the first is the long name; empty: the positional argument
    kind: type                   # str, int, float or bool (bool: a switch, off by default)
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    lo: float | None = None      # the range (ints: check_int, floats: check_float)
    hi: float | None = None
    lo_open: bool = False
    path: bool = False           # a file or directory (a Path on the command line, a str here)
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return self.flags[0] if self.flags else self.name.upper()

    @property
    def bound(self) -> str | None:
        """The range :meth:`check` enforces, in words (None: no range)."""
        if self.lo is None or self.kind not in (int, float):
            return None
        if self.kind is int:
            return f"at least {int(self.lo):,}" if self.hi is None else f"{int(self.lo):,} to {int(self.hi):,}"
        low = f"greater than {self.lo:g}" if self.lo_open else f"at least {self.lo:g}"
        return low if self.hi is None else f"{low}, at most {self.hi:g}"

    @property
    def help_text(self) -> str:
        """The help with the range the option accepts (what ``--help`` and docs/RUNTIME.md show)."""
        return self.help if self.bound is None else f"{self.help} ({self.bound})"

    def check(self, value: Any) -> None:
        """One-line InputError for a value out of range or not among the choices (None: not given)."""
        if value is None:
            return
        if self.choices is not None and value not in self.choices:
            raise InputError(f"{self.flag} must be {_or(self.choices)} (got {value!r})")
        if self.kind is int and self.lo is not None:
            check_int(self.flag, value, int(self.lo), None if self.hi is None else int(self.hi))
        elif self.kind is float and self.lo is not None:
            check_float(self.flag, value, self.lo, self.hi, lo_open=self.lo_open)


def flag(default: Any, *flags: str, kind: type, help: str, choices: tuple[str, ...] | None = None,
         lo: float | None = None, hi: float | None = None, lo_open: bool = False, path: bool = False,
         metavar: str | None = None):
    """A field of :class:`RunConfig` / :class:`LaunchConfig` with its command-line declaration.
    ``default`` ``...``: required (the positional plan)."""
    meta = {"flags": flags, "kind": kind, "help": help, "choices": choices, "lo": lo, "hi": hi,
            "lo_open": lo_open, "path": path, "metavar": metavar}
    if default is ...:
        return field(metadata={"flag": meta})
    return field(default=default, metadata={"flag": meta})


def flag_specs(cls) -> tuple[FlagSpec, ...]:
    """The options of a config class, in declaration order (fields without :func:`flag` are internal)."""
    out = []
    for f in fields(cls):
        meta = f.metadata.get("flag")
        if meta is not None:
            out.append(FlagSpec(name=f.name, default=... if f.default is MISSING else f.default, **meta))
    return tuple(out)


#: the options that say how ``--data`` is read (as ``zeppelin plan``'s field flags)
DATA_FIELDS = ("length_field", "ids_field", "text_field", "tokenizer")


@dataclass
class RunConfig:
    """What a rank runs: the plan and the training, checking and output options."""

    plan: str = flag(..., kind=str, help="plan file written by `zeppelin plan`", path=True)
    follow: bool = flag(False, "--follow", kind=bool,
                        help="run a plan `zeppelin plan --stream` is still writing: each step as soon as it is "
                             "written and its chained digest verified (waits for the planner, saying so)")
    plan_digest: str | None = flag(None, "--plan-digest", kind=str, metavar="sha256:HEX",
                                   help="run the plan only if its end record carries this digest (zeppelin run "
                                        "passes the digest of the plan it checked to every rank)")
    model: str | None = flag(None, "--model", kind=str,
                             help="model preset, JSON file or hf:DIR (Hugging Face); must match the plan")
    data: str | None = flag(None, "--data", kind=str, help="dataset manifest (token ids); must match the plan")
    # how --data is read: the field flags `zeppelin plan` took
    length_field: str | None = flag(None, "--length-field", kind=str,
                                    help="--data's field/column holding each sample's length (default: length)")
    ids_field: str | None = flag(None, "--ids-field", kind=str, help="--data's field/column holding token-id lists")
    text_field: str | None = flag(None, "--text-field", kind=str,
                                  help="--data's field/column holding raw text (needs --tokenizer)")
    tokenizer: str | None = flag(None, "--tokenizer", kind=str,
                                 help="for --text-field: whitespace, bytes or a Hugging Face tokenizer.json")
    steps: int | None = flag(None, "--steps", kind=int,
                             help="run the first N steps, 0 to N-1 (default: all; at most the plan's steps)")
    lr: float = flag(1e-3, "--lr", kind=float, help="AdamW learning rate", lo=0.0, hi=10.0, lo_open=True)
    weight_decay: float = flag(0.0, "--weight-decay", kind=float, help="AdamW weight decay (decoupled)",
                               lo=0.0, hi=10.0)
    betas: str = flag("0.9,0.95", "--betas", kind=str, metavar="B1,B2",
                      help="AdamW betas, two numbers in [0, 1) (torch's default is 0.9,0.999)")
    eps: float = flag(1e-8, "--eps", kind=float, help="AdamW epsilon", lo=0.0, hi=1.0, lo_open=True)
    lr_schedule: str = flag("constant", "--lr-schedule", kind=str, choices=LR_SCHEDULES,
                            help="constant | linear | cosine: after the warm-up, the decay from --lr toward --min-lr, "
                                 "which it reaches at step N, the plan's step count (one past its last step, as "
                                 "torch's schedulers count)")
    warmup_steps: int = flag(0, "--warmup-steps", kind=int, metavar="W",
                             help="linear warm-up: step k < W runs at lr * (k+1)/W (W = 1: step 0 at lr, no ramp)",
                             lo=0, hi=MAX_STEPS)
    min_lr: float = flag(0.0, "--min-lr", kind=float,
                         help="the rate a linear or cosine decay reaches at step N, the plan's step count (the last "
                              "step, N-1, runs one decay step above it)", lo=0.0, hi=10.0)
    grad_clip: float | None = flag(None, "--grad-clip", kind=float, metavar="MAX_NORM",
                                   help="clip the global gradient norm (over every shard and rank) to MAX_NORM "
                                        "(default: no clipping)", lo=0.0, hi=1e6, lo_open=True)
    seed: int | None = flag(None, "--seed", kind=int, help="model init seed (default: the plan's seed)",
                            lo=0, hi=MAX_SEED)
    metrics: str | None = flag(None, "--metrics", kind=str, path=True,
                               help="JSON Lines metrics (default: PLAN.metrics.jsonl)")
    tensorboard: str | None = flag(None, "--tensorboard", kind=str, path=True, metavar="DIR",
                                   help="also write the per-step metrics as TensorBoard event files into DIR (needs "
                                        "the tensorboard package)")
    verify: bool = flag(False, "--verify", kind=bool, help="compare every step with a single-process reference")
    verify_tol: float | None = flag(None, "--verify-tol", kind=float,
                                    help="relative tolerance (fp32 1e-5, bf16 2e-2)", lo=0.0, hi=1.0, lo_open=True)
    checkpoint_every: int = flag(0, "--checkpoint-every", kind=int, help="checkpoint every N steps (and at the end)",
                                 lo=0, hi=MAX_STEPS)
    checkpoint_dir: str | None = flag(None, "--checkpoint-dir", kind=str, path=True,
                                      help="directory of the checkpoints")
    resume: bool = flag(False, "--resume", kind=bool, help="continue from the latest checkpoint in --checkpoint-dir")
    timeout_s: float = flag(300.0, "--timeout", kind=float, help="collective / P2P timeout per operation, seconds",
                            lo=0.0, hi=MAX_TIMEOUT_S, lo_open=True)
    verify_timeout_s: float | None = flag(
        None, "--verify-timeout", kind=float, lo=0.0, hi=MAX_TIMEOUT_S, lo_open=True,
        help="with --verify: how long the ranks wait for rank 0's single-process verdict on a step, seconds "
             "(default: max(600, 4 x --timeout))")
    progress: str = flag("auto", "--progress", kind=str, choices=PROGRESS_MODES, help="auto | rich | plain | none")
    device: str = flag("auto", "--device", kind=str, choices=DEVICES, help="auto | cpu | cuda")
    threads: int | None = flag(None, "--threads", kind=int, help="torch threads per rank (default: cores / ranks)",
                               lo=1, hi=1024)
    tp_overlap: str | None = flag(None, "--tp-overlap", kind=str, choices=TP_OVERLAP_MODES,
                                  help="none | slicing | commfuse: TP-SP overlap (default: the plan's)")
    tp_chunks: int = 4  # slices of the slicing overlap mode (not an option)
    dp: str = flag("fsdp", "--dp", kind=str, choices=DP_MODES,
                   help="fsdp (FSDP2 at the plan's ZeRO stage) | replicate (whole model on every rank, one gradient "
                        "all-reduce)")
    zero_stage: int | None = flag(None, "--zero-stage", kind=int, lo=0, hi=3,
                                  help="ZeRO stage (default: the plan's; another needs --zero-stage-override)")
    zero_stage_override: bool = flag(False, "--zero-stage-override", kind=bool,
                                     help="run a plan made for another --zero-stage")
    hsdp: int | None = flag(None, "--hsdp", kind=int, lo=1,
                            help="hybrid sharding: shard inside groups of this many ranks (a node), replicate across "
                                 "them")
    dtype: str | None = flag(None, "--dtype", kind=str, choices=DTYPES,
                             help="fp32 | bf16 compute (default: bf16 on CUDA, fp32 on CPU)")
    recompute: str | None = flag(None, "--recompute", kind=str, choices=RECOMPUTE_MODES,
                                 help="none | selective | full | per-microbatch (default: the plan's; another needs "
                                      "--recompute-override)")
    recompute_override: bool = flag(False, "--recompute-override", kind=bool,
                                    help="run a plan made for another --recompute setting")
    nan_policy: str = flag("stop", "--nan-policy", kind=str, choices=NAN_POLICIES,
                           help="stop | skip: a step whose loss or gradient norm is not finite ends the run "
                                "(stop) or updates nothing (skip)")
    export: str | None = flag(None, "--export", kind=str, path=True, metavar="DIR",
                              help="after the run, write the model as a Hugging Face directory (config.json + "
                                   "safetensors files, one per rank) that transformers' from_pretrained loads")

    def __post_init__(self) -> None:
        for name in ("plan", "metrics", "checkpoint_dir", "export", "tensorboard"):  # paths are kept as text
            v = getattr(self, name)
            if isinstance(v, Path):
                setattr(self, name, str(v))
        self.check()

    def check(self) -> None:
        """The options' own checks (no plan needed): one-line InputError."""
        if self.zero_stage is not None and not 0 <= self.zero_stage <= 3:
            raise InputError(f"--zero-stage must be 0, 1, 2 or 3 (got {self.zero_stage})")
        for spec in flag_specs(RunConfig):
            spec.check(getattr(self, spec.name))
        self.betas_pair  # noqa: B018 (checks --betas)
        if self.min_lr > self.lr:
            raise InputError(f"--min-lr {self.min_lr:g} is above --lr {self.lr:g}")
        if self.follow and self.plan_digest is not None:
            raise InputError("--plan-digest checks a finished plan's end record; a plan run with --follow is "
                             "checked step by step against its chain file instead")
        if self.tensorboard is not None:
            import importlib.util

            self.check_tensorboard_dir()
            if importlib.util.find_spec("tensorboard") is None:
                raise InputError("--tensorboard needs the tensorboard package (pip install tensorboard)")
        if bool(self.text_field) != bool(self.tokenizer):
            raise InputError("--text-field and --tokenizer go together (as `zeppelin plan` took them)")
        if self.data is None and any(getattr(self, f) for f in DATA_FIELDS):
            raise InputError("--length-field, --ids-field, --text-field and --tokenizer say how --data is read: "
                             "pass --data")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise InputError("--checkpoint-every/--resume need --checkpoint-dir")

    @property
    def data_fields(self) -> dict[str, str | None]:
        """How ``--data`` is read (the keywords of ``load_manifest``)."""
        return {"length_field": self.length_field, "tokens_field": self.ids_field, "text_field": self.text_field,
                "tokenizer": self.tokenizer}

    def check_plan(self, header: Any) -> None:
        """The checks against the plan's header: the steps it has, and the settings it was made for
        (:func:`zeppelin.runtime.train.settings.check_planned`)."""
        if self.steps is not None and not 1 <= self.steps <= header.num_steps:
            raise InputError(f"--steps {self.steps} is out of range (the plan has {header.num_steps} steps)")
        from zeppelin.runtime.train.settings import check_planned

        check_planned(self, header)  # --zero-stage and --recompute as planned, or their override

    def input_files(self) -> list[Path]:
        """Every file the run reads: the plan, the model's file(s) (a spec file; every file of an
        ``hf:DIR``), the manifest document, each data shard and the tokenizer. Each is checked to be
        a regular file and noted as an input (:func:`zeppelin.schemas.io.safefiles.note_input`); no output
        of the run may be one of them (same device and inode)."""
        from zeppelin.schemas.io.safefiles import check_input_file

        files = [check_input_file(self.plan, "plan")]
        if self.model is not None:
            from zeppelin.schemas.hf import hf_dir, hf_input_files, is_hf_ref

            if is_hf_ref(self.model):
                files += hf_input_files(hf_dir(self.model))
            elif self.model.lower().endswith(".json") or "/" in self.model:
                files.append(check_input_file(self.model, "model"))
        if self.data is not None:
            from zeppelin.schemas.io.datasets import manifest_files

            files += manifest_files(self.data)
        return files

    def check_inputs(self, reader: Any, end: int) -> list[Path]:
        """The checks of the run's files before any work: usable weights, sequences within the
        model's positions, an export directory that can be made, a metrics file that is no input.
        Returns the input files."""
        from zeppelin.schemas.hf import check_positions, hf_dir, hf_weight_files, is_hf_ref
        from zeppelin.schemas.io.safefiles import check_output, check_writable_dir

        files = self.input_files()
        if is_hf_ref(self.model):
            hf_weight_files(hf_dir(self.model))
            longest = max((s.length for k in range(end) for s in reader.step(k).sequences), default=0)
            check_positions(self.model, longest)
        self.check_export_dir(files)
        check_output(self.metrics_path, files)
        check_writable_dir(self.metrics_path, "the metrics file")
        self.check_outside_checkpoint_dir(self.metrics_path, "the metrics file")
        return files

    def check_outside_checkpoint_dir(self, path: Any, what: str) -> None:
        """An output of the run may not be inside ``--checkpoint-dir`` (a directory zeppelin manages)."""
        import os

        if self.checkpoint_dir is None:
            return
        ck = os.path.realpath(self.checkpoint_dir)
        if os.path.commonpath([ck, os.path.realpath(path)]) == ck:
            raise InputError(f"{what} is inside --checkpoint-dir; name a file outside it", source=path)

    def check_tensorboard_dir(self) -> None:
        """``--tensorboard DIR`` obeys the rule of every output: not over or inside an input (an
        ``hf:DIR`` model directory), not inside ``--checkpoint-dir``, not a link, not a file."""
        import os

        tb = Path(self.tensorboard)
        if os.path.islink(tb):
            raise InputError("--tensorboard is a symbolic link; name a directory", source=tb)
        if tb.exists() and not tb.is_dir():
            raise InputError("--tensorboard names a file, not a directory", source=tb)
        self.check_outside_checkpoint_dir(tb, "--tensorboard")
        from zeppelin.schemas.hf import hf_dir, is_hf_ref

        if self.model is not None and is_hf_ref(self.model):
            model_dir = os.path.realpath(hf_dir(self.model))
            if os.path.commonpath([model_dir, os.path.realpath(tb)]) == model_dir:
                raise InputError(f"--tensorboard is inside the model directory {self.model}, an input; name a "
                                 "directory outside it", source=tb)

    def check_export_dir(self, inputs: Any = ()) -> None:
        """``--export`` names a new or empty directory that can be made: no link, no input, not
        under a file, not inside the checkpoint directory, in a writable directory."""
        import os

        from zeppelin.schemas.io.safefiles import same_file

        if self.export is None:
            return
        ex = Path(self.export)
        for src in inputs:
            if same_file(ex, src):
                other = os.path.abspath(src) != os.path.abspath(ex)
                raise InputError("--export would overwrite an input file" + (f" ({src})" if other else ""),
                                 source=ex)
        if os.path.islink(ex):
            raise InputError("--export is a symbolic link; name a new or empty directory", source=ex)
        if ex.exists() and not ex.is_dir():
            raise InputError("--export: the path exists and is not a directory", source=ex)
        if ex.exists() and any(ex.iterdir()):
            raise InputError("--export: the directory exists and is not empty", source=ex)
        if self.checkpoint_dir is not None:
            ck = os.path.realpath(self.checkpoint_dir)
            if os.path.commonpath([ck, os.path.realpath(ex)]) == ck:
                raise InputError("--export is inside --checkpoint-dir; name a directory outside it", source=ex)
        anc = ex.parent
        while not os.path.lexists(anc) and anc != anc.parent:
            anc = anc.parent
        if not anc.is_dir():
            raise InputError(f"--export cannot be made: {anc} is not a directory", source=ex)
        if not os.access(anc, os.W_OK | os.X_OK):
            raise InputError(f"--export cannot be made: {anc} is not writable", source=ex)

    @property
    def betas_pair(self) -> tuple[float, float]:
        """``--betas B1,B2`` as two floats (one-line InputError when malformed or out of [0, 1))."""
        parts = str(self.betas).split(",")
        try:
            b = tuple(float(x) for x in parts)
        except ValueError:
            b = ()
        if len(b) != 2 or not all(0.0 <= x < 1.0 for x in b):
            raise InputError(f"--betas must be two numbers in [0, 1) separated by a comma, e.g. 0.9,0.95 "
                             f"(got {self.betas!r})")
        return b

    def hyperparameters(self, plan_seed: int | None) -> dict[str, Any]:
        """The training hyperparameters a checkpoint records; ``--resume`` refuses other values."""
        return {"lr": self.lr, "weight_decay": self.weight_decay,
                "seed": plan_seed if self.seed is None else self.seed,
                "betas": list(self.betas_pair), "eps": self.eps, "lr_schedule": self.lr_schedule,
                "warmup_steps": self.warmup_steps, "min_lr": self.min_lr, "grad_clip": self.grad_clip}

    @property
    def metrics_path(self) -> Path:
        """``--metrics``, or ``PLAN.metrics.jsonl`` next to the plan (the plan's stem shortened when the
        name would exceed the 255 bytes a file name may have)."""
        if self.metrics:
            return Path(self.metrics)
        plan = Path(self.plan)
        suffix = ".metrics.jsonl"
        stem = plan.stem.encode()[:255 - len(suffix)].decode(errors="ignore")
        return plan.with_name(stem + suffix)

    def to_argv(self) -> list[str]:
        """The worker's command line for this config (options at their default are left out)."""
        argv = [str(self.plan)]
        for spec in flag_specs(RunConfig):
            value = getattr(self, spec.name)
            if not spec.flags or value is None or value == spec.default:
                continue
            argv += [spec.flag] if spec.kind is bool else [spec.flag, str(value)]
        return argv


def build_parser() -> argparse.ArgumentParser:
    """The worker's argument parser, from :class:`RunConfig`'s fields. Values are checked by
    :meth:`RunConfig.check` (the same messages as ``zeppelin run``), not by argparse."""
    p = argparse.ArgumentParser(prog="python -m zeppelin.runtime",
                                description="Run a zeppelin plan on this rank (start it with torchrun).")
    for spec in flag_specs(RunConfig):
        if not spec.flags:
            p.add_argument(spec.name, help=spec.help_text)
        elif spec.kind is bool:
            p.add_argument(*spec.flags, dest=spec.name, action="store_true", help=spec.help_text)
        else:
            p.add_argument(*spec.flags, dest=spec.name, type=spec.kind, default=spec.default, help=spec.help_text,
                           metavar=spec.metavar or (spec.name.upper() if spec.choices is None else
                                                    "{" + ",".join(spec.choices) + "}"))
    return p


@dataclass
class LaunchConfig:
    """What ``zeppelin run`` itself uses: torchrun's process layout and rendezvous, and the report
    after the job. Never passed to the ranks."""

    nproc_per_node: int | None = flag(None, "--nproc-per-node", kind=int, help="processes on this machine",
                                      lo=1, hi=1024)
    nnodes: int | None = flag(None, "--nnodes", kind=int, help="machines in the job", lo=1, hi=4096)
    node_rank: int | None = flag(None, "--node-rank", kind=int, help="this machine's rank in the job (0 to --nnodes - 1)")
    master_addr: str | None = flag(None, "--master-addr", kind=str, help="address of the machine of rank 0")
    master_port: int | None = flag(None, "--master-port", kind=int, help="port of rank 0's rendezvous",
                                   lo=1, hi=65535)
    rdzv_backend: str | None = flag(None, "--rdzv-backend", kind=str, help="torchrun rendezvous backend")
    rdzv_endpoint: str | None = flag(None, "--rdzv-endpoint", kind=str, help="torchrun rendezvous endpoint")
    rdzv_id: str | None = flag(None, "--rdzv-id", kind=str, help="torchrun rendezvous id")
    report: bool = flag(False, "--report", kind=bool,
                        help="after the job: measured vs predicted time per step and phase, and the prediction error")
    report_json: str | None = flag(None, "--report-json", kind=str, path=True,
                                   help="also write that report as JSON (implies --report)")

    def __post_init__(self) -> None:
        if isinstance(self.report_json, Path):
            self.report_json = str(self.report_json)
        for spec in flag_specs(LaunchConfig):
            spec.check(getattr(self, spec.name))
        if self.node_rank is not None:
            check_int("--node-rank", self.node_rank, 0, (self.nnodes or 1) - 1)
        if self.report_json is not None:
            self.report = True

