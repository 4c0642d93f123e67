"""TP-SP linears with none / slicing / commfuse overlap vs a single-process float64 reference.

Each TP degree (2, 3, 4) runs in one call on a 4-process gloo world: TP 2 as two concurrent groups
{0,1} and {2,3}, TP 3 on ranks {0,1,2} (rank 3 idle), TP 4 on all ranks. Row splits are uneven
(and include an empty shard), feature counts are not multiples of the TP degree.
"""

from __future__ import annotations

import pytest
import torch

from zeppelin.runtime.tp import OVERLAP_MODES, shard_sizes

from tests.support.numerics import assert_matches_reference

IN, OUT, FFN = 7, 10, 11
WORLD = 4  # ranks of the module's process pool (the `pool` fixture of tests/conftest.py)
ROWS = {2: [5, 3], 3: [4, 0, 5], 4: [3, 4, 2, 3]}
TOL = 1e-5


def _offsets(xs):
    o = [0]
    for x in xs:
        o.append(o[-1] + x)
    return o


def _data(tp: int):
    g = torch.Generator().manual_seed(100 + tp)
    T = sum(ROWS[tp])
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(x=r(T, IN), w_col=r(OUT, IN), dy=r(T, OUT), x2=r(T, IN), w_row=r(OUT, IN), dz=r(T, OUT),
                wg=r(FFN, IN), wu=r(FFN, IN), wd=r(IN, FFN), dm=r(T, IN))


def _tp_groups(tp: int, world: int):
    if tp == 2:
        return [[0, 1], [2, 3]]
    return [list(range(tp))]


def _tp_worker(rank, world, tp):
    from zeppelin.runtime.groups import GroupCache
    from zeppelin.runtime.tp import TPMLP, ColumnParallelLinear, RowParallelLinear, TPGroup

    groups = _tp_groups(tp, world)
    cache = GroupCache(world, extra=groups)
    mine = [g for g in groups if rank in g]
    if not mine:
        return None
    ranks = mine[0]
    grp = TPGroup(ranks, rank, cache.get(ranks))
    rows = ROWS[tp]
    ro = _offsets(rows)
    p = grp.pos
    d = {k: v.float() for k, v in _data(tp).items()}
    out = {}
    for mode in OVERLAP_MODES:
        res = {}
        # column-parallel: x sequence-sharded -> [T, OUT shard]
        col = ColumnParallelLinear.from_full(d["w_col"], grp, overlap=mode, chunks=3)
        co = _offsets(col.sizes)
        x = d["x"][ro[p]:ro[p + 1]].clone().requires_grad_(True)
        y = col(x, rows)
        (y * d["dy"][:, co[p]:co[p + 1]]).sum().backward()
        res["col_y"], res["col_dx"], res["col_dw"] = y.detach(), x.grad, col.weight.grad
        # row-parallel: [T, IN shard] -> sequence-sharded [rows[p], OUT]
        row = RowParallelLinear.from_full(d["w_row"], grp, overlap=mode, chunks=3)
        so = _offsets(row.sizes)
        x2 = d["x2"][:, so[p]:so[p + 1]].clone().requires_grad_(True)
        z = row(x2, rows)
        (z * d["dz"][ro[p]:ro[p + 1]]).sum().backward()
        res["row_z"], res["row_dx"], res["row_dw"] = z.detach(), x2.grad, row.weight.grad
        # SwiGLU MLP block
        mlp = TPMLP.from_full(d["wg"], d["wu"], d["wd"], grp, overlap=mode, chunks=2)
        xm = d["x"][ro[p]:ro[p + 1]].clone().requires_grad_(True)
        m = mlp(xm, rows)
        (m * d["dm"][ro[p]:ro[p + 1]]).sum().backward()
        res["mlp_y"], res["mlp_dx"] = m.detach(), xm.grad
        res["mlp_dgu"], res["mlp_dd"] = mlp.gate_up.weight.grad, mlp.down.weight.grad
        out[mode] = res
    return {"pos": p, "ranks": ranks, "res": out}


