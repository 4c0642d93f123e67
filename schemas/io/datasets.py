"""Dataset manifests: read every sample's length (and, when present, its token ids) into numpy.

Sources (format detected from the file extension, or forced by a :class:`ManifestSpec`):

* JSON lines ``.jsonl`` / ``.ndjson`` / ``.json`` (optionally ``.gz``): one object per line with
  a length field (default ``length``), a list of token ids (``tokens_field``) or raw text
  (``text_field`` + ``tokenizer``);
* Parquet ``.parquet`` (pyarrow; only the needed column is read, batch by batch);
* NumPy ``.npy``: a 1-D integer array of lengths (memory-mapped while reading);
* text ``.txt`` / ``.lengths`` (optionally ``.gz``): one length per line; blank lines and lines
  starting with ``#`` are ignored.

``ref`` may name one file, a directory (every shard of a known extension below it, sorted by
path), a glob (``data/*.jsonl``), or a ``*.manifest.json`` :class:`ManifestSpec` document whose
``paths`` are relative to the document. Sample ids are positions in the concatenation of the
shards in that order.

JSON-lines shards (header records, the fast path) are read by :mod:`zeppelin.schemas.io.jsonl`,
the other formats by :mod:`zeppelin.schemas.io.readers`, tokenizers resolved by
:mod:`zeppelin.schemas.io.tokenizers`.

All problems raise :class:`~zeppelin.schemas.common.InputError` naming the file, with one-line
messages such as ``field 'len' not found at line 1 (fields: length, text)`` or
``non-positive length -3 at sample 7 (line 8)``.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import os
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..common import InputError
from ..manifest import ManifestSpec
from .documents import load_doc
from .jsonl import JsonlReader
from .readers import Sink, offsets_file, read_npy, read_parquet, read_txt, token_file
from .safefiles import check_input_file
from .tokenizers import BUILTIN_TOKENIZERS, TOKENIZER_HINT, hf_tokenizer, looks_like_path, resolve_tokenizer

__all__ = [
    "KNOWN_EXTENSIONS",
    "PERCENTILES",
    "Dataset",
    "default_manifest_path",
    "length_histogram",
    "length_stats",
    "load_manifest",
    "manifest_files",
]

# extension -> format (longest suffixes first when matching)
KNOWN_EXTENSIONS: dict[str, str] = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".jsonl.gz": "jsonl", ".ndjson.gz": "jsonl", ".json.gz": "jsonl",
    ".parquet": "parquet", ".pq": "parquet",
    ".npy": "npy",
    ".txt": "txt", ".lengths": "txt", ".txt.gz": "txt", ".lengths.gz": "txt",
}
PERCENTILES = (10, 25, 50, 75, 90, 99, 99.9)


def default_manifest_path() -> Path:
    """The sample manifest shipped with the package (long-tailed, see its header line)."""
    return Path(__file__).resolve().parent.parent / "data" / "sample_manifest.jsonl"


# =============================================================================================
# Dataset
# =============================================================================================


class Dataset:
    """Lengths of every sample (``int64``, index = sample id) and optional token ids.

    Token ids are kept flat: ``token_ids[token_offsets[i]:token_offsets[i + 1]]`` are sample
    ``i``'s ids.
    """

    def __init__(self, lengths: np.ndarray, *, source: str, format: str, shards: list[str] | None = None,
                 token_ids: np.ndarray | None = None, token_offsets: np.ndarray | None = None):
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        self.source = source
        self.format = format
        self.shards = list(shards or [source])
        self._token_ids = token_ids
        self._token_offsets = token_offsets
        if token_ids is not None and (token_offsets is None or len(token_offsets) != len(self.lengths) + 1):
            raise ValueError("token_offsets must have num_samples + 1 entries")

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    @cached_property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def has_tokens(self) -> bool:
        return self._token_ids is not None

    def tokens(self, sample_id: int) -> np.ndarray | None:
        """Token ids of one sample (a view into the flat array), or None without token ids."""
        if self._token_ids is None:
            return None
        if not 0 <= sample_id < self.num_samples:
            raise IndexError(f"sample id {sample_id} out of range (0..{self.num_samples - 1})")
        return self._token_ids[self._token_offsets[sample_id]:self._token_offsets[sample_id + 1]]

    @cached_property
    def content_hash(self) -> str:
        """``sha256:<16 hex>`` of the little-endian int64 lengths bytes, followed by the int64
        token ids bytes when the manifest has token ids (equal to
        ``common.content_hash(lengths_bytes + token_bytes)``)."""
        h = hashlib.sha256()
        h.update(self.lengths.astype("<i8", copy=False).tobytes())
        if self._token_ids is not None:  # in chunks: token files may be memory maps larger than memory
            step = 1 << 24
            for a in range(0, int(self._token_ids.shape[0]), step):
                h.update(np.ascontiguousarray(self._token_ids[a:a + step], dtype="<i8").tobytes())
        return "sha256:" + h.hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "source": self.source,
            "format": self.format,
            "shards": len(self.shards),
            "has_tokens": self.has_tokens,
            "content_hash": self.content_hash,
        }
        d.update(length_stats(self.lengths))
        return d

    def manifest_ref(self):
        """The plan header's :class:`~zeppelin.schemas.plan.ManifestRef` for this dataset."""
        from ..plan import ManifestRef

        return ManifestRef(path=self.source, format=self.format, num_samples=self.num_samples,
                           num_tokens=self.num_tokens, token_ids=self.has_tokens)

    def __repr__(self) -> str:
        return (f"Dataset({self.source!r}, format={self.format}, samples={self.num_samples}, "
                f"tokens={self.num_tokens})")


