"""Sequence parallelism past the KV-head count on 8 gloo ranks (FSDP2): Ulysses groups of 2x and 4x
the KV heads (K/V heads replicated over the positions that need them) and 2-D ``usp`` groups (Ulysses
rows x a ring across them) of shapes 2x2, 2x4 and 4x2, zigzag and contiguous, in one step of four
micro-batches. One pool spawn runs the built-in model with a sliding-window layer and a full layer,
and a tiny Hugging Face Llama, both with 8 query heads over 2 KV heads, each against its single-process reference (loss and
every gradient, fp32 1e-5; the built-in model's final hidden states of every token too)."""

from __future__ import annotations

import pytest
import torch

from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.invariants import group_rings, inter_ring_transfers, plan_problems
from zeppelin.schemas.layout import contiguous_ranges, usp_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import Group, MicroBatch, Placement, Route, RoutePath, Sequence, StepPlan

from tests.runtime.test_flexsp_hydraulis_tp_plans import check, seed_header
from tests.runtime.test_hf import _hf_step, transformers_reference
from tests.support.numerics import assert_matches_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

WORLD = 8
WINDOW = 6
LENS = [45, 23, 38, 12, 31, 27, 9, 50, 19, 33]


def usp_step(k: int = 0) -> StepPlan:
    """Micro-batch 0: a 2x2 usp group on units 0-3 (one zigzag, one contiguous sequence) beside a
    Ulysses group of 4 (2x the KV heads) on units 4-7; 1: a 2x4 usp group over both nodes; 2: a 4x2
    usp group whose rows are the nodes, listed node 1 first (K/V heads replicated 2x in each row, a
    9-token sequence leaving positions empty); 3: a Ulysses group of 8 (4x the KV heads)."""
    seqs = [Sequence(sample_id=900 + 20 * k + i, length=L) for i, L in enumerate(LENS)]

    def usp(seq, shape, scheme="zigzag", group=0):
        return Placement(seq=seq, group=group, scheme=scheme, ranges=usp_ranges(LENS[seq], *shape, scheme))

    def uly(seq, G, group=0):
        return Placement(seq=seq, group=group, scheme="contiguous", ranges=contiguous_ranges(LENS[seq], G))

    mb0 = MicroBatch(groups=[Group(kind="usp", tier="intra", units=[0, 1, 2, 3], shape=[2, 2], kv_replication=1),
                             Group(kind="ulysses", tier="intra", units=[4, 5, 6, 7], kv_replication=2)],
                     placements=[usp(0, (2, 2)), usp(1, (2, 2), "contiguous"), uly(2, 4, 1), uly(3, 4, 1)],
                     queues=[[0]] * 4 + [[1]] * 4)
    mb1 = MicroBatch(groups=[Group(kind="usp", tier="inter", units=list(range(8)), shape=[2, 4], kv_replication=1)],
                     placements=[usp(4, (2, 4)), usp(5, (2, 4))], queues=[[0]] * 8)
    mb2 = MicroBatch(groups=[Group(kind="usp", tier="inter", units=[4, 5, 6, 7, 0, 1, 2, 3], shape=[4, 2],
                                   kv_replication=2)],
                     placements=[usp(6, (4, 2)), usp(7, (4, 2))], queues=[[0]] * 8)
    mb3 = MicroBatch(groups=[Group(kind="ulysses", tier="inter", units=list(range(8)), kv_replication=4)],
                     placements=[uly(8, 8), uly(9, 8)], queues=[[0]] * 8)
    mb1.routes, mb2.routes = column_routes(mb1, relay=True), column_routes(mb2, relay=False)
    return StepPlan(step=k, sequences=seqs, microbatches=[mb0, mb1, mb2, mb3])


