"""Hostile inputs through every command: one line, exit code 2, and no file changed or appeared.

Each case runs the ``zeppelin`` entry point in-process in a fresh copy of a small working directory
(a valid plan, manifest, cluster / model / profile files) and asserts the exit code, the exact
``zeppelin: error: ...`` line on stderr, and that a snapshot of the directory (every name, mode and
content, hidden files included) is the same before and after. docs/RELIABILITY.md maps each
guarantee to these tests.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeppelin.planner.cli import main as zeppelin_main

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------- harness
def snapshot(d: Path) -> dict:
    """Every entry under ``d``: kind, mode and (for files) content."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = os.lstat(p)
        rel = str(p.relative_to(d))
        if stat.S_ISREG(st.st_mode):
            out[rel] = ("file", st.st_mode, p.read_bytes())
        elif stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", os.readlink(p))
        else:
            out[rel] = ("other", st.st_mode)
    return out


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        zeppelin_main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A working directory with a valid 2-step plan and the files it was made from."""
    d = tmp_path_factory.mktemp("hostile-template")
    old = os.getcwd()
    os.chdir(d)
    try:
        (d / "m.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in [300, 500, 700, 900] * 8))
        for argv in (["presets", "--dump", "local-cpu:2", "-o", "cluster.json"],
                     ["presets", "--dump", "tiny", "-o", "model.json"]):
            with _quiet():
                zeppelin_main(argv)
        with _quiet():
            zeppelin_main(["plan", "-m", "m.jsonl", "-c", "cluster.json", "--model", "model.json", "--steps", "2",
                           "--tokens-per-step", "2048", "-q", "-o", "p.jsonl"])
        (d / "x.txt").write_text("3\n4\n5\n")
    finally:
        os.chdir(old)
    return d


class _quiet:
    def __enter__(self):
        import contextlib
        import io

        self._cm = contextlib.redirect_stdout(io.StringIO())
        self._cm.__enter__()

    def __exit__(self, *a):
        self._cm.__exit__(*a)
        e = a[1]
        if isinstance(e, SystemExit) and e.code in (0, None):
            return True
        return False


@pytest.fixture
def work(template, tmp_path, monkeypatch) -> Path:
    d = tmp_path / "w"
    shutil.copytree(template, d, symlinks=True)
    monkeypatch.chdir(d)
    return d


def assert_refused(work: Path, capsys, argv: list[str], message: str, code: int = 2) -> None:
    before = snapshot(work)
    rc, out, err = run_cli(argv, capsys)
    assert (rc, err) == (code, f"zeppelin: error: {message}\n"), out
    assert snapshot(work) == before


# ------------------------------------------------------------------------------------------- outputs
PLAN = ["plan", "-m", "m.jsonl", "-c", "local-cpu:2", "--model", "tiny", "--steps", "1", "-q",
        "--tokens-per-step", "2048"]

OUTPUT_CASES = [
    ("plan-o-manifest", PLAN + ["-o", "m.jsonl"], "m.jsonl: output would overwrite an input file"),
    ("plan-o-txt-manifest", ["plan", "-m", "x.txt", "-c", "local-cpu:2", "--model", "tiny", "-o", "x.txt"],
     "x.txt: output would overwrite an input file"),
    ("plan-o-cluster", PLAN[:4] + ["cluster.json"] + PLAN[5:] + ["-o", "cluster.json"],
     "cluster.json: output would overwrite an input file"),
    ("plan-o-model", ["plan", "-m", "m.jsonl", "-c", "local-cpu:2", "--model", "model.json", "-o", "model.json"],
     "model.json: output would overwrite an input file"),
    ("plan-o-hardlink", PLAN + ["-o", "hard.jsonl"], "hard.jsonl: output would overwrite an input file (m.jsonl)"),
    ("plan-o-symlink", PLAN + ["-o", "soft.jsonl"], "soft.jsonl: output would overwrite an input file (m.jsonl)"),
    ("plan-o-dev-full", PLAN + ["-o", "/dev/full"], "/dev/full: output path is a character device, not a regular file"),
    ("plan-o-dev-null-link", PLAN + ["-o", "null.jsonl"],
     "null.jsonl: output path is a character device, not a regular file"),
    ("plan-o-fifo", PLAN + ["-o", "fifo"], "fifo: output path is a FIFO, not a regular file"),
    ("plan-o-dir", PLAN + ["-o", "sub"], "sub: output path is a directory"),
    ("plan-o-cwd", PLAN + ["-o", "."], ".: output path is a directory"),
    ("plan-o-dangling", PLAN + ["-o", "dangling"], "dangling: output path is a dangling symbolic link"),
    ("plan-o-under-file", PLAN + ["-o", "x.txt/p.jsonl"], "x.txt/p.jsonl: cannot write output: Not a directory"),
    ("plan-o-long-name", PLAN + ["-o", "a" * 300],
     f"{'a' * 300}: cannot write output: File name too long"),
    ("simulate-o-plan", ["simulate", "p.jsonl", "-o", "p.jsonl"], "p.jsonl: output would overwrite an input file"),
    ("simulate-o-plan-link", ["simulate", "p.jsonl", "-o", "plan-link"],
     "plan-link: output would overwrite an input file (p.jsonl)"),
    ("simulate-o-dev-full", ["simulate", "p.jsonl", "-o", "/dev/full"],
     "/dev/full: output path is a character device, not a regular file"),
    ("simulate-o-fifo", ["simulate", "p.jsonl", "-o", "fifo"], "fifo: output path is a FIFO, not a regular file"),
    ("show-png-plan", ["show", "p.jsonl", "--png", "p.jsonl"], "p.jsonl: output would overwrite an input file"),
    ("show-png-dev", ["show", "p.jsonl", "--png", "/dev/full"],
     "/dev/full: output path is a character device, not a regular file"),
    ("compare-o-cluster", ["compare", "-c", "cluster.json", "-m", "tiny", "-n", "1", "-o", "cluster.json"],
     "cluster.json: output would overwrite an input file"),
    ("compare-png-dataset", ["compare", "-c", "local-cpu:2", "-m", "tiny", "-n", "1", "-d", "m.jsonl",
                             "--png", "m.jsonl"], "m.jsonl: output would overwrite an input file"),
    ("compare-o-equals-png", ["compare", "-c", "local-cpu:2", "-m", "tiny", "-n", "1", "-o", "c.png",
                              "--png", "c.png"], "c.png: -o and --png name the same file"),
    ("data-png-manifest", ["data", "stats", "x.png", "--png", "x.png"], "x.png: output would overwrite an input file"),
    ("data-png-dev", ["data", "stats", "m.jsonl", "--png", "null.png"],
     "null.png: output path is a character device, not a regular file"),
    ("presets-dump-dev", ["presets", "--dump", "tiny", "-o", "/dev/full"],
     "/dev/full: output path is a character device, not a regular file"),
    ("presets-dump-fifo", ["presets", "--dump", "tiny", "-o", "fifo"], "fifo: output path is a FIFO, not a regular file"),
    ("schema-o-dir", ["schema", "plan", "-o", "sub"], "sub: output path is a directory"),
    ("run-metrics-plan", ["run", "p.jsonl", "--metrics", "p.jsonl"], "p.jsonl: output would overwrite an input file"),
    ("run-metrics-data", ["run", "p.jsonl", "--data", "m.jsonl", "--metrics", "m.jsonl"],
     "m.jsonl: output would overwrite an input file"),
    ("run-metrics-dev", ["run", "p.jsonl", "--metrics", "/dev/full"],
     "/dev/full: output path is a character device, not a regular file"),
    ("run-report-json-plan", ["run", "p.jsonl", "--report-json", "p.jsonl"],
     "p.jsonl: output would overwrite an input file"),
    ("run-report-json-metrics", ["run", "p.jsonl", "--metrics", "out.jsonl", "--report-json", "out.jsonl"],
     "out.jsonl: --report-json and the metrics file are the same file"),
    ("profile-o-model", ["profile", "--model", "model.json", "-o", "model.json"],
     "model.json: output would overwrite an input file"),
    ("profile-o-dev", ["profile", "-o", "/dev/full"], "/dev/full: output path is a character device, not a regular file"),
]


def _extras(work: Path) -> None:
    """Links, a FIFO and a directory the output cases point at."""
    os.link(work / "m.jsonl", work / "hard.jsonl")
    os.symlink("m.jsonl", work / "soft.jsonl")
    os.symlink("/dev/null", work / "null.jsonl")
    os.symlink("/dev/null", work / "null.png")
    os.symlink("p.jsonl", work / "plan-link")
    os.symlink("missing/nowhere", work / "dangling")
    os.mkfifo(work / "fifo")
    (work / "sub").mkdir()
    (work / "x.png").write_text("5\n6\n")


@pytest.mark.parametrize("argv,message", [c[1:] for c in OUTPUT_CASES], ids=[c[0] for c in OUTPUT_CASES])
def test_output_refused(work, capsys, argv, message):
    _extras(work)
    assert_refused(work, capsys, argv, message)


def test_output_through_symlink_replaces_the_target(work, capsys):
    (work / "old.json").write_text("{}")
    os.symlink("old.json", work / "link.json")
    rc, _, err = run_cli(["presets", "--dump", "tiny", "-o", "link.json"], capsys)
    assert rc == 0, err
    assert os.path.islink(work / "link.json")
    assert json.loads((work / "old.json").read_text())["name"] == "tiny"


# ------------------------------------------------------------------------------------ write errors
WRITE_ERRORS = [
    (errno.ENOSPC, "No space left on device"),
    (errno.EACCES, "Permission denied"),
    (errno.EROFS, "Read-only file system"),
    (errno.EIO, "Input/output error"),
    (errno.EDQUOT, "Disk quota exceeded"),
]


@pytest.mark.parametrize("command", ["plan", "simulate", "presets", "schema"])
@pytest.mark.parametrize("err,reason", WRITE_ERRORS, ids=[errno.errorcode[e] for e, _ in WRITE_ERRORS])
def test_write_errors_are_one_line(work, capsys, monkeypatch, command, err, reason):
    argv = {"plan": PLAN + ["-o", "out.jsonl"], "simulate": ["simulate", "p.jsonl", "-o", "out.jsonl"],
            "presets": ["presets", "--dump", "tiny", "-o", "out.jsonl"],
            "schema": ["schema", "plan", "-o", "out.jsonl"]}[command]

    def fail(fd):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "fsync", fail)
    assert_refused(work, capsys, argv, f"out.jsonl: cannot write output: {reason}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_signal_while_writing_leaves_nothing(work, sig):
    """A plan interrupted while it writes: exit 128+N, one line, no temporary file, no output."""
    before = snapshot(work)
    # plan many steps so that the signal lands while the plan file is being written
    proc = subprocess.Popen([sys.executable, "-c", "from zeppelin.planner.cli import main; main()", *PLAN[:7],
                             "--steps", "200", "-q", "--tokens-per-step", "2048", "-o", "big.jsonl"],
                            stderr=subprocess.PIPE, text=True, cwd=work)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(p.name.startswith(".big.jsonl.") for p in work.iterdir()):
        time.sleep(0.01)
    assert any(p.name.startswith(".big.jsonl.") for p in work.iterdir()), "the plan never started writing"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig
    assert err.splitlines()[-1] == f"zeppelin: terminated by {signal.Signals(sig).name}"
    assert snapshot(work) == before


# ---------------------------------------------------------------------------------- no code from data
CODE = ("tokenizer 'os:system' names Python code, which a manifest or case file may not do (built-in tokenizers: "
        "'whitespace', 'bytes' or a tokenizer.json path; `zeppelin data stats --python-tokenizer MODULE:CALLABLE` runs code you name on "
        "the command line)")


def _code_manifest(work: Path) -> None:
    """A manifest whose tokenizer would run each record's text as a shell command."""
    (work / "t.jsonl").write_text(json.dumps({"text": "touch pwned"}) + "\n")
    (work / "evil.manifest.json").write_text(json.dumps(
        {"paths": ["t.jsonl"], "text_field": "text", "tokenizer": "os:system"}))
    (work / "cases").mkdir()
    (work / "cases" / "c.json").write_text(json.dumps(
        {"cluster": "local-cpu:2", "model": "tiny", "dataset": "../evil.manifest.json", "planner": "packed-dp",
         "steps": 1, "tokens_per_step": 2048, "tolerance": 0.1}))


