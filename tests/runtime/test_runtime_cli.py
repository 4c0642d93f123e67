"""`zeppelin run` end to end: torchrun launch, start-up refusals, faults, checkpoint/resume, --verify."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.clusters import cluster_preset  # local-cpu over fast links
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import write_plan

from tests.runtime.test_runtime_dist import hand_step, make_header, planner_step, two_node_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")


def _run(args, env_extra=None, timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.update(env_extra or {})
    t0 = time.monotonic()
    p = subprocess.run([ZEPPELIN, "run", *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)
    return p, time.monotonic() - t0


@pytest.fixture(scope="module")
def hand_plan(tmp_path_factory) -> Path:
    """Three steps of the all-paths hand plan (2 nodes x 2 ranks)."""
    path = tmp_path_factory.mktemp("plans") / "hand.jsonl"
    header = make_header(two_node_cluster(), model_preset("tiny"), 3)
    write_plan(path, header, [hand_step(k) for k in range(3)])
    return path


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory) -> Path:
    """Four packed-dp steps on 2 ranks (cheap: used for faults and resume)."""
    path = tmp_path_factory.mktemp("plans") / "small.jsonl"
    header = make_header(cluster_preset("local-cpu:1x2"), model_preset("tiny"), 4, planner="packed-dp")
    lens = [[40, 13, 9, 7, 3], [25, 21, 8, 2, 1], [33, 6, 5, 4, 12], [18, 17, 16, 3, 2]]
    write_plan(path, header, [planner_step("packed-dp", header, ls, k) for k, ls in enumerate(lens)])
    return path


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("zeppelin: error:")]


def test_run_verify_trains_and_writes_metrics(hand_plan, tmp_path):
    metrics = tmp_path / "m.jsonl"
    p, _ = _run([hand_plan, "--verify", "--lr", "3e-3", "--metrics", metrics, "--progress", "plain"])
    assert p.returncode == 0, p.stderr
    assert "zeppelin run: 3 steps" in p.stdout and " - ok" in p.stdout
    recs = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2]
    # the progress lines number the steps as the metrics do, from 0, then count them
    assert [ln.split("  ")[0] for ln in p.stdout.splitlines() if ln.startswith("step ")] == [
        "step 0 (1 of 3)", "step 1 (2 of 3)", "step 2 (3 of 3)"]
    for r in recs:
        v = r["verify"]
        assert v["ok"] and max(v["loss_rel"], v["hidden_rel"], v["grad_rel"]) <= 1e-5
        assert len(r["phases_s"]["attention"]) == 4 and min(r["phases_s"]["step"]) > 0
        assert r["bytes_sent"]["inter"] > 0 and r["bytes_sent"]["intra"] > 0 and r["bytes_sent"]["allreduce"] > 0
        assert r["tokens"] == sum(r["tokens_per_rank"]) - 1  # 1 padding token of the padded 4-rank ring
        assert r["tokens_per_s"] > 0 and min(r["peak_memory_bytes"]) > 0
        assert abs(r["loss"] - v["loss_ref"]) <= 1e-5 * v["loss_ref"]


def test_world_size_mismatch_refused_on_every_rank(hand_plan):
    """2 workers for a 4-rank plan, through the launcher directly (zeppelin run refuses earlier):
    each rank checks the world size before any collective, the first to refuse is the job's cause.
    The launcher stops the others at once (``launch.SETTLE_S`` after the first failure), so a rank
    still importing torch then never gets to say it: which ranks report depends on the machine's
    load, and each rank that does says the same."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "zeppelin.runtime.launch", "--standalone", "--nproc-per-node=2",
                        "-m", "zeppelin.runtime", str(hand_plan)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 2
    want = "the plan is for 4 ranks but the job has 2"
    errs = _errors(p.stderr)
    ranked = [e for e in errs if e.startswith("zeppelin: error: [rank ")]
    assert ranked and all(re.match(rf"zeppelin: error: \[rank [01]\] {want}", e) for e in ranked), p.stderr
    assert errs[-1].startswith("zeppelin: error: job failed: rank ") and want in errs[-1]
    assert "Traceback" not in p.stderr


def test_zeppelin_run_refuses_wrong_nproc_and_model(hand_plan):
    p, _ = _run([hand_plan, "--nproc-per-node", "2"])
    assert p.returncode == 2
    assert _errors(p.stderr) == ["zeppelin: error: the plan is for 4 ranks but --nproc-per-node 2 x --nnodes 1 "
                                 "gives 2"]
    p, _ = _run([hand_plan, "--model", "tiny-mha", "--steps", "1"])
    assert p.returncode == 2
    # refused by the command line before any rank starts
    assert _errors(p.stderr) == ["zeppelin: error: --model tiny-mha does not match the plan: num_kv_heads is 4 here, "
                                 "2 in the plan's model 'tiny'"], p.stderr
    assert "Traceback" not in p.stderr


