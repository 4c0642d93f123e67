"""Real tokens: token-id manifests (JSON lines, Parquet list<int>, .npy/.bin token files with an
offsets index), text manifests tokenized with a Hugging Face tokenizer.json, the plan's manifest
hash, and `zeppelin run --data` feeding exactly those tokens."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zeppelin.schemas.common import InputError
from zeppelin.schemas.io.datasets import load_manifest

ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")

WORDS = ("the cat dog bird sees likes finds a small big red blue tree house river stone and then "
         "runs sleeps sings under over near").split()


def corpus(n: int, seed: int = 0) -> list[str]:
    """Simple sentences from a tiny grammar (learnable by a tiny model in a few steps)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(2, 12)):
            parts.append(f"the {rng.choice(WORDS[6:10])} {rng.choice(WORDS[1:4])} {rng.choice(WORDS[4:6])} "
                         f"a {rng.choice(WORDS[10:14])} .")
        out.append(" ".join(parts))
    return out


def make_tokenizer(path: Path, texts: list[str]) -> Path:
    """A tiny word-level tokenizer.json trained with the tokenizers library."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=200, special_tokens=["[UNK]"]))
    tk.save(str(path))
    return path


@pytest.fixture(scope="module")
def text_manifest(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    d = tmp_path_factory.mktemp("text")
    texts = corpus(120)
    tok = make_tokenizer(d / "tokenizer.json", texts)
    with (d / "docs.jsonl").open("w") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t}) + "\n")
    spec = d / "docs.manifest.json"
    spec.write_text(json.dumps({"paths": ["docs.jsonl"], "text_field": "text", "tokenizer": "tokenizer.json"}))
    return spec, tok, texts


def test_text_manifest_tokenized_with_tokenizer_json(text_manifest):
    from tokenizers import Tokenizer

    spec, tok, texts = text_manifest
    ds = load_manifest(spec)
    ref = Tokenizer.from_file(str(tok))
    assert ds.has_tokens and ds.num_samples == len(texts)
    for i in (0, 7, len(texts) - 1):
        ids = ref.encode(texts[i]).ids
        assert ds.tokens(i).tolist() == ids and ds.lengths[i] == len(ids)
    # a directory holding tokenizer.json works too; the plan header says the manifest has ids
    spec2 = spec.parent / "dir.manifest.json"
    spec2.write_text(json.dumps({"paths": ["docs.jsonl"], "text_field": "text", "tokenizer": "./"}))
    d2 = load_manifest(spec2)
    assert d2.content_hash == ds.content_hash and ds.manifest_ref().token_ids


def test_bad_tokenizer_files(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    spec = tmp_path / "x.manifest.json"
    spec.write_text(json.dumps({"paths": ["d.jsonl"], "text_field": "text", "tokenizer": "missing/tokenizer.json"}))
    with pytest.raises(InputError) as e:
        load_manifest(spec)
    assert str(e.value) == (f"{tmp_path / 'missing/tokenizer.json'}: tokenizer file not found (name a "
                            "tokenizer.json or a directory holding one)")
    (tmp_path / "bad.json").write_text('{"model": 3}')
    spec.write_text(json.dumps({"paths": ["d.jsonl"], "text_field": "text", "tokenizer": "bad.json"}))
    with pytest.raises(InputError, match=r"bad.json: cannot read tokenizer.json \("):
        load_manifest(spec)


def test_parquet_token_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [[1, 2, 3], [4, 5], list(range(10, 30))]
    pq.write_table(pa.table({"ids": pa.array(rows, type=pa.list_(pa.int32()))}), tmp_path / "t.parquet")
    spec = tmp_path / "t.manifest.json"
    spec.write_text(json.dumps({"paths": ["t.parquet"], "tokens_field": "ids"}))
    ds = load_manifest(spec)
    assert ds.lengths.tolist() == [3, 2, 20] and [ds.tokens(i).tolist() for i in range(3)] == rows


@pytest.mark.parametrize("kind", ["npy", "bin"])
def test_token_files_with_offsets(tmp_path, kind):
    rows = [[1, 2, 3], [4, 5], list(range(10, 30)), [7]]
    flat = np.concatenate([np.asarray(r) for r in rows]).astype(np.uint16)
    off = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    if kind == "npy":
        np.save(tmp_path / "tok.npy", flat)
    else:
        flat.astype("<u2").tofile(tmp_path / "tok.bin")
    np.save(tmp_path / "off.npy", off)
    doc = {"paths": [f"tok.{kind}"], "offsets": ["off.npy"]} | ({"token_dtype": "uint16"} if kind == "bin" else {})
    spec = tmp_path / "t.manifest.json"
    spec.write_text(json.dumps(doc))
    ds = load_manifest(spec)
    assert ds.lengths.tolist() == [3, 2, 20, 1] and [ds.tokens(i).tolist() for i in range(4)] == rows
    # the same ids as a JSON-lines manifest: the same content hash
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"ids": r}) + "\n" for r in rows))
    assert load_manifest(tmp_path / "same.jsonl", tokens_field="ids").content_hash == ds.content_hash
    # two shards
    np.save(tmp_path / "off2.npy", off)
    spec.write_text(json.dumps(doc | {"paths": [f"tok.{kind}"] * 2, "offsets": ["off.npy", "off2.npy"]}))
    ds2 = load_manifest(spec)
    assert ds2.num_samples == 8 and ds2.tokens(6).tolist() == rows[2]


@pytest.mark.parametrize("doc, offsets, message", [
    ({"paths": ["tok.bin"]}, [0, 3, 5], "tok.bin: a .bin token file needs token_dtype in the manifest (uint16, "
                                        "uint32, int32 or int64)"),
    ({"paths": ["tok.bin"], "token_dtype": "uint16"}, [0, 3, 3, 5], "off.npy: non-positive length 0 at sample 1 "
                                                                    "(offsets 3 -> 3)"),
    ({"paths": ["tok.bin"], "token_dtype": "uint16"}, [0, 3, 4], "off.npy: the offsets index ends at 4 but the "
                                                                 "token file holds 5 ids"),
    ({"paths": ["tok.bin"], "token_dtype": "uint16"}, [1, 3, 5], "off.npy: the offsets index must start at 0 "
                                                                 "(got 1)"),
    ({"paths": ["tok.bin"], "token_dtype": "uint32"}, [0, 3, 5], "tok.bin: file size 10 is not a multiple of the "
                                                                 "uint32 token size (4 bytes)"),
])
def test_bad_token_files(tmp_path, doc, offsets, message):
    np.arange(5, dtype="<u2").tofile(tmp_path / "tok.bin")
    np.save(tmp_path / "off.npy", np.asarray(offsets, dtype=np.int64))
    spec = tmp_path / "t.manifest.json"
    spec.write_text(json.dumps(doc | {"offsets": ["off.npy"]}))
    with pytest.raises(InputError) as e:
        load_manifest(spec)
    assert str(e.value) == f"{tmp_path}/{message}"


def _plan(manifest: Path, out: Path, steps: int = 20) -> dict:
    p = subprocess.run([ZEPPELIN, "plan", "-m", str(manifest), "--cluster", "local-cpu:1x2", "--model", "tiny",
                        "--steps", str(steps), "--seqs-per-step", "6", "-q", "-o", str(out)],
                       capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text().splitlines()[0])


def test_run_feeds_exactly_the_manifest_tokens(text_manifest, tmp_path):
    """The plan records the manifest's hash and that it holds ids; the run's token source gives
    each planned sequence's tokenizer ids; a run without --data is refused."""
    from tokenizers import Tokenizer

    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks

    spec, tok, texts = text_manifest
    header = _plan(spec, tmp_path / "p.jsonl", steps=2)
    ds = load_manifest(spec)
    assert header["hashes"]["manifest"] == ds.content_hash and header["manifest"]["token_ids"] is True
    reader, source, _, _ = startup_checks(RunConfig(plan=str(tmp_path / "p.jsonl"), data=str(spec)), 2)
    assert not source.synthetic and source.describe().startswith(f"token ids from {spec} (120 samples,")
    ref = Tokenizer.from_file(str(tok))
    step = reader.step(0)
    for q, s in enumerate(step.sequences):
        batch = source.segments(step.sequences, [[q, 0, s.length]])
        assert batch.tokens.tolist() == ref.encode(texts[s.sample_id]).ids[: s.length]
    with pytest.raises(InputError) as e:
        startup_checks(RunConfig(plan=str(tmp_path / "p.jsonl")), 2)
    assert str(e.value) == (f"the plan was made from a manifest with token ids ({spec}); pass it with --data "
                            "(without it the run would train on synthetic ids)")
    from zeppelin.runtime import open_plan

    with pytest.raises(InputError) as e:
        open_plan(tmp_path / "p.jsonl", rank=0, world_size=2)
    assert str(e.value) == (f"the plan was made from a manifest with token ids ({spec}); pass it as data= "
                            "(without it the steps would get synthetic ids)")


