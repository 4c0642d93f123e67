"""Hostile inputs to runs and the files they touch: no file outside the declared outputs is ever
written, unusable weights and non-finite losses stop a run, Hugging Face configs are checked once,
and faults end cleanly.

Every case runs in a fresh copy of a small tree: ``w/`` (the working directory: plans, a manifest
with a tokenizer and a Parquet shard, a Hugging Face model directory, a checkpoint directory) and
``outside/`` (the targets of the links planted in ``w/``). Refusals run the ``zeppelin`` entry point
in-process (the checks run before any process starts) and assert the exit code, the exact line and
that a snapshot of the whole tree - link targets outside ``w/`` included - is unchanged. The few
cases that need a job run it as a subprocess. docs/RELIABILITY.md maps each guarantee to these tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_hostile import _quiet, run_cli, snapshot
from zeppelin.planner.cli import main as zeppelin_main

ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tk = Tokenizer(WordLevel({w: i for i, w in enumerate(["[UNK]", *WORDS])}, unk_token="[UNK]"))
    tk.pre_tokenizer = Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tk.save(str(path))


def _text(n: int, k: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for i in range(n))


def _zep(*argv: str) -> None:
    with _quiet():
        zeppelin_main(list(argv))


def _job(args: list, cwd: Path, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e.update(env or {})
    return subprocess.run([ZEPPELIN, *map(str, args)], cwd=cwd, env=e, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """``root/w``: plans (own model, token-id manifest, Hugging Face model), the manifest's files, an
    HF directory and a checkpoint after step 1; ``root/outside``: link targets."""
    from tests.runtime.test_hf import make_hf_dir

    root = tmp_path_factory.mktemp("hostile_runs")
    w, out = root / "w", root / "outside"
    w.mkdir()
    out.mkdir()
    (out / "victim.txt").write_text("victim\n")
    (out / "vdir").mkdir()
    (out / "vdir" / "keep.txt").write_text("keep\n")
    (out / "empty").mkdir()
    old = os.getcwd()
    os.chdir(w)
    try:
        (w / "m.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in [100, 200, 300, 150] * 4))
        (w / "x.txt").write_text("3\n")
        _tokenizer(w / "tok" / "tokenizer.json")
        (w / "t.jsonl").write_text("".join(json.dumps({"text": _text(60 + 10 * k, k)}) + "\n" for k in range(8)))
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [_text(80 + 5 * k, k + 3) for k in range(8)]}), str(w / "s.parquet"))
        (w / "data.manifest.json").write_text(json.dumps(
            {"paths": ["t.jsonl", "s.parquet"], "text_field": "text", "tokenizer": "tok/tokenizer.json"}))
        make_hf_dir(w / "hf", seed=3)
        shutil.copy(w / "tok" / "tokenizer.json", w / "hf" / "tokenizer.json")
        common = ["-c", "local-cpu:1x1", "--steps", "2", "--tokens-per-step", "512", "-q"]
        _zep("plan", "-m", "m.jsonl", "--model", "tiny", *common, "-o", "one.jsonl")
        _zep("plan", "-m", "data.manifest.json", "--model", "tiny", *common, "-o", "dplan.jsonl")
        _zep("plan", "-m", "m.jsonl", "--model", "hf:hf", *common, "-o", "hplan.jsonl")
    finally:
        os.chdir(old)
    _checkpoint(w / "one.jsonl", w / "ck")
    return root


def _checkpoint(plan: Path, ck: Path) -> None:
    """The checkpoint a one-rank run of ``plan`` writes after its first step (made in-process: the
    same writer, without starting a job)."""
    import torch

    from zeppelin.runtime.checkpoint import plan_hash, rng_state, save_checkpoint
    from zeppelin.runtime.lifecycle import prepare_checkpoint_dir
    from zeppelin.runtime.model import LlamaModel
    from zeppelin.schemas.plan import PlanReader

    header = PlanReader(plan).header
    model = LlamaModel(header.model, seed=header.seed)
    opt = torch.optim.AdamW(list(model.parameters()), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8,
                            foreach=False)
    lock = prepare_checkpoint_dir(ck)
    save_checkpoint(ck, next_step=1, model=model, optimizer=opt, rng_states=[rng_state()], plan_hash=plan_hash(header),
                    world_size=1, rank=0, extra={"hyperparameters": {"lr": 1e-3, "weight_decay": 0.0,
                                                                     "seed": header.seed}})
    lock.release()


@pytest.fixture
def tree(template, tmp_path, monkeypatch) -> Path:
    """A fresh copy of the tree; the working directory is its ``w/``."""
    root = tmp_path / "r"
    shutil.copytree(template, root, symlinks=True)
    monkeypatch.chdir(root / "w")
    return root


def refused(root: Path, capsys, argv: list[str], message: str, code: int = 2) -> None:
    """``zeppelin ARGV`` exits ``code`` with exactly one line, and no file of the tree changed."""
    before = snapshot(root)
    rc, out, err = run_cli(argv, capsys)
    assert (rc, err) == (code, f"zeppelin: error: {message}\n"), out
    assert snapshot(root) == before


def _shard(w: Path) -> Path:
    return next((w / "ck" / "ckpt-000001").glob("*.safetensors"))


# =============================================================================================
# 2. every input of a command is refused as any of its outputs
# =============================================================================================

RUN_D = ["run", "dplan.jsonl", "--data", "data.manifest.json"]
RUN_H = ["run", "hplan.jsonl", "--model", "hf:hf"]
PLAN_H = ["plan", "-m", "data.manifest.json", "--model", "hf:hf", "-c", "local-cpu:1x1", "--steps", "1",
          "--tokens-per-step", "512", "-q"]
# (command, the path given, the input it is - shown when it is another name of it)
INPUTS = [(RUN_D, "dplan.jsonl", None), (RUN_D, "data.manifest.json", None), (RUN_D, "t.jsonl", None),
          (RUN_D, "s.parquet", None), (RUN_D, "tok/tokenizer.json", None), (RUN_D, "hard-t.jsonl", "t.jsonl"),
          (RUN_D, "soft-tok.json", "tok/tokenizer.json"), (RUN_D, "hard-parquet", "s.parquet"),
          (RUN_H, "hplan.jsonl", None), (RUN_H, "hf/config.json", None), (RUN_H, "hf/model.safetensors", None),
          (RUN_H, "hf/tokenizer.json", None), (RUN_H, "hard-w.safetensors", "hf/model.safetensors"),
          (RUN_H, "soft-config.json", "hf/config.json")]
OUTPUT_FLAGS = ["--metrics", "--report-json", "--export"]


def _input_links(w: Path) -> None:
    os.link(w / "t.jsonl", w / "hard-t.jsonl")
    os.link(w / "s.parquet", w / "hard-parquet")
    os.link(w / "hf" / "model.safetensors", w / "hard-w.safetensors")
    os.symlink("tok/tokenizer.json", w / "soft-tok.json")
    os.symlink("hf/config.json", w / "soft-config.json")


@pytest.mark.parametrize("flag", OUTPUT_FLAGS)
@pytest.mark.parametrize("command,path,original", INPUTS, ids=[f"{c[1]}-{p}" for c, p, _ in INPUTS])
def test_run_refuses_every_input_as_an_output(tree, capsys, flag, command, path, original):
    _input_links(tree / "w")
    what = "--export" if flag == "--export" else "output"
    refused(tree, capsys, [*command, flag, path],
            f"{path}: {what} would overwrite an input file" + (f" ({original})" if original else ""))


@pytest.mark.parametrize("path", ["dplan.jsonl", "data.manifest.json", "t.jsonl", "s.parquet", "tok/tokenizer.json"])
def test_ranks_started_by_hand_refuse_an_input_as_metrics(tree, path):
    """The ranks' own start-up check (torchrun started by hand, no ``zeppelin run``) is the same."""
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks
    from zeppelin.schemas.common import InputError

    before = snapshot(tree)
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan="dplan.jsonl", data="data.manifest.json", metrics=path), 1)
    assert str(e.value) == f"{path}: output would overwrite an input file"
    assert snapshot(tree) == before


