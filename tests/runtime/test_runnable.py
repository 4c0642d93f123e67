"""Plans that always run: the planner makes only steps the runtime executes for the model,
``zeppelin validate --model`` checks it, and ``zeppelin run`` refuses a plan holding a step it
cannot execute before step 0, in one line naming that step.

The end-to-end case plans a tiny Hugging Face model with the default options on synthetic real-text
length mixes (:func:`zeppelin.planner.tools.compare.mix_dataset`) chosen so that the steps come from
every candidate family the planner offers on 8 CPU ranks (FLOP-share, Ulysses groups, the tiered
search) and include a rank without any token, and runs both plans to their end with ``--verify``; a third
plan makes the wide-rings family the only one beside the tiered search (it does not win a default
plan on 8 ranks) and runs it the same way. TP replicas are never planned for these models.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.runtime.test_fsdp import _plan
from tests.runtime.test_hf import ZEPPELIN, make_hf_dir
from tests.support.clusters import cluster_file
from zeppelin.schemas.common import content_hash
from zeppelin.schemas.hf import hf_model_spec
from zeppelin.schemas.plan import PlanReader, write_plan
from zeppelin.schemas.runnable import model_runs_tp, step_problem

REASON = "Hugging Face models run plans without tensor parallelism only"


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("hf") / "llama", "llama", seed=1)


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """``local-cpu`` clusters over fast links (tests/support/clusters.py), where the planners make
    the rings, Ulysses groups and TP replicas these tests run: ``fast("local-cpu:1x4")`` is a
    cluster file's path."""
    d = tmp_path_factory.mktemp("clusters")
    return lambda name: str(cluster_file(d, name))


