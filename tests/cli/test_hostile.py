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
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.support.plans import sealed

from zeppelin.planner.cli import main as zeppelin_main

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- harness
def snapshot(d: Path) -> dict:
    """Every entry under ``d``: kind, mode and (for files) content."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = os.lstat(p)
        rel = str(p.relative_to(d))
        if stat.S_ISREG(st.st_mode) and st.st_size > 8 << 20:  # large (sparse) files: size and times
            out[rel] = ("file", st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
        elif stat.S_ISREG(st.st_mode):
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
        # a two-node plan whose long sequence spans both nodes: it has routes over NICs and proxies (rings
        # of the tiered layouts: no family's groups)
        (d / "long.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in [100000, 2000, 3000, 5000] * 4))
        with _quiet():
            zeppelin_main(["plan", "-m", "long.jsonl", "--no-shuffle", "-c", "zeppelin-a:2", "--model", "llama-7b",
                           "--steps", "1", "--tokens-per-step", "110000", "--ilp", "never", "--families", "none",
                           "-q", "-o", "r.jsonl"])
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
    ("compare-o-cluster", ["compare", "-c", "cluster.json", "--model", "tiny", "--steps", "1", "-o", "cluster.json"],
     "cluster.json: output would overwrite an input file"),
    ("compare-png-dataset", ["compare", "-c", "local-cpu:2", "--model", "tiny", "--steps", "1", "-m", "m.jsonl",
                             "--png", "m.jsonl"], "m.jsonl: output would overwrite an input file"),
    ("compare-o-equals-png", ["compare", "-c", "local-cpu:2", "--model", "tiny", "--steps", "1", "-o", "c.png",
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
    # wait for the event (the temporary plan file appears); the deadline only guards against a hang
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".big.jsonl.") for p in work.iterdir()):
        assert proc.poll() is None, f"the plan ended before it was seen writing: {proc.communicate()[1]}"
        assert time.monotonic() < deadline, "the plan never started writing"
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
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
    ("compare", ["compare", "-c", "local-cpu:2", "--model", "tiny", "--steps", "1", "-m", "evil.manifest.json"],
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
    assert hits.pop("import_module(", []) == ["planner/cli/data.py", "planner/core/registry.py"]
    assert hits == {}
    # the fixed-name import: string constants naming zeppelin's own modules
    assert '"zeppelin.planner.baselines",' in (ROOT / "planner/core/registry.py").read_text()


# ------------------------------------------------------------------------------- one validation path
def _mb(s):
    return s["microbatches"][0]


def _route_mb(s):
    return next(mb for mb in s["microbatches"] if mb["routes"])


# (name, edit of the header dict h and the first step dict s, the problem every reader reports)
PLAN_EDITS = [
    ("group-unit-99", lambda h, s: _mb(s)["groups"][0]["units"].__setitem__(0, 99),
     "step 0 microbatch 0: group 0 names unit 99 (have 16)"),
    ("group-unit-negative", lambda h, s: _mb(s)["groups"][0]["units"].__setitem__(0, -1),
     "step 0 microbatch 0: group 0 names unit -1 (have 16)"),
    ("queue-group-99", lambda h, s: _mb(s)["queues"][0].append(99),
     "step 0 microbatch 0: unit 0 queues group 99 it is not a member of"),
    ("placement-group-99", lambda h, s: _mb(s)["placements"][0].__setitem__("group", 99),
     "step 0 microbatch 0: sequence 0 placed in missing group 99"),
    ("placement-seq-99", lambda h, s: _mb(s)["placements"][0].__setitem__("seq", 99),
     "step 0 microbatch 0: placement names sequence 99 (step has 4)"),
    ("route-nic-src", lambda h, s: _route_mb(s)["routes"][0]["paths"][0].__setitem__("nic_src", "node9/nic9"),
     "step 0 microbatch 0: route 0 uses NIC 'node9/nic9', which the cluster does not have"),
    ("route-nic-dst", lambda h, s: _route_mb(s)["routes"][0]["paths"][0].__setitem__("nic_dst", "bogus"),
     "step 0 microbatch 0: route 0 uses NIC 'bogus', which the cluster does not have"),
    ("route-proxy-99", lambda h, s: _route_mb(s)["routes"][0]["paths"][1].__setitem__("via_src", 99),
     "step 0 microbatch 0: route 0 source proxy 99 is not a unit (have 16)"),
    ("route-proxy-negative", lambda h, s: _route_mb(s)["routes"][0]["paths"][1].__setitem__("via_dst", -1),
     "step 0 microbatch 0: route 0 destination proxy -1 is not a unit (have 16)"),
    ("route-group-99", lambda h, s: _route_mb(s)["routes"][0].__setitem__("group", 99),
     "step 0 microbatch 0: route 0 names missing group 99"),
    ("route-src-99", lambda h, s: _route_mb(s)["routes"][0].__setitem__("src", 99),
     "step 0 microbatch 0: route 0 source 99 is not a unit of group 0"),
    ("prediction-per-unit-short", lambda h, s: s["prediction"]["per_unit"]["total_s"].pop(),
     "step 0: prediction per_unit.total_s has 15 entries for 16 units"),
    ("prediction-nic-name", lambda h, s: s["prediction"]["nic_bytes"].__setitem__("nope", 1.0),
     "step 0: prediction nic_bytes names NIC 'nope', which the cluster does not have"),
    ("linear-layout-seq-99",
     lambda h, s: _mb(s).__setitem__("linear_layout", [[[99, 0, 5]]] + [[] for _ in range(15)]),
     "step 0: linear layout names sequence 99 (step has 4)"),
    ("linear-layout-short", lambda h, s: _mb(s).__setitem__("linear_layout", [[[0, 0, 5]]]),
     "step 0 microbatch 0: linear layout has 1 units"),
    ("replicas-ranks", lambda h, s: s.__setitem__("replicas", [{"ranks": [99], "tp": 1}] * 16),
     "replicas do not cover GPU ranks 0..15 exactly once"),
    ("range-negative", lambda h, s: _mb(s)["placements"][0]["ranges"][0].__setitem__(0, [-5, 3]),
     "step 0: sequence 0 has a bad range [-5, 3]"),
    ("sequence-length-huge", lambda h, s: s["sequences"][0].__setitem__("length", 10**12),
     "step 0: attention layout misses the end of sequence 0 (covers 100000 of 1000000000000 tokens)"),
]

READERS = [["simulate"], ["simulate", "--step", "0", "--json"], ["show"], ["show", "--png", "x.png"]]


def _write_edited(work: Path, edit, keep_end: bool = False) -> Path:
    """The plan with ``edit`` applied, and either its old end record (which then no longer vouches
    for it) or a fresh one (``keep_end=False``: the edit reaches the checks behind the digest)."""
    recs = [json.loads(x) for x in (work / "r.jsonl").read_text().splitlines()]
    end = recs.pop() if recs[-1].get("kind") == "end" else None
    edit(recs[0], recs[1])
    out = work / "bad.jsonl"
    if keep_end:
        out.write_text("".join(json.dumps(r) + "\n" for r in recs + ([end] if end else [])))
    else:
        out.write_text(sealed(recs))
    return out


@pytest.mark.parametrize("reader", READERS, ids=["-".join(r) for r in READERS])
@pytest.mark.parametrize("edit,problem", [c[1:] for c in PLAN_EDITS], ids=[c[0] for c in PLAN_EDITS])
def test_bad_plan_is_one_line_for_every_reader(work, capsys, reader, edit, problem):
    """An edited plan (re-sealed with a fresh end record) reaches the same structural check in every
    reader: no IndexError / KeyError, one line, exit 2."""
    _write_edited(work, edit)
    assert_refused(work, capsys, [reader[0], "bad.jsonl", *reader[1:]], f"bad.jsonl: step 0: invalid plan: {problem}")


@pytest.mark.parametrize("edit,problem", [c[1:] for c in PLAN_EDITS], ids=[c[0] for c in PLAN_EDITS])
def test_validate_reports_the_same_problem(work, capsys, edit, problem):
    _write_edited(work, edit)
    before = snapshot(work)
    rc, _, err = run_cli(["validate", "bad.jsonl"], capsys)
    assert rc == 1 and err.splitlines()[1] == f"  coverage: {problem}"
    assert snapshot(work) == before


INTEGRITY = ("bad.jsonl: integrity check failed: the records do not match the digest of the end record (the plan "
             "was edited after it was written)")
HEADER_EDITS = [
    ("model-hidden", lambda h, s: h["model"].__setitem__("ffn_hidden", 4096)),
    ("model-layers", lambda h, s: h["model"].__setitem__("num_layers", 1)),
    ("cluster-bandwidth", lambda h, s: h["cluster"]["nics"][0].__setitem__("bandwidth_GBps", 400.0)),
    ("sample-id", lambda h, s: s["sequences"][0].__setitem__("sample_id", 3)),
    ("seed", lambda h, s: h.__setitem__("seed", 7)),
]


@pytest.mark.parametrize("command", [["simulate"], ["show"], ["run"], ["validate"]], ids=lambda c: c[0])
@pytest.mark.parametrize("edit", [c[1] for c in HEADER_EDITS], ids=[c[0] for c in HEADER_EDITS])
def test_integrity_digest_covers_every_record(work, capsys, command, edit):
    """Any edit of a plan written with an end record, valid or not, is refused by every reader."""
    _write_edited(work, edit, keep_end=True)
    if command[0] == "validate":
        before = snapshot(work)
        rc, _, err = run_cli(["validate", "bad.jsonl"], capsys)
        assert rc == 1 and f"  format: {INTEGRITY.removeprefix('bad.jsonl: ')}" in err.splitlines()
        assert snapshot(work) == before
    else:
        assert_refused(work, capsys, [command[0], "bad.jsonl"], INTEGRITY)


def test_run_refuses_an_embedded_model_edited_without_its_hash(work, capsys):
    from zeppelin.schemas.common import content_hash
    from zeppelin.schemas.model import ModelSpec

    def edit(h, s):
        h["model"]["ffn_hidden"] = 4096

    _write_edited(work, edit)  # re-sealed: the embedded-spec hashes are what refuses it
    h = json.loads((work / "bad.jsonl").read_text().splitlines()[0])
    got = content_hash(ModelSpec.model_validate(h["model"]))
    assert_refused(work, capsys, ["run", "bad.jsonl"],
                   f"bad.jsonl: the plan's embedded model hashes to {got}, its header records {h['hashes']['model']} "
                   f"(the plan was edited after planning)")


@pytest.mark.parametrize("model,message", [
    ("tiny", "--model tiny does not match the plan: num_layers is 2 here, 32 in the plan's model 'llama-7b'"),
    ("model.json", "--model model.json does not match the plan: num_layers is 2 here, 32 in the plan's model "
                   "'llama-7b'"),
    ("llama-13b", "--model llama-13b does not match the plan: num_layers is 40 here, 32 in the plan's model "
                  "'llama-7b'"),
])
def test_run_compares_the_given_model_with_the_embedded_one(work, capsys, model, message):
    assert_refused(work, capsys, ["run", "r.jsonl", "--model", model], message)


def test_sample_ids_are_checked_against_the_manifest(work):
    """A plan naming a sample beyond the manifest (or more tokens than a sample has) is refused before
    training, never fed synthetic tokens (the check every rank runs at start-up)."""
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks
    from zeppelin.schemas.common import InputError

    (work / "ids.jsonl").write_text("".join(json.dumps({"tokens": list(range(1, n + 1))}) + "\n"
                                            for n in [300, 500, 700, 900] * 8))
    (work / "ids.manifest.json").write_text(json.dumps({"paths": ["ids.jsonl"], "tokens_field": "tokens"}))
    assert run_cli_quiet(["plan", "-m", "ids.manifest.json", "-c", "local-cpu:2", "--model", "tiny", "--steps", "1",
                          "--tokens-per-step", "2048", "-q", "-o", "ids-plan.jsonl"]) == 0
    recs = [json.loads(x) for x in (work / "ids-plan.jsonl").read_text().splitlines()][:-1]
    for sample, length, problem in ((32, None, "names sample 32, beyond the manifest's 32 samples"),
                                    (0, 301, "uses 301 tokens of sample 0, which has 300")):
        step = json.loads(json.dumps(recs[1]))
        step["sequences"][0]["sample_id"] = sample
        if length is not None:
            step["sequences"][0]["sample_id"] = 0
        (work / "s.jsonl").write_text(sealed([recs[0], step]))
        if length is not None:
            continue  # changing a length breaks coverage first; the sample-id case is the one that matters
        with pytest.raises(InputError) as e:
            startup_checks(RunConfig(plan="s.jsonl", data="ids.manifest.json"), 8)
        assert str(e.value) == f"--data ids.manifest.json: step 0: sequence 0 {problem}"


def run_cli_quiet(argv: list[str]) -> int:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            zeppelin_main(argv)
        except SystemExit as e:
            return e.code or 0
    return 0


# ------------------------------------------------------------------------------------------ bounds
BOUNDS = [
    ("plan-steps-huge", PLAN[:7] + ["--steps", str(10**12), "-o", "o.jsonl"],
     "--steps must be at most 1,000,000 (got 1,000,000,000,000)"),
    ("plan-steps-zero", PLAN[:7] + ["--steps", "0", "-o", "o.jsonl"], "--steps must be at least 1 (got 0)"),
    ("plan-seed-huge", PLAN + ["--seed", str(2**70), "-o", "o.jsonl"],
     f"--seed must be at most {2**63 - 1:,} (got {2**70:,})"),
    ("plan-seed-negative", PLAN + ["--seed", "-1", "-o", "o.jsonl"], "--seed must be at least 0 (got -1)"),
    ("plan-tokens-huge", PLAN[:-2] + ["--tokens-per-step", str(2**50), "-o", "o.jsonl"],
     f"--tokens-per-step must be at most {2**40:,} (got {2**50:,})"),
    ("plan-seqs-zero", PLAN + ["--seqs-per-step", "0", "-o", "o.jsonl"], "--seqs-per-step must be at least 1 (got 0)"),
    ("plan-max-seq-len-zero", PLAN + ["--max-seq-len", "0", "-o", "o.jsonl"], "--max-seq-len must be at least 1 (got 0)"),
    ("plan-tp-zero", PLAN + ["--tp", "0", "-o", "o.jsonl"], "--tp must be at least 1 (got 0)"),
    ("plan-tp-huge", PLAN + ["--tp", "100000", "-o", "o.jsonl"], "--tp must be at most 256 (got 100,000)"),
    ("plan-workers-huge", PLAN + ["-j", "100000", "-o", "o.jsonl"], "--workers must be at most 1,024 (got 100,000)"),
    ("plan-time-limit-nan", PLAN + ["--time-limit", "nan", "-o", "o.jsonl"], "--time-limit must be a finite number (got nan)"),
    ("plan-time-limit-inf", PLAN + ["--time-limit", "inf", "-o", "o.jsonl"], "--time-limit must be a finite number (got inf)"),
    ("plan-time-limit-zero", PLAN + ["--time-limit", "0", "-o", "o.jsonl"], "--time-limit must be greater than 0 (got 0)"),
    ("plan-zero-stage", PLAN + ["--zero-stage", "4", "-o", "o.jsonl"], "--zero-stage must be 0, 1, 2 or 3 (got 4)"),
    ("plan-cluster-nodes-huge", ["plan", "-c", "zeppelin-a:100000000", "--model", "tiny", "-o", "o.jsonl"],
     "cluster preset 'zeppelin-a:100000000': at most 4,096 nodes of 256 GPUs (got 100,000,000 x 8)"),
    ("plan-cluster-gpus-huge", ["plan", "-c", "local-cpu:1x100000", "--model", "tiny", "-o", "o.jsonl"],
     "cluster preset 'local-cpu:1x100000': at most 4,096 nodes of 256 GPUs (got 1 x 100,000)"),
    ("plan-cluster-zero", ["plan", "-c", "zeppelin-a:0", "--model", "tiny", "-o", "o.jsonl"],
     "cluster preset 'zeppelin-a:0': node and GPU counts must be at least 1"),
    ("compare-steps-huge", ["compare", "--steps", str(10**12)], "--steps must be at most 1,000,000 (got 1,000,000,000,000)"),
    ("compare-tokens-zero", ["compare", "--tokens-per-step", "0"], "--tokens-per-step must be at least 1 (got 0)"),
    ("compare-time-limit-nan", ["compare", "--time-limit", "nan"], "--time-limit must be a finite number (got nan)"),
    ("compare-seed-huge", ["compare", "--seed", str(2**70)], f"--seed must be at most {2**63 - 1:,} (got {2**70:,})"),
    ("compare-workers-negative", ["compare", "-j", "-1"], "--workers must be at least 0 (got -1)"),
    ("compare-tp-zero", ["compare", "--tp", "0"], "--tp must be at least 1 (got 0)"),
    ("compare-max-seq-len-zero", ["compare", "--max-seq-len", "0"], "--max-seq-len must be at least 1 (got 0)"),
    ("check-workers-negative", ["check", "plans", "-j", "-3"], "--workers must be at least 0 (got -3)"),
    ("demo-steps-huge", ["demo", "--steps", str(10**12)], "--steps must be at most 10,000 (got 1,000,000,000,000)"),
    ("demo-seed-negative", ["demo", "--seed", "-5"], "--seed must be at least 0 (got -5)"),
    ("simulate-step-negative", ["simulate", "p.jsonl", "--step", "-1"], "--step must be at least 0 (got -1)"),
    ("simulate-step-beyond", ["simulate", "p.jsonl", "--step", "5"], "p.jsonl: step 5 out of range (plan has 2 steps)"),
    ("show-step-beyond", ["show", "p.jsonl", "--step", "9"], "p.jsonl: step 9 out of range (plan has 2 steps)"),
    ("run-lr-nan", ["run", "p.jsonl", "--lr", "nan"], "--lr must be a finite number (got nan)"),
    ("run-lr-negative", ["run", "p.jsonl", "--lr", "-1"], "--lr must be greater than 0 (got -1)"),
    ("run-lr-zero", ["run", "p.jsonl", "--lr", "0"], "--lr must be greater than 0 (got 0)"),
    ("run-lr-huge", ["run", "p.jsonl", "--lr", "1e9"], "--lr must be at most 10 (got 1e+09)"),
    ("run-weight-decay-inf", ["run", "p.jsonl", "--weight-decay", "inf"], "--weight-decay must be a finite number (got inf)"),
    ("run-weight-decay-negative", ["run", "p.jsonl", "--weight-decay", "-0.1"], "--weight-decay must be at least 0 (got -0.1)"),
    ("run-seed-huge", ["run", "p.jsonl", "--seed", str(2**70)], f"--seed must be at most {2**63 - 1:,} (got {2**70:,})"),
    ("run-seed-negative", ["run", "p.jsonl", "--seed", "-2"], "--seed must be at least 0 (got -2)"),
    ("run-timeout-zero", ["run", "p.jsonl", "--timeout", "0"], "--timeout must be greater than 0 (got 0)"),
    ("run-timeout-nan", ["run", "p.jsonl", "--timeout", "nan"], "--timeout must be a finite number (got nan)"),
    ("run-timeout-huge", ["run", "p.jsonl", "--timeout", "1e12"], "--timeout must be at most 604800 (got 1e+12)"),
    ("run-verify-tol-negative", ["run", "p.jsonl", "--verify-tol", "-1"], "--verify-tol must be greater than 0 (got -1)"),
    ("run-verify-tol-nan", ["run", "p.jsonl", "--verify-tol", "nan"], "--verify-tol must be a finite number (got nan)"),
    ("run-verify-tol-huge", ["run", "p.jsonl", "--verify-tol", "5"], "--verify-tol must be at most 1 (got 5)"),
    ("run-checkpoint-every-negative", ["run", "p.jsonl", "--checkpoint-every", "-1"],
     "--checkpoint-every must be at least 0 (got -1)"),
    ("run-threads-zero", ["run", "p.jsonl", "--threads", "0"], "--threads must be at least 1 (got 0)"),
    ("run-nproc-zero", ["run", "p.jsonl", "--nproc-per-node", "0"], "--nproc-per-node must be at least 1 (got 0)"),
    ("run-nnodes-huge", ["run", "p.jsonl", "--nnodes", "100000"], "--nnodes must be at most 4,096 (got 100,000)"),
    ("run-master-port", ["run", "p.jsonl", "--master-port", "70000"], "--master-port must be at most 65,535 (got 70,000)"),
    ("run-node-rank", ["run", "p.jsonl", "--nnodes", "2", "--node-rank", "5"], "--node-rank must be at most 1 (got 5)"),
    ("run-steps-beyond", ["run", "p.jsonl", "--steps", str(10**12)],
     "--steps 1000000000000 is out of range (the plan has 2 steps)"),
    ("profile-nodes-zero", ["profile", "-o", "prof.json", "--nodes", "0"], "--nodes must be at least 1 (got 0)"),
    ("profile-nproc-zero", ["profile", "-o", "prof.json", "--nproc", "0"], "--nproc must be at least 1 (got 0)"),
]


@pytest.mark.parametrize("argv,message", [c[1:] for c in BOUNDS], ids=[c[0] for c in BOUNDS])
def test_bounds_up_front(work, capsys, argv, message):
    assert_refused(work, capsys, argv, message)


# --------------------------------------------------------------------------------------- bad inputs
def _spec(work: Path, name: str, kind: str, edit) -> str:
    """A copy of the dumped cluster or model JSON with one edit (as text, so non-JSON numbers survive)."""
    text = (work / f"{kind}.json").read_text()
    (work / name).write_text(edit(text))
    return name


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _nic0_bandwidth(value: str):
    """An edit of a dumped cluster JSON: the first NIC's bandwidth written as ``value`` (any text)."""
    def edit(text: str) -> str:
        head, tail = text.split('"nics"', 1)
        return head + '"nics"' + re.sub(r'"bandwidth_GBps": [^,\n}]+', f'"bandwidth_GBps": {value}', tail, count=1)
    return edit


