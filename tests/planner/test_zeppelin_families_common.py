"""The families' shared whole-step dispatch (families/common.py): local search, the unrolled
two-type loop, the bound and the pruned search."""

from __future__ import annotations

import numpy as np
import pytest


def test_family_dispatch_local_search_never_worse():
    from zeppelin.planner.zeppelin.families.common import dispatch as _dispatch

    rng = np.random.default_rng(5)
    for trial in range(20):
        n = int(rng.integers(5, 60))
        cost = {0: rng.lognormal(0, 1.2, n), 1: None}
        cost[1] = cost[0] * rng.uniform(0.3, 0.7)
        fits = {0: np.ones(n, dtype=bool), 1: rng.random(n) < 0.9}
        counts = {0: int(rng.integers(1, 6)), 1: int(rng.integers(0, 3))}
        lpt = _dispatch(cost, fits, counts)
        best = _dispatch(cost, fits, counts, improve=True)
        assert best[0] <= lpt[0] * (1 + 1e-12)
        # the makespan is that of the returned assignment, which respects fits
        loads = {}
        for i, (t, g) in enumerate(best[1]):
            assert fits[t][i] and counts[t] > g
            loads[(t, g)] = loads.get((t, g), 0.0) + cost[t][i]
        assert max(loads.values()) == pytest.approx(best[0])
        assert _dispatch(cost, fits, counts, improve=True)[:2] == best[:2]


def test_family_dispatch_two_types_match_the_general_loop():
    """The unrolled two-type dispatch gives what the general loop gives: a third type that fits no
    sequence sends every configuration down the general loop without changing any choice."""
    from zeppelin.planner.zeppelin.families.common import dispatch as _dispatch

    rng = np.random.default_rng(17)
    for trial in range(30):
        n = int(rng.integers(3, 200))
        cost = {1: rng.lognormal(0, 1.0, n), 4: rng.lognormal(-1, 1.0, n), 9: rng.lognormal(0, 1.0, n)}
        if trial % 3 == 0:
            cost[4] = cost[1].copy()  # ties: the lower type, then the lower group
        fits = {1: rng.random(n) < 0.8, 4: np.ones(n, dtype=bool), 9: np.zeros(n, dtype=bool)}
        fixed = {1: 0.5, 4: 0.0} if trial % 2 else None
        counts = {1: int(rng.integers(1, 9)), 4: int(rng.integers(1, 4))}
        two = _dispatch({t: cost[t] for t in counts}, {t: fits[t] for t in counts}, counts, fixed)
        three = _dispatch(cost, fits, {**counts, 9: 2}, fixed)
        assert two[0] == three[0] and two[1] == three[1]
        for t in counts:
            np.testing.assert_array_equal(two[2][t], three[2][t])
        assert not three[2][9].any()


def test_family_dispatch_bound_and_pruned_search_match_trying_every_configuration():
    """_dispatch_bound never exceeds the dispatch's makespan, and the pruned search keeps exactly
    the configurations (and order) that dispatching every one of them would keep."""
    from zeppelin.planner.zeppelin.families.common import best_dispatches as _best_dispatches
    from zeppelin.planner.zeppelin.families.common import dispatch as _dispatch
    from zeppelin.planner.zeppelin.families.common import dispatch_bound as _dispatch_bound

    rng = np.random.default_rng(11)
    for trial in range(20):
        n = int(rng.integers(5, 80))
        sizes = [1, 2, 4, 8]
        cost = {s: rng.lognormal(0, 1.0, n) / s ** rng.uniform(0.6, 1.0) for s in sizes}
        fits = {s: rng.random(n) < (0.7 if s == 1 else 1.0) for s in sizes}
        configs = [{s: int(rng.integers(1, 6))} for s in sizes] + [
            {8: int(rng.integers(1, 3)), s: int(rng.integers(1, 5))} for s in (1, 2, 4)]

        def run(cfg):
            return _dispatch({t: cost[t] for t in cfg}, {t: fits[t] for t in cfg}, cfg)

        def bound(cfg):
            return _dispatch_bound(cost, fits, cfg, {t: t for t in cfg})

        every = []
        for a, cfg in enumerate(configs):
            r = run(cfg)
            if r is not None:
                assert bound(cfg) <= r[0] * (1 + 1e-12)
                every.append((r[0], a))
            else:
                assert bound(cfg) == float("inf")
        every.sort()
        for keep in (1, 3):
            got = _best_dispatches(configs, run, bound, keep)
            assert [(x[0], x[1]) for x in got] == every[:keep]


_REPARTITION_CASE = """
import numpy as np
from zeppelin.planner.zeppelin.families.common import repartition
c = np.array([0.291, 1.28, 2.185, 3.275, 1.642, 2.913, 2.298])
hot, cold = (0, 0), (0, 1)
members, loads = {hot: list(range(len(c))), cold: []}, {0: [float(c.sum()), 0.0]}
repartition({0: c}, {0: np.ones(len(c), dtype=bool)}, [hot] * len(c), members, loads, hot, float(c.sum()),
            [hot, cold], np.array(loads[0]), 1)
print(members[hot])
"""


def test_repartition_splits_alike_whatever_blas_kernel_runs():
    """Seven sequences of one group type split between two groups: several splits come within a
    rounding of the best, and the one chosen must not depend on the CPU. Summed by matrix products,
    OpenBLAS added in its CPU kernel's order and chose [0, 2, 4, 5] under its generic x86 kernel,
    [0, 1, 2, 3] under its AVX2 one; row sums choose the same on both."""
    import os
    import subprocess
    import sys

    picks = set()
    for core in ("Prescott", "Haswell"):  # (OpenBLAS' DYNAMIC_ARCH kernels; others ignore the variable)
        env = {**os.environ, "OPENBLAS_CORETYPE": core}
        out = subprocess.run([sys.executable, "-c", _REPARTITION_CASE], env=env, capture_output=True,
                             text=True, check=True)
        picks.add(out.stdout.strip())
    assert picks == {"[0, 1, 2, 3]"}
