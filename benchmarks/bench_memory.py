"""The planner's memory model vs what the runtime measures, per component, on N gloo ranks.

For each case (model, compute dtype, ZeRO stage, recompute mode) one step of a ``packed-dp`` plan
(every sequence on one rank, two sequences per rank) runs through the executor; each rank's
memory by component (``Executor.measured_memory``: weights, gradients, AdamW moments, whole FSDP
weights and pending gradients, saved activations, what one recomputation holds) sits beside the
cost model's components for the tokens that rank holds (``CostModel.memory_components``) and the
plan's predicted total. Prints one JSON document: per case the predicted and measured bytes by
component (rank 0; every rank holds the same here) and the relative error
``(predicted - measured) / measured`` of each component and of the sum.

    python benchmarks/bench_memory.py [--ranks 4] [--tokens 512] [--cases all|small|hf] [--tp 2]

``--tp N``: the ranks form units of ``N`` (TP-SP), each unit holding its two sequences' tokens
sharded over its ranks; the cost model prices the unit's tokens at TP ``N``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

# the repository root, for the test process pool (tests/support/dist_pool.py, not part of the package)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMPONENTS = ("params", "grads", "optimizer", "unsharded", "activations", "recompute")


def _worker(rank, world, header_json, step_json, zero, recompute, dtype, hf):
    import torch

    from zeppelin.runtime.data import TokenSource
    from zeppelin.runtime.executor import Executor
    from zeppelin.runtime.groups import GroupCache, set_default_cache
    from zeppelin.runtime.model import LlamaModel
    from zeppelin.schemas.plan import PlanHeader, StepPlan

    header = PlanHeader.model_validate_json(header_json)
    step = StepPlan.model_validate_json(step_json)
    cache = GroupCache(world, header=header, steps=[step])
    set_default_cache(cache)
    if hf is not None:
        from zeppelin.runtime.hf import load_hf_model

        model = load_hf_model(hf, seed=0, spec=header.model)
    else:
        model = LlamaModel(header.model, seed=0)
    ex = Executor(header, model, TokenSource(header.model.vocab_size, header.seed), rank=rank, world_size=world,
                  device=torch.device("cpu"), groups=cache, zero_stage=zero, dtype=dtype, recompute=recompute)
    res = ex.forward_backward(step)
    ex.optimizer_step()
    return ex.measured_memory(res)


def _hf_llama(root: Path) -> str:
    """A tiny transformers Llama directory (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 256)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(root))
    return f"hf:{root}"


def _cases(which: str) -> list[tuple[str, str, int, str]]:
    small = [("small", "fp32", z, r) for z in (0, 1, 2, 3) for r in ("none", "selective", "full")]
    small += [("small", "bf16", 3, r) for r in ("none", "selective", "full")]
    hf = [("hf-llama", "fp32", z, r) for z in (0, 2, 3) for r in ("none", "selective", "full")]
    return {"all": small + hf, "small": small, "hf": hf}[which]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank (two sequences of half that)")
    ap.add_argument("--cases", default="all", choices=("all", "small", "hf"))
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of every unit (built-in models)")
    args = ap.parse_args()
    if args.tp > 1 and args.cases != "small":
        ap.error("--tp runs the built-in models only (--cases small): Hugging Face models run at TP 1")

    from tests.support.dist_pool import DistributedPool
    from zeppelin.planner.core.base import PlanContext, get_planner
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.common import content_hash
    from zeppelin.schemas.model import model_preset, resolve_model_ref
    from zeppelin.schemas.plan import InputHashes, PlanHeader, Sequence
    from zeppelin.schemas.profile import default_profile

    cluster = cluster_preset(f"local-cpu:1x{args.ranks}")
    profile = default_profile(cluster.name, cluster.device)
    lengths = [args.tokens // 2] * (2 * args.ranks // args.tp)     # two sequences per unit
    out = {"ranks": args.ranks, "tp": args.tp, "tokens_per_rank": args.tokens, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp, DistributedPool(args.ranks, threads=1) as pool:
        hf_ref = _hf_llama(Path(tmp) / "llama") if args.cases != "small" else None
        for name, dtype, zero, recompute in _cases(args.cases):
            hf = hf_ref if name == "hf-llama" else None
            spec = (resolve_model_ref(hf) if hf else model_preset(name)).model_copy(update={"dtype": dtype})
            header = PlanHeader(planner="packed-dp", num_steps=1, world_size=cluster.world_size, seed=0,
                                cluster=cluster, model=spec, profile=profile, zero_stage=zero, recompute=recompute,
                                tp=args.tp,
                                hashes=InputHashes(cluster=content_hash(cluster), model=content_hash(spec),
                                                   profile=content_hash(profile), manifest="synthetic"))
            ctx = PlanContext(cluster=cluster, model=spec, profile=profile, zero_stage=zero, recompute=recompute,
                              tp=args.tp)
            seqs = [Sequence(sample_id=100 + i, length=L) for i, L in enumerate(lengths)]
            step = get_planner("packed-dp").plan_step(ctx, 0, seqs)
            mem = pool.run(_worker, header.model_dump_json(), step.model_dump_json(), zero, recompute, dtype, hf,
                           timeout=600)[0]
            cost = CostModel(cluster, spec, profile, zero_stage=zero, recompute=recompute, tp=args.tp)
            # the model prices a unit's tokens; the rank reports its share of them
            pred = {k: float(v) for k, v in cost.memory_components(mem["activation_tokens"] * args.tp).items()}
            meas = {k: int(mem.get(k, 0)) for k in COMPONENTS}
            err = {k: (round((pred[k] - meas[k]) / meas[k], 4) if meas[k] else None) for k in COMPONENTS}
            total_p, total_m = sum(pred.values()), int(mem["measured"])
            case = {"predicted_bytes": {k: int(v) for k, v in pred.items()}, "measured_bytes": meas,
                    "rel_error": err, "sum_predicted_bytes": int(total_p), "sum_measured_bytes": total_m,
                    "sum_rel_error": round((total_p - total_m) / total_m, 4),
                    "plan_predicted_bytes": int(step.prediction.per_unit.memory_gb[0] * 1e9)}
            key = f"{name}/{dtype}/zero{zero}/{recompute}" + (f"/tp{args.tp}" if args.tp > 1 else "")
            out["cases"][key] = case
            print(json.dumps({key: case["sum_rel_error"]}), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
