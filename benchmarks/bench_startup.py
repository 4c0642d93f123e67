"""Where `zeppelin run`'s seconds before the first step go: a tiny Hugging Face Llama on 4 CPU ranks.

Builds a transformers Llama directory (2 layers, hidden 64), plans 3 steps for ``local-cpu:1x4``,
and runs ``zeppelin run PLAN --model hf:DIR`` ``--repeats`` times with ``ZEPPELIN_STARTUP_TRACE``
set (:mod:`zeppelin.runtime.startup`). Per run: the start-up phases of rank 0 (launch: from the
``zeppelin`` command's start to the rank's first line, i.e. CLI imports, plan checks, the launcher
and the interpreter; imports; start-up checks; rendezvous; plan scan and process groups; model
build), the first step (one-time warm-up included) and the second. Prints one JSON object: every
run and the medians::

    .venv/bin/python benchmarks/bench_startup.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")


def make_hf_llama(path: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    return path


def one_run(plan: Path, ref: str, trace: Path) -> dict:
    env = dict(os.environ, ZEPPELIN_STARTUP_TRACE=str(trace))
    t = time.time()
    p = subprocess.run([ZEPPELIN, "run", str(plan), "--model", ref, "--progress", "none"], capture_output=True,
                       text=True, env=env, timeout=600)
    wall = time.time() - t
    if p.returncode != 0:
        raise SystemExit(f"zeppelin run failed: {p.stderr[-2000:]}")
    d = json.loads(trace.read_text())
    m = d["marks"]
    out = dict(d["phases_s"])
    out["to_ready_s"] = sum(d["phases_s"].values())
    out["first_step_s"] = m["step1"] - m["model"]
    out["second_step_s"] = m["step2"] - m["step1"]
    out["to_first_step_end_s"] = m["step1"] - d["t0"]
    out["wall_s"] = wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="zeppelin-startup-") as tmp:
        d = Path(tmp)
        ref = f"hf:{make_hf_llama(d / 'llama')}"
        man = d / "m.jsonl"
        man.write_text("".join(json.dumps({"length": n}) + "\n" for n in [300, 13, 90, 7, 33, 64, 21, 5] * 8))
        plan = d / "p.plan"
        subprocess.run([ZEPPELIN, "plan", "-m", str(man), "-c", "local-cpu:1x4", "--model", ref, "--steps", "3",
                        "--tokens-per-step", "1024", "-q", "-o", str(plan)], check=True)
        runs = [one_run(plan, ref, d / f"trace{i}.json") for i in range(args.repeats)]
    keys = list(runs[0])
    print(json.dumps({"bench": "startup", "label": args.label, "ranks": 4, "model": "hf tiny llama",
                      "repeats": args.repeats, "cpus": os.cpu_count(),
                      "load_avg_1min": os.getloadavg()[0],
                      "median": {k: round(statistics.median(r[k] for r in runs), 3) for k in keys},
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
