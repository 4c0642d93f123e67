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
import contextlib
import json
import math
import os
import random
import re
import stat
from pathlib import Path
from typing import Any

from zeppelin.schemas.common import InputError
from zeppelin.schemas.io.documents import parse_json
from zeppelin.schemas.io.safefiles import ManagedDir, kind_of

CKPT_VERSION = 2
_NAME = re.compile(r"^ckpt-(\d{6,})$")
# temporary names of zeppelin's own writes here: a save's directory, a replaced file, the writability probe
_TMP = re.compile(r"^\.(ckpt-\d{6,}\.tmp|latest\.[0-9a-f]{12}\.tmp|zeppelin-write-test-[0-9a-f]{12})$")
STATE_FILE = "state.json"
MAX_POINTER = 4096  # ``latest`` holds one name
MAX_HEADER = 100 << 20  # safetensors' own bound on a header


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
    from torch.distributed.checkpoint.api import CheckpointException

    d = Path(directory)
    name = checkpoint_name(next_step)
    tmp_name = f".{name}.tmp"
    tmp = d / tmp_name
    final = d / name
    md = ManagedDir(d, "--checkpoint-dir") if rank == 0 else None
    try:
        if md is not None:
            md.mkdir(tmp_name)  # a fresh directory: whatever was at the name (a link, an earlier save) is gone
        if dist.is_initialized():
            dist.barrier()
        flat, _msd, osd = _flat_state(model, optimizer)
        try:
            dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(tmp), save_distributed=True))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps every rank's failure (disk full,
            # ...) in its CheckpointException, a BaseException: caught here, or it escapes as a traceback per rank
            raise CheckpointError(f"cannot write checkpoint {final}: {_first_cause(e)}") from None
        if md is not None:
            state = {"version": CKPT_VERSION, "next_step": next_step, "plan_hash": plan_hash,
                     "world_size": world_size, "param_groups": _json_groups(osd), "rng": rng_states,
                     "keys": sorted(flat), "extra": extra or {}}
            try:
                with ManagedDir(tmp, "checkpoint", create=False) as td:
                    td.write_atomic(STATE_FILE, json.dumps(state).encode())
                md.rename(tmp_name, name)
                md.write_atomic("latest", (name + "\n").encode())
            except OSError as e:
                raise CheckpointError(f"cannot write checkpoint {final}: {e.strerror or e}") from None
    except BaseException:
        if md is not None:  # an interrupted or failed save leaves nothing behind
            with contextlib.suppress(OSError):
                md.remove(tmp_name)
        raise
    finally:
        if md is not None:
            md.close()
    if dist.is_initialized():
        dist.barrier()
    return final


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (one line: where and why)."""


def _first_cause(e: BaseException) -> str:
    """The first line of the innermost reason of a (DCP-wrapped) failure."""
    for _ in range(8):
        inner = getattr(e, "failures", None)
        if isinstance(inner, dict) and inner:
            v = next(iter(inner.values()))
            e = v[0] if isinstance(v, tuple) else v
            continue
        if e.__cause__ is not None:
            e = e.__cause__
            continue
        break
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip().splitlines()
    return f"{e.__class__.__name__}: {text[0]}" if text else e.__class__.__name__


def clean_interrupted_saves(md: ManagedDir) -> None:
    """Remove the temporary directories of saves that were interrupted (the caller holds the lock)."""
    for n in md.names():
        if _TMP.match(n):
            md.remove(n)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names (None without one); it must be a ``ckpt-NNNNNN`` directory
    inside ``directory``. ``latest`` must be a small regular file (never a link, FIFO or device)."""
    d = Path(directory)
    ptr = d / "latest"
    if not os.path.isdir(d):  # no directory yet: nothing to resume
        return None
    with ManagedDir(d, "--checkpoint-dir", create=False) as md:
        if md.lstat("latest") is None:
            return None
        raw = md.read_small("latest", "checkpoint pointer", limit=MAX_POINTER)
        try:
            name = raw.decode().strip()
        except UnicodeDecodeError:
            raise InputError("checkpoint pointer is not text", source=ptr) from None
        if not _NAME.match(name):
            raise InputError(f"checkpoint pointer names {name!r}, not a checkpoint of this directory "
                             "(expected ckpt-NNNNNN)", source=ptr)
        st = md.lstat(name)
        if st is None or not stat.S_ISDIR(st.st_mode):
            raise InputError(f"checkpoint pointer names {name!r}, which does not exist"
                             + ("" if st is None else f" as a directory (it is {kind_of(st.st_mode)})"), source=ptr)
    path = d / name
    if not os.path.lexists(path / STATE_FILE):
        raise InputError(f"checkpoint pointer names {name!r}, which has no {STATE_FILE}", source=ptr)
    return path


