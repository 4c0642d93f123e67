"""`zeppelin profile` (implemented by the profiling issue)."""

from __future__ import annotations

import typer

from .notyet import not_implemented


def profile(ctx: typer.Context) -> None:
    """Measure this machine and write a cluster cost profile."""
    not_implemented("profile")
