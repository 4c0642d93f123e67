"""Hugging Face decoders (Llama, Mistral, Qwen2, Qwen3 and the mixture-of-experts Mixtral,
Qwen2-MoE, Qwen3-MoE) on a plan's layouts: ``--model hf:DIR``.

The model is the ``transformers`` implementation itself (``AutoModelForCausalLM.from_config``),
built from ``DIR/config.json`` in fp32 master weights on the meta device (:func:`build_hf_model`);
once the executor has sharded it, each rank's rows come from ``DIR/*.safetensors`` through
``safetensors`` (never a pickle) or, without weight files, from the config's own initialisation
under a fixed seed (:mod:`zeppelin.runtime.weights`). The runtime's attention is registered with transformers'
attention-function interface under the name ``"zeppelin"`` (:func:`register_attention`, i.e.
:func:`zeppelin.runtime.api.register_hf_attention`); the micro-batch's attention context travels to
it as the forward keyword ``zeppelin_context``. So the plan's layouts, remaps and rings are unchanged:

* the model runs on the rank's packed linear-layout tokens as one ``[1, T]`` batch, with position
  ids restarting at 0 at every sequence's start (RoPE is applied by transformers before attention,
  per token, so the positions of the linear layout are the right ones);
* inside the attention function Q/K/V arrive in the linear layout; they are remapped to the
  attention layout as one ``[T, (Hq + 2 Hkv) D]`` buffer, run through the plan's engine (rings,
  routes, local varlen work) and the output is remapped back — the remap wraps attention only;
* no attention mask is built (a custom attention implementation gets none): causality and sequence
  boundaries are the engine's.

The single-process reference of ``--verify`` (:class:`~zeppelin.runtime.model.ReferenceLayout`)
runs transformers' own ``eager`` attention one whole sequence at a time, so a distributed step is
checked against transformers, not against the attention adapter.

Tensor-parallel plans (``tp > 1``) are refused for Hugging Face models: their linears are
transformers' ``nn.Linear`` modules, which the runtime's TP-SP path does not shard.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeppelin.schemas.common import InputError
from zeppelin.schemas.hf import hf_dir, hf_model_spec, hf_weight_files
from zeppelin.schemas.model import ModelSpec

from .data import IGNORE_INDEX
from .model import COMPUTE_DTYPES, Layout, PhaseTimer, ReferenceLayout

def register_attention() -> str:
    """Register the runtime's attention with transformers' ``AttentionInterface`` (the public
    :func:`zeppelin.runtime.api.register_hf_attention`); returns its name (``"zeppelin"``)."""
    from .api import register_hf_attention

    return register_hf_attention()


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the runtime's model interface.

    ``model`` is the transformers decoder stack (``model.layers`` are the decoder blocks) and
    ``lm_head`` its output projection: the parameter names are those of the Hugging Face checkpoint
    (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, ...). ``forward(tokens, labels,
    layout, timer) -> (loss_sum, final hidden states)`` as :class:`~zeppelin.runtime.model.LlamaModel`.
    """

    supports_tp = False  # transformers' nn.Linear projections are not sharded by the TP-SP path

    def __init__(self, causal_lm: nn.Module, spec: ModelSpec) -> None:
        super().__init__()
        self.model = causal_lm.model
        self.lm_head = causal_lm.lm_head
        self.config = causal_lm.config
        self.spec = spec
        self.dtype = COMPUTE_DTYPES[spec.dtype]
        cfg = self.config
        #: the router's auxiliary loss weight where transformers adds it to the loss
        #: (``output_router_logits``); 0: not part of the loss
        self.aux_coef = (float(getattr(cfg, "router_aux_loss_coef", 0.0))
                         if spec.is_moe and getattr(cfg, "output_router_logits", False) else 0.0)
        self._router_logits = None

    def _autocast(self, device: torch.device):
        if self.dtype in (torch.float32, torch.float64):
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)

    def hidden_states(self, tokens: torch.Tensor, layout: Layout, timer: PhaseTimer | None = None) -> torch.Tensor:
        if isinstance(layout, ReferenceLayout):
            return self._reference_hidden(tokens, layout)
        pos = getattr(layout, "linear_positions", None)
        if pos is None or getattr(layout, "ctx", None) is None:
            raise RuntimeError("HFCausalLM runs on a plan layout with an attention context and the linear "
                               "layout's position ids")
        n = tokens.shape[0]
        if n == 0:
            # a rank without tokens in this micro-batch still runs every layer (FSDP's gathers, remaps,
            # relays), but transformers' attention cannot reshape an empty row: one padding row runs
            # instead, dropped by the attention (zeppelin.runtime.api) and here
            tokens, pos = tokens.new_zeros(1), pos.new_zeros(1)
        kw = {"output_router_logits": True} if self.aux_coef else {}
        with self._autocast(tokens.device):
            out = self.model(input_ids=tokens[None], position_ids=pos.to(tokens.device)[None], use_cache=False,
                             zeppelin_context=layout.ctx, zeppelin_timer=timer, **kw)
        # the router's statistics count this rank's real tokens only (not a padding row)
        self._router_logits = tuple(r[:n] for r in out.router_logits) if self.aux_coef else None
        return out.last_hidden_state[0][:n]

    def _reference_hidden(self, tokens: torch.Tensor, layout: ReferenceLayout) -> torch.Tensor:
        """transformers' own eager attention, one whole sequence per call (the --verify oracle)."""
        cfg = self.config
        old = cfg._attn_implementation
        cfg._attn_implementation = "eager"
        try:
            hs = []
            routers = []
            pos = 0
            kw = {"output_router_logits": True} if self.aux_coef else {}
            for L in layout.seq_lengths:
                ids = tokens[pos:pos + L][None]
                with self._autocast(tokens.device):
                    out = self.model(input_ids=ids, position_ids=torch.arange(L, device=tokens.device)[None],
                                     use_cache=False, **kw)
                hs.append(out.last_hidden_state[0])
                if self.aux_coef:
                    routers.append(out.router_logits)
                pos += L
            self._router_logits = routers if self.aux_coef else None
        finally:
            cfg._attn_implementation = old
        if not hs:
            return tokens.new_zeros((0, self.spec.hidden), dtype=torch.float32)
        return torch.cat(hs, dim=0)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        with self._autocast(h.device):
            return self.lm_head(h).float()

    def loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(h), labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def forward(self, tokens, labels, layout: Layout, timer: PhaseTimer | None = None):
        """``(loss_sum, final hidden states)``; the hidden states are returned detached (for
        inspection and --verify: a view of transformers' output that required grad would make
        FSDP register its pre-backward hook on a view)."""
        h = self.hidden_states(tokens, layout, timer)
        loss = self.loss_sum(h, labels)
        if self.aux_coef:
            loss = loss + self._router_loss_term(labels, layout)
        return loss, h.detach()

    # ------------------------------------------------------------------ the router's auxiliary loss
    def _router_stats(self, logits, rows_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[tokens per expert (E), router probability sums (E), rows]`` of per-layer router
        logits, as transformers' ``load_balancing_loss_func`` sums them (over the rows of
        ``rows_mask``: padding is not a token)."""
        E, k = self.spec.num_experts, self.spec.experts_per_token
        dev = self.lm_head.weight.device
        tpe = torch.zeros(E, dtype=torch.float32, device=dev)
        prob = torch.zeros(E, dtype=torch.float32, device=dev)
        rows = 0
        for lg in logits:
            if rows_mask is not None:
                lg = lg[rows_mask]
            w = torch.softmax(lg, dim=-1)
            _, sel = torch.topk(w, k, dim=-1)
            tpe = tpe + torch.zeros(E, dtype=torch.float32, device=dev).scatter_add_(
                0, sel.reshape(-1), torch.ones(sel.numel(), dtype=torch.float32, device=dev))
            prob = prob + w.float().sum(dim=0)
            rows += w.shape[0]
        return torch.cat([tpe, prob, torch.tensor([float(rows)], device=dev)])

    def _aux_of(self, stats: torch.Tensor) -> torch.Tensor:
        E = self.spec.num_experts
        rows = stats[-1].clamp_min(1.0)
        return torch.sum(stats[:E] / rows * stats[E:2 * E] / rows) * E

    def _router_loss_term(self, labels: torch.Tensor, layout) -> torch.Tensor:
        """What the router loss adds to this rank's loss sum: transformers' ``router_aux_loss_coef
        x load_balancing_loss`` of each micro-batch (its statistic over all of the micro-batch's
        tokens, on every rank: all-reduced), weighted by the micro-batch's share of the step's
        predicted tokens (so that a one-micro-batch step's loss is transformers' batch loss) and
        split evenly over the ranks (the executor sums the ranks' losses and gradients)."""
        if isinstance(layout, ReferenceLayout):
            groups = layout.microbatches or [list(range(len(layout.seq_lengths)))]
            starts = [0]
            for L in layout.seq_lengths:
                starts.append(starts[-1] + L)
            total = labels.new_zeros((), dtype=torch.float32)
            for g in groups:
                per_layer = [torch.cat([self._router_logits[i][layer] for i in g], 0)
                             for layer in range(len(self._router_logits[g[0]]))] if g else []
                if not per_layer:
                    continue
                pred = sum(int((labels[starts[i]:starts[i + 1]] != IGNORE_INDEX).sum()) for i in g)
                total = total + self.aux_coef * self._aux_of(self._router_stats(per_layer)) * pred
            return total
        import torch.distributed as dist

        E = self.spec.num_experts
        local = self._router_stats(self._router_logits, getattr(layout, "real_rows", None))
        glob = torch.cat([local.detach(), (labels != IGNORE_INDEX).sum().to(local.dtype).reshape(1)])
        world = 1
        if dist.is_initialized():
            dist.all_reduce(glob)
            world = dist.get_world_size()
        pred, rows = glob[-1], glob[-2].clamp_min(1.0)
        # the loss is linear in the router probabilities (the token counts carry no gradient): its
        # value split evenly over the ranks, its gradient each rank's own share, with no collective
        # in the backward pass
        slope = glob[:E] / (rows * rows) * E
        own = torch.sum(slope * (local[E:2 * E] - local[E:2 * E].detach()))
        return self.aux_coef * pred * (self._aux_of(glob[:-1]) / world + own)

    def fill_shards(self, targets: dict[str, tuple[torch.Tensor, int, int]], device) -> None:
        """Each parameter's rows into its local tensor (:func:`zeppelin.runtime.fsdp.materialize`),
        from the weight files or the replayed seeded initialisation, then the buffers (RoPE tables,
        built by transformers' own rotary module: they are in no checkpoint)."""
        from .weights import WeightSources

        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        if isinstance(self.weights, WeightSources):
            self.weights.fill(targets, tied)
        else:
            self.weights.fill(self.seed, targets)
        emb = self.model.embed_tokens.weight
        if tied and self.lm_head.weight is not emb and not hasattr(emb, "to_local"):
            self.lm_head.weight = emb  # to_empty untied the whole model's head (FSDP keeps one parameter)
        for mod in self.modules():
            own = [k for k, b in mod._buffers.items() if b is not None]
            if not own:
                continue
            if "RotaryEmbedding" not in type(mod).__name__:
                raise RuntimeError(f"no rule to rebuild the buffers {own} of {type(mod).__name__}")
            with torch.device("cpu"):
                fresh = type(mod)(config=mod.config)
            for k in own:
                mod._buffers[k] = fresh._buffers[k].to(device)

    def reference_copy(self, device: torch.device | str = "cpu") -> HFCausalLM:
        """A new unsharded fp32 model of the same config and spec (transformers' initialisation,
        the global RNG left as it was): the frame a sharded model's whole parameters are copied
        into for the single-process reference of ``--verify``. Parameter names are this model's."""
        import copy

        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(self.config)
        with torch.random.fork_rng(devices=[]):
            causal = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        ref = HFCausalLM(causal, self.spec).to(device)
        ref.dtype = torch.float32
        return ref

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The Hugging Face checkpoint's tensors (tied output weights once, under the embedding)."""
        sd = self.state_dict()
        if getattr(self.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        return sd


def build_hf_model(ref: str, seed: int = 0, spec: ModelSpec | None = None) -> HFCausalLM:
    """The model of ``hf:DIR`` on the meta device (no storage): its weights come when
    :func:`zeppelin.runtime.fsdp.materialize` gives it storage - once sharded, each rank's rows only
    - from ``DIR/*.safetensors`` when present, otherwise from the config's initialisation seeded
    with ``seed`` (:mod:`zeppelin.runtime.weights`). The files' tensors are checked here (names,
    shapes) from their headers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .weights import WeightSources, record_init

    d = hf_dir(ref)
    spec = spec or hf_model_spec(ref)
    name = register_attention()
    config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    config._attn_implementation = name
    files = hf_weight_files(d)
    if files:
        with torch.device("meta"):
            causal = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        source = WeightSources(d, files, {k: tuple(p.shape) for k, p in causal.named_parameters(remove_duplicate=False)},
                               bool(getattr(config, "tie_word_embeddings", False)))
    else:
        causal, source = record_init(lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    causal.train()
    model = HFCausalLM(causal, spec)
    model.weights, model.seed = source, seed
    return model


def load_hf_model(ref: str, seed: int = 0, device: torch.device | str = "cpu",
                  spec: ModelSpec | None = None) -> HFCausalLM:
    """The whole model of ``hf:DIR`` in one process (:func:`build_hf_model`, then every row)."""
    from .fsdp import materialize

    model = build_hf_model(ref, seed, spec)
    materialize(model, torch.device(device))
    return model


# ---------------------------------------------------------------------------------------------
# export: a consolidated Hugging Face directory
# ---------------------------------------------------------------------------------------------

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# the runtime's own Llama -> transformers' LlamaForCausalLM parameter names
_LLAMA_NAMES = {"attn_norm.weight": "input_layernorm.weight", "attn.wq": "self_attn.q_proj.weight",
                "attn.wk": "self_attn.k_proj.weight", "attn.wv": "self_attn.v_proj.weight",
                "attn.wo": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
                "mlp.w1": "mlp.gate_proj.weight", "mlp.w3": "mlp.up_proj.weight", "mlp.w2": "mlp.down_proj.weight"}


def export_problem(model_ref: str | None, spec: ModelSpec) -> str | None:
    """Why ``--export`` cannot write this model (None when it can): Hugging Face models always
    can; the runtime's own model when it is a Llama (SwiGLU) decoder."""
    if model_ref is not None and model_ref.startswith("hf:"):
        return None
    if spec.mlp != "swiglu":
        return (f"--export writes Llama-family models; model {spec.name!r} has a {spec.mlp} MLP, which has no "
                "transformers Llama equivalent")
    return None


def llama_config(spec: ModelSpec, max_positions: int = 1 << 17):
    """transformers' ``LlamaConfig`` of the runtime's own model (same shapes, RoPE and norms)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden, intermediate_size=spec.ffn_hidden,
                       num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                       num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, hidden_act="silu",
                       rms_norm_eps=spec.norm_eps, max_position_embeddings=max_positions,
                       rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
                       tie_word_embeddings=spec.tie_embeddings, attention_bias=False, mlp_bias=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def llama_to_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The runtime's Llama state dict under transformers' LlamaForCausalLM names."""
    out = {}
    for k, v in state.items():
        if k == "embed":
            out["model.embed_tokens.weight"] = v
        elif k == "lm_head":
            out["lm_head.weight"] = v
        elif k == "norm.weight":
            out["model.norm.weight"] = v
        elif k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            if rest not in _LLAMA_NAMES:
                raise ValueError(f"no transformers name for parameter {k!r}")
            out[f"model.layers.{i}.{_LLAMA_NAMES[rest]}"] = v
        else:
            raise ValueError(f"no transformers name for parameter {k!r}")
    return out


def _file_tensors(name: str, value: torch.Tensor, mixtral: bool) -> list[tuple[str, torch.Tensor]]:
    """A parameter as the checkpoint stores it: fused experts one by one (``experts.e.gate_proj``,
    ``up_proj``, ``down_proj``; Mixtral: ``block_sparse_moe.experts.e.w1``, ``w3``, ``w2``)."""
    fused = name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
    if mixtral and (fused or name.endswith(".mlp.gate.weight")):
        name = name.replace(".mlp.", ".block_sparse_moe.")
    if not fused:
        return [(name, value)]
    pre = name.rsplit(".", 1)[0]
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else {p: f"{p}_proj" for p in ("gate", "up", "down")}
    out = []
    for e in range(value.shape[0]):
        if name.endswith("gate_up_proj"):
            half = value.shape[1] // 2
            out += [(f"{pre}.{e}.{names['gate']}.weight", value[e, :half]),
                    (f"{pre}.{e}.{names['up']}.weight", value[e, half:])]
        else:
            out.append((f"{pre}.{e}.{names['down']}.weight", value[e]))
    return out


def _export_config(model: nn.Module, spec: ModelSpec, dtype: torch.dtype):
    import copy

    config = copy.deepcopy(model.config) if isinstance(model, HFCausalLM) else llama_config(spec)
    config._attn_implementation = "eager"
    config.dtype = dtype
    return config


def _export_names(model: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """``(transformers name, canonical name, parameter)`` of every parameter to write (a tied LM
    head once, under the embedding)."""
    from .fsdp import canonical_name

    params = [(canonical_name(n), p) for n, p in model.named_parameters()]
    if isinstance(model, HFCausalLM):
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        return [(n, n, p) for n, p in params if not (tied and n == "lm_head.weight")]
    hf = llama_to_hf_names({n: n for n, _ in params})
    own = dict(params)
    return [(k, v, own[v]) for k, v in hf.items()]


def _owners(items: list[tuple[str, str, torch.Tensor]], world: int) -> list[int]:
    """The rank writing each parameter: the least loaded so far, by bytes (the same on every rank)."""
    load = [0] * world
    out = []
    for _, _, p in items:
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += p.numel()
        out.append(r)
    return out


def _export_target(out: Path, rank: int, world: int) -> Path:
    """Rank 0 checks ``out`` and makes the temporary directory next to it; every rank learns it."""
    import tempfile

    box: list = [None]
    if rank == 0:
        try:
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise InputError("export directory exists and is not empty", source=out)
            out.parent.mkdir(parents=True, exist_ok=True)
            box = [str(tempfile.mkdtemp(prefix=f".{out.name[:40]}.", dir=out.parent))]
        except InputError as e:
            box = [e]
    if world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], InputError):
        raise box[0]
    return Path(box[0])


def export_model(model: nn.Module, spec: ModelSpec, out_dir: str | Path) -> Path | None:
    """Write a Hugging Face model directory (``config.json``, safetensors weights, their index)
    that ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads; collective under
    FSDP (call on every rank). No rank gathers the model: each parameter is all-gathered in turn
    and kept by one rank (the least loaded), and each rank writes its own file of whole tensors,
    so a rank holds about 1/N of the model. ``model``: an :class:`HFCausalLM` (its own config) or
    the runtime's Llama (a ``LlamaConfig`` from its ModelSpec, parameters renamed); weights in the
    ModelSpec's dtype. Written under a temporary name next to ``out_dir`` and renamed into place
    by rank 0 (the directory is on a file system every rank sees); an existing non-empty
    ``out_dir`` is refused. Returns the directory on rank 0, None on the others."""
    import os
    import shutil

    import torch.distributed as dist
    from safetensors.torch import save_file

    from .fsdp import full_tensor

    on = dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    out = Path(out_dir)
    tmp = _export_target(out, rank, world)
    dtype = _TORCH_DTYPES[spec.dtype]
    config = _export_config(model, spec, dtype)
    mixtral = getattr(config, "model_type", "") == "mixtral"
    items = _export_names(model)
    owners = _owners(items, world)
    writers = sorted(set(owners))
    files = {r: ("model.safetensors" if len(writers) == 1 else
                 f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors") for i, r in enumerate(writers)}
    try:
        mine, weight_map, total = {}, {}, 0
        for (name, _, p), owner in zip(items, owners):
            whole = full_tensor(p.detach())  # collective for a sharded parameter
            for key, v in _file_tensors(name, whole, mixtral):
                weight_map[key] = files[owner]
                total += v.numel() * dtype.itemsize
                if owner == rank:
                    mine[key] = v.to("cpu", dtype).contiguous()
            del whole
        if mine:
            save_file(mine, str(tmp / files[rank]), metadata={"format": "pt"})
        del mine
        if rank == 0:
            _write_export_config(tmp, config, weight_map, total, len(writers))
        if on:
            dist.barrier()
        if rank == 0:
            if out.exists():
                out.rmdir()
            os.replace(tmp, out)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out if rank == 0 else None


def _write_export_config(tmp: Path, config, weight_map: dict[str, str], total: int, n_files: int) -> None:
    """``config.json``, ``generation_config.json`` and, for several weight files, their index."""
    import json

    from transformers import GenerationConfig

    config.save_pretrained(str(tmp))
    GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
    if n_files > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        from zeppelin.schemas.io.safefiles import atomic_write_text

        atomic_write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n",
                          what="export index")