def plan_hash(header: Any) -> str:
    """The hash a checkpoint is tied to: the plan header (its creation time left out)."""
    from zeppelin.schemas.common import content_hash

    return content_hash(header.model_dump(mode="json", exclude={"created_at"}))


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _b64_problem(v: Any, size: int | None) -> bool:
    if not isinstance(v, str):
        return True
    try:
        raw = base64.b64decode(v, validate=True)
    except ValueError:
        return True
    return size is not None and len(raw) != size


def _rng_problem(st: Any) -> str | None:
    """Why one rank's RNG record cannot be restored (None: it can): the shapes :func:`rng_state` writes."""
    import torch

    if not isinstance(st, dict) or not {"torch", "python", "numpy"} <= set(st) or set(st) - {"torch", "python", "numpy",
                                                                                            "cuda"}:
        return "expected torch, python and numpy states"
    if _b64_problem(st["torch"], torch.get_rng_state().numel()):
        return "torch: not the base64 of a CPU generator state"
    py = st["python"]
    if not (isinstance(py, list) and len(py) == 3 and py[0] == 3 and isinstance(py[1], list) and len(py[1]) == 625
            and all(_is_int(x, 0, 2**32 - 1) for x in py[1][:624]) and _is_int(py[1][624], 0, 624)
            and (py[2] is None or _is_number(py[2]))):
        return "python: not a Mersenne Twister state"
    npst = st["numpy"]
    if not (isinstance(npst, list) and len(npst) == 5 and npst[0] == "MT19937" and isinstance(npst[1], list)
            and len(npst[1]) == 624 and all(_is_int(x, 0, 2**32 - 1) for x in npst[1]) and _is_int(npst[2], 0, 624)
            and _is_int(npst[3], 0, 1) and _is_number(npst[4])):
        return "numpy: not an MT19937 state"
    if "cuda" in st and _b64_problem(st["cuda"], None):
        return "cuda: not base64"
    return None


#: hyperparameters every checkpoint records (``--resume`` compares them with the run's)
REQUIRED_HYPERPARAMETERS = ("lr", "weight_decay", "seed")


def state_problem(state: dict[str, Any]) -> str | None:
    """The first field of a checkpoint's state that is missing or malformed, as ``'NAME'`` (with a
    reason where one helps); None when every field is what :func:`save_checkpoint` writes. Every rank
    restores from this state, so it is checked in full before any rank starts."""
    if not _is_int(state.get("next_step"), 0, 1_000_000):
        return "'next_step'"
    if not isinstance(state.get("plan_hash"), str):
        return "'plan_hash'"
    if not _is_int(state.get("world_size"), 1, 1 << 22):
        return "'world_size'"
    keys = state.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        return "'keys'"
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return "'param_groups'"
    rng = state.get("rng")
    if not isinstance(rng, list) or not rng:
        return "'rng'"
    for r, st in enumerate(rng):
        why = _rng_problem(st)
        if why:
            return f"'rng' (rank {r}: {why})"
    extra = state.get("extra")
    hp = extra.get("hyperparameters") if isinstance(extra, dict) else None
    if not isinstance(hp, dict):
        return "'extra.hyperparameters' (the run's hyperparameters, which --resume compares)"
    for key in REQUIRED_HYPERPARAMETERS:
        ok = _is_int(hp.get(key), 0, 2**63 - 1) if key == "seed" else _is_number(hp.get(key))
        if not ok:
            return f"'extra.hyperparameters.{key}'"
    return None


def plan_prefix(reader: Any, steps: int) -> str:
    """The hash of a plan's first ``steps`` steps and its header but for its step count: a plan
    extended by more steps (the same inputs planned for longer) has the same prefix, so a checkpoint
    of the shorter plan continues on the longer one."""
    from zeppelin.schemas.common import content_hash

    head = reader.header.model_dump(mode="json", exclude={"created_at", "num_steps"})
    return content_hash({"header": head, "steps": reader.step_hashes(steps)})