def column_routes(mb: MicroBatch, relay: bool) -> list[Route]:
    """A route for every node-crossing hop of the usp groups' column rings (4 units per node):
    direct, or (``relay``) half of each block through the column ring's other unit on each node
    (its other row there), which the runtime relays through inside the ring."""
    nic = cluster_preset("local-cpu:2x4").nic_of
    out = []
    for (gi, s, d), tokens in inter_ring_transfers(mb, [u // 4 for u in range(8)]).items():
        ring = next(x for x in group_rings(mb.groups[gi]) if s in x)
        paths = [RoutePath(via_src=s, via_dst=d, nic_src=nic(s), nic_dst=nic(d), tokens=tokens)]
        if relay:
            a = next(x for x in ring if x // 4 == s // 4 and x != s)
            b = next(x for x in ring if x // 4 == d // 4 and x != d)
            paths = [paths[0].model_copy(update={"tokens": tokens // 2}),
                     RoutePath(via_src=a, via_dst=b, nic_src=nic(a), nic_dst=nic(b), tokens=tokens - tokens // 2)]
        out.append(Route(group=gi, src=s, dst=d, tokens=tokens, bytes=0, paths=paths))
    return out


def windowed_tiny():
    """The tiny model with 8 query heads over 2 KV heads, a sliding-window layer and a full one."""
    return model_preset("tiny").model_copy(update={"name": "tiny-usp-window", "num_heads": 8, "sliding_window": WINDOW,
                                                   "layer_types": ["sliding_attention", "full_attention"]})


def make_llama_dir(path):
    """A tiny transformers Llama with 8 query heads over 2 KV heads (written by transformers)."""
    import json

    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=4096)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    c = json.loads((path / "config.json").read_text())
    c["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(c, indent=1))
    return path


def test_plan_states_shapes_and_replication():
    header, step = seed_header(cluster_preset("local-cpu:2x4"), windowed_tiny(), 1, "hand"), usp_step()
    assert plan_problems(header, step) == []
    kinds = [(g.kind, g.shape, g.kv_replication) for mb in step.microbatches for g in mb.groups]
    assert kinds == [("usp", [2, 2], 1), ("ulysses", None, 2), ("usp", [2, 4], 1), ("usp", [4, 2], 2),
                     ("ulysses", None, 4)]
    # the 2x4 group's column rings cross the nodes twice each, half of every block relayed
    assert [(r.src, r.dst, [(p.via_src, p.via_dst) for p in r.paths]) for r in step.microbatches[1].routes] == [
        (2, 4, [(2, 4), (0, 6)]), (6, 0, [(6, 0), (4, 2)]), (3, 5, [(3, 5), (1, 7)]), (7, 1, [(7, 1), (5, 3)])]


def test_builtin_model_with_window_layer_equals_reference(pool):
    header = seed_header(cluster_preset("local-cpu:2x4"), windowed_tiny(), 1, "hand")
    outs = check(pool, header, usp_step(), seed=3)  # (the 2x4 group's crossings relayed inside its columns)
    assert all(o["bytes"]["inter"] > 0 for o in outs)  # the 2x4 / 4x2 rings cross the nodes


def test_hf_llama_two_kv_heads_equals_transformers(pool, tmp_path):
    from zeppelin.schemas.hf import hf_model_spec

    d = make_llama_dir(tmp_path / "llama")
    ref = f"hf:{d}"
    spec = hf_model_spec(ref)
    assert (spec.num_heads, spec.num_kv_heads) == (8, 2)
    header = seed_header(cluster_preset("local-cpu:2x4"), spec, 1, "hand")
    step = usp_step(1)
    assert plan_problems(header, step) == []
    outs = pool.run(_hf_step, header.model_dump_json(), step.model_dump_json(), ref, timeout=300)
    ref_loss, ref_grads = transformers_reference(d, header, step, torch.float32)
    for o in outs:
        assert_matches_reference(o["loss"], ref_loss, 1e-5, "loss")
    grads = outs[0]["grads"]
    assert set(grads) == set(ref_grads)
    for name in grads:
        assert_matches_reference(grads[name], ref_grads[name], 1e-5, f"gradient of {name}")