def test_lengths_only_manifest_is_synthetic(tmp_path):
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.train.checks import startup_checks

    m = tmp_path / "lens.jsonl"
    m.write_text("".join(json.dumps({"length": n}) + "\n" for n in [30, 12, 50, 7, 22, 9]))
    header = _plan(m, tmp_path / "p.jsonl", steps=1)
    assert "token_ids" not in header["manifest"]
    for data in (None, str(m)):
        _, source, _, _ = startup_checks(RunConfig(plan=str(tmp_path / "p.jsonl"), data=data), 2)
        assert source.synthetic
    assert source.describe() == f"synthetic token ids (the manifest {m} holds lengths only; seed 0, vocabulary 256)"


def _train(plan: Path, data: Path, tmp_path: Path) -> tuple[str, list[float]]:
    metrics = tmp_path / f"{plan.stem}.metrics.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([ZEPPELIN, "run", str(plan), "--data", str(data), "--lr", "1e-2", "--progress", "none",
                        "--metrics", str(metrics)], capture_output=True, text=True, env=env, timeout=200, check=False)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()[0], [json.loads(ln)["loss"] for ln in metrics.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_tokens_train_20_steps(text_manifest, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    spec, tok, texts = text_manifest
    # a Parquet manifest of token ids (the same corpus, tokenized here)
    ref = Tokenizer.from_file(str(tok))
    ids = [ref.encode(t).ids for t in corpus(120, seed=1)]
    pq.write_table(pa.table({"input_ids": pa.array(ids, type=pa.list_(pa.int64()))}), tmp_path / "ids.parquet")
    pspec = tmp_path / "ids.manifest.json"
    pspec.write_text(json.dumps({"paths": ["ids.parquet"], "tokens_field": "input_ids"}))
    for name, manifest in (("text", spec), ("parquet", pspec)):
        plan = tmp_path / f"{name}.jsonl"
        _plan(manifest, plan, steps=20)
        first, losses = _train(plan, manifest, tmp_path)
        assert first.startswith(f"zeppelin run: token ids from {manifest} (120 samples, "), first
        assert len(losses) == 20
        head, tail = np.mean(losses[:4]), np.mean(losses[-4:])
        assert tail < 0.6 * head, (name, losses)
