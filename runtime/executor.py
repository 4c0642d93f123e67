"""The executor: runs a plan step by step on the ranks it names.

Per step, on every rank::

    for each micro-batch:  build the rank's inputs (linear layout; with tensor parallelism the
                           rank's sequence shard of its unit's buffer) -> forward (remaps, the
                           plan's attention engine, TP-SP linears) -> loss / predicted tokens of
                           the step -> backward
    gradient all-reduce (SUM over every rank; the loss is already divided by the step's global
    number of predicted tokens, so the sum is exactly the single-process gradient)

Tensor parallelism (uniform ``header.tp`` or a step's mixed-TP ``replicas``, Hydraulis): every rank
keeps the whole parameters (the canonical layout) and a TP rank computes with its shard of them
(:class:`zeppelin.runtime.model.TPContext`), so its gradient is non-zero only where its shard, its
heads or its tokens contributed. The one SUM all-reduce over all ranks therefore assembles the full
gradient across replicas of any TP layout, and the identical AdamW step on every rank keeps the
parameters and the optimizer state identical everywhere. (The price: TP does not reduce parameter
or optimizer memory here; the activations and GEMMs are sharded.)
    [--verify: rank 0 recomputes the step single-process and compares]
    AdamW step, metrics line, checkpoint every N steps

Start-up checks run on every rank before any training collective: world size, plan input hashes
against ``--model``/``--data``, checkpoint compatibility. Each rank's verdict is exchanged with
one ``all_gather_object`` so that every rank exits with the same one-line error instead of some
ranks waiting for peers that already left.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zeppelin.schemas.common import InputError, content_hash
from zeppelin.schemas.plan import PlanHeader, PlanReader, StepPlan, check_embedded_specs, sample_problems

from .api import AttentionContext, attention, build_step, to_attention_layout, to_linear_layout
from .config import RunConfig
from .data import TokenSource, load_token_source, predicted_tokens
from . import startup
from .model import Layout, LlamaModel, PhaseTimer, reference_step
from .optim import LRSchedule


class VerifyError(RuntimeError):
    """``--verify`` found the distributed step differing from the reference beyond tolerance."""


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is not finite and ``--nan-policy stop`` ends the run (raised on
    the rank where it appeared; the other ranks raise :class:`PeerStopped`)."""


