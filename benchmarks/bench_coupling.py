"""Micro-batch coupling as the runtime runs it: does a two-micro-batch step take the sum over
micro-batches of the slowest rank, or the slowest rank's sum?

On 2 gloo ranks of this machine (``local-cpu:1x2``; each rank on its own cores, with the threads
``zeppelin profile`` gives a rank: cores / 2), three kinds of step, each of two
micro-batches of whole sequences (one local group per rank):

* ``complementary`` (C): rank 0 holds the heavy sequence in micro-batch 0 and the light one in
  micro-batch 1, rank 1 the reverse;
* ``same`` (S): both ranks heavy in micro-batch 0, both light in micro-batch 1 (every rank holds
  what it holds in C: no imbalance inside a micro-batch);
* ``double`` (D): both ranks heavy in both micro-batches.

Decoupled micro-batches (a rank runs its next one as soon as it is done) make C as fast as S;
micro-batches coupled every layer (a rank waits for the slowest rank in each) make C as slow as D.
The coupling index ``(C - S) / (D - S)`` is 0 for "the slowest rank's sum" and 1 for "the sum over
micro-batches of the slowest rank". Each data-parallel mode runs one plan through ``zeppelin run
--report-json`` (a warm-up step, then C, S, D repeated ``--steps`` times), the modes interleaved
for ``--rounds`` rounds: ZeRO-3 and ZeRO-2 (FSDP2 over both ranks), HSDP (``--hsdp 1``: shard
groups of one rank, FSDP2's all-reduce across them) and ``--dp replicate`` (ZeRO-0: one gradient
all-reduce after the last micro-batch). Predicted: the simulated step plus the profiled optimizer
step (what ``zeppelin run --report`` predicts), by the code that runs the benchmark; ``--repredict
RESULT.json`` prices a result's saved plans again with the current code, measurements kept.

    python benchmarks/bench_coupling.py [--profile FILE] [--rounds 3] [--steps 3] [-o RESULT.json]
    python benchmarks/bench_coupling.py --markdown RESULT.json
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
from bench_accuracy import _load, _run, _zeppelin_cmd

KINDS = ("complementary", "same", "double")
#: mode -> (plan ZeRO stage, extra `zeppelin run` flags)
MODES: dict[str, tuple[int, list[str]]] = {
    "zero3": (3, []),
    "zero2": (2, []),
    "hsdp": (3, ["--hsdp", "1"]),
    "replicate": (0, ["--dp", "replicate"]),
}
CLUSTER = "local-cpu:1x2"


def step_kinds(heavy: int, light: int) -> dict[str, list[list[tuple[int, int]]]]:
    """Per kind: per micro-batch, the (rank, length) of each rank's one sequence."""
    return {
        "complementary": [[(0, heavy), (1, light)], [(0, light), (1, heavy)]],
        "same": [[(0, heavy), (1, heavy)], [(0, light), (1, light)]],
        "double": [[(0, heavy), (1, heavy)], [(0, heavy), (1, heavy)]],
    }


def build_step(ctx, k: int, mbs: list[list[tuple[int, int]]]):
    """One step plan: every sequence whole on its rank's local group, in its micro-batch."""
    from zeppelin.planner.core.builder import StepBuilder
    from zeppelin.schemas.plan import Sequence, SolverInfo

    seqs, where = [], []
    for m, mb in enumerate(mbs):
        for unit, length in mb:
            where.append((m, unit))
            seqs.append(Sequence(sample_id=k * 16 + len(seqs), length=length))
    b = StepBuilder(ctx, seqs, "bench-coupling")
    for i, (m, unit) in enumerate(where):
        b.place(m, "local", [unit], i)
    return b.finish(k, SolverInfo(name="greedy"))


def plan_order(steps: int) -> list[str]:
    """The kinds of a plan's steps: a warm-up step, then C, S, D repeated."""
    return ["complementary"] + [kind for _ in range(steps) for kind in KINDS]


