"""Manifest readers: every format, directories/globs/specs, token ids, tokenizers, bad input."""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from zeppelin.schemas.common import InputError, content_hash
from zeppelin.schemas.io import jsonl, readers
from zeppelin.schemas.io.datasets import (
    Dataset,
    default_manifest_path,
    length_histogram,
    length_stats,
    load_manifest,
)
from zeppelin.schemas.manifest import ManifestSpec

ROOT = Path(__file__).resolve().parents[2]


def toy_tokenizer(text: str) -> list[int]:
    """A Python tokenizer passed in by the caller: one id per character (its code point)."""
    return [ord(c) for c in text]


def count_tokenizer(text: str) -> int:
    return len(text) + 1


def bad_tokenizer(text: str):
    return "oops"


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def err(fn, *a, **k) -> str:
    with pytest.raises(InputError) as ei:
        fn(*a, **k)
    return str(ei.value)


# ------------------------------------------------------------------------------------ JSONL


def reference_jsonl(path: Path, field: str = "length") -> list[int]:
    """Independent reference: json.loads every line, skip blanks and a leading header."""
    out, first = [], True
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if first and field not in rec and all(k.startswith("_") for k in rec):
            first = False
            continue
        first = False
        out.append(rec[field])
    return out


def test_jsonl_fast_path_matches_json_reference_on_awkward_records(tmp_path):
    rng = np.random.default_rng(1)
    lines = ['{"_comment": "made by a test", "_n": 3}']
    shapes = [
        '{{"length": {n}}}',
        '{{"length":{n},"text":"plain"}}',
        '{{"text": "has {{braces}} and [brackets]", "length": {n}}}',  # brace before key: json path
        '{{"meta": {{"length": 999999}}, "length": {n}}}',  # nested key: json path
        '{{"length": {n}, "meta": {{"length": 7}}}}',  # nested after: 2 hits -> json path
        '{{"length": 999, "length": {n}}}',  # duplicate: json keeps the last
        '{{"a": "quote \\" inside", "length" :  {n} , "b": [1, 2]}}',
        '{{"a": "x\\\\", "length":{n}}}',
        '   {{"length": {n}}}   ',  # surrounding whitespace
        '{{"t": "\\"length\\": 5", "length": {n}}}',  # key text inside a string
    ]
    for i in range(400):
        n = int(rng.integers(1, 200000))
        lines.append(shapes[i % len(shapes)].format(n=n))
        if i % 37 == 0:
            lines.append("")
    p = write_lines(tmp_path / "m.jsonl", lines)
    # CRLF variant of the same file
    q = tmp_path / "crlf.jsonl"
    q.write_bytes(p.read_bytes().replace(b"\n", b"\r\n"))
    ref = reference_jsonl(p)
    assert len(ref) == 400
    for path in (p, q):
        ds = load_manifest(path)
        assert ds.lengths.dtype == np.int64
        assert ds.lengths.tolist() == ref
        assert ds.format == "jsonl" and not ds.has_tokens and ds.tokens(0) is None


def test_common_records_take_the_vectorised_path(tmp_path, monkeypatch):
    """Only the header goes through json.loads for the usual record shapes (speed guard)."""
    calls = []
    orig = jsonl.JsonlReader._parse

    def counting(self, raw, lineno):
        calls.append(lineno)
        return orig(self, raw, lineno)

    monkeypatch.setattr(jsonl.JsonlReader, "_parse", counting)
    rng = np.random.default_rng(0)
    n = rng.integers(1, 10**9, size=600)  # 1 to 9 digits
    lines = ['{"_comment": "h"}'] + [
        (f'{{"length": {v}}}' if i % 3 == 0 else f'{{"id": {i}, "src": "web", "length":{v}, "lang": "en"}}'
         if i % 3 == 1 else f'{{"length" : {v} ,"text":"a {{b}} [c]"}}') for i, v in enumerate(n)]
    p = write_lines(tmp_path / "m.jsonl", lines)
    assert load_manifest(p).lengths.tolist() == n.tolist()
    assert calls == [1]