class PeerStopped(RuntimeError):
    """Another rank is reporting why the job ends (this rank leaves without a report)."""


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
        for mb in sc.microbatches:
            t1 = self._now()
            with self.activations.hooks():
                layout = PlanLayout(mb.context, mb.position_ids,
                                    real_rows(mb.segments, step.sequences).to(mb.input_ids.device))
                loss_sum, h = self.model(mb.input_ids, mb.labels, layout, timer)
            loss = loss_sum / mb.loss_normaliser
            t2 = self._now()
            loss.backward()
            held_mb = self.activations.release()
            if held_mb >= act_peak[0]:
                act_peak = (held_mb, mb.num_tokens)
            t3 = self._now()
            phases["forward"] += t2 - t1
            phases["backward"] += t3 - t2
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
                          memory=memory, local_loss=local_loss)

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
            self.last_lr = float(self.lr_schedule(k))
            for g in self.optimizer.param_groups:
                g["lr"] = self.last_lr
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        return self._now() - t0

    # -- --verify ------------------------------------------------------------------------------
    def verify(self, step: StepPlan, result: StepResult, tol: float, *, group=None,
               timeout_s: float | None = None) -> dict[str, Any] | None:
        """Rank 0 recomputes the step single-process in fp32 and compares loss, final hidden states and
        every parameter gradient (relative max-norm differences). Collective (FSDP
        gathers the whole parameters and gradients); returns the report
        on every rank (or raises :class:`VerifyError` on every rank when beyond ``tol``).

        ``group``: the process group the hidden states and the verdict travel on — a group whose
        timeout is the verification timeout (``timeout_s``, for the message), so that the other
        ranks wait for rank 0's reference as long as that, not the communication ``--timeout``.
        A verdict that does not come in time raises :class:`VerifyError` saying so."""
        gathered = [None] * self.world_size if self.rank == 0 else None
        if self.world_size > 1:
            dist.gather_object(result.hidden, gathered, dst=0, group=group)
        else:
            gathered = [result.hidden]
        ref_model = self._reference_model()
        report = None
        if self.rank == 0:
            from .lifecycle import maybe_fault

            maybe_fault(self.rank, step.step, "verify")
            ref = reference_step(ref_model, step.sequences, self.source, self.device,
                                 normaliser=max(predicted_tokens(step.sequences), 1),
                                 microbatches=step_microbatches(step))
            report = compare_with_reference(ref_model, step, result.loss, gathered, ref)
            report["tolerance"] = tol
            ok_grad = report["grad_rel"] <= tol
            if not ok_grad and self.dtype == "fp32":
                # beyond tol of the fp32 reference: judge both against an fp64 oracle. A trained fp32
                # model amplifies summation-order rounding; the distributed step passes when it is
                # as exact as the single-process fp32 step (within 2x of that step's own error).
                import copy

                m64 = copy.deepcopy(ref_model).double()
                m64.dtype = torch.float64
                ref64 = reference_step(m64, step.sequences, self.source, self.device,
                                       normaliser=max(predicted_tokens(step.sequences), 1),
                                       microbatches=step_microbatches(step))
                mine = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                        for n, p in ref_model.named_parameters()}
                report["grad_rel_vs_fp64"] = max(_rel(mine[n], g) for n, g in ref64["grads"].items())
                report["fp32_reference_vs_fp64"] = max(_rel(ref["grads"][n], g) for n, g in ref64["grads"].items())
                ok_grad = report["grad_rel_vs_fp64"] <= max(tol, 2 * report["fp32_reference_vs_fp64"])
            report["ok"] = max(report["loss_rel"], report["hidden_rel"]) <= tol and ok_grad
        box = [report]
        if self.world_size > 1:
            try:
                dist.broadcast_object_list(box, src=0, group=group)
            except Exception as e:
                low = str(e).lower()
                if self.rank != 0 and ("timed out" in low or "timeout" in low):
                    wait = f" within --verify-timeout {timeout_s:g} s" if timeout_s else ""
                    raise VerifyError(f"step {step.step}: --verify: no verdict from rank 0{wait} (its single-process "
                                      f"reference did not finish; raise --verify-timeout)") from None
                raise
        report = box[0]
        if not report["ok"]:
            raise VerifyError(
                f"step {step.step}: --verify failed: relative differences loss {report['loss_rel']:.3g}, "
                f"outputs {report['hidden_rel']:.3g}, gradients {report['grad_rel']:.3g} "
                f"(worst: {report['grad_worst']}) exceed tolerance {tol:g}"
                + (f"; vs an fp64 reference: distributed {report['grad_rel_vs_fp64']:.3g}, single-process fp32 "
                   f"{report['fp32_reference_vs_fp64']:.3g}" if "grad_rel_vs_fp64" in report else ""))
        return report


    def _reference_model(self) -> LlamaModel | None:
        """An unsharded fp32 copy of the model holding this step's whole gradients, on rank 0
        (None elsewhere); the model itself when it already is one. Collective under FSDP."""
        from .fsdp import full_params_and_grads

        if self.dp == "replicate" and self.model.dtype == torch.float32 and self.recompute == "none":
            return self.model if self.rank == 0 else None
        params, grads = full_params_and_grads(self.model)
        if self.rank != 0:
            return None
        if isinstance(self.model, LlamaModel):
            ref = LlamaModel(self.model.spec, seed=0)
        else:  # a transformers model (zeppelin.runtime.hf): a fresh one from the same config, built
            # without drawing from the global RNG (rank 0's RNG state stays what a resume restores)
            ref = self.model.reference_copy()
        ref = ref.to(self.device)
        ref.dtype = torch.float32
        with torch.no_grad():
            for name, p in ref.named_parameters():
                p.copy_(params[name])
                p.grad = grads[name].to(p.dtype)
        return ref


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference ||a-b||_2 / ||b||_2 (0 when both are zero).

    Norm-wise rather than element-wise: gradients such as the embedding's sum many contributions
    with cancellations, where an element-wise ratio measures fp32 summation order, not correctness.
    """
    if not a.numel():
        return 0.0
    d = float((a.double() - b.double()).norm())
    s = float(b.double().norm())
    return d / s if s > 0 else d


def compare_with_reference(model: LlamaModel, step: StepPlan, loss: float, gathered, ref) -> dict[str, Any]:
    """Loss, output and gradient differences of a distributed step vs its single-process reference:
    relative (norm-wise, worst tensor) and absolute (max |difference|)."""
    loss_abs = abs(loss - ref["loss"])
    loss_rel = loss_abs / max(abs(ref["loss"]), 1e-30)
    # reassemble the distributed final hidden states per sequence (padding rows dropped)
    worst_h = 0.0
    for per_rank in gathered:
        for segs, h in per_rank or []:
            row = 0
            for q, s, e in segs:
                L = step.sequences[q].length
                e_real = min(e, L)
                if e_real > s:
                    worst_h = max(worst_h, _rel(h[row:row + e_real - s], ref["hidden"][q][s:e_real].float().cpu()))
                row += e - s
    worst_g, worst_name, grad_abs = 0.0, "", 0.0
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        r = _rel(g, ref["grads"][name])
        grad_abs = max(grad_abs, float((g.double() - ref["grads"][name].double()).abs().max()))
        if r >= worst_g:
            worst_g, worst_name = r, name
    return {"loss_ref": ref["loss"], "loss_abs": loss_abs, "loss_rel": loss_rel, "hidden_rel": worst_h,
            "grad_rel": worst_g, "grad_abs": grad_abs, "grad_worst": worst_name}


# ---------------------------------------------------------------------------------------------
# The job: start-up checks, training loop, metrics, checkpoints
# ---------------------------------------------------------------------------------------------


def build_model(ref: str | None, header: PlanHeader, seed: int, device: torch.device):
    """The model a job trains: the transformers model of ``hf:DIR`` (:mod:`zeppelin.runtime.hf`)
    or the runtime's own Llama built from the plan's ModelSpec."""
    from zeppelin.schemas.hf import is_hf_ref

    if is_hf_ref(ref):
        from .hf import load_hf_model

        return load_hf_model(ref, seed=seed, device=device, spec=header.model)
    return LlamaModel(header.model, seed=seed).to(device)


def random_init_note(ref: str | None, seed: int) -> str | None:
    """The line announcing random initial weights of an ``hf:DIR`` without weight files (None when
    the directory has weights; the runtime's own models always start from their seeded init)."""
    from zeppelin.schemas.hf import hf_dir, hf_weight_files, is_hf_ref

    if not is_hf_ref(ref) or hf_weight_files(hf_dir(ref)):
        return None
    return f"{ref} holds no weight file: the model starts from random initialisation (seed {seed})"


def step_microbatches(step: StepPlan) -> list[list[int]]:
    """The sequences (indices into ``step.sequences``) of each micro-batch, in first-placement order."""
    out = []
    for mb in step.microbatches:
        seen: list[int] = []
        for p in mb.placements:
            if p.seq not in seen:
                seen.append(p.seq)
        out.append(seen)
    return out


def startup_checks(cfg: RunConfig, world_size: int, rank: int = 0) -> tuple[PlanReader, TokenSource, int, int]:
    """Everything a rank can decide alone, before any collective. Returns
    (reader, token source, first step, end step). Raises InputError.

    ``--follow``: the plan is read while it is written (:class:`zeppelin.schemas.io.stream.FollowReader`);
    the checks of each step (:func:`step_checks`) then run when it arrives, before it runs."""
    from zeppelin.schemas.io.stream import open_plan_reader, waiting_line

    cfg.check()  # the options' own bounds (a config may have been changed since it was made)
    reader = open_plan_reader(cfg.plan, follow=cfg.follow, digest=cfg.plan_digest,
                              on_wait=waiting_line if rank == 0 else None, wait_s=cfg.timeout_s)
    header = reader.header
    check_embedded_specs(reader)
    if header.world_size != world_size:
        raise InputError(f"the plan is for {header.world_size} ranks but the job has {world_size} "
                         f"(launch with --nproc-per-node/--nnodes giving {header.world_size} processes)")
    if cfg.model is not None:
        from zeppelin.schemas.model import resolve_model_ref

        spec = resolve_model_ref(cfg.model)
        if spec.attention_pattern() != header.model.attention_pattern():
            raise InputError(f"--model {cfg.model} runs {spec.attention_pattern()} attention but the plan was made for "
                             f"{header.model.attention_pattern()} attention (plan it for this model)")
        if content_hash(spec) != header.hashes.model:
            raise InputError(f"--model {cfg.model} does not match the plan: the plan was made for model "
                             f"{header.model.name!r} (hash {header.hashes.model}, given {content_hash(spec)})")
    own = header.model
    if (cfg.model is None or not cfg.model.startswith("hf:")) and (
            own.sliding_window is not None or own.is_moe or own.qk_norm or own.head_size is not None):
        raise InputError(f"the plan's model {own.name!r} ({own.attention_pattern()} attention"
                         f"{', mixture of experts' if own.is_moe else ''}) runs through transformers: pass "
                         "--model hf:DIR (the runtime's own model is a dense full-attention Llama)")
    if cfg.model is not None and cfg.model.startswith("hf:") and header.tp > 1:
        raise InputError(f"the plan uses tensor parallelism (tp={header.tp}); Hugging Face models run "
                         "data/sequence/context-parallel plans only (plan with --tp 1)")
    if header.tp > header.model.num_heads:
        raise InputError(f"the plan's tensor-parallel degree tp={header.tp} exceeds the model's "
                         f"{header.model.num_heads} attention heads")
    if cfg.export:
        from zeppelin.runtime.hf import export_problem

        why = export_problem(cfg.model, header.model)
        if why:
            raise InputError(why)
    if cfg.data is None and header.manifest.token_ids:
        raise InputError(f"the plan was made from a manifest with token ids ({header.manifest.path}); pass it "
                         "with --data (without it the run would train on synthetic ids)")
    source, mhash = load_token_source(header.model.vocab_size, header.seed, cfg.data)
    if cfg.data is not None and mhash is not None and mhash != header.hashes.manifest:
        raise InputError(f"--data {cfg.data} does not match the plan: the plan was made for manifest hash "
                         f"{header.hashes.manifest}, this one hashes to {mhash}")
    cfg.check_plan(header)  # --steps within the plan, --recompute as planned
    end = header.num_steps if cfg.steps is None else cfg.steps
    if not cfg.follow:  # every step runs here: checked before step 0
        for k in range(end):
            step_checks(cfg, reader, source, reader.step(k))
    if cfg.hsdp is not None and world_size % cfg.hsdp:
        raise InputError(f"--hsdp {cfg.hsdp} must divide the world size {world_size}")
    cfg.check_inputs(reader, end)  # weights, positions, --export, the metrics file against every input
    return reader, source, 0, end


def step_checks(cfg: RunConfig, reader: PlanReader, source: TokenSource, step: StepPlan, *,
                following: bool = False) -> None:
    """The checks of one step before it runs: the runtime executes it for the model
    (:mod:`zeppelin.schemas.runnable`) and every sample it names is in the manifest (never
    synthetic tokens instead)."""
    from zeppelin.schemas.hf import is_hf_ref
    from zeppelin.schemas.runnable import step_problem

    why = step_problem(reader.header, step, is_hf_ref(cfg.model))
    if why:
        raise InputError(f"zeppelin run cannot execute {why}" + ("" if following else " (nothing was run)"),
                         source=reader.path)
    lengths = getattr(getattr(source, "manifest", None), "lengths", None)
    if lengths is not None:
        probs = sample_problems(step, lengths)
        if probs:
            raise InputError(f"--data {cfg.data}: {probs[0]}")


class _Progress:
    """Rank 0's progress display: a rich bar on a terminal, one plain line per step otherwise."""

    def __init__(self, mode: str, total: int, start: int) -> None:
        self.mode = mode
        self.bar = None
        if mode == "auto":
            self.mode = "rich" if sys.stdout.isatty() else "plain"
        if self.mode == "rich":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("[bold]zeppelin run"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.description}"), TimeElapsedColumn(), TextColumn("ETA"),
                                TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("", total=total, completed=start)
        self.total = total

    def update(self, rec: dict) -> None:
        desc = (f"loss {rec['loss']:.4f}  {rec['step_time_s'] * 1e3:.0f} ms  "
                f"{rec['tokens_per_s']:.0f} tok/s")
        if rec.get("lr") is not None:
            desc += f"  lr {rec['lr']:.3g}"
        if rec.get("grad_norm") is not None:
            desc += f"  grad norm {rec['grad_norm']:.3g}"
        if rec.get("skipped"):
            desc += f"  skipped ({rec['skipped']})"
        if rec.get("mfu") is not None:
            desc += f"  MFU {rec['mfu'] * 100:.1f}%"
        if "verify" in rec:
            desc += f"  verify {max(rec['verify']['grad_rel'], rec['verify']['loss_rel']):.1e}"
        if self.mode == "rich":
            self.bar.update(self.task, advance=1, description=desc)
        elif self.mode == "plain":
            print(f"step {rec['step'] + 1}/{self.total}  {desc}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_job(cfg: RunConfig) -> dict[str, Any]:
    """Run a job on this rank (called by ``python -m zeppelin.runtime`` under torchrun).

    Returns a summary on rank 0 (``{}`` elsewhere). Raises InputError / VerifyError / runtime errors.
    """
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    store = None
    if os.environ.get("ZEPPELIN_STORE_FILE"):  # zeppelin-local: ranks meet through a file, no TCP store
        store = dist.FileStore(os.environ["ZEPPELIN_STORE_FILE"], world)
    elif "MASTER_ADDR" not in os.environ and world == 1:  # a single process without a launcher
        import tempfile

        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="zeppelin-store-"), "store"), 1)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    local_err: str | None = None
    try:
        reader, source, start, end = startup_checks(cfg, world, rank)
        header = reader.header
    except InputError as e:
        local_err = str(e)
        reader = header = source = None
        start = end = 0
    startup.mark("checks")
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()
                                         and (header is None or header.cluster.device == "cuda"))
    if want_cuda and not torch.cuda.is_available():
        local_err = local_err or "--device cuda: CUDA is not available on this machine"
        want_cuda = False
    backend = "nccl" if want_cuda else "gloo"
    if want_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=cfg.timeout_s),
                            **({"store": store} if store is not None else {}),
                            **({"device_id": device} if want_cuda else {}))
    startup.mark("rendezvous")
    try:
        return _run_initialised(cfg, rank, world, device, local_err, reader, header, source, start, end)
    finally:
        _teardown()


