"""Every command's tables stay readable in an 80-column terminal: no line wider than the terminal,
no header or cell cut to "…", the headers' words whole. The demo plans and writes its picture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from zeppelin.planner.cli import main
from zeppelin.schemas.io.datasets import default_manifest_path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = str(default_manifest_path())
SMALL = ["-c", "local-cpu:2x2", "--model", "tiny"]


def _run(argv: list[str], capsys, code: int = 0) -> str:
    try:
        main(argv)
    except SystemExit as e:
        assert (e.code or 0) == code, capsys.readouterr()
    return capsys.readouterr().out


def _fits(text: str, *words: str, width: int = 80) -> None:
    lines = text.splitlines()
    assert lines
    too_wide = [ln for ln in lines if len(ln.rstrip()) > width]
    assert not too_wide, too_wide[:3]
    assert "…" not in text, [ln for ln in lines if "…" in ln][:3]
    for w in words:  # header words are never cut or split across lines
        assert any(w in ln.split() for ln in lines), w


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("tables") / "z.plan"
    try:
        main(["plan", *SMALL, "--tokens-per-step", "16384", "--max-seq-len", "4096", "--steps", "2", "-q",
              "-o", str(path)])
    except SystemExit as e:
        assert (e.code or 0) == 0
    return path


def test_presets_and_data_stats_fit_80_columns(narrow, capsys):
    _fits(_run(["presets"], capsys), "name", "TFLOP/s", "params", "kv", "heads")
    _fits(_run(["data", "stats", SAMPLE], capsys), "length", "samples", "%", "tokens")


def test_simulate_and_show_fit_80_columns(narrow, capsys, small_plan):
    _fits(_run(["simulate", str(small_plan)], capsys), "step", "sim", "pred", "exposed", "NIC", "busy")
    _fits(_run(["simulate", str(small_plan), "--step", "0"], capsys), "unit", "tokens", "linear", "idle")
    _fits(_run(["show", str(small_plan)], capsys), "tier", "kind", "units", "seqs", "tokens", "total")


def test_compare_and_check_fit_80_columns(narrow, capsys, tmp_path):
    out = _run(["compare", *SMALL, "-d", SAMPLE, "-n", "1", "--tokens-per-gpu", "4096", "--max-seq-len", "4096",
                "--planners", "zeppelin,te-cp,te-cp-tuned,megatron-dcp,hybrid-dp", "-j", "1"], capsys)
    _fits(out, "planner", "mean", "p90", "te-cp", "tuned", "LB", "exposed", "plan", "megatron-dcp", "te-cp-tuned")
    for n in ("cpu2x2-tiny-sample--te-cp-tuned", "cpu2x2-tiny-sample--te-cp"):
        for ext in (".json", ".plan"):
            shutil.copy(ROOT / "plans" / f"{n}{ext}", tmp_path / f"{n}{ext}")
    _fits(_run(["check", str(tmp_path), "-j", "1"], capsys), "case", "planner", "golden", "change", "status")


@pytest.mark.timeout(120)
def test_demo_plans_compares_and_draws_in_80_columns(narrow, capsys, tmp_path):
    png = tmp_path / "demo.png"
    out = _run(["demo", "--cluster", "local-cpu:2x2", "--model", "tiny", "--steps", "1", "--png", str(png), "-j", "1"], capsys)
    # the data and cost stages, then the side-by-side table of every default planner
    _fits(out, "seqs", "tokens", "longest", "FLOPs", "length", "planner", "mean", "tuned", "LB", "plan")
    for name in ("zeppelin", "te-cp", "te-cp-tuned", "ulysses", "hybrid-dp", "megatron-dcp", "flexsp", "hydraulis"):
        assert any(ln.split()[:1] == [name] for ln in out.splitlines()), name
    flat = "".join(out.split())  # a long path wraps anywhere at 80 columns
    assert "verdict:zeppelin" in flat and f"wrote{png}" in flat
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_rejects_unknown_planner_before_work(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--planners", "zeppelin,bogus", "--png", str(tmp_path / "x.png")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zeppelin: error: unknown planner 'bogus' (known: ")
    assert not (tmp_path / "x.png").exists()


def test_compare_json_still_carries_every_column(narrow, capsys):
    """The 80-column table leaves the p50 out; the JSON keeps it and both speedups."""
    doc = json.loads(_run(["compare", *SMALL, "-d", SAMPLE, "-n", "1", "--tokens-per-gpu", "4096",
                           "--max-seq-len", "4096", "--planners", "te-cp,te-cp-tuned,zeppelin", "-j", "1", "--json"],
                          capsys))
    assert {"p50_s", "speedup_vs_te_cp", "speedup_vs_te_cp_tuned"} <= set(doc["planners"][2])
    assert "zeppelin_speedup_vs_te_cp_tuned" in doc


def test_a_table_leaves_out_columns_rather_than_break_a_word():
    from collections import Counter

    from zeppelin.planner.tools.tables import render_text, table

    cols = ("case", "planner", "golden ms", "now ms", "change", "tol", "plan ms", "status")
    t = table("zeppelin check", cols, drop=["plan ms", "tol", "planner", "golden ms", "now ms"])
    for name in ("a16-llama7b-short--hybrid-dp", "a16-llama7b-long--megatron-dcp"):
        t.add_row(name, "megatron-dcp", "1234.56", "1240.01", "+0.44%", "1%", "1138", "ok")
    for width, dropped in ((120, []), (80, ["plan ms", "tol"]), (60, ["plan ms", "tol", "planner", "golden ms",
                                                                     "now ms"])):
        text = render_text(t, width)
        assert all(len(ln.rstrip()) <= width for ln in text.splitlines())
        words = Counter(text.split())
        for c in cols:
            if c in dropped:
                continue
            assert all(words[w] >= 1 for w in c.split()), (width, c)
            for row in ([n, "megatron-dcp", "1234.56", "1240.01", "+0.44%", "1%", "1138", "ok"]
                        for n in ("a16-llama7b-short--hybrid-dp", "a16-llama7b-long--megatron-dcp")):
                assert words[row[cols.index(c)]] >= 1, (width, c, text)
        note = " ".join(text.split())
        assert (f"not shown at this width: {', '.join(dropped)}" in note) == bool(dropped), (width, note)


def test_show_summarises_a_step_in_one_screen(narrow, capsys, tmp_path):
    plan = tmp_path / "w32.plan"
    _run(["plan", "-c", "local-cpu:4x8", "--model", "tiny", "--tokens-per-step", "65536", "--max-seq-len", "8192",
          "--steps", "1", "-q", "-o", str(plan)], capsys)
    short = _run(["show", str(plan)], capsys)
    _fits(short, "tier", "kind", "units", "seqs", "tokens", "total")
    assert len(short.splitlines()) <= 50
    assert "the 4 most and least loaded of 32 units (--all: each)" in " ".join(short.split())
    full = _run(["show", str(plan), "--all"], capsys)
    _fits(full, "tier", "kind", "units", "seqs", "tokens", "total")
    units = [ln.split()[0] for ln in full.splitlines() if ("▓" in ln or "█" in ln) and ln.split()[0].isdigit()]
    assert units == [str(u) for u in range(32)]


@pytest.mark.parametrize("width, written", [(120, True), (80, True), (52, True), (30, False)])
def test_a_long_table_renders_as_rich_renders_it(width, written, monkeypatch):
    """A table of more than LONG_TABLE_ROWS rows (``simulate`` of a long plan) is laid out by rich on
    its deciding rows and its rows written with those widths: the text is exactly what rich renders
    for the whole table, at widths where every column fits and where headers wrap; where a cell
    would wrap (30 columns: "ccc dd"), rich renders the whole table."""
    import random

    from zeppelin.planner.tools import tables

    rng = random.Random(3)
    monkeypatch.setattr(tables, "LONG_TABLE_ROWS", 20)  # (a short table renders quickly through rich too)
    rows = 40
    t = tables.table("a long table", ["step", "sim ms", "exposed ms", ("note", "left"), "NIC busy %"],
                     caption="a caption long enough to wrap at the narrower widths of this test, twice over")
    for i in range(rows):
        t.add_row(str(i), f"{rng.uniform(0, 10 ** rng.randint(0, 5)):.2f}",
                  f"{rng.uniform(0, 99):.2f}\n+{rng.uniform(0, 9):.2f}", rng.choice(["a", "bb", "ccc dd"]),
                  f"{rng.uniform(0, 100):.1f}")
    taken = []
    fast = tables._long_table_lines

    def spy(*a):
        out = fast(*a)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(tables, "_long_table_lines", spy)
    text = tables.render_text(t, width)
    assert taken == [written]  # the rows were written, not rendered by rich
    monkeypatch.setattr(tables, "LONG_TABLE_ROWS", 10 ** 9)
    assert text == tables.render_text(t, width)
    assert len(text.splitlines()) > 2 * rows
