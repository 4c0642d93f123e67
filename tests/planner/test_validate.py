"""`zeppelin validate` / validate_plan: each invariant is checked and named when broken."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from tests.support.plans import sealed

from zeppelin.planner.core.base import PlanContext
from zeppelin.planner.core.driver import make_header, plan_steps
from zeppelin.planner.tools.validate import validate_plan
from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import SamplerConfig, Sequence, write_plan
from zeppelin.schemas.profile import default_profile


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    cl = cluster_preset("zeppelin-a")
    ctx = PlanContext(cl, model_preset("llama-7b"), default_profile(cl.name))
    rng = np.random.default_rng(11)
    cap = ctx.cost.token_capacity
    steps = []
    for k in range(2):
        L = list(np.clip(rng.lognormal(7, 1, 60).astype(int), 16, 6000)) + [cap * 9, cap * 3]
        steps.append([Sequence(sample_id=100 * k + i, length=int(x)) for i, x in enumerate(L)])
    # the tiered search, splitting short sequences whatever compute that wastes: overlapping rings
    # and routes to edit
    pl = ZeppelinPlanner(families="none", split_waste=1e9)
    hdr = make_header(ctx, pl, None, SamplerConfig(tokens_per_step=10**7), len(steps))
    path = tmp_path_factory.mktemp("plans") / "plan.jsonl"
    write_plan(path, hdr, list(plan_steps(ctx, pl, steps, progress=False)))
    return path


def _edit(src, dst, fn):
    lines = src.read_text().splitlines()
    recs = [json.loads(x) for x in lines if json.loads(x).get("kind") != "end"]
    fn(recs)
    dst.write_text(sealed(recs))  # re-sealed: the structural check under test refuses it, not the digest
    return dst


def test_valid_plan_has_no_problems(plan_file):
    assert validate_plan(plan_file) == []
    cl = cluster_preset("zeppelin-a")
    assert validate_plan(plan_file, cluster=cl, model=model_preset("llama-7b"),
                         profile=default_profile(cl.name)) == []


def _ring_placement(step: dict) -> dict:
    """The first zigzag-cut placement of a ring group in ``step`` (a usp group's placements cut
    each chunk further over its rows' positions)."""
    return next(p for mb in step["microbatches"] for p in mb["placements"]
                if p["scheme"] == "zigzag" and mb["groups"][p["group"]]["kind"] == "ring")


def test_dropped_chunk_is_a_coverage_problem(plan_file, tmp_path):
    dropped = {}

    def drop(recs):
        p = _ring_placement(recs[1])
        dropped["seq"], dropped["range"] = p["seq"], p["ranges"][0][1]
        dropped["len"] = recs[1]["sequences"][p["seq"]]["length"]
        p["ranges"][0] = p["ranges"][0][:1]  # drop the late zigzag chunk of ring position 0 (the last chunk)

    bad = _edit(plan_file, tmp_path / "bad.jsonl", drop)
    probs = validate_plan(bad)
    s, e = dropped["range"]
    assert e == dropped["len"]
    assert probs == [(f"coverage: step 0: attention layout misses the end of sequence {dropped['seq']} "
                     f"(covers {s} of {e} tokens)")]

    def drop_middle(recs):
        p = _ring_placement(recs[1])
        dropped["range"] = p["ranges"][1][0]
        p["ranges"][1] = p["ranges"][1][1:]  # drop the early chunk of ring position 1

    probs = validate_plan(_edit(plan_file, tmp_path / "bad2.jsonl", drop_middle))
    s, e = dropped["range"]
    assert probs[0] == f"coverage: step 0: attention layout misses tokens {s}..{e - 1} of sequence {dropped['seq']}"


def test_wrong_cluster_or_model_is_an_input_problem(plan_file):
    probs = validate_plan(plan_file, cluster=cluster_preset("zeppelin-c"), model=model_preset("llama-13b"))
    assert len(probs) == 2
    assert probs[0].startswith("inputs: cluster 'zeppelin-c' (sha256:")
    assert "is not the cluster this plan was made for (zeppelin-a, sha256:" in probs[0]
    assert probs[1].startswith("inputs: model 'llama-13b' (sha256:")


def test_edited_embedded_input_is_detected(plan_file, tmp_path):
    def edit(recs):
        recs[0]["model"]["num_layers"] = 16

    probs = validate_plan(_edit(plan_file, tmp_path / "m.jsonl", edit))
    assert probs[0].startswith("inputs: the embedded model hashes to sha256:")


def test_memory_overflow_is_reported(plan_file, tmp_path):
    def edit(recs):
        recs[0]["profile"]["memory_reserved_gb"] = 40.0  # shrink usable memory below what the plan holds

    probs = [p for p in validate_plan(_edit(plan_file, tmp_path / "mem.jsonl", edit)) if p.startswith("memory:")]
    assert probs and "holds" in probs[0] and "more than the" in probs[0]


def test_swapped_ring_chunks_break_ring_order(plan_file, tmp_path):
    def edit(recs):
        for mb in recs[1]["microbatches"]:
            for p in mb["placements"]:
                if p["scheme"] == "zigzag":
                    p["ranges"][0], p["ranges"][1] = p["ranges"][1], p["ranges"][0]
                    return

    probs = validate_plan(_edit(plan_file, tmp_path / "ring.jsonl", edit))
    assert any(p.startswith("ring-order: step 0 microbatch") and "zigzag chunks" in p for p in probs)


def test_ulysses_beside_a_ring_on_one_unit_is_reported(plan_file, tmp_path):
    """A unit may not run Ulysses and ring groups in one micro-batch (the runtime runs one family)."""
    where = {}

    def edit(recs):
        for mbi, mb in enumerate(recs[1]["microbatches"]):
            for u, q in enumerate(mb["queues"]):
                kinds = [mb["groups"][g]["kind"] for g in q]
                if "ring" in kinds and "local" in kinds:
                    # the unit's local work becomes a (one-unit) Ulysses group beside its ring
                    g = mb["groups"][q[kinds.index("local")]]
                    g["kind"], g["tier"] = "ulysses", "intra"
                    where["unit"], where["mb"] = u, mbi
                    return

    probs = validate_plan(_edit(plan_file, tmp_path / "kinds.jsonl", edit))
    assert where, "the fixture plan has no unit with a ring and local work"
    recs_step = json.loads(plan_file.read_text().splitlines()[1])["step"]
    assert (f"kinds: step {recs_step} microbatch {where['mb']}: unit {where['unit']} runs Ulysses and ring groups in one micro-batch "
            "(the runtime runs one family per unit: Ulysses, or rings/all-gathers)") in probs


def test_conflicting_queue_orders_are_reported(plan_file, tmp_path):
    def edit(recs):
        for mb in recs[1]["microbatches"]:
            multi = [gi for gi, g in enumerate(mb["groups"]) if len(g["units"]) > 1]
            for a in multi:
                for b in multi:
                    shared = set(mb["groups"][a]["units"]) & set(mb["groups"][b]["units"])
                    if a < b and len(shared) >= 2:  # swap on one shared unit, the other keeps the order
                        u = min(shared)
                        q = mb["queues"][u]
                        i, j = q.index(a), q.index(b)
                        q[i], q[j] = q[j], q[i]
                        return
        raise AssertionError("no overlapping ring groups in fixture")

    probs = validate_plan(_edit(plan_file, tmp_path / "q.jsonl", edit))
    assert any(p.startswith("ring-order:") and "conflicting orders" in p for p in probs)


def test_broken_route_is_reported(plan_file, tmp_path):
    def edit(recs):
        for mb in recs[1]["microbatches"]:
            if mb["routes"]:
                mb["routes"][0]["paths"][0]["nic_src"] = "node0/nic99"
                return
        raise AssertionError("fixture has no routes")

    probs = validate_plan(_edit(plan_file, tmp_path / "r.jsonl", edit))
    assert "coverage: step 0 microbatch 0: route 0 uses NIC 'node0/nic99', which the cluster does not have" in probs


def test_cli_exit_codes(plan_file, tmp_path, zeppelin_bin):
    r = subprocess.run([zeppelin_bin, "validate", str(plan_file), "--cluster", "zeppelin-a"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "valid - 2 steps by zeppelin" in r.stdout
    bad = _edit(plan_file, tmp_path / "bad.jsonl",
                lambda recs: recs[1]["microbatches"][0]["placements"].pop())
    r = subprocess.run([zeppelin_bin, "validate", str(bad)], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "INVALID" in r.stderr and "coverage: step 0: sequence" in r.stderr
    r = subprocess.run([zeppelin_bin, "validate", str(tmp_path / "missing.jsonl")], check=False, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().endswith("plan file not found")