def _reference(tp: int):
    d = {k: v.clone().requires_grad_(True) for k, v in _data(tp).items()}
    y = d["x"] @ d["w_col"].t()
    z = d["x2"] @ d["w_row"].t()
    m = (torch.nn.functional.silu(d["x"] @ d["wg"].t()) * (d["x"] @ d["wu"].t())) @ d["wd"].t()
    (y * d["dy"]).sum().backward()
    (z * d["dz"]).sum().backward()
    x_grad_col_row = d["x"].grad.clone()
    d["x"].grad = None
    d["wg"].grad = d["wu"].grad = d["wd"].grad = None
    xm = d["x"].detach().clone().requires_grad_(True)
    m = (torch.nn.functional.silu(xm @ d["wg"].t()) * (xm @ d["wu"].t())) @ d["wd"].t()
    (m * d["dm"]).sum().backward()
    return dict(y=y.detach(), z=z.detach(), m=m.detach(), col_dx=x_grad_col_row, col_dw=d["w_col"].grad,
                row_dx=d["x2"].grad, row_dw=d["w_row"].grad, mlp_dx=xm.grad, dwg=d["wg"].grad,
                dwu=d["wu"].grad, dwd=d["wd"].grad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_tp_linears_match_reference_in_every_overlap_mode(pool, tp):
    outs = pool.run(_tp_worker, tp, timeout=90)
    ref = _reference(tp)
    rows = ROWS[tp]
    ro = _offsets(rows)
    co = _offsets(shard_sizes(OUT, tp))
    si = _offsets(shard_sizes(IN, tp))
    fo = _offsets(shard_sizes(FFN, tp))
    seen = 0
    for rank, o in enumerate(outs):
        if o is None:
            assert tp == 3 and rank == 3
            continue
        p = o["pos"]
        for mode, r in o["res"].items():
            w = f"tp={tp} rank={rank} mode={mode}"
            assert_matches_reference(r["col_y"], ref["y"][:, co[p]:co[p + 1]], TOL, f"{w} column output")
            assert_matches_reference(r["col_dx"], ref["col_dx"][ro[p]:ro[p + 1]], TOL, f"{w} column input grad")
            assert_matches_reference(r["col_dw"], ref["col_dw"][co[p]:co[p + 1]], TOL, f"{w} column weight grad")
            assert_matches_reference(r["row_z"], ref["z"][ro[p]:ro[p + 1]], TOL, f"{w} row output")
            assert_matches_reference(r["row_dx"], ref["row_dx"][:, si[p]:si[p + 1]], TOL, f"{w} row input grad")
            assert_matches_reference(r["row_dw"], ref["row_dw"][:, si[p]:si[p + 1]], TOL, f"{w} row weight grad")
            assert_matches_reference(r["mlp_y"], ref["m"][ro[p]:ro[p + 1]], TOL, f"{w} MLP output")
            assert_matches_reference(r["mlp_dx"], ref["mlp_dx"][ro[p]:ro[p + 1]], TOL, f"{w} MLP input grad")
            a, b = fo[p], fo[p + 1]
            assert_matches_reference(r["mlp_dgu"], torch.cat([ref["dwg"][a:b], ref["dwu"][a:b]]), TOL, f"{w} MLP gate/up grad")
            assert_matches_reference(r["mlp_dd"], ref["dwd"][:, a:b], TOL, f"{w} MLP down grad")
            seen += 1
    assert seen == (4 if tp != 3 else 3) * len(OVERLAP_MODES)


def test_unknown_overlap_mode_is_refused():
    from zeppelin.runtime.tp import TPGroup, column_parallel

    g = TPGroup([0], 0)
    msg = r"^unknown TP overlap mode 'ring' \(choose from none, slicing, commfuse\)$"
    with pytest.raises(ValueError, match=msg):
        column_parallel(torch.zeros(2, 3), torch.zeros(4, 3), g, [2], "ring")


def test_single_rank_group_is_plain_linear():
    from zeppelin.runtime.tp import ColumnParallelLinear, RowParallelLinear, TPGroup

    g = TPGroup([5], 5)
    w = torch.randn(4, 3, dtype=torch.float64)
    x = torch.randn(6, 3, dtype=torch.float64)
    for mode in OVERLAP_MODES:
        assert torch.equal(ColumnParallelLinear.from_full(w, g, mode)(x), x @ w.t())
        assert torch.equal(RowParallelLinear.from_full(w, g, mode)(x), x @ w.t())
