"""``zeppelin check``: the CI plan regression check against the golden plans in ``plans/``.

A *case* is one JSON file in the checked directory::

    {"cluster": "local-cpu:2x2", "model": "tiny", "dataset": "sample", "planner": "zeppelin",
     "steps": 2, "seed": 0, "tokens_per_step": 32768, "max_seq_len": 8192, "tolerance": 0.03}

``dataset`` is ``sample`` (the manifest shipped with the package), one of the synthetic length
mixes of :mod:`zeppelin.planner.tools.compare` (``short``, ``mixed``, ``long``) or a manifest path
(relative to the case file). Its golden plan is ``NAME.plan`` next to ``NAME.json``, in the pretty
plan format so that ``git diff`` shows what changed.

For every case the check samples the steps, re-plans them, validates every invariant of the new
plan (:func:`zeppelin.planner.tools.validate.step_problems`), simulates the new plan and the golden one
with the current simulator (so a simulator change moves both alike and only the planner is
judged), and fails when

* the new plan is invalid or the planner fails;
* the golden plan was made for other inputs (cluster, model, sampler settings or sequences differ:
  the setting changed and the golden must be rewritten with ``--update``; a changed cost profile
  only adds a note, since both plans are simulated with the current one);
* the new mean simulated step time exceeds the golden's by more than the case's ``tolerance``;
* in a *setting* (cases equal in everything but planner, options and tolerance), the ``zeppelin``
  case's mean simulated step time is above any baseline's (planners not named ``zeppelin*``).

* a step of the new plan (or of the golden) hit a solver's wall-clock safety net (solver status
  ``wall_clock_limit``): its plan depends on the machine's load, so the step is reported as
  non-reproducible rather than compared as if it were the planner's answer;
* with ``--exact``: the new plan is not byte-identical to the golden (plans are deterministic: the
  same inputs give the same bytes on any machine and under any load).

``--update`` rewrites the goldens of the valid cases (atomically) and prints the step time before
and after. Plans carry no wall-clock fields, so an unchanged planner rewrites byte-identical files.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from zeppelin.schemas.common import MAX_SEED, InputError, Strict, format_validation_error
from zeppelin.schemas.io.documents import MAX_DOC_BYTES, parse_json
from zeppelin.schemas.io.safefiles import ManagedDir, note_input
from zeppelin.schemas.plan import OVERFLOW_MODES, RECOMPUTE_MODES, ZERO_STAGES

CASE_SCHEMA = "zeppelin.check-case/1"
SETTING_FIELDS = ("cluster", "model", "dataset", "steps", "seed", "tokens_per_step", "max_seq_len", "tp", "recompute")


#: the fields of the first cases (a saved case writes them all; the later ones only when set)
_FIRST_FIELDS = ("cluster", "model", "dataset", "planner", "options", "steps", "seed", "tokens_per_step",
                 "max_seq_len", "tp", "tolerance", "description")


class CheckCase(Strict):
    """One settings file of ``plans/``."""

    schema_version: str = CASE_SCHEMA
    cluster: str = Field(description="cluster preset (NAME, NAME:N, NAME:NxG) or JSON file")
    model: str = Field(description="model preset or JSON file")
    dataset: str = Field(description="sample, short, mixed, long, longtail or a manifest path")
    planner: str
    options: dict[str, Any] = Field(default_factory=dict, description="planner options")
    steps: int = Field(ge=1, le=64)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    tokens_per_step: int = Field(ge=1, le=2**40)
    max_seq_len: int | None = Field(default=None, ge=1, le=2**31)
    tp: int = Field(default=1, ge=1, le=256)
    zero_stage: int = Field(default=1, ge=ZERO_STAGES[0], le=ZERO_STAGES[-1], description="ZeRO stage of the "
                            "memory model")
    recompute: Literal[("auto", *RECOMPUTE_MODES)] = Field(
        default="auto", description="--recompute (auto: zeppelin's planners choose per micro-batch)")
    overflow: Literal[OVERFLOW_MODES] = Field(default="truncate", description="samples longer than max_seq_len")
    shuffle: bool = Field(default=True, description="draw samples shuffled (false: in manifest order)")
    length_field: str | None = Field(default=None, description="manifest field holding each sample's length")
    ids_field: str | None = Field(default=None, description="manifest field holding token-id lists")
    text_field: str | None = Field(default=None, description="manifest field holding raw text (needs tokenizer)")
    tokenizer: str | None = Field(default=None, description="whitespace, bytes or a tokenizer.json path "
                                  "(relative to the case file)")
    tolerance: float = Field(ge=0, le=10, description="allowed relative increase of the mean step time")
    description: str = ""


_DEFAULTS = {name: f.default for name, f in CheckCase.model_fields.items()}


@dataclass
class Case:
    name: str
    path: Path
    spec: CheckCase

    @property
    def golden(self) -> Path:
        return self.path.with_suffix(".plan")

    @property
    def setting(self) -> tuple:
        return tuple(getattr(self.spec, f) for f in SETTING_FIELDS)


@dataclass
class CaseResult:
    name: str
    planner: str
    tolerance: float
    new_mean_s: float | None = None
    golden_mean_s: float | None = None
    new_times_s: list[float] = field(default_factory=list)
    golden_times_s: list[float] = field(default_factory=list)
    predicted_mean_s: float | None = None
    latency_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    written: bool = False
    unchanged: bool | None = None
    bad_input: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def change(self) -> float | None:
        if self.new_mean_s is None or not self.golden_mean_s:
            return None
        return self.new_mean_s / self.golden_mean_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.name, "planner": self.planner, "tolerance": self.tolerance,
                "new_mean_s": self.new_mean_s, "golden_mean_s": self.golden_mean_s, "change": self.change,
                "new_times_s": self.new_times_s, "golden_times_s": self.golden_times_s,
                "predicted_mean_s": self.predicted_mean_s, "plan_latency_s": self.latency_s,
                "failures": self.failures, "notes": self.notes, "written": self.written,
                "unchanged": self.unchanged}


def regressed(golden_mean: float, new_mean: float, tolerance: float) -> bool:
    """True when ``new_mean`` is worse than ``golden_mean`` by more than ``tolerance`` (relative)."""
    return new_mean > golden_mean * (1.0 + tolerance) * (1.0 + 1e-12)


# ------------------------------------------------------------------ loading
def load_cases(directory: str | os.PathLike, only: list[str] | None = None) -> list[Case]:
    """Every ``*.json`` case of ``directory`` (sorted by name), validated; bad input raises InputError."""
    d = Path(directory)
    if not d.exists():
        raise InputError("directory not found", source=d)
    if not d.is_dir():
        raise InputError("not a directory (zeppelin check takes the directory holding the cases)", source=d)
    files = sorted(d.glob("*.json"))
    if not files:
        raise InputError("no check cases (*.json) in this directory", source=d)
    cases = []
    with ManagedDir(d, "check directory", create=False) as md:  # case files are never read through a link
        raws = [(f, md.read_small(f.name, "check case", limit=MAX_DOC_BYTES)) for f in files]
    for f, raw in raws:
        note_input(f)
        data = parse_json(raw, source=f)
        if not isinstance(data, dict):
            raise InputError(f"expected a JSON object, got {type(data).__name__}", source=f)
        if data.get("schema_version", CASE_SCHEMA) != CASE_SCHEMA:
            raise InputError(f"schema_version {data['schema_version']!r} is not supported (this zeppelin reads "
                             f"{CASE_SCHEMA!r})", source=f)
        try:
            spec = CheckCase.model_validate(data)
        except ValidationError as e:
            raise InputError(f"invalid check case: {format_validation_error(e)}", source=f) from None
        cases.append(Case(f.stem, f, spec))
    if only:
        names = {c.name for c in cases}
        for o in only:
            if o not in names:
                raise InputError(f"no case {o!r} in {d} (cases: {', '.join(sorted(names))})")
        cases = [c for c in cases if c.name in only]
    from zeppelin.planner.core.base import get_planner

    for c in cases:
        try:
            get_planner(c.spec.planner, **c.spec.options)
        except InputError as e:
            raise InputError(str(e), source=c.path) from None
    return cases


def _dataset(case: Case):
    from zeppelin.planner.core.inputs import load_dataset
    from zeppelin.planner.tools.compare import MIXES, mix_dataset

    s = case.spec
    ref = s.dataset
    if ref.removeprefix("mix:") in MIXES:
        return mix_dataset(ref.removeprefix("mix:"))
    # paths (the manifest's, a tokenizer.json's) are relative to the case file
    manifest = None if ref == "sample" else str(_near(case, ref))
    tokenizer = s.tokenizer
    if tokenizer is not None and tokenizer not in ("whitespace", "bytes"):
        tokenizer = str(_near(case, tokenizer))
    return load_dataset(manifest, s.length_field, s.ids_field, s.text_field, tokenizer)


def _near(case: Case, ref: str) -> Path:
    p = Path(ref)
    return p if p.is_absolute() else case.path.parent / p


def case_ref(case: Case, ref: str) -> str:
    """A case's ``cluster`` / ``model`` reference as this process opens it: a file path (``hf:DIR``
    included) is relative to the case's directory, as its manifest path is; a preset name is kept."""
    from zeppelin.planner.core.inputs import _looks_like_file

    hf = ref.startswith("hf:")
    path = ref[3:] if hf else ref
    if not (hf or _looks_like_file(ref)) or os.path.isabs(path) or path.startswith("~"):
        return ref
    return ("hf:" if hf else "") + os.path.join(case.path.parent, path)


