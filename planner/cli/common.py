"""The options every command shares: one name, one short form, one help text and one default.

The flags of ``plan``, ``compare`` and ``demo`` are declared in :mod:`zeppelin.planner.tools.config`
(the planning flags once, shared by the three). :func:`generated` makes a command's parameters from
them, and :func:`option` one parameter of another command that takes a planning flag (``validate``,
``data stats``, ``profile``), so that ``-m`` is the manifest and ``-c`` the cluster wherever they
appear, and every command reading a manifest takes the same ``--length-field / --ids-field /
--text-field / --tokenizer``. These two functions are the only places a planning flag becomes a
typer option (``tests/cli/test_cli_surface.py`` enforces it). Spellings of an older release still
work for one release: :func:`deprecated` prints one note on stderr naming the new spelling (the names
are listed in :data:`DEPRECATED`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import typer

from zeppelin.planner.tools.config import COMMANDS, Flag, default_tokens_per_step  # noqa: F401 (re-exported)

#: old spelling -> (command, the spelling that replaces it); each prints one note and still works
DEPRECATED = {
    ("compare", "--dataset"): "-m/--manifest",
    ("compare", "-d"): "-m/--manifest",
    ("compare", "-n"): "--steps",
    ("compare", "--tokens-per-gpu"): "--tokens-per-step",
    ("compare", "--solver-time-limit"): "--time-limit",
    ("compare", "-m MODEL"): "--model MODEL",
    ("data stats", "--tokens-field"): "--ids-field",
}

_noted: set[str] = set()


def deprecated(command: str, old: str) -> None:
    """One note on stderr (once per process) that ``old`` is an old spelling, naming the new one."""
    new = DEPRECATED[(command, old)]
    if (command, old) in _noted:
        return
    _noted.add((command, old))
    print(f"zeppelin: note: `{command} {old}` is deprecated and goes in the next release; use {new}",
          file=sys.stderr)


# ------------------------------------------------------------------ typer parameters from the declared flags
def option(flag: Flag, callback: Callable[..., Any] | None = None) -> Any:
    """The typer option of one declared flag (an eager flag acts in ``callback`` and passes no value)."""
    if flag.eager:
        return typer.Option(flag.default, *flag.flags, help=flag.help, is_eager=True, expose_value=False,
                            callback=callback)
    return typer.Option(flag.default, *flag.flags, help=flag.help, metavar=flag.metavar, hidden=flag.hidden)


def generated(command: str, **callbacks: Callable[..., Any]):
    """Decorator: the parameters of ``command`` are the flags ``COMMANDS[command]`` declares (the
    function takes them as keyword arguments); ``callbacks``: the eager flags' actions, by name."""
    def wrap(fn):
        fn.__signature__ = inspect.Signature([
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=bool if f.eager else f.annotation,
                              default=option(f, callbacks.get(f.name)))
            for f in COMMANDS[command]])
        return fn
    return wrap


# reading a manifest with the field flags (in planner.core, below the tools that read manifests too)
from zeppelin.planner.core.inputs import load_dataset  # noqa: F401