def test_jsonl_small_chunks_give_same_result_and_line_numbers(tmp_path, monkeypatch):
    lines = ['{"_comment": "h"}'] + [f'{{"length": {i + 1}, "pad": "{"x" * (i % 13)}"}}' for i in range(300)]
    p = write_lines(tmp_path / "m.jsonl", lines)
    whole = load_manifest(p).lengths
    monkeypatch.setattr(readers, "CHUNK_BYTES", 97)
    assert load_manifest(p).lengths.tolist() == whole.tolist() == list(range(1, 301))
    lines[250] = '{"length": 0, "pad": ""}'
    write_lines(p, lines)
    assert err(load_manifest, p) == f"{p}: non-positive length 0 at sample 249 (line 251)"


def test_jsonl_gz_and_ndjson(tmp_path):
    recs = [f'{{"length": {n}}}' for n in (5, 6, 7)]
    g = tmp_path / "a.jsonl.gz"
    with gzip.open(g, "wt") as fh:
        fh.write("\n".join(recs))  # no trailing newline
    assert load_manifest(g).lengths.tolist() == [5, 6, 7]
    n = write_lines(tmp_path / "b.ndjson", recs)
    assert load_manifest(n).lengths.tolist() == [5, 6, 7]


def test_custom_length_field(tmp_path):
    p = write_lines(tmp_path / "m.jsonl", ['{"n_tok": 4, "length": 100}', '{"length": 100, "n_tok": 9}'])
    assert load_manifest(p, length_field="n_tok").lengths.tolist() == [4, 9]


def test_tokens_field_keeps_flat_ids_and_hash_covers_them(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", ['{"_comment": "ids"}', '{"ids": [1, 2, 3]}', '{"ids": [7]}',
                                           '{"ids": [4, 5]}'])
    ds = load_manifest(p, tokens_field="ids")
    assert ds.has_tokens
    assert ds.lengths.tolist() == [3, 1, 2]
    assert ds.tokens(0).tolist() == [1, 2, 3] and ds.tokens(1).tolist() == [7] and ds.tokens(2).tolist() == [4, 5]
    expected = content_hash(np.array([3, 1, 2], "<i8").tobytes() + np.array([1, 2, 3, 7, 4, 5], "<i8").tobytes())
    assert ds.content_hash == expected
    # same lengths, different ids -> different hash
    q = write_lines(tmp_path / "u.jsonl", ['{"ids": [1, 2, 3]}', '{"ids": [8]}', '{"ids": [4, 5]}'])
    assert load_manifest(q, tokens_field="ids").content_hash != expected
    with pytest.raises(IndexError):
        ds.tokens(3)


def test_text_field_with_builtin_and_python_tokenizers(tmp_path):
    p = write_lines(tmp_path / "x.jsonl", [json.dumps({"text": "hello big world"}), json.dumps({"text": "é a"})])
    assert load_manifest(p, text_field="text", tokenizer="whitespace").lengths.tolist() == [3, 2]
    assert load_manifest(p, text_field="text", tokenizer="bytes").lengths.tolist() == [15, 4]
    ds = load_manifest(p, text_field="text", tokenizer=toy_tokenizer)
    assert ds.lengths.tolist() == [15, 3]
    assert ds.has_tokens and ds.tokens(1).tolist() == [ord("é"), ord(" "), ord("a")]
    ds = load_manifest(p, text_field="text", tokenizer=count_tokenizer)
    assert ds.lengths.tolist() == [16, 4] and not ds.has_tokens


def test_tokenizer_errors(tmp_path):
    p = write_lines(tmp_path / "x.jsonl", [json.dumps({"text": "a b"})])
    assert err(load_manifest, p, text_field="text", tokenizer=f"{__name__}:toy_tokenizer") == (
        f"tokenizer '{__name__}:toy_tokenizer' names Python code, which a manifest or case file may not do "
        "(built-in tokenizers: 'whitespace', 'bytes' or a tokenizer.json path; `zeppelin data stats --python-tokenizer MODULE:CALLABLE` "
        "runs code you name on the command line)")
    assert err(load_manifest, p, text_field="text", tokenizer="sentencepiece-ish") == (
        "unknown tokenizer 'sentencepiece-ish' (use 'whitespace', 'bytes' or a tokenizer.json path)")
    assert err(load_manifest, p, text_field="text", tokenizer=bad_tokenizer) == (
        f"{p}: tokenizer returned str at line 1; expected a list of token ids or a count")
    assert err(load_manifest, p, text_field="text") == (
        "text_field needs a tokenizer ('whitespace', 'bytes' or a tokenizer.json path)")