def portable_ref(ref: str, directory: Path) -> str:
    """``ref`` as typed on the command line, stored in a case in ``directory`` (:func:`case_ref`
    reverses it): a relative file path is rewritten relative to the case's directory."""
    from zeppelin.planner.core.inputs import _looks_like_file

    hf = ref.startswith("hf:")
    path = ref[3:] if hf else ref
    if not (hf or _looks_like_file(ref)) or os.path.isabs(path) or path.startswith("~"):
        return ref
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(directory))
    if not hf and not _looks_like_file(rel):
        rel = os.path.join(".", rel)  # still a path, not a preset name
    return ("hf:" if hf else "") + rel


def _inputs(case: Case):
    from zeppelin.planner.core.base import PlanContext, PlanningError
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
    from zeppelin.planner.core.sampler import run_max_seq_len, sample_steps
    from zeppelin.schemas.plan import SamplerConfig

    s = case.spec
    try:
        cl = resolve_cluster(case_ref(case, s.cluster))
        md = resolve_model(case_ref(case, s.model))
        ctx = PlanContext(cl, md, resolve_profile(None, cl), tp=s.tp, seed=s.seed, zero_stage=s.zero_stage,
                          recompute=s.recompute)
        ds = _dataset(case)
    except ValueError as e:
        raise PlanningError(str(e)) from None
    cfg = SamplerConfig(tokens_per_step=s.tokens_per_step, seed=s.seed, max_seq_len=s.max_seq_len,
                        shuffle=s.shuffle, overflow=s.overflow)
    ctx.max_seq_len = run_max_seq_len(ds, cfg)
    return ctx, ds, cfg, sample_steps(ds, cfg, s.steps)


