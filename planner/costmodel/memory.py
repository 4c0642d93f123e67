"""Memory costs of the analytic cost model: what one GPU holds at its peak, by component
(parameters, gradients, optimizer state, whole weights, activations and recomputation), and the
tokens it can hold. A mixin of :class:`~zeppelin.planner.costmodel.cost.CostModel`.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from zeppelin.planner.costmodel.compute import as_array


class MemoryCosts:
    """Peak bytes per GPU by component (see :mod:`zeppelin.planner.costmodel.cost`)."""

    # What one rank holds at its peak (the start of the backward), by component, as the runtime
    # allocates it (docs/RUNTIME.md, "Memory model"). ``c``: bytes of a compute-dtype element;
    # master weights, gradients and AdamW moments are fp32 whatever ``c`` is.
    MEMORY_COMPONENTS = ("params", "grads", "optimizer", "unsharded", "activations", "recompute", "loss")

    @property
    def compute_bytes(self) -> int:
        return self.model.dtype_bytes

    @cached_property
    def _hf_modules(self) -> bool:
        """Hugging Face decoders (``remap_payload: qkv``) have their own norm and rotary forms."""
        return self.model.remap_payload == "qkv"

    def norm_bytes_per_token(self) -> float:
        """What autograd keeps of one RMSNorm per token: the fp32 input (the input itself in
        fp32) and its inverse RMS; the runtime's norm keeps the fp32 normalised rows and its
        compute-dtype output, a Hugging Face norm the normalised rows cast back to ``c`` and
        its output: ``(8 + c) h + 4`` / ``(4 + 2c) h + 4``."""
        h, c = self.model.hidden, self.compute_bytes
        return ((4 + 2 * c) if self._hf_modules else (8 + c)) * h + 4.0

    def layer_activation_parts(self) -> dict[str, float]:
        """Bytes autograd keeps per token of one decoder layer without recomputation, by part:

        * ``norms``: two RMSNorms (:meth:`norm_bytes_per_token`);
        * ``attention``: rotated Q and K, V and the attention output in ``c``, the fp32
          log-sum-exp per head: ``c (2 h + 2 g d) + 4 heads`` (no L^2 term: the kernels are
          flash-style);
        * ``mlp``: SwiGLU keeps gate, its SiLU, up and their product ``4 c f``; GELU ``2 c f``.

        The residual stream, RoPE rotations by constant tables and the casts keep nothing."""
        m, c = self.model, self.compute_bytes
        mlp = (4 if m.mlp == "swiglu" else 2) * c * m.mlp_ffn_params(active=True)
        if m.is_moe:
            mlp += self.moe_routing_bytes_per_token()
        attn = c * (2 * m.q_dim + 2 * m.kv_dim) + 4.0 * m.num_heads
        if m.qk_norm:
            attn += self.qk_norm_bytes_per_token()
        parts = {"norms": 2 * self.norm_bytes_per_token(), "attention": attn, "mlp": float(mlp)}
        measured = self.profile.activation_bytes_per_token_layer
        if measured:  # a whole-layer figure: keep the analytic split
            scale = measured / sum(parts.values())
            parts = {k: v * scale for k, v in parts.items()}
        return parts

    def qk_norm_bytes_per_token(self) -> float:
        """What the per-head RMSNorms of queries and keys (Qwen3) keep per token of one layer:
        each keeps its input in fp32 (``4`` per channel: the cast, or the input itself in fp32),
        its normalised rows cast to ``c`` (the weight's product needs them) and its inverse RMS
        per head: ``(4 + c)(q + kv) + 4 (heads + kv heads)``. The rotary embedding and the
        attention keep their own outputs (counted with the attention)."""
        m, c = self.model, self.compute_bytes
        return (4.0 + c) * (m.q_dim + m.kv_dim) + 4.0 * (m.num_heads + m.num_kv_heads)

    def moe_routing_bytes_per_token(self) -> float:
        """What a mixture-of-experts layer keeps per token beyond its experts' MLP parts: the
        router's fp32 logits and probabilities (``8 E``), the normalised top-k weights and their
        sum (``4 k + 4``), and for each of the ``k`` experts the token runs: its copy of the
        token (``c h``, the experts' input), the expert's output (``c h``, kept for the product
        with the routing weight), that weight (``c``) and the int64 positions the dispatch and
        the combine index with (``24``). A shared expert adds its output and its fp32 gate
        (``c h + 4``)."""
        m, c, k = self.model, self.compute_bytes, self.model.experts_per_token
        out = 8.0 * m.num_experts + 4.0 * k + 4.0 + k * (2.0 * c * m.hidden + c + 24.0)
        if m.shared_expert_ffn_hidden:
            out += c * m.hidden + 4.0
        return out

    def head_activation_bytes(self) -> float:
        """Per token, once per model: the final norm, the fp32 log-softmax of the logits
        (``4 V``), token ids and labels (int64) and the rotary tables (fp32 cos/sin of ``d/2``
        each; Hugging Face: ``c`` of ``d`` each)."""
        m, c = self.model, self.compute_bytes
        rope = 2 * c * m.head_dim if self._hf_modules else 4.0 * m.head_dim
        return self.norm_bytes_per_token() + 4.0 * m.vocab_size + 16.0 + rope

    def loss_backward_bytes(self) -> float:
        """Per token, what the loss's backward holds beyond what the forward kept: the runtime
        takes the cross-entropy of fp32 logits (``model.loss_sum``), and the log-softmax's
        backward runs with its incoming gradient and its result alive, ``4 V`` each (its saved
        output is the head's activation). A TP unit's ranks each take the loss of their shard."""
        return 8.0 * self.model.vocab_size / self.tp

    def loss_extra_bytes(self, rec: float) -> float:
        """Per token, what the loss's backward holds beyond one recomputation's ``rec`` (the two
        never overlap: the loss's backward ends before the first block's recomputation)."""
        return max(self.loss_backward_bytes() - rec, 0.0)

    @cached_property
    def activation_split(self) -> tuple[float, float]:
        """Bytes per token held (``activations``, ``recompute``) for this recompute mode:

        * ``none``: every layer's parts and the head;
        * ``selective`` (each MLP recomputed): every layer without its MLP (the MLP's input
          stays: checkpoint keeps it), the head; in the backward one MLP's parts again;
        * ``full`` (each block recomputed): each block's input ``c h`` and the head; in the
          backward one layer's parts, less its fp32 input where that is the block input itself.

        A profile that measured this model's figures (``fits.activation_memory``) replaces them."""
        f = self._fits
        mode = self.global_recompute  # a plan of choices per micro-batch: ``none`` (the others: recompute.py)
        got = f.activation_memory.get(mode) if f is not None else None
        if got is not None:
            return got.activations, got.recompute
        m, c = self.model, self.compute_bytes
        parts = self.layer_activation_parts()
        layer = sum(parts.values())
        head = self.head_activation_bytes()
        L, tp = m.num_layers, self.tp
        if mode == "none":
            act, rec = L * layer + head, 0.0
        elif mode == "selective":
            act, rec = L * (layer - parts["mlp"]) + head, parts["mlp"]
        elif mode == "full":
            act, rec = L * c * m.hidden + head, layer - (4.0 * m.hidden if c == 4 else 0.0)
        else:
            raise ValueError(f"unknown recompute mode {self.recompute!r} (none, selective, full)")
        extra_act, extra_rec = self.tp_gathered_split(mode)
        return act / tp + extra_act, rec / tp + extra_rec

    def tp_gathered_split(self, mode: str) -> tuple[float, float]:
        """Bytes per token of a TP unit each of its GPUs holds beyond the TP share of the layer
        (``activations``, ``recompute``; zero at TP 1): each column-parallel GEMM (Q/K/V, the MLP's
        gate and up) keeps its all-gathered input for the weight gradient, ``c h`` per token of
        the unit where the TP share of the norm's output it replaces is ``c h / tp``. ``none``
        keeps both per layer; ``selective`` the attention's, and the MLP's recomputation gathers
        its input again (whole: the share stays as the recomputation's input); ``full`` gathers
        both inside the one layer recomputed."""
        tp = self.tp
        if tp == 1:
            return 0.0, 0.0
        whole = self.compute_bytes * self.model.hidden
        g = whole * (1.0 - 1.0 / tp)
        L = self.model.num_layers
        return {"none": (2.0 * L * g, 0.0), "selective": (L * g, whole), "full": (0.0, 2.0 * g)}[mode]

    @cached_property
    def ulysses_extra_split(self) -> tuple[float, float]:
        """Bytes per token a Ulysses group member holds beyond a local layout's, split as
        :attr:`activation_split` (``activations``, ``recompute``). Per layer the all-to-alls
        leave two more ``c q``-wide tensors alive: the attention's output in the head layout (its
        own backward keeps it) beside its copy in the sequence layout (the output projection
        keeps that), and the head-layout query beside the sequence-layout query the rotary
        embedding made; plus the int64 permutations that order the group's rows (``16``). Inside
        a recomputed block (``full``) only the layer being recomputed holds them."""
        m, c = self.model, self.compute_bytes
        per_layer = (2.0 * c * m.q_dim + 16.0) / self.tp
        if self.recompute == "full":
            return 0.0, per_layer
        return m.num_layers * per_layer, 0.0

    def ulysses_weight(self, G: int) -> float:
        """How many times :attr:`ulysses_extra_split` a token of a Ulysses row of G positions
        holds: once, plus - where the row replicates K/V heads (:meth:`kv_replication`) - the
        replicated heads' K and V in the head layout, which the attention keeps for its backward
        (``2 c kv_dim`` per layer for each replica beyond the first; inside a recomputed block
        only the layer being recomputed holds them, as it holds the other copies)."""
        m, c = self.model, self.compute_bytes
        rep = self.kv_replication(G)
        if rep <= 1:
            return 1.0
        return 1.0 + (rep - 1.0) * 2.0 * c * m.kv_dim / (2.0 * c * m.q_dim + 16.0)

    def ulysses_capacity(self, G: int) -> int:
        """Tokens one member of a Ulysses row of G positions (a Ulysses group, a usp group's row)
        can hold: each also holds :attr:`ulysses_extra_split` times :meth:`ulysses_weight`."""
        free = self.gpu_capacity_bytes - self.model_state_bytes()
        extra = sum(self.ulysses_extra_split) * self.ulysses_weight(G)
        return max(int(free / (self.activation_bytes_per_token + extra)), 0)

    def layout_tokens(self, tokens, ulysses_tokens) -> np.ndarray:
        """Token-equivalents of an attention layout for :meth:`memory_bytes`: ``tokens`` held,
        ``ulysses_tokens`` of them in Ulysses rows (each counted with :attr:`ulysses_extra_split`
        on top; a row's tokens weighted by :meth:`ulysses_weight`)."""
        extra = sum(self.ulysses_extra_split) / self.activation_bytes_per_token
        return as_array(tokens) + as_array(ulysses_tokens) * extra

    @cached_property
    def remap_split(self) -> tuple[float, float]:
        """Bytes per token (``linear``, ``attention``) of a remapped micro-batch: what a token
        costs in its linear layout and in its attention layout (their sum, a rank holding the
        same tokens in both, is :attr:`activation_bytes_per_token` plus the int64 position each
        layer's exchange orders rows by). With ``hidden`` payloads the attention layout holds
        each layer's attention parts and the moved input of the Q/K/V projections (``c h``; the
        norm's output in the linear layout is then kept by nothing); with ``qkv`` payloads the
        attention parts, while the linear layout keeps the moved-back attention output the output
        projection needs (``c q``). Inside a recomputed block (``full``) one layer counts."""
        m, c = self.model, self.compute_bytes
        attn = self.layer_attention_bytes()
        if m.remap_payload == "qkv":
            att, lin_extra = attn, c * m.q_dim
        else:
            att, lin_extra = attn + c * m.hidden, -c * m.hidden
        layers = 1 if self.recompute == "full" else m.num_layers
        total = self.activation_bytes_per_token
        return total - layers * (attn - lin_extra) / self.tp, layers * (att + 8.0) / self.tp

    def layer_attention_bytes(self) -> float:
        """The attention part of one layer's activations per token (:meth:`layer_activation_parts`)."""
        return self.layer_activation_parts()["attention"]

    def remap_tokens(self, attention_tokens, linear_tokens) -> np.ndarray:
        """Token-equivalents of a remapped micro-batch for :meth:`memory_bytes`: ``linear_tokens``
        and ``attention_tokens`` held in the two layouts, each at its :attr:`remap_split` cost."""
        lin, att = self.remap_split
        return (as_array(linear_tokens) * lin + as_array(attention_tokens) * att) / self.activation_bytes_per_token

    @cached_property
    def activation_bytes_per_token(self) -> float:
        """Activation memory per token held, all layers: what the forward keeps plus the most
        the backward holds beyond it, one recomputation (:attr:`activation_split`) or the
        loss's gradients (:meth:`loss_backward_bytes`)."""
        act, rec = self.activation_split
        return act + rec + self.loss_extra_bytes(rec)

    def model_state_components(self, dp: int | None = None) -> dict[str, float]:
        """Parameter, gradient, optimizer and whole-parameter bytes per GPU by ZeRO stage
        (``P`` the model's parameters, ``N`` units of ``tp`` GPUs), as the runtime's FSDP2 holds
        them (docs/RUNTIME.md, "ZeRO stages"). Parameters are whole on every GPU of a TP unit
        too: a TP rank multiplies slices of them, so TP divides only the sharded states.

        * ZeRO-0 (``--dp replicate``): fp32 weights ``4 P``, gradients ``4 P``, Adam moments
          ``8 P`` whole; ``unsharded``: in a compute dtype narrower than fp32, the casts of the
          weight matrices the forward keeps (none inside recomputed modules; at TP > 1 the head's
          alone: the TP GEMMs cast their slices inside);
        * ZeRO-1, 2 and 3: ``4 P / (N tp)``, ``4 P / (N tp)``, ``8 P / (N tp)``. FSDP reduce-scatters each
          block's gradient as soon as the backward has produced it, so ZeRO-1 runs with
          ZeRO-2's holdings and is charged exactly those;
        * ``unsharded`` (ZeRO-1/2): every whole compute-dtype weight ``c P``, kept between
          forward and backward; ZeRO-3: the root module (embedding, head, final norm: FSDP does
          not re-shard the root after forward) and two blocks (the one in its backward and the
          one prefetched). Both: the whole gradients not yet reduce-scattered at the peak, the
          LM head's (from the start of the backward) and one block's, in ``c``.
        """
        dp = dp or self.num_units
        m, tp = self.model, self.tp
        c = self.compute_bytes
        # whole sizes whatever the TP degree: the runtime keeps every parameter whole (FSDP gathers
        # it on every rank, a TP rank multiplies its slices), and a TP rank's gradient is a whole
        # tensor until it is reduce-scattered
        whole_params = m.num_params()
        block = m.params_per_layer()
        root = m.num_params() - m.num_layers * m.params_per_layer()
        out = m.vocab_size * m.hidden + m.hidden        # LM head (or tied embedding) + final norm
        if self.zero_stage == 0:
            P = whole_params
            copies = 0.0
            if c < 4:
                h, kv, f = m.hidden, m.kv_dim, m.ffn_hidden
                attn_w = h * (h + 2 * kv) + h * h
                mlp_w = (3 if m.mlp == "swiglu" else 2) * h * f
                kept = {"none": attn_w + mlp_w, "selective": attn_w, "full": 0}.get(self.global_recompute, attn_w + mlp_w)
                # a TP unit's GEMMs cast their slices inside (no copy kept): the head's cast only
                copies = c * ((m.num_layers * kept if tp == 1 else 0) + m.vocab_size * h)
            return {"params": 4.0 * P, "grads": 4.0 * P, "optimizer": 8.0 * P, "unsharded": copies}
        P = whole_params / tp     # the sharded states: over every GPU of the mesh (``dp`` units of ``tp``)
        pending = c * (out + block)
        whole = c * whole_params if self.zero_stage in (1, 2) else c * (root + 2 * block)
        return {"params": 4.0 * P / dp, "grads": 4.0 * P / dp, "optimizer": 8.0 * P / dp,
                "unsharded": whole + pending}

    def model_state_bytes(self, dp: int | None = None) -> float:
        """Everything but the activations: :meth:`model_state_components` summed."""
        return float(sum(self.model_state_components(dp).values()))

    def memory_components(self, tokens_held) -> dict[str, np.ndarray]:
        """Predicted peak bytes of one GPU holding ``tokens_held`` tokens, by component (the
        names the runtime's metrics measure: ``MEMORY_COMPONENTS``)."""
        T = as_array(tokens_held)
        act, rec = self.activation_split
        out = {k: np.full_like(T, v) for k, v in self.model_state_components().items()}
        out["activations"] = T * act
        out["recompute"] = np.where(T > 0, T * rec, 0.0)
        out["loss"] = np.where(T > 0, T * self.loss_extra_bytes(rec), 0.0)
        return out

    @cached_property
    def gpu_capacity_bytes(self) -> float:
        return (self.cluster.gpu.memory_gb - self.profile.memory_reserved_gb) * 1e9

    @cached_property
    def token_capacity(self) -> int:
        """Tokens one GPU (unit member) can hold for activations after model states."""
        free = self.gpu_capacity_bytes - self.model_state_bytes()
        return max(int(free / self.activation_bytes_per_token), 0)

    @cached_property
    def ulysses_token_capacity(self) -> int:
        """Tokens one member of a Ulysses group (two or more units) without replicated K/V heads
        can hold: each also holds :attr:`ulysses_extra_split` (:meth:`ulysses_capacity`)."""
        return self.ulysses_capacity(1)

    def memory_bytes(self, tokens_held) -> np.ndarray:
        """Predicted peak bytes of one GPU holding ``tokens_held`` tokens (all components)."""
        return self.model_state_bytes() + as_array(tokens_held) * self.activation_bytes_per_token
