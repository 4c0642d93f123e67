"""The memory model on one device: the executor's steady-state step (AdamW moments already there)
under ZeRO 0/2/3 and each recompute mode, bf16; on CUDA the allocator's peak of the step
(``torch.cuda.max_memory_allocated``) and the components the executor measures, beside the cost
model's components for the tokens held. Prints one line per case, writes JSON to OUT.

    python benchmarks/bench_memory_gpu.py cuda OUT.json     (a 0.5 B-parameter probe, 8,192 tokens)
    python benchmarks/bench_memory_gpu.py cpu OUT.json      (a tiny probe, for a dry run)

On CUDA the peak also holds what the model does not charge per component (the loss backward's
logit gradients, kernel workspaces): their size is the peak minus the predicted sum."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from zeppelin.planner.baselines.packed import PackedDP
from zeppelin.planner.costmodel.context import PlanContext
from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.runtime.data import TokenSource
from zeppelin.runtime.executor import Executor
from zeppelin.runtime.groups import GroupCache, set_default_cache
from zeppelin.runtime.model import LlamaModel
from zeppelin.schemas.cluster import GPUSpec, cluster_preset
from zeppelin.schemas.common import content_hash
from zeppelin.schemas.model import ModelSpec
from zeppelin.schemas.plan import InputHashes, PlanHeader, Sequence
from zeppelin.schemas.profile import default_profile

dev_name = sys.argv[1]
out_path = sys.argv[2]
big = dev_name == "cuda"
dev = torch.device("cuda", 0) if big else torch.device("cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl" if big else "gloo", rank=0, world_size=1)
if big:
    torch.cuda.set_device(0)
    spec = ModelSpec(name="gpu-probe", num_layers=8, hidden=2048, num_heads=16, num_kv_heads=8, ffn_hidden=5632,
                     vocab_size=32000, dtype="bf16")
    lengths = [4096, 2048, 1024, 1024]
else:
    spec = ModelSpec(name="cpu-probe", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=176,
                     vocab_size=256, dtype="bf16")
    lengths = [256, 128]
cl = cluster_preset("local-cpu:1x1")
cl = cl.model_copy(update={"gpu": GPUSpec(name="big", peak_tflops=989.0, memory_gb=141.0)})
prof = default_profile(cl.name, "cuda")
res = {"device": torch.cuda.get_device_name(0) if big else "cpu", "torch": torch.__version__,
       "spec": spec.model_dump(), "tokens": sum(lengths), "cases": {}}
print("kernels: flash_attn importable:", end=" ")
try:
    import flash_attn  # noqa: F401
    print(True)
except ImportError:
    print(False)
for zero in (0, 2, 3):
    for rc in ("none", "selective", "full"):
        t0 = time.time()
        header = PlanHeader(planner="packed-dp", num_steps=1, world_size=1, seed=0, cluster=cl, model=spec,
                            profile=prof, zero_stage=zero, recompute=rc,
                            hashes=InputHashes(cluster=content_hash(cl), model=content_hash(spec),
                                               profile=content_hash(prof), manifest="synthetic"))
        ctx = PlanContext(cluster=cl, model=spec, profile=prof, zero_stage=zero, recompute=rc)
        step = PackedDP().plan_step(ctx, 0, [Sequence(sample_id=i, length=L) for i, L in enumerate(lengths)])
        cache = GroupCache(1, header=header, steps=[step])
        set_default_cache(cache)
        model = LlamaModel(spec, seed=0).to(dev)
        ex = Executor(header, model, TokenSource(spec.vocab_size, 0), rank=0, world_size=1, device=dev, groups=cache,
                      zero_stage=zero, dtype="bf16", recompute=rc)
        r = ex.forward_backward(step)
        ex.optimizer_step()
        if big:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        r = ex.forward_backward(step)
        ex.optimizer_step()
        mem = ex.measured_memory(r)
        cost = CostModel(cl, spec, prof, zero_stage=zero, recompute=rc)
        pred = {k: float(v) for k, v in cost.memory_components(mem["activation_tokens"]).items()}
        case = {"measured": mem, "predicted": pred, "sum_predicted": sum(pred.values()),
                "plan_memory_gb": step.prediction.per_unit.memory_gb[0], "s": round(time.time() - t0, 1)}
        if big:
            case["allocated_before_step"] = base
            case["reserved_peak"] = torch.cuda.max_memory_reserved()
        key = f"zero{zero}/{rc}"
        res["cases"][key] = case
        m = mem["measured"]
        print(key, "measured", m, "predicted", int(case["sum_predicted"]),
              f"err {(case['sum_predicted'] - m) / m:+.3f}",
              {k: (round((pred[k] - mem.get(k, 0)) / mem[k], 3) if mem.get(k) else None) for k in pred}, flush=True)
        del ex, model, r
        if big:
            torch.cuda.empty_cache()
with open(out_path, "w") as fh:
    json.dump(res, fh, indent=1, default=str)
dist.destroy_process_group()
