"""Plans, predictions and simulated times of every planner on fixed steps stay what was recorded.

The recorded values (tests/data/plan_fingerprints.json) come from ``benchmarks/plan_fingerprint.py``;
a change that alters plans on purpose re-records them with that script (see its docstring).
"""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("plan_fingerprint", ROOT / "benchmarks" / "plan_fingerprint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plans_predictions_and_simulations_match_the_record():
    recorded = json.loads((ROOT / "tests" / "data" / "plan_fingerprints.json").read_text())["cases"]
    now = _script().fingerprint()["cases"]
    assert sorted(now) == sorted(recorded)
    changed = [k for k in recorded if now[k] != recorded[k]]
    assert not changed, f"plans or predictions changed for: {', '.join(changed)}"
