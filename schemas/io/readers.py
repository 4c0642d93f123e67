"""Readers of one manifest shard each (text lengths, ``.npy`` lengths, Parquet columns, token
files), and what they share: whole-line chunks, the length checks, the collected results.

Every problem raises :class:`~zeppelin.schemas.common.InputError` naming the file and, where
there is one, the line or row.
"""

from __future__ import annotations

import gzip
from array import array
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..common import InputError
from .safefiles import check_input_file

__all__ = ["CHUNK_BYTES", "MAX_LENGTH", "Sink", "apply_tokenizer", "check_positive", "line_chunks",
           "offsets_file", "read_npy", "read_parquet", "read_txt", "token_file"]

CHUNK_BYTES = 2 << 20  # bytes of whole lines scanned at once (small: cache-friendly, bounded)
MAX_LENGTH = 1 << 40  # anything larger is certainly a data error


class Sink:
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


def line_chunks(path: Path) -> Iterable[bytes]:
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


def check_positive(vals: np.ndarray, first_sample: int, path: Path, lines: Any = None) -> None:
    """Raise for the first length <= 0 (or absurdly large). ``lines``: file line numbers of
    ``vals`` (an array, or a callable building it, used only for the message)."""
    bad = np.flatnonzero(vals <= 0)
    if bad.size or (vals > MAX_LENGTH).any():
        lines = lines() if callable(lines) else lines
    if bad.size:
        i = int(bad[0])
        where = f" (line {int(lines[i])})" if lines is not None else ""
        raise InputError(f"non-positive length {int(vals[i])} at sample {first_sample + i}{where}", source=path)
    big = np.flatnonzero(vals > MAX_LENGTH)
    if big.size:
        i = int(big[0])
        where = f" (line {int(lines[i])})" if lines is not None else ""
        raise InputError(f"length {int(vals[i])} at sample {first_sample + i}{where} is implausibly large",
                         source=path)


def apply_tokenizer(tok: Callable[[str], Any], text: str, sink: Sink, where: str, path: Path) -> int:
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


def read_txt(path: Path, sink: Sink) -> None:
    line0 = 0
    for chunk in line_chunks(path):
        vals = _digits_only_lines(chunk)
        if vals is None and b"#" not in chunk:
            words = chunk.split()
            if len(words) == _nonblank_lines(chunk):  # exactly one word per non-blank line
                try:
                    vals = np.array(words).astype(np.int64) if words else np.zeros(0, np.int64)
                except (ValueError, OverflowError):
                    vals = None
        if vals is not None:
            check_positive(vals, sink.count, path, lambda c=chunk, l0=line0: _txt_lines(c, l0))
        else:  # comments or a bad line: go line by line (and name the line)
            out, lines_no = [], []
            for i, raw in enumerate(chunk.split(b"\n")):
                s = raw.strip()
                if not s or s.startswith(b"#"):
                    continue
                try:
                    v = int(s)
                    if v > MAX_LENGTH:  # before numpy sees it (an int beyond int64 would overflow there)
                        raise InputError(f"length {v} at sample {sink.count + len(out)} (line {line0 + i + 1}) is "
                                         f"implausibly large (more than {MAX_LENGTH:,})", source=path)
                    out.append(v)
                except ValueError:
                    txt = s[:30].decode("utf-8", "replace")
                    raise InputError(f"expected one integer length per line, got {txt!r} at line {line0 + i + 1}",
                                     source=path) from None
                lines_no.append(line0 + i + 1)
            vals = np.asarray(out, dtype=np.int64) if out else np.zeros(0, np.int64)
            check_positive(vals, sink.count, path, np.asarray(lines_no, dtype=np.int64))
        sink.add_lengths(vals)
        line0 += chunk.count(b"\n")


def _txt_lines(chunk: bytes, line0: int) -> np.ndarray:
    """File line numbers of the non-blank lines of a chunk (only built for error messages)."""
    out = [line0 + i + 1 for i, raw in enumerate(chunk.split(b"\n")) if raw.strip()]
    return np.asarray(out, dtype=np.int64)


def read_npy(path: Path, sink: Sink) -> None:
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
        if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and (arr[s:s + step] > MAX_LENGTH).any():
            raise InputError("length too large in uint64 array", source=path)
        check_positive(part, sink.count, path)
        sink.add_lengths(part)
    del arr


def read_parquet(path: Path, mode: str, field: str, tok: Callable[[str], Any] | None, sink: Sink) -> None:
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
    for batch in _parquet_batches(pf, field, path, pa.ArrowException):
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
            out = [apply_tokenizer(tok, t, sink, f"row {row0 + i}", path)  # type: ignore[arg-type]
                   for i, t in enumerate(col.to_pylist())]
            vals = np.asarray(out, dtype=np.int64)
        check_positive(vals, sink.count, path)
        sink.add_lengths(vals)
        row0 += len(col)


def _parquet_batches(pf, field: str, path: Path, arrow_error: type) -> Iterator[Any]:
    """The column's record batches; a page that cannot be decoded (damaged, truncated) is one line."""
    batches = pf.iter_batches(columns=[field], batch_size=1 << 20)
    row0 = 0
    while True:
        try:
            batch = next(batches, None)
        except (arrow_error, OSError, ValueError) as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise InputError(f"damaged Parquet data after row {row0:,} ({e.__class__.__name__}: {first})",
                             source=path) from None
        if batch is None:
            return
        row0 += batch.num_rows
        yield batch


# =============================================================================================
# Token files (with an offsets index each)
# =============================================================================================


def token_file(path: Path, dtype: str | None) -> np.ndarray:
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


def offsets_file(path: Path, n_tokens: int) -> np.ndarray:
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