def _plan_bytes(header, steps) -> bytes:
    """The golden plan file ``zeppelin check --update`` writes for these records (pretty format)."""
    from zeppelin.schemas.plan import plan_text

    return plan_text(header, steps, "pretty").encode()


def non_reproducible(steps) -> list[str]:
    """'step K (reason)' for every step whose solver hit its wall-clock safety net."""
    from zeppelin.planner.core.solver import WALL_CLOCK

    return [f"step {sp.step}" + (f" ({sp.solver.fallback_reason})" if sp.solver.fallback_reason else "")
            for sp in steps if sp.solver is not None and sp.solver.status == WALL_CLOCK]


# ------------------------------------------------------------------ one case
def run_case(case: Case, update: bool = False, exact: bool = False) -> CaseResult:
    from zeppelin.planner.core.base import get_planner
    from zeppelin.planner.core.driver import make_header
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.planner.tools.validate import step_problems

    s = case.spec
    res = CaseResult(case.name, s.planner, s.tolerance)
    ctx, ds, cfg, step_seqs = _inputs(case)
    planner = get_planner(s.planner, **s.options)
    header = make_header(ctx, planner, ds, cfg, s.steps, planner_options=dict(s.options), created_at="")
    # golden headers name the dataset as the case does (not this checkout's absolute path of it), so
    # that the same case gives the same golden bytes in any clone
    header = header.model_copy(update={"zeppelin_version": "",
                                       "manifest": header.manifest.model_copy(update={"path": s.dataset})})
    plans = []
    t0 = time.perf_counter()
    try:
        for k, seqs in enumerate(step_seqs):
            plans.append(planner.plan_step(ctx, k, seqs))
    except InputError as e:
        res.failures.append(f"{case.name}: planner {s.planner} failed: {e}")
        return res
    res.latency_s = (time.perf_counter() - t0) / s.steps
    for sp in plans:
        probs = step_problems(ctx, header, sp, limit=3)
        if probs:
            res.failures.append(f"{case.name}: invalid plan: {probs[0]}")
            return res
    for what in non_reproducible(plans):
        res.failures.append(f"{case.name}: {what} of the new plan hit the solver's wall-clock safety net: not "
                            f"reproducible (its plan depends on the machine's load; remove the case's time_limit "
                            f"or raise it)")
    sim = Simulator(ctx)
    res.new_times_s = [sim.simulate_step(sp).step_time_s for sp in plans]
    res.new_mean_s = sum(res.new_times_s) / len(res.new_times_s)
    preds = [sp.prediction.step_time_s for sp in plans if sp.prediction is not None]
    res.predicted_mean_s = sum(preds) / len(preds) if len(preds) == len(plans) else None
    if os.path.lexists(case.golden):
        _against_golden(case, res, header, plans, sim, exact)
    elif not update:
        res.failures.append(f"{case.name}: no golden plan {case.golden.name} (create it with "
                            f"`zeppelin check --update`)")
    if update:
        _update_golden(case, res, header, plans)
    return res