def length_stats(lengths: np.ndarray) -> dict[str, Any]:
    """Count, token total, mean, min/max and the :data:`PERCENTILES` of a lengths array."""
    a = np.asarray(lengths, dtype=np.int64)
    if a.size == 0:
        raise InputError("manifest has no samples")
    pct = np.percentile(a, PERCENTILES)
    return {
        "num_samples": int(a.size),
        "num_tokens": int(a.sum()),
        "mean": float(a.mean()),
        "min": int(a.min()),
        "max": int(a.max()),
        "percentiles": {f"p{p:g}": float(v) for p, v in zip(PERCENTILES, pct)},
    }


def length_histogram(lengths: np.ndarray) -> list[dict[str, Any]]:
    """Power-of-two buckets ``[2^k, 2^(k+1))`` from the shortest to the longest sample:
    samples and tokens in each (empty buckets inside the range are kept)."""
    a = np.asarray(lengths, dtype=np.int64)
    if a.size == 0:
        raise InputError("manifest has no samples")
    k = np.floor(np.log2(a)).astype(np.int64)
    lo, hi = int(k.min()), int(k.max())
    counts = np.bincount(k - lo, minlength=hi - lo + 1)
    toks = np.bincount(k - lo, weights=a, minlength=hi - lo + 1)
    n, t = float(a.size), float(a.sum())
    return [
        {"lo": 1 << (lo + i), "hi": 1 << (lo + i + 1), "samples": int(counts[i]), "tokens": int(toks[i]),
         "sample_share": float(counts[i] / n), "token_share": float(toks[i] / t)}
        for i in range(hi - lo + 1)
    ]


# =============================================================================================
# Shard resolution
# =============================================================================================


def _ext_format(path: Path) -> str | None:
    name = path.name.lower()
    for ext in sorted(KNOWN_EXTENSIONS, key=len, reverse=True):
        if name.endswith(ext):
            return KNOWN_EXTENSIONS[ext]
    return None


def _has_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def _is_dir(p: Path) -> bool:
    """``p.is_dir()``, with a path the system cannot even look up (name too long, a loop) as one line."""
    try:
        os.stat(p)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise InputError(f"cannot read manifest: {e.strerror or e.__class__.__name__}", source=p) from None
    return p.is_dir()