PLAN_OUTPUTS = [("data.manifest.json", None), ("t.jsonl", None), ("s.parquet", None), ("tok/tokenizer.json", None),
                ("hf/config.json", None), ("hf/model.safetensors", None), ("hf/tokenizer.json", None),
                ("hard-w.safetensors", "hf/model.safetensors"), ("soft-tok.json", "tok/tokenizer.json"),
                ("hard-t.jsonl", "t.jsonl")]


@pytest.mark.parametrize("path,original", PLAN_OUTPUTS, ids=[p for p, _ in PLAN_OUTPUTS])
def test_plan_refuses_every_input_as_its_output(tree, capsys, path, original):
    _input_links(tree / "w")
    refused(tree, capsys, [*PLAN_H, "-o", path],
            f"{path}: output would overwrite an input file" + (f" ({original})" if original else ""))


# =============================================================================================
# 1. no entry of a managed directory is followed
# =============================================================================================

def _plant(path: Path, kind: str, outside: Path) -> None:
    """Something zeppelin did not make at ``path``."""
    if kind == "link-file":
        os.symlink(outside / "victim.txt", path)
    elif kind == "link-dir":
        os.symlink(outside / "vdir", path)
    elif kind == "link-dangling":
        os.symlink(outside / "nowhere", path)
    elif kind == "link-devnull":
        os.symlink("/dev/null", path)
    elif kind == "hardlink":
        os.link(outside / "victim.txt", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        raise AssertionError(kind)


KINDS = ["link-file", "link-dir", "link-dangling", "link-devnull", "hardlink", "fifo", "dir"]
LOCK_WORDS = {"link-file": "is a symbolic link", "link-dir": "is a symbolic link", "link-dangling": "is a symbolic link",
              "link-devnull": "is a symbolic link", "hardlink": "has 2 hard links", "fifo": "is a FIFO",
              "dir": "is a directory"}


@pytest.mark.parametrize("resume", [False, True], ids=["save", "resume"])
@pytest.mark.parametrize("kind", KINDS)
def test_lock_file_is_never_followed(tree, capsys, kind, resume):
    w = tree / "w"
    (w / "ck" / ".zeppelin.lock").unlink(missing_ok=True)
    _plant(w / "ck" / ".zeppelin.lock", kind, tree / "outside")
    refused(tree, capsys, ["run", "one.jsonl", "--checkpoint-dir", "ck", "--checkpoint-every", "1",
                           *(["--resume"] if resume else [])],
            f"ck: --checkpoint-dir: .zeppelin.lock {LOCK_WORDS[kind]}, not a file zeppelin wrote (remove it)")


def test_lock_is_taken_through_the_directory_never_a_link(tree):
    from zeppelin.runtime.lifecycle import prepare_checkpoint_dir
    from zeppelin.schemas.common import InputError

    ck = tree / "w" / "ck"
    (ck / ".zeppelin.lock").unlink(missing_ok=True)
    os.symlink(tree / "outside" / "victim.txt", ck / ".zeppelin.lock")
    before = snapshot(tree)
    with pytest.raises(InputError) as e:
        prepare_checkpoint_dir(ck)
    assert str(e.value) == f"{ck}: --checkpoint-dir: .zeppelin.lock is a symbolic link, not a file zeppelin wrote " \
                           "(remove it)"
    assert snapshot(tree) == before


MD_OPS = ["write_atomic", "mkdir", "remove", "rename", "create", "open_lock", "read_small"]


@pytest.mark.parametrize("op", MD_OPS)
@pytest.mark.parametrize("kind", KINDS)
def test_managed_dir_never_follows_an_entry(tree, kind, op):
    """Every operation of the one writer of managed directories on every kind of foreign entry: the
    outside stays as it was; the entry is replaced (write, mkdir, remove, rename) or refused."""
    from zeppelin.schemas.common import InputError
    from zeppelin.schemas.io.safefiles import ManagedDir

    d = tree / "w" / "md"
    d.mkdir()
    _plant(d / "x", kind, tree / "outside")
    (d / "src").write_text("new\n")
    outside = snapshot(tree / "outside")
    with ManagedDir(d, "test dir") as md:
        if op == "write_atomic" and kind == "dir":  # a file cannot replace a directory: refused, nothing left
            with pytest.raises(IsADirectoryError):
                md.write_atomic("x", b"new\n")
        elif op == "write_atomic":
            md.write_atomic("x", b"new\n")
            assert (d / "x").read_text() == "new\n" and not (d / "x").is_symlink()
        elif op == "mkdir":
            md.mkdir("x")
            assert (d / "x").is_dir() and not (d / "x").is_symlink() and not any((d / "x").iterdir())
        elif op == "remove":
            md.remove("x")
            assert not os.path.lexists(d / "x")
        elif op == "rename":
            md.rename("src", "x")
            assert (d / "x").read_text() == "new\n" and not (d / "x").is_symlink()
        elif op == "create":
            with pytest.raises(FileExistsError):
                md.create("x")
        elif op == "open_lock":
            with pytest.raises(InputError):
                md.open_lock("x")
        elif kind == "hardlink":  # reading a regular file is harmless
            assert md.read_small("x", "x") == b"victim\n"
        else:
            with pytest.raises(InputError):
                md.read_small("x", "x")
    assert snapshot(tree / "outside") == outside
    assert sorted(os.listdir(d)) == sorted({"x", "src"} - ({"src"} if op == "rename" else set())
                                           - ({"x"} if op == "remove" else set()))


def test_symlinks_at_every_name_a_run_writes(tree):
    """A link to a file or directory outside at every name a run with checkpoints writes: the lock's
    probe, both checkpoints and their temporary directories, ``latest``. The run replaces the links
    (it never writes through one), then a resume of the finished run with ``--report`` exits 0."""
    w, out = tree / "w", tree / "outside"
    shutil.rmtree(w / "ck")
    ck = w / "ck"
    ck.mkdir()
    for name, target in [("latest", "victim.txt"), ("ckpt-000001", "vdir"), ("ckpt-000002", "empty"),
                         (".ckpt-000001.tmp", "vdir"), (".ckpt-000002.tmp", "victim.txt")]:
        os.symlink(out / target, ck / name)
    before = snapshot(out)
    p = _job(["run", "one.jsonl", "--checkpoint-dir", "ck", "--checkpoint-every", "1"], w)
    assert p.returncode == 0, p.stderr
    assert snapshot(out) == before
    assert sorted(os.listdir(ck)) == [".zeppelin.lock", "ckpt-000001", "ckpt-000002", "latest"]
    assert all(not (ck / n).is_symlink() for n in os.listdir(ck))
    assert (ck / "latest").read_text() == "ckpt-000002\n"
    p = _job(["run", "one.jsonl", "--checkpoint-dir", "ck", "--resume", "--report"], w)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == ("zeppelin run: --report: no step ran (the checkpoint is at the end of the "
                                         "run); nothing to report")
    assert snapshot(out) == before


def _tiny_state():
    import torch

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_save_replaces_links_in_process(tree):
    from zeppelin.runtime.checkpoint import save_checkpoint

    ck, out = tree / "w" / "ck2", tree / "outside"
    ck.mkdir()
    for name, target in [("latest", "victim.txt"), ("ckpt-000003", "vdir"), (".ckpt-000003.tmp", "vdir")]:
        os.symlink(out / target, ck / name)
    before = snapshot(out)
    model, opt = _tiny_state()
    save_checkpoint(ck, next_step=3, model=model, optimizer=opt, rng_states=[], plan_hash="h", world_size=1, rank=0)
    assert snapshot(out) == before
    assert sorted(os.listdir(ck)) == ["ckpt-000003", "latest"]
    assert (ck / "latest").read_text() == "ckpt-000003\n" and not (ck / "ckpt-000003").is_symlink()


@pytest.mark.parametrize("argv,message", [
    (["--metrics", "ck/latest"], "ck/latest: the metrics file is inside --checkpoint-dir; name a file outside it"),
    (["--metrics", "ck/m.jsonl"], "ck/m.jsonl: the metrics file is inside --checkpoint-dir; name a file outside it"),
    (["--report-json", "ck/ckpt-000001/state.json"],
     "ck/ckpt-000001/state.json: --report-json is inside --checkpoint-dir; name a file outside it"),
    (["--report-json", "ck/r.json"], "ck/r.json: --report-json is inside --checkpoint-dir; name a file outside it"),
], ids=["metrics-latest", "metrics-new", "report-state", "report-new"])
def test_no_output_inside_the_checkpoint_dir(tree, capsys, argv, message):
    refused(tree, capsys, ["run", "one.jsonl", "--checkpoint-dir", "ck", "--checkpoint-every", "1", *argv], message)


# =============================================================================================
# 10. interrupted and failed saves leave nothing; damaged checkpoints are one line
# =============================================================================================

@pytest.mark.parametrize("failure,message", [
    (OSError(28, "No space left on device"), "No space left on device"),
    (OSError(5, "Input/output error"), "Input/output error"),
    (RuntimeError("storage gone"), "RuntimeError: storage gone"),
    (KeyboardInterrupt(), None),  # SIGTERM in a rank becomes KeyboardInterrupt
])
def test_failed_or_interrupted_save_leaves_no_temporary_directory(tree, monkeypatch, failure, message):
    import torch.distributed.checkpoint as dcp

    from zeppelin.runtime.checkpoint import CheckpointError, save_checkpoint

    ck = tree / "w" / "ck"
    model, opt = _tiny_state()

    def fail(*a, **k):
        (ck / ".ckpt-000002.tmp" / "shard-00001.safetensors").write_bytes(b"")  # half-written
        raise failure

    monkeypatch.setattr(dcp, "save", fail)
    before = snapshot(tree)
    with pytest.raises(CheckpointError if message else KeyboardInterrupt) as e:
        save_checkpoint(ck, next_step=2, model=model, optimizer=opt, rng_states=[], plan_hash="h", world_size=1,
                        rank=0)
    if message:
        assert str(e.value) == f"cannot write checkpoint {ck / 'ckpt-000002'}: {message}"
    assert snapshot(tree) == before


def test_interrupted_save_left_behind_is_removed_under_the_lock(tree):
    from zeppelin.runtime.lifecycle import prepare_checkpoint_dir

    ck = tree / "w" / "ck"
    (ck / ".ckpt-000002.tmp").mkdir()
    (ck / ".ckpt-000002.tmp" / "shard-00001-model.safetensors").write_bytes(b"")
    os.symlink(tree / "outside" / "vdir", ck / ".ckpt-000003.tmp")
    (ck / ".latest.0123456789ab.tmp").write_text("ckpt-000002\n")  # a replaced `latest`, killed before the rename
    (ck / ".zeppelin-write-test-0123456789ab").write_text("")
    (ck / ".keep-me").write_text("not zeppelin's\n")
    outside = snapshot(tree / "outside")
    lock = prepare_checkpoint_dir(ck)
    lock.release()
    assert sorted(os.listdir(ck)) == [".keep-me", ".zeppelin.lock", "ckpt-000001", "latest"]
    assert snapshot(tree / "outside") == outside


def _damage(w: Path, how: str) -> str:
    """Damage the checkpoint; return the expected message."""
    ck = w / "ck" / "ckpt-000001"
    shard = _shard(w)
    rel_shard = f"ck/ckpt-000001/{shard.name}"
    size = shard.stat().st_size
    if how == "shard-empty":
        shard.write_bytes(b"")
        return f"{rel_shard}: damaged checkpoint: shard of 0 bytes has no valid header (truncated?)"
    if how in ("shard-minus-one", "shard-half"):
        n = size - 1 if how == "shard-minus-one" else size // 2
        os.truncate(shard, n)
        return f"{rel_shard}: damaged checkpoint: shard holds {n:,} bytes, its header describes {size:,} (truncated " \
               "or edited)"
    if how == "shard-longer":
        with open(shard, "ab") as fh:
            fh.write(b"\0" * 10)
        return f"{rel_shard}: damaged checkpoint: shard holds {size + 10:,} bytes, its header describes {size:,} " \
               "(truncated or edited)"
    if how == "shard-missing":
        keys = json.loads((ck / "state.json").read_text())["keys"]
        shard.unlink()
        return f"ck/ckpt-000001: damaged checkpoint: no shard holds {len(keys)} of its tensors (first: " \
               f"{sorted(keys)[0]!r}; a shard is missing?)"
    if how == "shard-header-garbage":
        data = bytearray(shard.read_bytes())
        n = int.from_bytes(data[:8], "little")
        data[8:8 + n] = b"[" + b" " * (n - 2) + b"]"
        shard.write_bytes(bytes(data))
        return f"{rel_shard}: damaged checkpoint: shard header is not a JSON object"
    if how == "shard-link":
        shutil.move(shard, w / "moved.safetensors")
        os.symlink(w / "moved.safetensors", shard)
        return f"{rel_shard}: damaged checkpoint: cannot read shard (Too many levels of symbolic links)"
    if how == "state-missing":
        (ck / "state.json").unlink()
        return "ck/latest: checkpoint pointer names 'ckpt-000001', which has no state.json"
    if how == "state-garbage":
        (ck / "state.json").write_text("{")
        return ("ck/ckpt-000001/state.json: checkpoint state: malformed JSON at line 1 column 2: Expecting property "
                "name enclosed in double quotes")
    if how == "state-nan":
        (ck / "state.json").write_text('{"version": NaN}')
        return ("ck/ckpt-000001/state.json: checkpoint state: NaN is not a finite number (JSON numbers must be "
                "finite)")
    if how == "state-version":
        st = json.loads((ck / "state.json").read_text())
        st["version"] = 99
        (ck / "state.json").write_text(json.dumps(st))
        return "ck/ckpt-000001/state.json: not a zeppelin checkpoint (or an unsupported version)"
    if how == "state-keys":
        st = json.loads((ck / "state.json").read_text())
        st["keys"] = "all"
        (ck / "state.json").write_text(json.dumps(st))
        return "ck/ckpt-000001/state.json: checkpoint state lacks a valid 'keys'"
    if how == "state-fifo":
        (ck / "state.json").unlink()
        os.mkfifo(ck / "state.json")
        return "ck/ckpt-000001/state.json: checkpoint state is a FIFO, not a regular file"
    if how == "state-link":
        (ck / "state.json").rename(w / "state-moved.json")
        os.symlink(w / "state-moved.json", ck / "state.json")
        return "ck/ckpt-000001/state.json: checkpoint state is a symbolic link, not a file zeppelin wrote"
    if how == "state-huge":
        with open(ck / "state.json", "ab") as fh:
            fh.truncate(65 << 20)
        return ("ck/ckpt-000001/state.json: checkpoint state of 68,157,440 bytes is larger than the 67,108,864 bytes "
                "zeppelin reads")
    raise AssertionError(how)


DAMAGE = ["shard-empty", "shard-minus-one", "shard-half", "shard-longer", "shard-missing", "shard-header-garbage",
          "shard-link", "state-missing", "state-garbage", "state-nan", "state-version", "state-keys", "state-fifo",
          "state-link", "state-huge"]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_checkpoint_is_one_line_before_any_rank_starts(tree, capsys, how):
    message = _damage(tree / "w", how)
    refused(tree, capsys, ["run", "one.jsonl", "--checkpoint-dir", "ck", "--resume"], message)


# =============================================================================================
# 6. small metadata files: regular files only, bounded reads, never a link
# =============================================================================================

def _latest(w: Path, how: str) -> str:
    p = w / "ck" / "latest"
    p.unlink()
    out = w.parent / "outside"
    if how == "fifo":
        os.mkfifo(p)
        return "ck/latest: checkpoint pointer is a FIFO, not a regular file"
    if how == "link-dev-zero":
        os.symlink("/dev/zero", p)
        return "ck/latest: checkpoint pointer is a symbolic link, not a file zeppelin wrote"
    if how == "link-outside":
        (out / "ptr").write_text("ckpt-000001\n")
        os.symlink(out / "ptr", p)
        return "ck/latest: checkpoint pointer is a symbolic link, not a file zeppelin wrote"
    if how == "link-dangling":
        os.symlink(out / "nowhere", p)
        return "ck/latest: checkpoint pointer is a symbolic link, not a file zeppelin wrote"
    if how == "huge":
        p.write_text("ckpt-000001\n" + " " * 5000)
        return "ck/latest: checkpoint pointer of 5,012 bytes is larger than the 4,096 bytes zeppelin reads"
    if how == "sparse-huge":
        with open(p, "wb") as fh:
            fh.truncate(8 << 30)
        return "ck/latest: checkpoint pointer of 8,589,934,592 bytes is larger than the 4,096 bytes zeppelin reads"
    if how == "directory":
        p.mkdir()
        return "ck/latest: checkpoint pointer is a directory, not a regular file"
    if how == "binary":
        p.write_bytes(b"\xff\xfe\x00ckpt")
        return "ck/latest: checkpoint pointer is not text"
    if how == "escape":
        p.write_text("../../outside/vdir\n")
        return ("ck/latest: checkpoint pointer names '../../outside/vdir', not a checkpoint of this directory "
                "(expected ckpt-NNNNNN)")
    if how == "absent-checkpoint":
        p.write_text("ckpt-000009\n")
        return "ck/latest: checkpoint pointer names 'ckpt-000009', which does not exist"
    if how == "checkpoint-link":
        p.write_text("ckpt-000001\n")
        shutil.move(w / "ck" / "ckpt-000001", out / "ck1")
        os.symlink(out / "ck1", w / "ck" / "ckpt-000001")
        return ("ck/latest: checkpoint pointer names 'ckpt-000001', which does not exist as a directory (it is a "
                "symbolic link)")
    if how == "checkpoint-file":
        p.write_text("ckpt-000001\n")
        shutil.rmtree(w / "ck" / "ckpt-000001")
        (w / "ck" / "ckpt-000001").write_text("x")
        return ("ck/latest: checkpoint pointer names 'ckpt-000001', which does not exist as a directory (it is a "
                "regular file)")
    raise AssertionError(how)


LATEST = ["fifo", "link-dev-zero", "link-outside", "link-dangling", "huge", "sparse-huge", "directory", "binary",
          "escape", "absent-checkpoint", "checkpoint-link", "checkpoint-file"]


@pytest.mark.parametrize("how", LATEST)
def test_bad_latest_is_one_line_and_never_blocks(tree, capsys, how):
    message = _latest(tree / "w", how)
    t0 = time.monotonic()
    refused(tree, capsys, ["run", "one.jsonl", "--checkpoint-dir", "ck", "--resume", "--timeout", "5"], message)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("kind,words", [
    ("fifo", "is a FIFO, not a regular file"), ("dev", "is a character device, not a regular file"),
    ("dir", "is a directory, not a regular file"), ("big", "of 5,000 bytes is larger than the 4,096 bytes zeppelin reads"),
])
def test_read_small_refuses_without_blocking(tmp_path, kind, words):
    from zeppelin.schemas.common import InputError
    from zeppelin.schemas.io.safefiles import read_small

    p = tmp_path / "f"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev":
        os.symlink("/dev/zero", p)
    elif kind == "dir":
        p.mkdir()
    else:
        p.write_bytes(b"x" * 5000)
    with pytest.raises(InputError) as e:
        read_small(p, "record", limit=4096)
    assert str(e.value) == f"{p}: record {words}"


# =============================================================================================
# 3. unusable weights are an error; random initialisation only without any weight file
# =============================================================================================

def _weights(w: Path, how: str) -> str:
    d = w / "hw"
    d.mkdir()
    shutil.copy(w / "hf" / "config.json", d / "config.json")
    st = d / "model.safetensors"
    out = w.parent / "outside"
    if how == "dangling":
        os.symlink(out / "nowhere.safetensors", st)
        return "hw/model.safetensors: weight file is a dangling symbolic link"
    if how == "dev-zero":
        os.symlink("/dev/zero", st)
        return "hw/model.safetensors: weight file is a character device, not a regular file"
    if how == "directory":
        st.mkdir()
        return "hw/model.safetensors: weight file is a directory, not a regular file"
    if how == "link-to-dir":
        os.symlink(out / "vdir", st)
        return "hw/model.safetensors: weight file is a directory, not a regular file"
    if how == "fifo":
        os.mkfifo(st)
        return "hw/model.safetensors: weight file is a FIFO, not a regular file"
    if how == "empty":
        st.write_bytes(b"")
        return "hw/model.safetensors: weight file of 0 bytes is truncated or not safetensors (no complete header)"
    if how == "truncated-header":
        st.write_bytes((w / "hf" / "model.safetensors").read_bytes()[:40])
        return "hw/model.safetensors: weight file of 40 bytes is truncated or not safetensors (no complete header)"
    if how == "second-shard-dangling":
        shutil.copy(w / "hf" / "model.safetensors", d / "model-00001-of-00002.safetensors")
        os.symlink(out / "nowhere", d / "model-00002-of-00002.safetensors")
        return "hw/model-00002-of-00002.safetensors: weight file is a dangling symbolic link"
    formats = {"pickle-only": ["pytorch_model.bin"], "tf-only": ["tf_model.h5"], "flax-only": ["flax_model.msgpack"],
               "index-only": ["model.safetensors.index.json"],
               "pickle-shards": ["pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"]}
    for name in formats[how]:
        (d / name).write_bytes(b"\x80\x02}q\x00.")
    names = ", ".join(n for n in formats[how] if not n.endswith(".index.json")) or formats[how][0]
    return (f"--model hf:hw: weights only as {names}, which zeppelin does not load (pickle or another framework's "
            "format); convert them to safetensors, or remove them to start from random initialisation")


WEIGHTS = ["dangling", "dev-zero", "directory", "link-to-dir", "fifo", "empty", "truncated-header",
           "second-shard-dangling", "pickle-only", "tf-only", "flax-only", "index-only", "pickle-shards"]


@pytest.mark.parametrize("how", WEIGHTS)
def test_unusable_weights_are_refused(tree, capsys, how):
    message = _weights(tree / "w", how)
    refused(tree, capsys, ["run", "hplan.jsonl", "--model", "hf:hw"], message)


@pytest.mark.parametrize("how", ["dangling", "pickle-only", "dev-zero"])
def test_unusable_weights_refused_by_the_runtime_too(tree, how):
    """The ranks' own start-up check (a job started without ``zeppelin run``) says the same."""
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks
    from zeppelin.schemas.common import InputError

    message = _weights(tree / "w", how)
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan="hplan.jsonl", model="hf:hw"), 1)
    assert str(e.value) == message


