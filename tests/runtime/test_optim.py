"""Optimizer flags of ``zeppelin run`` against torch's own: AdamW betas/eps/weight decay, a warmup +
cosine (or linear) learning-rate schedule and global gradient-norm clipping.

Five steps on 4 gloo ranks (FSDP2 ZeRO-3 and ZeRO-2, hybrid sharding, mixed TP-1/TP-2 replicas,
replicated) match a single-process reference built from ``torch.optim.AdamW``,
``torch.optim.lr_scheduler`` (``SequentialLR`` of ``LinearLR`` and ``CosineAnnealingLR``/``LinearLR``)
and ``torch.nn.utils.clip_grad_norm_`` within 1e-5: learning rates, gradient norms, losses and the
final parameters.
"""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_fsdp import _plan
from tests.support.numerics import assert_matches_reference, rel_err
from zeppelin.runtime.optim import LRSchedule
from zeppelin.schemas.plan import PlanHeader, StepPlan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORLD = 4
# eps 1e-5 (LLaMA's): Adam divides by sqrt(v) + eps, so where a gradient is near zero its update
# amplifies the fp32 summation-order differences of the distributed gradient by lr / eps
OPT = {"lr": 1e-3, "betas": (0.85, 0.99), "eps": 1e-5, "weight_decay": 0.1, "warmup": 2, "min_lr": 1e-4,
       "clip": 0.5}


def _train(rank: int, world: int, header_json: str, steps_json: list[str], dp: str, zero_stage: int,
           hsdp: int | None, kind: str, opt: dict):
    """Five steps with the runtime's optimizer path (Executor.optimizer_step); rank 0 returns the
    learning rates, gradient norms, losses and whole final parameters."""
    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.executor import Executor
    from zeppelin.runtime.fsdp import full_params_and_grads
    from zeppelin.runtime.groups import GroupCache, set_default_cache
    from zeppelin.runtime.model import LlamaModel

    header = PlanHeader.model_validate_json(header_json)
    steps = [StepPlan.model_validate_json(s) for s in steps_json]
    cache = GroupCache(world, header=header, steps=steps)
    set_default_cache(cache)
    model = LlamaModel(header.model, seed=3)
    sched = LRSchedule(opt["lr"], header.num_steps, kind, opt["warmup"], opt["min_lr"])
    ex = Executor(header, model, TokenSource(header.model.vocab_size, header.seed), rank=rank, world_size=world,
                  device=torch.device("cpu"), groups=cache, dp=dp, zero_stage=zero_stage, hsdp=hsdp,
                  lr=opt["lr"], weight_decay=opt["weight_decay"], betas=opt["betas"], eps=opt["eps"],
                  grad_clip=opt["clip"], lr_schedule=sched)
    lrs, norms, losses = [], [], []
    for k, step in enumerate(steps):
        res = ex.forward_backward(step)
        ex.optimizer_step(k)
        lrs.append(ex.last_lr)
        norms.append(ex.last_grad_norm)
        losses.append(res.loss)
    params, _ = full_params_and_grads(model)
    return {"lrs": lrs, "norms": norms, "losses": losses, "params": params if rank == 0 else None}


