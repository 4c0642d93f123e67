"""The public Python API of the zeppelin runtime: plans, attention and remaps for your own loop.

Everything a training loop needs to execute a zeppelin plan is here; ``zeppelin run`` itself uses
nothing else for its data, attention and remap path. The names are re-exported by
:mod:`zeppelin.runtime` (``import zeppelin.runtime as z``) and documented in ``docs/API.md``:

* :func:`open_plan` — read a plan; iterate per-rank :class:`StepContext` objects;
* :class:`StepContext` / :class:`MicroBatch` — a rank's tensors of one step (``input_ids``,
  ``position_ids``, ``labels``, the loss normaliser) and what the plan predicted;
* :class:`AttentionContext` — opaque: the groups, rings, routes and remaps of one micro-batch;
* :func:`attention` — the plan's attention of one micro-batch as one autograd function;
* :func:`to_attention_layout` / :func:`to_linear_layout` — the remap all-to-alls (autograd-aware);
* :func:`register_hf_attention` — run a Hugging Face ``transformers`` model's attention through
  :func:`attention`;
* :func:`build_step` — a :class:`StepContext` from an already-read plan step (what ``open_plan``
  and ``zeppelin run`` use);
* :data:`API_VERSION`, :data:`IGNORE_INDEX`, :data:`PLAN_FORMAT`, :class:`InputError` (bad plans
  and data: a one-line reason).

Stability: these names and their documented behaviour follow :data:`API_VERSION` (``MAJOR.MINOR``:
a MINOR bump adds, a MAJOR bump may change or remove). Every other module of
``zeppelin.runtime`` is private and may change in any release.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from zeppelin.schemas.common import InputError
from zeppelin.schemas.layout import split_even
from zeppelin.schemas.plan import PLAN_SCHEMA, PlanHeader, PlanReader, StepPlan

from .data import IGNORE_INDEX, TokenSource, load_token_source, predicted_tokens
from .public import PUBLIC_NAMES

if TYPE_CHECKING:  # pragma: no cover
    from .model import TPContext

__all__ = list(PUBLIC_NAMES)

#: Version of this API (``MAJOR.MINOR``). MINOR: additions only; MAJOR: a documented change.
API_VERSION = "1.0"

#: The plan file format this runtime reads (the ``schema_version`` of a plan header).
PLAN_FORMAT = PLAN_SCHEMA


# ---------------------------------------------------------------------------------------------
# contexts
# ---------------------------------------------------------------------------------------------


class AttentionContext:
    """How one micro-batch's attention runs on this rank (opaque; pass it to :func:`attention`,
    :func:`to_attention_layout` and :func:`to_linear_layout`).

    It holds the micro-batch's attention groups (local, ring, all-gather, Ulysses), their ring
    orders and token placements, the inter-node routes of ring transfers and the remap between the
    *linear layout* (the rows of :attr:`MicroBatch.input_ids`, token-balanced) and the *attention
    layout* (this rank's attention buffer, cost-balanced). Readable attributes:

    * ``attention_rows`` / ``linear_rows`` — rows this rank holds in each layout;
    * ``attention_positions`` — position ids (``[attention_rows]`` int64) of the attention layout,
      for models that apply RoPE after :func:`to_attention_layout`;
    * ``remapped`` — whether the two layouts differ (else both remaps are the identity);
    * :meth:`bytes_sent` — bytes this rank sent so far for this micro-batch.

    Built by :func:`open_plan` / :func:`build_step`; not constructed by users. Every rank must run
    the same sequence of :func:`attention` and remap calls for a micro-batch (one per layer, in
    layer order), forward and backward: the calls are collective over the plan's groups.
    """

    def __init__(self, header: PlanHeader, step: StepPlan, index: int, rank: int, *, device: torch.device,
                 groups: Any = None, attention_positions: torch.Tensor, tp: TPContext | None = None) -> None:
        from .remap import Remapper

        self.step = step.step
        self.index = index
        self.rank = rank
        self.device = device
        self.tp = tp
        self.attention_positions = attention_positions
        self._header, self._plan_step, self._groups = header, step, groups
        self._engines: dict[tuple[float | None, int | None], Any] = {}
        self._remapper = Remapper(header, step, index, rank, device=device)
        self.attention_rows = self._remapper.attention_rows
        self.linear_rows = self._remapper.linear_rows
        self.remapped = bool(self._remapper.enabled)

    def _engine(self, scale: float | None, window: int | None = None):
        eng = self._engines.get((scale, window))
        if eng is None:
            from .engine import AttentionEngine

            eng = AttentionEngine(self._header, self._plan_step, self.index, self.rank, groups=self._groups,
                                  scale=scale, window=window)
            self._engines[(scale, window)] = eng
        return eng

    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank sent for this micro-batch (attention and remaps, forward and backward),
        per link class: ``{"intra": ..., "inter": ...}``."""
        out = {"intra": 0, "inter": 0}
        for stats in [e.stats for e in self._engines.values()] + [self._remapper.stats]:
            for cls in out:
                out[cls] += int(stats.get(cls, 0))
        return out

    def __repr__(self) -> str:
        return (f"AttentionContext(step={self.step}, microbatch={self.index}, rank={self.rank}, "
                f"attention_rows={self.attention_rows}, linear_rows={self.linear_rows}, remapped={self.remapped})")


@dataclass
class MicroBatch:
    """One micro-batch of one step on one rank, in the *linear layout* (the rows this rank's
    embedding, MLPs, LM head and loss see).

    ``input_ids``, ``position_ids`` and ``labels`` are ``[T]`` int64 tensors on the step's device
    (add a batch dimension, ``x[None]``, for models that want ``[1, T]``). Sequences are packed
    one after another; a sequence may be cut across ranks, so ``position_ids`` restart at 0 at
    each sequence's first token and otherwise continue where the previous rank's part ended.
    ``labels[i]`` is the next token of the same sequence, :data:`IGNORE_INDEX` (-100) at each
    sequence's last token and at padding rows (padding rows have ``input_ids`` 0).

    The loss of the step is ``sum over micro-batches and ranks of cross_entropy(logits, labels,
    reduction="sum") / loss_normaliser``: ``loss_normaliser`` is the step's global number of
    tokens that predict a next token, the same on every rank and micro-batch. Summing (not
    averaging) the gradients over ranks then gives exactly the single-process gradient.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_normaliser: int
    context: AttentionContext
    #: ``(sequence index in the step, start, end)`` of each packed run of rows, in row order
    segments: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the step loss from ``[T, vocab]`` (or ``[1, T, vocab]``)
        logits: summed float32 cross-entropy divided by :attr:`loss_normaliser`."""
        logits = logits.reshape(-1, logits.shape[-1]).float()
        ce = torch.nn.functional.cross_entropy(logits, self.labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return ce / self.loss_normaliser


@dataclass
class StepContext:
    """One step of the plan on one rank: its micro-batches and what the plan predicted.

    Run forward and backward of every micro-batch in order (gradients accumulate), then reduce
    gradients with a SUM over the data-parallel ranks and step the optimizer.
    ``predicted_step_time_s`` (the whole step, slowest unit) and ``predicted_memory_bytes`` (this
    rank's unit, activations and states as the planner's cost model counts them) are None when the
    plan carries no prediction; log them against what you measure.
    """

    step: int
    rank: int
    world_size: int
    microbatches: list[MicroBatch]
    loss_normaliser: int
    num_sequences: int
    tokens: int
    predicted_step_time_s: float | None = None
    predicted_memory_bytes: int | None = None
    #: this rank's unit: predicted ``attention_s``, ``linear_s``, ``comm_s``, ``exposed_comm_s``
    predicted: dict[str, float] = field(default_factory=dict)

    def __iter__(self) -> Iterator[MicroBatch]:
        return iter(self.microbatches)

    def __len__(self) -> int:
        return len(self.microbatches)

    @property
    def local_tokens(self) -> int:
        """Rows this rank holds in the linear layout, over all micro-batches (padding included)."""
        return sum(mb.num_tokens for mb in self.microbatches)

    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank sent in this step so far (attention and remaps), per link class."""
        out = {"intra": 0, "inter": 0}
        for mb in self.microbatches:
            for k, v in mb.context.bytes_sent().items():
                out[k] += v
        return out


# ---------------------------------------------------------------------------------------------
# building a step
# ---------------------------------------------------------------------------------------------


def _unit_of(header: PlanHeader, step: StepPlan, rank: int) -> int:
    for u, rep in enumerate(header.replicas(step)):
        if rank in rep.ranks:
            return u
    raise InputError(f"step {step.step}: rank {rank} belongs to no replica of the plan")


def _shard(segments: list[list[int]], a: int, b: int) -> list[list[int]]:
    """Rows ``[a, b)`` of the buffer made of ``[seq, start, end]`` segments, as segments."""
    out: list[list[int]] = []
    row = 0
    for q, s, e in segments:
        n = e - s
        lo, hi = max(a, row), min(b, row + n)
        if hi > lo:
            out.append([q, s + lo - row, s + hi - row])
        row += n
    return out


def _positions(segments: list[list[int]]) -> torch.Tensor:
    if not segments:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(s, e, dtype=torch.int64) for _, s, e in segments])


def build_step(header: PlanHeader, step: StepPlan, *, rank: int, source: TokenSource,
               device: torch.device | str = "cpu", groups: Any = None, tp_group: Any = None,
               tp_mode: str = "none", tp_chunks: int = 4) -> StepContext:
    """This rank's :class:`StepContext` of an already-read plan step (advanced; :func:`open_plan`
    is the usual entry point).

    ``source`` gives token ids; ``groups`` the pre-created process groups of the plan (None for a
    one-rank job). ``tp_group`` (a tensor-parallel group of this rank's unit, internal) makes the
    micro-batches this rank's sequence shard of its unit's linear buffer; ``tp_mode``/``tp_chunks``
    choose the TP overlap. No communication happens here.
    """
    device = torch.device(device)
    source.clear()
    unit = _unit_of(header, step, rank)
    norm = max(predicted_tokens(step.sequences), 1)
    mbs: list[MicroBatch] = []
    for i, mb in enumerate(step.microbatches):
        lin = mb.linear_segments(unit)
        att = mb.attention_segments(unit)
        tpc = None
        if tp_group is not None:
            from .model import TPContext

            rows = split_even(sum(e - s for _, s, e in lin), tp_group.size)
            a = sum(rows[:tp_group.pos])
            lin = _shard(lin, a, a + rows[tp_group.pos])
            tpc = TPContext(tp_group, rows, tp_mode, tp_chunks)
        batch = source.segments(step.sequences, lin)
        ctx = AttentionContext(header, step, i, rank, device=device, groups=groups,
                               attention_positions=_positions(att).to(device), tp=tpc)
        mbs.append(MicroBatch(
            input_ids=torch.from_numpy(batch.tokens).to(device),
            position_ids=torch.from_numpy(batch.positions).to(device),
            labels=torch.from_numpy(batch.labels).to(device),
            loss_normaliser=norm, context=ctx, segments=[(int(q), int(s), int(e)) for q, s, e in lin]))
    pred_t = pred_m = None
    predicted: dict[str, float] = {}
    if step.prediction is not None:
        p = step.prediction
        pred_t = float(p.step_time_s)
        if unit < len(p.per_unit.memory_gb):
            pred_m = round(p.per_unit.memory_gb[unit] * 1e9)
        for key in ("attention_s", "linear_s", "comm_s", "exposed_comm_s", "total_s"):
            vals = getattr(p.per_unit, key)
            if unit < len(vals):
                predicted[key] = float(vals[unit])
    return StepContext(step=step.step, rank=rank, world_size=header.world_size, microbatches=mbs,
                       loss_normaliser=norm, num_sequences=len(step.sequences), tokens=step.tokens,
                       predicted_step_time_s=pred_t, predicted_memory_bytes=pred_m, predicted=predicted)


class PlanSteps:
    """The steps of a plan on one rank (returned by :func:`open_plan`).

    Iterating yields one :class:`StepContext` per step, reading the plan file one step at a time;
    ``steps[k]`` builds step ``k``; ``len(steps)`` is the number of steps. ``header`` is the
    plan's header (model, cluster, planner; a ``zeppelin.schemas.plan.PlanHeader``).
    """

    def __init__(self, reader: PlanReader, source: TokenSource, *, rank: int, world_size: int,
                 device: torch.device, groups: Any) -> None:
        self._reader = reader
        self.header: PlanHeader = reader.header
        self._source = source
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._groups = groups

    def __len__(self) -> int:
        return self.header.num_steps

    def __getitem__(self, k: int) -> StepContext:
        if not 0 <= k < len(self):
            raise IndexError(f"step {k} is out of range (the plan has {len(self)} steps)")
        return build_step(self.header, self._reader.step(k), rank=self.rank, source=self._source,
                          device=self.device, groups=self._groups)

    def __iter__(self) -> Iterator[StepContext]:
        for k in range(len(self)):
            yield self[k]


def _default_device() -> torch.device:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def open_plan(path: str | os.PathLike, *, rank: int, world_size: int,
              data: str | os.PathLike | Callable[[int], Sequence[int]] | None = None,
              device: torch.device | str | None = None) -> PlanSteps:
    """Open a plan file for this rank; iterate the result for one :class:`StepContext` per step.

    ``rank``/``world_size``: this process in the job (``world_size`` must equal the plan's). With
    ``world_size > 1``, ``torch.distributed`` must already be initialised (gloo or NCCL) and every
    rank must call ``open_plan`` with the same plan: it creates the process groups the plan's
    attention groups need, collectively, once. ``data``: where token ids come from — None for the
    deterministic synthetic ids the plan's seed defines (what ``zeppelin run`` trains on without
    ``--data``; refused for a plan made from a manifest with token ids), a dataset manifest path
    (``zeppelin data``; its hash must match the plan's), or a function ``sample_id -> token ids``. ``device``: where tensors go (default: the current CUDA
    device under NCCL, else the CPU).

    Raises :class:`InputError` with a one-line reason for a missing, malformed or incompatible
    plan (a plan of another format version names the zeppelin that reads it).
    """
    import torch.distributed as dist

    reader = PlanReader(path)
    header = reader.header
    if header.world_size != world_size:
        raise InputError(f"the plan is for {header.world_size} ranks but world_size is {world_size}")
    if not 0 <= rank < world_size:
        raise InputError(f"rank {rank} is outside the world of {world_size} ranks")
    if data is None and header.manifest.token_ids:
        raise InputError(f"the plan was made from a manifest with token ids ({header.manifest.path}); pass it as "
                         "data= (without it the steps would get synthetic ids)")
    if callable(data):
        source = TokenSource(header.model.vocab_size, header.seed, tokens_fn=data)
    else:
        source, mhash = load_token_source(header.model.vocab_size, header.seed,
                                          None if data is None else os.fspath(data))
        if data is not None and mhash is not None and mhash != header.hashes.manifest:
            raise InputError(f"data {data} does not match the plan: the plan was made for manifest hash "
                             f"{header.hashes.manifest}, this one hashes to {mhash}")
    groups = None
    if world_size > 1:
        if not dist.is_initialized():
            raise RuntimeError("open_plan with world_size > 1 needs torch.distributed initialised first "
                               "(torch.distributed.init_process_group)")
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise InputError(f"rank {rank} / world_size {world_size} differ from the process group's "
                             f"{dist.get_rank()} / {dist.get_world_size()}")
        from .groups import GroupCache, set_default_cache

        groups = GroupCache(world_size, header=header, steps=(reader.step(k) for k in range(header.num_steps)))
        set_default_cache(groups)
    dev = torch.device(device) if device is not None else _default_device()
    return PlanSteps(reader, source, rank=rank, world_size=world_size, device=dev, groups=groups)


# ---------------------------------------------------------------------------------------------
# attention and remaps
# ---------------------------------------------------------------------------------------------


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
              layer: int | None = None, *, scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """The plan's causal attention of one micro-batch: ``[T, Hq, D]`` queries, ``[T, Hkv, D]``
    keys/values -> ``[T, Hq, D]``.

    Rows are this rank's *attention layout* (``ctx.attention_rows`` rows; use
    :func:`to_attention_layout` first when ``ctx.remapped``); RoPE is already applied (by
    absolute position within each sequence). Each token attends to the tokens at or before its
    position in its own sequence, wherever the plan placed them: local sequences run as one varlen
    kernel call, split sequences as zigzag ring attention over their group (K/V blocks passed
    around the ring, inter-node transfers split over the plan's routes), all-gather groups on the
    same exact ring schedule, Ulysses groups as head-scatter all-to-alls. GQA: ``Hq % Hkv == 0``.
    ``scale`` defaults to ``1/sqrt(D)``. ``window``: sliding-window attention, a token attends to
    the ``window`` tokens ending at its own (transformers' ``sliding_window``); ring blocks wholly
    outside it are neither computed nor sent.

    One autograd function: backward runs the same groups in the same order and returns exact
    gradients for ``q``, ``k`` and ``v``. On CUDA bf16/fp16 the blocks run on flash-attn's varlen
    kernels when flash-attn is importable (else PyTorch's fused kernels); float32 and the CPU use
    PyTorch kernels. Softmax statistics are float32 whatever the input dtype.

    Collective: every rank of the job must call it for the same micro-batch and layer, in the same
    order. ``layer`` (optional) only labels error messages; results do not depend on it.
    """
    if not isinstance(ctx, AttentionContext):
        raise TypeError(f"attention: ctx must be an AttentionContext (from open_plan/build_step), got "
                        f"{type(ctx).__name__}")
    where = f"attention (step {ctx.step}, micro-batch {ctx.index}" + (f", layer {layer})" if layer is not None
                                                                       else ")")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"{where}: q, k, v must be [tokens, heads, head_dim], got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"{where}: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(need k == v, the same head_dim and query heads a multiple of key/value heads)")
    if q.shape[0] != ctx.attention_rows or k.shape[0] != ctx.attention_rows:
        raise ValueError(f"{where}: rank {ctx.rank} holds {ctx.attention_rows} attention-layout rows, got "
                         f"{q.shape[0]} (convert with to_attention_layout)")
    if scale is not None and math.isclose(scale, 1.0 / math.sqrt(q.shape[-1]), rel_tol=1e-12):
        scale = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{where}: window must be a positive int or None, got {window!r}")
    return ctx._engine(scale, window)(q, k, v)


def to_attention_layout(x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """Rows of this rank's linear layout (``[ctx.linear_rows, ...]``) -> its attention layout
    (``[ctx.attention_rows, ...]``): the plan's variable-size all-to-all (point-to-point transfers
    between the ranks that exchange tokens). Differentiable (backward is the inverse transfer).
    The identity when the plan does not remap this micro-batch. Collective."""
    return ctx._remapper.to_attention(x)


def to_linear_layout(x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """Rows of this rank's attention layout -> its linear layout; the inverse of
    :func:`to_attention_layout`. Differentiable; the identity without a remap. Collective."""
    return ctx._remapper.to_linear(x)


# ---------------------------------------------------------------------------------------------
# Hugging Face transformers
# ---------------------------------------------------------------------------------------------

HF_ATTENTION_NAME = "zeppelin"
HF_CONTEXT_KWARG = "zeppelin_context"


def _hf_attention_forward(module, query, key, value, attention_mask=None, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """A ``transformers`` attention implementation: ``[1, H, T, D]`` linear-layout q/k/v (RoPE
    applied) -> ``([1, T, Hq, D]`` output, None)."""
    ctx = kwargs.get(HF_CONTEXT_KWARG)
    if ctx is None:
        raise ValueError(f"attention implementation {HF_ATTENTION_NAME!r} needs the micro-batch's context: call "
                         f"the model with {HF_CONTEXT_KWARG}=microbatch.context")
    if query.shape[0] != 1:
        raise ValueError(f"attention implementation {HF_ATTENTION_NAME!r} takes one packed row per call "
                         f"(input_ids[None]); got batch size {query.shape[0]}")
    if dropout:
        raise ValueError(f"attention implementation {HF_ATTENTION_NAME!r} does not support attention dropout "
                         f"(got {dropout})")
    timer = kwargs.get("zeppelin_timer")  # zeppelin run's per-phase timer (internal; optional)

    def region(name, fn, *xs):
        return timer.region(name, fn, *xs) if timer is not None else fn(*xs)

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    hq, hkv = q.shape[1], k.shape[1]
    # the padding row zeppelin.runtime.hf runs on a rank without tokens: dropped here, a zero output row
    pad = ctx.linear_rows == 0 and q.shape[0] == 1
    if pad:
        q, k, v = q[:0], k[:0], v[:0]
    if ctx.remapped:  # one all-to-all for q, k and v together
        qkv = region("remap", lambda x: to_attention_layout(x, ctx), torch.cat([q, k, v], dim=1))
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    layer = getattr(module, "layer_idx", None)
    # transformers passes the layer's window (None: full attention); 0 is full attention too, as the one
    # parser of HF configs (zeppelin.schemas.hf.sliding_window) reads it and as the plan was made
    window = kwargs.get("sliding_window") or None
    o = region("attention", lambda a, b, c: attention(a, b, c, ctx, layer, scale=scaling, window=window), q, k, v)
    o = region("remap", lambda x: to_linear_layout(x, ctx), o)
    if pad:
        o = torch.cat([o, o.new_zeros((1, *o.shape[1:]))])
    return o[None], None


def register_hf_attention(name: str = HF_ATTENTION_NAME) -> str:
    """Register :func:`attention` as a Hugging Face ``transformers`` attention implementation.

    After it, ``model.config._attn_implementation = "zeppelin"`` (or
    ``from_pretrained(..., attn_implementation="zeppelin")``) makes every attention layer run the
    plan's attention. Call the model on one micro-batch as::

        out = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None],
                    zeppelin_context=mb.context, use_cache=False)
        loss = mb.loss(out.logits)

    q/k/v arrive in the linear layout with RoPE applied (from ``position_ids``); the
    implementation remaps them to the attention layout (one all-to-all), runs :func:`attention`
    and remaps the output back. No attention mask is built (sequence boundaries come from the
    plan). Returns the registered name. Needs ``transformers`` (>= 4.48, ``AttentionInterface``).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(name, _hf_attention_forward)
    return name