def test_random_init_only_without_weight_files_and_announced(tree):
    """No weight file at all: the run starts from random initialisation and its first line says so.
    The same job also shows that the environment does not leak into it: an inherited
    ``ZEPPELIN_ERROR_DIR`` holding an earlier job's error and the unprefixed fault hook are ignored."""
    w = tree / "w"
    d = w / "hw"
    d.mkdir()
    shutil.copy(w / "hf" / "config.json", d / "config.json")
    old = tree / "old-errors"
    old.mkdir()
    (old / "rank0.json").write_text(json.dumps({"rank": 0, "time": 0.0, "message": "old failure", "code": 1}))
    before = snapshot(tree)
    p = _job(["run", "hplan.jsonl", "--model", "hf:hw", "--steps", "1", "--metrics", "out.jsonl"], w,
             env={"ZEPPELIN_ERROR_DIR": str(old), "ZEPPELIN_FAULT": "raise:0:0", "ZEPPELIN_STORE_FILE": str(old / "s")})
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == ("zeppelin run: hf:hw holds no weight file: the model starts from random "
                                        "initialisation (seed 0)")
    after = snapshot(tree)
    assert set(after) - set(before) == {"w/out.jsonl"} and {k: after[k] for k in before} == before


# =============================================================================================
# 4. a non-finite loss or gradient stops the run (or is skipped); metrics stay valid JSON
# =============================================================================================