BAD_FILES = [
    ("cluster-bandwidth-infinity", "cluster",
     _nic0_bandwidth('Infinity'),
     "c.json: Infinity is not a finite number (JSON numbers must be finite)"),
    ("cluster-bandwidth-nan", "cluster", _nic0_bandwidth('NaN'),
     "c.json: NaN is not a finite number (JSON numbers must be finite)"),
    ("cluster-bandwidth-overflow", "cluster", _nic0_bandwidth('1e999'),
     "c.json: 1e999 is not a finite number (JSON numbers must be finite)"),
    ("cluster-bandwidth-huge", "cluster", _nic0_bandwidth('1e300'),
     "c.json: invalid ClusterSpec: nics.0.bandwidth_GBps: Input should be less than or equal to 1000000"),
    ("cluster-bandwidth-tiny", "cluster", _nic0_bandwidth('1e-300'),
     "c.json: invalid ClusterSpec: nics.0.bandwidth_GBps: Input should be greater than or equal to 0.001"),
    ("cluster-nodes-huge", "cluster", lambda t: t.replace('"num_nodes": 2', '"num_nodes": 100000000', 1),
     "c.json: invalid ClusterSpec: num_nodes: Input should be less than or equal to 4096"),
    ("cluster-gpus-zero", "cluster", lambda t: t.replace('"gpus_per_node": 4', '"gpus_per_node": 0', 1),
     "c.json: invalid ClusterSpec: gpus_per_node: Input should be greater than or equal to 1"),
    ("cluster-memory-huge", "cluster", lambda t: t.replace('"memory_gb": 4.0', '"memory_gb": 1e9', 1),
     "c.json: invalid ClusterSpec: gpu.memory_gb: Input should be less than or equal to 100000"),
    ("cluster-deep", "cluster", lambda t: _deep(100_000), "c.json: JSON nested deeper than 64 levels"),
    ("cluster-deep-in-field", "cluster", lambda t: t.replace('"name": "local-cpu"', f'"name": {_deep(200)}', 1),
     "c.json: JSON nested deeper than 64 levels"),
    ("model-head-dim-odd", "model", lambda t: t.replace('"hidden": 64', '"hidden": 60', 1),
     "c.json: invalid ModelSpec: (document): head_dim = hidden / num_heads = 15 must be even (rotary embeddings "
     "rotate pairs of channels)"),
    ("model-layers-huge", "model", lambda t: t.replace('"num_layers": 2', '"num_layers": 100000', 1),
     "c.json: invalid ModelSpec: num_layers: Input should be less than or equal to 1024"),
    ("model-vocab-huge", "model", lambda t: t.replace('"vocab_size": 256', '"vocab_size": 10000000000', 1),
     "c.json: invalid ModelSpec: vocab_size: Input should be less than or equal to 16777216"),
    ("model-rope-infinity", "model", lambda t: t.replace('"rope_theta": 10000.0', '"rope_theta": Infinity', 1),
     "c.json: Infinity is not a finite number (JSON numbers must be finite)"),
    ("model-deep", "model", lambda t: _deep(5000), "c.json: JSON nested deeper than 64 levels"),
    ("model-not-object", "model", lambda t: "[1, 2]", "c.json: expected a JSON object for ModelSpec, got list"),
]


