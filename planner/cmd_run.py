"""`zeppelin run` (implemented by the runtime issue)."""

from __future__ import annotations

import typer

from .notyet import not_implemented


def run(ctx: typer.Context) -> None:
    """Execute a plan with torch (launched through torchrun)."""
    not_implemented("run")
