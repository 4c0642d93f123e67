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
micro-batch, so ZeRO-1 plans run with ZeRO-2's holdings (sharded gradients). The planner's memory
model (``CostModel.model_state_components``) charges exactly these holdings: fp32 master
parameters, gradients and moments ``16 P / N``; whole compute-dtype parameters for ZeRO-1/2; for
ZeRO-3 the unsharded root module (FSDP does not re-shard the root after forward) and two blocks
(computing and prefetched); both: the whole gradients not yet reduce-scattered (the LM head's and
one block's). :class:`SavedActivations` measures them on the CPU.

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

import contextlib
import weakref
from typing import Any

import torch
from torch import nn

DP_MODES = ("fsdp", "replicate")
RECOMPUTE_MODES = ("none", "selective", "full")
#: a plan whose micro-batches each name their recomputation (:func:`set_recompute`)
PER_MICROBATCH = "per-microbatch"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_modes(*, dp: str | None = None, dtype: str | None = None, recompute: str | None = None) -> None:
    """One-line InputError for a ``--dp`` / ``--dtype`` / ``--recompute`` value that is not known
    (None: not given)."""
    from zeppelin.schemas.common import InputError

    for flag, value, known in (("--dp", dp, DP_MODES), ("--dtype", dtype, tuple(DTYPES)),
                               ("--recompute", recompute, (*RECOMPUTE_MODES, PER_MICROBATCH))):
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


def _switchable_class():
    """:class:`SwitchableCheckpoint`, defined once torch's checkpoint wrapper is imported."""
    global _SWITCHABLE
    if _SWITCHABLE is None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        class SwitchableCheckpoint(CheckpointWrapper):
            """A non-reentrant checkpoint wrapper whose checkpointing each micro-batch switches
            on or off (``checkpointing``): off, the wrapped module runs as if unwrapped. The
            model is wrapped once; a micro-batch's choice only sets the switches."""

            checkpointing = True

            def forward(self, *args, **kwargs):
                if self.checkpointing:
                    return super().forward(*args, **kwargs)
                return self._checkpoint_wrapped_module(*args, **kwargs)

        _SWITCHABLE = SwitchableCheckpoint
    return _SWITCHABLE


_SWITCHABLE = None


def apply_recompute(model: nn.Module, mode: str, tracker: SavedActivations | None = None) -> None:
    """Wrap the decoder blocks (``full``) or their MLPs (``selective``) with non-reentrant
    activation checkpointing; ``per-microbatch``: both, switched per micro-batch by
    :func:`set_recompute`. ``none`` leaves the model as it is. ``tracker``: counts what each
    recomputation holds (the backward's transient working set)."""
    if mode not in (*RECOMPUTE_MODES, PER_MICROBATCH):
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}, {PER_MICROBATCH}")
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    extra = {} if tracker is None else {"context_fn": tracker.checkpoint_contexts}

    def wrap(m: nn.Module) -> nn.Module:
        return _switchable_class()(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False, **extra)

    blocks = decoder_blocks(model)
    if mode in ("selective", PER_MICROBATCH):
        for b in blocks:
            if not isinstance(getattr(b, "mlp", None), nn.Module):
                raise ValueError(f"selective recomputation needs a block with an .mlp module ({type(b).__name__})")
            b.mlp = wrap(b.mlp)
    if mode in ("full", PER_MICROBATCH):
        _set_blocks(model, nn.ModuleList(wrap(b) for b in blocks))
    if mode == PER_MICROBATCH:
        set_recompute(model, "none")


def set_recompute(model: nn.Module, mode: str) -> None:
    """Set the switches of a model wrapped ``per-microbatch`` for one micro-batch's choice:
    ``none``, ``selective`` (each MLP), ``full`` (each block) or ``full:k`` (the first ``k``
    blocks; the others keep everything)."""
    kind, _, k = mode.partition(":")
    if kind not in RECOMPUTE_MODES or (k and kind != "full"):
        raise ValueError(f"recompute {mode!r} is not one of none, selective, full, full:k")
    blocks = decoder_blocks(model)
    n_full = (int(k) if k else len(blocks)) if kind == "full" else 0
    for i, b in enumerate(blocks):
        b.checkpointing = i < n_full
        b._checkpoint_wrapped_module.mlp.checkpointing = kind == "selective"


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


