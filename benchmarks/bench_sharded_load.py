"""Peak host memory of a rank that loads a real-size Hugging Face model sharded: a Llama of about
0.57 B parameters (hidden 1024, 32 layers, FFN 4096, 16 heads / 8 KV heads, vocab 32,000) with
random weights written as safetensors (several files), on 4 CPU ranks at ZeRO-3.

Each rank builds the model on the meta device, shards it (FSDP2), reads only its rows of the files
(:mod:`zeppelin.runtime.weights`), runs one planned step (forward, backward, AdamW) and reports its
RSS high-water mark (VmHWM: the whole process, torch's import included), the bytes it read and
held, and the step's loss. The bound each rank must stay under is the memory model's prediction for
its step (the plan's ``memory_gb``: sharded weights, gradients, AdamW moments, whole blocks and
activations) + 25% of the model's fp32 size + 1 GB for the process itself. The whole-model loader
this replaces held the fp32 model and a copy of the checkpoint in every rank: at least 2 x 4 P bytes.
Prints one JSON object::

    .venv/bin/python benchmarks/bench_sharded_load.py            # the 0.57 B model (needs ~16 GB)
    .venv/bin/python benchmarks/bench_sharded_load.py --layers 2 # a quick check of the script
    .venv/bin/python benchmarks/bench_sharded_load.py --verify   # through `zeppelin run --verify`

``--verify`` runs the same plan through ``zeppelin run --verify --zero-stage 3`` instead (the
sharded loader as a user runs it): rank 0 also holds the single-process reference (the whole model,
its gradients and the reference's own: about 3 x 4 P bytes more than its training state; ~16 GB in
all), so its step peak is reported but not held to the bound. Every rank runs with
``MALLOC_MMAP_THRESHOLD_=1048576`` (freed blocks of 1 MiB and more go back to the OS at once, as
``--verify`` sets on rank 0), so that the ranks waiting for the reference hold only their live memory. Afterwards one process
loads the whole model the way the loader before sharding did (``from_pretrained`` of the files, fp32)
and computes the step's loss single-process: it must equal the ``--verify`` reference's loss (built
from the ranks' gathered shards) bit for bit. The run is stopped when the machine's available
memory falls under ``--min-available-gb``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")


def write_llama(path: Path, layers: int, per_file: int = 4) -> int:
    """A Llama directory with random weights (N(0, 0.02), ones for norms) in several safetensors
    files, one tensor generated at a time; returns the parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    path.mkdir(parents=True)
    cfg.save_pretrained(str(path))
    with torch.device("meta"):
        shapes = {k: tuple(p.shape) for k, p in AutoModelForCausalLM.from_config(cfg).named_parameters()}
    g = torch.Generator().manual_seed(0)
    groups: dict[str, list[str]] = {}
    for k in shapes:
        i = int(k.split(".")[2]) // per_file if k.startswith("model.layers.") else -1
        groups.setdefault(f"{i + 1}", []).append(k)
    weight_map = {}
    for n, (gname, keys) in enumerate(sorted(groups.items(), key=lambda kv: int(kv[0]))):
        fname = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        part = {k: (torch.ones(shapes[k]) if k.endswith("norm.weight") else
                    torch.randn(shapes[k], generator=g) * 0.02) for k in keys}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
        del part
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(int(torch.Size(s).numel()) for s in shapes.values())


