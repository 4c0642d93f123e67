"""Your own FSDP2 loop training a Hugging Face Llama on a zeppelin plan (docs/API.md).

zeppelin decides which tokens each rank gets each step and how attention runs across ranks; the
model (transformers' LlamaForCausalLM), the sharding (FSDP2 ``fully_shard`` per decoder layer) and
the optimizer are yours. Run on 2 CPU processes (gloo) with a tiny model::

    zeppelin plan -c local-cpu:1x2 --model tiny --steps 3 --tokens-per-step 1024 --max-seq-len 512 \\
        -o /tmp/tiny.plan.jsonl -q
    torchrun --standalone --nproc-per-node 2 examples/hf_fsdp2_loop.py /tmp/tiny.plan.jsonl
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import zeppelin.runtime as z


def llama_config(spec) -> LlamaConfig:
    """The plan's model (``steps.header.model``) as a transformers config."""
    return LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden, intermediate_size=spec.ffn_hidden,
                       num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                       num_key_value_heads=spec.num_kv_heads, rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta,
                       tie_word_embeddings=spec.tie_embeddings, max_position_embeddings=1 << 20,
                       attention_dropout=0.0)


def build_model(spec, seed: int = 0, attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(seed)  # the same initial weights on every rank (and in a reference)
    config = llama_config(spec)
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config).float()


def shard(model: LlamaForCausalLM) -> None:
    """FSDP2: one unit per decoder layer plus the root. Gradients are SUMMED over ranks (not
    averaged): each rank's loss is already divided by the step's global token count."""
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def make_optimizer(params, name: str, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def train(plan: str, rank: int, world_size: int, *, steps: int | None = None, lr: float = 1e-3, seed: int = 0,
          data=None, optimizer: str = "adamw", keep_grads: bool = False) -> dict:
    """Train on the plan's steps; returns the step losses (and, with ``keep_grads``, every step's
    full gradients on rank 0, for tests)."""
    register = z.register_hf_attention()                   # attn_implementation "zeppelin"
    plan_steps = z.open_plan(plan, rank=rank, world_size=world_size, data=data)
    model = build_model(plan_steps.header.model, seed, attn_implementation=register)
    shard(model)
    opt = make_optimizer(model.parameters(), optimizer, lr)
    out = {"losses": [], "grads": [], "predicted_s": [], "measured_s": []}
    n = len(plan_steps) if steps is None else steps
    for k in range(n):
        sc = plan_steps[k]
        start = time.perf_counter()
        step_loss = torch.zeros((), dtype=torch.float64)
        for mb in sc:                                      # micro-batches: gradients accumulate
            logits = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None],
                           zeppelin_context=mb.context, use_cache=False).logits
            loss = mb.loss(logits)                         # sum CE / the step's global token count
            loss.backward()
            step_loss += loss.detach().double()
        dist.all_reduce(step_loss)                         # the step's loss (for logging)
        if keep_grads:
            full = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
            if rank == 0:
                out["grads"].append(full)
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(step_loss))
        out["measured_s"].append(time.perf_counter() - start)
        out["predicted_s"].append(sc.predicted_step_time_s)
        if rank == 0:
            print(f"step {sc.step}: loss {float(step_loss):.4f}  measured {out['measured_s'][-1] * 1e3:.0f} ms  "
                  f"predicted {(sc.predicted_step_time_s or 0) * 1e3:.1f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--data", default=None, help="dataset manifest the plan was made from (default: synthetic ids)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    try:
        train(args.plan, dist.get_rank(), dist.get_world_size(), steps=args.steps, lr=args.lr, data=args.data)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
