"""`zeppelin simulate | compare | check | show` (implemented by the simulator issue)."""

from __future__ import annotations

import typer

from .notyet import not_implemented


def simulate(ctx: typer.Context) -> None:
    """Predict a plan's per-rank timeline and step time."""
    not_implemented("simulate")


def compare(ctx: typer.Context) -> None:
    """Plan the same steps with zeppelin and every baseline; print them side by side."""
    not_implemented("compare")


def check(ctx: typer.Context) -> None:
    """CI plan regression check against the golden plans in plans/."""
    not_implemented("check")


def show(ctx: typer.Context) -> None:
    """Render a plan for a person: tiers, per-rank load, routing, a PNG timeline."""
    not_implemented("show")