def write_plan(path: Path, profile, model: str, zero: int, heavy: int, light: int, steps: int) -> None:
    from zeppelin.planner.core.base import PlanContext, get_planner
    from zeppelin.planner.core.driver import make_header
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.plan import PlanWriter, SamplerConfig

    ctx = PlanContext(cluster_preset(CLUSTER), model_preset(model), profile, zero_stage=zero)
    kinds = step_kinds(heavy, light)
    plans = [build_step(ctx, k, kinds[kind]) for k, kind in enumerate(plan_order(steps))]
    header = make_header(ctx, get_planner("zeppelin"), None, SamplerConfig(seed=0), len(plans))
    with PlanWriter(path, header, "jsonl") as w:
        for st in plans:
            w.write(st)


def predicted(plan_path: Path) -> list[float]:
    """Per step: simulated step + profiled optimizer step (``zeppelin run --report``'s prediction)."""
    from zeppelin.planner.sim.simulate import Simulator, context_from_header
    from zeppelin.schemas.plan import read_plan

    header, steps = read_plan(plan_path)
    ctx = context_from_header(header)
    sim = Simulator(ctx)
    opt = float(ctx.cost.optimizer_time())
    return [sim.simulate_step(s).step_time_s + opt for s in steps]


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Per mode: per kind the median measured and predicted step (warm-up left out), the coupling
    index measured and predicted, what it says, and the prediction's error per kind."""
    order = plan_order(doc["steps"])
    out = {}
    for mode in MODES:
        runs = [r for r in doc["runs"] if r["mode"] == mode]
        pred = doc["predicted_s"][mode]
        row: dict[str, Any] = {"measured_s": {}, "predicted_s": {}, "error": {}}
        for kind in KINDS:
            idx = [i for i, k in enumerate(order) if k == kind and i > 0]
            meas = [r["measured_steps_s"][i] for r in runs for i in idx]
            row["measured_s"][kind] = round(statistics.median(meas), 4)
            row["predicted_s"][kind] = round(statistics.median(pred[i] for i in idx), 4)
            row["error"][kind] = round(row["predicted_s"][kind] / row["measured_s"][kind] - 1, 4)
        for what in ("measured_s", "predicted_s"):
            c, s, d = (row[what][k] for k in KINDS)
            row["coupling_" + what.split("_")[0]] = round((c - s) / (d - s), 3) if d != s else None
        km = row["coupling_measured"]
        row["runtime_shows"] = ("sum over micro-batches of the slowest rank" if km is not None and km >= 0.5
                                else "slowest rank's sum")
        out[mode] = row
    return out


def render_markdown(doc: dict[str, Any]) -> str:
    lines = ["| mode | C measured / predicted s | S measured / predicted s | D measured / predicted s | "
             "coupling measured / predicted | the runtime shows | worst error |",
             "|---|---|---|---|---|---|---:|"]
    for mode, row in doc["summary"].items():
        cells = [f"{row['measured_s'][k]:.3f} / {row['predicted_s'][k]:.3f}" for k in KINDS]
        worst = max(abs(e) for e in row["error"].values())
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {row['coupling_measured']} / "
                     f"{row['coupling_predicted']} | {row['runtime_shows']} | {worst:.1%} |")
    return "\n".join(lines)