def _nan_checkpoint(w: Path) -> None:
    """Make the checkpoint's final norm weight NaN (its resumed step's loss is then NaN)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shard = _shard(w)
    with safe_open(str(shard), framework="pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    key = next(k for k in tensors if k.endswith("norm.weight") and "layers" not in k)
    tensors[key] = tensors[key] * float("nan")
    save_file(tensors, str(shard), metadata=meta)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_loss(tree, policy):
    from zeppelin.schemas.io.documents import parse_json

    w = tree / "w"
    _nan_checkpoint(w)
    shutil.copy(w / "ck" / "ckpt-000001" / "state.json", w / "st.json")
    args = ["run", "one.jsonl", "--checkpoint-dir", "ck", "--resume", "--metrics", "nan.jsonl"]
    # a decaying rate: the skipped step reports its own (the schedule's), not the last one an update used
    skip = ["--nan-policy", "skip", "--lr-schedule", "linear", "--min-lr", "1e-4"]
    p = _job(args + (skip if policy == "skip" else []), w)
    recs = [parse_json(line) for line in (w / "nan.jsonl").read_text().splitlines()]  # strict JSON: no NaN token
    if policy == "stop":
        assert p.returncode == 1
        assert p.stderr.splitlines()[-1] == (
            "zeppelin: error: job failed: rank 0: step 1: the loss is nan (not finite); the run stopped "
            "(--nan-policy stop; --nan-policy skip leaves such steps out)")
        assert recs == []
        assert (w / "ck" / "latest").read_text() == "ckpt-000001\n"  # no checkpoint of a non-finite state
    else:  # every step of this run is skipped: it fails rather than report success for nothing
        assert p.returncode == 1, p.stderr
        assert p.stderr.splitlines()[-1] == (
            "zeppelin: error: job failed: rank 0: every step of the run (1) had a non-finite loss or gradient norm "
            "and was skipped (--nan-policy skip): nothing was trained and no checkpoint was written")
        assert [(r["step"], r["loss"], r["skipped"]) for r in recs] == [(1, None, "non-finite loss on rank 0")]
        from zeppelin.runtime.optim import LRSchedule

        assert recs[0]["lr"] == LRSchedule(1e-3, 2, "linear", min_lr=1e-4)(1) == pytest.approx(5.5e-4)
        assert recs[0]["grad_norm"] is None
        assert (w / "ck" / "latest").read_text() == "ckpt-000001\n"  # no checkpoint of an untrained model
        assert sorted(p.name for p in (w / "ck").iterdir() if p.name.startswith("ckpt-")) == ["ckpt-000001"]


@pytest.mark.parametrize("value,clean", [
    (float("nan"), None), (float("inf"), None), (-float("inf"), None), (1.5, 1.5),
    ({"a": [1.0, float("nan")], "b": {"c": float("inf")}}, {"a": [1.0, None], "b": {"c": None}}),
])
def test_metrics_records_are_strict_json(value, clean):
    from zeppelin.runtime.train.metrics import finite_json

    assert finite_json(value) == clean
    json.dumps(finite_json(value), allow_nan=False)


# =============================================================================================
# 9. one parser of Hugging Face configs, with bounds and one-line reasons
# =============================================================================================

BIG = 1 << 14
HF_CONFIGS = [
    ("kv-zero", {"num_key_value_heads": 0},
     f"config.json: num_key_value_heads must be an integer from 1 to {BIG:,} or null (got 0)"),
    ("kv-negative", {"num_key_value_heads": -2},
     f"config.json: num_key_value_heads must be an integer from 1 to {BIG:,} or null (got -2)"),
    ("kv-string", {"num_key_value_heads": "2"},
     f"config.json: num_key_value_heads must be an integer from 1 to {BIG:,} or null (got '2')"),
    ("kv-bool", {"num_key_value_heads": True},
     f"config.json: num_key_value_heads must be an integer from 1 to {BIG:,} or null (got True)"),
    ("kv-not-divisor", {"num_key_value_heads": 3}, "config.json: num_attention_heads 4 is not a multiple of "
                                                   "num_key_value_heads 3"),
    ("heads-zero", {"num_attention_heads": 0},
     f"config.json: num_attention_heads must be an integer from 1 to {BIG:,} (got 0)"),
    ("sliding-float", {"model_type": "mistral", "sliding_window": 4096.0},
     "config.json: sliding_window must be an integer from 0 (none) to 4,294,967,296 or null (got 4096.0)"),
    ("sliding-string", {"model_type": "mistral", "sliding_window": "full"},
     "config.json: sliding_window must be an integer from 0 (none) to 4,294,967,296 or null (got 'full')"),
    ("sliding-negative", {"model_type": "mistral", "sliding_window": -1},
     "config.json: sliding_window must be an integer from 0 (none) to 4,294,967,296 or null (got -1)"),
    ("yarn-negative", {"rope_scaling": {"rope_type": "yarn", "factor": -1}},
     "config.json: rope factor must be a number at least 1 and at most 1e+06 (got -1)"),
    ("rope-factor-string", {"rope_parameters": {"rope_type": "linear", "factor": "2", "rope_theta": 10000.0}},
     "config.json: rope factor must be a number at least 1 and at most 1e+06 (got '2')"),
    ("rope-factor-huge", {"rope_scaling": {"rope_type": "dynamic", "factor": 1e9}},
     "config.json: rope factor must be a number at least 1 and at most 1e+06 (got 1000000000.0)"),
    ("rope-scaling-list", {"rope_scaling": [1, 2]}, "config.json: rope scaling must be an object or null (got list)"),
    ("head-dim-dict", {"head_dim": {"a": 1}},
     f"config.json: head_dim must be an integer from 1 to {BIG:,} or null (got {{'a': 1}})"),
    ("head-dim-float", {"head_dim": 16.0},
     f"config.json: head_dim must be an integer from 1 to {BIG:,} or null (got 16.0)"),
    ("rope-theta-list", {"rope_theta": [10000]},
     "config.json: rope_theta must be a number greater than 0 and at most 1e+12 (got [10000])"),
    ("rope-theta-zero", {"rope_theta": 0},
     "config.json: rope_theta must be a number greater than 0 and at most 1e+12 (got 0)"),
    ("rope-theta-negative", {"rope_theta": -5.0},
     "config.json: rope_theta must be a number greater than 0 and at most 1e+12 (got -5.0)"),
    ("eps-list", {"rms_norm_eps": [1e-6]},
     "config.json: rms_norm_eps must be a number greater than 0 and at most 1 (got [1e-06])"),
    ("eps-zero", {"rms_norm_eps": 0}, "config.json: rms_norm_eps must be a number greater than 0 and at most 1 (got 0)"),
    ("eps-large", {"rms_norm_eps": 2}, "config.json: rms_norm_eps must be a number greater than 0 and at most 1 (got 2)"),
    ("max-pos-zero", {"max_position_embeddings": 0},
     "config.json: max_position_embeddings must be an integer from 1 to 4,294,967,296 or null (got 0)"),
    ("max-pos-float", {"max_position_embeddings": 4096.5},
     "config.json: max_position_embeddings must be an integer from 1 to 4,294,967,296 or null (got 4096.5)"),
    ("tie-string", {"tie_word_embeddings": "yes"}, "config.json: tie_word_embeddings must be true or false (got 'yes')"),
    ("hidden-huge", {"hidden_size": 1 << 30},
     "config.json: hidden_size must be an integer from 1 to 1,048,576 (got 1073741824)"),
    ("vocab-zero", {"vocab_size": 0}, "config.json: vocab_size must be an integer from 1 to 16,777,216 (got 0)"),
    ("ffn-string", {"intermediate_size": "big"},
     "config.json: intermediate_size must be an integer from 1 to 4,194,304 (got 'big')"),
    ("layers-missing", {"num_hidden_layers": None},
     f"config.json: num_hidden_layers must be an integer from 1 to {BIG:,} (missing)"),
    ("hidden-not-divisible", {"hidden_size": 66, "head_dim": None},
     "config.json does not describe a supported decoder: hidden (66) must be divisible by num_heads (4)"),
    ("head-dim-odd", {"hidden_size": 60, "head_dim": None},
     "config.json does not describe a supported decoder: head_dim = hidden / num_heads = 15 must be even (rotary "
     "embeddings rotate pairs of channels)"),
    ("head-dim-odd-given", {"head_dim": 31}, "config.json has a bad head_dim 31 (an even integer >= 2)"),
    ("not-an-object", [1, 2], "config.json is not a JSON object"),
    ("dtype-list", {"dtype": ["float32"]}, "dtype ['float32'] is not one of float32, bfloat16, float16"),
    ("dtype-int8", {"dtype": "int8"}, "dtype 'int8' is not one of float32, bfloat16, float16"),
    ("model-type-list", {"model_type": ["llama"]},
     "model_type ['llama'] is not supported (supported: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, "
     "qwen3_moe)"),
    ("act-list", {"hidden_act": ["silu"]}, "hidden_act ['silu'] is not supported (SwiGLU with silu only)"),
]


def _hf_config(w: Path, edit) -> None:
    """``hc/config.json``: the test model's config with ``edit`` applied (None removes a key)."""
    d = w / "hc"
    d.mkdir()
    c = json.loads((w / "hf" / "config.json").read_text())
    if isinstance(edit, dict):
        c.update(edit)
        c = {k: v for k, v in c.items() if not (v is None and k in edit)}
    else:
        c = edit
    (d / "config.json").write_text(json.dumps(c))