def _against_golden(case: Case, res: CaseResult, header, plans: list, sim, exact: bool) -> None:
    """The new plan against the case's golden: stale inputs, a slower mean step, a changed byte."""
    from zeppelin.schemas.plan import PlanReader

    s = case.spec
    try:
        if os.path.islink(case.golden):  # a case directory is managed: its entries are never followed
            raise InputError("a symbolic link, not a file zeppelin wrote (remove it, or rewrite it with `zeppelin "
                             "check --update`)", source=case.golden.name)
        reader = PlanReader(case.golden)
        golden_steps = list(reader)
        gh = reader.header
    except InputError as e:
        res.failures.append(f"{case.name}: unreadable golden plan: {e}")
        return
    stale = _stale(gh, header, golden_steps, plans)
    if not stale and gh.hashes.profile != header.hashes.profile:
        res.notes.append(f"{case.name}: the golden plan was made with another cost profile; both plans "
                         f"are simulated with the current one")
    if stale:
        res.failures.append(f"{case.name}: golden plan {case.golden.name} is stale ({stale}); review the "
                            f"change and run `zeppelin check --update`")
    else:
        res.golden_times_s = [sim.simulate_step(sp).step_time_s for sp in golden_steps]
        res.golden_mean_s = sum(res.golden_times_s) / len(res.golden_times_s)
        if regressed(res.golden_mean_s, res.new_mean_s, s.tolerance):
            res.failures.append(
                f"{case.name}: {s.planner} mean step time {res.new_mean_s * 1e3:.2f} ms is "
                f"{res.change * 100:+.2f}% against the golden {res.golden_mean_s * 1e3:.2f} ms "
                f"(tolerance {s.tolerance * 100:g}%); {_regression_detail(res, gh, header)}")
    # byte for byte: what --update would write against the golden file
    res.unchanged = case.golden.read_bytes() == _plan_bytes(header, plans)
    for what in non_reproducible(golden_steps):
        res.notes.append(f"{case.name}: {what} of the golden plan hit a wall-clock safety net when it was made")
    if exact and not stale and not res.unchanged:
        differ = [sp.step for g, sp in zip(golden_steps, plans)
                  if g.model_dump(mode="json") != sp.model_dump(mode="json")]
        where = f"steps {', '.join(map(str, differ))}" if differ else "the header"
        res.failures.append(f"{case.name}: the new plan is not byte-identical to the golden ({where} "
                            f"differ); plans are deterministic, so the planner changed: review and run "
                            f"`zeppelin check --update`")


