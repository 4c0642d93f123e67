"""Rank 0's per-step metrics: one record per step (:func:`step_record`), handed to every sink.

A sink is anything with ``write(record)`` and ``close()`` (:class:`MetricsSink`). A run opens
(:func:`open_sinks`): the metrics JSON Lines file (:class:`JsonlSink`, always), the TensorBoard
event files (:class:`TensorBoardSink`, ``--tensorboard DIR``), the progress display
(:class:`ProgressSink`, ``--progress``) and the capacity warning on stderr
(:class:`CapacityWarning`). Steps are numbered from 0 everywhere, as in the plan: the ``step`` of
a record, the progress line (``step 3 (4 of 8)``), errors and the checkpoint a run resumes from.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from zeppelin.schemas.common import InputError
from zeppelin.schemas.plan import PlanHeader, StepPlan

__all__ = ["TENSORBOARD_SCALARS", "CapacityWarning", "JsonlSink", "MetricsSink", "ProgressSink", "Sinks",
           "TensorBoardSink", "add_utilisation", "finite_json", "memory_record", "metrics_record", "model_flops",
           "open_sinks", "progress_label", "step_record"]

#: the metrics written to TensorBoard (tag: key of the metrics record)
TENSORBOARD_SCALARS = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
                       "perf/tokens_per_s": "tokens_per_s", "perf/mfu": "mfu", "perf/step_time_s": "step_time_s",
                       "perf/predicted_step_time_s": "predicted_step_time_s",
                       "perf/measured_over_predicted": "measured_over_predicted",
                       "memory/max_bytes": "max_memory_bytes"}

PHASES = ("data", "forward", "backward", "attention", "remap", "linear", "grad_allreduce", "optimizer", "step")


class MetricsSink:
    """Where the records of a run go. ``write`` receives each step's record, ``close`` the end."""

    def write(self, rec: dict[str, Any]) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


class JsonlSink(MetricsSink):
    """One strict-JSON line per step (non-finite numbers as null), flushed as it is written; a
    resumed run appends to the file of the run it continues."""

    def __init__(self, path, append: bool) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fh = path.open("a" if append else "w")  # streamed: checked up front by check_output
        except OSError as e:
            raise self._error(e) from None

    def _error(self, e: OSError) -> InputError:
        """A failed open or write (full disk, read-only filesystem): one line naming the file and why."""
        return InputError(f"cannot write the metrics file: {e.strerror or e}", source=self.path)

    def write(self, rec: dict[str, Any]) -> None:
        try:
            self.fh.write(json.dumps(finite_json(rec), allow_nan=False) + "\n")
            self.fh.flush()
        except OSError as e:
            raise self._error(e) from None

    def close(self) -> None:
        self.fh.close()