@pytest.mark.parametrize("command", ["plan", "compare"])
@pytest.mark.parametrize("kind,edit,message", [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES])
def test_bad_spec_file(work, capsys, command, kind, edit, message):
    _spec(work, "c.json", kind, edit)
    flag = {"cluster": "-c", "model": "--model"}[kind]
    other = ["--model", "tiny"] if kind == "cluster" else ["-c", "local-cpu:2"]
    argv = (["plan", "-m", "m.jsonl", flag, "c.json", *other, "-o", "o.jsonl"] if command == "plan"
            else ["compare", "--steps", "1", flag, "c.json", *other])
    assert_refused(work, capsys, argv, message)


def _input_extras(work: Path) -> None:
    os.symlink("/dev/zero", work / "zero.jsonl")
    os.symlink("/dev/zero", work / "zero.json")
    os.mkfifo(work / "fifo.jsonl")
    os.mkfifo(work / "fifo.json")
    (work / "dir.json").mkdir()
    (work / "deep.jsonl").write_text(_deep(100_000) + "\n")
    (work / "deep-plan.jsonl").write_text(_deep(100_000) + "\n")
    (work / "nan.jsonl").write_text('{"length": NaN}\n')
    (work / "latin1.json").write_bytes(b'{"name": "\xff"}')
    (work / "evil-shards.manifest.json").write_text(json.dumps({"paths": ["zero.jsonl"]}))


