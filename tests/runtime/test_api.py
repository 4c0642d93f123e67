"""The public runtime API (docs/API.md), exercised through ``zeppelin.runtime``'s public names only.

Plans come from the planners (te-cp rings, zeppelin rings + local + remap, zeppelin Ulysses,
DeepSpeed-Ulysses) on 2 gloo ranks. On every rank the test builds q/k/v for its linear-layout rows,
remaps them, runs :func:`attention`, remaps back and backpropagates; the outputs and gradients of
every real token must equal a single-process float64 SDPA reference within 1e-5.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import zeppelin.runtime as z
from tests.support.clusters import cluster_preset  # local-cpu over fast links
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import write_plan

from tests.runtime.test_runtime_dist import make_header, planner_step
from tests.support.numerics import assert_matches_reference

WORLD = 2
TOL = 1e-5
STEPS = [[600, 60, 33, 8, 5, 3, 1], [250, 60, 33, 8]]
PLANS = {
    "te-cp": ("te-cp", {"cp": 2}),
    "zeppelin": ("zeppelin", {"intra": "ring"}),     # a ring + local sequences; a remapped step
    "zeppelin-ulysses": ("zeppelin", {}),            # a Ulysses group + local sequences
    "ulysses": ("ulysses", {}),
}

KINDS = {"te-cp": {"ring"}, "zeppelin": {"ring", "local"}, "zeppelin-ulysses": {"ulysses", "local"},
         "ulysses": {"ulysses"}}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("api_plans")
    out = {}
    for key, (name, opts) in PLANS.items():
        header = make_header(cluster_preset("local-cpu:1x2"), model_preset("tiny"), len(STEPS), planner=name)
        steps = [planner_step(name, header, lens, k, **opts) for k, lens in enumerate(STEPS)]
        kinds = {g.kind for st in steps for mb in st.microbatches for g in mb.groups}
        assert kinds >= KINDS[key], (key, kinds)
        path = d / f"{key}.jsonl"
        write_plan(path, header, steps)
        out[key] = str(path)
    return out


def _values(seq: int, pos: torch.Tensor, heads: int, dim: int, salt: float) -> torch.Tensor:
    """Deterministic [len(pos), heads, dim] values of sequence ``seq`` (the same on every rank)."""
    p = pos.double()[:, None, None]
    h = torch.arange(heads, dtype=torch.float64)[None, :, None]
    d = torch.arange(dim, dtype=torch.float64)[None, None, :]
    return torch.sin(p * 0.731 + h * 1.37 + d * 0.513 + seq * 2.19 + salt) * (1 + 0.3 * torch.cos(p * 0.057 + d))


HQ, HKV, D = 4, 2, 16


def _rows(mb, lengths, heads, salt):
    parts, real = [], []
    for q, s, e in mb.segments:
        pos = torch.arange(s, e)
        parts.append(_values(q, pos, heads, D, salt))
        real.append(pos < lengths[q])
    return torch.cat(parts).float(), torch.cat(real)


def _attention_on_rank(rank: int, world: int, path: str):
    steps = z.open_plan(path, rank=rank, world_size=world)
    out = []
    for sc in steps:
        lengths = {i: L for i, L in enumerate(STEPS[sc.step])}
        for mb in sc:
            q, real = _rows(mb, lengths, HQ, 0.0)
            k, _ = _rows(mb, lengths, HKV, 1.0)
            v, _ = _rows(mb, lengths, HKV, 2.0)
            dout, _ = _rows(mb, lengths, HQ, 3.0)
            dout = dout * real[:, None, None]       # padding rows carry no gradient
            q.requires_grad_(True)
            k.requires_grad_(True)
            v.requires_grad_(True)
            qa, ka, va = (z.to_attention_layout(t, mb.context) for t in (q, k, v))
            o = z.to_linear_layout(z.attention(qa, ka, va, mb.context, layer=0), mb.context)
            (o * dout).sum().backward()
            out.append({"step": sc.step, "segments": mb.segments, "o": o.detach(), "dq": q.grad, "dk": k.grad,
                        "dv": v.grad, "remapped": mb.context.remapped, "bytes": mb.context.bytes_sent()})
    return out


def _reference(step: int, seq: int, L: int):
    pos = torch.arange(L)
    q = _values(seq, pos, HQ, D, 0.0).float().double().requires_grad_(True)
    k = _values(seq, pos, HKV, D, 1.0).float().double().requires_grad_(True)
    v = _values(seq, pos, HKV, D, 2.0).float().double().requires_grad_(True)
    dout = _values(seq, pos, HQ, D, 3.0).float().double()
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
        enable_gqa=True)[0].transpose(0, 1)
    (o * dout).sum().backward()
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(PLANS))
def test_attention_matches_single_process_sdpa(pool, plans, plan):
    outs = pool.run(_attention_on_rank, plans[plan], timeout=120)
    got: dict[tuple[int, int], dict[str, list]] = {}
    remapped = False
    for rank_out in outs:
        for r in rank_out:
            remapped = remapped or r["remapped"]
            row = 0
            for q, s, e in r["segments"]:
                L = STEPS[r["step"]][q]
                n = max(min(e, L) - s, 0)
                d = got.setdefault((r["step"], q), {})
                for key in ("o", "dq", "dk", "dv"):
                    d.setdefault(key, []).append((s, r[key][row:row + n]))
                row += e - s
    for k, lens in enumerate(STEPS):
        for q, L in enumerate(lens):
            ref = _reference(k, q, L)
            for key in ("o", "dq", "dk", "dv"):
                parts = sorted(got[(k, q)][key], key=lambda x: x[0])
                assert parts[0][0] == 0
                mine = torch.cat([t for _, t in parts])
                assert mine.shape[0] == L, (k, q, key)           # every real token exactly once
                # a one-token sequence's dq and dk are exactly 0 in the reference and float32 rounding
                # noise in a distributed run: those are judged against the inputs' unit scale
                zero = not bool(ref[key].abs().max() > 0)
                assert_matches_reference(mine, ref[key], TOL, f"{plan} step {k} sequence {q} {key}",
                                         scale=1.0 if zero else None)
    if plan == "zeppelin":
        assert remapped  # the second step's linear layout differs from its attention layout
    if "ring" in KINDS[plan]:  # ring transfers are counted
        assert sum(r["bytes"]["intra"] for o in outs for r in o) > 0


def _fields_on_rank(rank: int, world: int, path: str):
    vocab = 256

    def tokens(sample_id: int):
        return [(sample_id * 7 + i) % vocab for i in range(1000)]

    steps = z.open_plan(path, rank=rank, world_size=world, data=tokens)
    res = []
    for sc in steps:
        mbs = []
        for mb in sc:
            ctx = mb.context
            x = mb.position_ids.double()[:, None]
            back = z.to_linear_layout(z.to_attention_layout(x, ctx), ctx)
            mbs.append({"ids": mb.input_ids, "pos": mb.position_ids, "labels": mb.labels, "segments": mb.segments,
                        "norm": mb.loss_normaliser, "round_trip": bool(torch.equal(back, x)),
                        "attn_pos_ok": bool(torch.equal(z.to_attention_layout(x, ctx)[:, 0].long(),
                                                        ctx.attention_positions)),
                        "rows": (ctx.attention_rows, ctx.linear_rows)})
        res.append({"step": sc.step, "mbs": mbs, "norm": sc.loss_normaliser, "time": sc.predicted_step_time_s,
                    "mem": sc.predicted_memory_bytes, "tokens": sc.tokens, "n": sc.num_sequences, "len": len(steps)})
    return res


@pytest.mark.slow
def test_open_plan_microbatch_fields_and_layout_round_trip(pool, plans):
    outs = pool.run(_fields_on_rank, plans["zeppelin"], timeout=120)
    for k, lens in enumerate(STEPS):
        seen = {q: [] for q in range(len(lens))}
        sample = [1000 + q for q in range(len(lens))]  # planner_step's sample ids
        for rank_out in outs:
            st = rank_out[k]
            assert st["len"] == len(STEPS) and st["n"] == len(lens) and st["tokens"] == sum(lens)
            assert st["norm"] == sum(L - 1 for L in lens)
            assert st["time"] is not None and st["time"] > 0 and st["mem"] is not None and st["mem"] > 0
            for mb in st["mbs"]:
                assert mb["norm"] == st["norm"]
                assert mb["round_trip"] and mb["attn_pos_ok"]
                row = 0
                for q, s, e in mb["segments"]:
                    L, sid = lens[q], sample[q]
                    pos = mb["pos"][row:row + e - s]
                    assert pos.tolist() == list(range(s, e))                 # restart at each sequence
                    ids = mb["ids"][row:row + e - s].tolist()
                    lab = mb["labels"][row:row + e - s].tolist()
                    for i, p in enumerate(range(s, e)):
                        if p < L:
                            assert ids[i] == (sid * 7 + p) % 256
                            assert lab[i] == ((sid * 7 + p + 1) % 256 if p + 1 < L else z.IGNORE_INDEX)
                        else:  # padding
                            assert ids[i] == 0 and lab[i] == z.IGNORE_INDEX
                    seen[q].extend(range(s, min(e, L)))
                    row += e - s
                assert row == mb["rows"][1]
        for q, L in enumerate(lens):
            assert sorted(seen[q]) == list(range(L))  # every token on exactly one rank


def test_old_and_new_plan_formats_name_the_reader(plans, tmp_path):
    lines = open(plans["ulysses"]).read().splitlines()
    for fmt, expect in [
        ("zeppelin.plan/0", "plan format 'zeppelin.plan/0' is older than zeppelin 0.1.0 reads ('zeppelin.plan/1'); "
                            "unreleased development versions before zeppelin 0.1.0 read it: re-plan with "
                            "`zeppelin plan` to get a current plan"),
        ("zeppelin.plan/2", "plan format 'zeppelin.plan/2' is newer than zeppelin 0.1.0 reads ('zeppelin.plan/1'); "
                            "it was written by a later zeppelin: upgrade zeppelin to read it"),
    ]:
        head = json.loads(lines[0])
        head["schema_version"] = fmt
        p = tmp_path / f"{fmt.replace('/', '_')}.jsonl"
        p.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
        with pytest.raises(z.InputError) as e:
            z.open_plan(p, rank=0, world_size=2)
        assert expect in str(e.value)
    assert z.PLAN_FORMAT == "zeppelin.plan/1"


def test_open_plan_refuses_wrong_world_size(plans):
    with pytest.raises(z.InputError, match="the plan is for 2 ranks but world_size is 4"):
        z.open_plan(plans["ulysses"], rank=0, world_size=4)


def test_attention_refuses_wrong_rows_in_one_process(tmp_path):
    # a one-rank plan needs no process group: the API runs in a plain process
    header = make_header(cluster_preset("local-cpu:1x1"), model_preset("tiny"), 1, planner="packed-dp")
    path = tmp_path / "one.jsonl"
    write_plan(path, header, [planner_step("packed-dp", header, [7, 5, 3])])
    (sc,) = list(z.open_plan(path, rank=0, world_size=1))
    (mb,) = sc.microbatches
    assert mb.context.attention_rows == 15 and not mb.context.remapped
    q = torch.randn(15, HQ, D, dtype=torch.float64)
    kv = torch.randn(15, HKV, D, dtype=torch.float64)
    o = z.attention(q, kv, kv, mb.context)
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[a:b].transpose(0, 1)[None], kv[a:b].transpose(0, 1)[None], kv[a:b].transpose(0, 1)[None],
        is_causal=True, enable_gqa=True)[0].transpose(0, 1) for a, b in [(0, 7), (7, 12), (12, 15)]])
    # softmax statistics are float32 whatever the dtype
    assert_matches_reference(o, ref, TOL, "one-process attention")
    with pytest.raises(ValueError, match=r"rank 0 holds 15 attention-layout rows, got 14"):
        z.attention(q[:14], kv[:14], kv[:14], mb.context, layer=3)


def test_import_is_cheap_and_help_shows_the_contract():
    code = ("import sys, zeppelin.runtime as z; assert 'torch' not in sys.modules, 'torch imported'; "
            "help(z.attention); print(z.API_VERSION)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PAGER": "cat", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert "attention(q: 'torch.Tensor', k: 'torch.Tensor', v: 'torch.Tensor', ctx: 'AttentionContext'" in r.stdout
    assert "One autograd function" in r.stdout and "Collective" in r.stdout
    assert r.stdout.strip().endswith(z.API_VERSION)


def test_zeppelin_run_reaches_attention_remap_and_data_only_through_the_api():
    """``zeppelin run``'s executor imports no attention, remap or token-building module itself:
    its data, attention and remap path is the public API's (build_step, attention, layouts)."""
    import ast
    from pathlib import Path

    src = Path(z.__file__).with_name("executor.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            imported.add(node.module)
            if node.module == "api":
                api_names = {a.name for a in node.names}
    assert imported.isdisjoint({"engine", "remap", "kernels"}), imported
    assert not [m for m in imported if m and (m == "attn" or m.startswith("attn."))], imported
    assert {"build_step", "attention", "to_attention_layout", "to_linear_layout"} <= api_names
    assert ".segments(" not in src  # micro-batch tensors come from build_step
