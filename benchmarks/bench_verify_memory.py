"""Memory of `zeppelin run --verify`: rank 0's peak with the single-process reference vs a rank's
peak without it, on the same plan step.

For each case: plan one step with `zeppelin plan`, run it once without and once with `--verify`,
and read the per-step ``peak_memory_bytes`` of every rank from the metrics files (on CPU the step's
own RSS high-water mark, reset at the start of each step: runtime/memory.py). The acceptance of
``--verify`` is ``ratio <= 2`` (rank 0 with verify / the largest rank without).

    python benchmarks/bench_verify_memory.py [--cases repro,short-heavy-8] [--timeout 2]

Prints one JSON object: per case the plan command, peaks (bytes) per rank, wall times, ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")

CASES = {
    # the repro of issue 17: 2 ranks, te-cp, 8,192 tokens, sequences up to 4,096
    "repro": ["-c", "local-cpu:1x2", "--model", "small", "--steps", "1", "--tokens-per-step", "8192",
              "--max-seq-len", "4096", "--planner", "te-cp", "--seed", "0"],
    # a short-heavy step on 8 ranks: 16,384 tokens, sequences up to 8,192 (zeppelin's planner)
    "short-heavy-8": ["-c", "local-cpu:1x8", "--model", "small", "--steps", "1", "--tokens-per-step", "16384",
                      "--max-seq-len", "8192", "--planner", "zeppelin", "--seed", "0"],
}


def _run(plan: Path, metrics: Path, verify: bool, timeout: float) -> dict:
    cmd = [ZEPPELIN, "run", str(plan), "--metrics", str(metrics), "--progress", "none", "--timeout", str(timeout)]
    if verify:
        cmd.append("--verify")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"ok": False, "rc": p.returncode, "stderr_tail": p.stderr.strip().splitlines()[-3:], "wall_s": wall}
    rec = json.loads(metrics.read_text().splitlines()[-1])
    out = {"ok": True, "wall_s": round(wall, 2), "peak_memory_bytes": rec["peak_memory_bytes"],
           "step_time_s": rec["step_time_s"]}
    if verify:
        out["verify"] = {k: rec["verify"][k] for k in ("loss_rel", "hidden_rel", "grad_rel", "ok")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="repro,short-heavy-8")
    ap.add_argument("--timeout", type=float, default=120.0, help="--timeout of the runs (the repro uses 2)")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        for name in args.cases.split(","):
            plan = Path(tmp) / f"{name}.jsonl"
            pcmd = [ZEPPELIN, "plan", *CASES[name], "-o", str(plan), "-q"]
            subprocess.run(pcmd, check=True, capture_output=True)
            timeout = 2.0 if name == "repro" else args.timeout
            plain = _run(plan, Path(tmp) / f"{name}.plain.jsonl", False, timeout)
            ver = _run(plan, Path(tmp) / f"{name}.verify.jsonl", True, timeout)
            res = {"plan": "zeppelin plan " + " ".join(CASES[name]), "timeout_s": timeout,
                   "without_verify": plain, "with_verify": ver}
            if plain.get("ok") and ver.get("ok"):
                base = max(plain["peak_memory_bytes"])
                res["rank0_verify_peak_bytes"] = ver["peak_memory_bytes"][0]
                res["max_rank_peak_without_verify_bytes"] = base
                res["ratio"] = round(ver["peak_memory_bytes"][0] / base, 3)
            results[name] = res
            print(json.dumps({name: res}), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
