"""Sharded data parallelism with PyTorch FSDP2, mixed precision and activation recomputation.

The runtime shards its model with FSDP2 (``torch.distributed.fsdp.fully_shard``): every decoder
block is one FSDP unit, the root module (embedding, final norm, LM head) another. The plan's
``zero_stage`` chooses what a rank holds between the forward and the backward of a micro-batch:

==========  ==========================================  =====================  ==============
ZeRO stage  parameters between forward and backward     gradients              AdamW state
==========  ==========================================  =====================  ==============
3           re-sharded after each block's forward (1/N;  reduce-scattered       sharded (1/N)
            re-gathered for its backward)                (1/N)
1, 2        kept unsharded (whole, compute dtype)       reduce-scattered       sharded (1/N)
                                                        (1/N)
0           ``--dp replicate``: whole parameters, gradients and AdamW state on every rank;
            one SUM all-reduce of the gradients after the backward
==========  ===========================================================================

FSDP reduce-scatters each block's gradient as soon as the backward has produced it, after every
micro-batch, so ZeRO-1 plans run with ZeRO-2's holdings (sharded gradients). The planner's memory model (``CostModel.model_state_bytes``) charges exactly these
holdings: fp32 master parameters, gradients and moments ``16 P / N``; whole compute-dtype
parameters for ZeRO-1/2; for ZeRO-3 the unsharded root module (FSDP does not re-shard the root
after forward), two blocks (computing and prefetched) and one block's gradient.

The gradient reduction is a SUM (the runtime's loss is already divided by the step's global
number of predicted tokens): FSDP's divide factor is set to 1 and its collectives to SUM only.

Hybrid sharding (``hsdp``): a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` of
``(replicate, shard)`` — shard inside a group of ranks (a node), replicate across groups; FSDP
reduce-scatters inside the group and all-reduces across groups.

Tensor parallelism composes with FSDP through the canonical layout: FSDP all-gathers a block's
whole parameters before its forward/backward (over every rank of the mesh, TP ranks included),
and a TP rank computes with its slice of them; its gradient is non-zero only on its slice, so the
SUM reduce-scatter over every rank assembles the full gradient of any TP layout (mixed-TP
replicas of Hydraulis included). The tests check this against the single-process reference.

Mixed precision (``MixedPrecisionPolicy``): parameters are all-gathered and computed in bf16,
the sharded master parameters, the gradients' reduction and the optimizer stay fp32.

Recomputation (``torch.utils.checkpoint`` through ``checkpoint_wrapper``, non-reentrant):

* ``none``      — autograd keeps every activation;
* ``selective`` — each block's MLP (norm excluded) is recomputed in the backward: the SwiGLU
  intermediates (the largest per-token activations) are not kept; the attention part, whose
  recomputation would repeat the plan's ring/all-to-all communication, is kept;
* ``full``      — each block keeps only its input and recomputes its whole forward (attention
  communication included) in the backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

DP_MODES = ("fsdp", "replicate")
RECOMPUTE_MODES = ("none", "selective", "full")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_modes(*, dp: str | None = None, dtype: str | None = None, recompute: str | None = None) -> None:
    """One-line InputError for a ``--dp`` / ``--dtype`` / ``--recompute`` value that is not known
    (None: not given)."""
    from zeppelin.schemas.common import InputError

    for flag, value, known in (("--dp", dp, DP_MODES), ("--dtype", dtype, tuple(DTYPES)),
                               ("--recompute", recompute, RECOMPUTE_MODES)):
        if value is not None and value not in known:
            raise InputError(f"{flag} {value!r} is not one of {', '.join(known)}")


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a model: ``model.layers`` for the runtime's :class:`LlamaModel`,
    ``model.model.layers`` for a ``transformers`` causal LM (Llama, Mistral, Qwen2...)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    raise ValueError(f"cannot find the decoder blocks of {type(model).__name__} "
                     "(expected .layers or .model.layers)")


def _set_blocks(model: nn.Module, blocks: nn.ModuleList) -> None:
    if isinstance(getattr(model, "layers", None), nn.ModuleList):
        model.layers = blocks
    else:
        model.model.layers = blocks


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Wrap the decoder blocks (``full``) or their MLPs (``selective``) with non-reentrant
    activation checkpointing. ``none`` leaves the model as it is."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    def wrap(m: nn.Module) -> nn.Module:
        return checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)

    blocks = decoder_blocks(model)
    if mode == "full":
        _set_blocks(model, nn.ModuleList(wrap(b) for b in blocks))
        return
    for b in blocks:
        name = "mlp" if isinstance(getattr(b, "mlp", None), nn.Module) else None
        if name is None:
            raise ValueError(f"selective recomputation needs a block with an .mlp module ({type(b).__name__})")
        setattr(b, name, wrap(getattr(b, name)))


def dp_mesh(world_size: int, device_type: str, hsdp: int | None = None):
    """The data-parallel mesh: 1-D over every rank, or 2-D ``(replicate, shard)`` with shard
    groups of ``hsdp`` consecutive ranks (hybrid sharding)."""
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp is None or hsdp in (0, world_size):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    if hsdp < 1 or world_size % hsdp:
        raise ValueError(f"--hsdp {hsdp} must divide the world size {world_size}")
    return init_device_mesh(device_type, (world_size // hsdp, hsdp), mesh_dim_names=("replicate", "shard"))


def mixed_precision(dtype: str):
    """FSDP2 policy: compute in ``dtype``, fp32 master parameters and gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    # the model casts its own inputs (RoPE tables stay fp32): no cast of the forward inputs
    if dtype == "fp32":
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_model(model: nn.Module, mesh, zero_stage: int, mp_policy=None, recompute: str = "none") -> nn.Module:
    """Apply ``recompute`` then FSDP2 to every decoder block and to the root (in place)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if zero_stage not in (1, 2, 3):
        raise ValueError(f"FSDP runs ZeRO stages 1, 2 and 3 (got {zero_stage}; stage 0 is --dp replicate)")
    apply_recompute(model, recompute)
    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy(cast_forward_inputs=False)
    reshard = zero_stage >= 3
    for blk in decoder_blocks(model):
        fully_shard(blk, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            m.set_reduce_scatter_unused_params(True, recurse=False)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a (possibly DTensor) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: call on every rank)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_params_and_grads(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Whole parameters and gradients by canonical name (collective under FSDP)."""
    params, grads = {}, {}
    for name, p in model.named_parameters():
        key = canonical_name(name)
        params[key] = full_tensor(p.detach())
        g = p.grad
        grads[key] = full_tensor(g) if g is not None else torch.zeros_like(params[key])
    return params, grads


