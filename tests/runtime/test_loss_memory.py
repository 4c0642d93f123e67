"""The loss's backward memory the cost model charges (``CostModel.loss_backward_bytes``) against
the resident set of a process running the runtime's loss forward and backward.

On a GPU the allocator's peak counts the loss's gradient buffers; on CPU ranks the executor counts
the tensors a step holds (saved activations, states), which leaves them out - so this measures them
apart: one process, large blocks served by their own mmap (``runtime.memory.mmap_large_blocks``,
so the resident set follows what is alive), a vocabulary large enough that the logits dwarf
everything else, the high-water mark of the loss's forward and backward over the resident set
before it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.clusters import cluster_preset
from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.schemas.model import model_preset

VOCAB, TOKENS = 32768, 2048

PROBE = r"""
import gc, json, sys, torch
from zeppelin.runtime.memory import mmap_large_blocks, rss_bytes, step_peak_memory
from zeppelin.runtime.model import LlamaModel
from zeppelin.schemas.model import model_preset
assert mmap_large_blocks()
torch.set_num_threads(1)
spec = model_preset("tiny").model_copy(update={"vocab_size": int(sys.argv[1]), "dtype": sys.argv[3]})
m = LlamaModel(spec, seed=0)
T = int(sys.argv[2])
h = torch.randn(T, spec.hidden, dtype=m.dtype, requires_grad=True)
labels = torch.randint(spec.vocab_size, (T,))
def run():
    m.loss_sum(h, labels).backward()
run()  # first call: allocator and kernels warmed up
h.grad = None
m.zero_grad(set_to_none=True)
gc.collect()
base = rss_bytes()
_, peak = step_peak_memory("cpu", run)
print(json.dumps({"extra": peak - base}))
"""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_loss_backward_holds_what_the_model_charges(dtype):
    """The loss's forward and backward hold, at their peak, the fp32 log-softmax the forward keeps
    (the head's ``4 V`` per token of activations) plus what the cost model charges its backward
    (``8 V``): within 5% of the measured high-water mark."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(VOCAB), str(TOKENS), dtype], capture_output=True,
                         text=True, timeout=240, check=True)
    extra = json.loads(out.stdout.strip().splitlines()[-1])["extra"]
    spec = model_preset("tiny").model_copy(update={"vocab_size": VOCAB, "dtype": dtype})
    cost = CostModel(cluster_preset("local-cpu:1x4"), spec)
    want = TOKENS * (4.0 * VOCAB + cost.loss_backward_bytes())
    assert abs(extra - want) <= 0.05 * want, (extra, want)
    # the step's peak is charged the loss's extra beyond a recomputation (none here)
    assert float(cost.memory_components(TOKENS)["loss"]) == pytest.approx(TOKENS * cost.loss_backward_bytes())
