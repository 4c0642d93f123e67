"""The test suite's own helpers: the process pool reports failures and recovers, the reference
comparison behaves as documented, and each shared helper (the ``pool`` fixture, ``rel_err``,
``assert_matches_reference``, ``max_abs_errs``) is defined in exactly one place, so "within 1e-5"
means the same in every test file."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from tests.support.dist_pool import DistributedError, DistributedPool, DistributedTimeout, run_distributed
from tests.support.numerics import TINY, assert_matches_reference, max_abs_errs, rel_err

TESTS = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------- the process pool
def _raise_on_rank(rank, world):
    if rank == 2:
        raise ValueError("boom on two")
    return rank


@pytest.mark.timeout(120)
def test_run_distributed_results_and_errors():
    assert run_distributed(_raise_on_rank, 2) == [0, 1]
    with pytest.raises(DistributedError, match=r"failed on rank \[2\]"):
        run_distributed(_raise_on_rank, 3, timeout=30)


def _die_on_rank_one(rank, world):
    import os

    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.barrier()  # rank 0 would wait forever for the dead rank


def _sleep_forever(rank, world):
    import time

    time.sleep(600)


@pytest.mark.timeout(120)
def test_pool_reports_dead_rank_and_timeout_then_recovers():
    with DistributedPool(2) as pool:
        # the dead rank is reported as such, not as the 60 s timeout running out
        with pytest.raises(DistributedError, match=r"rank 1 died \(exit code 3\)") as died:
            pool.run(_die_on_rank_one, timeout=60)
        assert not isinstance(died.value, DistributedTimeout)
        with pytest.raises(
            DistributedTimeout, match=r"_sleep_forever did not finish within 2 s on ranks \[0, 1\]"
        ):
            pool.run(_sleep_forever, timeout=2)
        assert pool.run(_raise_on_rank) == [0, 1]  # the pool restarted itself


# ------------------------------------------------------------------------------- rel_err, as documented
def test_rel_err_is_max_abs_difference_over_the_references_largest_magnitude():
    ref = torch.tensor([[1.0, -4.0], [2.0, 0.5]], dtype=torch.float64)
    got = ref + torch.tensor([[0.0, 0.02], [-0.04, 0.01]], dtype=torch.float64)
    assert rel_err(got, ref) == pytest.approx(0.04 / 4.0, rel=1e-12)
    # symmetric in sign, in float64 whatever the inputs' dtype
    assert rel_err(got.to(torch.bfloat16).double(), ref) == rel_err(got.to(torch.bfloat16), ref)
    assert rel_err(ref, ref) == 0.0
    # one bad element is not averaged away (a norm-wise measure would give about 0.002 here)
    big = torch.ones(10_000, dtype=torch.float64)
    bad = big.clone()
    bad[17] += 0.2
    assert rel_err(bad, big) == pytest.approx(0.2, rel=1e-12)
    assert float((bad - big).norm() / big.norm()) == pytest.approx(0.002, rel=1e-12)


def test_rel_err_scale_zero_reference_empty_nan_and_shapes():
    ref = torch.tensor([0.5, -0.25], dtype=torch.float64)
    got = torch.tensor([0.5, -0.2], dtype=torch.float64)
    assert rel_err(got, ref, scale=10.0) == pytest.approx(0.05 / 10.0, rel=1e-12)
    zero = torch.zeros(3)
    assert rel_err(zero, zero) == 0.0
    assert rel_err(torch.full((3,), 1e-8), zero) == pytest.approx(1e-8 / TINY)  # zero reference: no slack
    assert rel_err(torch.full((3,), 1e-8), zero, scale=2.0) == pytest.approx(5e-9)
    assert rel_err(torch.empty(0, 4), torch.empty(0, 4)) == 0.0
    assert math.isnan(rel_err(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0])))
    assert rel_err(1.0 + 1e-6, 1.0) == pytest.approx(1e-6, rel=1e-9)  # plain numbers (losses)
    with pytest.raises(ValueError, match=r"shapes differ: \(2,\) vs reference \(3,\)"):
        rel_err(torch.zeros(2), torch.zeros(3))


def test_assert_matches_reference_passes_returns_and_names_the_failure():
    ref = torch.arange(6, dtype=torch.float64).reshape(2, 3) - 2.0  # largest magnitude 3
    assert assert_matches_reference(ref + 3e-6, ref, 1e-6) == pytest.approx(1e-6, rel=1e-9)
    got = ref.clone()
    got[1, 2] += 6e-5
    with pytest.raises(AssertionError) as e:
        assert_matches_reference(got, ref, 1e-5, "dq of sequence 2")
    msg = str(e.value)
    assert msg.startswith("dq of sequence 2: relative error 2e-05 > 1e-05 (max|got - ref| / 3); worst at (1, 2)")
    with pytest.raises(AssertionError, match=r"^x: shape \(2,\) != reference \(3,\)$"):
        assert_matches_reference(torch.zeros(2), torch.zeros(3), 1.0, "x")
    with pytest.raises(AssertionError, match="relative error nan"):
        assert_matches_reference(torch.tensor([float("nan")]), torch.tensor([1.0]), 1.0)
    # a slice whose reference is exactly zero passes against a scale the caller names
    assert_matches_reference(torch.full((2,), 1e-9), torch.zeros(2), 1e-5, scale=1.0)
    with pytest.raises(AssertionError):
        assert_matches_reference(torch.full((2,), 1e-9), torch.zeros(2), 1e-5)


def test_max_abs_errs_one_absolute_error_per_pair():
    a = (torch.tensor([1.0, 2.0]), torch.tensor([[0.0]]))
    b = (torch.tensor([1.0, 2.5]), torch.tensor([[-0.25]]))
    assert max_abs_errs(a, b) == [0.5, 0.25]
    with pytest.raises(ValueError, match="2 tensors vs 1 references"):
        max_abs_errs(a, b[:1])


# ------------------------------------------------------------------------------- one definition each
# helper name -> the one file (relative to tests/) that may define it; the names that used to be
# defined per file (and the spellings a new file might reach for) are allowed nowhere
HOME = {
    "pool": "conftest.py",
    "rel_err": "support/numerics.py",
    "assert_matches_reference": "support/numerics.py",
    "max_abs_errs": "support/numerics.py",
    "DistributedPool": "support/dist_pool.py",
}
NOWHERE = {"_rel", "_rel_err", "rel", "_close", "_err", "_max_errs", "pool2", "pool4", "pool8"}


def _definitions() -> dict[str, list[str]]:
    """name -> ``file:line`` of every function or class defined under tests/ with a helper's name, and
    of every pytest fixture (whatever its name) that starts a DistributedPool."""
    found: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            where = f"{rel}:{node.lineno}"
            if node.name in HOME or node.name in NOWHERE:
                found.setdefault(node.name, []).append(where)
            is_fixture = any("fixture" in ast.unparse(d) for d in getattr(node, "decorator_list", []))
            starts_pool = any(isinstance(n, ast.Call) and ast.unparse(n.func).endswith("DistributedPool")
                              for n in ast.walk(node))
            if is_fixture and starts_pool and node.name != "pool":
                found.setdefault(f"fixture {node.name} starting a DistributedPool", []).append(where)
    return found


def test_each_test_helper_is_defined_once_in_its_home():
    found = _definitions()
    problems = []
    for name, places in sorted(found.items()):
        home = HOME.get(name)
        if home is None:
            problems.append(f"{name} defined at {', '.join(places)}: use the shared helper instead")
        elif len(places) != 1 or not places[0].startswith(home + ":"):
            problems.append(f"{name} defined at {', '.join(places)}: only {home} may define it")
    assert problems == []
    assert set(found) == set(HOME)  # and every shared helper is where this test looks for it


def test_the_definition_scan_sees_a_second_definition(tmp_path, monkeypatch):
    # the scan above, pointed at a copy of tests/ with one more file that defines its own helpers
    import shutil

    copy = tmp_path / "tests"
    shutil.copytree(TESTS, copy, ignore=shutil.ignore_patterns("__pycache__", "data"))
    (copy / "runtime" / "test_new.py").write_text(
        "import pytest\n\n\n@pytest.fixture(scope='module')\ndef pool():\n    pass\n\n\n"
        "def _rel(a, b):\n    return 0.0\n\n\n@pytest.fixture\ndef ranks():\n    with DistributedPool(2) as p:\n"
        "        yield p\n"
    )
    monkeypatch.setattr(f"{__name__}.TESTS", copy)
    found = _definitions()
    assert found["pool"] == ["conftest.py:" + found["pool"][0].split(":")[1], "runtime/test_new.py:5"]
    assert found["_rel"] == ["runtime/test_new.py:9"]
    assert found["fixture ranks starting a DistributedPool"] == ["runtime/test_new.py:14"]