class TensorBoardSink(MetricsSink):
    """The scalar metrics of :data:`TENSORBOARD_SCALARS` as TensorBoard events, at the record's step."""

    def __init__(self, directory: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise InputError("--tensorboard needs the tensorboard package (pip install tensorboard)") from None
        self.writer = SummaryWriter(log_dir=directory)

    def write(self, rec: dict[str, Any]) -> None:
        for tag, key in TENSORBOARD_SCALARS.items():
            v = rec.get(key)
            if isinstance(v, (int, float)):
                self.writer.add_scalar(tag, v, rec["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class ProgressSink(MetricsSink):
    """The progress display: a rich bar on a terminal, one plain line per step otherwise
    (``step K (N of TOTAL)``: K the step, from 0 as everywhere, N how many of the run's steps are done)."""

    def __init__(self, mode: str, total: int, start: int) -> None:
        self.mode = mode
        self.bar = None
        if mode == "auto":
            self.mode = "rich" if sys.stdout.isatty() else "plain"
        if self.mode == "rich":
            from rich import progress as rp

            self.bar = rp.Progress(rp.TextColumn("[bold]zeppelin run"), rp.BarColumn(), rp.MofNCompleteColumn(),
                                   rp.TextColumn("{task.description}"), rp.TimeElapsedColumn(), rp.TextColumn("ETA"),
                                   rp.TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("", total=total, completed=start)
        self.total = total

    def write(self, rec: dict[str, Any]) -> None:
        desc = (f"loss {rec['loss']:.4f}  {rec['step_time_s'] * 1e3:.0f} ms  "
                f"{rec['tokens_per_s']:.0f} tok/s")
        if rec.get("lr") is not None:
            desc += f"  lr {rec['lr']:.3g}"
        if rec.get("grad_norm") is not None:
            desc += f"  grad norm {rec['grad_norm']:.3g}"
        if rec.get("skipped"):
            desc += f"  skipped ({rec['skipped']})"
        if rec.get("mfu") is not None:
            desc += f"  MFU {rec['mfu'] * 100:.1f}%"
        if "verify" in rec:
            desc += f"  verify {max(rec['verify']['grad_rel'], rec['verify']['loss_rel']):.1e}"
        if self.mode == "rich":
            self.bar.update(self.task, advance=1, description=f"step {rec['step']}  {desc}")
        elif self.mode == "plain":
            from zeppelin.schemas.common import fit_width

            print(fit_width(f"{progress_label(rec['step'], self.total)}  {desc}"), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def progress_label(step: int, total: int) -> str:
    """``step K (N of TOTAL)``: the step as numbered everywhere (from 0), then the count done."""
    return f"step {step} ({step + 1} of {total})"


class CapacityWarning(MetricsSink):
    """One line on stderr for each rank whose measured memory exceeds the plan's GPU."""

    def __init__(self, header: PlanHeader) -> None:
        self.gpu = header.cluster.gpu

    def write(self, rec: dict[str, Any]) -> None:
        for r in rec["memory"]["exceeds_capacity"]:
            print(f"zeppelin run: warning: step {rec['step']}: rank {r} measured "
                  f"{rec['memory']['measured_bytes'][r] / 1e9:.2f} GB, more than the "
                  f"{self.gpu.memory_gb:g} GB of a {self.gpu.name} the plan assumes", file=sys.stderr, flush=True)


class Sinks(MetricsSink):
    """Every sink of a run, written in order (none on ranks other than 0)."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def write(self, rec: dict[str, Any]) -> None:
        for s in self.sinks:
            s.write(rec)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def open_sinks(cfg, header: PlanHeader, rank: int, start: int, end: int, resumed: bool) -> Sinks:
    """The sinks of rank 0 (an empty set elsewhere): TensorBoard, the capacity warning, the JSONL
    file and the progress display, in the order each record reaches them."""
    if rank != 0:
        return Sinks([])
    made: list[MetricsSink] = []
    try:
        jsonl = JsonlSink(cfg.metrics_path, append=resumed)
        made.append(jsonl)
        progress = ProgressSink(cfg.progress, end, start)
        made.append(progress)
        tboard = [TensorBoardSink(cfg.tensorboard)] if cfg.tensorboard else []
    except BaseException:
        Sinks(made).close()
        raise
    return Sinks([*tboard, CapacityWarning(header), jsonl, progress])


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (metrics files are strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def model_flops(spec, lengths) -> float:
    """Model FLOPs of a training step (forward + backward, recomputation not counted): 6 per
    active parameter per token for the decoder blocks (an MoE layer's top-k and shared experts
    and its router, not every expert) and the LM head (the embedding is a lookup), and attention's
    12 ``q_dim`` per visible query-key pair of each layer (``L^2 / 2`` pairs causal, about ``L w``
    in a window of ``w``)."""
    h = spec.hidden
    attn_proj = h * (spec.q_dim + 2 * spec.kv_dim) + spec.q_dim * h
    mlp = (3 if spec.mlp == "swiglu" else 2) * h * spec.mlp_ffn_params(active=True)
    router = h * spec.num_experts if spec.is_moe else 0
    dense = (attn_proj + mlp + router) * spec.num_layers + spec.vocab_size * h

    def pairs(n: float, w: int | None) -> float:
        if w is None or n <= w:
            return n * n / 2.0
        return n * w - w * w / 2.0

    attn = sum(12.0 * spec.q_dim * pairs(float(n), w) for w in spec.layer_windows() for n in lengths)
    return 6.0 * dense * sum(lengths) + attn


def add_utilisation(rec: dict[str, Any], step: StepPlan, header: PlanHeader) -> None:
    """Model FLOPs, the MFU estimate (against the peak of the plan's GPUs) and the measured step
    time relative to the plan's prediction."""
    flops = model_flops(header.model, [s.length for s in step.sequences])
    t = rec["step_time_s"]
    peak = header.cluster.gpu.peak_tflops * 1e12 * header.world_size
    rec["model_tflops"] = flops / 1e12
    rec["mfu"] = flops / (t * peak) if t > 0 else None
    measured = rec["memory"]["measured_bytes"]
    rec["max_memory_bytes"] = max(measured) if measured else 0
    pred = (rec.get("predicted") or {}).get("step_time_s")
    rec["predicted_step_time_s"] = pred
    rec["measured_over_predicted"] = t / pred if pred else None


def memory_record(step: StepPlan, per_rank: list, header: PlanHeader | None) -> dict[str, Any]:
    """Measured memory of every rank next to the plan's prediction for that rank."""
    mems = [pr[3] if len(pr) > 3 else {} for pr in per_rank]
    measured = [int(m.get("measured", 0)) for m in mems]
    out: dict[str, Any] = {
        "measured_bytes": measured,
        "params_bytes": [int(m.get("params", 0)) for m in mems],
        "grads_bytes": [int(m.get("grads", 0)) for m in mems],
        "optimizer_bytes": [int(m.get("optimizer", 0)) for m in mems],
        "activation_bytes": [int(m.get("activations", 0)) for m in mems],
        "unsharded_bytes": [int(m.get("unsharded", 0)) for m in mems],
        "recompute_bytes": [int(m.get("recompute", 0)) for m in mems],
        "process_peak_bytes": [int(m.get("process_peak", 0)) for m in mems],
        "activation_bytes_per_token": [round(int(m.get("activations", 0)) / m["activation_tokens"], 3)
                                       if m.get("activation_tokens") else 0.0 for m in mems],
        # per rank, per micro-batch: its recomputation, tokens, bytes held, forward and backward seconds
        "microbatches": [[{k: (round(v, 6) if isinstance(v, float) else v) for k, v in mb.items()}
                          for mb in m.get("microbatches", [])] for m in mems],
        "predicted_bytes": None,
        "capacity_bytes": None,
        "exceeds_capacity": [],
    }
    if header is not None:
        cap = header.cluster.gpu.memory_gb * 1e9
        out["capacity_bytes"] = cap
        out["exceeds_capacity"] = [r for r, v in enumerate(measured) if v > cap]
        if step.prediction is not None:
            unit_of = {}
            for u, rep in enumerate(header.replicas(step)):
                for r in rep.ranks:
                    unit_of[r] = u
            gb = step.prediction.per_unit.memory_gb
            out["predicted_bytes"] = [int(gb[unit_of[r]] * 1e9) if unit_of.get(r, len(gb)) < len(gb) else None
                                      for r in range(len(per_rank))]
    return out


def metrics_record(step: StepPlan, loss: float, per_rank: list, report: dict | None,
                   header: PlanHeader | None = None) -> dict[str, Any]:
    """The measured part of a step's record: loss, tokens, time, phases, bytes and memory per rank
    (``per_rank``: every rank's ``(phases, bytes, tokens, memory)``), the plan's prediction and the
    ``--verify`` report."""
    phases = {n: [round(pr[0].get(n, 0.0), 6) for pr in per_rank] for n in PHASES}
    step_time = max(phases["step"])
    nbytes: dict[str, int] = {}
    for pr in per_rank:
        for cls, v in pr[1].items():
            nbytes[cls] = nbytes.get(cls, 0) + int(v)
    rec: dict[str, Any] = {
        "step": step.step,
        "loss": loss,
        "sequences": len(step.sequences),
        "tokens": step.tokens,
        "step_time_s": step_time,
        "tokens_per_s": step.tokens / step_time if step_time > 0 else 0.0,
        "phases_s": phases,
        "bytes_sent": nbytes,
        "tokens_per_rank": [pr[2] for pr in per_rank],
        "peak_memory_bytes": [int(pr[0].get("peak_memory_bytes", 0)) for pr in per_rank],
        "memory": memory_record(step, per_rank, header),
    }
    if step.prediction is not None:
        p = step.prediction
        rec["predicted"] = {"step_time_s": p.step_time_s, "attention_s": p.per_unit.attention_s,
                            "linear_s": p.per_unit.linear_s, "comm_s": p.per_unit.comm_s,
                            "exposed_comm_s": p.per_unit.exposed_comm_s}
    if report is not None:
        rec["verify"] = report
    return rec


def step_record(step: StepPlan, header: PlanHeader, loss: float, per_rank: list, report: dict | None, *,
                lr: float, grad_norm: float | None, skipped: str | None) -> dict[str, Any]:
    """The whole record of a step: :func:`metrics_record`, the step's learning rate (the schedule's
    value, a skipped step's too), the gradient norm (None when skipped), the utilisation and the
    reason a step was skipped."""
    rec = metrics_record(step, loss, per_rank, report, header)
    rec["lr"] = lr
    rec["grad_norm"] = grad_norm
    add_utilisation(rec, step, header)
    if skipped is not None:
        rec["skipped"] = skipped
    return rec