def shard_model(model: nn.Module, mesh, zero_stage: int, mp_policy=None, recompute: str = "none",
                tracker: SavedActivations | None = None) -> nn.Module:
    """Apply ``recompute`` then FSDP2 to every decoder block and to the root (in place)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if zero_stage not in (1, 2, 3):
        raise ValueError(f"FSDP runs ZeRO stages 1, 2 and 3 (got {zero_stage}; stage 0 is --dp replicate)")
    apply_recompute(model, recompute, tracker)
    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy(cast_forward_inputs=False)
    reshard = zero_stage >= 3
    for blk in decoder_blocks(model):
        fully_shard(blk, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            # gradients of parameters unused on a rank reduce-scattered as zeros (every rank joins the
            # same collectives); torch releases without the switch reduce only the parameters with a
            # gradient, the same set on every rank for the runtime's models (fused experts: one tensor)
            if hasattr(m, "set_reduce_scatter_unused_params"):
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


def local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(local tensor, first row, end row)``: the rows of dim 0 this rank holds of a parameter
    (FSDP2 shards dim 0 only; a plain tensor is held whole)."""
    if not hasattr(p, "to_local"):
        return p, 0, p.shape[0] if p.dim() else 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape[1:]) != tuple(p.shape[1:]) or any(offset[1:]):
        raise RuntimeError(f"a parameter sharded beyond dim 0 ({tuple(p.shape)} -> {tuple(shape)})")
    return p.to_local(), offset[0], offset[0] + shape[0]


def on_meta(model: nn.Module) -> bool:
    """Whether the model was built on the meta device and still waits for its weights."""
    return any(p.is_meta for p in model.parameters())


def materialize(model: nn.Module, device: torch.device) -> None:
    """Storage and weights for a model built on the meta device, once sharded (or not: ``--dp
    replicate`` and one-process use hold whole parameters): ``to_empty`` on ``device`` allocates
    this rank's shards only, then ``model.fill_shards`` writes each parameter's rows from its
    source (weight files or the seeded initialisation), reading no rows another rank holds.
    A model with real weights is left as it is."""
    if not on_meta(model):
        return
    model.to_empty(device=device)
    targets = {canonical_name(n): local_rows(p.data if not hasattr(p, "to_local") else p)
               for n, p in model.named_parameters()}
    with torch.no_grad():
        model.fill_shards(targets, device)


def full_params_and_grads(model: nn.Module, keep: bool = True) -> tuple[dict[str, torch.Tensor],
                                                                       dict[str, torch.Tensor]]:
    """Whole parameters and gradients by canonical name (collective under FSDP). ``keep=False``: take
    part in the gathers but keep nothing (empty dicts), so that a rank whose peers want the whole
    model holds one whole tensor at a time, not the model and its gradients."""
    params, grads = {}, {}
    for name, p in model.named_parameters():
        key = canonical_name(name)
        w = full_tensor(p.detach())
        g = full_tensor(p.grad) if p.grad is not None else None
        if keep:
            params[key] = w
            grads[key] = g if g is not None else torch.zeros_like(w)
        del w, g
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


def _storage(t: torch.Tensor):
    """(key, bytes) of the storage under ``t``; None for tensors without one (fakes)."""
    try:
        st = t.untyped_storage()
        return (st.data_ptr(), t.device.type), st.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


