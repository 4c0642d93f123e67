"""The one log-sum-exp merge of partial attention results, used by every variant that splits a
query row's keys over several blocks (ring rounds, chunk pairs, tests and benchmarks that tile).

A block's result is ``(out_b, lse_b)``: its softmax-weighted values and the log-sum-exp of its
scores per query row. Two blocks over disjoint keys merge exactly: the merged log-sum-exp is
``logaddexp(lse_a, lse_b)`` and each output is weighted by ``exp(lse_x - lse_merged)``.
"""

from __future__ import annotations

import torch

__all__ = ["merge_partial", "new_accumulators", "out_lse_function"]


def new_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty float32 accumulators for ``q``'s rows: ``out [T, Hq, D]`` zeros, ``lse [Hq, T]`` -inf
    (no key seen yet)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def merge_partial(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> None:
    """In place: merge a partial result (out_b, lse_b) into float32 accumulators.

    ``out_acc [T, H, D]`` fp32, ``lse_acc [H, T]`` fp32. Handles ``-inf`` (no visible key) on
    either side."""
    new = torch.logaddexp(lse_acc, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    wa = torch.exp(lse_acc - safe).transpose(0, 1).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).transpose(0, 1).unsqueeze(-1)
    out_acc.mul_(wa).add_(out_b.float() * wb)
    lse_acc.copy_(new)


def out_lse_function(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd function over ``(q, k, v, *args)`` from a no-autograd ``forward(q, k, v, *args)
    -> (out, lse)`` and ``backward(dout, q, k, v, out, lse, *args) -> (dq, dk, dv)``: the forward
    keeps q, k, v and its merged ``out``/``lse``, the backward recomputes from them (the form every
    attention variant here shares). ``args`` (layouts, transports, scales) get no gradient."""

    def fwd(ctx, q, k, v, *args):
        out, lse = forward(q, k, v, *args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = args
        return out

    def bwd(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return (dq, dk, dv, *(None,) * len(ctx.args))

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})
