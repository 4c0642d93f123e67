"""Shared plumbing of the contracts: strict base model, input errors, hashing, atomic writes.

Every document zeppelin reads or writes is a pydantic v2 model derived from :class:`Doc`:
unknown fields are rejected, values are validated strictly, and each document carries a
``schema_version`` so that readers can refuse documents they do not understand.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import signal
import stat
import threading
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


# ---------------------------------------------------------------------------------------------
# Files: every input is a regular file, every output is written atomically and never clobbers an input
# ---------------------------------------------------------------------------------------------

MAX_JSON_DEPTH = 64
"""Deepest JSON nesting any zeppelin document may have (plans need about 10 levels)."""

_INPUTS: list[str] = []  # paths read as input by the running command (see note_input)
_TRACKING = [False]


@contextmanager
def tracking_inputs() -> Iterator[None]:
    """While a command runs: remember every file read as input, so that no output replaces one."""
    _INPUTS.clear()
    _TRACKING[0] = True
    try:
        yield
    finally:
        _TRACKING[0] = False
        _INPUTS.clear()


def note_input(path: str | os.PathLike) -> None:
    """Remember ``path`` as an input of the running command: :func:`atomic_write` refuses to write over it."""
    if not _TRACKING[0]:
        return
    p = os.fspath(path)  # kept as named (messages show it so); compared by device and inode
    if all(os.path.abspath(p) != os.path.abspath(q) for q in _INPUTS):
        _INPUTS.append(p)


def _reason(e: OSError) -> str:
    return e.strerror or e.__class__.__name__


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_input_file(path: str | os.PathLike, what: str = "input") -> Path:
    """Refuse an input that is missing or not a regular file (devices, FIFOs, directories; symlinks
    are followed and the target decides) before anything opens it; note it as an input."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise InputError("file not found", source=p) from None
    except OSError as e:
        raise InputError(f"cannot read {what}: {_reason(e)}", source=p) from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} is {_kind(st.st_mode)}, not a regular file", source=p)
    note_input(p)
    return p


def read_input_bytes(path: str | os.PathLike, what: str = "input") -> bytes:
    p = check_input_file(path, what)
    try:
        return p.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {what}: {_reason(e)}", source=p) from None


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when both paths exist and name the same file (symlinks followed)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output(path: str | os.PathLike, inputs: Any = (), what: str = "output", *, replaces: bool = False) -> Path:
    """Refuse an output path that is the same file as an input (those given and those noted by
    :func:`note_input`), or that exists and is not a regular file (symlinks followed), or whose
    directory is not a directory. ``replaces=True``: the output is meant to replace the input read from
    the same path (``check --update`` rewriting a golden plan). Returns the path to write (a symlink's
    target)."""
    p = Path(path)
    if not str(path) or str(path).endswith(os.sep):
        raise InputError(f"{what} path names a directory", source=path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise InputError(f"cannot write {what}: {_reason(e)}", source=p) from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{what} path is a directory", source=p)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{what} path is {_kind(st.st_mode)}, not a regular file", source=p)
        for src in [*(x for x in inputs if x is not None), *_INPUTS]:
            if not replaces and same_file(p, src):
                raise InputError(f"{what} would overwrite an input file ({src})"
                                 if os.path.abspath(os.fspath(src)) != os.path.abspath(p)
                                 else f"{what} would overwrite an input file", source=p)
    elif os.path.islink(p):
        raise InputError(f"{what} path is a dangling symbolic link", source=p)
    target = Path(os.path.realpath(p)) if os.path.islink(p) else p
    parent = target.parent
    try:
        pst = os.stat(parent)
    except FileNotFoundError:
        pst = None
    except OSError as e:
        raise InputError(f"cannot write {what}: {_reason(e)}", source=p) from None
    if pst is not None and not stat.S_ISDIR(pst.st_mode):
        raise InputError(f"cannot write {what}: {parent} is not a directory", source=p)
    return target


class Terminated(BaseException):
    """Raised by the signal handlers :func:`atomic_write` installs (SIGTERM, SIGHUP) while it writes."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextmanager
def _cleanup_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into :class:`Terminated` while writing (so the temporary file is removed),
    restoring the previous handlers afterwards. Only the main thread can install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, _raise_terminated)
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _temp_name(target: Path) -> str:
    return str(target.parent / f".{target.name[:40]}.{secrets.token_hex(6)}.tmp")


_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", *, inputs: Any = (), what: str = "output",
                 replaces: bool = False) -> Iterator[Any]:
    """Write to a temporary file next to ``path`` and rename it into place on success.

    The one way zeppelin writes a file: :func:`check_output` runs first (never over an input, never over
    a device or FIFO, a symlink's target is replaced); any ``OSError`` becomes an :class:`InputError`
    naming the path and the reason; on any exception, SIGTERM and SIGHUP included, the temporary file
    is removed and ``path`` is left untouched.
    """
    target = check_output(path, inputs, what, replaces=replaces)
    shown = Path(path)
    try:
        if not target.parent.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot write {what}: {_reason(e)}", source=shown) from None
    tmp: str | None = None
    try:
        with _cleanup_signals():
            try:
                while True:  # the name is known before the file exists: a signal in between still removes it
                    tmp = _temp_name(target)
                    try:
                        fd = os.open(tmp, _TEMP_FLAGS, 0o600)
                        break
                    except FileExistsError:
                        continue
                with os.fdopen(fd, mode) as fh:
                    yield fh
                    fh.flush()
                    os.fsync(fh.fileno())
                # mkstemp creates 0600; give the file the permissions a plain open() would have
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o666 & ~umask)
                os.replace(tmp, target)
                tmp = None
            except OSError as e:
                raise InputError(f"cannot write {what}: {_reason(e)}", source=shown) from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def atomic_write_text(path: str | os.PathLike, text: str, *, inputs: Any = (), what: str = "output") -> None:
    with atomic_write(path, inputs=inputs, what=what) as fh:
        fh.write(text)


_STRING_OR_BRACKET = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth_exceeds(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text nests arrays/objects deeper than ``limit`` (checked before parsing, so a
    hostile file cannot exhaust the parser's recursion)."""
    import numpy as np

    a = np.frombuffer(data, dtype=np.uint8)
    step = (a == 0x5B).astype(np.int32) + (a == 0x7B) - (a == 0x5D) - (a == 0x7D)
    if step.size == 0 or int(np.cumsum(step).max()) <= limit:
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
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
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
