"""Prediction accuracy end to end: ``zeppelin profile`` -> ``plan --profile`` -> ``run --report``.

For each rank count (default 2 and 4 gloo processes on this machine, ``local-cpu:1xN``):

1. ``zeppelin profile --quick --nproc N --model M`` measures this machine with N ranks at once;
2. for each length mix (short-heavy, mixed, long-heavy: the shapes of ``zeppelin compare``'s
   synthetic mixes, log-normal components with medians divided by ``--scale`` so that a CPU step
   takes seconds, clipped to [16, ``--max-seq-len``]) a manifest is written and
   ``zeppelin plan --profile`` plans ``--steps`` steps of ``--tokens-per-rank`` x N tokens;
3. ``zeppelin run --report-json`` executes them with the same N ranks (and the same threads per
   rank as the profile) and predicts every step with the simulator under the measured profile.

Prints one JSON document: per (ranks, mix) the median / worst / mean relative error of the
predicted step time (all steps, and without the run's first step), the per-step measured and
predicted times, and the load average of the machine before and after each run.

    python benchmarks/bench_accuracy.py [--ranks 2 4] [--model small] [--steps 4] [--intra auto|ring] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _zeppelin_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "zeppelin"
    found = str(exe) if exe.exists() else shutil.which("zeppelin")
    if not found:
        raise SystemExit("bench_accuracy: the `zeppelin` command is not installed (pip install -e .)")
    return [found]


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _run(cmd: list[str], log: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    with log.open("w") as fh:
        p = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, text=True)
    if p.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"bench_accuracy: `{' '.join(cmd)}` failed with exit code {p.returncode}:\n{tail}")
    return time.perf_counter() - t0


def write_manifest(path: Path, mix: str, scale: float, max_len: int, num: int, seed: int) -> dict:
    import numpy as np

    from zeppelin.planner.tools.compare import MIXES

    rng = np.random.default_rng(seed)
    comps = MIXES[mix]
    which = rng.choice(len(comps), size=num, p=[c[0] for c in comps])
    med = np.array([c[1] for c in comps])[which] / scale
    sig = np.array([c[2] for c in comps])[which]
    lengths = np.clip(np.exp(np.log(med) + sig * rng.standard_normal(num)), 16, max_len).astype(np.int64)
    with path.open("w") as fh:
        for L in lengths:
            fh.write(json.dumps({"length": int(L)}) + "\n")
    return {"samples": num, "median_length": float(np.median(lengths)), "mean_length": float(lengths.mean()),
            "max_length": int(lengths.max())}


def _with_second_profile(row: dict, profile_path: Path) -> None:
    """Predict the row's steps again with a profile taken after the runs: the relative error
    against the measurements, and the drift between the two profiles' predictions."""
    from zeppelin.planner.sim.report import build_report, error_summary, load_metrics
    from zeppelin.schemas.io.documents import load_doc
    from zeppelin.schemas.plan import PlanReader
    from zeppelin.schemas.profile import CostProfile

    reader = PlanReader(row["_plan"])
    header = reader.header.model_copy(update={"profile": load_doc(CostProfile, profile_path)})
    recs = load_metrics(row["_metrics"])
    rep = build_report(header, {int(r["step"]): reader.step(int(r["step"])) for r in recs}, recs)
    s = rep["summary"]["step"]
    row["profile_after"] = {"median_rel_error": s["median_abs"], "worst_rel_error": s["worst_abs"],
                            "mean_rel_error": s["mean"]}
    pairs = zip(row["steps"], rep["steps"], strict=True)
    drift = [b["predicted_s"]["step"] / a["predicted_s"] - 1.0 for a, b in pairs]
    row["profile_drift"] = error_summary(drift)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mixes", nargs="+", default=["short", "mixed", "long"])
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens-per-rank", type=int, default=2048)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--scale", type=float, default=20.0, help="divide the mixes' median lengths by this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--intra", default="auto", choices=["auto", "ring"],
                    help="passed to `zeppelin plan --intra` (how a sequence split inside a node runs)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep profiles, plans, metrics here")
    args = ap.parse_args(argv)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="zeppelin-accuracy-"))
    work.mkdir(parents=True, exist_ok=True)
    zep = _zeppelin_cmd()
    result: dict = {"machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})",
                    "model": args.model, "steps": args.steps, "tokens_per_rank": args.tokens_per_rank,
                    "max_seq_len": args.max_seq_len, "scale": args.scale, "intra": args.intra, "workdir": str(work),
                    "runs": []}
    for R in args.ranks:
        # profile and run with the same ranks and threads per rank: CPU kernel times depend on how
        # many processes share the cores
        threads = max(1, (os.cpu_count() or 1) // R)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        prof = work / f"profile_{R}.json"
        load0 = _load()
        t_prof = _run([*zep, "profile", "--quick", "--nproc", str(R), "--model", args.model, "-o", str(prof)],
                      work / f"profile_{R}.log", env)
        print(f"[bench_accuracy] profiled {R} ranks in {t_prof:.0f} s (load {load0})", file=sys.stderr,
              flush=True)
        for mix in args.mixes:
            man = work / f"{mix}.jsonl"
            mstats = write_manifest(man, mix, args.scale, args.max_seq_len, 2000, args.seed)
            plan = work / f"plan_{R}_{mix}.jsonl"
            _run([*zep, "plan", "--cluster", f"local-cpu:1x{R}", "--model", args.model,
                  "--profile", str(prof), "--manifest", str(man),
                  "--tokens-per-step", str(args.tokens_per_rank * R), "--max-seq-len", str(args.max_seq_len),
                  "--steps", str(args.steps), "--seed", str(args.seed), "--intra", args.intra, "-q", "-o", str(plan)],
                 work / f"plan_{R}_{mix}.log", env)
            rep_path = work / f"report_{R}_{mix}.json"
            load_before = _load()
            t_run = _run([*zep, "run", str(plan), "--progress", "none", "--threads", str(threads),
                          "--metrics", str(work / f"metrics_{R}_{mix}.jsonl"),
                          "--report-json", str(rep_path)],
                         work / f"run_{R}_{mix}.log", env)
            load_after = _load()
            rep = json.loads(rep_path.read_text())
            s, s1 = rep["summary"]["step"], rep["summary"]["step_after_first"]
            row = {
                "ranks": R, "mix": mix, "manifest": mstats,
                "median_rel_error": s["median_abs"], "worst_rel_error": s["worst_abs"],
                "mean_rel_error": s["mean"],
                "median_rel_error_after_first": s1["median_abs"],
                "worst_rel_error_after_first": s1["worst_abs"],
                "phase_median_rel_error": {k: v["median_abs"] for k, v in rep["summary"]["phases"].items()},
                "steps": [{"step": r["step"], "measured_s": round(r["measured_s"]["step"], 4),
                           "predicted_s": round(r["predicted_s"]["step"], 4),
                           "rel_error": round(r["rel_error"]["step"], 4),
                           "plan_estimate_s": r["plan_prediction_s"]} for r in rep["steps"]],
                "load_avg_before": load_before, "load_avg_after": load_after, "run_wall_s": round(t_run, 1),
            }
            row["_plan"], row["_metrics"] = str(plan), str(work / f"metrics_{R}_{mix}.jsonl")
            result["runs"].append(row)
            print(f"[bench_accuracy] {R} ranks, {mix}: median {s['median_abs']:.1%}, "
                  f"worst {s['worst_abs']:.1%} (load {load_after})", file=sys.stderr, flush=True)
        # the noise floor: profile again after the runs and predict the same steps with it. On a
        # shared machine the two profiles differ by how much the machine's speed drifted.
        prof2 = work / f"profile_{R}_after.json"
        _run([*zep, "profile", "--quick", "--nproc", str(R), "--model", args.model, "-o", str(prof2)],
             work / f"profile_{R}_after.log", env)
        for row in result["runs"]:
            if row["ranks"] == R:
                _with_second_profile(row, prof2)
    for row in result["runs"]:
        row.pop("_plan", None)
        row.pop("_metrics", None)
    errs = [r["median_rel_error"] for r in result["runs"]]
    result["median_of_medians"] = statistics.median(errs) if errs else None
    result["worst_of_worst"] = max((r["worst_rel_error"] for r in result["runs"]), default=None)
    # per (ranks, mix): [median, worst] relative error of the predicted step time, and the median
    # drift between the predictions of the profiles taken before and after the runs
    result["table"] = {f"{r['ranks']}x{r['mix']}": [round(r["median_rel_error"], 4),
                                                    round(r["worst_rel_error"], 4),
                                                    round(r["profile_drift"]["median_abs"], 4)]
                       for r in result["runs"]}
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