def _reference(header: PlanHeader, steps: list[StepPlan], kind: str, opt: dict = OPT):
    """The same steps single-process with torch's AdamW, schedulers and clip_grad_norm_."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    from zeppelin.runtime.data import TokenSource, predicted_tokens
    from zeppelin.runtime.model import LlamaModel, reference_step

    model = LlamaModel(header.model, seed=3)
    source = TokenSource(header.model.vocab_size, header.seed)
    adamw = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=opt["betas"], eps=opt["eps"],
                              weight_decay=opt["weight_decay"])
    w, decay = opt["warmup"], header.num_steps - opt["warmup"]
    warm = LinearLR(adamw, start_factor=1 / w, end_factor=1.0, total_iters=w - 1)
    after = (CosineAnnealingLR(adamw, T_max=decay, eta_min=opt["min_lr"]) if kind == "cosine" else
             LinearLR(adamw, start_factor=1.0, end_factor=opt["min_lr"] / opt["lr"], total_iters=decay))
    sched = SequentialLR(adamw, [warm, after], milestones=[w])
    lrs, norms, losses = [], [], []
    for step in steps:
        ref = reference_step(model, step.sequences, source, normaliser=max(predicted_tokens(step.sequences), 1))
        for name, p in model.named_parameters():
            p.grad = ref["grads"][name].clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), opt["clip"])))
        lrs.append(adamw.param_groups[0]["lr"])
        losses.append(ref["loss"])
        adamw.step()
        sched.step()
    return {"lrs": lrs, "norms": norms, "losses": losses, "params": dict(model.named_parameters())}


CASES = [("zeppelin", "fsdp", 3, None, "cosine"), ("zeppelin", "fsdp", 2, None, "cosine"),
         ("zeppelin", "fsdp", 3, 2, "cosine"), ("hydraulis", "fsdp", 3, None, "cosine"),
         ("hydraulis", "replicate", 0, None, "linear")]


@pytest.mark.parametrize("planner,dp,zero_stage,hsdp,kind", CASES,
                         ids=["zero3", "zero2", "hsdp2x2", "tp-replicas-zero3", "tp-replicas-replicated-linear"])
def test_schedule_and_clipping_match_torch(pool, planner, dp, zero_stage, hsdp, kind):
    header, steps = _plan(planner)
    if planner == "hydraulis":
        assert any(r.tp == 2 for s in steps for r in s.replicas)
    outs = pool.run(_train, header.model_dump_json(), [s.model_dump_json() for s in steps], dp, zero_stage,
                    hsdp, kind, OPT, timeout=240)
    got, ref = outs[0], _reference(header, steps, kind)
    assert len(got["lrs"]) == len(steps) == 5
    # warmup then decay: the schedule moved, and clipping acted on at least one step
    assert got["lrs"][0] < got["lrs"][1] and got["lrs"][-1] < got["lrs"][1]
    assert any(n > OPT["clip"] for n in ref["norms"]), ref["norms"]
    for k in range(len(steps)):
        assert abs(got["lrs"][k] - ref["lrs"][k]) <= 1e-12 * OPT["lr"], (k, got["lrs"], ref["lrs"])
        assert rel_err(got["norms"][k], ref["norms"][k]) <= 1e-5, (k, got["norms"], ref["norms"])
        assert rel_err(got["losses"][k], ref["losses"][k]) <= 1e-5, (k, got["losses"], ref["losses"])
    for name, p in ref["params"].items():
        assert_matches_reference(got["params"][name], p.detach(), 1e-5, name)
    assert all(o["lrs"] == got["lrs"] and o["norms"] == got["norms"] for o in outs)


def test_schedule_shapes():
    """The schedule's closed forms: warmup from lr/W, cosine and linear to min_lr at the plan's end."""
    s = LRSchedule(1.0, 10, "cosine", warmup_steps=4, min_lr=0.1)
    assert [s(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(9) == pytest.approx(0.1 + 0.9 * (1 + torch.cos(torch.tensor(torch.pi * 5 / 6)).item()) / 2)
    lin = LRSchedule(1.0, 10, "linear", warmup_steps=0, min_lr=0.0)
    assert lin(5) == pytest.approx(0.5) and lin(10) == 0.0
    assert LRSchedule(2.0, 10)(7) == 2.0


def test_flags_are_checked_recorded_and_refused_on_resume_when_changed():
    """The optimizer flags are part of the hyperparameters a checkpoint records; --resume with any
    of them changed is refused naming each one; malformed values are one-line errors."""
    from zeppelin.runtime.config import RunConfig
    from zeppelin.runtime.lifecycle import check_resume_hyperparameters
    from zeppelin.schemas.common import InputError

    a = RunConfig(plan="p.jsonl", lr_schedule="cosine", warmup_steps=10, min_lr=1e-4, grad_clip=1.0)
    saved = a.hyperparameters(plan_seed=0)
    assert saved == {"lr": 1e-3, "weight_decay": 0.0, "seed": 0, "betas": [0.9, 0.95], "eps": 1e-8,
                     "lr_schedule": "cosine", "warmup_steps": 10, "min_lr": 1e-4, "grad_clip": 1.0}
    check_resume_hyperparameters(saved, a.hyperparameters(plan_seed=0))
    b = RunConfig(plan="p.jsonl", lr_schedule="linear", warmup_steps=10, min_lr=1e-4, grad_clip=0.5,
                  betas="0.9,0.999", eps=1e-6)
    with pytest.raises(InputError) as e:
        check_resume_hyperparameters(saved, b.hyperparameters(plan_seed=0))
    assert str(e.value) == ("--resume with other hyperparameters than the checkpoint was trained with: --betas "
                            "[0.9, 0.999] (checkpoint: [0.9, 0.95]), --eps 1e-06 (checkpoint: 1e-08), --lr-schedule "
                            "'linear' (checkpoint: 'cosine'), --grad-clip 0.5 (checkpoint: 1.0); pass the "
                            "checkpoint's values, or start a new --checkpoint-dir")
    for kw, msg in ((dict(betas="0.9"), "--betas must be two numbers in [0, 1) separated by a comma, e.g. 0.9,0.95 "
                                        "(got '0.9')"),
                    (dict(betas="0.9,1.0"), "--betas must be two numbers in [0, 1) separated by a comma, e.g. "
                                            "0.9,0.95 (got '0.9,1.0')"),
                    (dict(min_lr=0.1), "--min-lr 0.1 is above --lr 0.001"),
                    (dict(lr_schedule="step"), "--lr-schedule must be constant, linear or cosine (got 'step')"),
                    (dict(grad_clip=0.0), "--grad-clip must be greater than 0 (got 0)")):
        with pytest.raises(InputError) as e:
            RunConfig(plan="p.jsonl", **kw)
        assert str(e.value) == msg
    argv = RunConfig(plan="p.jsonl", betas="0.9,0.999", grad_clip=1.0, lr_schedule="cosine").to_argv()
    assert argv == ["p.jsonl", "--betas", "0.9,0.999", "--lr-schedule", "cosine", "--grad-clip", "1.0"]