def rank_step(rank: int, world: int, plan: str, ref: str) -> dict:
    import torch

    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.executor import Executor
    from zeppelin.runtime.fsdp import local_tensor
    from zeppelin.runtime.groups import GroupCache, set_default_cache
    from zeppelin.runtime.hf import build_hf_model
    from zeppelin.runtime.memory import cpu_peak_bytes
    from zeppelin.schemas.plan import PlanReader

    reader = PlanReader(plan)
    header, step = reader.header, reader.step(0)
    cache = GroupCache(world, header=header, steps=[step])
    set_default_cache(cache)
    t0 = time.time()
    model = build_hf_model(ref, spec=header.model)
    ex = Executor(header, model, TokenSource(header.model.vocab_size, header.seed), rank=rank, world_size=world,
                  device=torch.device("cpu"), groups=cache, zero_stage=3)
    t_load = time.time() - t0
    loaded_peak = cpu_peak_bytes()
    res = ex.forward_backward(step)
    ex.optimizer.step()
    return {"rank": rank, "load_s": round(t_load, 1), "step_s": round(time.time() - t0 - t_load, 1),
            "peak_rss_after_load_bytes": loaded_peak, "peak_rss_bytes": cpu_peak_bytes(),
            "bytes_read": model.weights.bytes_read, "tensors_read": model.weights.tensors_read,
            "held_param_bytes": sum(local_tensor(p.detach()).numel() * 4 for p in model.parameters()),
            "loss": res.loss, "predicted_bytes": int(step.prediction.per_unit.memory_gb[0] * 1e9)}


def _available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _run_guarded(cmd: list[str], min_available: float) -> tuple[int, str, str, int]:
    """``cmd`` in a process group of its own, stopped (SIGTERM to the group) when the machine's
    available memory falls under ``min_available`` bytes; (exit code, stdout, stderr, the least
    available memory seen)."""
    # every rank hands freed blocks of 1 MiB and more back to the OS at once (what --verify does on
    # rank 0): the ranks waiting for rank 0's reference then hold their live memory only
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        least = _available_bytes()
        while p.poll() is None:
            time.sleep(1.0)
            least = min(least, _available_bytes())
            if least < min_available:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait()
                err.write(f"\nstopped: the machine's available memory fell to {least / 1e9:.2f} GB\n")
                break
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read(), err.read(), least


def whole_model_loss(ref: str, plan: Path) -> float:
    """Step 0's loss of the whole fp32 model loaded from the files (transformers' ``from_pretrained``,
    the loader before sharding), single-process, as the ``--verify`` reference computes it."""
    import torch
    from transformers import AutoModelForCausalLM

    from zeppelin.runtime.data import TokenSource, predicted_tokens
    from zeppelin.runtime.hf import HFCausalLM
    from zeppelin.runtime.model import ReferenceLayout
    from zeppelin.runtime.train.verify import step_microbatches
    from zeppelin.schemas.plan import PlanReader

    reader = PlanReader(str(plan))
    header, step = reader.header, reader.step(0)
    causal = AutoModelForCausalLM.from_pretrained(ref[3:], dtype=torch.float32, attn_implementation="eager")
    model = HFCausalLM(causal, header.model)
    model.dtype = torch.float32
    seqs = step.sequences
    batch = TokenSource(header.model.vocab_size, header.seed).segments(seqs, [[i, 0, s.length]
                                                                             for i, s in enumerate(seqs)])
    tokens, labels = torch.from_numpy(batch.tokens), torch.from_numpy(batch.labels)
    layout = ReferenceLayout([s.length for s in seqs], torch.device("cpu"), step_microbatches(step))
    with torch.no_grad():
        loss_sum, _ = model(tokens, labels, layout)
    return float(loss_sum / max(predicted_tokens(seqs), 1))


