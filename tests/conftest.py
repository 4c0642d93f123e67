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
