"""FSDP2's cost per micro-batch as the runtime's phase timing reports it, against the cost model's
bandwidth pricing under preset curves (no measured ``fsdp_microbatch_s`` fit).

On 2 gloo ranks of this machine (``local-cpu:1x2``), one plan of steps of ``--microbatches``
micro-batches, one whole sequence of ``--tokens`` tokens per rank in each, planned twice: at ZeRO-3
(FSDP2 over both ranks: every block's parameters all-gathered before its forward and again before
its backward, its gradients reduce-scattered after every micro-batch's backward) and at ZeRO-0
(``--dp replicate``: whole parameters, one gradient all-reduce after the last micro-batch). Both
run through ``zeppelin run --report-json`` (a warm-up step left out), the modes interleaved for
``--rounds`` rounds. What FSDP adds to a micro-batch = (forward + backward of a ZeRO-3 step -
forward + backward of the replicated step, the phases ``attention + remap + linear`` of the
slowest rank) / micro-batches; predicted = the plan's data-parallel collectives per micro-batch
(``CostModel.step_collectives_time`` / micro-batches: the ``grad_allreduce`` phase ``zeppelin run
--report`` predicts) under the preset profile, i.e. the local-cpu cluster's link figures.

    python benchmarks/bench_fsdp_microbatch.py [--rounds 3] [--steps 4] [-o RESULT.json]
    python benchmarks/bench_fsdp_microbatch.py --repredict RESULT.json   # measurements kept
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_accuracy import _zeppelin_cmd
from bench_coupling import add_run_args, run_report, write_result

CLUSTER = "local-cpu:1x2"
#: mode -> (plan ZeRO stage, extra `zeppelin run` flags)
MODES: dict[str, tuple[int, list[str]]] = {"zero3": (3, []), "replicate": (0, ["--dp", "replicate"])}


def write_plan(path: Path, model: str, zero: int, tokens: int, microbatches: int, steps: int) -> None:
    """A plan of ``steps + 1`` steps (the first one warms up): per micro-batch one sequence of
    ``tokens`` tokens whole on each rank, preset profile of the CPU cluster."""
    from zeppelin.planner.core.base import PlanContext, get_planner
    from zeppelin.planner.core.builder import StepBuilder
    from zeppelin.planner.core.driver import make_header
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.plan import PlanWriter, SamplerConfig, Sequence, SolverInfo
    from zeppelin.schemas.profile import default_profile

    cluster = cluster_preset(CLUSTER)
    ctx = PlanContext(cluster, model_preset(model), default_profile(cluster.name, cluster.device), zero_stage=zero)
    plans = []
    for k in range(steps + 1):
        seqs = [Sequence(sample_id=k * 64 + i, length=tokens) for i in range(2 * microbatches)]
        b = StepBuilder(ctx, seqs, "bench-fsdp-microbatch")
        for i in range(len(seqs)):
            b.place(i // 2, "local", [i % 2], i)
        plans.append(b.finish(k, SolverInfo(name="greedy")))
    header = make_header(ctx, get_planner("zeppelin"), None, SamplerConfig(seed=0), len(plans))
    with PlanWriter(path, header, "jsonl") as w:
        for st in plans:
            w.write(st)


def predicted_per_microbatch(plan_path: Path) -> float:
    """The plan's data-parallel collectives per micro-batch, as the current code prices them: the
    current ``local-cpu`` preset's links (the plan's header keeps the figures it was written with)."""
    from zeppelin.planner.sim.simulate import context_from_header
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.plan import read_plan

    header, steps = read_plan(plan_path)
    shape = f"local-cpu:{header.cluster.num_nodes}x{header.cluster.gpus_per_node}"
    ctx = context_from_header(header.model_copy(update={"cluster": cluster_preset(shape)}))
    m = len(steps[0].microbatches)
    return float(ctx.cost.step_collectives_time(m, ctx.num_units)) / m


def fwd_bwd(step: dict[str, Any]) -> float:
    ph = step["measured_s"]
    return sum(float(ph.get(k) or 0.0) for k in ("attention", "remap", "linear"))


def measure(args, work: Path) -> dict[str, Any]:
    zep = _zeppelin_cmd()
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    plans = {}
    for mode, (zero, _) in MODES.items():
        plans[mode] = work / f"plan_{mode}.jsonl"
        write_plan(plans[mode], args.model, zero, args.tokens, args.microbatches, args.steps)
    runs = []
    for rnd in range(args.rounds):
        for mode, (_, flags) in MODES.items():
            steps, info = run_report(zep, plans[mode], flags, f"{mode}_r{rnd}", work, env, threads)
            steps = steps[1:]  # the first step warms up
            runs.append({"round": rnd, "mode": mode, **info, "fwd_bwd_s": [round(fwd_bwd(s), 4) for s in steps],
                         "step_s": [round(float(s["measured_s"]["step"]), 4) for s in steps]})
            print(f"[bench_fsdp_microbatch] round {rnd} {mode}: {runs[-1]['fwd_bwd_s']}", file=sys.stderr, flush=True)
    return {"machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})", "ranks": 2,
            "cluster": CLUSTER, "threads_per_rank": int(threads), "model": args.model, "tokens": args.tokens,
            "microbatches": args.microbatches, "steps": args.steps, "rounds": args.rounds,
            "plans": {m: str(p) for m, p in plans.items()}, "runs": runs}


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Measured FSDP seconds per micro-batch: per round, the median over steps of ZeRO-3's forward +
    backward minus the replicated run's, over micro-batches; the median over rounds."""
    m = doc["microbatches"]
    per_round = []
    for rnd in range(doc["rounds"]):
        z3, rep = (next(r for r in doc["runs"] if r["round"] == rnd and r["mode"] == mode) for mode in MODES)
        per_round.append((statistics.median(z3["fwd_bwd_s"]) - statistics.median(rep["fwd_bwd_s"])) / m)
    meas = statistics.median(per_round)
    pred = doc["predicted_per_microbatch_s"]
    return {"measured_per_microbatch_s": round(meas, 4), "per_round_s": [round(x, 4) for x in per_round],
            "predicted_per_microbatch_s": round(pred, 4), "error": round(pred / meas - 1, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--tokens", type=int, default=512, help="tokens of each rank's sequence per micro-batch")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per run (after a warm-up step)")
    add_run_args(ap)
    args = ap.parse_args(argv)
    if args.repredict is not None:  # (plan paths relative to the result's folder)
        doc = json.loads(args.repredict.read_text())
        doc["plans"] = {m: str(args.repredict.parent / Path(p).name) for m, p in doc["plans"].items()}
    else:
        work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_fsdp_mb_"))
        work.mkdir(parents=True, exist_ok=True)
        doc = measure(args, work)
    doc["predicted_per_microbatch_s"] = predicted_per_microbatch(Path(doc["plans"]["zero3"]))
    doc["summary"] = summarize(doc)
    write_result(doc, args.output)
    print(json.dumps(doc["summary"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