def verify_run(plan: Path, ref: str, d: Path, params: int, min_available_gb: float, label: str) -> dict:
    """The plan's step through ``zeppelin run --verify --zero-stage 3`` (4 ranks), then the whole
    model's loss single-process (see the module's text)."""
    metrics = d / "metrics.jsonl"
    cmd = [ZEPPELIN, "run", str(plan), "--model", ref, "--verify", "--zero-stage", "3", "--steps", "1",
           "--metrics", str(metrics), "--progress", "none", "--timeout", "3600", "--verify-timeout", "3600"]
    t0 = time.time()
    code, out, err, least = _run_guarded(cmd, min_available_gb * 1e9)
    res = {"bench": "sharded_load_verify", "label": label, "ranks": 4, "params": params,
           "fp32_model_bytes": 4 * params, "command": " ".join(["zeppelin", *cmd[1:]]), "exit_code": code,
           "run_s": round(time.time() - t0, 1),
           "least_available_bytes": least, "cpus": os.cpu_count(), "load_avg_1min": os.getloadavg()[0],
           "stdout_tail": out.strip().splitlines()[-4:], "stderr_tail": err.strip().splitlines()[-4:]}
    if code != 0 or not metrics.exists():
        return res
    rec = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rec = [r for r in rec if "verify" in r][0]
    mem = rec["memory"]
    bounds = [p + int(0.25 * 4 * params) + (1 << 30) for p in mem["predicted_bytes"]]
    peaks = mem["process_peak_bytes"]
    res.update({"loss": rec["loss"], "verify": rec["verify"], "step_peak_rss_bytes": peaks,
                "predicted_bytes": mem["predicted_bytes"], "bound_bytes": bounds,
                "training_ranks_within_bound": all(m <= b for m, b in zip(peaks[1:], bounds[1:]))})
    t1 = time.time()
    whole = whole_model_loss(ref, plan)
    res.update({"whole_model_loader_loss": whole, "whole_model_s": round(time.time() - t1, 1),
                "reference_equals_whole_model_loader": whole == rec["verify"]["loss_ref"]})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--label", default="")
    ap.add_argument("--verify", action="store_true", help="run the plan through `zeppelin run --verify`")
    ap.add_argument("--min-available-gb", type=float, default=1.5,
                    help="with --verify: stop the run when the machine has less memory available")
    ap.add_argument("--write-only", metavar="DIR", help=argparse.SUPPRESS)  # the model only; prints its size
    args = ap.parse_args()
    if args.write_only:
        print(write_llama(Path(args.write_only), args.layers))
        return
    sys.path.insert(0, str(ROOT))

    with tempfile.TemporaryDirectory(prefix="zeppelin-sharded-") as tmp:
        d = Path(tmp)
        if args.verify:  # written by a process of its own: this one stays small while the ranks run
            write = [sys.executable, __file__, "--layers", str(args.layers), "--write-only", str(d / "llama")]
            params = int(subprocess.run(write, check=True, capture_output=True, text=True).stdout)
        else:
            params = write_llama(d / "llama", args.layers)
        ref = f"hf:{d / 'llama'}"
        man = d / "m.jsonl"
        man.write_text("".join(json.dumps({"length": n}) + "\n" for n in [64, 32, 16, 16] * 8))
        plan = d / "p.plan"
        subprocess.run([ZEPPELIN, "plan", "-m", str(man), "-c", "local-cpu:1x4", "--model", ref, "--steps", "1",
                        "--tokens-per-step", "256", "--zero-stage", "3", "-q", "-o", str(plan)], check=True)
        if args.verify:
            print(json.dumps(verify_run(plan, ref, d, params, args.min_available_gb, args.label), indent=1))
            return
        from tests.support.dist_pool import run_distributed

        outs = run_distributed(rank_step, 4, str(plan), ref, timeout=1800)
    fp32 = 4 * params
    for o in outs:
        o["bound_bytes"] = o["predicted_bytes"] + int(0.25 * fp32) + (1 << 30)
        o["within_bound"] = o["peak_rss_bytes"] <= o["bound_bytes"]
    print(json.dumps({"bench": "sharded_load", "label": args.label, "ranks": 4, "params": params,
                      "fp32_model_bytes": fp32, "whole_model_loader_bytes_at_least": 2 * fp32,
                      "cpus": os.cpu_count(), "load_avg_1min": os.getloadavg()[0],
                      "all_within_bound": all(o["within_bound"] for o in outs),
                      "same_loss_on_every_rank": len({o["loss"] for o in outs}) == 1, "ranks_detail": outs},
                     indent=1))


if __name__ == "__main__":
    main()