INPUT_CASES = [
    ("manifest-dev-zero-symlink", ["data", "stats", "zero.jsonl"],
     "zero.jsonl: manifest is a character device, not a regular file"),
    ("manifest-fifo", ["data", "stats", "fifo.jsonl"], "fifo.jsonl: manifest is a FIFO, not a regular file"),
    ("manifest-spec-shard-dev-zero", ["data", "stats", "evil-shards.manifest.json"],
     "zero.jsonl: manifest is a character device, not a regular file"),
    ("plan-manifest-dev-zero", ["plan", "-m", "zero.jsonl", "-c", "local-cpu:2", "--model", "tiny", "-o", "o.jsonl"],
     "zero.jsonl: manifest is a character device, not a regular file"),
    ("plan-manifest-fifo", ["plan", "-m", "fifo.jsonl", "-c", "local-cpu:2", "--model", "tiny", "-o", "o.jsonl"],
     "fifo.jsonl: manifest is a FIFO, not a regular file"),
    ("cluster-dev-zero", ["plan", "-c", "zero.json", "--model", "tiny", "-o", "o.jsonl"],
     "zero.json: input is a character device, not a regular file"),
    ("cluster-fifo", ["plan", "-c", "fifo.json", "--model", "tiny", "-o", "o.jsonl"],
     "fifo.json: input is a FIFO, not a regular file"),
    ("cluster-directory", ["plan", "-c", "dir.json", "--model", "tiny", "-o", "o.jsonl"],
     "dir.json: input is a directory, not a regular file"),
    ("cluster-missing", ["plan", "-c", "missing.json", "--model", "tiny", "-o", "o.jsonl"], "missing.json: file not found"),
    ("cluster-not-utf8", ["plan", "-c", "latin1.json", "--model", "tiny", "-o", "o.jsonl"], "latin1.json: not UTF-8 text"),
    ("model-dev-zero", ["plan", "-c", "local-cpu:2", "--model", "zero.json", "-o", "o.jsonl"],
     "zero.json: input is a character device, not a regular file"),
    ("profile-fifo", ["plan", "-c", "local-cpu:2", "--model", "tiny", "--profile", "fifo.json", "-o", "o.jsonl"],
     "fifo.json: input is a FIFO, not a regular file"),
    ("simulate-plan-dev-zero", ["simulate", "zero.jsonl"], "zero.jsonl: plan is a character device, not a regular file"),
    ("simulate-plan-fifo", ["simulate", "fifo.jsonl"], "fifo.jsonl: plan is a FIFO, not a regular file"),
    ("show-plan-fifo", ["show", "fifo.jsonl"], "fifo.jsonl: plan is a FIFO, not a regular file"),
    ("validate-plan-dev-zero", ["validate", "zero.jsonl"], "zero.jsonl: plan is a character device, not a regular file"),
    ("run-plan-fifo", ["run", "fifo.jsonl"], "fifo.jsonl: plan is a FIFO, not a regular file"),
    ("simulate-plan-deep", ["simulate", "deep-plan.jsonl"], "deep-plan.jsonl: header: JSON nested deeper than 64 levels"),
    ("show-plan-deep", ["show", "deep-plan.jsonl"], "deep-plan.jsonl: header: JSON nested deeper than 64 levels"),
    ("compare-dataset-dev-zero", ["compare", "--steps", "1", "-m", "zero.jsonl"],
     "zero.jsonl: manifest is a character device, not a regular file"),
    ("run-data-fifo", ["run", "p.jsonl", "--data", "fifo.jsonl"], "fifo.jsonl: manifest is a FIFO, not a regular file"),
    ("run-data-dev-zero", ["run", "p.jsonl", "--data", "zero.jsonl"],
     "zero.jsonl: manifest is a character device, not a regular file"),
    ("run-model-fifo", ["run", "p.jsonl", "--model", "fifo.json"], "fifo.json: input is a FIFO, not a regular file"),
    ("manifest-name-too-long", ["data", "stats", "x" * 300 + ".jsonl"],
     f"{'x' * 300}.jsonl: cannot read manifest: File name too long"),
    ("plan-manifest-name-too-long", ["plan", "-m", "x" * 300 + ".jsonl", "-c", "local-cpu:2", "--model", "tiny",
                                     "-o", "o.jsonl"], f"{'x' * 300}.jsonl: cannot read manifest: File name too long"),
    ("validate-manifest-fifo", ["validate", "p.jsonl", "--manifest", "fifo.jsonl"],
     "fifo.jsonl: manifest is a FIFO, not a regular file"),
    ("check-case-fifo", ["check", "cases"], "cases/a.json: check case is a FIFO, not a regular file"),
    ("check-case-deep", ["check", "deepcases"], "deepcases/a.json: JSON nested deeper than 64 levels"),
]


