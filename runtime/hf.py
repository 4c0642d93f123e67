"""Hugging Face decoders (Llama, Mistral, Qwen2) on a plan's layouts: ``--model hf:DIR``.

The model is the ``transformers`` implementation itself (``AutoModelForCausalLM.from_config``),
built from ``DIR/config.json`` in fp32 master weights; weights come from ``DIR/*.safetensors``
through ``safetensors`` (never a pickle) or, without weight files, from the config's own
initialisation under a fixed seed. The runtime's attention is registered with transformers'
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
from zeppelin.schemas.hf import hf_dir, hf_model_spec
from zeppelin.schemas.model import ModelSpec

from .data import IGNORE_INDEX
from .model import COMPUTE_DTYPES, Layout, PhaseTimer, ReferenceLayout

def register_attention() -> str:
    """Register the runtime's attention with transformers' ``AttentionInterface`` (the public
    :func:`zeppelin.runtime.api.register_hf_attention`); returns its name (``"zeppelin"``)."""
    from .api import register_hf_attention

    return register_hf_attention()


def _safetensors_files(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("*.safetensors") if p.is_file())


def load_safetensors_state(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``DIR/*.safetensors`` (sharded checkpoints included), as CPU tensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(d):
        try:
            part = load_file(str(f), device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise InputError(f"cannot read safetensors weights ({e.__class__.__name__}: {e})", source=f) from None
        dup = set(part) & set(out)
        if dup:
            raise InputError(f"tensor {sorted(dup)[0]!r} appears in two weight files", source=f)
        out.update(part)
    return out


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
        with self._autocast(tokens.device):
            out = self.model(input_ids=tokens[None], position_ids=pos.to(tokens.device)[None], use_cache=False,
                             zeppelin_context=layout.ctx, zeppelin_timer=timer)
        return out.last_hidden_state[0]

    def _reference_hidden(self, tokens: torch.Tensor, layout: ReferenceLayout) -> torch.Tensor:
        """transformers' own eager attention, one whole sequence per call (the --verify oracle)."""
        cfg = self.config
        old = cfg._attn_implementation
        cfg._attn_implementation = "eager"
        try:
            hs = []
            pos = 0
            for L in layout.seq_lengths:
                ids = tokens[pos:pos + L][None]
                with self._autocast(tokens.device):
                    out = self.model(input_ids=ids, position_ids=torch.arange(L, device=tokens.device)[None],
                                     use_cache=False)
                hs.append(out.last_hidden_state[0])
                pos += L
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
        h = self.hidden_states(tokens, layout, timer)
        return self.loss_sum(h, labels), h

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The Hugging Face checkpoint's tensors (tied output weights once, under the embedding)."""
        sd = self.state_dict()
        if getattr(self.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        return sd


def load_hf_model(ref: str, seed: int = 0, device: torch.device | str = "cpu",
                  spec: ModelSpec | None = None) -> HFCausalLM:
    """Build the model of ``hf:DIR``: weights from ``DIR/*.safetensors`` when present, otherwise
    the config's initialisation seeded with ``seed`` (the global RNG is left as it was)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = hf_dir(ref)
    spec = spec or hf_model_spec(ref)
    name = register_attention()
    config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    config._attn_implementation = name
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        causal = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    files = _safetensors_files(d)
    if files:
        state = load_safetensors_state(d)
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        own = causal.state_dict()
        tied = bool(getattr(config, "tie_word_embeddings", False))
        unexpected = sorted(set(state) - set(own))
        if unexpected:
            raise InputError(f"weights hold {len(unexpected)} tensors the model does not have "
                             f"(first: {unexpected[0]!r})", source=d)
        missing = sorted(set(own) - set(state) - ({"lm_head.weight"} if tied else set()))
        if missing:
            raise InputError(f"weights lack {len(missing)} tensors of the model (first: {missing[0]!r})", source=d)
        for k, v in state.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise InputError(f"tensor {k!r} has shape {tuple(v.shape)}, the config gives "
                                 f"{tuple(own[k].shape)}", source=d)
        causal.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
        if tied:
            causal.tie_weights()
    causal.train()
    return HFCausalLM(causal, spec).to(device)


def export_hf(model: HFCausalLM, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``model`` (or the full ``state`` dict gathered from a sharded one) as a Hugging Face
    directory: ``config.json`` + consolidated ``model.safetensors``, written to a temporary
    directory next to ``out_dir`` and renamed into place. Refuses an existing non-empty ``out_dir``."""
    import os
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError("export directory exists and is not empty", source=out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sd = state if state is not None else model.state_dict()
    config = model.config
    old = config._attn_implementation
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        config._attn_implementation = "eager"
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        shell.load_state_dict({k: v.detach().to("cpu", torch.float32) for k, v in sd.items()},
                              strict=False, assign=True)
        if getattr(config, "tie_word_embeddings", False):
            shell.tie_weights()
        shell.config.dtype = torch.float32
        shell.save_pretrained(str(tmp), safe_serialization=True)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        config._attn_implementation = old
    return out
