"""`zeppelin data stats` and `zeppelin demo` through the real CLI entry point."""

from __future__ import annotations

import io
import json
import subprocess

import numpy as np
import pytest

from zeppelin.planner.cli import main
from zeppelin.schemas.io.datasets import default_manifest_path, load_manifest


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_stats_on_shipped_sample_tables(capsys):
    code, out, err = run(["data", "stats", str(default_manifest_path())], capsys)
    assert code == 0 and err == ""
    ds = load_manifest(default_manifest_path())
    assert f"{ds.num_samples:,}" in out and f"{ds.num_tokens:,}" in out
    assert f"p50 {np.percentile(ds.lengths, 50):,.0f}" in out
    assert "length histogram" in out and "64K-128K" in out


def test_stats_json_matches_the_reader(tmp_path, capsys):
    p = tmp_path / "m.jsonl"
    p.write_text("".join(f'{{"length": {n}}}\n' for n in (1, 2, 3, 4, 100, 1000)))
    code, out, _ = run(["data", "stats", str(p), "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    assert (d["num_samples"], d["num_tokens"], d["min"], d["max"]) == (6, 1110, 1, 1000)
    assert d["percentiles"]["p50"] == 3.5 and d["format"] == "jsonl"
    assert [b["samples"] for b in d["histogram"]] == [1, 2, 1, 0, 0, 0, 1, 0, 0, 1]


def test_stats_parquet_npy_and_fields(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"n": [5, 6, 7]}), tmp_path / "a.parquet")
    code, out, _ = run(["data", "stats", str(tmp_path / "a.parquet"), "--length-field", "n", "--json"], capsys)
    assert code == 0 and json.loads(out)["num_tokens"] == 18
    np.save(tmp_path / "b.npy", np.array([9, 9]))
    code, out, _ = run(["data", "stats", str(tmp_path / "b.npy"), "--json"], capsys)
    assert code == 0 and json.loads(out)["num_tokens"] == 18
    (tmp_path / "c.jsonl").write_text('{"text": "a b c"}\n{"ids": [1]}\n')
    code, out, err = run(["data", "stats", str(tmp_path / "c.jsonl"), "--text-field", "text",
                          "--tokenizer", "whitespace"], capsys)
    assert code == 2 and err == f"zeppelin: error: {tmp_path / 'c.jsonl'}: field 'text' not found at line 2 " \
                                "(fields: ids); name the field to use with --text-field NAME\n"
    code, _, err = run(["data", "stats", str(tmp_path / "c.jsonl"), "--text-field", "text"], capsys)
    assert code == 2 and err == "zeppelin: error: --text-field needs --tokenizer ('whitespace', 'bytes' or a tokenizer.json path) or " \
                                "--python-tokenizer MODULE:CALLABLE\n"


def test_png_written_and_nothing_written_on_error(tmp_path, capsys):
    png = tmp_path / "h.png"
    code, out, _ = run(["data", "stats", str(default_manifest_path()), "--png", str(png)], capsys)
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"length": 3}\n{"length": -3}\n')
    png2 = tmp_path / "h2.png"
    code, out, err = run(["data", "stats", str(bad), "--png", str(png2)], capsys)
    assert code == 2 and out == ""
    assert err == f"zeppelin: error: {bad}: non-positive length -3 at sample 1 (line 2)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "h.png"]
    code, _, err = run(["data", "stats", str(bad), "--png", str(tmp_path / "h.jpg")], capsys)
    assert code == 2 and err == f"zeppelin: error: {tmp_path / 'h.jpg'}: --png needs a file name ending in .png\n"


@pytest.mark.parametrize("content,problem", [
    ('{"length": 3}\n{"length": 4\n', "malformed JSON at line 2: Expecting ',' delimiter (column 13)"),
    ('{"len": 3}\n', "field 'length' not found at line 1 (fields: len); name the field to use with --length-field NAME"),
    ('{"length": 0}\n', "non-positive length 0 at sample 0 (line 1)"),
    ("\n\n", "manifest has no samples"),
])
def test_stats_bad_manifests_one_line_errors(tmp_path, capsys, content, problem):
    p = tmp_path / "m.jsonl"
    p.write_text(content)
    code, out, err = run(["data", "stats", str(p)], capsys)
    assert (code, out, err) == (2, "", f"zeppelin: error: {p}: {problem}\n")


def test_stats_missing_shards_via_console_script(tmp_path, zeppelin_bin):
    r = subprocess.run([zeppelin_bin, "data", "stats", str(tmp_path / "*.jsonl")], capture_output=True, text=True, check=False,
                       timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"zeppelin: error: no manifest shards match '{tmp_path / '*.jsonl'}'\n"


def test_demo_runs_on_defaults(capsys):
    code, out, err = run(["demo", "--steps", "2"], capsys)
    assert code == 0, err
    ds = load_manifest(default_manifest_path())
    assert f"{ds.num_samples:,}" in out
    assert "zeppelin-a: 2 x 8 A800-SXM4-80GB" in out and "llama-7b" in out
    assert "sampled steps  (tokens_per_step=127,472" in out  # the one default: 7,967 tokens x 16 GPUs
    assert "why tiers" in out and "ring communication hides from" in out


def test_demo_stage_selection_and_crossovers():
    """The cost stage's crossovers agree with the cost model they are derived from."""
    from rich.console import Console

    from zeppelin.planner.tools.demo import DEMO_STAGES, DemoContext
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.plan import SamplerConfig

    cl, mo = cluster_preset("zeppelin-a"), model_preset("llama-7b")
    cm = CostModel(cl, mo)
    ctx = DemoContext(console=Console(file=io.StringIO()), cluster=cl, model=mo, profile=cm.profile,
                      cost=cm, dataset=load_manifest(default_manifest_path()),
                      sampler=SamplerConfig(tokens_per_step=1 << 19), num_steps=2)
    DEMO_STAGES["cost"](ctx)
    x = ctx.results["crossover_tokens"]["intra"]
    G = 8

    def hides(L):  # a later ring round (two full blocks of L/2G) covers the next K/V transfer
        ch = L / (2 * G)
        rnd = 2 * cm.attn_block_time(ch, ch) - cm.profile.attention.overhead_s
        return rnd >= cm.p2p_time(cm.ring_round_bytes(L / G), "intra")

    assert hides(x) and not hides(x * 0.99)
    assert all(hides(x * f) for f in (1.5, 3, 10, 100))
    steps = ctx.results["steps"]
    assert [s["seqs"] for s in steps] == [len(s) for s in ctx.steps]
    assert all(0 < s["attn_flop_share"] < 1 for s in steps)


def test_demo_bad_inputs(capsys):
    from zeppelin.planner.tools.demo import DEMO_STAGES

    assert run(["demo", "--cluster", "nope"], capsys)[2] == (
        "zeppelin: error: unknown cluster preset 'nope' (known: zeppelin-a, zeppelin-b, zeppelin-c, flexsp-a100, "
        "h100, local-cpu)\n")
    assert run(["demo", "--stages", "data,bogus"], capsys)[2] == (
        f"zeppelin: error: unknown demo stage 'bogus' (available: {', '.join(DEMO_STAGES)})\n")
    code, _, err = run(["demo", "--manifest", "/nonexistent/m.jsonl"], capsys)
    assert code == 2 and err == "zeppelin: error: /nonexistent/m.jsonl: file not found\n"