PLAN_HC = ["plan", "-m", "m.jsonl", "--model", "hf:hc", "-c", "local-cpu:1x1", "--steps", "1",
           "--tokens-per-step", "512", "-q", "-o", "o.jsonl"]


@pytest.mark.parametrize("edit,message", [c[1:] for c in HF_CONFIGS], ids=[c[0] for c in HF_CONFIGS])
def test_hf_config_refused_by_the_planner(tree, capsys, edit, message):
    _hf_config(tree / "w", edit)
    refused(tree, capsys, PLAN_HC, f"hc/config.json: {message}")


@pytest.mark.parametrize("edit,message", [c[1:] for c in HF_CONFIGS[:4] + HF_CONFIGS[6:8] + HF_CONFIGS[9:10]],
                         ids=[c[0] for c in HF_CONFIGS[:4] + HF_CONFIGS[6:8] + HF_CONFIGS[9:10]])
def test_hf_config_refused_by_the_runtime_alike(tree, edit, message):
    """The runtime reads the config through the same parser: the same line, before any process group."""
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks
    from zeppelin.schemas.common import InputError

    _hf_config(tree / "w", edit)
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan="hplan.jsonl", model="hf:hc"), 1)
    assert str(e.value) == f"hc/config.json: {message}"


@pytest.mark.parametrize("ref,message", [
    ("hf:~nosuchuser/x", "--model hf:~nosuchuser/x: cannot expand '~nosuchuser' (no such user)"),
    ("hf:", "--model hf:: hf: needs a directory (hf:DIR names a directory with config.json)"),
    ("hf:m.jsonl", "--model hf:m.jsonl: m.jsonl is not a directory (hf:DIR names a directory with config.json)"),
    ("hf:tok", "--model hf:tok: no config.json in tok"),
])
def test_hf_reference_refused(tree, capsys, ref, message):
    refused(tree, capsys, [*PLAN_HC[:4], ref, *PLAN_HC[5:]], message)


