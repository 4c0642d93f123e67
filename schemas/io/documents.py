"""JSON documents from untrusted files: one parser (nesting bounded, numbers finite, every problem
one line) and one reader of spec documents (a regular file of bounded size, validated strictly)."""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from ..common import InputError, validate_doc
from .safefiles import check_input_file, read_input_bytes

__all__ = ["MAX_DOC_BYTES", "MAX_JSON_DEPTH", "json_depth_exceeds", "load_doc", "parse_json"]

T = TypeVar("T", bound=BaseModel)

MAX_JSON_DEPTH = 64
"""Deepest JSON nesting any zeppelin document may have (plans need about 10 levels)."""

_STRING_OR_BRACKET = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
#: every digit as ``0``, ``e``/``E`` as ``e``, ``+`` kept, any other byte a space (see :func:`_may_overflow`)
_NUMBER_SHAPE = bytes(48 if c in b"0123456789" else 101 if c in b"eE" else 43 if c == 43 else 32
                      for c in range(256))


def _may_overflow(raw: bytes) -> bool:
    """Whether a number of the JSON text may round to infinity: only one with a run of 32 digits or an
    exponent of three digits can (without, every number is below 1e131). Linear, two C passes."""
    shape = raw.translate(_NUMBER_SHAPE)
    return b"0" * 32 in shape or b"e000" in shape or b"e+000" in shape


@functools.lru_cache(maxsize=1)
def _bracket_steps():
    """The depth change of every byte: +1 for an opening bracket, -1 for a closing one."""
    import numpy as np

    t = np.zeros(256, dtype=np.int8)
    t[list(b"[{")] = 1
    t[list(b"]}")] = -1
    return t


def json_depth_exceeds(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text nests arrays/objects deeper than ``limit`` (checked before parsing, so a
    hostile file cannot exhaust the parser's recursion)."""
    import numpy as np

    brackets = data.translate(None, _NOT_BRACKETS)  # the brackets alone, in order (one pass in C)
    if len(brackets) <= limit:
        return False
    # innermost pairs stripped: one strip lowers the deepest nesting by one at most, so brackets gone
    # within ``limit`` strips nest no deeper (a plan record: about ten strips, no array work)
    rest = brackets
    for _ in range(limit // 2):
        shorter = rest.replace(b"[]", b"").replace(b"{}", b"")
        if not shorter:
            return False
        if len(shorter) == len(rest):
            break
        rest = shorter
    steps = _bracket_steps()[np.frombuffer(brackets, dtype=np.uint8)]
    if int(np.cumsum(steps, dtype=np.int32).max()) <= limit:
        return False  # brackets inside strings can only raise this bound, never lower it below the truth
    depth = 0
    for m in _STRING_OR_BRACKET.finditer(data):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False


def parse_json(data: bytes | str, source: str | os.PathLike | None = None, what: str = "") -> Any:
    """``json.loads`` for untrusted input: nesting depth bounded, non-finite numbers and malformed
    text reported as one-line :class:`InputError`."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    prefix = f"{what}: " if what else ""
    if json_depth_exceeds(raw):
        raise InputError(f"{prefix}JSON nested deeper than {MAX_JSON_DEPTH} levels", source=source)
    try:
        # json.loads of bytes, with decoders made once (json.loads makes one a call when given hooks);
        # floats need no finite check when none can round to infinity (the check costs as much as the parse)
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        return (_FINITE_DECODER if _may_overflow(raw) else _DECODER).decode(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{prefix}malformed JSON at line {e.lineno} column {e.colno}: {e.msg}", source=source) from None
    except UnicodeDecodeError:
        raise InputError(f"{prefix}not UTF-8 text", source=source) from None
    except _NonFinite as e:
        raise InputError(f"{prefix}{e.args[0]} is not a finite number (JSON numbers must be finite)",
                         source=source) from None
    except RecursionError:
        raise InputError(f"{prefix}JSON nested too deeply", source=source) from None


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str):
    raise _NonFinite(name)


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _NonFinite(text)
    return v


#: NaN and Infinity refused (what :func:`parse_json` decodes with); with every float checked finite
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
_FINITE_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)

MAX_DOC_BYTES = 64 << 20
"""Largest spec document (cluster, model, profile, manifest spec) read: real ones are a few KB."""


def load_doc(cls: type[T], path: str | os.PathLike) -> T:
    """Read and validate a JSON document, raising :class:`InputError` with a one-line message."""
    path = Path(path)
    size = check_input_file(path, "input").stat().st_size
    if size > MAX_DOC_BYTES:
        raise InputError(f"{cls.__name__} document of {size:,} bytes is larger than the {MAX_DOC_BYTES >> 20} MiB "
                         f"zeppelin reads", source=path)
    return validate_doc(cls, parse_json(read_input_bytes(path, "input"), source=path), source=path)