def _update_golden(case: Case, res: CaseResult, header, plans: list) -> None:
    """``--update``: the golden's own failures are dropped, and a changed plan is written as the golden."""
    res.failures = [f for f in res.failures if ": golden plan " not in f and ": no golden plan " not in f
                    and ": unreadable golden plan" not in f and " against the golden " not in f
                    and " byte-identical to the golden " not in f]
    if not res.unchanged:
        write_case_file(case.golden, _plan_bytes(header, plans), "golden plan")
        res.written = True
        res.notes = [n for n in res.notes if "another cost profile" not in n]  # the new golden has this one


def write_case_file(path: Path, data: bytes, what: str) -> None:
    """Replace ``path``, an entry of a case directory, with ``data``. The directory is managed like a
    checkpoint directory (:class:`~zeppelin.schemas.io.safefiles.ManagedDir`): a fresh temporary file
    is renamed over the name, so a link there is replaced, never written through; an ``OSError`` is
    one line; SIGTERM / SIGHUP remove the temporary file."""
    from zeppelin.schemas.io.signals import cleanup_signals

    try:
        with ManagedDir(path.parent, "check directory", create=False) as md, cleanup_signals():
            md.write_atomic(path.name, data)
    except OSError as e:
        raise InputError(f"cannot write {what}: {e.strerror or e}", source=path) from None


def _regression_detail(res: CaseResult, golden_header, header) -> str:
    """Which step got worst, by how much, and what differs from the golden's making."""
    worst = max(range(len(res.new_times_s)), key=lambda k: res.new_times_s[k] / res.golden_times_s[k])
    new, old = res.new_times_s[worst], res.golden_times_s[worst]
    text = f"worst step {worst}: {old * 1e3:.2f} -> {new * 1e3:.2f} ms ({(new / old - 1) * 100:+.2f}%); "
    was, now = golden_header.planner_options, header.planner_options
    changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    if changed:
        return text + "planner options changed: " + ", ".join(
            f"{k} {was.get(k, 'default')} -> {now.get(k, 'default')}" for k in changed)
    return text + "same inputs and options: the planner's code changed"


def _stale(gh, header, golden_steps, plans) -> str:
    if gh.planner != header.planner:
        return f"planner {gh.planner!r}, the case says {header.planner!r}"
    for what in ("cluster", "model"):
        if getattr(gh.hashes, what) != getattr(header.hashes, what):
            return f"made for another {what}"
    if gh.tp != header.tp or gh.sampler != header.sampler:
        return "made with other sampler settings"
    if (gh.zero_stage, gh.recompute) != (header.zero_stage, header.recompute):
        return f"made for ZeRO stage {gh.zero_stage} and recompute {gh.recompute}"
    if len(golden_steps) != len(plans):
        return f"{len(golden_steps)} steps, the case has {len(plans)}"
    for g, p in zip(golden_steps, plans):
        if g.sequences != p.sequences:
            return f"the sequences of step {p.step} differ"
    return ""


def _run_case_job(arg: tuple[Case, bool, bool]) -> CaseResult:
    case, update, exact = arg
    try:
        return run_case(case, update, exact)
    except InputError as e:  # inputs of a case that cannot be resolved
        r = CaseResult(case.name, case.spec.planner, case.spec.tolerance)
        r.failures.append(f"{case.name}: bad input: {e}")
        r.bad_input = True
        return r