def canonical_name(name: str) -> str:
    """A parameter name without the checkpoint wrapper's prefix."""
    return name.replace("_checkpoint_wrapped_module.", "")


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards)."""
    p_bytes = g_bytes = o_bytes = 0
    for p in model.parameters():
        lp = local_tensor(p.detach())
        p_bytes += lp.numel() * lp.element_size()
        if p.grad is not None:
            lg = local_tensor(p.grad)
            g_bytes += lg.numel() * lg.element_size()
    if optimizer is not None:
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    lv = local_tensor(v)
                    o_bytes += lv.numel() * lv.element_size()
    return {"params": p_bytes, "grads": g_bytes, "optimizer": o_bytes}


class SavedActivations:
    """Bytes autograd holds for the backward (tensors saved by the forward), measured with
    ``torch.autograd.graph.saved_tensors_hooks``; storages are counted once. ``peak`` is the
    most held at any point of the step."""

    def __init__(self) -> None:
        self.live: dict[Any, int] = {}
        self.held = 0
        self.peak = 0
        self.mb_peak = 0

    def _pack(self, t: torch.Tensor):
        try:
            st = t.untyped_storage()
            key = (st.data_ptr(), t.device.type)
            n = st.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (fakes)
            return t
        if key not in self.live and n:
            self.live[key] = n
            self.held += n
            self.peak = max(self.peak, self.held)
            self.mb_peak = max(self.mb_peak, self.held)
        return t

    def _unpack(self, t):
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def release(self) -> int:
        """After a micro-batch's backward: its saved tensors are gone. Returns the most that
        micro-batch held."""
        self.live.clear()
        self.held = 0
        mb, self.mb_peak = self.mb_peak, 0
        return mb
