"""Token inputs of a step: what each rank feeds its model, built without communication.

A rank needs, for every ``[seq, start, end]`` segment of its buffer, the token ids of positions
``start..end-1`` of that sequence, their absolute positions (RoPE restarts at 0 at each sequence's
start) and the labels (the next token of the same sequence; ``-100`` at the sequence's last token
and at padding positions ``>= length``).

Token ids come from the dataset manifest when it holds token ids (``tokens_field``) and
otherwise from a deterministic counter-based hash of ``(seed, sample_id, position)``, so every
rank — and the single-process reference — builds exactly the same ids for any slice of any
sequence without generating or exchanging whole sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from zeppelin.schemas.common import InputError

IGNORE_INDEX = -100

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser, vectorised over uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLD
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def synthetic_tokens(sample_id: int, start: int, end: int, *, seed: int, vocab: int,
                     noise: float = 0.1, max_stride: int = 4) -> np.ndarray:
    """Token ids of positions ``start..end-1`` of synthetic sample ``sample_id`` (int64, in [0, vocab)).

    Learnable but not trivial: each sample is an arithmetic progression modulo ``vocab`` with its
    own start and a stride in ``1..max_stride`` (a model must infer the stride in context, through
    attention to the previous tokens; small strides let a small model learn it in a few steps), and a
    fraction ``noise`` of the positions carries a uniformly random id. Every id is a pure function
    of ``(seed, sample_id, position)`` (SplitMix64), so any slice is computed without the rest.
    """
    if end < start:
        raise ValueError(f"bad token range [{start}, {end})")
    with np.errstate(over="ignore"):
        key = _splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * _M2 + np.uint64(sample_id))
        v = np.uint64(vocab)
        first = key % v
        stride = np.uint64(1) + (key >> np.uint64(32)) % np.uint64(max(min(max_stride, vocab - 1), 1))
        pos = np.arange(start, end, dtype=np.uint64)
        clean = (first + stride * pos) % v
        h = _splitmix64(pos ^ _splitmix64(key))
        noisy = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53) < noise
        out = np.where(noisy, h % v, clean)
    return out.astype(np.int64)


@dataclass
class SegmentBatch:
    """The packed inputs of one buffer: tokens, absolute positions, labels and sequence bounds."""

    tokens: np.ndarray      # [T] int64
    positions: np.ndarray   # [T] int64, absolute positions in each sequence
    labels: np.ndarray      # [T] int64, next token of the same sequence or IGNORE_INDEX
    seg_lengths: list[int]  # tokens per segment (segment order)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


class TokenSource:
    """Token ids of a step's sequences: from the manifest when it has ids, else synthetic.

    ``manifest`` is an object with ``tokens(sample_id) -> sequence of ints or None`` (the loaded
    manifest of :mod:`zeppelin.schemas.io.datasets`) or None. Whole token lists of the samples a rank
    touches are cached per step (``clear()`` between steps).
    """

    def __init__(self, vocab: int, seed: int = 0, manifest: Any = None,
                 tokens_fn: Callable[[int], Any] | None = None) -> None:
        if vocab < 2:
            raise InputError(f"vocabulary of {vocab} tokens is too small")
        self.vocab = vocab
        self.seed = seed
        self._fn = tokens_fn
        self.manifest = manifest
        if self._fn is None and manifest is not None and getattr(manifest, "has_tokens", True) \
                and hasattr(manifest, "tokens"):
            self._fn = manifest.tokens
        self._cache: dict[int, np.ndarray | None] = {}

    def clear(self) -> None:
        self._cache.clear()

    @property
    def synthetic(self) -> bool:
        """True when every token id is synthetic (no manifest ids, no token function)."""
        return self._fn is None

    def describe(self) -> str:
        """One line saying where the token ids come from."""
        m = self.manifest
        if not self.synthetic:
            if m is None:
                return "token ids from the caller's function"
            return (f"token ids from {m.source} ({m.num_samples} samples, {m.num_tokens} tokens, "
                    f"manifest hash {m.content_hash})")
        why = "no --data given" if m is None else f"the manifest {m.source} holds lengths only"
        return f"synthetic token ids ({why}; seed {self.seed}, vocabulary {self.vocab})"

    def _manifest_ids(self, sample_id: int) -> np.ndarray | None:
        if self._fn is None:
            return None
        if sample_id not in self._cache:
            ids = self._fn(sample_id)
            if ids is None:
                self._cache[sample_id] = None
            else:
                arr = np.asarray(ids, dtype=np.int64).reshape(-1)
                if arr.size and (arr.min() < 0 or arr.max() >= self.vocab):
                    bad = int(arr.max() if arr.max() >= self.vocab else arr.min())
                    raise InputError(f"sample {sample_id}: token id {bad} is outside the model's vocabulary "
                                     f"(0..{self.vocab - 1})")
                self._cache[sample_id] = arr
        return self._cache[sample_id]

    def ids(self, sample_id: int, length: int, start: int, end: int) -> np.ndarray:
        """Ids of positions ``start..end-1`` (clipped to ``length``) of a sequence of ``length`` tokens."""
        end = min(end, length)
        if end <= start:
            return np.zeros(0, dtype=np.int64)
        arr = self._manifest_ids(sample_id)
        if arr is None:
            return synthetic_tokens(sample_id, start, end, seed=self.seed, vocab=self.vocab)
        if arr.size < length:
            raise InputError(f"sample {sample_id}: the manifest holds {arr.size} token ids, "
                             f"the plan uses {length}")
        return arr[start:end]

    def segments(self, sequences, segments: list[list[int]]) -> SegmentBatch:
        """Build the packed inputs of ``[seq, start, end]`` segments of a step's ``sequences``.

        Positions ``>= length`` (padding of padded placements) get token 0 and label IGNORE_INDEX.
        """
        toks, poss, labs, lens = [], [], [], []
        for q, s, e in segments:
            seq = sequences[q]
            L = seq.length
            n = e - s
            t = np.zeros(n, dtype=np.int64)
            lab = np.full(n, IGNORE_INDEX, dtype=np.int64)
            real_end = min(e, L)
            if real_end > s:
                # one extra id (position real_end) gives the label of the last real token of the slice
                ids = self.ids(seq.sample_id, L, s, min(real_end + 1, L))
                t[: real_end - s] = ids[: real_end - s]
                nxt = ids[1:]
                lab[: nxt.shape[0]] = nxt
            toks.append(t)
            poss.append(np.arange(s, e, dtype=np.int64))
            labs.append(lab)
            lens.append(n)
        if not toks:
            z = np.zeros(0, dtype=np.int64)
            return SegmentBatch(z, z.copy(), z.copy(), [])
        return SegmentBatch(np.concatenate(toks), np.concatenate(poss), np.concatenate(labs), lens)


def predicted_tokens(sequences) -> int:
    """Tokens that predict a next token in a step (the last token of each sequence predicts nothing)."""
    return sum(max(s.length - 1, 0) for s in sequences)


def load_token_source(vocab: int, seed: int, manifest_ref: str | None,
                      fields: dict[str, str | None] | None = None) -> tuple[TokenSource, str | None]:
    """A TokenSource for ``--data MANIFEST`` (or synthetic ids when None) and the manifest's content
    hash. ``fields``: how the manifest is read (``length_field``, ``tokens_field``, ``text_field``,
    ``tokenizer`` of :func:`zeppelin.schemas.io.datasets.load_manifest`)."""
    if manifest_ref is None:
        return TokenSource(vocab, seed), None
    from zeppelin.schemas.io import datasets  # written by the data helper

    man = datasets.load_manifest(manifest_ref, **(fields or {}))
    h = getattr(man, "content_hash", None)
    if callable(h):
        h = h()
    return TokenSource(vocab, seed, manifest=man), h
