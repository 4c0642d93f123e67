"""The metrics of ``zeppelin run``: per step loss, tokens/s, model FLOPs and the MFU estimate,
learning rate, gradient norm, memory, predicted vs measured step time - always in the metrics
JSONL, and as TensorBoard scalars with ``--tensorboard DIR`` when the package is installed; the
terminal progress bar shows an ETA."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.runtime.test_hf import ZEPPELIN
from zeppelin.runtime.optim import LRSchedule
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import PlanReader


def test_model_flops_by_hand():
    """6 per weight of the matmuls per token (norms left out), 12 q_dim per visible query-key pair;
    an MoE layer counts its active experts and router, a windowed layer its window's pairs."""
    from zeppelin.runtime.train.metrics import model_flops

    m = model_preset("tiny")
    h, f = m.hidden, m.ffn_hidden
    mats = h * (m.q_dim + 2 * m.kv_dim) + m.q_dim * h + 3 * h * f
    want = 6 * (mats * m.num_layers + m.vocab_size * h) * 300 + 6 * m.num_layers * m.q_dim * (100**2 + 200**2)
    assert model_flops(m, [100, 200]) == pytest.approx(want, rel=1e-12)
    moe = m.model_copy(update={"num_experts": 8, "experts_per_token": 2, "expert_ffn_hidden": f // 2})
    mats_moe = h * (m.q_dim + 2 * m.kv_dim) + m.q_dim * h + 3 * h * f + h * 8  # 2 experts of f/2, router
    assert model_flops(moe, [100]) == pytest.approx(
        6 * (mats_moe * m.num_layers + m.vocab_size * h) * 100 + 6 * m.num_layers * m.q_dim * 100**2, rel=1e-12)
    win = m.model_copy(update={"sliding_window": 50})
    assert model_flops(win, [200]) == pytest.approx(
        6 * (mats * m.num_layers + m.vocab_size * h) * 200 + 12 * m.num_layers * m.q_dim * (200 * 50 - 50**2 / 2),
        rel=1e-12)


def test_progress_bar_has_an_eta():
    from rich.progress import TimeRemainingColumn

    from zeppelin.runtime.train.metrics import ProgressSink

    p = ProgressSink("rich", 4, 1)
    try:
        assert any(isinstance(c, TimeRemainingColumn) for c in p.bar.columns)
    finally:
        p.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("metrics")
    (d / "m.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in [300, 500, 700, 900, 120, 60] * 8))
    p = subprocess.run([ZEPPELIN, "plan", "-m", "m.jsonl", "-c", "local-cpu:1x2", "--model", "tiny", "--steps", "3",
                        "--tokens-per-step", "2048", "--max-seq-len", "1024", "-q", "-o", "p.jsonl"], cwd=d,
                       capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    return d


def _run(d: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([ZEPPELIN, "run", "p.jsonl", "--progress", "none", "--lr-schedule", "cosine",
                           "--warmup-steps", "1", "--grad-clip", "1.0", *extra], cwd=d, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=200, check=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_metrics_jsonl_and_tensorboard(run_dir):
    import tensorboard as tb  # (a dev dependency: ./dev setup installs it)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    p = _run(run_dir, "--tensorboard", "tb", "--metrics", "tb.metrics.jsonl")
    assert p.returncode == 0, p.stderr
    recs = _check_records(run_dir / "tb.metrics.jsonl")
    events = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1, tb.__version__
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("perf/mfu", "mfu"), ("perf/tokens_per_s", "tokens_per_s"), ("memory/max_bytes",
                                                                                 "max_memory_bytes")):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [r["step"] for r in recs]
        for (_, v), r in zip(got, recs):
            assert v == pytest.approx(r[key], rel=1e-6), (tag, v, r[key])


def _check_records(path: Path) -> list[dict]:
    from zeppelin.runtime.train.metrics import model_flops

    reader = PlanReader(path.parent / "p.jsonl")
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2]
    sched = LRSchedule(1e-3, 3, "cosine", warmup_steps=1)
    for r in recs:
        step = reader.step(r["step"])
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] == pytest.approx(step.tokens / r["step_time_s"])
        assert r["lr"] == pytest.approx(sched(r["step"]), rel=1e-12)
        assert 0 < r["grad_norm"] < 100
        flops = model_flops(reader.header.model, [s.length for s in step.sequences])
        assert r["model_tflops"] == pytest.approx(flops / 1e12)
        peak = reader.header.cluster.gpu.peak_tflops * 1e12 * reader.header.world_size
        assert r["mfu"] == pytest.approx(flops / (r["step_time_s"] * peak)) and 0 < r["mfu"] < 1
        assert r["max_memory_bytes"] == max(r["memory"]["measured_bytes"]) > 0
        assert r["predicted_step_time_s"] == step.prediction.step_time_s > 0
        assert r["measured_over_predicted"] == pytest.approx(r["step_time_s"] / r["predicted_step_time_s"])
    assert recs[2]["lr"] < recs[1]["lr"]  # the cosine decay after the one warmup step
    return recs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_metrics_jsonl_without_tensorboard(run_dir):
    p = _run(run_dir)
    assert p.returncode == 0, p.stderr
    _check_records(run_dir / "p.metrics.jsonl")


def test_tensorboard_flag_without_the_package(monkeypatch):
    import importlib.util

    from zeppelin.runtime.config import RunConfig
    from zeppelin.schemas.common import InputError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a))
    with pytest.raises(InputError) as e:
        RunConfig(plan="p.jsonl", tensorboard="tb")
    assert str(e.value) == "--tensorboard needs the tensorboard package (pip install tensorboard)"