def _teardown() -> None:
    """Destroy every process group while the interpreter is fully alive.

    The group cache (and anything else holding a process group or a finished work handle) is
    dropped and collected *before* ``destroy_process_group``: a gloo group that survives into
    interpreter finalisation can abort the process at exit ("terminate called without an active
    exception") after the job itself succeeded."""
    import gc

    from .groups import set_default_cache

    set_default_cache(None)
    gc.collect()
    with contextlib.suppress(Exception):  # best effort at exit
        dist.destroy_process_group()
    gc.collect()


def _agree(world: int, err: str | None) -> None:
    """Exchange start-up verdicts; every rank raises the first error any rank found."""
    errs = [None] * world
    dist.all_gather_object(errs, err)
    for r, e in enumerate(errs):
        if e is not None:
            raise InputError(e if r == dist.get_rank() or e == err else f"rank {r}: {e}")


def _run_initialised(cfg, rank, world, device, local_err, reader, header, source, start, end):
    from .checkpoint import load_checkpoint_tensors, plan_hash, rng_state, save_checkpoint, set_rng_state
    from .groups import GroupCache, set_default_cache
    from .lifecycle import Heartbeat, maybe_fault, prepare_checkpoint_dir, resume_point
    from .memory import StepMemory

    # the checkpoint directory: writable, and locked by this run (rank 0 holds the lock until it exits)
    ckpt_lock = None
    if local_err is None and cfg.checkpoint_dir and rank == 0:
        try:
            ckpt_lock = prepare_checkpoint_dir(cfg.checkpoint_dir)
        except InputError as e:
            local_err = str(e)
    hparams = cfg.hyperparameters(header.seed if header is not None else None)
    # resume: find the checkpoint (rank 0's filesystem view is shared with every local rank)
    state = None
    ckpt_path = None
    if local_err is None and cfg.resume:
        try:
            found = resume_point(cfg.checkpoint_dir, plan_hash=plan_hash(header), world_size=world, end=end,
                                 hparams=hparams)
            if found is not None:
                ckpt_path, state = found
        except InputError as e:
            local_err = str(e)
    _agree(world, local_err)
    if rank == 0:  # the run's first lines: where its weights and its token ids come from
        init = random_init_note(cfg.model, cfg.seed if cfg.seed is not None else header.seed)
        if init:
            print(f"zeppelin run: {init}", flush=True)
        print(f"zeppelin run: {source.describe()}", flush=True)
    if state is not None:
        start = state["next_step"]
    verify_group, verify_timeout = None, None
    if cfg.verify and world > 1:
        # the verdict travels on a group of its own whose timeout accounts for the reference
        verify_timeout = cfg.verify_timeout_s or max(600.0, 4 * cfg.timeout_s)
        verify_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=verify_timeout))
    # one scan of the steps to run: validates every record (a corrupt line is reported with its
    # step number here, on every rank) and collects the process groups the steps need
    steps_iter = () if cfg.follow else (reader.step(k) for k in range(start, end))
    # (every rank reads the same file: a bad record fails all ranks identically, before any group;
    # a followed plan's steps bring their groups as they arrive)
    groups = GroupCache(world, header=header, steps=steps_iter)
    set_default_cache(groups)
    startup.mark("groups")
    seed = header.seed if cfg.seed is None else cfg.seed
    model = build_model(cfg.model, header, seed, device)
    dtype = cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")
    recompute = cfg.recompute if cfg.recompute is not None else getattr(header, "recompute", "none")
    ex = Executor(header, model, source, rank=rank, world_size=world, device=device, groups=groups,
                  lr=cfg.lr, weight_decay=cfg.weight_decay, tp_overlap=cfg.tp_overlap, tp_chunks=cfg.tp_chunks,
                  dp=cfg.dp, zero_stage=cfg.zero_stage, dtype=dtype, recompute=recompute, hsdp=cfg.hsdp,
                  betas=cfg.betas_pair, eps=cfg.eps, grad_clip=cfg.grad_clip,
                  lr_schedule=LRSchedule(cfg.lr, header.num_steps, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr))
    if state is not None:
        load_checkpoint_tensors(ckpt_path, model, ex.optimizer)
        if rank < len(state["rng"]):
            set_rng_state(state["rng"][rank])
    startup.report(rank, show=cfg.progress in ("rich", "plain") or (cfg.progress == "auto" and sys.stderr.isatty()))
    tol = cfg.verify_tol if cfg.verify_tol is not None else (1e-5 if dtype == "fp32" else 2e-2)
    metrics_path = cfg.metrics_path
    mfh = None
    progress = None
    tboard = None
    if rank == 0:
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        mfh = metrics_path.open("a" if state is not None else "w")
        progress = _Progress(cfg.progress, end, start)
        if cfg.tensorboard:
            tboard = _tensorboard(cfg.tensorboard)
    phash = plan_hash(header)
    losses: list[float] = []
    skipped = 0
    used_tp = False
    verify_worst = {"loss_rel": 0.0, "hidden_rel": 0.0, "grad_rel": 0.0}
    heartbeat = Heartbeat(os.environ.get("ZEPPELIN_ERROR_DIR"), rank)
    memory = StepMemory(device)
    if cfg.verify and rank == 0 and device.type == "cpu":
        from .memory import mmap_large_blocks

        mmap_large_blocks()  # the reference's freed tiles go back to the OS (no heap high-water mark)
    try:
        for k in range(start, end):
            step = reader.step(k)
            if cfg.follow:  # the step just arrived: its checks, then its process groups (collective)
                step_checks(cfg, reader, source, step, following=True)
                groups.add_steps([step])
            used_tp = used_tp or any(rep.tp > 1 for rep in header.replicas(step))
            heartbeat.step(k)
            maybe_fault(rank, k)
            memory.reset()
            t0 = time.perf_counter()
            res = ex.forward_backward(step, keep_hidden=cfg.verify)
            bad = ex.nonfinite(res)
            if bad is not None and cfg.nan_policy == "stop":
                r, what, v = bad
                if r != rank:
                    raise PeerStopped()
                raise NonFiniteError(f"step {k}: the {what} is {v} (not finite); the run stopped "
                                     "(--nan-policy stop; --nan-policy skip leaves such steps out)")
            tv = time.perf_counter()
            if cfg.verify:
                heartbeat.step(k, "verify")
                report = ex.verify(step, res, tol, group=verify_group, timeout_s=verify_timeout)
                heartbeat.step(k)
            else:
                report = None
            t_verify = time.perf_counter() - tv
            if bad is not None:  # --nan-policy skip: no update from this step
                for p in ex.params:
                    p.grad = None
                res.phases["optimizer"] = 0.0
            else:
                res.phases["optimizer"] = ex.optimizer_step(k)
            res.phases["step"] = time.perf_counter() - t0 - t_verify
            if report is not None:
                for key in ("loss_rel", "hidden_rel", "grad_rel", "grad_rel_vs_fp64", "fp32_reference_vs_fp64"):
                    if key in report:
                        verify_worst[key] = max(verify_worst.get(key, 0.0), report[key])
            mem = ex.measured_memory(res)
            mem["process_peak"] = int(memory.peak())
            res.phases["peak_memory_bytes"] = float(mem["process_peak"])
            res.phases["verify"] = t_verify
            per_rank = [None] * world
            dist.all_gather_object(per_rank, (res.phases, res.bytes, res.tokens, mem))
            if bad is None:
                losses.append(res.loss)
            else:
                skipped += 1
            if rank == 0:
                rec = _metrics_record(step, res.loss, per_rank, report, header)
                rec["lr"] = ex.last_lr
                rec["grad_norm"] = ex.last_grad_norm if bad is None else None
                _add_utilisation(rec, step, header)
                if tboard is not None:
                    _tensorboard_step(tboard, rec)
                if bad is not None:
                    rec["skipped"] = f"non-finite {bad[1]} on rank {bad[0]}"
                for r in rec["memory"]["exceeds_capacity"]:
                    print(f"zeppelin run: warning: step {step.step}: rank {r} measured "
                          f"{rec['memory']['measured_bytes'][r] / 1e9:.2f} GB, more than the "
                          f"{header.cluster.gpu.memory_gb:g} GB of a {header.cluster.gpu.name} the plan assumes",
                          file=sys.stderr, flush=True)
                mfh.write(json.dumps(finite_json(rec), allow_nan=False) + "\n")
                mfh.flush()
                progress.update(rec)
            if k - start < 3:  # the first steps' ends: the warm-up in the start-up trace
                startup.mark(f"step{k - start + 1}")
            if cfg.checkpoint_dir and ((cfg.checkpoint_every and (k + 1) % cfg.checkpoint_every == 0)
                                       or k + 1 == end):
                rngs = [None] * world
                dist.all_gather_object(rngs, rng_state())
                save_checkpoint(cfg.checkpoint_dir, next_step=k + 1, model=model, optimizer=ex.optimizer,
                                rng_states=rngs, plan_hash=phash, world_size=world, rank=rank,
                                extra={"hyperparameters": hparams})
    finally:
        heartbeat.close()
        startup.write_trace(rank)
        if progress is not None:
            progress.close()
        if tboard is not None:
            tboard.close()
        if mfh is not None:
            mfh.close()
    exported = None
    if cfg.export:  # every rank takes part in gathering the full state (collective under FSDP)
        from .hf import export_model, full_state_dict

        state_full = full_state_dict(model)
        if rank == 0:
            exported = str(export_model(model, header.model, cfg.export, state=state_full))
        del state_full
    # every rank is done with every transfer before any rank tears its groups down
    dist.barrier()
    if ckpt_lock is not None:
        ckpt_lock.release()
    if rank != 0:
        return {}
    summary = {"steps_run": end - start, "first_step": start, "losses": losses,
               "metrics": str(metrics_path)}
    if skipped:
        summary["skipped"] = skipped
    if used_tp:
        summary["tp_overlap"] = ex.tp_overlap
    if cfg.verify:
        summary["verify"] = verify_worst | {"tolerance": tol}
    if exported is not None:
        summary["export"] = exported
    return summary


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (metrics files are strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def model_flops(spec, lengths) -> float:
    """Model FLOPs of a training step (forward + backward, recomputation not counted): 6 per
    active parameter per token for the decoder blocks (an MoE layer's top-k and shared experts
    and its router, not every expert) and the LM head (the embedding is a lookup), and attention's
    12 ``q_dim`` per visible query-key pair of each layer (``L^2 / 2`` pairs causal, about ``L w``
    in a window of ``w``)."""
    h = spec.hidden
    attn_proj = h * (spec.q_dim + 2 * spec.kv_dim) + spec.q_dim * h
    mlp = (3 if spec.mlp == "swiglu" else 2) * h * spec.mlp_ffn_params(active=True)
    router = h * spec.num_experts if spec.is_moe else 0
    dense = (attn_proj + mlp + router) * spec.num_layers + spec.vocab_size * h

    def pairs(n: float, w: int | None) -> float:
        if w is None or n <= w:
            return n * n / 2.0
        return n * w - w * w / 2.0

    attn = sum(12.0 * spec.q_dim * pairs(float(n), w) for w in spec.layer_windows() for n in lengths)
    return 6.0 * dense * sum(lengths) + attn


def _add_utilisation(rec: dict[str, Any], step: StepPlan, header: PlanHeader) -> None:
    """Model FLOPs, the MFU estimate (against the peak of the plan's GPUs) and the measured step
    time relative to the plan's prediction."""
    flops = model_flops(header.model, [s.length for s in step.sequences])
    t = rec["step_time_s"]
    peak = header.cluster.gpu.peak_tflops * 1e12 * header.world_size
    rec["model_tflops"] = flops / 1e12
    rec["mfu"] = flops / (t * peak) if t > 0 else None
    measured = rec["memory"]["measured_bytes"]
    rec["max_memory_bytes"] = max(measured) if measured else 0
    pred = (rec.get("predicted") or {}).get("step_time_s")
    rec["predicted_step_time_s"] = pred
    rec["measured_over_predicted"] = t / pred if pred else None


#: the metrics written to TensorBoard (tag: key of the metrics record)
TENSORBOARD_SCALARS = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
                       "perf/tokens_per_s": "tokens_per_s", "perf/mfu": "mfu", "perf/step_time_s": "step_time_s",
                       "perf/predicted_step_time_s": "predicted_step_time_s",
                       "perf/measured_over_predicted": "measured_over_predicted",
                       "memory/max_bytes": "max_memory_bytes"}