def test_jsonl_error_messages(tmp_path):
    p = write_lines(tmp_path / "a.jsonl", ['{"length": 3, "text": "x"}', '{"len": 4, "text": "y"}'])
    assert err(load_manifest, p) == f"{p}: field 'length' not found at line 2 (fields: len, text)"
    assert err(load_manifest, p, length_field="len") == f"{p}: field 'len' not found at line 1 (fields: length, text)"
    p = write_lines(tmp_path / "b.jsonl", ['{"length": 3}', '{"length": 4', '{"length": 5}'])
    assert err(load_manifest, p) == f"{p}: malformed JSON at line 2: Expecting ',' delimiter (column 13)"
    p = write_lines(tmp_path / "c.jsonl", ['{"length": 3}'] * 7 + ['{"length": -3}'])
    assert err(load_manifest, p) == f"{p}: non-positive length -3 at sample 7 (line 8)"
    p = write_lines(tmp_path / "d.jsonl", ['{"length": 3.5}'])
    assert err(load_manifest, p) == f"{p}: field 'length' at line 1 must be an integer, got 3.5"
    p = write_lines(tmp_path / "e.jsonl", ['{"length": "12"}'])
    assert err(load_manifest, p) == f"{p}: field 'length' at line 1 must be an integer, got \"12\""
    p = write_lines(tmp_path / "f.jsonl", ["[1, 2]"])
    assert err(load_manifest, p) == f"{p}: expected a JSON object at line 1, got array"
    p = write_lines(tmp_path / "g.jsonl", ['{"_comment": "only a header"}', ""])
    assert err(load_manifest, p) == f"{p}: manifest has no samples"
    p = write_lines(tmp_path / "h.jsonl", ['{"length": 3}', '{"_late": "not a header"}'])
    assert err(load_manifest, p) == f"{p}: field 'length' not found at line 2 (fields: _late)"
    p = write_lines(tmp_path / "i.jsonl", ['{"ids": [1, "a"]}'])
    assert err(load_manifest, p, tokens_field="ids") == (
        f"{p}: field 'ids' at line 1 must be a list of integer token ids")
    p = write_lines(tmp_path / "j.jsonl", ['{"ids": []}'])
    assert err(load_manifest, p, tokens_field="ids") == f"{p}: non-positive length 0 at sample 0 (line 1)"
    p = write_lines(tmp_path / "k.jsonl", ['{"length": 05}'])
    assert err(load_manifest, p).startswith(f"{p}: malformed JSON at line 1: ")


# ------------------------------------------------------------------------------------ Parquet


def test_parquet_lengths_tokens_text_and_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    t = pa.table({"length": pa.array([5, 1, 9], pa.int32()), "ids": [[1, 2], [3], [4, 5, 6]],
                  "text": ["a b", "c", "d e f g"], "score": [0.1, 0.2, 0.3]})
    p = tmp_path / "m.parquet"
    pq.write_table(t, p, row_group_size=2)
    ds = load_manifest(p)
    assert ds.format == "parquet" and ds.lengths.tolist() == [5, 1, 9]
    ds = load_manifest(p, tokens_field="ids")
    assert ds.lengths.tolist() == [2, 1, 3] and ds.tokens(2).tolist() == [4, 5, 6]
    # same ids via JSONL -> same content hash
    j = write_lines(tmp_path / "m.jsonl", ['{"ids": [1, 2]}', '{"ids": [3]}', '{"ids": [4, 5, 6]}'])
    assert load_manifest(j, tokens_field="ids").content_hash == ds.content_hash
    assert load_manifest(p, text_field="text", tokenizer="whitespace").lengths.tolist() == [2, 1, 4]
    assert err(load_manifest, p, length_field="len") == (
        f"{p}: column 'len' not found (columns: length, ids, text, score)")
    assert err(load_manifest, p, length_field="score") == f"{p}: column 'score' has type double, expected integers"
    q = tmp_path / "null.parquet"
    pq.write_table(pa.table({"length": pa.array([3, None, 4], pa.int64())}), q)
    assert err(load_manifest, q) == f"{q}: null 'length' at row 1 (sample 1)"
    z = tmp_path / "zero.parquet"
    pq.write_table(pa.table({"length": pa.array([3, 4, 0], pa.int64())}), z)
    assert err(load_manifest, z) == f"{z}: non-positive length 0 at sample 2"
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    assert err(load_manifest, bad).startswith(f"{bad}: cannot read Parquet file (")


