"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): sharded, atomic, nothing unpickled.

Layout of a checkpoint directory::

    ckpt-000010/                  state after 10 steps (the next step to run is 10)
        shard-0000N-model-...safetensors   every rank's shards of the model and optimizer tensors
        state.json                plan cursor, plan hash, world size, optimizer hyper-parameters,
                                  every rank's RNG states (JSON)
    latest                        name of the newest complete checkpoint (written last, atomically)

Every rank writes its own shards of the model and AdamW state (``get_state_dict`` of
``torch.distributed.checkpoint.state_dict``: FSDP's DTensor shards, or the whole tensors of a
replicated run, which DCP writes once) through DCP's safetensors storage
(``HuggingFaceStorageWriter(save_distributed=True)``; ``HuggingFaceStorageReader`` rebuilds the
checkpoint's layout from the safetensors headers, which are JSON). DCP's default file storage is
not used: its ``.metadata`` file is a pickle. The non-tensor state is JSON; nothing in a
checkpoint is executed or unpickled when it is read.

A checkpoint is first written to a temporary directory beside it and renamed into place when
complete; ``latest`` is replaced atomically after that, so an interrupted save leaves the previous
checkpoint in force. ``latest`` may only name a ``ckpt-NNNNNN`` directory inside the checkpoint
directory. A checkpoint is tied to its plan (hash of the plan header) and world size; resuming
with another plan or world size is refused. Sharded tensors are loaded back into the job's own
sharding (DCP re-shards), so the data-parallel mode and ZeRO stage may differ from the run that
wrote it.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

from zeppelin.schemas.common import InputError, atomic_write_text

CKPT_VERSION = 2
_NAME = re.compile(r"^ckpt-(\d{6,})$")
STATE_FILE = "state.json"


def checkpoint_name(next_step: int) -> str:
    return f"ckpt-{next_step:06d}"


# ---------------------------------------------------------------------------------------------
# RNG state as JSON
# ---------------------------------------------------------------------------------------------


def _b64(t) -> str:
    return base64.b64encode(bytes(t.numpy().tobytes())).decode("ascii")


def _unb64(s: str):
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """This process's random states (torch, Python, NumPy, CUDA) as JSON-ready values."""
    import numpy as np
    import torch

    ver, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    st = {"torch": _b64(torch.get_rng_state()),
          "python": [ver, list(internal), gauss],
          "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = _b64(torch.cuda.get_rng_state())
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(_unb64(st["torch"]))
    ver, internal, gauss = st["python"]
    random.setstate((ver, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(st["cuda"]))


# ---------------------------------------------------------------------------------------------
# model + optimizer state as one flat dict of tensors
# ---------------------------------------------------------------------------------------------


def _flat_state(model, optimizer) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(flat tensors by key, model state dict, optimizer state dict); the flat dict's tensors are
    the state dicts' own (loading into them fills the state dicts in place)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    flat: dict[str, Any] = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for key, v in st.items():
            flat[f"optim.{fqn}.{key}"] = v
    return flat, msd, osd


def _json_groups(osd: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for g in osd["param_groups"]:
        out.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()})
    return out


def save_checkpoint(directory: str | os.PathLike, *, next_step: int, model, optimizer, rng_states: list,
                    plan_hash: str, world_size: int, rank: int, extra: dict | None = None) -> Path:
    """Write ``ckpt-<next_step>/`` then point ``latest`` at it. Collective: every rank calls it
    (``rng_states``: every rank's :func:`rng_state`, needed on rank 0)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    d = Path(directory)
    name = checkpoint_name(next_step)
    tmp = d / f".{name}.tmp"
    final = d / name
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save interrupted earlier
        tmp.mkdir()
    if dist.is_initialized():
        dist.barrier()
    flat, _msd, osd = _flat_state(model, optimizer)
    dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(tmp), save_distributed=True))
    if rank == 0:
        state = {"version": CKPT_VERSION, "next_step": next_step, "plan_hash": plan_hash,
                 "world_size": world_size, "param_groups": _json_groups(osd), "rng": rng_states,
                 "keys": sorted(flat), "extra": extra or {}}
        atomic_write_text(tmp / STATE_FILE, json.dumps(state))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(d / "latest", name + "\n")
    if dist.is_initialized():
        dist.barrier()
    return final


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names (None without one); it must be a ``ckpt-NNNNNN`` directory
    inside ``directory``."""
    d = Path(directory)
    ptr = d / "latest"
    if not ptr.exists():
        return None
    try:
        name = ptr.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read the checkpoint pointer ({e.__class__.__name__})", source=ptr) from None
    if not _NAME.match(name):
        raise InputError(f"checkpoint pointer names {name!r}, not a checkpoint of this directory "
                         "(expected ckpt-NNNNNN)", source=ptr)
    path = d / name
    if not (path / STATE_FILE).is_file():
        raise InputError(f"checkpoint pointer names {name!r}, which does not exist", source=ptr)
    return path


def read_checkpoint_state(path: str | os.PathLike, *, plan_hash: str, world_size: int) -> dict[str, Any]:
    """The checkpoint's JSON state, checked against the job (no tensors are read)."""
    path = Path(path)
    f = path / STATE_FILE
    try:
        state = json.loads(f.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read checkpoint state ({e.__class__.__name__})", source=f) from None
    if not isinstance(state, dict) or state.get("version") != CKPT_VERSION:
        raise InputError("not a zeppelin checkpoint (or an unsupported version)", source=f)
    for key, typ in (("next_step", int), ("plan_hash", str), ("world_size", int), ("rng", list)):
        if not isinstance(state.get(key), typ):
            raise InputError(f"checkpoint state lacks a valid {key!r}", source=f)
    if state["plan_hash"] != plan_hash:
        raise InputError(f"checkpoint was written for another plan (plan header {state['plan_hash']}, "
                         f"this plan {plan_hash})", source=f)
    if state["world_size"] != world_size:
        raise InputError(f"checkpoint was written by {state['world_size']} ranks, this job has {world_size}",
                         source=f)
    return state


def load_checkpoint_tensors(path: str | os.PathLike, model, optimizer) -> None:
    """Load the model and optimizer state of checkpoint ``path`` into this job's (sharded) model
    and optimizer. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    flat, msd, osd = _flat_state(model, optimizer)
    dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(path)))
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def read_tensors(path: str | os.PathLike) -> dict[str, Any]:
    """Every tensor of a checkpoint, whole, by key (single process; for tests and tools)."""
    import torch
    from safetensors import safe_open

    out: dict[str, Any] = {}
    parts: dict[str, list] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get("DCP_SHARDING_INFO", "null") or "null")
            for key in fh.keys():
                off = meta[key]["saved_offsets"] if meta and key in meta else None
                parts.setdefault(key, []).append((off, fh.get_tensor(key)))
    for key, ps in parts.items():
        if len(ps) == 1 and (ps[0][0] is None or not any(ps[0][0])):
            out[key] = ps[0][1]
            continue
        shape = [max(o[i] + t.shape[i] for o, t in ps) for i in range(ps[0][1].dim())]
        full = torch.empty(shape, dtype=ps[0][1].dtype)
        for o, t in ps:
            full[tuple(slice(a, a + n) for a, n in zip(o, t.shape))] = t
        out[key] = full
    return out
