"""Generate the sample manifest shipped with zeppelin (``schemas/data/sample_manifest.jsonl``).

The lengths follow a two-part mixture shaped like a web/code/book pre-training corpus:

* body (95% of documents): log-normal, median 600 tokens, sigma 1.0, floored at 16 tokens;
* tail (5%): truncated Pareto with shape 1.1 from 4,096 to 131,072 tokens (inverse-CDF sampling,
  so there is no pile-up at the cap).

Most documents are short, yet a large share of the tokens (and most of the quadratic attention
work) sits in the few long ones, which is what makes per-step load balancing matter.

    python benchmarks/make_sample_manifest.py --seed 0 -o schemas/data/sample_manifest.jsonl

The first line of the output is a header record (keys starting with ``_``) that says how the file
was made; manifest readers skip it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

BODY_SHARE = 0.95
BODY_MEDIAN, BODY_SIGMA, BODY_MIN = 600.0, 1.0, 16
TAIL_MIN, TAIL_MAX, TAIL_ALPHA = 4096, 131072, 1.1


def sample_lengths(num_samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    is_tail = rng.random(num_samples) >= BODY_SHARE
    n_tail = int(is_tail.sum())
    body = np.exp(rng.normal(np.log(BODY_MEDIAN), BODY_SIGMA, num_samples - n_tail))
    body = np.clip(np.rint(body), BODY_MIN, TAIL_MAX)
    # truncated Pareto on [TAIL_MIN, TAIL_MAX] by inverting its CDF
    u = rng.random(n_tail)
    r = (TAIL_MIN / TAIL_MAX) ** TAIL_ALPHA
    tail = np.floor(TAIL_MIN / (1.0 - u * (1.0 - r)) ** (1.0 / TAIL_ALPHA))
    out = np.empty(num_samples, dtype=np.int64)
    out[~is_tail] = body.astype(np.int64)
    out[is_tail] = np.minimum(tail, TAIL_MAX).astype(np.int64)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-samples", type=int, default=30000)
    ap.add_argument("-o", "--output", type=Path, default=None, help="default: stdout")
    a = ap.parse_args(argv)
    lengths = sample_lengths(a.num_samples, a.seed)
    header = {
        "_comment": (
            "zeppelin sample manifest: synthetic long-tailed document lengths (tokens) shaped like a "
            f"pre-training corpus. {a.num_samples} samples; {BODY_SHARE:.0%} log-normal body (median "
            f"{BODY_MEDIAN:g}, sigma {BODY_SIGMA:g}, min {BODY_MIN}), {1 - BODY_SHARE:.0%} truncated Pareto "
            f"tail (alpha {TAIL_ALPHA:g}, {TAIL_MIN}..{TAIL_MAX}). Not real data."
        ),
        "_generator": f"python benchmarks/make_sample_manifest.py --seed {a.seed} --num-samples {a.num_samples}",
    }
    lines = [json.dumps(header)] + [f'{{"length": {int(n)}}}' for n in lengths]
    text = "\n".join(lines) + "\n"
    if a.output is None:
        sys.stdout.write(text)
    else:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.output.with_suffix(a.output.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(a.output)
        print(json.dumps({"output": str(a.output), "num_samples": int(lengths.size),
                          "num_tokens": int(lengths.sum()), "max": int(lengths.max())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
