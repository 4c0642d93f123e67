"""`zeppelin plan` and `zeppelin validate` (implemented by the planner issue)."""

from __future__ import annotations

import typer

from .notyet import not_implemented


def plan(ctx: typer.Context) -> None:
    """Plan training steps: manifest + cluster + model -> plan file."""
    not_implemented("plan")


def validate(ctx: typer.Context) -> None:
    """Check a plan's invariants (coverage, memory, routes, ring order, input hashes)."""
    not_implemented("validate")