def _expand(pattern: str, base: Path | None, forced: str | None) -> list[tuple[Path, str]]:
    """Files (with their format) named by one path / directory / glob."""
    p = Path(pattern).expanduser()
    if base is not None and not p.is_absolute():
        p = base / p
    if _has_magic(pattern):
        matches = sorted(Path(m) for m in _glob.glob(str(p), recursive=True) if Path(m).is_file())
        if not matches:
            raise InputError(f"no manifest shards match {pattern!r}")
        files = matches
    elif _is_dir(p):
        files = sorted(f for f in p.rglob("*") if f.is_file() and not any(
            part.startswith(".") for part in f.relative_to(p).parts) and _ext_format(f) is not None
            and (forced is None or _ext_format(f) == forced))
        if not files:
            known = ", ".join(sorted(set(KNOWN_EXTENSIONS)))
            raise InputError(f"directory has no manifest shards (known extensions: {known})", source=p)
    elif p.exists():
        files = [p]
    else:
        raise InputError("file not found", source=p)
    out = []
    for f in files:
        check_input_file(f, "manifest")
        fmt = forced or _ext_format(f)
        if fmt is None:
            known = ", ".join(sorted(set(KNOWN_EXTENSIONS)))
            raise InputError(f"unknown manifest format (extension {''.join(f.suffixes) or 'none'!r}; "
                             f"known: {known}; or name a *.manifest.json document)", source=f)
        out.append((f, fmt))
    return out


# =============================================================================================
# Token files and the entry point
# =============================================================================================


def _joined(p: str, base: Path | None) -> Path:
    q = Path(p).expanduser()
    return base / q if base is not None and not q.is_absolute() else q


def _load_token_files(spec: ManifestSpec, base: Path | None, source: str) -> Dataset:
    """Token files (``.npy`` / ``.bin``) with an offsets index each (``spec.offsets``, paired with
    ``spec.paths`` in order): sample ``i`` of a shard is ``tokens[offsets[i]:offsets[i + 1]]``."""
    def one(p: str) -> Path:
        q = _joined(p, base)
        if not q.exists():
            raise InputError("file not found", source=q)
        return q

    paths = [one(p) for p in spec.paths]
    offs = [one(p) for p in spec.offsets or []]
    if len(paths) != len(offs):
        raise InputError(f"{len(paths)} token files but {len(offs)} offsets indexes (one per token file)",
                         source=source)
    toks, lens, names = [], [], []
    for tp, op in zip(paths, offs):
        t = token_file(tp, spec.token_dtype)
        off = offsets_file(op, int(t.shape[0]))
        toks.append(t)
        lens.append(np.diff(off))
        names.append(str(tp))
    lengths = np.concatenate(lens) if len(lens) > 1 else lens[0]
    token_ids = toks[0] if len(toks) == 1 else np.concatenate([np.asarray(t, dtype=np.int64) for t in toks])
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    fmt = "tokens-npy" if all(n.lower().endswith(".npy") for n in names) else "tokens-bin"
    return Dataset(lengths, source=source, format=fmt, shards=names, token_ids=token_ids, token_offsets=offsets)


def _is_spec_file(ref: str | os.PathLike) -> bool:
    return str(ref).lower().endswith(".manifest.json")


def _spec_of(ref: str | os.PathLike | ManifestSpec) -> tuple[ManifestSpec, Path | None, str]:
    """The spec a manifest reference names, the directory its paths are relative to (a spec
    document's; None: the current directory) and the name the dataset is known by."""
    if isinstance(ref, ManifestSpec):
        return ref, None, ref.name or ",".join(ref.paths)
    if _is_spec_file(ref):
        return load_doc(ManifestSpec, ref), Path(ref).parent, str(ref)
    return ManifestSpec(paths=[str(ref)]), None, str(ref)


def manifest_files(ref: str | os.PathLike) -> list[Path]:
    """Every file a manifest reference names - the ``*.manifest.json`` document, every shard (token
    files and offsets indexes included) and a tokenizer file - each checked to be a regular file and
    noted as an input of the running command, without reading the data."""
    spec, base, _ = _spec_of(ref)
    out: list[Path] = [Path(ref)] if base is not None else []
    forced = None if spec.format == "auto" else spec.format
    if spec.offsets is not None:
        out.extend(check_input_file(_joined(p, base), "token file") for p in [*spec.paths, *spec.offsets])
    else:
        for pattern in spec.paths:
            out.extend(p for p, _ in _expand(pattern, base, forced))
    tk = spec.tokenizer
    if isinstance(tk, str) and tk not in BUILTIN_TOKENIZERS and looks_like_path(tk):
        encode = hf_tokenizer(tk, base)
        out.append(Path(encode.path))  # type: ignore[attr-defined]
    return out


