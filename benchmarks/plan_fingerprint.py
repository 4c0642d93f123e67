"""Fingerprint of what the planner produces: plan bytes, predicted and simulated step times.

Plans a fixed set of steps with every planner on a few fixed settings through the ``zeppelin``
command line (so the fingerprint does not depend on module paths), simulates each plan, and prints
one JSON object::

    {"cases": {"<setting>/<planner>": {"plan_sha256": ..., "predicted_s": [...],
                                         "simulated_s": [...], "lower_bound_s": [...]}, ...}}

The plan digest covers every record of the plan file except the checkout's location (the
manifest's ``path``; ``created_at`` and solver ``time_s``, which older plans carried, are left out
too). Plans are deterministic - every solver stops at node / iteration limits, never at a clock - so
every planner is fingerprinted, FlexSP and Hydraulis with their MILPs and zeppelin with its ILP
(``--ilp auto``, the default).
``tests/project/test_plan_fingerprint.py`` compares the output with the values recorded in
``tests/data/plan_fingerprints.json``; a change that alters plans on purpose re-records them with

    python benchmarks/plan_fingerprint.py -o tests/data/plan_fingerprints.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

from zeppelin.planner.cli import main as zeppelin

PLANNERS = ["zeppelin", "zeppelin-no-routing", "zeppelin-no-remap", "zeppelin-tiers-only", "packed-dp", "te-cp", "te-cp-tuned",
            "llama3-cp", "ulysses", "hybrid-dp", "megatron-dcp", "flexsp", "hydraulis"]

SETTINGS = {
    "cpu2x2-tiny": ["-c", "local-cpu:2x2", "--model", "tiny", "--steps", "2", "--tokens-per-step", "16384",
                    "--max-seq-len", "4096"],
    "a16-llama7b": ["-c", "zeppelin-a:2", "--model", "llama-7b", "--steps", "2", "--tokens-per-step", "131072",
                    "--max-seq-len", "7680"],
}

SKIP: set[tuple[str, str]] = set()  # (setting, planner) pairs left out (none: every plan is deterministic)


def _cli(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            zeppelin(argv)
        except SystemExit as e:
            if e.code not in (0, None):
                raise RuntimeError(f"zeppelin {' '.join(argv)} exited {e.code}") from None
    return out.getvalue()


# Fields that record where (the manifest's absolute path) - and, in older plans, when and how long -
# not what: left out of the plan's digest.
WALL_CLOCK = {"created_at", "time_s", "path"}


def _stable_bytes(text: str) -> bytes:
    """The plan's records re-serialised canonically without the wall-clock fields."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in WALL_CLOCK}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    # the end record's digest covers created_at: left out like it
    lines = [json.dumps(strip(r), sort_keys=True) for r in records if r.get("kind") != "end"]
    return "\n".join(lines).encode()


def fingerprint(planners: list[str] = PLANNERS, settings: dict[str, list[str]] = SETTINGS) -> dict:
    cases: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sname, args in settings.items():
            for planner in planners:
                if (sname, planner) in SKIP:
                    continue
                plan = os.path.join(tmp, f"{sname}-{planner}.jsonl")
                _cli(["plan", *args, "--planner", planner, "--seed", "0", "-q", "-o", plan])
                data = _stable_bytes(Path(plan).read_text())
                sim = json.loads(_cli(["simulate", plan, "--json"]))
                cases[f"{sname}/{planner}"] = {
                    "plan_sha256": hashlib.sha256(data).hexdigest(),
                    "predicted_s": [s["predicted_s"] for s in sim["steps"]],
                    "simulated_s": [s["step_time_s"] for s in sim["steps"]],
                    "lower_bound_s": [s["lower_bound_s"] for s in sim["steps"]],
                }
    return {"cases": cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", help="write the JSON here instead of stdout")
    args = ap.parse_args()
    text = json.dumps(fingerprint(), indent=1, sort_keys=True) + "\n"
    if args.output:
        tmp = args.output + ".tmp"
        Path(tmp).write_text(text)
        os.replace(tmp, args.output)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
