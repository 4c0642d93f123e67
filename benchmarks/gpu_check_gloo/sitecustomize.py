"""Loaded at start-up by every Python process that has this folder on PYTHONPATH: when
``ZEPPELIN_GPU_CHECK_BACKEND`` is set (``benchmarks/gpu_check.py``'s two-ranks section sets it to
``cpu:gloo,cuda:gloo``), every process group torch.distributed creates uses that backend instead of
NCCL. NCCL refuses two ranks on one device; gloo takes CUDA tensors for some collectives. The
runtime itself has no switch for this: the check only learns what gloo can carry."""

import os

_BACKEND = os.environ.get("ZEPPELIN_GPU_CHECK_BACKEND")

if _BACKEND:
    import torch.distributed as _dist

    _init, _new_group = _dist.init_process_group, _dist.new_group

    def _init_process_group(backend=None, *args, **kwargs):
        kwargs.pop("device_id", None)  # binds a NCCL communicator to a device; gloo takes none
        return _init(_BACKEND, *args, **kwargs)

    def _new_group_any(*args, backend=None, **kwargs):
        return _new_group(*args, backend=_BACKEND if backend in (None, "nccl") else backend, **kwargs)

    _dist.init_process_group = _init_process_group
    _dist.new_group = _new_group_any
