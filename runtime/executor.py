"""The step engine: what one rank does for one step of a plan, and nothing around it.

:class:`Executor` holds a rank's model (sharded by FSDP2 at the plan's ZeRO stage, or replicated),
its AdamW optimizer, its token source and the job's process groups. Per step, on every rank::

    for each micro-batch:  build the rank's inputs (linear layout; with tensor parallelism the
                           rank's sequence shard of its unit's buffer) -> forward (remaps, the
                           plan's attention engine, TP-SP linears) -> loss / predicted tokens of
                           the step -> backward
    gradient reduction     FSDP2's reduce-scatter as a SUM (``--dp fsdp``), or one flat SUM
                           all-reduce (``--dp replicate``); the loss is already divided by the step's
                           global number of predicted tokens, so the sum is the single-process gradient
    non-finite check       one all-gather of each rank's loss share and gradient sum of squares
    optimizer step         global-norm clipping, the step's learning rate, AdamW

Tensor parallelism (uniform ``header.tp`` or a step's mixed-TP ``replicas``, Hydraulis): every rank
keeps the whole parameters (the canonical layout) and a TP rank computes with its shard of them
(:class:`zeppelin.runtime.model.TPContext`), so its gradient is non-zero only where its shard, its
heads or its tokens contributed; the SUM over all ranks assembles the full gradient across replicas
of any TP layout. (The price: TP does not reduce parameter or optimizer memory here; the
activations and GEMMs are sharded.)

Everything around the step - start-up checks, the settings a run resolves against its plan, the
training loop, metrics, ``--verify``, checkpoints - lives in :mod:`zeppelin.runtime.train`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zeppelin.schemas.common import InputError
from zeppelin.schemas.plan import PlanHeader, StepPlan

from .api import AttentionContext, attention, build_step, to_attention_layout, to_linear_layout
from .data import TokenSource
from .model import Layout, LlamaModel, PhaseTimer

# ---------------------------------------------------------------------------------------------
# Layout over the plan: remaps and the attention engine of one micro-batch
# ---------------------------------------------------------------------------------------------


class PlanLayout(Layout):
    """One micro-batch on one rank, through the public API only (:mod:`zeppelin.runtime.api`):
    :func:`~zeppelin.runtime.api.attention` and the two remaps on the micro-batch's context."""

    def __init__(self, ctx: AttentionContext, linear_positions: torch.Tensor | None = None,
                 real_rows: torch.Tensor | None = None) -> None:
        self.ctx = ctx
        self.attn_positions = ctx.attention_positions
        self.linear_positions = linear_positions
        self.tp = ctx.tp
        #: which linear-layout rows are tokens of a sequence (not padding of a padded placement)
        self.real_rows = real_rows

    def to_attention(self, x):
        return to_attention_layout(x, self.ctx)

    def to_linear(self, x):
        return to_linear_layout(x, self.ctx)

    def attention(self, q, k, v):
        return attention(q, k, v, self.ctx)


def real_rows(segments, sequences) -> torch.Tensor:
    """Rows of ``[seq, start, end]`` segments that hold a sequence's tokens (padding of a padded
    placement lies at positions >= the sequence's length)."""
    parts = [torch.arange(s, e) < sequences[q].length for q, s, e in segments]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def _add_bytes(acc: dict[str, int], stats: Any) -> None:
    if not isinstance(stats, dict):
        return
    for cls in ("intra", "inter"):
        v = stats.get(cls)
        if isinstance(v, (int, float)):
            acc[cls] = acc.get(cls, 0) + int(v)


def my_unit(header: PlanHeader, step: StepPlan, rank: int) -> int:
    for u, rep in enumerate(header.replicas(step)):
        if rank in rep.ranks:
            return u
    raise InputError(f"step {step.step}: rank {rank} belongs to no replica of the plan")


@dataclass
class StepResult:
    loss: float
    phases: dict[str, float]
    bytes: dict[str, int]
    tokens: int
    hidden: list[tuple[list[list[int]], torch.Tensor]] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    local_loss: float = 0.0  # this rank's share of the loss (before the sum over ranks)
    #: per micro-batch: its recomputation, tokens, bytes saved for the backward (``activations``), the
    #: most one recomputation held (``recompute_bytes``), forward and backward seconds
    microbatches: list[dict] = field(default_factory=list)


