"""What a run takes from its plan and what from its flags (runtime/train/settings.py), the bounds
every flag's help states, and the learning-rate schedule as documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import run_cli
from zeppelin.runtime.config import LaunchConfig, RunConfig, flag_specs
from zeppelin.runtime.optim import LRSchedule
from zeppelin.runtime.train.settings import PLANNED, resolve
from zeppelin.schemas.common import InputError
from zeppelin.schemas.plan import PlanReader

ROOT = Path(__file__).resolve().parents[2]
ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Path:
    """A 4-step plan made at ZeRO-1 with recomputation chosen per micro-batch (the planner's defaults)."""
    d = tmp_path_factory.mktemp("settings")
    p = subprocess.run([ZEPPELIN, "plan", "-c", "local-cpu:1x2", "--model", "tiny", "--steps", "4",
                        "--tokens-per-step", "2048", "--max-seq-len", "1024", "-q", "-o", "p.jsonl"], cwd=d,
                       capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    return d / "p.jsonl"


@pytest.mark.parametrize("argv,line", [
    (["--zero-stage", "3"], ("the plan was made for --zero-stage 1 (its model-state memory per GPU), not 3; "
                            "re-plan with `zeppelin plan --zero-stage 3` or pass --zero-stage-override")),
    (["--recompute", "full"], ("the plan was made for --recompute auto (its activation memory per token), not full; "
                              "re-plan with `zeppelin plan --recompute full` or pass --recompute-override")),
])
def test_a_flag_that_differs_from_the_plan_needs_its_override(plan, capsys, monkeypatch, argv, line):
    """One rule and one line for --zero-stage and --recompute: refused before any process starts,
    accepted with the override, and the plan's value when the flag is left out."""
    monkeypatch.chdir(plan.parent)
    code, out, err = run_cli(["run", plan.name, *argv, "--steps", "1"], capsys)
    assert (code, out, err) == (2, "", f"zeppelin: error: {line}\n")
    header = PlanReader(plan).header
    with pytest.raises(InputError) as e:
        RunConfig(plan=str(plan), **{argv[0][2:].replace("-", "_"): _value(argv[1])}).check_plan(header)
    assert str(e.value) == line
    name = argv[0][2:].replace("-", "_")
    cfg = RunConfig(plan=str(plan), **{name: _value(argv[1]), f"{name}_override": True})
    cfg.check_plan(header)
    assert getattr(resolve(cfg, header, "cpu"), name) == _value(argv[1])
    assert getattr(resolve(RunConfig(plan=str(plan)), header, "cpu"), name) == getattr(header, name)


def _value(text: str):
    return int(text) if text.isdigit() else text


def test_every_planned_setting_has_its_override_flag():
    names = {s.name for s in flag_specs(RunConfig)}
    for p in PLANNED:
        assert p.name in names and p.override in names
        spec = next(s for s in flag_specs(RunConfig) if s.name == p.override)
        assert spec.flag == p.override_flag and spec.kind is bool


def test_other_settings_take_the_flag_or_the_plan(plan):
    header = PlanReader(plan).header
    s = resolve(RunConfig(plan=str(plan)), header, "cpu")
    assert (s.seed, s.dtype, s.tp_overlap, s.verify_tol) == (header.seed, "fp32", header.tp_overlap, 1e-5)
    s = resolve(RunConfig(plan=str(plan), seed=7, tp_overlap="slicing", dtype="bf16"), header, "cuda")
    assert (s.seed, s.dtype, s.tp_overlap, s.verify_tol) == (7, "bf16", "slicing", 2e-2)
    assert resolve(RunConfig(plan=str(plan)), header, "cuda").dtype == "bf16"


BOUNDED = [s for s in (*flag_specs(RunConfig), *flag_specs(LaunchConfig)) if s.lo is not None]


def test_the_bounded_flags_are_the_ones_config_declares():
    assert {s.flag for s in BOUNDED} >= {"--lr", "--weight-decay", "--eps", "--min-lr", "--warmup-steps",
                                         "--zero-stage", "--hsdp", "--seed", "--threads"}
    by = {s.flag: s.bound for s in BOUNDED}
    assert by["--lr"] == "greater than 0, at most 10" and by["--weight-decay"] == "at least 0, at most 10"
    assert by["--zero-stage"] == "0 to 3" and by["--hsdp"] == "at least 1"


@pytest.fixture(scope="module")
def run_help() -> str:
    p = subprocess.run([ZEPPELIN, "run", "--help"], capture_output=True, text=True, check=False,
                       env={"COLUMNS": "250", "PATH": "", "TERM": "dumb"})
    assert p.returncode == 0, p.stderr
    return re.sub(r"[\s│]+", " ", p.stdout)


@pytest.mark.parametrize("spec", BOUNDED, ids=lambda s: s.flag)
def test_every_bounded_flag_states_its_bound(spec, run_help):
    """The bound a flag enforces (read from runtime/config.py) is in its --help text, in the worker's
    parser and in its row of docs/RUNTIME.md; out of the bound the value is refused."""
    assert spec.help_text.endswith(f" ({spec.bound})")
    assert " ".join(spec.help_text.split()) in run_help, spec.flag  # the flag's help, its bound included
    rows = [ln for ln in (ROOT / "docs" / "RUNTIME.md").read_text().splitlines() if ln.startswith(f"| `{spec.flag}` |")]
    assert len(rows) == 1 and f"({spec.bound})" in rows[0], spec.flag
    if spec.hi is not None and spec.flag in {f.flag for f in flag_specs(RunConfig)}:
        with pytest.raises(InputError):
            RunConfig(plan="p.jsonl", **{spec.name: spec.kind(spec.hi) * 2 + 1})


def test_the_worker_parser_shows_the_bounds():
    from zeppelin.runtime.config import build_parser

    text = re.sub(r"\s+", " ", build_parser().format_help())
    assert "AdamW learning rate (greater than 0, at most 10)" in text


def test_the_schedule_ends_where_help_and_docs_say():
    """The decay reaches --min-lr at step N, the plan's step count, one past its last step N-1 (as
    torch's LinearLR/CosineAnnealingLR with total_iters/T_max = N - W count); help and docs say so."""
    n, w = 10, 2
    for kind in ("linear", "cosine"):
        s = LRSchedule(1.0, n, kind, warmup_steps=w, min_lr=0.1)
        assert s(n) == pytest.approx(0.1) and s(n - 1) > 0.1 + 1e-3
    lin = LRSchedule(1.0, n, "linear", min_lr=0.1)
    assert lin(n - 1) == pytest.approx(1.0 + (0.1 - 1.0) * (n - 1) / n)
    spec = {s.flag: s for s in flag_specs(RunConfig)}
    assert "reaches at step N, the plan's step count (one past its last step" in spec["--lr-schedule"].help
    assert "step k < W runs at lr * (k+1)/W" in spec["--warmup-steps"].help
    doc = (ROOT / "docs" / "RUNTIME.md").read_text()
    assert "at the plan's last step" not in doc
    assert "reaches `min_lr` at step `N`" in doc


@pytest.mark.parametrize("warmup", [1, 2, 3])
def test_the_documented_torch_equivalent(warmup):
    """docs/RUNTIME.md's torch equivalent of a warm-up + decay, W = 1 included (no ramp: ConstantLR
    with factor 1 for step 0), step for step."""
    torch = pytest.importorskip("torch")
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

    n, lr, min_lr = 8, 1e-3, 1e-4
    for kind in ("linear", "cosine"):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        warm = (ConstantLR(opt, factor=1.0, total_iters=1) if warmup == 1 else
                LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1))
        decay = (CosineAnnealingLR(opt, T_max=n - warmup, eta_min=min_lr) if kind == "cosine" else
                 LinearLR(opt, start_factor=1.0, end_factor=min_lr / lr, total_iters=n - warmup))
        sched = SequentialLR(opt, [warm, decay], milestones=[warmup])
        ours = LRSchedule(lr, n, kind, warmup_steps=warmup, min_lr=min_lr)
        got = []
        for _ in range(n):
            got.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert got == pytest.approx([ours(k) for k in range(n)], rel=1e-9), kind