def _field_of(spec: ManifestSpec, base: Path | None, source: str, length_field: str | None,
              tokens_field: str | None, text_field: str | None,
              tokenizer: str | Callable[[str], Any] | None) -> tuple[str, str, Callable[[str], Any] | None]:
    """What each record holds (``length``, ``tokens`` or ``text``), the field read, and the tokenizer
    of text (keyword arguments override the spec's fields)."""
    lf = length_field if length_field is not None else spec.length_field
    tf = tokens_field if tokens_field is not None else spec.tokens_field
    xf = text_field if text_field is not None else spec.text_field
    tk = tokenizer if tokenizer is not None else spec.tokenizer
    if tf:
        return "tokens", tf, None
    if not xf:
        return "length", (lf or "length"), None
    if not tk:
        raise InputError(f"text_field needs a tokenizer ({TOKENIZER_HINT})", source=source if base else None)
    try:
        return "text", xf, resolve_tokenizer(tk, base)
    except InputError as e:  # name the manifest document that named the tokenizer
        if tokenizer is None and base is not None and e.source is None:
            raise InputError(e.problem, source=source) from None
        raise


def _read_shard(path: Path, fmt: str, mode: str, field: str, tok: Callable[[str], Any] | None,
                sink: Sink) -> None:
    if fmt == "jsonl":
        JsonlReader(path, mode, field, tok, sink).read()
    elif fmt == "parquet":
        read_parquet(path, mode, field, tok, sink)
    elif mode != "length":
        raise InputError(f"{fmt} manifests hold lengths only; "
                         f"{'tokens_field' if mode == 'tokens' else 'text_field'} needs JSON lines or Parquet",
                         source=path)
    elif fmt == "npy":
        read_npy(path, sink)
    else:
        read_txt(path, sink)


def load_manifest(
    ref: str | os.PathLike | ManifestSpec,
    *,
    length_field: str | None = None,
    tokens_field: str | None = None,
    text_field: str | None = None,
    tokenizer: str | Callable[[str], Any] | None = None,
) -> Dataset:
    """Read a manifest (file, directory, glob, ``*.manifest.json`` or a :class:`ManifestSpec`).

    Keyword arguments override the spec's fields. The field used is ``tokens_field`` if set,
    else ``text_field`` (needs ``tokenizer``), else ``length_field`` (default ``length``).
    Paths of a spec document are relative to the document; those of an in-memory spec to the
    current directory.
    """
    spec, base, source = _spec_of(ref)
    mode, field, tok = _field_of(spec, base, source, length_field, tokens_field, text_field, tokenizer)
    forced = None if spec.format == "auto" else spec.format
    if spec.offsets is not None:
        return _load_token_files(spec, base, source)
    shards: list[tuple[Path, str]] = []
    for pattern in spec.paths:
        shards.extend(_expand(pattern, base, forced))
    # token ids are kept for token-id manifests and for tokenizers that return ids
    sink = Sink(with_tokens=mode in ("tokens", "text"))
    for path, fmt in shards:
        _read_shard(path, fmt, mode, field, tok, sink)
    lengths = sink.lengths()
    if lengths.size == 0:
        raise InputError("manifest has no samples", source=source)
    token_ids = offsets = None
    if mode == "tokens" or (mode == "text" and sink.ids_seen):
        token_ids = np.frombuffer(sink.tokens, dtype=np.int64) if len(sink.tokens) else np.zeros(0, np.int64)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if token_ids.size != int(offsets[-1]):  # cannot happen: each length is its id count
            raise AssertionError("token ids and lengths disagree")
    formats = {fmt for _, fmt in shards}
    fmt_name = formats.pop() if len(formats) == 1 else "mixed"
    return Dataset(lengths, source=source, format=fmt_name, shards=[str(p) for p, _ in shards],
                   token_ids=token_ids, token_offsets=offsets)
