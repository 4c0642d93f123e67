"""Fixtures shared by every test folder (tests/planner, tests/runtime, tests/schemas, tests/cli,
tests/project). Helpers that are not fixtures live in tests/support/: the process pool
(``tests.support.dist_pool``) and the reference comparison (``tests.support.numerics``)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ZEPPELIN = str(Path(sys.executable).parent / "zeppelin")

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def zeppelin_bin() -> str:
    """Path of the installed `zeppelin` console script of this venv."""
    return ZEPPELIN


@pytest.fixture(scope="module")
def pool(request):
    """One persistent world of local gloo processes per test module (one torch thread per rank),
    shared by the module's tests; its size is the module's ``WORLD`` constant (so each file keeps
    its rank count: 2 for the API and examples, 4 for most runtime files, 8 for ring attention).
    Functions run on it must be module-level (the ranks import them by name)."""
    from tests.support.dist_pool import DistributedPool

    world = getattr(request.module, "WORLD", None)
    if not isinstance(world, int) or world < 1:
        pytest.fail(f"{request.module.__name__} uses the `pool` fixture but names no WORLD = <ranks>", pytrace=False)
    with DistributedPool(world, threads=1) as p:
        yield p
