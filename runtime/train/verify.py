"""``--verify``: rank 0 recomputes every step single-process and compares.

The reference (:func:`zeppelin.runtime.model.reference_step`) runs in fp32 on an unsharded copy of
the model holding the step's whole gradients; the loss, the final hidden states of every sequence
(gathered from the ranks that hold them) and every parameter gradient are compared norm-wise.
Beyond the tolerance of an fp32 run, both are judged against an fp64 oracle. The verdict travels
on a process group of its own whose timeout is ``--verify-timeout`` (:class:`Verifier`).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zeppelin.schemas.plan import StepPlan

from ..data import predicted_tokens
from ..executor import Executor, StepResult
from ..model import LlamaModel, reference_step

__all__ = ["Verifier", "VerifyError", "compare_with_reference", "step_microbatches", "verify_step"]

#: the report's figures whose worst value over the run the summary gives
WORST = ("loss_rel", "hidden_rel", "grad_rel", "grad_rel_vs_fp64", "fp32_reference_vs_fp64")


class VerifyError(RuntimeError):
    """``--verify`` found the distributed step differing from the reference beyond tolerance."""


class Verifier:
    """A run's ``--verify``: its process group, tolerance and the worst differences seen."""

    def __init__(self, tol: float, timeout_s: float, rank: int, world: int) -> None:
        self.tol = tol
        self.group, self.timeout_s = None, None
        if world > 1:  # the verdict's group: its timeout accounts for the reference
            self.timeout_s = timeout_s
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.worst = {"loss_rel": 0.0, "hidden_rel": 0.0, "grad_rel": 0.0}

    @staticmethod
    def bound_memory(rank: int, device: torch.device) -> None:
        """On a CPU, rank 0's freed reference tiles go back to the OS (no heap high-water mark)."""
        if rank == 0 and device.type == "cpu":
            from ..memory import mmap_large_blocks

            mmap_large_blocks()

    def check(self, ex: Executor, step: StepPlan, result: StepResult, heartbeat) -> tuple[dict[str, Any], float]:
        """The step's report (every rank) and the seconds it took."""
        t0 = time.perf_counter()
        heartbeat.step(step.step, "verify")
        report = verify_step(ex, step, result, self.tol, group=self.group, timeout_s=self.timeout_s)
        heartbeat.step(step.step)
        for key in WORST:
            if key in report:
                self.worst[key] = max(self.worst.get(key, 0.0), report[key])
        return report, time.perf_counter() - t0

    def summary(self) -> dict[str, Any]:
        return self.worst | {"tolerance": self.tol}


def verify_step(ex: Executor, step: StepPlan, result: StepResult, tol: float, *, group=None,
                timeout_s: float | None = None) -> dict[str, Any]:
    """Rank 0 recomputes the step single-process in fp32 and compares loss, final hidden states and
    every parameter gradient (relative max-norm differences). Collective (FSDP gathers the whole
    parameters and gradients); returns the report on every rank (or raises :class:`VerifyError` on
    every rank when beyond ``tol``).

    ``group``: the process group the hidden states and the verdict travel on - a group whose
    timeout is the verification timeout (``timeout_s``, for the message), so that the other
    ranks wait for rank 0's reference as long as that, not the communication ``--timeout``.
    A verdict that does not come in time raises :class:`VerifyError` saying so."""
    gathered = [None] * ex.world_size if ex.rank == 0 else None
    if ex.world_size > 1:
        dist.gather_object(result.hidden, gathered, dst=0, group=group)
    else:
        gathered = [result.hidden]
    ref_model = reference_model(ex)
    report = _judge(ex, ref_model, step, result, gathered, tol) if ex.rank == 0 else None
    report = _verdict(ex, report, step, group, timeout_s)
    if not report["ok"]:
        raise VerifyError(
            f"step {step.step}: --verify failed: relative differences loss {report['loss_rel']:.3g}, "
            f"outputs {report['hidden_rel']:.3g}, gradients {report['grad_rel']:.3g} "
            f"(worst: {report['grad_worst']}) exceed tolerance {tol:g}"
            + (f"; vs an fp64 reference: distributed {report['grad_rel_vs_fp64']:.3g}, single-process fp32 "
               f"{report['fp32_reference_vs_fp64']:.3g}" if "grad_rel_vs_fp64" in report else ""))
    return report


def _reference(model, ex: Executor, step: StepPlan):
    return reference_step(model, step.sequences, ex.source, ex.device,
                          normaliser=max(predicted_tokens(step.sequences), 1), microbatches=step_microbatches(step))


def _judge(ex: Executor, ref_model, step: StepPlan, result: StepResult, gathered, tol: float) -> dict[str, Any]:
    """Rank 0's report on the step against its single-process reference."""
    from ..lifecycle import maybe_fault

    maybe_fault(ex.rank, step.step, "verify")
    ref = _reference(ref_model, ex, step)
    report = compare_with_reference(ref_model, step, result.loss, gathered, ref)
    report["tolerance"] = tol
    ok_grad = report["grad_rel"] <= tol
    if not ok_grad and ex.dtype == "fp32":
        # beyond tol of the fp32 reference: judge both against an fp64 oracle. A trained fp32
        # model amplifies summation-order rounding; the distributed step passes when it is
        # as exact as the single-process fp32 step (within 2x of that step's own error).
        import copy

        m64 = copy.deepcopy(ref_model).double()
        m64.dtype = torch.float64
        ref64 = _reference(m64, ex, step)
        mine = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref_model.named_parameters()}
        report["grad_rel_vs_fp64"] = max(_rel(mine[n], g) for n, g in ref64["grads"].items())
        report["fp32_reference_vs_fp64"] = max(_rel(ref["grads"][n], g) for n, g in ref64["grads"].items())
        ok_grad = report["grad_rel_vs_fp64"] <= max(tol, 2 * report["fp32_reference_vs_fp64"])
    report["ok"] = max(report["loss_rel"], report["hidden_rel"]) <= tol and ok_grad
    return report


def _verdict(ex: Executor, report, step: StepPlan, group, timeout_s: float | None) -> dict[str, Any]:
    """Rank 0's report on every rank (a verdict that does not come in time: :class:`VerifyError`)."""
    box = [report]
    if ex.world_size > 1:
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        except Exception as e:
            low = str(e).lower()
            if ex.rank != 0 and ("timed out" in low or "timeout" in low):
                wait = f" within --verify-timeout {timeout_s:g} s" if timeout_s else ""
                raise VerifyError(f"step {step.step}: --verify: no verdict from rank 0{wait} (its single-process "
                                  f"reference did not finish; raise --verify-timeout)") from None
            raise
    return box[0]


def reference_model(ex: Executor) -> LlamaModel | None:
    """An unsharded fp32 copy of the model holding this step's whole gradients, on rank 0
    (None elsewhere); the model itself when it already is one. Collective under FSDP."""
    from ..fsdp import full_params_and_grads

    if ex.dp == "replicate" and ex.model.dtype == torch.float32 and ex.recompute == "none":
        return ex.model if ex.rank == 0 else None
    params, grads = full_params_and_grads(ex.model, keep=ex.rank == 0)  # the others: a tensor at a time
    if ex.rank != 0:
        return None
    if isinstance(ex.model, LlamaModel):
        ref = LlamaModel(ex.model.spec, seed=0)
    else:  # a transformers model (zeppelin.runtime.hf): a fresh one from the same config, built
        # without drawing from the global RNG (rank 0's RNG state stays what a resume restores)
        ref = ex.model.reference_copy()
    ref = ref.to(ex.device)
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