# ------------------------------------------------------------------------------------ npy / txt


def test_npy(tmp_path):
    p = tmp_path / "l.npy"
    np.save(p, np.array([3, 8, 2], dtype=np.uint16))
    ds = load_manifest(p)
    assert ds.format == "npy" and ds.lengths.dtype == np.int64 and ds.lengths.tolist() == [3, 8, 2]
    np.save(p, np.ones((2, 3), dtype=np.int64))
    assert err(load_manifest, p) == f"{p}: expected a 1-D array of lengths, got shape (2, 3)"
    np.save(p, np.array([1.0, 2.0]))
    assert err(load_manifest, p) == f"{p}: expected an integer array of lengths, got dtype float64"
    np.save(p, np.array([4, 5, -1, 6]))
    assert err(load_manifest, p) == f"{p}: non-positive length -1 at sample 2"
    np.save(p, np.zeros(0, dtype=np.int64))
    assert err(load_manifest, p) == f"{p}: manifest has no samples"
    j = write_lines(tmp_path / "l.jsonl", ['{"length": 3}'])
    assert err(load_manifest, p.with_name("l.npy"), tokens_field="ids") == (
        f"{p}: npy manifests hold lengths only; tokens_field needs JSON lines or Parquet")
    assert j.exists()


def test_txt(tmp_path, monkeypatch):
    p = tmp_path / "l.txt"
    p.write_text("# lengths of a test corpus\n12\n\n  7 \n3\n")
    assert load_manifest(p).lengths.tolist() == [12, 7, 3]
    p.write_text("12\n\n7\r\n3")  # no comments: vectorised parse, blank line, CRLF, no final newline
    assert load_manifest(p).lengths.tolist() == [12, 7, 3]
    p.write_text("12\n7 8\n")
    assert err(load_manifest, p) == f"{p}: expected one integer length per line, got '7 8' at line 2"
    p.write_text("12\nabc\n")
    assert err(load_manifest, p) == f"{p}: expected one integer length per line, got 'abc' at line 2"
    p.write_text("12\n\n5\n0\n")
    assert err(load_manifest, p) == f"{p}: non-positive length 0 at sample 2 (line 4)"
    q = tmp_path / "l.lengths"
    monkeypatch.setattr(readers, "CHUNK_BYTES", 8)
    q.write_text("".join(f"{i}\n" for i in range(1, 200)))
    assert load_manifest(q).lengths.tolist() == list(range(1, 200))


# ------------------------------------------------------------------------------------ shards