@pytest.mark.parametrize("kind,message", [
    ("fifo", "hc/config.json: config.json is a FIFO, not a regular file"),
    ("dev-zero", "hc/config.json: config.json is a character device, not a regular file"),
    ("huge", "hc/config.json: config.json of 68,157,440 bytes is larger than the 67,108,864 bytes zeppelin reads"),
])
def test_hf_config_file_is_a_bounded_regular_file(tree, capsys, kind, message):
    d = tree / "w" / "hc"
    d.mkdir()
    if kind == "fifo":
        os.mkfifo(d / "config.json")
    elif kind == "dev-zero":
        os.symlink("/dev/zero", d / "config.json")
    else:
        with open(d / "config.json", "wb") as fh:
            fh.truncate(65 << 20)
    refused(tree, capsys, PLAN_HC, message)


@pytest.mark.parametrize("max_pos,ok", [(16, False), (299, False), (300, True), (4096, True)])
def test_sequences_beyond_max_position_embeddings_are_refused(tree, capsys, max_pos, ok):
    _hf_config(tree / "w", {"max_position_embeddings": max_pos})
    if ok:
        rc, _, err = run_cli(PLAN_HC, capsys)
        assert rc == 0, err
    else:
        refused(tree, capsys, PLAN_HC, f"--model hf:hc: a sequence of 300 tokens is longer than the model's "
                                       f"max_position_embeddings {max_pos:,} (config.json)")


