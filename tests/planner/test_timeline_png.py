"""The pictures tell the truth: `zeppelin show --png` draws the whole step as the simulator runs it
(every layer of every micro-batch, the head, the gradient all-reduce; no barrier between
micro-batches), so the drawn extent and every unit's drawn compute equal what `zeppelin simulate`
reports; the load heat-map's colour scale starts at 0 and its title states the spread."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from zeppelin.planner.cli import main
from zeppelin.planner.sim.simulate import Simulator, context_from_header
from zeppelin.planner.tools.show import timeline_boxes
from zeppelin.schemas.plan import PlanReader


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """A step with two micro-batches and ring groups of different sizes (units wait for their group only)."""
    path = tmp_path_factory.mktemp("tl") / "a16.plan"
    with pytest.raises(SystemExit) as e:
        # without recomputation the default step takes two micro-batches (the case the timeline guards)
        main(["plan", "-c", "zeppelin-a:2", "--model", "llama-7b", "--steps", "1", "--recompute", "none", "-o",
              str(path), "-q"])
    assert e.value.code == 0
    return path


def _simulate_json(plan, tmp_path) -> dict:
    out = tmp_path / "sim.json"
    with pytest.raises(SystemExit) as e:
        main(["simulate", str(plan), "--step", "0", "-o", str(out)])
    assert e.value.code == 0
    return json.loads(out.read_text())["steps"][0]


def test_timeline_drawn_total_equals_simulate(plan_file, tmp_path):
    sim_doc = _simulate_json(plan_file, tmp_path)
    reader = PlanReader(plan_file)
    res = Simulator(context_from_header(reader.header)).simulate_step(reader.step(0), timeline=True)
    assert len(res.timeline) >= 2  # the case this guards: more than one micro-batch
    boxes, extent = timeline_boxes(res)
    assert extent == pytest.approx(sim_doc["step_time_s"], rel=1e-9)
    n = len(res.units)
    compute = np.zeros(n)
    end_before_ar = np.zeros(n)
    for (cat, lane), spans in boxes.items():
        for x0, x1, u in spans:
            assert 0.0 <= x0 <= x1 <= extent * (1 + 1e-12)
            if cat == "grad all-reduce":
                assert x1 == pytest.approx(extent) and x1 - x0 == pytest.approx(sim_doc["allreduce_s"])
                continue
            end_before_ar[u] = max(end_before_ar[u], x1)
            if lane == "compute":
                compute[u] += x1 - x0
    # every unit's drawn attention + linear + head is the busy time simulate reports for it
    units = sim_doc["per_unit"]
    busy = np.array(units["attention_s"]) + np.array(units["linear_s"])
    assert compute == pytest.approx(busy, rel=1e-6)
    assert end_before_ar.max() == pytest.approx(sim_doc["compute_end_s"], rel=1e-9)


def test_show_png_axis_title_and_heatmap_scale(plan_file, tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from zeppelin.planner.tools import show as show_mod

    figs = []
    monkeypatch.setattr(show_mod, "save_png", lambda fig, path, dpi=100: figs.append(fig) or
                        path.write_bytes(b"\x89PNG"))
    png = tmp_path / "s.png"
    with pytest.raises(SystemExit) as e:
        main(["show", str(plan_file), "--png", str(png)])
    assert e.value.code == 0
    sim_doc = _simulate_json(plan_file, tmp_path)
    ax, ax2 = figs[0].axes[:2]
    total_ms = sim_doc["step_time_s"] * 1e3
    assert ax.get_xlim()[1] == pytest.approx(total_ms)  # the full extent, not one layer
    assert f"simulated {total_ms:,.1f} ms" in ax.get_title()
    assert not ax.lines  # no barrier lines between micro-batches
    assert "ms" in ax.get_xlabel() and "unit" in ax.get_ylabel()
    assert ax2.images[0].get_clim()[0] == 0.0  # the load scale starts at 0
    assert "spread" in ax2.get_title() and "scale from 0" in ax2.get_title()
    # the heat-map draws each unit's total (attention + linear + exposed comm), the quantity of the
    # load table's "total ms" column, and says so
    units = sim_doc["per_unit"]
    total = (np.array(units["attention_s"]) + np.array(units["linear_s"]) + np.array(units["exposed_comm_s"])) * 1e3
    drawn = ax2.images[0].get_array().compressed()
    assert np.array(drawn) == pytest.approx(total, rel=1e-6)
    assert any(units["exposed_comm_s"])  # the case this guards: busy time alone would differ
    assert ax2.get_title().startswith("total ms per unit: attention + linear\n+ exposed comm")


def test_summary_timeline_keeps_the_truth(plan_file):
    """The summary drawn for large steps (summary_boxes) has the detailed timeline's extent, each
    unit's compute by kind and each unit's micro-batch ends: only the layers are merged."""
    from zeppelin.planner.tools.show import summary_boxes

    reader = PlanReader(plan_file)
    res = Simulator(context_from_header(reader.header)).simulate_step(reader.step(0), timeline=True)
    detail, extent = timeline_boxes(res)
    summ, extent2 = summary_boxes(res)
    assert extent2 == pytest.approx(extent, rel=1e-12)
    n = len(res.units)

    def per_kind(boxes):
        out: dict[str, np.ndarray] = {}
        for (cat, lane), spans in boxes.items():
            if lane == "compute" and cat != "waiting":
                a = out.setdefault(cat, np.zeros(n))
                for x0, x1, u in spans:
                    a[u] += x1 - x0
        return out

    want, got = per_kind(detail), per_kind(summ)
    assert sorted(want) == sorted(got)
    for cat in want:
        assert got[cat] == pytest.approx(want[cat], rel=1e-9)
    # a unit's boxes tile its time until the all-reduce: compute by kind + waiting + head, no gaps
    for u in range(n):
        spans = sorted((x0, x1) for (cat, _), sp in summ.items() if cat != "grad all-reduce"
                       for x0, x1, v in sp if v == u)
        assert spans[0][0] == 0.0 and all(a[1] == pytest.approx(b[0], abs=1e-12) for a, b in itertools.pairwise(spans))
    assert sum(len(v) for v in summ.values()) < sum(len(v) for v in detail.values()) / 10
