"""`zeppelin data stats`."""

from __future__ import annotations

import typer

from .notyet import not_implemented


def stats(ctx: typer.Context) -> None:
    """Length statistics of a dataset manifest."""
    not_implemented("data stats")