def test_directory_glob_and_spec_document(tmp_path):
    d = tmp_path / "shards"
    (d / "sub").mkdir(parents=True)
    write_lines(d / "b.jsonl", ['{"length": 2}', '{"length": 3}'])
    write_lines(d / "a.jsonl", ['{"length": 1}'])
    np.save(d / "sub" / "c.npy", np.array([4, 5]))
    (d / "notes.md").write_text("ignored")
    (d / ".hidden.jsonl").write_text('{"length": 999}\n')
    ds = load_manifest(d)
    assert ds.lengths.tolist() == [1, 2, 3, 4, 5]
    assert ds.format == "mixed" and len(ds.shards) == 3
    assert load_manifest(str(d / "*.jsonl")).lengths.tolist() == [1, 2, 3]
    assert err(load_manifest, str(d / "*.parquet")) == f"no manifest shards match '{d / '*.parquet'}'"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert err(load_manifest, empty).startswith(f"{empty}: directory has no manifest shards (known extensions: ")
    assert err(load_manifest, tmp_path / "nope.jsonl") == f"{tmp_path / 'nope.jsonl'}: file not found"
    odd = tmp_path / "x.csv"
    odd.write_text("1\n")
    assert err(load_manifest, odd).startswith(f"{odd}: unknown manifest format (extension '.csv'; known: ")
    # a spec document: paths relative to it, custom field, forced format
    (tmp_path / "extra").mkdir()
    write_lines(tmp_path / "extra" / "e.data", ['{"n": 6}', '{"n": 7}'])
    spec = tmp_path / "my.manifest.json"
    spec.write_text(json.dumps({"schema_version": "zeppelin.manifest/1", "paths": ["extra/e.data"],
                                "format": "jsonl", "length_field": "n"}))
    ds = load_manifest(spec)
    assert ds.lengths.tolist() == [6, 7] and ds.source == str(spec)
    # in-memory spec, keyword arguments override it
    ms = ManifestSpec(paths=[str(tmp_path / "extra" / "e.data")], format="jsonl", length_field="zz")
    assert load_manifest(ms, length_field="n").lengths.tolist() == [6, 7]
    spec.write_text('{"schema_version": "zeppelin.manifest/1", "paths": []')
    assert err(load_manifest, spec) == f"{spec}: malformed JSON at line 1 column 54: Expecting ',' delimiter"


# ------------------------------------------------------------------------------------ dataset object


def test_hash_is_format_independent_and_matches_common_hash(tmp_path):
    lengths = np.array([10, 20, 30, 40], dtype=np.int64)
    np.save(tmp_path / "a.npy", lengths)
    write_lines(tmp_path / "a.jsonl", [f'{{"length": {n}}}' for n in lengths])
    (tmp_path / "a.txt").write_text("\n".join(map(str, lengths)))
    hashes = {load_manifest(tmp_path / f"a.{e}").content_hash for e in ("npy", "jsonl", "txt")}
    expect = "sha256:" + hashlib.sha256(lengths.astype("<i8").tobytes()).hexdigest()[:16]
    assert hashes == {expect} == {content_hash(lengths.astype("<i8").tobytes())}
    assert Dataset(lengths[::-1], source="x", format="npy").content_hash != expect


def test_stats_and_histogram_against_hand_values():
    a = np.array([1, 2, 3, 4, 100, 1000], dtype=np.int64)
    s = length_stats(a)
    assert (s["num_samples"], s["num_tokens"], s["min"], s["max"]) == (6, 1110, 1, 1000)
    assert s["mean"] == pytest.approx(185.0)
    assert s["percentiles"]["p50"] == pytest.approx(3.5)
    h = length_histogram(a)
    assert [(b["lo"], b["samples"], b["tokens"]) for b in h] == [
        (1, 1, 1), (2, 2, 5), (4, 1, 4), (8, 0, 0), (16, 0, 0), (32, 0, 0), (64, 1, 100), (128, 0, 0),
        (256, 0, 0), (512, 1, 1000)]
    assert sum(b["token_share"] for b in h) == pytest.approx(1.0)


def test_shipped_sample_is_what_its_header_says():
    path = default_manifest_path()
    header = json.loads(path.read_text().splitlines()[0])
    assert set(header) == {"_comment", "_generator"}
    assert header["_generator"] == "python benchmarks/make_sample_manifest.py --seed 0 --num-samples 30000"
    ds = load_manifest(path)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import make_sample_manifest as gen
    finally:
        sys.path.pop(0)
    assert ds.lengths.tolist() == gen.sample_lengths(30000, 0).tolist()
    assert path.stat().st_size < 2_000_000
    # long-tailed: median well under 1K tokens, yet the top 1% of samples carry > 20% of the tokens
    s = np.sort(ds.lengths)[::-1]
    assert np.median(s) < 1024 and s[0] > 100_000
    assert s[: s.size // 100].sum() / s.sum() > 0.2
    assert ds.manifest_ref().num_samples == 30000
