"""The profiler's short-circuited TP collectives (the TP layer's compute alone): every overlap
mode's all-gather+GEMM and GEMM+reduce-scatter keep their shapes and post no communication."""

import pytest
import torch

from zeppelin.runtime import tp as tpmod
from zeppelin.runtime.profiler import _NoComm
from zeppelin.runtime.tp import TPGroup, ag_gemm, gemm_rs


@pytest.mark.parametrize("mode", ["none", "slicing", "commfuse"])
@pytest.mark.parametrize("pos", [0, 1])
def test_short_circuited_collectives_keep_shapes(mode, pos):
    g = TPGroup(ranks=[0, 1], rank=pos, pg=object())   # never used: nothing is communicated
    rows = [5, 3]
    x = torch.randn(rows[pos], 8)
    w = torch.randn(6, 8)
    saved = (tpmod._all_gather_rows, tpmod._reduce_scatter_rows, tpmod._p2p)
    with _NoComm():
        y, xf = ag_gemm(x, w, g, rows, mode)
        assert y.shape == (8, 6) and xf.shape == (8, 8)
        z = gemm_rs(torch.randn(8, 6), w.t(), g, rows, mode)
        assert z.shape == (rows[pos], 8)
    assert (tpmod._all_gather_rows, tpmod._reduce_scatter_rows, tpmod._p2p) == saved
