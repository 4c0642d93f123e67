"""What FSDP2 does in each micro-batch at ZeRO-2 and ZeRO-3, as the runtime shards its model, and
the memory probe that watches it (one gloo rank, the runtime's ``small`` model).

ZeRO-2 (``reshard_after_forward=False``): every block's parameters are gathered before its
forward and stay whole until its backward; after the backward every parameter is sharded again
and every gradient reduce-scattered, in every micro-batch (the runtime never defers the gradient
sync). ZeRO-3 re-shards each block after its forward. The profile's ``fsdp_microbatch_s`` measures
these per micro-batch, under the executor's memory probe as ``zeppelin run`` runs on a CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.planner.test_profile_fit import one_rank_group  # noqa: F401 (a fixture)


def _walk_bytes(model) -> int:
    """The unsharded bytes by a full walk of ``model.parameters()`` (what the probe must equal)."""
    from zeppelin.runtime.fsdp import _storage

    seen = {}
    for p in model.parameters():
        for t in (p, p.grad):
            if t is not None and not hasattr(t, "to_local"):
                s = _storage(t)
                seen[s[0]] = s[1]
    return sum(seen.values())


def _micro_batch(model, tracker, tokens, layout, at_forward_end):
    with tracker.hooks():
        loss, _ = model(tokens, tokens, layout)
    at_forward_end.append(tracker._whole())
    loss.backward()
    tracker.release()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_stage_gathers_and_reduce_scatters_every_microbatch(monkeypatch, zero):
    from torch.distributed.tensor import DTensor

    from zeppelin.runtime import fsdp
    from zeppelin.runtime.model import LlamaModel
    from zeppelin.runtime.profiler import _stand_in_layout
    from zeppelin.schemas.model import model_preset

    spec = model_preset("small")
    model = LlamaModel(spec, seed=0)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = sum(p.numel() * p.element_size() for p in fsdp.decoder_blocks(model).parameters())
    fsdp.shard_model(model, fsdp.dp_mesh(1, "cpu"), zero)
    tracker = fsdp.SavedActivations(model)
    tracker.watch_blocks(model)
    scans = []
    real_scan = fsdp.SavedActivations._scan

    def checked_scan(self):  # at every scan: the cached slots count what a full walk counts
        scans.append((self._whole(), _walk_bytes(self.model)))
        real_scan(self)

    monkeypatch.setattr(fsdp.SavedActivations, "_scan", checked_scan)
    toks = torch.randint(spec.vocab_size, (64,))
    at_forward_end = []
    for _ in range(2):  # two micro-batches of one step
        _micro_batch(model, tracker, toks, _stand_in_layout(64, torch.device("cpu")), at_forward_end)
        assert all(isinstance(p, DTensor) for p in model.parameters())  # every parameter sharded again
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())  # every gradient reduce-scattered
        assert fsdp.UnshardedBytes(model)() == 0
    # ZeRO-2: every block stays whole from its forward to its backward; ZeRO-3: no block does
    if zero == 2:
        assert at_forward_end == [whole] * 2
    else:
        assert all(b <= whole - blocks for b in at_forward_end), (at_forward_end, whole - blocks)
    assert len(scans) > 100 and all(a == b for a, b in scans)
    assert tracker.unsharded_peak >= (whole if zero == 2 else blocks // spec.num_layers)


@pytest.mark.usefixtures("one_rank_group")
def test_profile_measures_fsdp_under_the_memory_probe(monkeypatch):
    """On a CPU the plain and the sharded micro-batches the profile times run under the executor's
    probe; only the sharded ones scan whole parameters."""
    from zeppelin.runtime import fsdp
    from zeppelin.runtime.profiler import measure_fsdp_microbatch
    from zeppelin.schemas.model import model_preset

    scans = []
    real_scan = fsdp.SavedActivations._scan
    monkeypatch.setattr(fsdp.SavedActivations, "_scan",
                        lambda self: scans.append(self._whole is not None) or real_scan(self))

    class CountingClock:  # "time" = scans of whole parameters during the call
        def sweep(self, fns, reps, warmup, sync=None):
            out = []
            for fn in fns:
                scans.clear()
                fn()
                out.append(float(sum(scans)))
            return out

    got = measure_fsdp_microbatch(model_preset("small"), 64, torch.device("cpu"), CountingClock(), 1, 0)
    assert set(got) == {"1", "3"} and all(v > 50 for v in got.values()), got
