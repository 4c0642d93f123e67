"""`zeppelin show`: tiers, load bars, NIC loads with/without routing, remap volume, PNG."""

from __future__ import annotations

import subprocess

import pytest
from tests.planner.test_simulate import KV_BYTES_PER_TOKEN, _header, cluster, ctx_for, ring_step

from zeppelin.planner.costmodel.predict import predict_step
from zeppelin.planner.tools.show import group_rows, load_rows
from zeppelin.schemas.plan import Route, RoutePath, write_plan

B = 3 * 2048 * KV_BYTES_PER_TOKEN  # bytes of one ring round of a 4096-token zigzag sequence over 2 ranks


def _routed_step():
    cl = cluster(nodes=2, gpn=2, nics=2, nic=10.0)

    def route(src, dst, psrc, pdst):
        return Route(group=0, src=src, dst=dst, tokens=2048, bytes=int(B), paths=[
            RoutePath(via_src=src, via_dst=dst, nic_src=cl.nic_of(src), nic_dst=cl.nic_of(dst), tokens=1024),
            RoutePath(via_src=psrc, via_dst=pdst, nic_src=cl.nic_of(psrc), nic_dst=cl.nic_of(pdst), tokens=1024)])

    st = ring_step(4096, [0, 2], tier="inter", n=4, routes=[route(0, 2, 1, 3), route(2, 0, 3, 1)],
                   extra_groups=[(1, 1000), (3, 3000), (1, 500)])
    return cl, st


@pytest.fixture
def routed_plan(tmp_path):
    cl, st = _routed_step()
    st = st.model_copy(update={"prediction": predict_step(ctx_for(cl), st)})
    path = tmp_path / "routed.plan"
    write_plan(path, _header(cl), [st])
    return path


def test_group_rows_order_and_content():
    _, st = _routed_step()
    rows = group_rows(st)
    assert [(r["tier"], r["units"]) for r in rows] == [("inter", [0, 2]), ("local", [1]), ("local", [3]),
                                                       ("local", [1])]
    assert rows[0]["sequences"] == [(0, 4096)]
    assert [r["tokens"] for r in rows] == [4096, 1000, 3000, 500]


def test_load_rows_follow_prediction():
    cl, st = _routed_step()
    pred = predict_step(ctx_for(cl), st)
    rows = load_rows(pred)
    assert [r[5] for r in rows] == [2048, 1500, 2048, 3000]
    assert [r[4] for r in rows] == pytest.approx(pred.per_unit.total_s)


def test_cli_show_text(routed_plan, zeppelin_bin):
    out = subprocess.run([zeppelin_bin, "show", str(routed_plan)], capture_output=True, text=True, check=False,
                         env={"COLUMNS": "200", "PATH": ""})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "groups by tier" in text and "#0:4096" in text
    assert "sequences by tier: local 3, intra 0, inter 1" in text
    # each NIC carries half a round each way routed (B), the two direct NICs carry 2B unrouted
    gb, gb2 = f"{B / 1e9:.3f}", f"{2 * B / 1e9:.3f}"
    rows = [ln.replace("│", " ").split() for ln in text.splitlines() if "node" in ln and "/nic" in ln]
    nic_lines = {r[0]: r[1:3] for r in rows}
    assert nic_lines["node0/nic0"] == [gb, gb2]
    assert nic_lines["node0/nic1"] == [gb, "0.000"]
    assert "remap: off in all 1 micro-batch(es)" in text


def test_cli_show_png(routed_plan, zeppelin_bin, tmp_path):
    png = tmp_path / "out" / "step.png"
    out = subprocess.run([zeppelin_bin, "show", str(routed_plan), "--png", str(png)], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(png.parent.glob(".*.tmp"))


def test_cli_show_errors(routed_plan, zeppelin_bin, tmp_path):
    out = subprocess.run([zeppelin_bin, "show", str(routed_plan), "--png", str(tmp_path)], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == f"zeppelin: error: {tmp_path}: output path is a directory"
    out = subprocess.run([zeppelin_bin, "show", str(routed_plan), "--all", "--png", str(tmp_path / "x.png")],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == "zeppelin: error: --png draws one step: use --step K, not --all"
    assert not (tmp_path / "x.png").exists()
    out = subprocess.run([zeppelin_bin, "show", str(routed_plan), "--step", "3"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == f"zeppelin: error: {routed_plan}: step 3 out of range (plan has 1 steps)"