def _tensorboard(directory: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise InputError("--tensorboard needs the tensorboard package (pip install tensorboard)") from None
    return SummaryWriter(log_dir=directory)


def _tensorboard_step(writer, rec: dict[str, Any]) -> None:
    for tag, key in TENSORBOARD_SCALARS.items():
        v = rec.get(key)
        if isinstance(v, (int, float)):
            writer.add_scalar(tag, v, rec["step"])
    writer.flush()


def _memory_record(step: StepPlan, per_rank: list, header: PlanHeader | None) -> dict[str, Any]:
    """Measured memory of every rank next to the plan's prediction for that rank."""
    mems = [pr[3] if len(pr) > 3 else {} for pr in per_rank]
    measured = [int(m.get("measured", 0)) for m in mems]
    out: dict[str, Any] = {
        "measured_bytes": measured,
        "params_bytes": [int(m.get("params", 0)) for m in mems],
        "grads_bytes": [int(m.get("grads", 0)) for m in mems],
        "optimizer_bytes": [int(m.get("optimizer", 0)) for m in mems],
        "activation_bytes": [int(m.get("activations", 0)) for m in mems],
        "unsharded_bytes": [int(m.get("unsharded", 0)) for m in mems],
        "recompute_bytes": [int(m.get("recompute", 0)) for m in mems],
        "process_peak_bytes": [int(m.get("process_peak", 0)) for m in mems],
        "activation_bytes_per_token": [round(int(m.get("activations", 0)) / m["activation_tokens"], 3)
                                       if m.get("activation_tokens") else 0.0 for m in mems],
        "predicted_bytes": None,
        "capacity_bytes": None,
        "exceeds_capacity": [],
    }
    if header is not None:
        cap = header.cluster.gpu.memory_gb * 1e9
        out["capacity_bytes"] = cap
        out["exceeds_capacity"] = [r for r, v in enumerate(measured) if v > cap]
        if step.prediction is not None:
            unit_of = {}
            for u, rep in enumerate(header.replicas(step)):
                for r in rep.ranks:
                    unit_of[r] = u
            gb = step.prediction.per_unit.memory_gb
            out["predicted_bytes"] = [int(gb[unit_of[r]] * 1e9) if unit_of.get(r, len(gb)) < len(gb) else None
                                      for r in range(len(per_rank))]
    return out


def _metrics_record(step: StepPlan, loss: float, per_rank: list, report: dict | None,
                    header: PlanHeader | None = None) -> dict[str, Any]:
    phases_names = ["data", "forward", "backward", "attention", "remap", "linear", "grad_allreduce", "optimizer",
                    "step"]
    phases = {n: [round(pr[0].get(n, 0.0), 6) for pr in per_rank] for n in phases_names}
    step_time = max(phases["step"])
    nbytes: dict[str, int] = {}
    for pr in per_rank:
        for cls, v in pr[1].items():
            nbytes[cls] = nbytes.get(cls, 0) + int(v)
    rec: dict[str, Any] = {
        "step": step.step,
        "loss": loss,
        "sequences": len(step.sequences),
        "tokens": step.tokens,
        "step_time_s": step_time,
        "tokens_per_s": step.tokens / step_time if step_time > 0 else 0.0,
        "phases_s": phases,
        "bytes_sent": nbytes,
        "tokens_per_rank": [pr[2] for pr in per_rank],
        "peak_memory_bytes": [int(pr[0].get("peak_memory_bytes", 0)) for pr in per_rank],
        "memory": _memory_record(step, per_rank, header),
    }
    if step.prediction is not None:
        p = step.prediction
        rec["predicted"] = {"step_time_s": p.step_time_s, "attention_s": p.per_unit.attention_s,
                            "linear_s": p.per_unit.linear_s, "comm_s": p.per_unit.comm_s,
                            "exposed_comm_s": p.per_unit.exposed_comm_s}
    if report is not None:
        rec["verify"] = report
    return rec
