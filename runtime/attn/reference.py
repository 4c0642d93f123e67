"""The reference: causal attention per sequence by explicit softmax, autograd through plain torch
ops (float64-capable). Tests and benchmarks hold every variant against it; it shares no kernel
code with them beyond the causal mask and the expansion of KV heads to query heads (GQA).
"""

from __future__ import annotations

import itertools

import torch

from .. import kernels as _k
from .local import bounds

__all__ = ["reference_attention"]


def reference_attention(q, k, v, cu_seqlens, scale: float | None = None):
    """Causal attention of the packed sequences ``cu_seqlens`` delimits (``q [T, Hq, D]``,
    ``k, v [T, Hkv, D]``), by explicit softmax."""
    sc = _k.default_scale(q, scale)
    hq = q.shape[1]
    outs = []
    for s, e in itertools.pairwise(bounds(cu_seqlens)):
        qs, ks, vs = q[s:e], _k._expand(k[s:e], hq), _k._expand(v[s:e], hq)
        sco = torch.einsum("qhd,khd->hqk", qs, ks) * sc
        m = _k.causal_mask(e - s, e - s, 0, 0, q.device)
        p = torch.softmax(sco.masked_fill(~m, _k.NEG_INF), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
    return torch.cat(outs, 0) if outs else q.new_zeros(q.shape)