#: the components of a step's memory the runtime measures (bytes, per rank), in the order the
#: planner's memory model charges them (``CostModel.memory_components``)
MEMORY_COMPONENTS = ("params", "grads", "optimizer", "unsharded", "activations", "recompute")


class Executor:
    """Per-rank state of a job: model, optimizer, token source, process groups.

    Usable without torchrun (tests construct it inside an initialised process group).
    """

    def __init__(self, header: PlanHeader, model: LlamaModel, source: TokenSource, *,
                 rank: int, world_size: int, device: torch.device, groups=None,
                 lr: float = 1e-3, weight_decay: float = 0.0, tp_overlap: str | None = None,
                 tp_chunks: int = 4, dp: str = "fsdp", zero_stage: int | None = None,
                 dtype: str | None = None, recompute: str = "none", hsdp: int | None = None,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, grad_clip: float | None = None,
                 lr_schedule=None) -> None:
        from . import fsdp
        from .tp import OVERLAP_MODES

        fsdp.check_modes(dp=dp, dtype=dtype, recompute=recompute)
        self.zero_stage = header.zero_stage if zero_stage is None else zero_stage
        if dp == "fsdp" and self.zero_stage == 0:
            dp = "replicate"  # ZeRO-0: whole model and optimizer state on every rank
        self.dp = dp
        self.recompute = recompute
        self.spec_dtype = model.dtype
        if dtype is not None:
            model.dtype = fsdp.DTYPES[dtype]
        self.dtype = {v: k for k, v in fsdp.DTYPES.items()}.get(model.dtype, str(model.dtype))
        # on a GPU the allocator's peak is the measurement; on the CPU the step's saves and
        # FSDP's whole parameters are counted as they happen (the scan is CPU-only: it walks the
        # parameters at every save)
        self.activations = fsdp.SavedActivations(model if dp == "fsdp" and device.type != "cuda" else None)
        if dp == "fsdp":
            self.mesh = fsdp.dp_mesh(world_size, device.type, hsdp)
            fsdp.shard_model(model, self.mesh, self.zero_stage,
                             fsdp.mixed_precision(self.dtype if self.dtype in fsdp.DTYPES else "fp32"), recompute,
                             tracker=self.activations)
        else:
            self.mesh = None
            fsdp.apply_recompute(model, recompute, self.activations)
        fsdp.materialize(model, device)  # a model built on the meta device: this rank's rows only
        self.activations.watch_blocks(model)

        self.tp_overlap = header.tp_overlap if tp_overlap is None else tp_overlap
        if self.tp_overlap not in OVERLAP_MODES:
            raise InputError(f"--tp-overlap {self.tp_overlap!r} is not one of {', '.join(OVERLAP_MODES)}")
        if tp_chunks < 1:
            raise InputError(f"TP slicing needs at least one chunk (got {tp_chunks})")
        self.tp_chunks = tp_chunks
        self.used_tp = False
        self.header = header
        self.model = model
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.groups = groups
        self.cuda = device.type == "cuda"
        self.params = [p for p in model.parameters()]
        self.names = [n for n, _ in model.named_parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay,
                                           betas=tuple(betas), eps=eps, foreach=False)
        # the learning rate of step k (None: ``lr`` throughout) and global gradient-norm clipping
        self.lr_schedule = lr_schedule
        self.grad_clip = grad_clip
        self.base_lr = lr
        self.last_lr = lr
        self.last_grad_norm = float("nan")
        self._grad_sq = None  # this rank's gradient sum of squares, from nonfinite() until the optimizer step

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    # -- one step: forward / backward / all-reduce ---------------------------------------------
    def forward_backward(self, step: StepPlan, *, keep_hidden: bool = False) -> StepResult:
        """Gradients of the step's loss in ``param.grad`` (all-reduced); nothing is updated."""
        for p in self.params:
            p.grad = None
        unit = my_unit(self.header, step, self.rank)
        tpg = self._tp_group(step, unit)
        timer = PhaseTimer(enabled=True, cuda=self.cuda)
        phases = {"data": 0.0, "forward": 0.0, "backward": 0.0}
        nbytes: dict[str, int] = {"intra": 0, "inter": 0}
        loss_local = torch.zeros((), dtype=torch.float64)
        tokens = 0
        hidden = []
        n_mb = len(step.microbatches)
        self.activations.reset()
        act_peak = (0, 0)  # (bytes saved for the backward, tokens) of the micro-batch holding the most
        t0 = self._now()
        sc = build_step(self.header, step, rank=self.rank, source=self.source, device=self.device,
                        groups=self.groups, tp_group=tpg, tp_mode=self.tp_overlap, tp_chunks=self.tp_chunks)
        phases["data"] = self._now() - t0
        per_mb = []  # each micro-batch's choice, tokens, bytes held and times (``run --report``)
        for mbi, mb in enumerate(sc.microbatches):
            mode = self._set_recompute(step, mbi, unit)
            t1 = self._now()
            with self.activations.hooks():
                layout = PlanLayout(mb.context, mb.position_ids,
                                    real_rows(mb.segments, step.sequences).to(mb.input_ids.device))
                loss_sum, h = self.model(mb.input_ids, mb.labels, layout, timer)
            loss = loss_sum / mb.loss_normaliser
            t2 = self._now()
            loss.backward()
            held_mb, rec_mb = self.activations.release()
            if held_mb >= act_peak[0]:
                act_peak = (held_mb, mb.num_tokens)
            t3 = self._now()
            phases["forward"] += t2 - t1
            phases["backward"] += t3 - t2
            per_mb.append({"recompute": mode, "tokens": mb.num_tokens, "activations": held_mb,
                           "recompute_bytes": rec_mb, "forward_s": t2 - t1, "backward_s": t3 - t2})
            loss_local += loss.detach().double().cpu()
            tokens += mb.num_tokens
            _add_bytes(nbytes, mb.context.bytes_sent())
            if keep_hidden:
                hidden.append(([list(sg) for sg in mb.segments], h.detach().float().cpu()))
        t4 = self._now()
        sent = self.allreduce_grads() if self.dp == "replicate" else self._fsdp_bytes(n_mb)
        t5 = self._now()
        phases["grad_allreduce"] = t5 - t4
        local_loss = float(loss_local)
        if self.world_size > 1:
            dist.all_reduce(loss_local)
        phases["attention"] = timer.totals.get("attention", 0.0)
        phases["remap"] = timer.totals.get("remap", 0.0)
        phases["linear"] = max(phases["forward"] + phases["backward"] - phases["attention"] - phases["remap"], 0.0)
        nbytes["allreduce"] = sent
        from .fsdp import held_bytes

        held = held_bytes(self.model)
        memory = {"params": held["params"], "grads": held["grads"], "activations": act_peak[0],
                  "activation_tokens": act_peak[1], "unsharded": self.activations.unsharded_peak,
                  "recompute": self.activations.recompute_peak}
        return StepResult(loss=float(loss_local), phases=phases, bytes=nbytes, tokens=tokens, hidden=hidden,
                          memory=memory, local_loss=local_loss, microbatches=per_mb)

    def _set_recompute(self, step: StepPlan, mbi: int, unit: int) -> str:
        """Set the model's recomputation for micro-batch ``mbi`` of ``step`` on this rank (of
        ``unit``) and return it: in a plan of choices per micro-batch, the unit's own in it
        (``MicroBatch.recompute_of``; the switches of the wrappers set once at start-up; the
        collectives are the same in every mode, so ranks may differ) - else the run's one mode."""
        if self.recompute != "per-microbatch":
            return self.recompute
        from .fsdp import set_recompute

        mode = step.microbatches[mbi].recompute_of(unit) or "none"
        set_recompute(self.model, mode)
        return mode

    def nonfinite(self, result: StepResult) -> tuple[int, str, float] | None:
        """``(rank, "loss" | "gradient norm", value)`` of the first rank whose share of the step's
        loss, or whose gradients, are not finite (None when all are). Collective: one all-gather of
        two numbers per rank."""
        from .optim import local_grad_sq

        # kept for the optimizer step's global norm: the gradients do not change in between
        self._grad_sq = local_grad_sq(self.params)
        gsq = self._grad_sq.to(self.device)
        mine = torch.stack([torch.tensor(result.local_loss, dtype=torch.float64, device=self.device), gsq])
        if self.world_size > 1:
            every = [torch.zeros_like(mine) for _ in range(self.world_size)]
            dist.all_gather(every, mine)
        else:
            every = [mine]
        vals = [v.cpu().tolist() for v in every]
        for what, i in (("loss", 0), ("gradient norm", 1)):
            for r, v in enumerate(vals):
                if not math.isfinite(v[i]):
                    return r, what, (v[i] if i == 0 else math.sqrt(v[i]) if v[i] >= 0 else v[i])
        return None

    def _tp_group(self, step: StepPlan, unit: int):
        """The TP group of this rank's unit in ``step`` (None for a one-rank unit)."""
        rep = self.header.replicas(step)[unit]
        if rep.tp == 1:
            return None
        if not getattr(self.model, "supports_tp", True):
            raise InputError(f"step {step.step}: replica {unit} has tp={rep.tp}; Hugging Face models run "
                             "plans without tensor parallelism only")
        hq = self.header.model.num_heads
        if rep.tp > hq:
            raise InputError(f"step {step.step}: replica {unit} has tp={rep.tp}, more than the model's {hq} "
                             "attention heads")
        from .tp import TPGroup

        self.used_tp = True
        pg = self.groups.get(rep.ranks) if self.groups is not None else None
        return TPGroup(ranks=list(rep.ranks), rank=self.rank, pg=pg)

    def _fsdp_bytes(self, n_mb: int) -> int:
        """Bytes this rank sent in FSDP's gradient reduce-scatters (ring estimate, fp32): one per
        micro-batch."""
        w = self.mesh.size() if self.mesh is not None else self.world_size
        if w == 1:
            return 0
        numel = sum(p.numel() for p in self.params)
        return int(n_mb * (w - 1) / w * numel * 4)

    def allreduce_grads(self) -> int:
        """SUM the gradients over all ranks in one flat buffer; returns bytes this rank sent."""
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.world_size == 1:
            return 0
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        off = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[off:off + n].view_as(g))
            off += n
        w = self.world_size
        return int(2 * (w - 1) / w * flat.numel() * flat.element_size())

    def measured_memory(self, result: StepResult) -> dict[str, int]:
        """This rank's memory for the step (after the optimizer step), by component: the shards
        of parameters, gradients (as the backward left them) and AdamW state it holds; FSDP's
        whole parameters and their pending gradients (``unsharded``, the most seen at once; CPU
        only); the peak bytes autograd saved for a backward, weights excluded
        (``activations``); the most one recomputation held (``recompute``). ``measured``: the
        CUDA allocator's peak on a GPU; on the CPU the sum of the components' peaks - the
        tensors the step holds, without the process's own footprint (interpreter, libraries,
        malloc's free lists) that the resident set also counts (``process_peak``)."""
        from .fsdp import held_bytes

        mem = dict(result.memory)
        mem["optimizer"] = held_bytes(self.model, self.optimizer)["optimizer"]
        mem["microbatches"] = [dict(m) for m in result.microbatches]
        mem["measured"] = (int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else
                           sum(mem.get(k, 0) for k in MEMORY_COMPONENTS))
        return mem

    def _shard_group(self):
        """The process group over which FSDP's gradient shards are summed for the global norm."""
        if self.mesh is None:
            return None
        return self.mesh["shard"].get_group() if self.mesh.ndim > 1 else self.mesh.get_group()

    def optimizer_step(self, k: int | None = None) -> float:
        """Clip the gradients (their global norm is kept in ``last_grad_norm``), set step ``k``'s
        learning rate and take the AdamW step; returns the time it took."""
        from .optim import clip_gradients

        t0 = self._now()
        local_sq, self._grad_sq = self._grad_sq, None
        self.last_grad_norm = clip_gradients(self.params, self.grad_clip, self._shard_group(), local_sq)
        if self.lr_schedule is not None and k is not None:
            self.last_lr = self.lr_at(k)
            for g in self.optimizer.param_groups:
                g["lr"] = self.last_lr
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        return self._now() - t0

    def lr_at(self, k: int) -> float:
        """Step ``k``'s learning rate: the schedule's value (``--lr`` throughout without one), whether
        or not the step updates anything (a step ``--nan-policy skip`` leaves out reports it too)."""
        return float(self.lr_schedule(k)) if self.lr_schedule is not None else self.base_lr

    def drop_gradients(self) -> float:
        """Leave the step out (``--nan-policy skip``): its gradients are dropped and nothing is
        updated; returns the time the optimizer took (none)."""
        for p in self.params:
            p.grad = None
        self._grad_sq = None
        return 0.0