CODE_CASES = [
    ("data-stats", ["data", "stats", "evil.manifest.json"], f"evil.manifest.json: {CODE}"),
    ("plan", ["plan", "-m", "evil.manifest.json", "-c", "local-cpu:2", "--model", "tiny", "-o", "o.jsonl"],
     f"evil.manifest.json: {CODE}"),
    ("compare", ["compare", "-c", "local-cpu:2", "-m", "tiny", "-n", "1", "-d", "evil.manifest.json"],
     f"evil.manifest.json: {CODE}"),
    ("check-case", ["check", "cases"], f"c: bad input: cases/../evil.manifest.json: {CODE}"),
    ("validate", ["validate", "p.jsonl", "--manifest", "evil.manifest.json"], f"evil.manifest.json: {CODE}"),
    ("demo", ["demo", "--manifest", "evil.manifest.json", "--cluster", "local-cpu:2", "--model", "tiny"],
     f"evil.manifest.json: {CODE}"),
    ("data-stats-cli-tokenizer", ["data", "stats", "t.jsonl", "--text-field", "text", "--tokenizer", "os:system"],
     CODE),
    ("python-tokenizer-no-text-field", ["data", "stats", "t.jsonl", "--python-tokenizer", "builtins:len"],
     "--python-tokenizer needs --text-field"),
    ("python-tokenizer-bad-ref", ["data", "stats", "t.jsonl", "--text-field", "text", "--python-tokenizer", "os"],
     "--python-tokenizer 'os': expected MODULE:CALLABLE"),
    ("python-tokenizer-missing", ["data", "stats", "t.jsonl", "--text-field", "text", "--python-tokenizer",
                                  "nosuchmod_zz:f"],
     "--python-tokenizer: cannot import module 'nosuchmod_zz' (ModuleNotFoundError: No module named 'nosuchmod_zz')"),
    ("python-tokenizer-both", ["data", "stats", "t.jsonl", "--text-field", "text", "--tokenizer", "bytes",
                               "--python-tokenizer", "builtins:len"],
     "--tokenizer and --python-tokenizer exclude each other"),
]