def run_report(zep: list[str], plan: Path, flags: list[str], tag: str, work: Path, env: dict[str, str],
               threads: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One ``zeppelin run --report-json`` of ``plan``: the report's steps, and the run's wall
    seconds and load averages before and after."""
    rep = work / f"report_{tag}.json"
    load_before = _load()
    wall = _run([*zep, "run", str(plan), "--progress", "none", "--threads", threads, *flags,
                 "--metrics", str(work / f"metrics_{tag}.jsonl"), "--report-json", str(rep)],
                work / f"run_{tag}.log", env)
    info = {"wall_s": round(wall, 1), "load_avg_before": load_before, "load_avg_after": _load()}
    return json.loads(rep.read_text())["steps"], info


def measure(args, work: Path) -> dict[str, Any]:
    from zeppelin.schemas.io.documents import load_doc
    from zeppelin.schemas.profile import CostProfile

    zep = _zeppelin_cmd()
    # each rank on its own cores, as many threads as `zeppelin profile` gives a rank (cores / ranks)
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    prof_path = args.profile
    if prof_path is None:
        prof_path = work / "profile.json"
        _run([*zep, "profile", "--quick", "--nproc", "2", "--model", args.model, "--cluster-name", CLUSTER,
              "-o", str(prof_path)], work / "profile.log", env)
    profile = load_doc(CostProfile, prof_path)
    plans = {}
    for mode, (zero, _) in MODES.items():
        plans[mode] = work / f"plan_{mode}.jsonl"
        write_plan(plans[mode], profile, args.model, zero, args.heavy, args.light, args.steps)
    runs = []
    for rnd in range(args.rounds):
        for mode, (_, flags) in MODES.items():
            steps, info = run_report(zep, plans[mode], flags, f"{mode}_r{rnd}", work, env, threads)
            runs.append({"round": rnd, "mode": mode, **info,
                         "measured_steps_s": [round(s["measured_s"]["step"], 4) for s in steps]})
            print(f"[bench_coupling] round {rnd} {mode}: {runs[-1]['measured_steps_s']}", file=sys.stderr,
                  flush=True)
    return {"machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})", "ranks": 2,
            "cluster": CLUSTER, "threads_per_rank": int(threads), "model": args.model, "heavy": args.heavy, "light": args.light,
            "steps": args.steps, "rounds": args.rounds, "profile": str(prof_path), "workdir": str(work),
            "plans": {m: str(p) for m, p in plans.items()}, "runs": runs}


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The options of a benchmark that runs saved plans in rounds and can price them again."""
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the profile, plans and reports here")
    ap.add_argument("-o", "--output", type=Path, default=None)
    ap.add_argument("--repredict", type=Path, default=None, metavar="RESULT.json",
                    help="price a result's saved plans again with the current code, measurements kept")


def write_result(doc: dict[str, Any], output: Path | None) -> None:
    """The result document as JSON: to ``output``, else to standard output."""
    text = json.dumps(doc, indent=1)
    if output is not None:
        output.write_text(text + "\n")
    else:
        print(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=None, help="reuse this profile instead of measuring one")
    ap.add_argument("--model", default="small")
    ap.add_argument("--heavy", type=int, default=2048, help="tokens of the heavy sequence")
    ap.add_argument("--light", type=int, default=128, help="tokens of the light sequence")
    ap.add_argument("--steps", type=int, default=3, help="C, S, D steps of each kind per run")
    add_run_args(ap)
    ap.add_argument("--markdown", type=Path, default=None, metavar="RESULT.json", help="print a result as a table")
    args = ap.parse_args(argv)
    if args.markdown is not None:
        print(render_markdown(json.loads(args.markdown.read_text())))
        return 0
    if args.repredict is not None:  # (plan paths relative to the result's folder)
        doc = json.loads(args.repredict.read_text())
        doc["plans"] = {m: str(args.repredict.parent / p) for m, p in doc["plans"].items()}
    else:
        work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_coupling_"))
        work.mkdir(parents=True, exist_ok=True)
        doc = measure(args, work)
    return finish(doc, {m: Path(p) for m, p in doc["plans"].items()}, summarize, render_markdown, args.output)


def finish(doc: dict[str, Any], plans: dict[str, Path], summary, render, output: Path | None) -> int:
    """Price every plan (``predicted_s``), summarize, write the result (``output`` or stdout) and
    print its table on stderr."""
    doc["predicted_s"] = {k: [round(x, 4) for x in predicted(p)] for k, p in plans.items()}
    doc["summary"] = summary(doc)
    write_result(doc, output)
    print(render(doc), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