def test_truncated_plan_line_reported_with_step(small_plan, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = small_plan.read_text().splitlines(keepends=True)
    bad.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2] + "\n")
    p, _ = _run([bad])
    assert p.returncode == 2
    # the command line reads every record (the plan's integrity) before any rank starts
    assert re.search(rf"^zeppelin: error: {re.escape(str(bad))}: step 2: corrupt or truncated record", p.stderr,
                     re.M), p.stderr
    assert "Traceback" not in p.stderr


def test_killed_rank_fails_the_job_quickly(small_plan, tmp_path):
    p, dt = _run([small_plan, "--metrics", tmp_path / "m.jsonl", "--timeout", "60"],
                 env_extra={"ZEPPELIN_TEST_FAULT": "1:1:exit"})
    assert p.returncode == 1
    assert "zeppelin: error: job failed: rank 1 exited with code 3 without an error message" in p.stderr, p.stderr
    assert dt < 60


def test_raising_rank_reports_its_error(small_plan, tmp_path):
    p, _ = _run([small_plan, "--metrics", tmp_path / "m.jsonl"], env_extra={"ZEPPELIN_TEST_FAULT": "0:0:raise"})
    assert p.returncode == 1
    assert "zeppelin: error: job failed: rank 0: RuntimeError: injected fault at step 0" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_resume_is_bit_identical(small_plan, tmp_path):
    import shutil

    from zeppelin.runtime.checkpoint import read_tensors

    a, b = tmp_path / "a", tmp_path / "b"
    # uninterrupted: 4 steps, DCP checkpoints after steps 2 and 4
    p, _ = _run([small_plan, "--checkpoint-every", 2, "--checkpoint-dir", a, "--metrics", tmp_path / "a.jsonl"])
    assert p.returncode == 0, p.stderr
    assert (a / "latest").read_text().strip() == "ckpt-000004"
    assert not list(a.glob(".*.tmp"))  # written to a temporary directory, renamed when complete
    # interrupted after step 2: a directory holding only the mid-run checkpoint, resumed to the end
    b.mkdir()
    shutil.copytree(a / "ckpt-000002", b / "ckpt-000002")
    (b / "latest").write_text("ckpt-000002\n")
    metrics_b = tmp_path / "b.jsonl"
    metrics_b.write_text("".join((tmp_path / "a.jsonl").read_text().splitlines(keepends=True)[:2]))
    p, _ = _run([small_plan, "--resume", "--checkpoint-dir", b, "--metrics", metrics_b, "--progress", "plain"])
    assert p.returncode == 0, p.stderr
    assert "zeppelin run: 2 steps" in p.stdout
    # one step numbering: ckpt-000002 resumes at step 2, the third step, as the progress and metrics say
    lines = p.stdout.splitlines()
    assert lines[1] == f"zeppelin run: resuming at step 2 from {b / 'ckpt-000002'}"
    assert [ln.split("  ")[0] for ln in lines if ln.startswith("step ")] == ["step 2 (3 of 4)", "step 3 (4 of 4)"]
    sa, sb = read_tensors(a / "ckpt-000004"), read_tensors(b / "ckpt-000004")
    assert sa.keys() == sb.keys()
    assert any(k.startswith("model.") for k in sa) and any(k.endswith(".exp_avg_sq") for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # the resumed run appended steps 2 and 3, with the uninterrupted run's losses
    ra = [json.loads(ln) for ln in (tmp_path / "a.jsonl").read_text().splitlines()]
    rb = [json.loads(ln) for ln in metrics_b.read_text().splitlines()]
    assert [r["step"] for r in rb] == [0, 1, 2, 3]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]


def test_failure_summary_blames_the_failing_rank_not_the_ranks_the_launcher_stopped(tmp_path):
    """torchrun stops the surviving workers (SIGTERM; the worker's handler exits 130) when one fails;
    whichever order the exits are seen in, the summary names the rank that failed."""
    from types import SimpleNamespace as F

    from zeppelin.runtime.launch import _summarise

    errs = tmp_path / "errs"
    errs.mkdir()
    (errs / "rank1.json").write_text(json.dumps({"rank": 1, "time": 1.0, "message": "step 2: bad", "code": 2}))
    for stopped in (-15, 130):
        assert _summarise(errs, {0: F(exitcode=stopped), 1: F(exitcode=2)}) == ("rank 1: step 2: bad", 2)
    # a rank that aborted without a report is the cause; the ranks stopped after it are not
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _summarise(empty, {0: F(exitcode=-15), 3: F(exitcode=-6), 1: F(exitcode=130)}) == (
        "rank 3 was killed by SIGABRT", 1)
    assert _summarise(errs, {0: F(exitcode=-15), 2: F(exitcode=3), 1: F(exitcode=2)}) == (
        "rank 2 exited with code 3 without an error message (then rank 1: step 2: bad)", 1)
    # only stopped ranks and no report at all: say so rather than inventing a cause
    assert _summarise(empty, {0: F(exitcode=-15)}) == ("rank 0 was killed by SIGTERM", 1)
