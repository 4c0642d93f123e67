"""A Hugging Face model's weights, one rank's rows at a time.

The model is built on the meta device and sharded first (:func:`zeppelin.runtime.fsdp.materialize`
then gives each rank storage for its own rows); its values come from one of two sources:

* **weight files** (:class:`WeightSources`): each parameter is read from ``DIR/*.safetensors``
  through ``safetensors``' ``safe_open(...).get_slice`` (no pickle), only the rows of dim 0 the
  rank holds. Mixture-of-experts checkpoints store experts one by one while transformers holds
  them fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``): a rank reads
  its experts' ``gate_proj``/``up_proj``/``down_proj`` (Mixtral: ``w1``/``w3``/``w2`` under
  ``block_sparse_moe``) and fuses them. Every tensor's shape, missing and unexpected tensors are
  checked from the files' headers before anything is read.
* **the seeded initialisation** (:class:`InitReplay`): transformers' own initialisation of
  ``from_config`` under ``torch.manual_seed(seed)`` - the construction's draws (``nn.Linear``'s
  kaiming, ``nn.Embedding``'s normal) and then ``post_init``'s, in the order transformers makes
  them. The model is built on the meta device with every in-place write recorded; replaying the
  record on the CPU draws the same random numbers, one whole tensor at a time, and keeps only the
  rank's rows of each parameter's final value. A write whose value is overwritten later only
  advances the generator (on a scratch tensor dropped at once).

The rank's bytes and tensors read are counted (``bytes_read``, ``tensors_read``).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from zeppelin.schemas.common import InputError

_RANDOM_WORDS = ("rand", "normal", "bernoulli", "uniform", "exponential", "cauchy", "geometric", "multinomial")
_OVERWRITES = ("normal_", "uniform_", "fill_", "zero_")


# ---------------------------------------------------------------------------------------------
# weight files
# ---------------------------------------------------------------------------------------------


class _Files:
    """The tensors of a set of safetensors files, opened once: headers, and slices of dim 0."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import SafetensorError, safe_open

        self.handles, self.where = [], {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt", device="cpu")
                keys = list(h.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise InputError(f"cannot read safetensors weights ({e.__class__.__name__}: {e})", source=f) from None
            self.handles.append(h)
            for k in keys:
                if k in self.where:
                    raise InputError(f"tensor {k!r} appears in two weight files", source=f)
                self.where[k] = h
        self.bytes_read = 0
        self.tensors_read = 0

    def close(self) -> None:
        """Drop the open files (their mappings); the counts stay."""
        self.handles, self.where = [], {}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.where[key].get_slice(key).get_shape())

    def rows(self, key: str, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` of dim 0 (the whole tensor for a scalar), in fp32."""
        sl = self.where[key].get_slice(key)
        t = sl[a:b] if sl.get_shape() else sl[...]
        self.bytes_read += t.numel() * t.element_size()
        self.tensors_read += 1
        return t.to(torch.float32)


_FUSED = re.compile(r"^(?P<pre>.*)\.experts\.(?P<kind>gate_up_proj|down_proj)$")


def _expert_names(pre: str, e: int, have) -> dict[str, str] | None:
    """The file names of expert ``e``'s gate/up/down projections under the model prefix ``pre``
    (``...layers.i.mlp``): Qwen's names, or Mixtral's ``block_sparse_moe.experts.e.w1/w3/w2``."""
    qwen = {p: f"{pre}.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")}
    if qwen["gate"] in have:
        return qwen
    mx = pre[: -len(".mlp")] + ".block_sparse_moe" if pre.endswith(".mlp") else pre
    mixtral = {p: f"{mx}.experts.{e}.{w}.weight" for p, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))}
    return mixtral if mixtral["gate"] in have else None


class WeightSources:
    """Where each parameter of a transformers model comes from in ``DIR/*.safetensors``, checked
    against the model's shapes (``shapes``: parameter name -> shape; ``tied``: the LM head is the
    embedding)."""

    def __init__(self, d: Path, files: list[Path], shapes: dict[str, tuple[int, ...]], tied: bool) -> None:
        self.dir = d
        self.files = _Files(files)
        self.plan: dict[str, tuple] = {}
        have = {k for k in self.files.where if not k.endswith("rotary_emb.inv_freq")}
        used: set[str] = set()
        for name, shape in shapes.items():
            if tied and name == "lm_head.weight":
                continue
            src = self._source(name, shape, have)
            if src is not None:
                self.plan[name] = src
                used.update(src[1] if src[0] == "experts" else (src[1],))
        unexpected = sorted(have - used)
        if unexpected:
            raise InputError(f"weights hold {len(unexpected)} tensors the model does not have "
                             f"(first: {unexpected[0]!r})", source=d)
        missing = sorted(set(shapes) - set(self.plan) - ({"lm_head.weight"} if tied else set()))
        if missing:
            raise InputError(f"weights lack {len(missing)} tensors of the model (first: {missing[0]!r})", source=d)

    def _check(self, key: str, want: tuple[int, ...]) -> None:
        got = self.files.shape(key)
        if got != tuple(want):
            raise InputError(f"tensor {key!r} has shape {got}, the config gives {tuple(want)}", source=self.dir)

    def _source(self, name: str, shape: tuple[int, ...], have: set[str]):
        """``("tensor", key)`` or ``("experts", keys, kind)`` for parameter ``name``; None: absent."""
        if name in have:
            self._check(name, shape)
            return ("tensor", name)
        if ".mlp.gate.weight" in name:  # Mixtral's router
            alt = name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
            if alt in have:
                self._check(alt, shape)
                return ("tensor", alt)
        m = _FUSED.match(name)
        if m is None or len(shape) != 3:
            return None
        per = [_expert_names(m["pre"], e, have) for e in range(shape[0])]
        if any(p is None for p in per):
            return None
        kind = m["kind"]
        keys = []
        for p in per:
            if kind == "gate_up_proj":
                half = (shape[1] // 2, shape[2])
                self._check(p["gate"], half)
                self._check(p["up"], half)
                keys += [p["gate"], p["up"]]
            else:
                self._check(p["down"], shape[1:])
                keys.append(p["down"])
        return ("experts", tuple(keys), kind)

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` of parameter ``name`` (for fused experts: experts ``a`` to ``b``)."""
        src = self.plan[name]
        if src[0] == "tensor":
            return self.files.rows(src[1], a, b)
        keys, kind = src[1], src[2]
        per = 2 if kind == "gate_up_proj" else 1
        out = []
        for e in range(a, b):
            parts = [self.files.rows(k, 0, self.files.shape(k)[0]) for k in keys[e * per:(e + 1) * per]]
            out.append(torch.cat(parts, dim=0))
        return torch.stack(out) if out else torch.empty(0)

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read

    @property
    def tensors_read(self) -> int:
        return self.files.tensors_read

    def fill(self, targets: dict[str, tuple[torch.Tensor, int, int]], tied: bool) -> None:
        for name, (local, a, b) in targets.items():
            if tied and name == "lm_head.weight":
                continue
            if b > a or local.dim() == 0:
                local.copy_(self.rows(name, a, b).reshape(local.shape))
        self.files.close()


# ---------------------------------------------------------------------------------------------
# the seeded initialisation, replayed
# ---------------------------------------------------------------------------------------------


class _WriteLog:
    """A dispatch mode recording every in-place write (and refusing any other random op) of a
    model's construction on the meta device."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self
        self.ops: list[tuple] = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                log.record(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def record(self, func, args, kwargs) -> None:
        name = func.overloadpacket.__name__
        if name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            base = t._base if t._base is not None else t
            self.ops.append((func, base, (tuple(t.shape), tuple(t.stride()), t.storage_offset()),
                             tuple(args[1:]), dict(kwargs)))
        elif any(w in name for w in _RANDOM_WORDS):
            raise RuntimeError(f"the seeded initialisation draws with {name}, which cannot be replayed per shard")


def record_init(build):
    """``(model, replay)``: ``build()`` run on the meta device with transformers' weight
    initialisation made to run there too (it skips a meta model otherwise) and every write recorded."""
    from unittest import mock

    import transformers.modeling_utils as mu

    log = _WriteLog()
    if not hasattr(mu, "get_torch_context_manager_or_global_device"):
        raise RuntimeError("this transformers version cannot replay its initialisation per shard")
    with torch.device("meta"), mock.patch.object(mu, "get_torch_context_manager_or_global_device",
                                                 lambda: torch.device("cpu")), log.mode:
        model = build()
    return model, InitReplay(model, log.ops)


class InitReplay:
    """The recorded writes of a model's construction, by parameter name (see the module's text)."""

    def __init__(self, model: nn.Module, ops: list[tuple]) -> None:
        names: dict[int, str] = {}
        for n, p in model.named_parameters():  # a tied parameter under its first name
            names.setdefault(id(p), n)
        self.shapes = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
        self.ops = []
        for func, base, view, args, kwargs in ops:
            pname = names.get(id(base))
            fname = func.overloadpacket.__name__
            if pname is not None and any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
                raise RuntimeError(f"the initialisation of {pname} copies another tensor ({fname}): "
                                   "no per-shard replay")
            if pname is None and not any(w in fname for w in _RANDOM_WORDS):
                continue  # buffers and discarded tensors: only their random draws matter
            self.ops.append((func, pname, (tuple(base.shape), base.dtype), view, args, kwargs))
        # from its last whole overwrite on, a parameter's value is kept; writes before it only draw
        self.start: dict[str, int] = {}
        self.last: dict[str, int] = {}
        for i, (func, pname, (shape, _), view, _, _) in enumerate(self.ops):
            if pname is None:
                continue
            self.last[pname] = i
            whole = view[0] == shape and view[2] == 0 and view[1] == _contiguous_strides(shape)
            if whole and func.overloadpacket.__name__ in _OVERWRITES:
                self.start[pname] = i

    def fill(self, seed: int, targets: dict[str, tuple[torch.Tensor, int, int]]) -> None:
        """Replay under ``torch.manual_seed(seed)`` (the global RNG is left as it was)."""
        live: dict[str, torch.Tensor] = {}
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for i, (func, pname, (shape, dtype), (vshape, vstride, voff), args, kwargs) in enumerate(self.ops):
                if pname is None or i < self.start.get(pname, len(self.ops)):
                    if any(w in func.overloadpacket.__name__ for w in _RANDOM_WORDS):
                        func(torch.empty(vshape, dtype=dtype), *args, **kwargs)
                    continue
                if pname not in live:
                    live[pname] = torch.empty(shape, dtype=dtype)
                func(live[pname].as_strided(vshape, vstride, voff), *args, **kwargs)
                if self.last[pname] == i and pname in targets:
                    local, a, b = targets[pname]
                    local.copy_(live.pop(pname)[a:b].reshape(local.shape))
        for name, (local, _, _) in targets.items():
            if name not in self.start and name in self.shapes:  # never written: zeros, not garbage
                local.zero_()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))
