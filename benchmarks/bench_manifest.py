"""Manifest loading at scale: 10 million samples as JSONL, Parquet and .npy.

Writes each manifest to a temporary directory, then loads it through
``zeppelin.schemas.io.datasets.load_manifest`` in a fresh subprocess per format: the median of
``--repeats`` load times, and the peak resident memory the load added over the process's
footprint just before the load (Linux ``VmHWM`` after resetting it through
``/proc/self/clear_refs``; the largest over the repeats). Prints one JSON object.

    python benchmarks/bench_manifest.py                # 10M samples
    python benchmarks/bench_manifest.py --samples 1000000 --formats jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, statistics, sys, time
from zeppelin.schemas.io.datasets import load_manifest
import numpy as np

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024.0  # MiB
    return float("nan")

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False

path, repeats, extra = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
times, peaks = [], []
for i in range(repeats):
    can_reset = reset_peak()
    base = status("VmRSS")
    t = time.perf_counter()
    ds = load_manifest(path, **extra)
    times.append(time.perf_counter() - t)
    peaks.append(status("VmHWM") - base if can_reset else float("nan"))
    first = (ds.num_samples, ds.num_tokens, ds.content_hash, ds.lengths.nbytes / 2**20)
    del ds
print(json.dumps({"times_s": times, "median_s": statistics.median(times),
                  "peak_rss_added_mib": max(peaks), "num_samples": first[0],
                  "num_tokens": first[1], "content_hash": first[2], "result_mib": first[3]}))
"""

def make_lengths(n: int, seed: int) -> np.ndarray:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_sample_manifest import sample_lengths

    return sample_lengths(n, seed)


def write_jsonl(path: Path, lengths: np.ndarray, extra_fields: bool) -> None:
    step = 1_000_000
    with open(path, "w") as fh:
        fh.write('{"_comment": "bench_manifest.py synthetic manifest"}\n')
        for s in range(0, lengths.size, step):
            part = lengths[s:s + step].tolist()
            if extra_fields:
                fh.write("".join(f'{{"id": {s + i}, "source": "web", "length": {n}, "lang": "en"}}\n'
                                 for i, n in enumerate(part)))
            else:
                fh.write("".join(f'{{"length": {n}}}\n' for n in part))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", default="jsonl,jsonl-fields,parquet,npy,txt")
    a = ap.parse_args(argv)
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    lengths = make_lengths(a.samples, a.seed)
    results = {}
    with tempfile.TemporaryDirectory(prefix="zeppelin-bench-") as tmp:
        d = Path(tmp)
        for fmt in formats:
            t = time.perf_counter()
            extra: dict = {}
            if fmt == "jsonl":
                path = d / "m.jsonl"
                write_jsonl(path, lengths, extra_fields=False)
            elif fmt == "jsonl-fields":
                path = d / "f.jsonl"
                write_jsonl(path, lengths, extra_fields=True)
            elif fmt == "parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                path = d / "m.parquet"
                pq.write_table(pa.table({"length": pa.array(lengths.astype(np.int32)),
                                         "id": pa.array(np.arange(lengths.size))}), path)
            elif fmt == "npy":
                path = d / "m.npy"
                np.save(path, lengths.astype(np.int32))
            elif fmt == "txt":
                path = d / "m.txt"
                path.write_text("\n".join(map(str, lengths.tolist())) + "\n")
            else:
                raise SystemExit(f"unknown format {fmt!r}")
            write_s = time.perf_counter() - t
            r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(a.repeats), json.dumps(extra)],
                               capture_output=True, text=True, check=True)
            res = json.loads(r.stdout)
            res["file_mb"] = path.stat().st_size / 1e6
            res["write_s"] = write_s
            res["samples_per_s"] = res["num_samples"] / res["median_s"]
            assert res["num_samples"] == lengths.size and res["num_tokens"] == int(lengths.sum())
            results[fmt] = res
            path.unlink()
    print(json.dumps({
        "benchmark": "manifest_load",
        "samples": a.samples,
        "repeats": a.repeats,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.system()}, Python {platform.python_version()}",
        
        "results": results,
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