@pytest.mark.parametrize("argv,message", [c[1:] for c in INPUT_CASES], ids=[c[0] for c in INPUT_CASES])
def test_bad_input_file(work, capsys, argv, message):
    _input_extras(work)
    (work / "cases").mkdir()
    os.mkfifo(work / "cases" / "a.json")
    (work / "deepcases").mkdir()
    (work / "deepcases" / "a.json").write_text(_deep(100_000))
    assert_refused(work, capsys, argv, message)


@pytest.mark.parametrize("name", ["tiny", "local-cpu:2"])
def test_bare_name_is_a_preset(work, capsys, name):
    """A file named like a preset in the working directory does not shadow the preset; ./NAME is the file."""
    (work / "tiny").write_text("not json")
    (work / "local-cpu:2").write_text("not json")
    argv = (["plan", "-m", "m.jsonl", "-c", "local-cpu:2", "--model", name, "--steps", "1", "-q",
             "--tokens-per-step", "2048", "-o", "o.jsonl"] if name == "tiny" else
            ["plan", "-m", "m.jsonl", "-c", name, "--model", "tiny", "--steps", "1", "-q", "--tokens-per-step",
             "2048", "-o", "o.jsonl"])
    rc, _, err = run_cli(argv, capsys)
    assert rc == 0, err
    flag = "--model" if name == "tiny" else "-c"
    argv[argv.index(flag) + 1] = f"./{name}"
    assert_refused(work, capsys, argv, f"{name}: malformed JSON at line 1 column 1: Expecting value")


