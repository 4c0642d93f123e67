"""docs/RUNTIME.md lists every flag of ``zeppelin run`` with its default, and ``zeppelin run
--help`` shows the defaults of the training flags."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from zeppelin.runtime.config import LaunchConfig, RunConfig, flag_specs

ROOT = Path(__file__).resolve().parents[2]
ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")


def _default_cell(spec) -> str:
    if spec.default is ...:
        return "(required)"
    if spec.kind is bool:
        return "off"
    return "—" if spec.default is None else f"`{spec.default}`"


@pytest.mark.parametrize("spec", [*flag_specs(RunConfig), *flag_specs(LaunchConfig)], ids=lambda s: s.flag)
def test_every_flag_is_documented_with_its_default(spec):
    doc = (ROOT / "docs" / "RUNTIME.md").read_text()
    name = spec.flag if spec.flags else "PLAN"
    rows = [ln for ln in doc.splitlines() if ln.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"{name}: {len(rows)} rows in docs/RUNTIME.md's flag tables"
    assert rows[0].split(" | ")[1] == _default_cell(spec), rows[0]


def test_run_help_lists_the_training_defaults():
    p = subprocess.run([ZEPPELIN, "run", "--help"], capture_output=True, text=True, check=False,
                       env={"COLUMNS": "250", "PATH": ""})
    text = re.sub(r"\s+", " ", p.stdout)
    for flag, default in (("--lr", "0.001"), ("--betas", "0.9,0.95"), ("--eps", "1e-08"), ("--weight-decay", "0.0"),
                          ("--lr-schedule", "constant"), ("--warmup-steps", "0"), ("--min-lr", "0.0")):
        assert re.search(re.escape(flag) + r" .*?\[default: " + re.escape(default) + r"\]", text), flag
    assert "(default: no clipping)" in text
