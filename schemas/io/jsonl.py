"""JSON-lines shards: one object per line with a length, a list of token ids or text.

**Header records.** A shard may start with a header: its first non-empty line is a JSON object
that lacks the length (tokens / text) field and whose keys all start with ``_`` (e.g.
``{"_comment": "...", "_generator": "..."}``). It is skipped. Any other record that lacks the
field is an error.

**Fast path.** For the common ``{"length": N, ...}`` case the reader scans each chunk of lines
with numpy instead of calling ``json.loads`` per line: a line is accepted when it is framed by
``{`` ... ``}``, holds the key exactly once, at the top level (no ``{`` or ``[`` between the
opening brace and the key) and not escaped, followed by a plain positive decimal integer. Every
other line (nested keys, floats, strings, duplicates, braces in text before the key, header
lines, malformed lines) goes through ``json.loads`` with full validation. The fast path checks
the framing of each record but does not validate the JSON syntax of fields it does not read.
Files are read in chunks of whole lines, so memory stays bounded by the chunk size plus the
8 bytes per sample of the result.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..common import InputError
from .readers import MAX_LENGTH, Sink, apply_tokenizer, check_positive, line_chunks

__all__ = ["JsonlReader"]


def _fields_hint(rec: dict) -> str:
    keys = list(rec)
    s = ", ".join(str(k) for k in keys[:8])
    return s + (", ..." if len(keys) > 8 else "")


class JsonlReader:
    def __init__(self, path: Path, mode: str, field: str, tokenizer: Callable[[str], Any] | None,
                 sink: Sink):
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
            if v > MAX_LENGTH:  # before numpy sees it (an int beyond int64 would overflow there)
                raise InputError(f"length {v} at sample {sample} (line {lineno}) is implausibly large "
                                 f"(more than {MAX_LENGTH:,})", source=self.path)
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
        return apply_tokenizer(self.tok, v, self.sink, f"line {lineno}", self.path)

    # ------------------------------------------------------------------ fast path
    def _fast_chunk(self, chunk: bytes, line0: int) -> None:
        """Lengths of a chunk of lines; lines the scan cannot vouch for use json.loads."""
        n_bytes = len(chunk)
        buf = np.frombuffer(chunk + b"\n" * 32, dtype=np.uint8)  # padding: no bounds checks below
        starts, ends, e_trim = _line_bounds(buf, n_bytes)
        nlines = starts.size
        if nlines == 0:
            return
        line_of, ok, val = _key_values(buf, n_bytes, self.needle, starts)
        line_ok = _accepted_lines(buf, starts, e_trim, line_of, ok)
        # the first record of a shard (maybe a header) always goes through json
        if not self.seen_record:
            nonblank = np.flatnonzero(e_trim > starts)
            if nonblank.size:
                line_ok[nonblank[0]] = False
        lengths = np.zeros(nlines, dtype=np.int64)
        keep = np.zeros(nlines, dtype=bool)
        lengths[line_of[ok]] = val[ok]
        keep[line_ok] = True
        for i in np.flatnonzero(~line_ok).tolist():
            rec = self._parse(chunk[starts[i]:ends[i]], line0 + i + 1)
            if rec is None:
                continue
            lengths[i] = self._length_of(rec, line0 + i + 1, self.sink.count)
            keep[i] = True
        if line_ok.any():
            self.seen_record = True
        idx = np.flatnonzero(keep)
        vals = lengths[idx]
        check_positive(vals, self.sink.count, self.path, idx + line0 + 1)
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
        check_positive(vals, self.sink.count, self.path, np.asarray(lines_no))
        self.sink.add_lengths(vals)

    def read(self) -> None:
        line0 = 0
        for chunk in line_chunks(self.path):
            if self.mode == "length":
                self._fast_chunk(chunk, line0)
            else:
                self._slow_chunk(chunk, line0)
            line0 += chunk.count(b"\n")


# ------------------------------------------------------------------ the fast path's vectorised scan
def _line_bounds(buf: np.ndarray, n_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start, end (at the newline) and end without a trailing ``\\r`` of every line of the chunk
    ``buf[:n_bytes]`` (a chunk that ends with a newline has no trailing partial line)."""
    nl = np.flatnonzero(buf[:n_bytes] == 10)
    starts = np.concatenate(([0], nl + 1))
    ends = np.concatenate((nl, [n_bytes]))
    if starts[-1] >= n_bytes:
        starts, ends = starts[:-1], ends[:-1]
    e_trim = ends - ((ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13))
    return starts, ends, e_trim


