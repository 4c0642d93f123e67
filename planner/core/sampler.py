"""Deterministic step sampler: cut a dataset's sample stream into training steps.

The *stream* is an endless sequence of epochs. Epoch ``e`` visits every eligible sample once,
in manifest order (``shuffle=False``) or in a permutation drawn from
``numpy.random.default_rng([seed, e])`` (``shuffle=True``), so any epoch can be rebuilt on its
own and the same ``(dataset, config)`` always yields the same steps.

A step takes samples from the stream while the running token total stays within
``tokens_per_step`` and the count within ``seqs_per_step`` (either or both may be set). A step
always takes at least one sample, even one longer than the budget. When an epoch runs out the
step continues with the next epoch, but a step never holds more samples than one epoch has.

Samples longer than ``max_seq_len`` are handled by ``overflow``:

* ``truncate`` - the sequence keeps its first ``max_seq_len`` tokens (``truncated_from`` records
  the original length; token budgets count the truncated length);
* ``skip``     - such samples are left out of the stream altogether;
* ``reject``   - building a step that contains one raises :class:`InputError` naming the sample.

``start_sample`` skips that many stream positions (positions count eligible samples across
epochs), so a run can resume where a previous plan stopped (:attr:`StepSampler.position`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from zeppelin.schemas.common import InputError
from zeppelin.schemas.io.datasets import Dataset
from zeppelin.schemas.plan import SamplerConfig, Sequence

__all__ = ["StepSampler", "run_max_seq_len", "sample_steps"]


class StepSampler:
    def __init__(self, dataset: Dataset, config: SamplerConfig):
        if config.tokens_per_step is None and config.seqs_per_step is None:
            raise InputError("the sampler needs tokens_per_step and/or seqs_per_step")
        self.dataset = dataset
        self.config = config
        L = dataset.lengths
        m = config.max_seq_len
        self._eligible: np.ndarray | None = None  # None: every sample
        if m is not None and config.overflow == "skip":
            ok = L <= m
            if not ok.any():
                raise InputError(f"every sample is longer than max_seq_len {m} (overflow=skip leaves nothing)",
                                 source=dataset.source)
            if not ok.all():
                self._eligible = np.flatnonzero(ok)
        self._eff = np.minimum(L, m) if (m is not None and config.overflow == "truncate") else L
        self.num_eligible = int(L.size if self._eligible is None else self._eligible.size)
        self.position = int(config.start_sample)
        self.steps_done = 0
        self._cache: tuple[int, np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------------ epochs
    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample ids of one epoch of the stream, in visiting order."""
        base = np.arange(self.dataset.num_samples, dtype=np.int64) if self._eligible is None else self._eligible
        if not self.config.shuffle:
            return base
        rng = np.random.default_rng([self.config.seed % (1 << 64), epoch])
        return base[rng.permutation(base.size)]

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cache is None or self._cache[0] != epoch:
            order = self.epoch_order(epoch)
            cs = np.zeros(order.size + 1, dtype=np.int64)
            np.cumsum(self._eff[order], out=cs[1:])
            self._cache = (epoch, order, cs)
        return self._cache[1], self._cache[2]

    # ------------------------------------------------------------------ steps
    def next_ids(self) -> np.ndarray:
        """Sample ids of the next step (advances :attr:`position`)."""
        budget = self.config.tokens_per_step
        cap = self.config.seqs_per_step
        n = self.num_eligible
        picks: list[np.ndarray] = []
        tokens = taken = 0
        while True:
            epoch, i = divmod(self.position, n)
            order, cs = self._epoch(epoch)
            k = n
            if budget is not None:
                k = int(np.searchsorted(cs, cs[i] + (budget - tokens), side="right")) - 1
            if cap is not None:
                k = min(k, i + cap - taken)
            k = min(k, i + n - taken)  # never more than one epoch's worth of samples
            if taken == 0:
                k = max(k, i + 1)  # at least one sample per step
            k = min(k, n)
            if k > i:
                picks.append(order[i:k])
                tokens += int(cs[k] - cs[i])
                taken += k - i
                self.position += k - i
            if k < n or taken >= n or (cap is not None and taken >= cap) or (
                    budget is not None and tokens >= budget):
                break
        ids = picks[0] if len(picks) == 1 else np.concatenate(picks)
        m = self.config.max_seq_len
        if m is not None and self.config.overflow == "reject":
            over = np.flatnonzero(self.dataset.lengths[ids] > m)
            if over.size:
                sid = int(ids[over[0]])
                raise InputError(f"sample {sid} has {int(self.dataset.lengths[sid])} tokens, more than "
                                 f"max_seq_len {m} (overflow=reject)", source=self.dataset.source)
        self.steps_done += 1
        return ids

    def next_step(self) -> list[Sequence]:
        ids = self.next_ids()
        orig = self.dataset.lengths[ids]
        eff = self._eff[ids]
        return [
            Sequence(sample_id=s, length=e, truncated_from=o if o != e else None)
            for s, e, o in zip(ids.tolist(), eff.tolist(), orig.tolist())
        ]

    def steps(self, num_steps: int) -> Iterator[list[Sequence]]:
        """The next ``num_steps`` steps, each a list of :class:`Sequence` in stream order."""
        if num_steps < 0:
            raise InputError(f"number of steps must be >= 0, got {num_steps}")
        for _ in range(num_steps):
            yield self.next_step()


def sample_steps(dataset: Dataset, config: SamplerConfig, num_steps: int) -> list[list[Sequence]]:
    """The first ``num_steps`` steps of a fresh :class:`StepSampler`."""
    return list(StepSampler(dataset, config).steps(num_steps))


def run_max_seq_len(dataset: Dataset, config: SamplerConfig) -> int:
    """The longest sequence a run with ``config`` can meet: ``max_seq_len`` when set (what a static
    context-parallel job sizes its CP group for), else the dataset's longest sample."""
    if config.max_seq_len is not None:
        return int(config.max_seq_len)
    return int(dataset.lengths.max()) if dataset.num_samples else 1
