"""Checkpoints: model, optimizer, RNG states of every rank and the plan cursor, written atomically.

Layout of a checkpoint directory::

    ckpt-000010.pt   state after 10 steps (the next step to run is 10)
    latest           name of the newest complete checkpoint (written last, atomically)

Data-parallel units hold identical parameters and optimizer state after every step, so rank 0
writes the file; the RNG states of all ranks are gathered into it so that a resumed job continues
every rank's random streams exactly. A checkpoint is tied to its plan (hash of the plan header)
and world size; resuming with another plan is refused.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from zeppelin.schemas.common import InputError, atomic_write, atomic_write_text

CKPT_VERSION = 1


def checkpoint_name(next_step: int) -> str:
    return f"ckpt-{next_step:06d}.pt"


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    st = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def save_checkpoint(directory: str | os.PathLike, *, next_step: int, model, optimizer, rng_states: list,
                    plan_hash: str, world_size: int, extra: dict | None = None) -> Path:
    """Write ``ckpt-<next_step>.pt`` then point ``latest`` at it (both atomic). Rank 0 only."""
    import torch

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {
        "version": CKPT_VERSION,
        "next_step": next_step,
        "plan_hash": plan_hash,
        "world_size": world_size,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng_states,
        "extra": extra or {},
    }
    path = d / checkpoint_name(next_step)
    with atomic_write(path, "wb") as fh:
        torch.save(state, fh)
    atomic_write_text(d / "latest", path.name + "\n")
    return path


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    d = Path(directory)
    ptr = d / "latest"
    if not ptr.exists():
        return None
    name = ptr.read_text().strip()
    path = d / name
    if not name or not path.exists():
        raise InputError(f"checkpoint pointer names {name!r}, which does not exist", source=ptr)
    return path


def load_checkpoint(path: str | os.PathLike, *, plan_hash: str, world_size: int) -> dict[str, Any]:
    import torch

    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is an input problem
        raise InputError(f"cannot read checkpoint ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                         source=path) from None
    if not isinstance(state, dict) or state.get("version") != CKPT_VERSION:
        raise InputError("not a zeppelin checkpoint (or an unsupported version)", source=path)
    if state["plan_hash"] != plan_hash:
        raise InputError(f"checkpoint was written for another plan (plan header {state['plan_hash']}, "
                         f"this plan {plan_hash})", source=path)
    if state["world_size"] != world_size:
        raise InputError(f"checkpoint was written by {state['world_size']} ranks, this job has {world_size}",
                         source=path)
    return state