# =============================================================================================
# 10. --export targets are checked before any work
# =============================================================================================

def _export_target(w: Path, how: str) -> tuple[list[str], str]:
    out = w.parent / "outside"
    if how == "under-file":
        return ["--export", "x.txt/model"], "x.txt/model: --export cannot be made: x.txt is not a directory"
    if how == "deep-under-file":
        return ["--export", "x.txt/a/b"], "x.txt/a/b: --export cannot be made: x.txt is not a directory"
    if how == "in-checkpoint-dir":
        return (["--checkpoint-dir", "ck", "--export", "ck/model"],
                "ck/model: --export is inside --checkpoint-dir; name a directory outside it")
    if how == "link-to-empty":
        os.symlink(out / "empty", w / "exp")
        return ["--export", "exp"], "exp: --export is a symbolic link; name a new or empty directory"
    if how == "link-to-dir":
        os.symlink(out / "vdir", w / "exp")
        return ["--export", "exp"], "exp: --export is a symbolic link; name a new or empty directory"
    if how == "dangling-link":
        os.symlink(out / "nowhere", w / "exp")
        return ["--export", "exp"], "exp: --export is a symbolic link; name a new or empty directory"
    if how == "a-file":
        return ["--export", "x.txt"], "x.txt: --export: the path exists and is not a directory"
    if how == "non-empty":
        return ["--export", "tok"], "tok: --export: the directory exists and is not empty"
    if how == "the-plan":
        return ["--export", "one.jsonl"], "one.jsonl: --export would overwrite an input file"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["under-file", "deep-under-file", "in-checkpoint-dir", "link-to-empty", "link-to-dir",
                                 "dangling-link", "a-file", "non-empty", "the-plan"])
def test_export_target_checked_up_front(tree, capsys, how):
    extra, message = _export_target(tree / "w", how)
    refused(tree, capsys, ["run", "one.jsonl", *extra], message)


# =============================================================================================
# 7, 8, 11. environment, a stopped launcher, spec hashes, long names, the blamed rank
# =============================================================================================

def test_fault_hook_is_namespaced(monkeypatch):
    from zeppelin.runtime import lifecycle

    monkeypatch.setenv("ZEPPELIN_FAULT", "raise:0:0")
    lifecycle.maybe_fault(0, 0)  # the unprefixed name of older releases does nothing
    monkeypatch.setenv("ZEPPELIN_TEST_FAULT", "raise:0:0")
    with pytest.raises(RuntimeError, match="injected fault at step 0"):
        lifecycle.maybe_fault(0, 0)