# --------------------------------------------------------------------------------- command-line usage
USAGE = [
    ("plan-steps-not-int", ["plan", "--steps", "abc", "-c", "local-cpu", "--model", "tiny", "-o", "o.jsonl"],
     "Invalid value for '--steps': Input should be a valid integer, unable to parse string as an integer "
     "(see `zeppelin plan --help`)"),
    ("plan-unknown-option", ["plan", "--bogus"], "No such option: --bogus (see `zeppelin plan --help`)"),
    ("plan-missing-cluster", ["plan", "--model", "tiny", "-o", "o.jsonl"],
     "Missing option '--cluster' / '-c'. (see `zeppelin plan --help`)"),
    ("simulate-missing-plan", ["simulate"], "Missing argument 'plan'. (see `zeppelin simulate --help`)"),
    ("run-lr-not-float", ["run", "p.jsonl", "--lr", "fast"],
     "Invalid value for '--lr': Input should be a valid number, unable to parse string as a number "
     "(see `zeppelin run --help`)"),
    ("unknown-command", ["bogus"], "No such command 'bogus'. (see `zeppelin --help`)"),
    ("data-unknown-command", ["data", "bogus"], "No such command 'bogus'. (see `zeppelin data --help`)"),
    ("schema-unknown", ["schema", "nope"], "unknown schema 'nope' (known: cluster, model, manifest, profile, plan, step, case)"),
    ("validate-limit-not-int", ["validate", "p.jsonl", "--limit", "x"],
     "Invalid value for '--limit': Input should be a valid integer, unable to parse string as an integer "
     "(see `zeppelin validate --help`)"),
]


@pytest.mark.parametrize("argv,message", [c[1:] for c in USAGE], ids=[c[0] for c in USAGE])
def test_usage_errors_are_one_line(work, capsys, argv, message):
    assert_refused(work, capsys, argv, message)


