"""The "add a planner" example of docs/ARCHITECTURE.md: the page shows exactly examples/custom_planner.py,
and the planner it defines registers and plans valid steps (structure, memory, plan-file round trip)."""

import importlib.util
import re
from pathlib import Path

import pytest
from tests.planner.test_baselines import SETUPS, check_valid_plans


ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_planner.py"


@pytest.fixture(autouse=True)
def _unregister_afterwards():
    """The example registers a planner globally: take it out again so later tests see the stock registry."""
    from zeppelin.planner.core.base import PLANNERS

    yield
    PLANNERS.pop("example-longest-first", None)


def _load():
    spec = importlib.util.spec_from_file_location("custom_planner", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_architecture_page_shows_the_example_file():
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert EXAMPLE.read_text() in blocks


@pytest.mark.parametrize("cluster,model", SETUPS)
def test_example_planner_registers_and_plans_valid_steps(cluster, model, tmp_path):
    from zeppelin.planner.core.base import PLANNERS

    mod = _load()
    assert PLANNERS["example-longest-first"] is mod.LongestFirstLocal
    check_valid_plans("example-longest-first", cluster, model, tmp_path, longest=1.0)


def test_example_planner_balances_compute_and_refuses_what_does_not_fit():
    from tests.planner.test_baselines import make_ctx, seqs

    from zeppelin.planner.core.base import PlanningError, get_planner

    _load()
    ctx = make_ctx("local-cpu:2x2", "tiny")
    cap = ctx.cost.token_capacity
    plan = get_planner("example-longest-first").plan_step(ctx, 0, seqs([cap // 2, cap // 4, cap // 4, 64, 64]))
    owner = {p.seq: mb.groups[p.group].units[0] for mb in plan.microbatches for p in mb.placements}
    assert len({owner[0], owner[1], owner[2]}) == 3  # the three longest go to three different units
    with pytest.raises(PlanningError, match=rf"^sequence 0 \(sample 3, {cap + 1} tokens\) does not fit one unit "
                                            rf"\(capacity {cap} tokens\)$"):
        get_planner("example-longest-first").plan_step(ctx, 0, seqs([cap + 1]))
