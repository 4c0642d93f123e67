"""Tokenizers a manifest or the command line names: built-in counters or a Hugging Face
``tokenizer.json`` read as data (never code)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..common import InputError
from .safefiles import check_input_file

__all__ = ["BUILTIN_TOKENIZERS", "TOKENIZER_HINT", "hf_tokenizer", "looks_like_path", "resolve_tokenizer"]


def _whitespace(text: str) -> int:
    return len(text.split())


def _bytes(text: str) -> int:
    return len(text.encode("utf-8"))


BUILTIN_TOKENIZERS = {"whitespace": _whitespace, "bytes": _bytes}
TOKENIZER_HINT = "'whitespace', 'bytes' or a tokenizer.json path"


def looks_like_path(spec: str) -> bool:
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
    if isinstance(spec, str) and looks_like_path(spec):
        return hf_tokenizer(spec, base)
    if isinstance(spec, str) and ":" in spec:
        raise InputError(f"tokenizer {spec!r} names Python code, which a manifest or case file may not do "
                         f"(built-in tokenizers: {TOKENIZER_HINT}; `zeppelin data stats --python-tokenizer "
                         f"MODULE:CALLABLE` runs code you name on the command line)")
    raise InputError(f"unknown tokenizer {spec!r} (use {TOKENIZER_HINT})")
