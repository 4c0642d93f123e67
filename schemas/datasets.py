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

**Header records.** A JSON-lines shard may start with a header: its first non-empty line is a
JSON object that lacks the length (tokens / text) field and whose keys all start with ``_``
(e.g. ``{"_comment": "...", "_generator": "..."}``). It is skipped. Any other record that lacks
the field is an error.

**Fast path.** For the common ``{"length": N, ...}`` case the reader scans each chunk of lines
with numpy instead of calling ``json.loads`` per line: a line is accepted when it is framed by
``{`` ... ``}``, holds the key exactly once, at the top level (no ``{`` or ``[`` between the
opening brace and the key) and not escaped, followed by a plain positive decimal integer. Every
other line (nested keys, floats, strings, duplicates, braces in text before the key, header
lines, malformed lines) goes through ``json.loads`` with full validation. The fast path checks
the framing of each record but does not validate the JSON syntax of fields it does not read.
Files are read in chunks of whole lines, so memory stays bounded by the chunk size plus the
8 bytes per sample of the result.

All problems raise :class:`~zeppelin.schemas.common.InputError` naming the file, with one-line
messages such as ``field 'len' not found at line 1 (fields: length, text)`` or
``non-positive length -3 at sample 7 (line 8)``.
"""

from __future__ import annotations

import glob as _glob
import gzip
import hashlib
import json
import os
from array import array
from collections.abc import Callable, Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from .common import InputError, check_input_file, load_doc
from .manifest import ManifestSpec

__all__ = [
    "KNOWN_EXTENSIONS",
    "PERCENTILES",
    "Dataset",
    "default_manifest_path",
    "length_histogram",
    "length_stats",
    "load_manifest",
    "resolve_tokenizer",
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

CHUNK_BYTES = 2 << 20  # bytes of whole lines scanned at once (small: cache-friendly, bounded)
_MAX_LENGTH = 1 << 40  # anything larger is certainly a data error


def default_manifest_path() -> Path:
    """The sample manifest shipped with the package (long-tailed, see its header line)."""
    return Path(__file__).resolve().parent / "data" / "sample_manifest.jsonl"


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
        from .plan import ManifestRef

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
# Tokenizers
# =============================================================================================


def _whitespace(text: str) -> int:
    return len(text.split())


def _bytes(text: str) -> int:
    return len(text.encode("utf-8"))


BUILTIN_TOKENIZERS = {"whitespace": _whitespace, "bytes": _bytes}
TOKENIZER_HINT = "'whitespace', 'bytes' or a tokenizer.json path"


def _looks_like_path(spec: str) -> bool:
    return spec.lower().endswith(".json") or "/" in spec or os.sep in spec


def hf_tokenizer(path: str | os.PathLike, base: Path | None = None) -> Callable[[str], list[int]]:
    """A Hugging Face ``tokenizer.json`` (a file, or a directory holding one) -> callable(text) ->
    token ids, through the ``tokenizers`` library. The file is JSON read from disk (no code, no
    network); special tokens are added as the tokenizer's post-processor defines them."""
    p = Path(path).expanduser()
    if base is not None and not p.is_absolute():
        p = base / p
    if p.is_dir():
        p = p / "tokenizer.json"
    if not os.path.lexists(p):
        raise InputError("tokenizer file not found (name a tokenizer.json or a directory holding one)", source=p)
    check_input_file(p, "tokenizer")  # a regular file, and an input no output may replace
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - a dependency
        raise InputError("reading a tokenizer.json needs the tokenizers package", source=p) from None
    try:
        tk = Tokenizer.from_file(str(p))
    except Exception as e:  # the library raises its own exception types for malformed files
        msg = str(e).strip().splitlines()
        raise InputError(f"cannot read tokenizer.json ({e.__class__.__name__}: {msg[0] if msg else ''})",
                         source=p) from None

    def encode(text: str) -> list[int]:
        return tk.encode(text).ids

    encode.tokenizer = tk  # type: ignore[attr-defined]
    encode.path = str(p)  # type: ignore[attr-defined]
    return encode


def resolve_tokenizer(spec: str | Callable[[str], Any], base: Path | None = None) -> Callable[[str], Any]:
    """A tokenizer named in a manifest or on the command line -> callable(text).

    Data never names code: a string is a built-in tokenizer (``whitespace``, ``bytes``: counts
    only) or the path of a Hugging Face ``tokenizer.json`` (or of a directory holding one; relative
    to ``base``, the manifest document's directory), read with the ``tokenizers`` library (token
    ids). A Python callable can only be passed in by a caller that chose to run it (the command
    line's ``--python-tokenizer``, or library code)."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and spec in BUILTIN_TOKENIZERS:
        return BUILTIN_TOKENIZERS[spec]
    if isinstance(spec, str) and _looks_like_path(spec):
        return hf_tokenizer(spec, base)
    if isinstance(spec, str) and ":" in spec:
        raise InputError(f"tokenizer {spec!r} names Python code, which a manifest or case file may not do "
                         f"(built-in tokenizers: {TOKENIZER_HINT}; `zeppelin data stats --python-tokenizer "
                         f"MODULE:CALLABLE` runs code you name on the command line)")
    raise InputError(f"unknown tokenizer {spec!r} (use {TOKENIZER_HINT})")


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
# Readers
# =============================================================================================


class _Sink:
    """Collects per-shard results; concatenated once at the end."""

    def __init__(self, with_tokens: bool):
        self.parts: list[np.ndarray] = []
        self.tokens: array | None = array("q") if with_tokens else None
        self.count = 0
        self.ids_seen = False  # text mode: the tokenizer returned token ids
        self.counts_seen = False  # text mode: the tokenizer returned counts

    def add_lengths(self, a: np.ndarray) -> None:
        if a.size:
            self.parts.append(np.asarray(a, dtype=np.int64))
            self.count += int(a.size)

    def lengths(self) -> np.ndarray:
        if not self.parts:
            return np.zeros(0, dtype=np.int64)
        return self.parts[0] if len(self.parts) == 1 else np.concatenate(self.parts)


def _open_bytes(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _line_chunks(path: Path) -> Iterable[bytes]:
    """Chunks of whole lines (each ends at a newline, except possibly the last)."""
    try:
        fh = _open_bytes(path)
    except OSError as e:
        raise InputError(f"cannot read file ({e.strerror or e.__class__.__name__})", source=path) from None
    with fh:
        rest = b""
        while True:
            try:
                block = fh.read(CHUNK_BYTES)
            except (OSError, EOFError) as e:  # corrupt gzip etc.
                raise InputError(f"cannot read file ({e.__class__.__name__}: {e})", source=path) from None
            if not block:
                if rest:
                    yield rest
                return
            block = rest + block
            cut = block.rfind(b"\n")
            if cut < 0:
                rest = block
                continue
            rest = block[cut + 1:]
            yield block[: cut + 1]


def _check_positive(vals: np.ndarray, first_sample: int, path: Path, lines: Any = None) -> None:
    """Raise for the first length <= 0 (or absurdly large). ``lines``: file line numbers of
    ``vals`` (an array, or a callable building it, used only for the message)."""
    bad = np.flatnonzero(vals <= 0)
    if bad.size or (vals > _MAX_LENGTH).any():
        lines = lines() if callable(lines) else lines
    if bad.size:
        i = int(bad[0])
        where = f" (line {int(lines[i])})" if lines is not None else ""
        raise InputError(f"non-positive length {int(vals[i])} at sample {first_sample + i}{where}", source=path)
    big = np.flatnonzero(vals > _MAX_LENGTH)
    if big.size:
        i = int(big[0])
        where = f" (line {int(lines[i])})" if lines is not None else ""
        raise InputError(f"length {int(vals[i])} at sample {first_sample + i}{where} is implausibly large",
                         source=path)


def _fields_hint(rec: dict) -> str:
    keys = list(rec)
    s = ", ".join(str(k) for k in keys[:8])
    return s + (", ..." if len(keys) > 8 else "")


class _JsonlReader:
    def __init__(self, path: Path, mode: str, field: str, tokenizer: Callable[[str], Any] | None,
                 sink: _Sink):
        self.path, self.mode, self.field, self.tok, self.sink = path, mode, field, tokenizer, sink
        self.needle = np.frombuffer(json.dumps(field, ensure_ascii=False).encode("utf-8"), dtype=np.uint8)
        self.seen_record = False  # first non-empty line of the shard consumed

    # ------------------------------------------------------------------ slow path (json.loads)
    def _parse(self, raw: bytes, lineno: int) -> dict | None:
        """Parse one line; None for blank lines and the shard's header record."""
        s = raw.strip()
        if not s:
            return None
        try:
            rec = json.loads(s)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "invalid UTF-8"
            col = f" (column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
            raise InputError(f"malformed JSON at line {lineno}: {msg}{col}", source=self.path) from None
        except RecursionError:
            raise InputError(f"JSON nested too deeply at line {lineno}", source=self.path) from None
        first = not self.seen_record
        self.seen_record = True
        if not isinstance(rec, dict):
            raise InputError(f"expected a JSON object at line {lineno}, got {_json_type(rec)}", source=self.path)
        if self.field not in rec:
            if first and rec and all(isinstance(k, str) and k.startswith("_") for k in rec):
                return None  # header record
            raise InputError(f"field {self.field!r} not found at line {lineno} (fields: {_fields_hint(rec)})",
                             source=self.path)
        return rec

    def _length_of(self, rec: dict, lineno: int, sample: int) -> int:
        v = rec[self.field]
        if self.mode == "length":
            if isinstance(v, bool) or not isinstance(v, int):
                raise InputError(f"field {self.field!r} at line {lineno} must be an integer, got {_json_repr(v)}",
                                 source=self.path)
            if v > _MAX_LENGTH:  # before numpy sees it (an int beyond int64 would overflow there)
                raise InputError(f"length {v} at sample {sample} (line {lineno}) is implausibly large "
                                 f"(more than {_MAX_LENGTH:,})", source=self.path)
            return v
        if self.mode == "tokens":
            if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise InputError(f"field {self.field!r} at line {lineno} must be a list of integer token ids",
                                 source=self.path)
            try:
                self.sink.tokens.extend(v)  # type: ignore[union-attr]
            except OverflowError:
                raise InputError(f"token id out of range at line {lineno}", source=self.path) from None
            return len(v)
        # text
        if not isinstance(v, str):
            raise InputError(f"field {self.field!r} at line {lineno} must be a string, got {_json_type(v)}",
                             source=self.path)
        return _apply_tokenizer(self.tok, v, self.sink, f"line {lineno}", self.path)

    # ------------------------------------------------------------------ fast path
    def _fast_chunk(self, chunk: bytes, line0: int) -> None:
        """Lengths of a chunk of lines; lines the scan cannot vouch for use json.loads."""
        n_bytes = len(chunk)
        buf = np.frombuffer(chunk + b"\n" * 32, dtype=np.uint8)  # padding: no bounds checks below
        arr = buf[:n_bytes]
        nl = np.flatnonzero(arr == 10)
        starts = np.concatenate(([0], nl + 1))
        ends = np.concatenate((nl, [n_bytes]))
        if starts[-1] >= n_bytes:  # chunk ends with a newline: no trailing partial line
            starts, ends = starts[:-1], ends[:-1]
        nlines = starts.size
        if nlines == 0:
            return
        e_trim = ends - ((ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13))  # strip \r
        # candidate key positions
        nd = self.needle
        k = nd.size
        # anchor the search on the needle byte that is rarest in this chunk (sampled)
        freq = np.bincount(arr[: 1 << 16], minlength=256)[nd]
        a = int(np.argmin(freq[1:-1])) + 1 if k > 2 else 0
        cand = np.flatnonzero(arr[a: max(n_bytes - k + 1 + a, a)] == nd[a])
        for j in range(k):
            if j != a:
                cand = cand[buf[cand + j] == nd[j]]
        line_of = np.searchsorted(starts, cand, side="right") - 1
        per_line = np.bincount(line_of, minlength=nlines)
        # parse ``\s*:\s*DIGITS\s*[,}]`` after each candidate
        ok = cand > 0
        ok &= buf[np.maximum(cand - 1, 0)] != 92  # not an escaped quote
        p = cand + k
        p = _skip_ws(buf, p)
        ok &= buf[p] == 58  # ':'
        p = _skip_ws(buf, p + 1)
        first_digit = buf[p]
        val = np.zeros(cand.size, dtype=np.int64)
        ndig = np.zeros(cand.size, dtype=np.int64)
        active = ok.copy()
        for _ in range(15):
            d = buf[p + ndig]
            isd = active & (d >= 48) & (d <= 57)
            active = isd
            if not isd.any():
                break
            val = np.where(isd, val * 10 + (d.astype(np.int64) - 48), val)
            ndig += isd
        ok &= (ndig >= 1) & ~((ndig > 1) & (first_digit == 48)) & ~active  # no leading zero, <=15 digits
        q = _skip_ws(buf, p + ndig)
        ok &= (buf[q] == 44) | (buf[q] == 125)  # ',' or '}'
        # exactly one brace/bracket (the opening one) between the line start and the key
        first_key = cand == starts[line_of] + 1  # '{"length"...': nothing in between
        if not first_key.all():
            br = np.flatnonzero((arr == 123) | (arr == 91))
            n_br = np.searchsorted(br, cand) - np.searchsorted(br, starts[line_of])
            ok &= first_key | (n_br == 1)
        # line-level acceptance
        line_ok = per_line == 1
        good_line = np.zeros(nlines, dtype=bool)
        good_line[line_of[ok]] = True
        line_ok &= good_line
        line_ok &= buf[starts] == 123
        line_ok &= (e_trim > starts) & (buf[np.maximum(e_trim - 1, 0)] == 125)
        # the first record of a shard (maybe a header) always goes through json
        if not self.seen_record:
            nonblank = np.flatnonzero(e_trim > starts)
            if nonblank.size:
                line_ok[nonblank[0]] = False
        lengths = np.zeros(nlines, dtype=np.int64)
        keep = np.zeros(nlines, dtype=bool)
        sel = line_of[ok]
        lengths[sel] = val[ok]
        keep[line_ok] = True
        slow = np.flatnonzero(~line_ok)
        if slow.size:
            for i in slow.tolist():
                raw = chunk[starts[i]:ends[i]]
                rec = self._parse(raw, line0 + i + 1)
                if rec is None:
                    continue
                lengths[i] = self._length_of(rec, line0 + i + 1, self.sink.count)
                keep[i] = True
        if line_ok.any():
            self.seen_record = True
        idx = np.flatnonzero(keep)
        vals = lengths[idx]
        _check_positive(vals, self.sink.count, self.path, idx + line0 + 1)
        self.sink.add_lengths(vals)

    def _slow_chunk(self, chunk: bytes, line0: int) -> None:
        out: list[int] = []
        lines_no: list[int] = []
        for i, raw in enumerate(chunk.split(b"\n")):
            rec = self._parse(raw, line0 + i + 1)
            if rec is None:
                continue
            sample = self.sink.count + len(out)
            n = self._length_of(rec, line0 + i + 1, sample)
            out.append(n)
            lines_no.append(line0 + i + 1)
            if n <= 0:
                break
        vals = np.asarray(out, dtype=np.int64)
        _check_positive(vals, self.sink.count, self.path, np.asarray(lines_no))
        self.sink.add_lengths(vals)

    def read(self) -> None:
        line0 = 0
        for chunk in _line_chunks(self.path):
            if self.mode == "length":
                self._fast_chunk(chunk, line0)
            else:
                self._slow_chunk(chunk, line0)
            line0 += chunk.count(b"\n")


def _skip_ws(buf: np.ndarray, p: np.ndarray) -> np.ndarray:
    for _ in range(8):
        sp = (buf[p] == 32) | (buf[p] == 9)
        if not sp.any():
            break
        p = p + sp
    return p


def _json_type(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _json_repr(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 30 else s[:27] + "..."


def _apply_tokenizer(tok: Callable[[str], Any], text: str, sink: _Sink, where: str, path: Path) -> int:
    try:
        out = tok(text)
    except Exception as e:
        raise InputError(f"tokenizer failed at {where} ({e.__class__.__name__}: {e})", source=path) from None
    if isinstance(out, (int, np.integer)) and not isinstance(out, bool):
        if sink.ids_seen:
            raise InputError(f"tokenizer returned a count at {where} but token ids before", source=path)
        sink.counts_seen = True
        return int(out)
    try:
        ids = np.asarray(out)
    except Exception:
        ids = None
    if ids is None or ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise InputError(f"tokenizer returned {type(out).__name__} at {where}; expected a list of token ids "
                         f"or a count", source=path)
    if sink.counts_seen:
        raise InputError(f"tokenizer returned token ids at {where} but counts before", source=path)
    sink.ids_seen = True
    sink.tokens.extend(ids.astype(np.int64).tolist())  # type: ignore[union-attr]
    return int(ids.size)


def _nonblank_lines(chunk: bytes) -> int:
    """Number of lines of a chunk that hold something besides whitespace (vectorised)."""
    arr = np.frombuffer(chunk, dtype=np.uint8)
    if not arr.size:
        return 0
    starts = np.concatenate(([0], np.flatnonzero(arr[:-1] == 10) + 1))
    nonws = ~((arr == 32) | (arr == 9) | (arr == 13) | (arr == 10) | (arr == 11) | (arr == 12))
    return int(np.count_nonzero(np.logical_or.reduceat(nonws, starts)))


_POW10 = 10 ** np.arange(16, dtype=np.int64)


def _digits_only_lines(chunk: bytes) -> np.ndarray | None:
    """Vectorised parse of a chunk made only of digits and newlines (one number per non-empty
    line); None when the chunk holds anything else (or a number of more than 15 digits)."""
    arr = np.frombuffer(chunk, dtype=np.uint8)
    nl_mask = arr == 10
    digit = (arr >= 48) & (arr <= 57)
    if not (digit | nl_mask).all():
        return None
    nl = np.flatnonzero(nl_mask)
    idx = np.flatnonzero(digit)
    if not idx.size:
        return np.zeros(0, dtype=np.int64)
    line = np.searchsorted(nl, idx)  # index of the newline ending each digit's line
    line_end = np.append(nl, arr.size)[line]
    power = line_end - 1 - idx
    if power.max() >= _POW10.size:
        return None
    val = (arr[idx].astype(np.int64) - 48) * _POW10[power]
    seg = np.flatnonzero(np.diff(line, prepend=-1))
    return np.add.reduceat(val, seg)


def _read_txt(path: Path, sink: _Sink) -> None:
    line0 = 0
    for chunk in _line_chunks(path):
        vals = _digits_only_lines(chunk)
        if vals is None and b"#" not in chunk:
            words = chunk.split()
            if len(words) == _nonblank_lines(chunk):  # exactly one word per non-blank line
                try:
                    vals = np.array(words).astype(np.int64) if words else np.zeros(0, np.int64)
                except (ValueError, OverflowError):
                    vals = None
        if vals is not None:
            _check_positive(vals, sink.count, path, lambda c=chunk, l0=line0: _txt_lines(c, l0))
        else:  # comments or a bad line: go line by line (and name the line)
            out, lines_no = [], []
            for i, raw in enumerate(chunk.split(b"\n")):
                s = raw.strip()
                if not s or s.startswith(b"#"):
                    continue
                try:
                    v = int(s)
                    if v > _MAX_LENGTH:  # before numpy sees it (an int beyond int64 would overflow there)
                        raise InputError(f"length {v} at sample {sink.count + len(out)} (line {line0 + i + 1}) is "
                                         f"implausibly large (more than {_MAX_LENGTH:,})", source=path)
                    out.append(v)
                except ValueError:
                    txt = s[:30].decode("utf-8", "replace")
                    raise InputError(f"expected one integer length per line, got {txt!r} at line {line0 + i + 1}",
                                     source=path) from None
                lines_no.append(line0 + i + 1)
            vals = np.asarray(out, dtype=np.int64) if out else np.zeros(0, np.int64)
            _check_positive(vals, sink.count, path, np.asarray(lines_no, dtype=np.int64))
        sink.add_lengths(vals)
        line0 += chunk.count(b"\n")


def _txt_lines(chunk: bytes, line0: int) -> np.ndarray:
    """File line numbers of the non-blank lines of a chunk (only built for error messages)."""
    out = [line0 + i + 1 for i, raw in enumerate(chunk.split(b"\n")) if raw.strip()]
    return np.asarray(out, dtype=np.int64)


def _read_npy(path: Path, sink: _Sink) -> None:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise InputError(f"cannot read .npy file ({e})", source=path) from None
    except OSError as e:
        raise InputError(f"cannot read .npy file ({e.__class__.__name__}: {e})", source=path) from None
    if not isinstance(arr, np.ndarray):
        raise InputError("expected a .npy array of lengths", source=path)
    if arr.ndim != 1:
        raise InputError(f"expected a 1-D array of lengths, got shape {tuple(arr.shape)}", source=path)
    if arr.dtype.kind not in "iu":
        raise InputError(f"expected an integer array of lengths, got dtype {arr.dtype}", source=path)
    step = 1 << 22
    for s in range(0, arr.shape[0], step):
        part = np.array(arr[s:s + step], dtype=np.int64)
        if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and (arr[s:s + step] > _MAX_LENGTH).any():
            raise InputError("length too large in uint64 array", source=path)
        _check_positive(part, sink.count, path)
        sink.add_lengths(part)
    del arr


def _read_parquet(path: Path, mode: str, field: str, tok: Callable[[str], Any] | None, sink: _Sink) -> None:
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("reading Parquet needs pyarrow (pip install 'zeppelin[parquet]')", source=path) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise InputError(f"cannot read Parquet file ({e.__class__.__name__}: {str(e).splitlines()[0]})",
                         source=path) from None
    names = pf.schema_arrow.names
    if field not in names:
        raise InputError(f"column {field!r} not found (columns: {', '.join(names[:8])}"
                         f"{', ...' if len(names) > 8 else ''})", source=path)
    typ = pf.schema_arrow.field(field).type
    if mode == "length" and not pa.types.is_integer(typ):
        raise InputError(f"column {field!r} has type {typ}, expected integers", source=path)
    if mode == "tokens" and not ((pa.types.is_list(typ) or pa.types.is_large_list(typ))
                                 and pa.types.is_integer(typ.value_type)):
        raise InputError(f"column {field!r} has type {typ}, expected a list of integer token ids", source=path)
    if mode == "text" and not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise InputError(f"column {field!r} has type {typ}, expected strings", source=path)
    row0 = 0
    for batch in pf.iter_batches(columns=[field], batch_size=1 << 20):
        col = batch.column(0)
        if col.null_count:
            i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise InputError(f"null {field!r} at row {row0 + i} (sample {sink.count + i})", source=path)
        if mode == "length":
            vals = col.to_numpy(zero_copy_only=False).astype(np.int64)
        elif mode == "tokens":
            vals = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
            flat = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.int64)
            sink.tokens.extend(flat.tolist())  # type: ignore[union-attr]
        else:
            out = [_apply_tokenizer(tok, t, sink, f"row {row0 + i}", path)  # type: ignore[arg-type]
                   for i, t in enumerate(col.to_pylist())]
            vals = np.asarray(out, dtype=np.int64)
        _check_positive(vals, sink.count, path)
        sink.add_lengths(vals)
        row0 += len(col)


# =============================================================================================
# Entry point
# =============================================================================================


def _token_file(path: Path, dtype: str | None) -> np.ndarray:
    """A token file as a read-only memory map: ``.npy`` (its own dtype) or raw little-endian
    ``.bin`` of ``dtype``."""
    check_input_file(path, "token file")
    if path.name.lower().endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise InputError(f"cannot read .npy token file ({e.__class__.__name__}: {e})", source=path) from None
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise InputError("expected a 1-D integer array of token ids", source=path)
        return arr
    if not path.name.lower().endswith(".bin"):
        raise InputError("token files are .npy or .bin", source=path)
    if dtype is None:
        raise InputError("a .bin token file needs token_dtype in the manifest (uint16, uint32, int32 or int64)",
                         source=path)
    dt = np.dtype(dtype).newbyteorder("<")
    size = path.stat().st_size
    if size % dt.itemsize:
        raise InputError(f"file size {size} is not a multiple of the {dtype} token size ({dt.itemsize} bytes)",
                         source=path)
    if size == 0:
        return np.zeros(0, dtype=dt)
    return np.memmap(path, dtype=dt, mode="r")


def _offsets_file(path: Path, n_tokens: int) -> np.ndarray:
    check_input_file(path, "offsets index")
    try:
        off = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise InputError(f"cannot read offsets index ({e.__class__.__name__}: {e})", source=path) from None
    if not isinstance(off, np.ndarray) or off.ndim != 1 or off.dtype.kind not in "iu" or off.size < 2:
        raise InputError("the offsets index must be a 1-D integer .npy array of num_samples + 1 entries",
                         source=path)
    off = off.astype(np.int64)
    if off[0] != 0:
        raise InputError(f"the offsets index must start at 0 (got {int(off[0])})", source=path)
    lengths = np.diff(off)
    bad = np.flatnonzero(lengths <= 0)
    if bad.size:
        i = int(bad[0])
        raise InputError(f"non-positive length {int(lengths[i])} at sample {i} (offsets {int(off[i])} -> "
                         f"{int(off[i + 1])})", source=path)
    if int(off[-1]) != n_tokens:
        raise InputError(f"the offsets index ends at {int(off[-1])} but the token file holds {n_tokens} ids",
                         source=path)
    return off


def _load_token_files(spec: ManifestSpec, base: Path | None, source: str) -> Dataset:
    """Token files (``.npy`` / ``.bin``) with an offsets index each (``spec.offsets``, paired with
    ``spec.paths`` in order): sample ``i`` of a shard is ``tokens[offsets[i]:offsets[i + 1]]``."""
    def one(p: str) -> Path:
        q = Path(p).expanduser()
        if base is not None and not q.is_absolute():
            q = base / q
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
        t = _token_file(tp, spec.token_dtype)
        off = _offsets_file(op, int(t.shape[0]))
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


def manifest_files(ref: str | os.PathLike) -> list[Path]:
    """Every file a manifest reference names - the ``*.manifest.json`` document, every shard (token
    files and offsets indexes included) and a tokenizer file - each checked to be a regular file and
    noted as an input of the running command, without reading the data."""
    base: Path | None = None
    out: list[Path] = []
    if _is_spec_file(ref):
        spec = load_doc(ManifestSpec, ref)
        base = Path(ref).parent
        out.append(Path(ref))
    else:
        spec = ManifestSpec(paths=[str(ref)])
    forced = None if spec.format == "auto" else spec.format
    if spec.offsets is not None:
        for p in [*spec.paths, *spec.offsets]:
            q = Path(p).expanduser()
            q = base / q if base is not None and not q.is_absolute() else q
            out.append(check_input_file(q, "token file"))
    else:
        for pattern in spec.paths:
            out.extend(p for p, _ in _expand(pattern, base, forced))
    tk = spec.tokenizer
    if isinstance(tk, str) and tk not in BUILTIN_TOKENIZERS and _looks_like_path(tk):
        encode = hf_tokenizer(tk, base)
        out.append(Path(encode.path))  # type: ignore[attr-defined]
    return out


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
    base: Path | None = None
    if isinstance(ref, ManifestSpec):
        spec = ref
        source = spec.name or ",".join(spec.paths)
    elif _is_spec_file(ref):
        spec = load_doc(ManifestSpec, ref)
        base = Path(ref).parent
        source = str(ref)
    else:
        spec = ManifestSpec(paths=[str(ref)])
        source = str(ref)
    lf = length_field if length_field is not None else spec.length_field
    tf = tokens_field if tokens_field is not None else spec.tokens_field
    xf = text_field if text_field is not None else spec.text_field
    tk = tokenizer if tokenizer is not None else spec.tokenizer
    if tf:
        mode, field = "tokens", tf
    elif xf:
        if not tk:
            raise InputError(f"text_field needs a tokenizer ({TOKENIZER_HINT})",
                             source=source if base else None)
        mode, field = "text", xf
    else:
        mode, field = "length", (lf or "length")
    tok = None
    if mode == "text":
        try:
            tok = resolve_tokenizer(tk, base)
        except InputError as e:  # name the manifest document that named the tokenizer
            if tokenizer is None and base is not None and e.source is None:
                raise InputError(e.problem, source=source) from None
            raise
    forced = None if spec.format == "auto" else spec.format

    if spec.offsets is not None:
        return _load_token_files(spec, base, source)
    shards: list[tuple[Path, str]] = []
    for pattern in spec.paths:
        shards.extend(_expand(pattern, base, forced))

    # token ids are kept for token-id manifests and for tokenizers that return ids
    sink = _Sink(with_tokens=mode in ("tokens", "text"))
    formats = []
    for path, fmt in shards:
        formats.append(fmt)
        if fmt == "jsonl":
            _JsonlReader(path, mode, field, tok, sink).read()
        elif fmt == "parquet":
            _read_parquet(path, mode, field, tok, sink)
        elif mode != "length":
            raise InputError(f"{fmt} manifests hold lengths only; "
                             f"{'tokens_field' if mode == 'tokens' else 'text_field'} needs JSON lines or Parquet",
                             source=path)
        elif fmt == "npy":
            _read_npy(path, sink)
        else:
            _read_txt(path, sink)
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
    fmt_name = formats[0] if len(set(formats)) == 1 else "mixed"
    return Dataset(lengths, source=source, format=fmt_name, shards=[str(p) for p, _ in shards],
                   token_ids=token_ids, token_offsets=offsets)
