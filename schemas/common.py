"""The contracts' bases: the strict pydantic models, the input error, bounds and hashing.

Every document zeppelin reads or writes is a pydantic v2 model derived from :class:`Doc`:
unknown fields are rejected, values are validated strictly, and each document carries a
``schema_version`` so that readers can refuse documents they do not understand. Reading and
writing files is the I/O floor's (:mod:`zeppelin.schemas.io`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "fit_width",
    "Doc",
    "Strict",
    "InputError",
    "canonical_json",
    "check_float",
    "check_int",
    "content_hash",
    "format_validation_error",
    "validate_doc",
]


class Strict(BaseModel):
    """Base for nested records: no unknown fields, no silent coercion of wrong types."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=False, validate_assignment=False,
                              allow_inf_nan=False)


class Doc(Strict):
    """Base for top-level documents (they carry ``schema_version``)."""

    schema_version: str


class InputError(Exception):
    """A problem with user input. The CLI prints ``str(err)`` on one line and exits with code 2."""

    def __init__(self, message: str, *, source: str | os.PathLike | None = None):
        self.source = str(source) if source is not None else None
        self.problem = message
        super().__init__(f"{self.source}: {message}" if self.source else message)


T = TypeVar("T", bound=BaseModel)

# Upper bounds of options and spec fields: far above any real job, low enough that nothing loops for
# hours or allocates gigabytes because of a typo. Each message states the bound.
MAX_STEPS = 1_000_000
MAX_SEED = 2**63 - 1
MAX_WORKERS = 1024
MAX_TOKENS = 2**40
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def check_int(flag: str, value: int | None, lo: int, hi: int | None = None) -> None:
    """Refuse an integer option outside ``[lo, hi]`` with one line naming the bound."""
    if value is None:
        return
    if value < lo:
        raise InputError(f"{flag} must be at least {lo:,} (got {value:,})")
    if hi is not None and value > hi:
        raise InputError(f"{flag} must be at most {hi:,} (got {value:,})")


def fit_width(text: str, indent: str = "  ", width: int | None = None) -> str:
    """``text`` wrapped at the terminal's width (``COLUMNS`` when set; 80 on a pipe), the lines after
    the first indented by ``indent``; words are not broken."""
    import shutil
    import textwrap

    width = width or shutil.get_terminal_size((80, 24)).columns
    return textwrap.fill(text, max(width, 40), subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


def check_float(flag: str, value: float | None, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """Refuse a float option that is not finite or is outside ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if value is None:
        return
    if not math.isfinite(value):
        raise InputError(f"{flag} must be a finite number (got {value})")
    if lo_open and value <= lo:
        raise InputError(f"{flag} must be greater than {lo:g} (got {value:g})")
    if value < lo:
        raise InputError(f"{flag} must be at least {lo:g} (got {value:g})")
    if value > hi:
        raise InputError(f"{flag} must be at most {hi:g} (got {value:g})")


def format_validation_error(err: ValidationError, limit: int = 3) -> str:
    """One line summarising a pydantic validation error: ``field.path: message; ...``."""
    parts = []
    for e in err.errors()[:limit]:
        loc = ".".join(str(x) for x in e.get("loc", ())) or "(document)"
        msg = e.get("msg", "invalid")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        parts.append(f"{loc}: {msg}")
    more = len(err.errors()) - limit
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts)


def canonical_json(obj: Any) -> str:
    """Stable JSON text (sorted keys, no whitespace) used for hashing."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def content_hash(obj: Any) -> str:
    """``sha256:<16 hex>`` of the canonical JSON of a document (or raw bytes)."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
    else:
        data = canonical_json(obj).encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()[:16]


def validate_doc(cls: type[T], data: Any, *, source: str | os.PathLike | None = None) -> T:
    """Validate parsed JSON as document ``cls``: its ``schema_version`` must be the one this zeppelin
    reads; any problem is one :class:`InputError` line."""
    if not isinstance(data, dict):
        raise InputError(f"expected a JSON object for {cls.__name__}, got {type(data).__name__}", source=source)
    expected = cls.model_fields["schema_version"].default if "schema_version" in cls.model_fields else None
    got = data.get("schema_version")
    if expected and got is not None and got != expected:
        raise InputError(
            f"schema_version {got!r} is not supported (this zeppelin reads {expected!r})", source=source
        )
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise InputError(f"invalid {cls.__name__}: {format_validation_error(e)}", source=source) from None