# ------------------------------------------------------------------ the whole check
@dataclass
class CheckReport:
    results: list[CaseResult]
    beats: list[dict[str, Any]]
    failures: list[str]
    bad_input: list[str]
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"cases": [r.to_dict() for r in self.results], "zeppelin_vs_baselines": self.beats,
                "failures": self.failures, "bad_input": self.bad_input, "wall_s": self.wall_s,
                "passed": not self.failures and not self.bad_input}


def zeppelin_beats(cases: list[Case], results: list[CaseResult]) -> tuple[list[dict[str, Any]], list[str]]:
    """Per setting, the zeppelin case against each baseline case (mean simulated step times)."""
    by = {r.name: r for r in results}
    groups: dict[tuple, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.setting, []).append(c)
    rows, failures = [], []
    for members in groups.values():
        zs = [c for c in members if c.spec.planner == "zeppelin"]
        bases = [c for c in members if not c.spec.planner.startswith("zeppelin")]
        for z in zs:
            zr = by[z.name]
            for b in bases:
                br = by[b.name]
                if zr.new_mean_s is None or br.new_mean_s is None:
                    continue
                ok = zr.new_mean_s <= br.new_mean_s
                rows.append({"zeppelin_case": z.name, "baseline_case": b.name, "baseline": b.spec.planner,
                             "zeppelin_s": zr.new_mean_s, "baseline_s": br.new_mean_s,
                             "speedup": br.new_mean_s / zr.new_mean_s, "ok": ok})
                if not ok:
                    failures.append(f"{z.name}: zeppelin ({zr.new_mean_s * 1e3:.2f} ms) no longer beats "
                                    f"{b.spec.planner} ({br.new_mean_s * 1e3:.2f} ms, case {b.name})")
    return rows, failures


def run_check(directory: str | os.PathLike, update: bool = False, workers: int = 1,
              only: list[str] | None = None, exact: bool = False) -> CheckReport:
    cases = load_cases(directory, only)
    t0 = time.perf_counter()
    jobs = [(c, update, exact) for c in cases]
    if workers <= 1 or len(jobs) <= 1:
        results = [_run_case_job(j) for j in jobs]
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        # the slowest cases first so that the pool finishes together
        order = sorted(range(len(jobs)), key=lambda i: -_weight(cases[i]))
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=mp.get_context(method)) as ex:
            done = list(ex.map(_run_case_job, [jobs[i] for i in order], chunksize=1))
        results = [None] * len(jobs)
        for i, r in zip(order, done):
            results[i] = r
    bad = [f for r in results if r.bad_input for f in r.failures]
    failures = [f for r in results if not r.bad_input for f in r.failures]
    beats, bf = zeppelin_beats(cases, results)
    return CheckReport(results, beats, failures + bf, bad, time.perf_counter() - t0)


# ------------------------------------------------------------------ a case from `zeppelin plan` flags
DEFAULT_TOLERANCE = 0.01


def check_case_flags(target: str | Path, given: list[str], inputs: list) -> None:
    """Refuse ``--save-case`` with flags a check case cannot hold (``given``), or a target that is not
    DIR/NAME."""
    from zeppelin.planner.core.inputs import check_path_writable

    if given:
        raise InputError(f"--save-case: a check case holds every planning flag but {', '.join(given)}; drop it")
    name = Path(target).name
    if (not name or name in (".", "..") or name.endswith((".json", ".plan"))
            or str(target).endswith(("/", os.sep))):
        raise InputError(f"--save-case takes DIR/NAME (NAME without an extension; got {str(target)!r})")
    for suffix in (".json", ".plan"):
        path = Path(str(target) + suffix)
        if os.path.lexists(path):
            raise InputError(f"--save-case: case {name!r} exists ({path}); refresh its golden with `zeppelin check "
                             f"{path.parent} --update -k {name}`, or remove it")
        check_path_writable(path, [p for p in inputs if p is not None])


