"""Rankings when run: does the plan the cost model ranks fastest run fastest on this machine?

On N gloo ranks of this machine (default 4, ``local-cpu:1x4``):

1. ``zeppelin profile --quick`` measures this machine with N ranks at once (``--profile FILE``
   reuses a profile instead; the cluster is the one the profile names, else ``--cluster``);
2. the same sampled steps (a long-tailed length mix, see ``bench_accuracy.write_manifest``) are
   planned in this process under that profile by zeppelin, te-cp and every other baseline of
   ``zeppelin compare``; the best other baseline is the one with the lowest predicted step time;
3. the plans of zeppelin, te-cp and the best other are written and run with ``zeppelin run
   --report-json``, interleaved (zeppelin, te-cp, best other, zeppelin, ...) for ``--rounds``
   rounds, so that load on the shared machine hits all three alike.

Per plan: the measured step time (median over rounds of each run's median step time, step 0 left
out: it warms up), the predicted one (simulated step + profiled optimizer step, the prediction
``zeppelin run --report`` makes, median over the same steps), and the ratios of te-cp's and the
best other's times to each plan's, measured (median of the per-round ratios) and predicted; whether
the predicted winner is the measured winner; the spread of each plan's per-round times and the load
average around every run. JSON on stdout (or ``-o``), a table on stderr.

    python benchmarks/bench_rankings.py [--ranks 4] [--profile FILE] [--rounds 3] [--steps 4] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# the helpers of bench_accuracy (running commands, load average, the length-mix manifest)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_accuracy import _load, _run, _zeppelin_cmd, write_manifest

REFERENCE = "te-cp"
# the ratios a plan's agreement is judged on: measured / predicted - 1 within this
TARGET_AGREEMENT = 0.10


def candidate_planners() -> list[str]:
    """``zeppelin compare``'s planners, without zeppelin's ablations."""
    from zeppelin.planner.tools.compare import DEFAULT_PLANNERS

    return [p for p in DEFAULT_PLANNERS if p == "zeppelin" or not p.startswith("zeppelin")]


def plan_candidates(ctx, step_seqs: list[list], planners: list[str]) -> dict[str, dict[str, Any]]:
    """Plan and simulate every step with every planner (``zeppelin compare``'s jobs). Per planner:
    its step plans and per step the predicted step time (simulated step + profiled optimizer step,
    as ``zeppelin run --report`` predicts it), or the error that stopped it."""
    from zeppelin.planner.tools.compare import run_compare

    keep = {(p, k) for p in planners for k in range(len(step_seqs))}
    opt = ctx.cost.optimizer_time()
    out = {}
    for run in run_compare(ctx, step_seqs, planners, keep=keep):
        if run.error is not None:
            out[run.planner] = {"error": run.error}
        else:
            out[run.planner] = {"plans": [run.plans[k] for k in range(len(step_seqs))],
                                "predicted_steps_s": [t + opt for t in run.step_times]}
    return out


def predicted_time(steps_s: list[float], skip_first: bool = True) -> float:
    """The statistic measured runs are judged by: the median step time without step 0."""
    xs = steps_s[1:] if skip_first and len(steps_s) > 1 else steps_s
    return statistics.median(xs)


def pick_best_other(candidates: dict[str, dict[str, Any]]) -> str:
    """The baseline other than te-cp with the lowest predicted step time."""
    others = {p: predicted_time(c["predicted_steps_s"]) for p, c in candidates.items()
              if "error" not in c and p != REFERENCE and not p.startswith("zeppelin")}
    if not others:
        raise SystemExit("bench_rankings: no baseline other than te-cp planned these steps")
    return min(others, key=lambda p: (others[p], p))


def write_plans(ctx, dataset, sampler_cfg, candidates: dict, names: list[str], workdir: Path) -> dict[str, Path]:
    """The plan files of ``names``: headers as ``zeppelin plan`` writes them, the steps planned above."""
    from zeppelin.planner.core.base import get_planner
    from zeppelin.planner.core.driver import make_header
    from zeppelin.schemas.plan import PlanWriter

    paths = {}
    for name in names:
        plans = candidates[name]["plans"]
        header = make_header(ctx, get_planner(name), dataset, sampler_cfg, len(plans))
        paths[name] = workdir / f"plan_{name}.jsonl"
        with PlanWriter(paths[name], header, "jsonl") as w:
            for st in plans:
                w.write(st)
    return paths


def run_step_times(report: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Measured and predicted step times of a ``zeppelin run --report-json`` report, step 0 excluded
    when the run has more steps."""
    rows = [r for r in report["steps"] if not r["first"]] or report["steps"]
    return [r["measured_s"]["step"] for r in rows], [r["predicted_s"]["step"] for r in rows]


def summarize(names: list[str], best_other: str, predicted_s: dict[str, list[float]],
              rounds: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Per plan the measured (median over rounds of each round's median step) and predicted step
    times, and for each of te-cp and the best other the ratio of its time to the plan's: measured
    (median of the per-round ratios; also the ratio of the medians) and predicted. ``rounds``: per
    round, per plan, the measured step times (step 0 left out)."""
    per_round = [{n: statistics.median(r[n]) for n in names} for r in rounds]
    pred = {n: predicted_time(predicted_s[n]) for n in names}
    meas = {n: statistics.median(r[n] for r in per_round) for n in names}
    plans: dict[str, Any] = {}
    for n in names:
        row = {"measured_step_s": meas[n], "predicted_step_s": pred[n], "predicted_steps_s": list(predicted_s[n]),
               "measured_rounds_s": [r[n] for r in per_round], "fastest_round_s": min(r[n] for r in per_round),
               # run-to-run spread of this plan: (slowest round - fastest round) / median
               "round_spread": (max(r[n] for r in per_round) - min(r[n] for r in per_round)) / meas[n],
               "prediction_rel_error": (pred[n] - meas[n]) / meas[n], "ratios": {}}
        for ref in (REFERENCE, best_other):
            if ref == n:
                continue
            m = statistics.median(r[ref] / r[n] for r in per_round)
            p = pred[ref] / pred[n]
            # load from other jobs only ever adds time: the fastest rounds are the least disturbed
            fastest = min(r[ref] for r in per_round) / min(r[n] for r in per_round)
            row["ratios"][ref] = {"measured": m, "measured_of_medians": meas[ref] / meas[n],
                                  "measured_of_fastest_rounds": fastest, "predicted": p, "agreement": m / p - 1.0}
        plans[n] = row
    pw = min(names, key=lambda n: pred[n])
    mw = min(names, key=lambda n: meas[n])
    z = plans.get("zeppelin", {}).get("ratios", {})
    agree = [abs(v["agreement"]) for v in z.values()]
    return {"plans": plans, "predicted_winner": pw, "measured_winner": mw, "winner_holds": pw == mw,
            "zeppelin_worst_agreement": max(agree) if agree else None,
            "target": {"agreement_within": TARGET_AGREEMENT,
                       "holds": pw == mw and bool(agree) and max(agree) <= TARGET_AGREEMENT}}


def _ratio_cells(row: dict[str, Any], best: str) -> list[str]:
    """"measured / fastest rounds / predicted" of a plan's ratios over te-cp and the best other."""
    cells = []
    for ref in (REFERENCE, best):
        r = row["ratios"].get(ref)
        cells.append(f"{r['measured']:.3f} / {r['measured_of_fastest_rounds']:.3f} / {r['predicted']:.3f}"
                     if r else "-")
    return cells


def render(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    best = doc["best_other"]
    lines = [(f"rankings when run: {doc['ranks']} ranks ({doc['cluster']}), model {doc['model']}, {doc['rounds']} "
              f"rounds x {doc['steps']} steps, load {doc['load_avg_start']} -> {doc['load_avg_end']}"),
             (f"{'plan':<14}{'measured s':>11}{'predicted s':>12}{'spread':>8}"
              f"{'vs te-cp meas/fastest/pred':>28}{'vs ' + best + ' meas/fastest/pred':>32}")]
    for n, row in s["plans"].items():
        cells = _ratio_cells(row, best)
        lines.append(f"{n:<14}{row['measured_step_s']:>11.3f}{row['predicted_step_s']:>12.3f}"
                     f"{row['round_spread']:>8.1%}{cells[0]:>28}{cells[1]:>32}")
    lines.append(f"predicted winner {s['predicted_winner']}, measured winner {s['measured_winner']}; "
                 f"target (winner holds, zeppelin's ratios within {TARGET_AGREEMENT:.0%}): "
                 f"{'holds' if s['target']['holds'] else 'missed'}")
    return "\n".join(lines)


def render_markdown(doc: dict[str, Any]) -> str:
    """The table of docs/BENCHMARKS.md, "Rankings when run", from a result document."""
    s = doc["summary"]
    best = doc["best_other"]
    lines = [(f"| ranks | plan | measured step (median s) | per-round median s | spread | predicted step s "
              f"| vs te-cp measured / fastest rounds / predicted | vs {best} measured / fastest rounds / predicted "
              f"| load avg (1 min) during runs |"),
             "|---|---|---:|---|---:|---:|---|---|---|"]
    for n, row in s["plans"].items():
        cells = _ratio_cells(row, best)
        loads = [x["load_avg_before"][0] for x in doc["runs"] if x["plan"] == n and x["load_avg_before"]]
        lines.append(f"| {doc['ranks']} | {n} | {row['measured_step_s']:.3f} | "
                     f"{' / '.join(f'{x:.2f}' for x in row['measured_rounds_s'])} | {row['round_spread']:.0%} | "
                     f"{row['predicted_step_s']:.3f} | {cells[0]} | {cells[1]} | "
                     f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} |")
    return "\n".join(lines)


def _cluster_name(profile, given: str | None, ranks: int) -> str:
    if given:
        return given
    if profile.cluster.startswith("local-cpu:"):
        return profile.cluster
    return f"local-cpu:1x{ranks}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=1, help="'nodes' the ranks form when this run profiles")
    ap.add_argument("--profile", type=Path, default=None, help="reuse this profile instead of measuring one")
    ap.add_argument("--cluster", default=None,
                    help="cluster preset (default: the one the profile names, else local-cpu:NODESxRANKS/NODES)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--mix", default="mixed", help="length mix of `zeppelin compare` (short, mixed, long)")
    ap.add_argument("--scale", type=float, default=20.0, help="divide the mix's median lengths by this")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--tokens-per-rank", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4, help="steps per run (step 0 warms up and is left out)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--planners", nargs="+", default=None, help="planners to choose the best other from")
    ap.add_argument("--workdir", type=Path, default=None, help="keep profile, plans, reports here")
    ap.add_argument("-o", "--output", type=Path, default=None, help="write the JSON here (default: stdout)")
    ap.add_argument("--markdown", type=Path, default=None,
                    help="print the docs/BENCHMARKS.md table of this earlier result JSON and exit")
    args = ap.parse_args(argv)
    if args.markdown is not None:
        print(render_markdown(json.loads(args.markdown.read_text())))
        return 0
    if args.ranks < 2 or args.ranks % args.nodes:
        raise SystemExit("bench_rankings: --ranks must be >= 2 and a multiple of --nodes")

    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.core.sampler import run_max_seq_len, sample_steps
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.io.datasets import load_manifest
    from zeppelin.schemas.io.documents import load_doc
    from zeppelin.schemas.model import model_preset
    from zeppelin.schemas.plan import SamplerConfig
    from zeppelin.schemas.profile import CostProfile

    work = args.workdir or Path(tempfile.mkdtemp(prefix="zeppelin-rankings-"))
    work.mkdir(parents=True, exist_ok=True)
    zep = _zeppelin_cmd()
    # profile and run with the same threads per rank: CPU kernel times depend on how many
    # processes share the cores
    threads = max(1, (os.cpu_count() or 1) // args.ranks)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    load_start = _load()
    prof_path, prof_wall = args.profile, None
    if prof_path is None:
        prof_path = work / f"profile_{args.ranks}.json"
        prof_wall = _run([*zep, "profile", "--quick", "--nproc", str(args.ranks), "--nodes", str(args.nodes),
                          "--model", args.model, "--cluster-name",
                          args.cluster or f"local-cpu:{args.nodes}x{args.ranks // args.nodes}", "-o", str(prof_path)],
                         work / "profile.log", env)
        print(f"[bench_rankings] profiled {args.ranks} ranks in {prof_wall:.0f} s", file=sys.stderr, flush=True)
    profile = load_doc(CostProfile, prof_path)
    cluster_name = _cluster_name(profile, args.cluster, args.ranks)
    cluster = cluster_preset(cluster_name)
    if cluster.world_size != args.ranks:
        raise SystemExit(f"bench_rankings: cluster {cluster_name} has {cluster.world_size} ranks, not --ranks "
                         f"{args.ranks}")
    model = model_preset(args.model)
    man = work / f"{args.mix}.jsonl"
    mstats = write_manifest(man, args.mix, args.scale, args.max_seq_len, 2000, args.seed)
    ds = load_manifest(man)
    cfg = SamplerConfig(tokens_per_step=args.tokens_per_rank * args.ranks, shuffle=True, seed=args.seed,
                        max_seq_len=args.max_seq_len)
    ctx = PlanContext(cluster, model, profile, seed=args.seed)
    ctx.max_seq_len = run_max_seq_len(ds, cfg)
    step_seqs = sample_steps(ds, cfg, args.steps)
    planners = args.planners or candidate_planners()
    for must in ("zeppelin", REFERENCE):
        if must not in planners:
            planners = [must, *planners]
    t0 = time.perf_counter()
    cands = plan_candidates(ctx, step_seqs, planners)
    for must in ("zeppelin", REFERENCE):
        if "error" in cands[must]:
            raise SystemExit(f"bench_rankings: {must} failed to plan: {cands[must]['error']}")
    best = pick_best_other(cands)
    names = ["zeppelin", REFERENCE, best]
    paths = write_plans(ctx, ds, cfg, cands, names, work)
    print(f"[bench_rankings] planned {len(planners)} planners x {args.steps} steps in "
          f"{time.perf_counter() - t0:.0f} s; best other: {best}", file=sys.stderr, flush=True)

    runs, rounds = [], []
    for rnd in range(args.rounds):
        measured = {}
        for n in names:
            tag = f"{n}_r{rnd}"
            rep_path = work / f"report_{tag}.json"
            load_before = _load()
            wall = _run([*zep, "run", str(paths[n]), "--progress", "none", "--threads", str(threads),
                         "--metrics", str(work / f"metrics_{tag}.jsonl"), "--report-json", str(rep_path)],
                        work / f"run_{tag}.log", env)
            load_after = _load()
            meas, pred = run_step_times(json.loads(rep_path.read_text()))
            measured[n] = meas
            runs.append({"round": rnd, "plan": n, "measured_steps_s": [round(x, 4) for x in meas],
                         "report_predicted_steps_s": [round(x, 4) for x in pred],
                         "load_avg_before": load_before, "load_avg_after": load_after, "wall_s": round(wall, 1)})
            print(f"[bench_rankings] round {rnd} {n}: median step {statistics.median(meas):.3f} s "
                  f"(load {load_after})", file=sys.stderr, flush=True)
        rounds.append(measured)

    summary = summarize(names, best, {n: cands[n]["predicted_steps_s"] for n in names}, rounds)
    doc = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
        "ranks": args.ranks, "cluster": cluster_name, "threads_per_rank": threads,
        # above 1 the ranks share cores: a rank that waits gives its core to one that computes,
        # which no profile taken with every rank busy can price
        "ranks_per_core": args.ranks / (os.cpu_count() or 1), "model": args.model,
        "mix": args.mix, "scale": args.scale, "max_seq_len": args.max_seq_len,
        "tokens_per_step": cfg.tokens_per_step, "steps": args.steps, "rounds": args.rounds, "seed": args.seed,
        "manifest": mstats,
        "step_lengths": [sorted((s.length for s in seqs), reverse=True) for seqs in step_seqs],
        "profile": str(prof_path), "profile_wall_s": None if prof_wall is None else round(prof_wall, 1),
        "candidates_predicted_step_s": {p: (c["error"] if "error" in c else predicted_time(c["predicted_steps_s"]))
                                        for p, c in cands.items()},
        "best_other": best,
        "load_avg_start": load_start, "load_avg_end": _load(),
        "summary": summary, "runs": runs, "workdir": str(work),
    }
    print(render(doc), file=sys.stderr)
    text = json.dumps(doc, indent=1) + "\n"
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
