"""Plan integrity: a plan of the current format must carry its end record, and a reader runs
exactly the bytes it verified.

* Dropping the end record (``head -n -1``), with or without an edit, makes the plan "truncated or
  edited" for every reader (validate, simulate, show, run, the ranks' start-up checks).
* A reader reads through one open descriptor: replacing the file after it was verified (a rename
  over it) changes nothing it returns; rewriting the same file in place is detected at the step.
* ``zeppelin run`` hands the digest it verified to the ranks (``--plan-digest``): a file replaced
  between the command's check and a rank's start is refused by the rank.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cli.test_hostile import run_cli, snapshot
from zeppelin.schemas.common import InputError
from zeppelin.schemas.plan import NO_END_RECORD, PlanReader

NOEND = f"noend.jsonl: {NO_END_RECORD}"


@pytest.fixture
def work(tmp_path, monkeypatch, capsys) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in [300, 500, 700, 900] * 8))
    rc, _, err = run_cli(["plan", "-m", "m.jsonl", "-c", "local-cpu:1x2", "--model", "tiny", "--steps", "3", "-q",
                          "--tokens-per-step", "2048", "-o", "base.jsonl"], capsys)
    assert rc == 0, err
    return tmp_path


def _noend(work: Path, edit: bool) -> None:
    lines = (work / "base.jsonl").read_text().splitlines(keepends=True)[:-1]  # head -n -1
    text = "".join(lines)
    if edit:
        assert '"seed":0' in text
        text = text.replace('"seed":0', '"seed":12345')  # sed 's/"seed":0/"seed":12345/'
    (work / "noend.jsonl").write_text(text)


@pytest.mark.parametrize("edit", [True, False], ids=["edited", "cut"])
@pytest.mark.parametrize("command", [["simulate"], ["show"], ["run", "--progress", "none"]], ids=lambda c: c[0])
def test_plan_without_end_record_is_refused(work, capsys, command, edit):
    _noend(work, edit)
    before = snapshot(work)
    rc, out, err = run_cli([command[0], "noend.jsonl", *command[1:]], capsys)
    assert (rc, err) == (2, f"zeppelin: error: {NOEND}\n"), out
    assert snapshot(work) == before


@pytest.mark.parametrize("edit", [True, False], ids=["edited", "cut"])
def test_validate_and_ranks_refuse_a_plan_without_end_record(work, capsys, edit):
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks

    _noend(work, edit)
    rc, _, err = run_cli(["validate", "noend.jsonl"], capsys)
    assert rc == 1 and f"  format: {NO_END_RECORD}" in err.splitlines(), err
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan="noend.jsonl"), 2)
    assert str(e.value) == NOEND


def _edited_same_size(text: str) -> str:
    out = text.replace('"seed":0', '"seed":7')
    assert len(out) == len(text) and out != text
    return out


def test_replacing_the_file_after_verification_changes_nothing(work):
    """Rename an edited same-size copy over the plan after the reader verified it: the reader still
    returns the verified steps (its open descriptor holds the file it verified)."""
    reader = PlanReader("base.jsonl")
    reader.verify()
    want = [reader.step(k).model_dump() for k in range(3)]
    text = (work / "base.jsonl").read_text()
    lines = text.splitlines(keepends=True)
    rec = json.loads(lines[2])
    rec["sequences"][0]["sample_id"] ^= 1
    (work / "swap.jsonl").write_text("".join([lines[0], lines[1], json.dumps(rec, separators=(",", ":")) + "\n",
                                              *lines[3:]]))
    os.replace(work / "swap.jsonl", work / "base.jsonl")
    assert [reader.step(k).model_dump() for k in range(3)] == want
    assert reader.header.seed == 0


def test_rewriting_the_file_in_place_is_detected(work):
    reader = PlanReader("base.jsonl")
    reader.verify()
    lines = (work / "base.jsonl").read_bytes().splitlines(keepends=True)
    step1 = lines[2]
    edited = step1.replace(b'"step":1', b'"step":7')
    assert len(edited) == len(step1) and edited != step1
    with open(work / "base.jsonl", "r+b") as fh:  # same file, same size, one record rewritten
        fh.seek(len(lines[0]) + len(lines[1]))
        fh.write(edited)
    reader.step(0)  # untouched records still read
    with pytest.raises(InputError) as e:
        reader.step(1)
    assert str(e.value) == ("base.jsonl: step 1: the plan file changed after it was verified (its record is not the "
                            "one read then)")


def test_ranks_run_only_the_plan_the_command_checked(work, capsys):
    """``zeppelin run`` passes the verified digest (``--plan-digest``); a rank whose file carries
    another digest (replaced in between by another valid plan) refuses it."""
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks

    r = PlanReader("base.jsonl")
    r.verify()
    digest = r.digest
    assert digest.startswith("sha256:") and len(digest) == 71
    assert RunConfig(plan="base.jsonl", plan_digest=digest).to_argv() == ["base.jsonl", "--plan-digest", digest]
    startup_checks(RunConfig(plan="base.jsonl", plan_digest=digest), 2)
    rc, _, err = run_cli(["plan", "-m", "m.jsonl", "-c", "local-cpu:1x2", "--model", "tiny", "--steps", "3", "-q",
                          "--tokens-per-step", "2048", "--seed", "5", "-o", "other.jsonl"], capsys)
    assert rc == 0, err
    os.replace(work / "other.jsonl", work / "base.jsonl")
    other = PlanReader("base.jsonl")
    other.verify()
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan="base.jsonl", plan_digest=digest), 2)
    assert str(e.value) == (f"base.jsonl: integrity check failed: the plan's digest is {other.digest}, not the "
                            f"{digest} expected (the file was replaced after it was checked)")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_swapping_the_plan_mid_run_changes_nothing_that_runs(work, capsys):
    """`zeppelin run` on 2 ranks; once its first step is done the plan file is replaced (renamed
    over) by another valid plan of the same inputs: every step that runs is the original's."""
    import subprocess
    import sys
    import time

    rc, _, err = run_cli(["plan", "-m", "m.jsonl", "-c", "local-cpu:1x2", "--model", "tiny", "--steps", "8", "-q",
                          "--tokens-per-step", "2048", "--seed", "3", "-o", "long.jsonl"], capsys)
    assert rc == 0, err
    rc, _, err = run_cli(["plan", "-m", "m.jsonl", "-c", "local-cpu:1x2", "--model", "tiny", "--steps", "8", "-q",
                          "--tokens-per-step", "2048", "--seed", "9", "-o", "other.jsonl"], capsys)
    assert rc == 0, err
    want = [s.tokens for s in PlanReader("long.jsonl")]
    other = [s.tokens for s in PlanReader("other.jsonl")]
    assert want != other
    zeppelin = str(Path(sys.executable).parent / "zeppelin")
    run = subprocess.Popen([zeppelin, "run", "long.jsonl", "--progress", "none", "--metrics", "m.metrics.jsonl"],
                           cwd=work, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    def first_step_done() -> bool:
        f = work / "m.metrics.jsonl"
        return f.exists() and bool(f.read_text().strip())

    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and not first_step_done():
        time.sleep(0.02)
    assert first_step_done() and run.poll() is None  # mid-run: steps are still to come
    os.replace(work / "other.jsonl", work / "long.jsonl")
    _, err = run.communicate(timeout=200)
    assert run.returncode == 0, err
    got = [json.loads(x)["tokens"] for x in (work / "m.metrics.jsonl").read_text().splitlines()]
    assert got == want
