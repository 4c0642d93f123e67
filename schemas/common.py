"""Shared plumbing of the contracts: strict base model, input errors, hashing, atomic writes.

Every document zeppelin reads or writes is a pydantic v2 model derived from :class:`Doc`:
unknown fields are rejected, values are validated strictly, and each document carries a
``schema_version`` so that readers can refuse documents they do not understand.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "Doc",
    "Strict",
    "InputError",
    "canonical_json",
    "content_hash",
    "atomic_write",
    "atomic_write_text",
    "format_validation_error",
    "load_doc",
]


class Strict(BaseModel):
    """Base for nested records: no unknown fields, no silent coercion of wrong types."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=False, validate_assignment=False)


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


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Write to a temporary file next to ``path`` and rename it into place on success.

    On any exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent or "."))
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp creates 0600; give the file the permissions a plain open() would have
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_write(path) as fh:
        fh.write(text)


def load_doc(cls: type[T], path: str | os.PathLike) -> T:
    """Read and validate a JSON document, raising :class:`InputError` with a one-line message."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError("file not found", source=path) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read file ({e.__class__.__name__})", source=path) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}", source=path) from None
    return validate_doc(cls, data, source=path)


def validate_doc(cls: type[T], data: Any, *, source: str | os.PathLike | None = None) -> T:
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