# ---------------------------------------------------------------------------------- manifest contents
MANIFESTS = [
    ("deep.jsonl", b"[" * 100_000 + b"]" * 100_000 + b"\n", "deep.jsonl: JSON nested too deeply at line 1"),
    ("deep-field.jsonl", b'{"length": 5, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
     "deep-field.jsonl: JSON nested too deeply at line 1"),
    ("huge.jsonl", b'{"length": 100000000000000000000000}\n',
     "huge.jsonl: length 100000000000000000000000 at sample 0 (line 1) is implausibly large (more than "
     "1,099,511,627,776)"),
    ("huge.txt", b"7\n100000000000000000000000\n",
     "huge.txt: length 100000000000000000000000 at sample 1 (line 2) is implausibly large (more than "
     "1,099,511,627,776)"),
    ("large.txt", b"2000000000000\n", "large.txt: length 2000000000000 at sample 0 (line 1) is implausibly large"),
    ("nan.jsonl", b'{"length": NaN}\n', "nan.jsonl: field 'length' at line 1 must be an integer, got NaN"),
    ("inf.jsonl", b'{"length": 1e999}\n', "inf.jsonl: field 'length' at line 1 must be an integer, got Infinity"),
    ("neg.txt", b"-5\n", "neg.txt: non-positive length -5 at sample 0 (line 1)"),
    ("zero.jsonl", b'{"length": 0}\n', "zero.jsonl: non-positive length 0 at sample 0 (line 1)"),
    ("bool.jsonl", b'{"length": true}\n', "bool.jsonl: field 'length' at line 1 must be an integer, got true"),
    ("array.jsonl", b'{"length": 5}\n[1, 2]\n', "array.jsonl: expected a JSON object at line 2, got array"),
    ("latin1.jsonl", b'{"length": 5}\n{"length": \xff}\n', "latin1.jsonl: malformed JSON at line 2: invalid UTF-8"),
    ("empty.jsonl", b"", "empty.jsonl: manifest has no samples"),
    ("word.txt", b"abc\n", "word.txt: expected one integer length per line, got 'abc' at line 1"),
]


@pytest.mark.parametrize("command", ["data", "plan", "compare"])
@pytest.mark.parametrize("name,content,message", MANIFESTS, ids=[c[0] for c in MANIFESTS])
def test_bad_manifest(work, capsys, command, name, content, message):
    (work / name).write_bytes(content)
    argv = {"data": ["data", "stats", name],
            "plan": ["plan", "-m", name, "-c", "local-cpu:2", "--model", "tiny", "-o", "o.jsonl"],
            "compare": ["compare", "--steps", "1", "-m", name]}[command]
    assert_refused(work, capsys, argv, message)