def read_checkpoint_state(path: str | os.PathLike, *, plan_hash: str, world_size: int,
                          prefix: Any = None) -> dict[str, Any]:
    """The checkpoint's JSON state, checked against the job (no tensors are read). ``prefix``:
    ``steps -> plan_prefix(this plan, steps)``; a checkpoint of another plan whose steps so far
    are this plan's first steps (an extended plan) is accepted."""
    path = Path(path)
    f = path / STATE_FILE
    with ManagedDir(path, "checkpoint", create=False) as md:
        raw = md.read_small(STATE_FILE, "checkpoint state")
    state = parse_json(raw, source=f, what="checkpoint state")
    if not isinstance(state, dict) or state.get("version") != CKPT_VERSION:
        raise InputError("not a zeppelin checkpoint (or an unsupported version)", source=f)
    problem = state_problem(state)
    if problem:
        raise InputError(f"checkpoint state lacks a valid {problem}", source=f)
    was = (state.get("extra") or {}).get("plan_prefix")
    extended = prefix is not None and isinstance(was, str) and was == prefix(state["next_step"])
    if state["plan_hash"] != plan_hash and not extended:
        raise InputError(f"checkpoint was written for another plan (plan header {state['plan_hash']}, "
                         f"this plan {plan_hash})", source=f)
    if state["world_size"] != world_size:
        raise InputError(f"checkpoint was written by {state['world_size']} ranks, this job has {world_size}",
                         source=f)
    if len(state["rng"]) != world_size:
        raise InputError(f"checkpoint state lacks a valid 'rng' ({len(state['rng'])} entries for {world_size} ranks)",
                         source=f)
    check_checkpoint_files(path, state["keys"])
    return state


def _shard_keys(md: ManagedDir, name: str) -> set[str]:
    """The tensor names of one safetensors shard, after checking that the file holds every byte its
    header describes (a truncated or emptied shard is refused here, not deep inside the loader)."""
    import struct

    shown = md.path / name
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(name, flags, dir_fd=md.fd)
    except OSError as e:
        raise InputError(f"damaged checkpoint: cannot read shard ({e.strerror or e})", source=shown) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"damaged checkpoint: shard is {kind_of(st.st_mode)}", source=shown)
        head = os.pread(fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or 8 + n > st.st_size or n > MAX_HEADER:
            raise InputError(f"damaged checkpoint: shard of {st.st_size:,} bytes has no valid header "
                             "(truncated?)", source=shown)
        header = parse_json(os.pread(fd, n, 8), source=shown, what="damaged checkpoint: shard header")
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise InputError("damaged checkpoint: shard header is not a JSON object", source=shown)
    end = 0
    for k, v in header.items():
        if k == "__metadata__":
            continue
        offs = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(x, int) for x in offs)):
            raise InputError(f"damaged checkpoint: shard header entry {k!r} has no data offsets", source=shown)
        end = max(end, offs[1])
    if 8 + n + end != st.st_size:
        raise InputError(f"damaged checkpoint: shard holds {st.st_size:,} bytes, its header describes "
                         f"{8 + n + end:,} (truncated or edited)", source=shown)
    return {k for k in header if k != "__metadata__"}


def check_checkpoint_files(path: str | os.PathLike, keys: list[str]) -> None:
    """Every shard of a checkpoint is whole and together they hold every tensor ``keys`` names."""
    found: set[str] = set()
    with ManagedDir(path, "checkpoint", create=False) as md:
        for name in md.names():
            if name.endswith(".safetensors"):
                found |= _shard_keys(md, name)
    missing = sorted(set(keys) - found)
    if missing:
        raise InputError(f"damaged checkpoint: no shard holds {len(missing)} of its tensors (first: {missing[0]!r}; "
                         "a shard is missing?)", source=path)


def load_checkpoint_tensors(path: str | os.PathLike, model, optimizer) -> None:
    """Load the model and optimizer state of checkpoint ``path`` into this job's (sharded) model
    and optimizer. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    flat, msd, osd = _flat_state(model, optimizer)
    try:
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(path)))
    except Exception as e:  # noqa: BLE001 - DCP gathers every rank's failure into its own exception type
        raise InputError(f"damaged checkpoint: cannot load its tensors ({_first_cause(e)})", source=path) from None
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
