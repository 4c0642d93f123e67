"""Worker entry point: ``torchrun --nproc-per-node N -m zeppelin.runtime PLAN [options]``.

``zeppelin run`` launches this through torchrun; it can also be started by hand (torchrun, or a
single plain ``python -m zeppelin.runtime PLAN`` for a one-rank plan). Every rank runs
:func:`zeppelin.runtime.train.loop.run_job`. Failures are reported on the failing rank as one line
``zeppelin: error: [rank R] ...`` on stderr and, when ``ZEPPELIN_ERROR_DIR`` is set (``zeppelin
run`` sets it), as a JSON error file the launcher summarises; exit codes: 2 bad input, 1 runtime
failure or ``--verify`` beyond tolerance, 128 + signal when stopped (SIGINT, SIGTERM, SIGHUP).

Under the launcher (``ZEPPELIN_PARENT_PID`` set) a rank dies with its launcher
(:func:`zeppelin.runtime.lifecycle.die_with_parent`) and is stopped quietly: the launcher reports.
"""

from __future__ import annotations

from . import startup

startup.mark("launch")  # first: what follows is this process's imports

import json
import os
import signal
import sys
import time
import traceback

from zeppelin.schemas.common import InputError

from .config import RunConfig, build_parser


def _report(rank: int, message: str, code: int, tb: str | None = None) -> None:
    sys.stderr.write(f"zeppelin: error: [rank {rank}] {message}\n")  # one write: ranks share the stream
    sys.stderr.flush()
    d = os.environ.get("ZEPPELIN_ERROR_DIR")
    if d:
        from zeppelin.schemas.io.safefiles import ManagedDir

        try:
            rec = {"rank": rank, "time": time.time(), "message": message, "code": code, "traceback": tb}
            with ManagedDir(d, "error directory", create=False) as md:
                md.write_atomic(f"rank{rank}.json", json.dumps(rec).encode())
        except (OSError, InputError):
            pass


_STOPPED_BY: list[int] = []


def _record_signal(signum: int) -> None:
    """``signal-rank<R>.json`` in the job's error directory: the moment this rank received a stop
    signal (the launcher names a rank that a signal from outside the job stopped first, ahead of the
    peers that then failed with it; a signal the launcher sent itself comes after its verdict)."""
    d = os.environ.get("ZEPPELIN_ERROR_DIR")
    if not d:
        return
    rank = int(os.environ.get("RANK", "0"))
    rec = json.dumps({"rank": rank, "time": time.time(), "signal": int(signum)}).encode()
    try:
        fd = os.open(os.path.join(d, f"signal-rank{rank}.json"),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        os.write(fd, rec)
    except OSError:
        pass
    finally:
        os.close(fd)


def _on_stop_signal(signum, frame):  # the launcher stops the workers with SIGTERM
    if _STOPPED_BY:  # stopping already: a second signal must not interrupt the way out
        return
    _STOPPED_BY.append(signum)
    _record_signal(signum)
    raise KeyboardInterrupt


def _unraisable(hook):
    """``sys.unraisablehook``: the stop signal's KeyboardInterrupt raised inside a finalizer or a
    callback (which cannot propagate it: "Exception ignored in ...") ends the rank quietly, as the
    stop it is, instead of printing and running on."""
    def on_unraisable(u) -> None:
        if _STOPPED_BY and isinstance(u.exc_value, KeyboardInterrupt):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + _STOPPED_BY[0])
        hook(u)
    return on_unraisable


def _exit_at_once(signum, frame):
    os._exit(128 + signum)


def _finishing() -> None:
    """The job is over on this rank (done, or its failure is being reported): a stop signal from
    now on ends the process quietly instead of raising inside the report."""
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, _exit_at_once)


def main(argv: list[str] | None = None) -> int:
    from .lifecycle import PARENT_ENV, die_with_parent

    if os.environ.get(PARENT_ENV):
        die_with_parent(signal.SIGKILL)
    sys.unraisablehook = _unraisable(sys.unraisablehook)
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, _on_stop_signal)
    args = vars(build_parser().parse_args(argv))  # the options of RunConfig (zeppelin.runtime.config)
    rank = int(os.environ.get("RANK", "0"))
    startup.one_line_warnings(rank)
    from .train.loop import NonFiniteError, PeerStopped, run_job
    from .train.verify import VerifyError

    startup.mark("imports")

    try:
        cfg = RunConfig(**args)  # checks every option
        summary = run_job(cfg)
        _finishing()
    except InputError as e:
        _finishing()
        _report(rank, str(e), 2)
        return 2
    except (VerifyError, NonFiniteError) as e:
        _finishing()
        _report(rank, str(e), 1)
        return 1
    except PeerStopped:  # another rank reports the cause; this one leaves as a stopped rank does
        _finishing()
        from .lifecycle import PEER_STOPPED_EXIT

        return PEER_STOPPED_EXIT
    except KeyboardInterrupt:
        _finishing()
        sig = _STOPPED_BY[0] if _STOPPED_BY else int(signal.SIGINT)
        if rank == 0 and not os.environ.get(PARENT_ENV):  # under a launcher, the launcher reports
            print(f"zeppelin: error: stopped by {signal.Signals(sig).name}", file=sys.stderr, flush=True)
        return 128 + sig
    except Exception as e:  # noqa: BLE001 - any failure: one line here, the traceback in the error file
        _finishing()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _report(rank, f"{e.__class__.__name__}: {msg}" if msg else e.__class__.__name__, 1, traceback.format_exc())
        return 1
    if rank == 0 and summary:
        losses = summary["losses"]
        line = f"zeppelin run: {summary['steps_run']} steps"
        if summary.get("skipped"):
            line += f" ({summary['skipped']} skipped by --nan-policy skip: loss or gradient norm not finite)"
        if losses:
            line += f", loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        if "tp_overlap" in summary:
            line += f", TP overlap {summary['tp_overlap']}"
        print(line + f"; metrics in {summary['metrics']}", flush=True)
        if "export" in summary:
            print(f"zeppelin run: exported the model to {summary['export']} (transformers "
                  "AutoModelForCausalLM.from_pretrained loads it)", flush=True)
        if "verify" in summary:
            v = summary["verify"]
            print(f"zeppelin run: --verify max relative differences: loss {v['loss_rel']:.2e}, "
                  f"outputs {v['hidden_rel']:.2e}, gradients {v['grad_rel']:.2e} "
                  f"(tolerance {v['tolerance']:g})"
                  + (f"; gradients vs an fp64 oracle: distributed {v['grad_rel_vs_fp64']:.2e}, single-process "
                     f"fp32 {v['fp32_reference_vs_fp64']:.2e}" if "grad_rel_vs_fp64" in v else "")
                  + " - ok", flush=True)
    return 0


def _guarded_main() -> int:
    try:
        code = main()
    except KeyboardInterrupt:  # a stop signal before the job started (or between the handlers)
        code = 128 + (_STOPPED_BY[0] if _STOPPED_BY else int(signal.SIGINT))
    if code != 0:
        # the failure is reported (error file, one line): leave without the interpreter's shutdown,
        # whose process-group destructors can abort on a peer that is gone and print a C++
        # "terminate ... what(): Traceback" after the report
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(_guarded_main())