def _run(args, cwd, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([ZEPPELIN, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def _hf_config(path: Path, **dims) -> str:
    path.mkdir()
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000, "dtype": "bfloat16",
           "rms_norm_eps": 1e-6, "hidden_act": "silu"} | dims
    (path / "config.json").write_text(json.dumps(cfg))
    return f"hf:{path}"


def test_planner_makes_no_tp_replicas_for_hf_models(tmp_path):
    """A step where replicas of a larger TP degree win for llama-13b (the grid cell of
    tests/planner/test_zeppelin_families.py) is planned without them for the same architecture
    read from a Hugging Face config.json."""
    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.core.sampler import sample_steps
    from zeppelin.planner.tools.compare import mix_dataset
    from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.plan import SamplerConfig
    from zeppelin.schemas.profile import default_profile

    cl = cluster_preset("zeppelin-c:8")
    seqs = sample_steps(mix_dataset("long"), SamplerConfig(tokens_per_step=16384 * 64, seed=0, max_seq_len=131072),
                        1)[0]
    spec = hf_model_spec(_hf_config(tmp_path / "l13", hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                                    num_key_value_heads=40, intermediate_size=13824, rms_norm_eps=1e-5))
    assert model_runs_tp(model_preset("llama-13b")) and not model_runs_tp(spec)
    # the usp groups win this step outright since they price their routes; without them, TP replicas do
    fams = "ulysses-groups,flop-share,tp-replicas,wide-rings"
    own = ZeppelinPlanner(families=fams).plan_step(PlanContext(cl, model_preset("llama-13b"), default_profile(cl.name)),
                                                   0, seqs)
    assert own.notes["family"] == "tp-replicas" and max(r.tp for r in own.replicas) > 1
    plan = ZeppelinPlanner(families=fams).plan_step(PlanContext(cl, spec, default_profile(cl.name)), 0, seqs)
    assert plan.notes.get("family") != "tp-replicas"
    assert plan.replicas is None or all(r.tp == 1 for r in plan.replicas)


def test_plan_refuses_to_write_steps_the_runtime_cannot_run(hf, fast, tmp_path):
    """`zeppelin plan --tp 2` for an HF model, and a baseline planner told to make TP-2 replicas for
    it, are refused in one line; no plan file is written."""
    (tmp_path / "m.jsonl").write_text("".join(json.dumps({"length": n}) + "\n" for n in [300, 500, 700, 900] * 8))
    base = ["plan", "-m", "m.jsonl", "-c", fast("local-cpu:1x4"), "--model", f"hf:{hf}", "--steps", "2",
            "--tokens-per-step", "2048", "-q", "-o", "p.jsonl"]
    for extra, line in ((["--tp", "2"], f"--tp 2: {REASON} (plan with --tp 1)"),
                        (["--planner", "hydraulis", "-O", "tp_degrees=1,2"],
                         f"planner hydraulis made a step zeppelin run cannot execute: step 0: replica 0 has tp=2; "
                         f"{REASON}")):
        p = _run([*base, *extra], tmp_path)
        assert (p.returncode, p.stderr) == (2, f"zeppelin: error: {line}\n")
        assert sorted(x.name for x in tmp_path.iterdir()) == ["m.jsonl"]


def test_unrunnable_plan_refused_by_validate_and_before_step_0(hf, tmp_path):
    """A hand-made plan with a TP-2 replica for an HF model: `validate --model hf:DIR` names the
    step, `run` refuses it in one line before any process starts (no metrics written); without the
    HF model (the runtime's own Llama runs TP) the same plan is runnable."""
    header, steps = _plan("hydraulis")  # the tiny model, mixed TP-1/TP-2 replicas
    spec = hf_model_spec(f"hf:{hf}")
    dims = ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab_size")
    assert [getattr(spec, d) for d in dims] == [getattr(header.model, d) for d in dims]
    header = header.model_copy(update={"model": spec, "hashes": header.hashes.model_copy(
        update={"model": content_hash(spec)})})
    first = next(s.step for s in steps if any(r.tp > 1 for r in s.replicas))
    unit = next(u for u, r in enumerate(steps[first].replicas) if r.tp > 1)
    write_plan(tmp_path / "p.jsonl", header, steps)
    why = f"step {first}: replica {unit} has tp=2; {REASON}"
    assert step_problem(header, steps[first]) == why and step_problem(header, steps[first], hf=False) is None
    p = _run(["validate", "p.jsonl", "--model", f"hf:{hf}"], tmp_path)
    assert p.returncode == 1 and f"  runnable: {why}" in p.stderr.splitlines(), p.stderr
    p = _run(["run", "p.jsonl", "--model", f"hf:{hf}", "--progress", "none"], tmp_path)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == [f"zeppelin: error: p.jsonl: zeppelin run cannot execute {why} (nothing was run)"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["p.jsonl"]
    p = _run(["run", "p.jsonl", "--model", f"hf:{hf}", "--steps", str(first), "--progress", "none"], tmp_path)
    assert p.returncode == 0, p.stderr  # the steps before it run


def _families(path: Path) -> tuple[set[str], bool]:
    r = PlanReader(path)
    fams, empty = set(), False
    for s in r:
        fams.add(s.notes.get("family", "tiered" if "tiers" in s.notes else "?"))
        empty = empty or any(not mb.linear_segments(u) for mb in s.microbatches for u in range(r.header.num_units))
    return fams, empty


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_default_hf_plans_run_to_the_end(hf, fast, tmp_path):
    """`zeppelin plan --model hf:DIR` with default options on two length mixes: between them the
    steps come from usp groups, Ulysses groups and the tiered search, and one leaves a rank without
    tokens; `validate --model` passes and `run --verify` executes every step within 1e-5."""
    from zeppelin.planner.tools.compare import mix_dataset

    lengths = mix_dataset("short", 2000).lengths
    (tmp_path / "short.jsonl").write_text("".join(json.dumps({"length": int(n)}) + "\n" for n in lengths))
    seen, empty_seen = set(), False
    for name, cluster, budget, steps in (("a", "local-cpu:2x4", 4096, 3), ("b", "local-cpu:1x8", 2048, 2)):
        p = _run(["plan", "-m", "short.jsonl", "-c", fast(cluster), "--model", f"hf:{hf}", "--steps", steps,
                  "--tokens-per-step", budget, "--max-seq-len", budget, "-q", "-o", f"{name}.jsonl"], tmp_path)
        assert p.returncode == 0, p.stderr
        fams, empty = _families(tmp_path / f"{name}.jsonl")
        seen |= fams
        empty_seen = empty_seen or empty
        p = _run(["validate", f"{name}.jsonl", "--model", f"hf:{hf}"], tmp_path)
        assert p.returncode == 0, p.stderr
        p = _run(["run", f"{name}.jsonl", "--model", f"hf:{hf}", "--verify", "--progress", "none",
                  "--zero-stage", "3", "--zero-stage-override"], tmp_path)
        assert p.returncode == 0, p.stderr
        recs = [json.loads(x) for x in (tmp_path / f"{name}.metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in recs] == list(range(steps))
        assert all(r["verify"]["ok"] and r["verify"]["grad_rel"] <= 1e-5 for r in recs)
        assert np.isfinite([r["loss"] for r in recs]).all()
    assert seen >= {"usp-groups", "ulysses-groups", "tiered"}, seen
    assert empty_seen


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hf_plan_with_wide_rings_runs(hf, fast, tmp_path):
    """The one family the default plans above do not reach on 8 ranks: rings of whole nodes for a
    step's long sequences (it wins where a slow network keeps such a step far from its bound). Made
    the only family beside the tiered search, on 4 'nodes' of 2 ranks and the long-tail mix, with
    the tiered search splitting short sequences whatever compute that wastes (``split_waste``: the
    tiny model's short kernels make every split costly, and the thrifty tiered plans win every step),
    it plans one step; the plan validates for the model and runs to the end within 1e-5 of the
    single-process reference."""
    from zeppelin.planner.tools.compare import mix_dataset

    lengths = mix_dataset("longtail", 2000).lengths
    (tmp_path / "lt.jsonl").write_text("".join(json.dumps({"length": int(n)}) + "\n" for n in lengths))
    p = _run(["plan", "-m", "lt.jsonl", "-c", fast("local-cpu:4x2"), "--model", f"hf:{hf}", "--steps", 4,
              "--tokens-per-step", 2048, "--max-seq-len", 2048, "--families", "wide-rings",
              "-O", "family_margin=10", "-O", "split_waste=1e9", "-q", "-o", "w.jsonl"], tmp_path)
    assert p.returncode == 0, p.stderr
    fams, _ = _families(tmp_path / "w.jsonl")
    assert "wide-rings" in fams, fams
    p = _run(["validate", "w.jsonl", "--model", f"hf:{hf}"], tmp_path)
    assert p.returncode == 0, p.stderr
    p = _run(["run", "w.jsonl", "--model", f"hf:{hf}", "--verify", "--progress", "none", "--zero-stage", "3",
              "--zero-stage-override"], tmp_path)
    assert p.returncode == 0, p.stderr
    recs = [json.loads(x) for x in (tmp_path / "w.metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    assert all(r["verify"]["ok"] and r["verify"]["grad_rel"] <= 1e-5 for r in recs)


@pytest.mark.timeout(300)
def test_long_blocks_plan_runs_exactly(tmp_path):
    """A long-blocks plan on 3 'nodes' of 2 ranks (tiny model): each step's two long sequences in
    two micro-batches, each on a usp group of all three nodes (rows of 2, a ring of 3 - not a power
    of two), the short ones whole on units that also hold a long sequence's share. It validates and
    runs within 1e-5 of the single-process reference."""
    from tests.runtime.test_runtime_dist import make_header
    from tests.support.clusters import cluster_preset
    from zeppelin.planner.sim.simulate import context_from_header
    from zeppelin.planner.zeppelin.families import long_blocks
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.plan import Sequence

    header = make_header(cluster_preset("local-cpu:3x2"), model_preset("tiny"), 2, planner="zeppelin")
    ctx = context_from_header(header)
    steps = []
    for k, lens in enumerate(([4096, 4096, 256, 128, 64], [6000, 3000, 200, 100, 31])):
        seqs = [Sequence(sample_id=100 * k + i, length=n) for i, n in enumerate(lens)]
        plan = long_blocks.candidates(ctx, k, seqs, top=1)[0].build()
        assert plan.notes["family"] == "long-blocks" and len(plan.microbatches) == 2
        for mb in plan.microbatches:
            (usp,) = [g for g in mb.groups if g.kind == "usp"]
            assert usp.shape == [2, 3]
        shared = [u for mb in plan.microbatches for g in mb.groups if g.kind == "local" for u in g.units]
        assert shared, "no short sequence beside a long one's share"
        steps.append(plan)
    _runs_exactly(tmp_path, "lb", header, steps)


def _runs_exactly(tmp_path, name: str, header, steps) -> None:
    """``steps`` written as ``name.jsonl`` validate and run with ``--verify``, every step within 1e-5
    of the single-process reference."""
    write_plan(tmp_path / f"{name}.jsonl", header, steps)
    p = _run(["validate", f"{name}.jsonl"], tmp_path)
    assert p.returncode == 0, p.stderr
    p = _run(["run", f"{name}.jsonl", "--verify", "--progress", "none"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / f"{name}.metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(len(steps)))
    assert all(r["verify"]["ok"] and r["verify"]["grad_rel"] <= 1e-5 for r in recs)


@pytest.mark.timeout(300)
def test_tiered_usp_rings_run_exactly(tmp_path):
    """The tiered search's inter-node ring run as a usp group (rows of 2 inside each of 2 'nodes', a
    ring of 2 rows), the short sequences whole beside it: the plan validates and runs within 1e-5 of
    the single-process reference."""
    from tests.runtime.test_runtime_dist import make_header
    from tests.support.clusters import cluster_preset
    from zeppelin.planner.sim.simulate import context_from_header
    from zeppelin.planner.zeppelin.planner import ZeppelinPlanner
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.plan import Sequence

    header = make_header(cluster_preset("local-cpu:2x2"), model_preset("tiny"), 2, planner="zeppelin")
    ctx = context_from_header(header)
    steps = []
    for k, lens in enumerate(([6000, 300, 200, 100], [8192, 64, 32])):
        seqs = [Sequence(sample_id=100 * k + i, length=n) for i, n in enumerate(lens)]
        plan = ZeppelinPlanner(families="none").plan_step(ctx, k, seqs)
        usp = [g for mb in plan.microbatches for g in mb.groups if g.kind == "usp"]
        assert [(g.tier, g.units, g.shape) for g in usp] == [("inter", [0, 1, 2, 3], [2, 2])]
        steps.append(plan)
    _runs_exactly(tmp_path, "usp", header, steps)