@pytest.mark.parametrize("argv,message", [c[1:] for c in CODE_CASES], ids=[c[0] for c in CODE_CASES])
def test_data_never_names_code(work, capsys, argv, message):
    _code_manifest(work)
    assert_refused(work, capsys, argv, message)


def test_python_tokenizer_only_from_the_command_line(work, capsys):
    _code_manifest(work)
    rc, out, err = run_cli(["data", "stats", "t.jsonl", "--text-field", "text", "--python-tokenizer", "builtins:len",
                            "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["num_tokens"] == len("touch pwned")


def test_no_import_or_unpickling_of_data_in_the_source():
    """Only fixed module names are imported, and only the --python-tokenizer option imports a name the
    user gave; nothing unpickles with pickle or numpy's allow_pickle (torch.load is checked by the
    checkpoint tests)."""
    hits: dict[str, list[str]] = {}
    for pkg in ("schemas", "planner", "runtime"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            text = f.read_text()
            for needle in ("import_module(", "__import__(", "exec(", "eval(", "pickle.load", "allow_pickle=True",
                           "runpy", "marshal.load"):
                if needle in text:
                    hits.setdefault(needle, []).append(str(f.relative_to(ROOT)))
    assert hits.pop("import_module(", []) == ["planner/cli/data.py", "planner/core/registry.py",
                                              "planner/zeppelin/planner.py"]
    assert hits == {}
    # the two fixed-name imports: string constants naming zeppelin's own modules
    assert 'import_module(f"zeppelin.planner.zeppelin.{module}")' in (ROOT / "planner/zeppelin/planner.py").read_text()
    assert '"zeppelin.planner.baselines",' in (ROOT / "planner/core/registry.py").read_text()
