"""docs/CONCEPTS.md is linked from the README and the commands that print its terms, and maps every
baseline planner to the system it stands for (as the verdict of `compare` does)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_concepts_is_linked_and_names_every_baseline():
    from zeppelin.planner.core import registry  # noqa: F401 (imports every planner module: they register)
    from zeppelin.planner.core.base import PLANNERS
    from zeppelin.planner.tools.compare import BASELINE_SYSTEMS

    text = (ROOT / "docs" / "CONCEPTS.md").read_text()
    assert "docs/CONCEPTS.md" in (ROOT / "README.md").read_text()
    baselines = sorted(p for p in PLANNERS if not p.startswith("zeppelin"))
    assert sorted(BASELINE_SYSTEMS) == baselines  # the verdict names the system of every baseline
    table = text.split("## Which baseline is your current setup")[1]
    for name in baselines:
        assert f"| `{name}` |" in table, name
    for term in ("unit", "tier", "lower bound", "ZeRO stage", "CP / ring", "Ulysses", "routing", "remap",
                 "CommFuse", "micro-batch"):
        assert f"**{term}" in text, term