def _key_candidates(arr: np.ndarray, buf: np.ndarray, nd: np.ndarray) -> np.ndarray:
    """Every position of the quoted key ``nd`` in the chunk ``arr``; the search is anchored on the
    key's byte that is rarest in the chunk (sampled)."""
    k = nd.size
    freq = np.bincount(arr[: 1 << 16], minlength=256)[nd]
    a = int(np.argmin(freq[1:-1])) + 1 if k > 2 else 0
    cand = np.flatnonzero(arr[a: max(arr.size - k + 1 + a, a)] == nd[a])
    for j in range(k):
        if j != a:
            cand = cand[buf[cand + j] == nd[j]]
    return cand


def _digits(buf: np.ndarray, p: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decimal integer at each position ``p`` (where ``ok``): its value, its digit count, and
    whether it is a plain one (at least one digit, no leading zero, at most 15 digits)."""
    val = np.zeros(p.size, dtype=np.int64)
    ndig = np.zeros(p.size, dtype=np.int64)
    active = ok.copy()
    for _ in range(15):
        d = buf[p + ndig]
        isd = active & (d >= 48) & (d <= 57)
        active = isd
        if not isd.any():
            break
        val = np.where(isd, val * 10 + (d.astype(np.int64) - 48), val)
        ndig += isd
    plain = (ndig >= 1) & ~((ndig > 1) & (buf[p] == 48)) & ~active
    return val, ndig, plain


def _key_values(buf: np.ndarray, n_bytes: int, nd: np.ndarray,
                starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every candidate key: its line, whether ``\\s*:\\s*DIGITS\\s*[,}]`` follows it at the top
    level of its record (unescaped, no brace or bracket between the record's opening brace and the
    key), and the value."""
    arr = buf[:n_bytes]
    cand = _key_candidates(arr, buf, nd)
    line_of = np.searchsorted(starts, cand, side="right") - 1
    ok = cand > 0
    ok &= buf[np.maximum(cand - 1, 0)] != 92  # not an escaped quote
    p = _skip_ws(buf, cand + nd.size)
    ok &= buf[p] == 58  # ':'
    p = _skip_ws(buf, p + 1)
    val, ndig, plain = _digits(buf, p, ok)
    ok &= plain
    q = _skip_ws(buf, p + ndig)
    ok &= (buf[q] == 44) | (buf[q] == 125)  # ',' or '}'
    # exactly one brace/bracket (the opening one) between the line start and the key
    first_key = cand == starts[line_of] + 1  # '{"length"...': nothing in between
    if not first_key.all():
        br = np.flatnonzero((arr == 123) | (arr == 91))
        n_br = np.searchsorted(br, cand) - np.searchsorted(br, starts[line_of])
        ok &= first_key | (n_br == 1)
    return line_of, ok, val


def _accepted_lines(buf: np.ndarray, starts: np.ndarray, e_trim: np.ndarray, line_of: np.ndarray,
                    ok: np.ndarray) -> np.ndarray:
    """Lines the scan vouches for: the key exactly once, accepted, in a line framed by ``{`` ... ``}``."""
    nlines = starts.size
    line_ok = np.bincount(line_of, minlength=nlines) == 1
    good_line = np.zeros(nlines, dtype=bool)
    good_line[line_of[ok]] = True
    line_ok &= good_line
    line_ok &= buf[starts] == 123
    line_ok &= (e_trim > starts) & (buf[np.maximum(e_trim - 1, 0)] == 125)
    return line_ok


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
