"""torchtitan's Llama 3 trained on a zeppelin plan, through torchtitan's own extension point.

torchtitan builds every module from a config; a Llama 3 attention layer takes its *inner
attention* (the kernel between RoPE and the output projection) from
``GQAttention.Config.inner_attention``, and its forward passes ``attention_masks`` from
``Decoder.forward`` straight to that inner attention. zeppelin plugs in there, without forking:

* :class:`ZeppelinInnerAttention` — a torchtitan ``Module`` with its own ``Config``, used as
  ``inner_attention``: it remaps q/k/v to the plan's attention layout, runs
  ``zeppelin.runtime.attention`` and remaps the output back;
* the model is called as ``model(tokens, positions=..., attention_masks=micro_batch.context)``:
  ``positions`` restart per sequence (torchtitan's RoPE reads them), the zeppelin context rides in
  ``attention_masks``;
* data: the plan's micro-batches (``zeppelin.runtime.open_plan``) instead of torchtitan's loader;
  loss: each micro-batch's summed cross-entropy over the step's global count of predicted tokens
  (torchtitan's own normalisation, ``global_valid_tokens``); FSDP2 with SUM gradient reduction.

The loop here is a plain one; docs/API.md says what torchtitan's ``Trainer`` would need to run it
(a dataloader and one hook). Run on 2 CPU processes (gloo)::

    zeppelin plan -c local-cpu:1x2 --model tiny --steps 3 --tokens-per-step 1024 --max-seq-len 512 \\
        -o /tmp/tiny.plan.jsonl -q
    torchrun --standalone --nproc-per-node 2 examples/torchtitan_llama.py /tmp/tiny.plan.jsonl
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.protocols.module import Module

import zeppelin.runtime as z


class ZeppelinInnerAttention(Module):
    """torchtitan inner attention running the plan's attention (``attention_masks``: the
    micro-batch's ``zeppelin.runtime.AttentionContext``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, **kwargs):
        ctx = attention_masks
        if not isinstance(ctx, z.AttentionContext) or q_BLNH.shape[0] != 1:
            raise ValueError("ZeppelinInnerAttention needs batch size 1 and attention_masks=micro_batch.context")
        q, k, v = q_BLNH[0], k_BLNH[0], v_BLNH[0]                  # [T, heads, head_dim], linear layout
        hq, hkv = q.shape[1], k.shape[1]
        if ctx.remapped:                                          # one all-to-all for q, k and v
            qkv = z.to_attention_layout(torch.cat([q, k, v], dim=1), ctx)
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        o = z.attention(q, k, v, ctx, scale=scale)
        return z.to_linear_layout(o, ctx)[None]


def llama_config(spec, inner_attention: Module.Config) -> Llama3Model.Config:
    """A torchtitan Llama 3 config of the plan's model (``steps.header.model``)."""
    dim, heads = spec.hidden, spec.num_heads
    lin = {"weight": lambda w: torch.nn.init.trunc_normal_(w, std=0.02)}
    ones = {"weight": torch.nn.init.ones_}
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=1 << 16, theta=spec.rope_theta)
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, eps=spec.norm_eps, param_init=ones),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=spec.norm_eps, param_init=ones),
        attention=make_gqa_config(dim=dim, n_heads=heads, n_kv_heads=spec.num_kv_heads, wqkv_param_init=lin,
                                  wo_param_init=lin, inner_attention=inner_attention, rope=rope),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=spec.ffn_hidden, w1_param_init=lin, w2w3_param_init=lin),
    ) for _ in range(spec.num_layers)]
    return Llama3Model.Config(
        dim=dim, vocab_size=spec.vocab_size, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=spec.vocab_size, embedding_dim=dim,
                                        param_init={"weight": lambda w: torch.nn.init.normal_(w, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, eps=spec.norm_eps, param_init=ones),
        lm_head=Linear.Config(in_features=dim, out_features=spec.vocab_size, param_init=lin))


def build_model(spec, seed: int = 0, zeppelin: bool = True) -> Llama3Model:
    inner = ZeppelinInnerAttention.Config() if zeppelin else ScaledDotProductAttention.Config()
    model = llama_config(spec, inner).build()
    torch.manual_seed(seed)  # the same initial weights on every rank (and in a reference)
    model.init_states()
    return model


def shard(model: Llama3Model) -> None:
    """FSDP2 per transformer block plus the root; gradients SUMMED over ranks (the loss is
    already divided by the step's global token count)."""
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def train(plan: str, rank: int, world_size: int, *, steps: int | None = None, lr: float = 1e-3, seed: int = 0,
          data=None, keep_grads: bool = False) -> dict:
    plan_steps = z.open_plan(plan, rank=rank, world_size=world_size, data=data)
    model = build_model(plan_steps.header.model, seed)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = {"losses": [], "grads": [], "predicted_s": [], "measured_s": []}
    for k in range(len(plan_steps) if steps is None else steps):
        sc = plan_steps[k]
        start = time.perf_counter()
        step_loss = torch.zeros((), dtype=torch.float64)
        for mb in sc:
            logits = model(mb.input_ids[None], positions=mb.position_ids[None], attention_masks=mb.context)
            loss = mb.loss(logits)
            loss.backward()
            step_loss += loss.detach().double()
        dist.all_reduce(step_loss)
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
    ap.add_argument("--lr", type=float, default=0.1)
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
