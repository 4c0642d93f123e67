"""Hostile inputs, round three: the side files zeppelin makes (a plan stream's chain, check cases and
their goldens, TensorBoard directories) managed like checkpoint directories, every wait of
``run --follow`` bounded, one writer per stream, full and read-only disks in one line, the resume
state checked in full, portable and bounded check cases, policies that cannot report success for
nothing, and the smaller cases of the audit.

Each case runs in a fresh copy of the tree of ``tests/cli/test_hostile_runs.py`` (``w/``, the working
directory, and ``outside/``, the targets of links planted in ``w/``) and asserts the exit code, the
exact line and that a snapshot of the whole tree - link targets included - changed only where the
case's declared outputs are. docs/RELIABILITY.md maps each guarantee to these tests.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.cli.test_hostile import run_cli, snapshot
from tests.cli.test_hostile_runs import ZEPPELIN, _job, _plant, refused, template, tree  # noqa: F401 (fixtures)
from zeppelin.schemas.common import InputError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PLAN = ["plan", "-m", "m.jsonl", "--model", "tiny", "-c", "local-cpu:1x1", "--steps", "2", "--tokens-per-step", "512",
        "-q"]


def _header_steps(w: Path):
    from zeppelin.schemas.plan import read_plan

    return read_plan(w / "one.jsonl")


# =============================================================================================
# 1. side files are zeppelin's own: never followed, never another writer's
# =============================================================================================

CHAIN_KINDS = {"link-file": "is a symbolic link", "link-dangling": "is a symbolic link",
               "link-devnull": "is a symbolic link", "hardlink": "has 2 hard links", "fifo": "is a FIFO",
               "dir": "is a directory"}


@pytest.mark.parametrize("kind", sorted(CHAIN_KINDS))
def test_stream_chain_is_never_followed(tree, capsys, kind):
    w = tree / "w"
    _plant(w / "s2.jsonl.chain", kind, tree / "outside")
    refused(tree, capsys, [*PLAN, "--stream", "-o", "s2.jsonl"],
            f"s2.jsonl.chain: plan chain file {CHAIN_KINDS[kind]}, not a file zeppelin wrote (remove it)")


def test_stream_writer_never_writes_through_a_chain_planted_after_the_check(tree):
    """The chain appears by a hard link of the writer's own (locked) file: a name taken meanwhile is
    refused at write time too, and the writer removes nothing it did not make."""
    from zeppelin.schemas.io.stream import StreamingPlanWriter

    w = tree / "w"
    header, steps = _header_steps(w)
    os.symlink(tree / "outside" / "victim.txt", w / "s2.jsonl.chain")
    before = snapshot(tree)
    with pytest.raises(InputError) as e:
        with StreamingPlanWriter(w / "s2.jsonl", header) as sw:
            sw.write(steps[0])
    assert e.value.problem == "plan chain file is a symbolic link, not a file zeppelin wrote (remove it)"
    assert snapshot(tree) == before


def test_stale_chain_of_a_killed_planner_is_taken_over(tree, capsys):
    w = tree / "w"
    (w / "s2.jsonl.chain").write_text("0 sha256:00\n")  # a killed planner's: a regular file, its lock free
    rc, _, err = run_cli([*PLAN, "--stream", "-o", "s2.jsonl"], capsys)
    assert (rc, err) == (0, "")
    assert not (w / "s2.jsonl.chain").exists() and (w / "s2.jsonl").read_text().endswith('"}\n')


def test_second_stream_of_a_live_one_is_refused_and_an_old_writer_removes_only_its_own(tree, capsys):
    from zeppelin.schemas.io.stream import StreamingPlanWriter

    w = tree / "w"
    header, steps = _header_steps(w)
    first = StreamingPlanWriter(w / "sf.jsonl", header).__enter__()
    first.write(steps[0])
    refused(tree, capsys, [*PLAN, "--stream", "-o", "sf.jsonl"],
            "sf.jsonl.chain: sf.jsonl is being written by another `zeppelin plan --stream` (a live stream); wait "
            "for it to end or write another file")
    # a newer file takes the plan's name; the first writer, aborted, leaves it alone
    (w / "newer.jsonl").write_text("newer\n")
    os.replace(w / "newer.jsonl", w / "sf.jsonl")
    first.__exit__(RuntimeError, RuntimeError("planner failed"), None)
    assert (w / "sf.jsonl").read_text() == "newer\n" and not (w / "sf.jsonl.chain").exists()


def _case(w: Path, name: str = "c1", **edit) -> None:
    from tests.cli.test_hostile_runs import _zep

    d = w / "cases"
    _zep(*PLAN[:-1], "--save-case", str(d / name))
    if edit:
        doc = json.loads((d / f"{name}.json").read_text())
        doc.update(edit)
        (d / f"{name}.json").write_text(json.dumps(doc))


def test_check_update_replaces_a_linked_golden_never_its_target(tree, capsys):
    w = tree / "w"
    _case(w)
    golden = w / "cases" / "c1.plan"
    keep = golden.read_bytes()
    golden.unlink()
    os.symlink(tree / "outside" / "victim.txt", golden)
    before = snapshot(tree / "outside")
    rc, out, _ = run_cli(["check", "cases"], capsys)
    assert rc == 1 and "c1: unreadable golden plan: c1.plan: a symbolic link, not a file zeppelin wrote" in " ".join(
        out.split())
    rc, _, err = run_cli(["check", "cases", "--update"], capsys)
    assert (rc, err) == (0, "")
    assert snapshot(tree / "outside") == before  # the victim is untouched
    assert not golden.is_symlink() and golden.read_bytes() == keep


@pytest.mark.parametrize("existing", ["json", "plan", "link"])
def test_save_case_never_replaces_a_case(tree, capsys, existing):
    w = tree / "w"
    _case(w)
    if existing == "link":
        for f in (w / "cases").iterdir():
            f.unlink()
        os.symlink(tree / "outside" / "victim.txt", w / "cases" / "c1.plan")
    elif existing == "plan":
        (w / "cases" / "c1.json").unlink()
    name = "c1.plan" if existing != "json" else "c1.json"
    refused(tree, capsys, [*PLAN[:-1], "--save-case", "cases/c1"],
            f"--save-case: case 'c1' exists (cases/{name}); refresh its golden with `zeppelin check cases --update "
            f"-k c1`, or remove it")


@pytest.mark.parametrize("how,message", [
    ("in-hf", "--tensorboard is inside the model directory hf:hf, an input; name a directory outside it"),
    ("hf-itself", "--tensorboard is inside the model directory hf:hf, an input; name a directory outside it"),
    ("in-ck", "--tensorboard is inside --checkpoint-dir; name a file outside it"),
    ("link", "--tensorboard is a symbolic link; name a directory"),
])
def test_tensorboard_obeys_the_output_rules(tree, capsys, how, message):
    w = tree / "w"
    where = {"in-hf": "hf/tb", "hf-itself": "hf", "in-ck": "ck/tb", "link": "tblink"}[how]
    if how == "link":
        os.symlink(tree / "outside" / "vdir", w / "tblink")
    argv = ["run", "hplan.jsonl", "--model", "hf:hf", "--checkpoint-dir", "ck", "--tensorboard", where]
    refused(tree, capsys, argv, f"{where}: {message}")


# =============================================================================================
# 2. every wait of run --follow is bounded
# =============================================================================================

@pytest.mark.parametrize("kind,message", [
    ("fifo", "plan chain file is a FIFO, not a regular file"),
    ("link-devzero", "plan chain file is a character device, not a regular file"),
    ("dir", "plan chain file is a directory, not a regular file"),
])
def test_follow_reads_the_chain_like_a_small_file(tree, capsys, kind, message):
    w = tree / "w"
    shutil.copy(w / "one.jsonl", w / "p.jsonl")
    chain = w / "p.jsonl.chain"
    if kind == "fifo":
        os.mkfifo(chain)
    elif kind == "dir":
        chain.mkdir()
    else:
        os.symlink("/dev/zero", chain)
    refused(tree, capsys, ["run", "p.jsonl", "--follow"], f"p.jsonl.chain: {message}")


def test_follow_refuses_an_oversized_chain(tree):
    from zeppelin.schemas.io.stream import FollowReader

    w = tree / "w"
    shutil.copy(w / "one.jsonl", w / "p.jsonl")
    (w / "p.jsonl.chain").write_bytes(b"0" * 1000)  # no newline: a line that never ends
    with pytest.raises(InputError) as e:
        FollowReader(w / "p.jsonl", stall_s=30)
    assert e.value.problem == ("chain file is larger than the 240 bytes a plan of 2 steps has (not a chain zeppelin "
                               "wrote)")


def test_a_planner_that_makes_no_progress_ends_the_wait_within_the_timeout(tree):
    from zeppelin.schemas.io.stream import FollowReader, StreamingPlanWriter

    w = tree / "w"
    header, steps = _header_steps(w)
    sw = StreamingPlanWriter(w / "p.jsonl", header).__enter__()  # holds its lock, writes nothing more
    try:
        sw.write(steps[0])
        r = FollowReader(w / "p.jsonl", stall_s=0.5)
        assert r.step(0).step == 0
        t0 = time.monotonic()
        with pytest.raises(InputError) as e:
            r.step(1)
        assert time.monotonic() - t0 < 10
        assert e.value.problem == ("step 1: the planner wrote nothing for 0.5 s (--timeout); it is stopped or stuck "
                                   "(the plan stream holds 1 of 2 steps)")
    finally:
        sw.__exit__(RuntimeError, RuntimeError("stop"), None)


# =============================================================================================
# 4. full and read-only disks: one line, nothing half-written
# =============================================================================================

def _limited(args: list, cwd: Path, limit: int) -> subprocess.CompletedProcess:
    """``zeppelin ARGS`` with files limited to ``limit`` bytes (writes beyond fail with EFBIG, as on a
    full disk; Python ignores SIGXFSZ)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([ZEPPELIN, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=240,
                          preexec_fn=cap, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("limit", [1000, 2500], ids=["in-header", "in-step"])  # the header is 1,945 bytes
def test_plan_stream_on_a_full_disk_is_one_line(tree, limit):
    w = tree / "w"
    before = snapshot(tree)
    p = _limited([*PLAN, "--stream", "-o", "full.jsonl"], w, limit)
    assert p.returncode == 2 and p.stderr == "zeppelin: error: full.jsonl: cannot write plan: File too large\n"
    assert snapshot(tree) == before  # no plan, no chain, no temporary file


def test_metrics_on_a_read_only_filesystem_is_one_line_before_any_process(tree, capsys, monkeypatch):
    real = os.statvfs

    class RO:
        def __init__(self, st):
            self.f_flag = st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda p: RO(real(p)) if str(p).endswith("ro") else real(p))
    (tree / "w" / "ro").mkdir()
    refused(tree, capsys, ["run", "one.jsonl", "--metrics", "ro/m.jsonl"],
            "ro/m.jsonl: cannot write the metrics file: Read-only file system")


def test_metrics_write_failure_is_one_line(tmp_path):
    from zeppelin.runtime.train.metrics import JsonlSink

    sink = JsonlSink(tmp_path / "m.jsonl", append=False)
    sink.fh.close()
    sink.fh = open("/dev/full", "w")  # every write: ENOSPC
    with pytest.raises(InputError) as e:
        sink.write({"step": 0})
    assert str(e.value) == f"{tmp_path / 'm.jsonl'}: cannot write the metrics file: No space left on device"


# =============================================================================================
# 5. the resume state is validated in full before any rank loads it
# =============================================================================================

def _edit_state(w: Path, edit) -> None:
    f = w / "ck" / "ckpt-000001" / "state.json"
    st = json.loads(f.read_text())
    edit(st)
    f.write_text(json.dumps(st))


STATES = [
    ("no-hyperparameters", lambda st: st["extra"].pop("hyperparameters"),
     "'extra.hyperparameters' (the run's hyperparameters, which --resume compares)"),
    ("no-lr", lambda st: st["extra"]["hyperparameters"].pop("lr"), "'extra.hyperparameters.lr'"),
    ("empty-rng", lambda st: st.update(rng=[]), "'rng'"),
    ("next-step-true", lambda st: st.update(next_step=True), "'next_step'"),
    ("rng-python-short", lambda st: st["rng"][0]["python"][1].pop(), "'rng' (rank 0: python: not a Mersenne Twister "
                                                                     "state)"),
    ("rng-torch-not-base64", lambda st: st["rng"][0].update(torch="!!"), "'rng' (rank 0: torch: not the base64 of "
                                                                         "a CPU generator state)"),
    ("rng-numpy-missing", lambda st: st["rng"][0].pop("numpy"), "'rng' (rank 0: expected torch, python and numpy "
                                                                "states)"),
    ("rng-two-ranks", lambda st: st["rng"].append(st["rng"][0]), "'rng' (2 entries for 1 ranks)"),
    ("param-groups", lambda st: st.update(param_groups={}), "'param_groups'"),
]


@pytest.mark.parametrize("edit,message", [s[1:] for s in STATES], ids=[s[0] for s in STATES])
def test_resume_state_is_validated_in_full(tree, capsys, edit, message):
    w = tree / "w"
    _edit_state(w, edit)
    refused(tree, capsys, ["run", "one.jsonl", "--checkpoint-dir", "ck", "--resume", "--lr", "0.5"],
            f"ck/ckpt-000001/state.json: checkpoint state lacks a valid {message}")


# =============================================================================================
# 6. saved check cases: portable, bounded, validated, never replaced silently
# =============================================================================================

def test_saved_case_is_portable(tree, capsys):
    w = tree / "w"
    from tests.cli.test_hostile_runs import _zep

    _zep("presets", "--dump", "tiny", "-o", "mymodel.json")
    os.mkdir(w / "sub")
    os.chdir(w / "sub")
    _zep("plan", "-m", "../m.jsonl", "--model", "../mymodel.json", "-c", "local-cpu:1x1", "--steps", "2",
         "--tokens-per-step", "512", "--save-case", "../cases/c1")
    doc = json.loads((w / "cases" / "c1.json").read_text())
    assert (doc["model"], doc["dataset"]) == ("../mymodel.json", "../m.jsonl")
    os.chdir(tree / "outside")  # another directory, where ../mymodel.json is not that file
    rc, out, err = run_cli(["check", str(w / "cases"), "--exact"], capsys)
    assert (rc, err) == (0, ""), out


def test_save_case_takes_dir_slash_name(tree, capsys):
    refused(tree, capsys, [*PLAN[:-1], "--save-case", "cases/"],
            "--save-case takes DIR/NAME (NAME without an extension; got 'cases/')")


@pytest.mark.parametrize("field,value,message", [
    ("seed", 2**64, "seed: Input should be less than or equal to 9223372036854775807"),
    ("tp", 10**6, "tp: Input should be less than or equal to 256"),
    ("max_seq_len", 2**40, "max_seq_len: Input should be less than or equal to 2147483648"),
])
def test_case_fields_have_the_samplers_bounds(tree, capsys, field, value, message):
    w = tree / "w"
    _case(w, **{field: value})
    refused(tree, capsys, ["check", "cases"], f"cases/c1.json: invalid check case: {message}")


def test_oversized_case_is_refused_before_it_is_read(tree, capsys):
    w = tree / "w"
    (w / "cases").mkdir()
    with open(w / "cases" / "big.json", "wb") as fh:
        fh.truncate(70 << 20)  # sparse: nothing is written, nothing may be read
    refused(tree, capsys, ["check", "cases"],
            "cases/big.json: check case of 73,400,320 bytes is larger than the 67,108,864 bytes zeppelin reads")


@pytest.mark.parametrize("kind", ["link-file", "fifo"])
def test_case_files_are_never_followed(tree, capsys, kind):
    w = tree / "w"
    (w / "cases").mkdir()
    _plant(w / "cases" / "x.json", kind, tree / "outside")
    words = "is a symbolic link, not a file zeppelin wrote" if kind == "link-file" else "is a FIFO, not a regular file"
    refused(tree, capsys, ["check", "cases"], f"cases/x.json: check case {words}")


# =============================================================================================
# 7. policies that report success for nothing
# =============================================================================================

def test_sliding_window_zero_is_full_attention_in_the_runtime_too():
    """The parser reads 0 as full attention (the plan is made so); the runtime's HF attention reads the
    window transformers passes the same way instead of refusing it on every rank."""
    import inspect

    import zeppelin.runtime.api as api
    from zeppelin.schemas.hf import sliding_window

    assert sliding_window({"model_type": "mistral", "sliding_window": 0}) is None
    assert 'window = kwargs.get("sliding_window") or None' in inspect.getsource(api)


# =============================================================================================
# 9. smaller
# =============================================================================================

def test_damaged_parquet_page_is_one_line(tree, capsys):
    w = tree / "w"
    data = bytearray((w / "s.parquet").read_bytes())
    mid = len(data) // 3
    data[mid:mid + 40] = b"\xff" * 40  # a damaged data page; the footer is intact
    (w / "s.parquet").write_bytes(bytes(data))
    before = snapshot(tree)
    rc, _, err = run_cli(["data", "stats", "data.manifest.json"], capsys)
    assert rc == 2 and err.startswith("zeppelin: error: s.parquet: damaged Parquet data after row 0 (") and \
        err.count("\n") == 1, err
    assert snapshot(tree) == before


def test_moe_preset_that_does_not_fit_names_no_budget(tree, capsys):
    refused(tree, capsys, ["plan", "-m", "m.jsonl", "--model", "mixtral-8x7b", "-c", "local-cpu:1x1", "--steps", "1",
                           "-o", "x.jsonl"],
            "model mixtral-8x7b does not fit cluster local-cpu:1x1: its model states take 843.8 GB of a GPU's 3.5 GB "
            "(ZeRO stage 1, tp 1, 1 data-parallel unit(s)), leaving no room for activations; no ZeRO stage or TP "
            "degree within a node makes room: use a cluster with more GPUs or more memory")


# =============================================================================================
# 8. signals: a SIGTERM while a file is written is never lost
# =============================================================================================

def test_a_signal_whose_exception_is_swallowed_still_stops_the_write(tmp_path):
    import signal

    from zeppelin.schemas.io.safefiles import atomic_write
    from zeppelin.schemas.io.signals import Terminated

    out = tmp_path / "o.txt"
    out.write_text("old\n")
    with pytest.raises(Terminated):
        with atomic_write(out) as fh:
            fh.write("new\n")
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here ...
            except BaseException:  # noqa: BLE001 - ... and this code swallows it, as a __del__ would
                pass
    assert out.read_text() == "old\n" and os.listdir(tmp_path) == ["o.txt"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_checkpoint_save_on_a_full_disk_is_one_line(tree):
    w = tree / "w"
    p = _limited(["run", "one.jsonl", "--checkpoint-dir", "ck2", "--progress", "none"], w, 100_000)
    assert p.returncode == 1
    assert p.stderr.splitlines()[-1] == ("zeppelin: error: job failed: rank 0: CheckpointError: cannot write checkpoint "
                                         "ck2/ckpt-000002: File too large")
    assert all(line.startswith("zeppelin: error: ") for line in p.stderr.splitlines()), p.stderr  # no traceback
    assert sorted(os.listdir(w / "ck2")) == [".zeppelin.lock"]  # nothing half-written, no "latest"


@pytest.mark.parametrize("model", ["model.json", "hf:hf"])
def test_old_compare_spelling_reads_any_model_reference(tree, capsys, monkeypatch, model):
    from tests.cli.test_hostile_runs import _zep
    from zeppelin.planner.cli import common

    _zep("presets", "--dump", "tiny", "-o", "model.json")
    monkeypatch.setattr(common, "_noted", set())
    rest = ["--steps", "1", "--tokens-per-step", "512", "--planners", "te-cp", "-j", "1", "--json"]
    code, new, err = run_cli(["compare", "-c", "local-cpu:1x1", "--model", model, "-m", "m.jsonl", *rest], capsys)
    assert code == 0 and "note:" not in err, err
    code, old, err = run_cli(["compare", "-c", "local-cpu:1x1", "-d", "m.jsonl", "-m", model, *rest], capsys)
    assert code == 0, err
    assert "zeppelin: note: `compare -m MODEL` is deprecated and goes in the next release; use --model MODEL" in err
    a, b = json.loads(new), json.loads(old)
    assert [s["step_times_s"] for s in a["planners"]] == [s["step_times_s"] for s in b["planners"]]