def save_case(target: str | Path, *, manifest: str | None, planner: str, options: dict[str, Any],
              **settings: Any) -> list[str]:
    """Write ``target.json`` (a check case of these settings: the other fields of :class:`CheckCase`)
    and its golden ``target.plan``; the lines to print. Paths (the manifest, a tokenizer.json, a model
    or cluster file) are stored relative to the case's directory, as ``zeppelin check`` reads them."""
    import json

    check_case_flags(target, [], [])  # again: a case may have appeared meanwhile
    d = Path(target).parent
    dataset = "sample" if manifest is None else _case_path(manifest, d)
    tokenizer = settings.get("tokenizer")
    if tokenizer is not None and tokenizer not in ("whitespace", "bytes"):
        settings["tokenizer"] = _case_path(tokenizer, d)
    try:
        for key in ("cluster", "model"):
            settings[key] = portable_ref(settings[key], d)
        spec = CheckCase(dataset=dataset, planner=planner, options=_json_options(planner, options),
                         tolerance=DEFAULT_TOLERANCE, description=f"saved by `zeppelin plan --save-case {target}`",
                         **settings)
    except ValidationError as e:
        raise InputError(f"--save-case: {format_validation_error(e)}") from None
    ManagedDir(d, "--save-case directory").close()  # made with its parents, one line when it cannot be
    path = Path(str(target) + ".json")
    case = Case(path.stem, path, spec)
    res = run_case(case, update=True)
    if res.failures:
        raise InputError(f"--save-case: {res.failures[0]}")
    # the settings added to cases later are written only when not at their defaults
    later = {f for f in CheckCase.model_fields if f not in _FIRST_FIELDS and getattr(spec, f) == _DEFAULTS[f]}
    try:
        write_case_file(path, (json.dumps(spec.model_dump(exclude={"schema_version", *later}), indent=1)
                               + "\n").encode(), "check case")
    except BaseException:
        with ManagedDir(d, "check directory", create=False) as md:  # no golden without its case
            md.remove(case.golden.name)
        raise
    return [f"wrote {path} and its golden {case.golden} (mean simulated step {res.new_mean_s * 1e3:.2f} ms, "
            f"tolerance {DEFAULT_TOLERANCE:.0%}); check it with `zeppelin check {d} -k {case.name}`"]


def _case_path(ref: str, directory: Path) -> str:
    if os.path.isabs(ref):
        return ref
    return os.path.relpath(os.path.abspath(ref), os.path.abspath(directory))


def _json_options(planner: str, options: dict[str, Any]) -> dict[str, Any]:
    """Planner options as a case stores them: those differing from the planner's defaults."""
    from zeppelin.planner.core import registry  # noqa: F401 (imports every planner module: they register)
    from zeppelin.planner.core.base import PLANNERS

    cls = PLANNERS.get(planner)
    defaults = {sp.name: sp.default for sp in cls.Options.specs()} if cls is not None else {}
    return {k: v for k, v in options.items() if k not in defaults or defaults[k] != v}


def _weight(case: Case) -> float:
    return case.spec.steps * case.spec.tokens_per_step


def render(report: CheckReport, update: bool):
    from zeppelin.planner.tools.tables import table

    t = table("zeppelin check" + (" --update" if update else ""),
              [(c, "left" if c in ("case", "planner", "status") else "right")
               for c in ("case", "planner", "golden ms", "now ms", "change", "tol", "plan ms", "status")],
              drop=["plan ms", "tol", "planner", "golden ms", "now ms"])
    for r in report.results:
        g = f"{r.golden_mean_s * 1e3:.2f}" if r.golden_mean_s is not None else "-"
        n = f"{r.new_mean_s * 1e3:.2f}" if r.new_mean_s is not None else "-"
        ch = f"{r.change * 100:+.2f}%" if r.change is not None else "-"
        if r.failures:
            status = "[red]FAIL[/red]"
        elif update:
            status = "unchanged" if r.unchanged else ("[yellow]written[/yellow]" if r.written else "ok")
        else:
            status = "[green]ok[/green]"
        t.add_row(r.name, r.planner, g, n, ch, f"{r.tolerance * 100:g}%", f"{r.latency_s * 1e3:.0f}", status)
    return t