def test_every_file_write_goes_through_the_one_writer():
    """Writes in the package go through ``atomic_write`` (the PNG writer hands matplotlib its file);
    the exceptions are listed with why: the streamed metrics file (checked up front by the same
    check_output) and the modules below that write state files, not outputs."""
    import re

    pattern = re.compile(r"open\([^)]*[\"'][wax]b?[\"']|\.write_text\(|\.write_bytes\(|savefig\(|np\.save\(|"
                         r"torch\.save\(|json\.dump\(|os\.open\(")
    found = set()
    for pkg in ("schemas", "planner", "runtime"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for line in f.read_text().splitlines():
                read_only = "O_RDONLY" in line and not re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND", line)
                if pattern.search(line) and not line.lstrip().startswith("#") and not read_only:
                    found.add((str(f.relative_to(ROOT)), line.strip()))
    allowed = {
        ("planner/tools/show.py", 'fig.savefig(fh, format="png", dpi=dpi)'),  # fh from atomic_write
        ("runtime/train/metrics.py", 'self.fh = path.open("a" if append else "w")  # streamed: checked up front by check_output'),  # streamed metrics
        ("planner/core/solver.py", 'with open(os.devnull, "wb") as null:'),  # silences the solver's banner
        # a rank's stop-signal record in the job's own error directory (O_EXCL | O_NOFOLLOW), not an output
        ("runtime/__main__.py", 'fd = os.open(os.path.join(d, f"signal-rank{rank}.json"),'),
    }
    # whole modules whose writes are not outputs: checkpoint files (written inside atomic_write or by DCP),
    # the run's lock, heartbeat and writability probe files (lifecycle), /proc/self/clear_refs (memory),
    # the one home of file safety (schemas/io/safefiles.py: the writer itself, and the writer of managed
    # directories, where no entry is followed when a link) and a
    # streamed plan (checked by check_output, started as temporary files renamed into place, then
    # appended in place so that a follower reads it while it is written)
    modules = {"runtime/checkpoint.py", "runtime/lifecycle.py", "runtime/memory.py",
               "schemas/io/safefiles.py", "schemas/io/stream.py"}
    assert {x for x in found if x[0] not in modules} - allowed == set()


# ------------------------------------------------------------------------------------- check cases
CASE = {"cluster": "local-cpu:2", "model": "tiny", "dataset": "sample", "planner": "zeppelin", "steps": 1,
        "tokens_per_step": 2048, "tolerance": 0.1}
CASES = [
    ("option-negative", {"options": {"ilp_nodes": -5}},
     "cases/a.json: planner 'zeppelin': bad option (solver node and iteration limits must be >= 0)"),
    ("option-not-int", {"options": {"ilp_nodes": "abc"}},
     "cases/a.json: planner 'zeppelin': bad option (invalid literal for int() with base 10: 'abc')"),
    ("option-time-limit", {"options": {"time_limit": -1}}, "cases/a.json: --time-limit must be positive (got -1)"),
    ("option-misspelt", {"options": {"ilp_node": 5}},
     ("cases/a.json: planner 'zeppelin': unknown option 'ilp_node' (known: attention_max_units, families, "
      "families_max_units, family_gap, family_margin, ilp, ilp_budget_calls, ilp_iterations, ilp_nodes, inter, intra, "
      "large_families, max_ilp_vars_nodes, max_ilp_vars_units, node_cp_max_units, search_gap, select, simulate_max_units, solver, "
      "split_waste, time_limit, tol, usp_spans)")),
    ("option-none-taken", {"planner": "packed-dp", "options": {"cp": 2}},
     "cases/a.json: planner 'packed-dp': unknown option 'cp' (it takes none)"),
    ("steps-huge", {"steps": 100000},
     "cases/a.json: invalid check case: steps: Input should be less than or equal to 64"),
    ("tokens-huge", {"tokens_per_step": 10**17},
     "cases/a.json: invalid check case: tokens_per_step: Input should be less than or equal to 1099511627776"),
    ("seed-negative", {"seed": -1}, "cases/a.json: invalid check case: seed: Input should be greater than or equal to 0"),
    ("tolerance-string", {"tolerance": "NaN"}, "cases/a.json: invalid check case: tolerance: Input should be a valid "
                                                "number"),
    ("unknown-field", {"bogus": 1}, "cases/a.json: invalid check case: bogus: Extra inputs are not permitted"),
    ("planner-unknown", {"planner": "nope"}, "cases/a.json: unknown planner 'nope' (known: flexsp, hybrid-dp, "
     "hydraulis, llama3-cp, megatron-dcp, packed-dp, te-cp, te-cp-tuned, ulysses, usp, zeppelin, zeppelin-no-remap, "
     "zeppelin-no-routing, zeppelin-tiers-only)"),
    ("cluster-huge", {"cluster": "zeppelin-a:9999999"},
     "a: bad input: cluster preset 'zeppelin-a:9999999': at most 4,096 nodes of 256 GPUs (got 9,999,999 x 8)"),
    ("dataset-dev-zero", {"dataset": "/dev/zero"}, "a: bad input: /dev/zero: manifest is a character device, not a "
                                                   "regular file"),
]


@pytest.mark.parametrize("change,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_check_case(work, capsys, change, message):
    (work / "cases").mkdir()
    (work / "cases" / "a.json").write_text(json.dumps({**CASE, **change}))
    assert_refused(work, capsys, ["check", "cases", "-j", "1"], message)


def test_oversized_spec_document_is_refused_before_reading(work, capsys):
    with open(work / "big.json", "wb") as fh:  # sparse: 100 MiB of nothing, read by nobody
        fh.truncate(100 << 20)
    assert_refused(work, capsys, ["plan", "-c", "big.json", "--model", "tiny", "-o", "o.jsonl"],
                   "big.json: ClusterSpec document of 104,857,600 bytes is larger than the 64 MiB zeppelin reads")


RECORD_EDITS = [
    ("length-beyond-int64", lambda h, s: s["sequences"][0].__setitem__("length", 10**30),
     "sequences.0.length: Input should be less than or equal to 1099511627776"),
    ("sample-id-negative", lambda h, s: s["sequences"][0].__setitem__("sample_id", -1),
     "sequences.0.sample_id: Input should be greater than or equal to 0"),
    ("route-bytes-huge", lambda h, s: _route_mb(s)["routes"][0].__setitem__("bytes", 10**30),
     "microbatches.0.routes.0.bytes: Input should be less than or equal to 4611686018427387904"),
    ("unknown-field", lambda h, s: s.__setitem__("exec", "os.system"), "exec: Extra inputs are not permitted"),
    ("string-for-int", lambda h, s: s.__setitem__("step", "0"), "step: Input should be a valid integer"),
    ("prediction-huge", lambda h, s: s["prediction"]["per_unit"]["attention_s"].__setitem__(2, 1e300),
     "prediction.per_unit.attention_s.2: Input should be less than or equal to 1000000000"),
]

HEADER_FIELD_EDITS = [
    ("profile-reserve-huge", lambda h, s: h["profile"].__setitem__("memory_reserved_gb", 1e300),
     "profile.memory_reserved_gb: Input should be less than or equal to 100000"),
    ("model-head-dim-odd", lambda h, s: h["model"].update(hidden=4092, num_heads=124, num_kv_heads=124),
     "model: head_dim = hidden / num_heads = 33 must be even (rotary embeddings rotate pairs of channels)"),
    ("tp-not-dividing", lambda h, s: h.__setitem__("tp", 3), "(document): tp=3 does not divide the cluster's 8 GPUs "
                                                            "per node"),
    ("seed-huge", lambda h, s: h.__setitem__("seed", 2**70), "seed: Input should be less than or equal to "
                                                            "9223372036854775807"),
    ("cluster-nodes-huge", lambda h, s: h["cluster"].__setitem__("num_nodes", 10**8),
     "cluster.num_nodes: Input should be less than or equal to 4096"),
]


@pytest.mark.parametrize("command", [["simulate"], ["show"], ["validate"], ["run"]], ids=lambda c: c[0])
@pytest.mark.parametrize("edit,problem", [c[1:] for c in HEADER_FIELD_EDITS], ids=[c[0] for c in HEADER_FIELD_EDITS])
def test_bad_plan_header(work, capsys, command, edit, problem):
    _write_edited(work, edit)
    assert_refused(work, capsys, [command[0], "bad.jsonl"], f"bad.jsonl: invalid plan header: {problem}")


@pytest.mark.parametrize("reader", READERS[:3], ids=["-".join(r) for r in READERS[:3]])
@pytest.mark.parametrize("edit,problem", [c[1:] for c in RECORD_EDITS], ids=[c[0] for c in RECORD_EDITS])
def test_bad_step_record(work, capsys, reader, edit, problem):
    _write_edited(work, edit)
    assert_refused(work, capsys, [reader[0], "bad.jsonl", *reader[1:]],
                   f"bad.jsonl: step 0: invalid step record: {problem}")


def test_validate_checks_sample_ids_against_the_manifest(work, capsys):
    lines = (work / "m.jsonl").read_text().splitlines(keepends=True)
    (work / "m4.jsonl").write_text("".join(lines[:4]))
    before = snapshot(work)
    rc, _, err = run_cli(["validate", "p.jsonl", "--manifest", "m4.jsonl", "--limit", "50"], capsys)
    assert rc == 1
    beyond = [ln for ln in err.splitlines() if "beyond the manifest's 4 samples" in ln]
    steps = [json.loads(x) for x in (work / "p.jsonl").read_text().splitlines()[1:-1]]
    want = [f"  inputs: step {s['step']}: sequence {i} names sample {q['sample_id']}, beyond the manifest's 4 samples"
            for s in steps for i, q in enumerate(s["sequences"]) if q["sample_id"] >= 4]
    assert beyond == want[:len(beyond)] and beyond
    assert snapshot(work) == before
