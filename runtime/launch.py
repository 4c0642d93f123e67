"""Launcher: torchrun with zeppelin's error reporting.

``python -m zeppelin.runtime.launch [torchrun options] -m zeppelin.runtime PLAN [options]`` runs
``torch.distributed.run`` (torchrun) in this process, with three changes:

* every worker gets ``ZEPPELIN_ERROR_DIR``; a failing worker writes its one-line error there;
* torchrun's own log chatter and its ``ChildFailedError`` traceback are replaced by one line
  naming the rank that failed first and its error (a rank that died without a word — killed, or
  ``os._exit`` — is named with its exit code or signal);
* Ctrl-C stops every worker (torchrun sends them SIGTERM) and exits with 130.

When one worker fails, torchrun's agent stops the others at once, so a job never waits for a
collective that cannot complete; ranks additionally run with a process-group timeout.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path


def torchrun_argv(*, nproc_per_node: int, nnodes: int = 1, node_rank: int | None = None,
                  master_addr: str | None = None, master_port: int | None = None,
                  rdzv_backend: str | None = None, rdzv_endpoint: str | None = None,
                  rdzv_id: str | None = None, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """torchrun options for a job: standalone on one machine unless a rendezvous is named."""
    argv = [f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}"]
    multi = nnodes > 1 or master_addr or rdzv_endpoint
    if not multi:
        argv.append("--standalone")
    if node_rank is not None:
        argv.append(f"--node-rank={node_rank}")
    if master_addr:
        argv.append(f"--master-addr={master_addr}")
    if master_port:
        argv.append(f"--master-port={master_port}")
    if rdzv_backend:
        argv.append(f"--rdzv-backend={rdzv_backend}")
    if rdzv_endpoint:
        argv.append(f"--rdzv-endpoint={rdzv_endpoint}")
    if rdzv_id:
        argv.append(f"--rdzv-id={rdzv_id}")
    argv.extend(extra)
    return argv


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _summarise(err_dir: Path, failures: dict) -> tuple[str, int]:
    """One line for the user about a failed job, and the exit code to return."""
    errs = {}
    for f in err_dir.glob("rank*.json"):
        try:
            rec = json.loads(f.read_text())
            errs[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError):
            continue
    # a rank that died without writing an error caused the others' failures - unless the launcher
    # stopped it (SIGTERM, or exit 130 from the worker's SIGTERM handler) because another rank failed
    silent = sorted(r for r, pf in failures.items() if r not in errs)
    stopped = {-int(signal.SIGTERM), 130}
    if any(failures[r].exitcode not in stopped for r in silent):
        silent = [r for r in silent if failures[r].exitcode not in stopped]
    elif errs:
        silent = []
    if silent:
        r = silent[0]
        code = failures[r].exitcode
        how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with code {code} without an error message"
        more = ""
        if errs:
            first = min(errs.values(), key=lambda x: x["time"])
            more = f" (then rank {first['rank']}: {first['message']})"
        return f"rank {r} {how}{more}", 1
    if errs:
        first = min(errs.values(), key=lambda x: x["time"])
        return f"rank {first['rank']}: {first['message']}", int(first.get("code", 1)) or 1
    return "the job failed (no worker reported an error)", 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    own_dir = "ZEPPELIN_ERROR_DIR" not in os.environ
    err_dir = Path(os.environ["ZEPPELIN_ERROR_DIR"]) if not own_dir else Path(tempfile.mkdtemp(prefix="zeppelin-err-"))
    os.environ["ZEPPELIN_ERROR_DIR"] = str(err_dir)
    err_dir.mkdir(parents=True, exist_ok=True)
    try:
        torchrun.main(argv)
        return 0
    except ChildFailedError as e:
        msg, code = _summarise(err_dir, e.failures)
        print(f"zeppelin: error: job failed: {msg}", file=sys.stderr, flush=True)
        return code
    except (KeyboardInterrupt, SignalException):
        print("zeppelin: interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        if own_dir:
            shutil.rmtree(err_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
