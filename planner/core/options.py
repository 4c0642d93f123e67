"""Planner options: one typed dataclass per planner, the single source of every option.

A planner declares ``Options``, a frozen dataclass derived from :class:`PlannerOptions` whose
fields are made with :func:`option` (type, default, range or choices, help). From it come the
planner's ``option_names``, the checks and conversions of options as they arrive (keyword
arguments of the API, a check case's ``options``, strings from a command line) and the text of
``zeppelin plan --list-options`` and of the ``zeppelin plan`` flags that set Zeppelin options.

Errors are one line: an unknown option ``planner 'NAME': unknown option 'X' (known: ...)``, a value
of the wrong type or out of range ``planner 'NAME': bad option (...)``, a value outside a fixed set
``X option must be a, b or c (got 'v')``.

This module imports nothing heavy: the command line builds its help from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from zeppelin.schemas.common import InputError

__all__ = ["INTS", "NoOptions", "OptionSpec", "PlannerOptions", "option"]

#: the kind of an option holding a list of integers (``"1,2,4"`` or a list)
INTS = "ints"
_KIND_NAMES = {int: "int", float: "float", str: "str", bool: "bool", INTS: "int list"}


def _planning_error(message: str) -> Exception:
    from zeppelin.planner.costmodel.context import PlanningError  # (the cost model: not at import time)

    return PlanningError(message)


def _or(values) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


@dataclass(frozen=True)
class OptionSpec:
    """One option: what :func:`option` declared, with the field's name."""

    name: str
    kind: Any
    default: Any
    help: str
    minimum: float | None = None
    above: float | None = None
    choices: tuple[str, ...] | None = None
    #: replaces the range error: the text inside ``bad option (...)``, or a function of the
    #: converted value returning the exception to raise
    error: str | Callable[[Any], Exception] | None = None

    @property
    def type_name(self) -> str:
        return _KIND_NAMES[self.kind]

    @property
    def allowed(self) -> str:
        """The values it takes, for a listing: ``>= 1``, ``> 0``, ``auto | ring``, or empty."""
        if self.choices:
            return " | ".join(self.choices)
        if self.above is not None:
            return f"> {self.above:g}"
        if self.minimum is not None:
            return f">= {self.minimum:g}"
        return ""

    @property
    def default_text(self) -> str:
        if self.default is None:
            return "-"
        if isinstance(self.default, tuple):
            return ",".join(map(str, self.default))
        return str(self.default).lower() if isinstance(self.default, bool) else str(self.default)

    def convert(self, planner: str, raw: Any) -> Any:
        """``raw`` (None: the default) as this option's type, checked against its range or choices."""
        if raw is None:
            return self.default
        val = self._typed(planner, raw)
        if self.choices is not None and val not in self.choices:
            raise _planning_error(f"{self.name} option must be {_or(self.choices)} (got {raw!r})")
        for v in (val if self.kind == INTS else (val,)):
            if self.minimum is not None and not v >= self.minimum:
                self._range_error(planner, raw, val, f"must be at least {self.minimum:g}")
            if self.above is not None and not v > self.above:
                self._range_error(planner, raw, val, f"must be greater than {self.above:g}")
        return val

    def _range_error(self, planner: str, raw: Any, val: Any, why: str):
        if callable(self.error):
            raise self.error(val)
        raise _bad(planner, self.error or f"{self.name}={raw!r} {why}")

    def _typed(self, planner: str, raw: Any) -> Any:
        kind = self.kind
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            low = str(raw).strip().lower()
            if low in ("1", "true", "yes"):
                return True
            if low in ("0", "false", "no"):
                return False
            raise _bad(planner, f"{self.name}={raw!r} is not a boolean (true/false, yes/no, 1/0)")
        if kind is str:
            return str(raw)
        if isinstance(raw, bool):  # True is an int to Python, never a count or a size here
            what = {int: "an integer", float: "a number", INTS: "a list of integers"}[kind]
            raise _bad(planner, f"{self.name}={raw!r} is not {what}")
        try:
            if kind is int:
                if isinstance(raw, float) and not raw.is_integer():
                    raise _bad(planner, f"{self.name}={raw!r} is not an integer")
                return int(raw)
            if kind is float:
                val = float(raw)
                if not math.isfinite(val):
                    raise _bad(planner, f"{self.name}={raw!r} is not a finite number")
                return val
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            if any(isinstance(x, bool) or isinstance(x, float) and not x.is_integer() for x in items):
                raise ValueError
            return tuple(int(x) for x in items)
        except (TypeError, ValueError) as e:
            if kind == INTS:
                raise _bad(planner, f"{self.name}={raw!r} is not a list of integers") from None
            raise _bad(planner, str(e)) from None


def _bad(planner: str, text: str) -> Exception:
    return _planning_error(f"planner {planner!r}: bad option ({text})")


def option(kind: Any, default: Any, help: str, *, minimum: float | None = None, above: float | None = None,
           choices: tuple[str, ...] | None = None, error: str | Callable[[Any], Exception] | None = None):
    """A field of a :class:`PlannerOptions` dataclass: its type (``int``, ``float``, ``str``, ``bool``
    or :data:`INTS`), default (None: unset; the planner decides), one-line help, and its range
    (``minimum`` inclusive, ``above`` exclusive) or ``choices``."""
    if kind not in _KIND_NAMES:
        raise TypeError(f"option kind must be one of int, float, str, bool, INTS (got {kind!r})")
    meta = {"kind": kind, "help": help, "minimum": minimum, "above": above,
            "choices": tuple(choices) if choices else None, "error": error}
    return field(default=default, metadata={"option": meta})


@dataclass(frozen=True)
class PlannerOptions:
    """Base of every planner's options dataclass (a planner without options uses it as is)."""

    _specs: ClassVar[dict[type, tuple[OptionSpec, ...]]] = {}

    @classmethod
    def specs(cls) -> tuple[OptionSpec, ...]:
        """Every option, in declaration order."""
        if cls not in PlannerOptions._specs:
            out = []
            for f in fields(cls):
                meta = f.metadata.get("option")
                if meta is None:
                    raise TypeError(f"{cls.__name__}.{f.name}: declare planner options with option()")
                out.append(OptionSpec(name=f.name, default=f.default, **meta))
            PlannerOptions._specs[cls] = tuple(out)
        return PlannerOptions._specs[cls]

    @classmethod
    def spec(cls, name: str) -> OptionSpec:
        return next(s for s in cls.specs() if s.name == name)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(s.name for s in cls.specs())

    @classmethod
    def parse(cls, planner: str, raw: Mapping[str, Any]):
        """The options of planner ``planner`` from ``raw`` (names to values, possibly strings)."""
        names = cls.names()
        unknown = sorted(k for k in raw if k not in names)
        if unknown:
            known = f"known: {', '.join(sorted(names))}" if names else "it takes none"
            raise InputError(f"planner {planner!r}: unknown option {unknown[0]!r} ({known})")
        return cls(**{s.name: s.convert(planner, raw.get(s.name)) for s in cls.specs()})


@dataclass(frozen=True)
class NoOptions(PlannerOptions):
    """A planner that takes no options."""