class UnshardedBytes:
    """Bytes of the whole (all-gathered) parameters an FSDP-sharded model holds right now, with
    their gradients not yet reduce-scattered and any all-gather still pending (a prefetched
    block), each storage counted once: call the instance. FSDP registers a parameter as a sharded
    DTensor while resharded and as a plain tensor while unsharded, in the same slot of its module.

    The slots (each module's parameter dict) and the FSDP states are found once, on the first
    call: :class:`SavedActivations` counts at every tensor autograd saves or unpacks (hundreds per
    micro-batch), and walking the module tree each time cost the runtime more per micro-batch
    than FSDP's own collectives (most under ZeRO-1/2, whose blocks stay unsharded from the forward
    to the backward)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._slots: list[dict] | None = None
        self._states: list = []

    def _find(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._slots = [m._parameters for m in self.model.modules() if m._parameters]
        self._states = []
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                try:
                    self._states.append(m._get_fsdp_state())
                except AttributeError:  # FSDP2 without it: no pending all-gather counted
                    self._states = []
                    break

    def _pending(self):
        """The output buffers of FSDP all-gathers issued but not yet copied out into parameters.
        FSDP2 keeps them in a private attribute: none found, none counted."""
        for st in self._states:
            for g in getattr(st, "_fsdp_param_groups", None) or ():
                out = getattr(getattr(g, "_all_gather_result", None), "all_gather_output", None)
                if isinstance(out, torch.Tensor):
                    yield out

    def __call__(self) -> int:
        from torch.distributed.tensor import DTensor

        if self._slots is None:
            self._find()
        seen: dict[Any, int] = {}
        # storages keyed by address alone: the model's tensors share one device
        for slot in self._slots:
            for p in slot.values():
                if p is None or isinstance(p, DTensor):
                    continue
                g = p.grad
                for t in (p,) if g is None or isinstance(g, DTensor) else (p, g):
                    try:
                        st = t.untyped_storage()
                        seen[st.data_ptr()] = st.nbytes()
                    except (RuntimeError, NotImplementedError):  # no storage (a fake tensor)
                        pass
        for t in self._pending():
            s = _storage(t)
            if s is not None:
                seen[s[0][0]] = s[1]
        return sum(seen.values())


def unsharded_bytes(model: nn.Module) -> int:
    """:class:`UnshardedBytes` of ``model``, once."""
    return UnshardedBytes(model)()


def _weight_kind(t: torch.Tensor) -> str | None:
    """``"weight"`` for a parameter or a view of one (a linear saves its weight's transpose),
    ``"copy"`` for a cast of a parameter to the compute dtype (or a view of such a cast), else
    None: an activation."""
    base = t._base if t._base is not None else t
    if isinstance(base, nn.Parameter):
        return "weight"
    fn = base.grad_fn
    if fn is not None and type(fn).__name__.startswith("ToCopyBackward"):
        nxt = fn.next_functions[0][0] if fn.next_functions else None
        if isinstance(getattr(nxt, "variable", None), nn.Parameter):
            return "copy"
    return None


class SavedActivations:
    """Bytes autograd holds for the backward, measured with ``saved_tensors_hooks``; storages
    are counted once.

    * ``peak`` / :meth:`release`: the tensors the forward saved (checkpointed modules' inputs
      included), parameters excluded - they are the model's weights, counted apart;
    * ``recompute_peak``: the most one recomputation of a checkpointed module held in the
      backward (counted through the ``context_fn`` of :func:`apply_recompute`);
    * ``unsharded_peak``: with ``model`` given (an FSDP-sharded model), the most whole
      parameters and their pending gradients seen at any save or unpack of the step
      (:func:`unsharded_bytes`)."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model
        self._whole = UnshardedBytes(model) if model is not None else None
        self.live: dict[Any, int] = {}
        self.held = 0
        self.peak = 0
        self.mb_peak = 0
        self.recompute_peak = 0
        self.mb_recompute_peak = 0
        self.unsharded_peak = 0
        self.copies: dict[Any, int] = {}
        self.copies_held = 0
        self._recomputing: dict[Any, int] | None = None
        self._active = False

    def reset(self) -> None:
        """At the start of a step."""
        self.peak = self.recompute_peak = self.unsharded_peak = 0

    def _scan(self) -> None:
        whole = self._whole() if self._whole is not None else 0
        self.unsharded_peak = max(self.unsharded_peak, whole + self.copies_held)

    def watch_blocks(self, model: nn.Module) -> None:
        """Hooks on each decoder block. A checkpointed block holds its tensor arguments until
        its backward, keyword ones too (Hugging Face passes the rotary tables so), which
        checkpoint does not save through the saved-tensor hooks: count them as saved. With
        ``model`` to scan, also scan when the backward reaches the block's input: its weight
        gradients are complete then and not yet reduce-scattered (FSDP's post-backward runs
        after)."""

        def scan_at_input(grad):
            self._scan()

        def pre(module, args, kwargs):
            if not torch.is_grad_enabled():
                return
            if self._active and getattr(module, "checkpointing", False):
                for a in (*args, *kwargs.values()):
                    for t in (a if isinstance(a, (tuple, list)) else (a,)):
                        if isinstance(t, torch.Tensor):
                            self._pack(t)
            if self.model is not None:
                for a in args:
                    if isinstance(a, torch.Tensor) and a.requires_grad:
                        a.register_hook(scan_at_input)

        for blk in decoder_blocks(model):
            blk.register_forward_pre_hook(pre, with_kwargs=True)

    def _pack(self, t: torch.Tensor):
        kind = _weight_kind(t)
        if kind == "weight":
            self._scan()
            return t
        s = _storage(t)
        if s is None:
            return t
        key, n = s
        if kind == "copy":  # a compute-dtype copy of a weight: the unsharded component
            if key not in self.copies and n:
                self.copies[key] = n
                self.copies_held += n
            self._scan()
            return t
        self._scan()
        if key not in self.live and n:
            # the tensor, weakly: a storage the backward has freed no longer counts as held
            # when a recomputation reuses its address
            self.live[key] = weakref.ref(t)
            self.held += n
            self.peak = max(self.peak, self.held)
            self.mb_peak = max(self.mb_peak, self.held)
        return t

    def _unpack(self, t):
        self._scan()
        return t

    def _count_recomputed(self, t: torch.Tensor) -> None:
        self._scan()
        rec = self._recomputing
        if rec is None or _weight_kind(t) is not None:
            return
        s = _storage(t)
        alive = self.live.get(s[0]) if s is not None else None
        if s is not None and (alive is None or alive() is None):
            rec[s[0]] = s[1]
            self.recompute_peak = max(self.recompute_peak, sum(rec.values()))
            self.mb_recompute_peak = max(self.mb_recompute_peak, sum(rec.values()))

    def checkpoint_contexts(self):
        """``context_fn`` of ``torch.utils.checkpoint``: nothing in the forward; in the
        recomputation, count what it saves, then hand each tensor to checkpoint's own hook."""
        return contextlib.nullcontext(), _CountRecomputation(self)

    @contextlib.contextmanager
    def hooks(self):
        """Count what the forward inside saves."""
        self._active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._active = False

    def release(self) -> tuple[int, int]:
        """After a micro-batch's backward: its saved tensors are gone. Returns the most that
        micro-batch held, and the most one of its recomputations held."""
        self.live.clear()
        self.copies.clear()
        self.held = self.copies_held = 0
        mb, self.mb_peak = self.mb_peak, 0
        rec, self.mb_recompute_peak = self.mb_recompute_peak, 0
        return mb, rec


class _CountRecomputation:
    """Entered inside checkpoint's recomputation, whose saved-tensor hook is then the innermost:
    push a hook that counts each saved tensor and delegates to it (same pack, same unpack)."""

    def __init__(self, tracker: SavedActivations) -> None:
        self.tracker = tracker
        self.ctx = None

    def __enter__(self):
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            return self
        pack, unpack = top
        tracker = self.tracker
        tracker._recomputing = {}

        def counting_pack(t):
            tracker._count_recomputed(t)
            return pack(t)

        self.ctx = torch.autograd.graph.saved_tensors_hooks(counting_pack, unpack)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
            self.ctx = None
        self.tracker._recomputing = None
        return False
