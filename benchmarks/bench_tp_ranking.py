"""Tensor-parallel units at their cost, as the runtime runs them: is a plan of TP-2 units ranked
against its TP-1 alternative (the same steps, one unit per rank) as the prediction ranks it?

On N gloo ranks of this machine (``local-cpu:1xN``, default 2: one rank per core), the same steps
of a fixed length mix are planned by zeppelin twice, with ``--tp 2`` (TP-2 units: TP-SP
collectives around every linear, rings over TP units exchanging each rank's head share) and with
``--tp 1``, under a ``zeppelin profile --quick`` of this machine taken just before (it measures
the TP-2 layer with each ``--tp-overlap`` mode's collectives) or ``--profile FILE``. Both plans run
through ``zeppelin run --report-json``, interleaved for ``--rounds`` rounds. Per plan: the measured
step (median over the rounds' steps, step 0 left out) and the predicted one (simulated step +
profiled optimizer step, what ``zeppelin run --report`` predicts); the TP-2 / TP-1 ratio measured
and predicted, and whether the faster plan measured is the one predicted faster. ``--repredict
RESULT.json`` prices a result's saved plans again with the current code, measurements kept.

    python benchmarks/bench_tp_ranking.py [--ranks 2] [--profile FILE] [--rounds 3] [-o RESULT.json]
    python benchmarks/bench_tp_ranking.py --repredict benchmarks/data/tp_ranking/result.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_accuracy import _load, _run, _zeppelin_cmd
from bench_coupling import finish

#: the steps' sequence lengths (one step of each line), whole on a rank or split over a TP unit
LENGTHS = ([512, 256, 128, 64, 64], [384, 384, 128, 128], [1024], [256] * 4)
TP_DEGREES = (2, 1)
#: every candidate family but replicas of a larger TP degree: each plan keeps its own TP degree, so
#: the TP-1 plan is the pure alternative of the TP-2 one
FAMILIES = "ulysses-groups,flop-share,wide-rings,usp-groups"


def write_manifest(path: Path) -> int:
    """One manifest line per sequence; returns the tokens of the largest step."""
    path.write_text("".join(json.dumps({"length": n}) + "\n" for step in LENGTHS for n in step))
    return max(sum(step) for step in LENGTHS)


def plan(zep: list[str], work: Path, profile: Path, cluster: str, model: str, tp: int, steps: int,
         env: dict[str, str]) -> Path:
    out = work / f"plan_tp{tp}.jsonl"
    tokens = write_manifest(work / "m.jsonl")
    _run([*zep, "plan", "-m", str(work / "m.jsonl"), "-c", cluster, "--model", model, "--tp", str(tp),
          "--profile", str(profile), "--steps", str(steps), "--tokens-per-step", str(tokens), "--seed", "0",
          "--families", FAMILIES, "-q", "-o", str(out)], work / f"plan_tp{tp}.log", env)
    return out


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Per plan the median measured and predicted step (step 0 left out); the TP-2 / TP-1 ratios
    and whether the rankings agree."""
    out: dict[str, Any] = {}
    for tp in map(str, TP_DEGREES):
        meas = [s for r in doc["runs"] if r["tp"] == int(tp) for s in r["measured_steps_s"][1:]]
        pred = doc["predicted_s"][tp][1:]
        out[tp] = {"measured_s": round(statistics.median(meas), 4), "predicted_s": round(statistics.median(pred), 4)}
        out[tp]["error"] = round(out[tp]["predicted_s"] / out[tp]["measured_s"] - 1, 4)
    a, b = (str(t) for t in TP_DEGREES)
    ratio_m = out[a]["measured_s"] / out[b]["measured_s"]
    ratio_p = out[a]["predicted_s"] / out[b]["predicted_s"]
    out["ratio_measured"], out["ratio_predicted"] = round(ratio_m, 3), round(ratio_p, 3)
    out["same_ranking"] = (ratio_m > 1) == (ratio_p > 1)
    return out


def render_markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    lines = ["| plan | measured s | predicted s | error |", "|---|---:|---:|---:|"]
    for tp in map(str, TP_DEGREES):
        lines.append(f"| TP-{tp} units | {s[tp]['measured_s']:.3f} | {s[tp]['predicted_s']:.3f} | {s[tp]['error']:+.1%} |")
    lines.append(f"\nTP-2 / TP-1: measured {s['ratio_measured']}, predicted {s['ratio_predicted']}; "
                 f"same ranking: {'yes' if s['same_ranking'] else 'NO'}")
    return "\n".join(lines)


def measure(args, work: Path) -> dict[str, Any]:
    zep = _zeppelin_cmd()
    cluster = f"local-cpu:1x{args.ranks}"
    threads = str(max(1, (os.cpu_count() or 2) // args.ranks))
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    prof = work / "profile.json"
    if args.profile is None:
        _run([*zep, "profile", "--quick", "--nproc", str(args.ranks), "--model", args.model, "--cluster-name",
              cluster, "-o", str(prof)], work / "profile.log", env)
    else:
        shutil.copyfile(args.profile, prof)
    steps = len(LENGTHS)
    plans = {str(tp): plan(zep, work, prof, cluster, args.model, tp, steps, env) for tp in TP_DEGREES}
    runs = []
    for rnd in range(args.rounds):
        for tp in TP_DEGREES:
            rep = work / f"report_tp{tp}_r{rnd}.json"
            load = _load()
            _run([*zep, "run", str(plans[str(tp)]), "--progress", "none", "--threads", threads,
                  "--report-json", str(rep)], work / f"run_tp{tp}_r{rnd}.log", env)
            rows = json.loads(rep.read_text())["steps"]
            runs.append({"round": rnd, "tp": tp, "load_avg_before": load, "load_avg_after": _load(),
                         "measured_steps_s": [round(r["measured_s"]["step"], 4) for r in rows]})
            print(f"[bench_tp_ranking] round {rnd} tp {tp}: {runs[-1]['measured_steps_s']}", file=sys.stderr, flush=True)
    return {"machine": f"{platform.node()} ({os.cpu_count()} CPUs, {platform.machine()})", "ranks": args.ranks,
            "cluster": cluster, "model": args.model, "threads_per_rank": int(threads), "rounds": args.rounds,
            "lengths": [list(s) for s in LENGTHS], "profile": prof.name,
            "plans": {tp: p.name for tp, p in plans.items()}, "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--profile", type=Path, default=None, help="reuse this profile instead of measuring one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="keep profile, plans and reports here")
    ap.add_argument("-o", "--output", type=Path, default=None)
    ap.add_argument("--repredict", type=Path, default=None, metavar="RESULT.json",
                    help="price a result's saved plans again with the current code (plans beside it)")
    args = ap.parse_args(argv)
    if args.repredict is not None:
        doc, work = json.loads(args.repredict.read_text()), args.repredict.parent
    else:
        work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_tp_ranking_"))
        work.mkdir(parents=True, exist_ok=True)
        doc = measure(args, work)
    return finish(doc, {tp: work / p for tp, p in doc["plans"].items()}, summarize, render_markdown, args.output)


if __name__ == "__main__":
    sys.exit(main())