def _runs_module(pid: int, module: bytes) -> bool:
    """Whether process ``pid`` runs ``python -m MODULE`` (exactly that module)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            args = fh.read().split(b"\0")
    except OSError:
        return False
    return any(a == b"-m" and i + 1 < len(args) and args[i + 1] == module for i, a in enumerate(args))


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as fh:
                    if int(fh.read().rpartition(b")")[2].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("who", ["launcher", "rank"])
def test_a_stopped_process_is_bounded_by_timeout(tree, who):
    """SIGSTOP to the launcher (its ranks finish, nobody reports) or to the only rank (no peer times
    out): the command still ends within about --timeout, with one line."""
    w = tree / "w"
    proc = subprocess.Popen([ZEPPELIN, "run", "one.jsonl", "--timeout", "2", "--metrics", "s.jsonl"], cwd=w,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 60
    target = []
    while not target:  # the event: the process exists (a short-lived helper process is not it)
        assert time.monotonic() < deadline and proc.poll() is None, f"no {who}"
        found = [c for c in _children(proc.pid) if _runs_module(c, b"zeppelin.runtime.launch")]
        if who == "rank":
            found = [r for c in found for r in _children(c) if _runs_module(r, b"zeppelin.runtime")]
        for pid in found:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:  # it ended between the listing and the signal
                continue
            target = [pid]
            break
        time.sleep(0.01)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.splitlines()[-1] == (
        f"zeppelin: error: the launcher (pid {target[0]}) was stopped for more than --timeout 2 s; the job was killed"
        if who == "launcher" else
        "zeppelin: error: job failed: rank 0 was stopped (SIGSTOP) for more than --timeout 2 s; every rank ended")
    assert time.monotonic() - t0 < 30


def _edit_embedded(w: Path, part: str) -> None:
    from zeppelin.schemas.plan import read_plan, write_plan

    h, steps = read_plan(w / "one.jsonl")
    if part == "model":
        h = h.model_copy(update={"model": h.model.model_copy(update={"ffn_hidden": h.model.ffn_hidden * 2})})
    elif part == "cluster":
        gpu = h.cluster.gpu.model_copy(update={"memory_gb": h.cluster.gpu.memory_gb * 2})
        h = h.model_copy(update={"cluster": h.cluster.model_copy(update={"gpu": gpu})})
    else:
        h = h.model_copy(update={"profile": h.profile.model_copy(update={"backward_linear_factor": 3.0})})
    write_plan(w / "bad.jsonl", h, steps)  # a valid digest: the edit shows only in the spec hashes


@pytest.mark.parametrize("command", ["simulate", "show"])
@pytest.mark.parametrize("part", ["model", "cluster", "profile"])
def test_simulate_and_show_check_embedded_spec_hashes(tree, capsys, command, part):
    from zeppelin.schemas.common import content_hash
    from zeppelin.schemas.plan import PlanReader

    _edit_embedded(tree / "w", part)
    h = PlanReader("bad.jsonl").header
    got, want = content_hash(getattr(h, part)), getattr(h.hashes, part)
    refused(tree, capsys, [command, "bad.jsonl"],
            f"bad.jsonl: the plan's embedded {part} hashes to {got}, its header records {want} (the plan was edited "
            "after planning)")


@pytest.mark.parametrize("argv", [
    ["plan", "-m", "m.jsonl", "--model", "tiny", "-c", "local-cpu:1x1", "--steps", "1", "-q", "-o", "N"],
    ["simulate", "one.jsonl", "-o", "N"],
    ["presets", "--dump", "tiny", "-o", "N"],
], ids=["plan", "simulate", "presets"])
def test_a_254_character_output_name_is_accepted(tree, capsys, argv):
    name = "n" * 248 + ".jsonl"
    rc, _, err = run_cli([name if a == "N" else a for a in argv], capsys)
    assert rc == 0, err
    assert (tree / "w" / name).is_file()


@pytest.mark.parametrize("stem", [10, 200, 241, 248, 250])
def test_default_metrics_name_of_a_long_plan_name_is_legal(tmp_path, stem):
    from zeppelin.runtime.config import RunConfig
    from zeppelin.schemas.io.safefiles import check_output

    cfg = RunConfig(plan=str(tmp_path / ("p" * stem + ".jsonl")))
    name = cfg.metrics_path.name
    assert len(name.encode()) <= 255 and name.endswith(".metrics.jsonl") and name.startswith("p" * min(stem, 241))
    check_output(cfg.metrics_path)
    cfg.metrics_path.write_text("")


class _Exit:
    def __init__(self, code: int, t: float = 0.0):
        self.exitcode, self.time = code, t


@pytest.mark.parametrize("code,how", [
    (143, "was stopped by SIGTERM (exit code 143)"), (-int(signal.SIGTERM), "was killed by SIGTERM"),
    (129, "was stopped by SIGHUP (exit code 129)"), (130, "was stopped by SIGINT (exit code 130)"),
    (-int(signal.SIGKILL), "was killed by SIGKILL (e.g. by the out-of-memory killer)"),
])
def test_a_signalled_rank_is_blamed_not_its_peers(tmp_path, code, how):
    """Rank 1 of 8 ends on a signal nobody in the job sent; ranks 2-7 then fail on the lost peer and
    report first. The local launcher names rank 1."""
    from zeppelin.runtime.launch import PEER_STOPPED_EXIT, classify_failure

    for r in range(2, 8):
        (tmp_path / f"rank{r}.json").write_text(json.dumps(
            {"rank": r, "time": 1.0 + r, "message": "RuntimeError: Connection closed by peer", "code": 1}))
    failures = {1: _Exit(code, 2.0), **{r: _Exit(1, 1.0 + r) for r in range(2, 8)}}
    msg, rc = classify_failure(tmp_path, failures, [0], stopped=frozenset({PEER_STOPPED_EXIT}))
    assert (msg, rc) == (f"rank 1 {how} (then rank 2: RuntimeError: Connection closed by peer)", 1)


def test_a_rank_leaving_for_its_peer_is_not_blamed(tmp_path):
    from zeppelin.runtime.launch import PEER_STOPPED_EXIT, classify_failure

    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "time": 2.0, "message": "step 3: the loss is nan",
                                                     "code": 1}))
    msg, rc = classify_failure(tmp_path, {0: _Exit(PEER_STOPPED_EXIT, 1.0), 1: _Exit(1, 2.0)}, [],
                               stopped=frozenset({PEER_STOPPED_EXIT}))
    assert (msg, rc) == ("rank 1: step 3: the loss is nan", 1)


@pytest.mark.parametrize("entry", ["link", "fifo", "huge"])
def test_error_records_are_read_bounded_and_never_block(tmp_path, entry):
    from zeppelin.runtime.launch import _read_errors

    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "time": 1.0, "message": "real", "code": 1}))
    p = tmp_path / "rank1.json"
    if entry == "link":
        os.symlink("/dev/zero", p)
    elif entry == "fifo":
        os.mkfifo(p)
    else:
        with open(p, "wb") as fh:
            fh.truncate(2 << 20)
    assert list(_read_errors(tmp_path)) == [0]
