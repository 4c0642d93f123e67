"""The wheel holds every module of the three packages: a subpackage left out of the build installs
a zeppelin that fails on its first import (setup.py finds the subpackages, pyproject.toml lists none)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"schemas": "zeppelin/schemas", "planner": "zeppelin/planner", "runtime": "zeppelin/runtime"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_wheel_holds_every_module_and_the_sample_data(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in PACKAGES:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                        "-w", str(tmp_path / "wheel")], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"{PACKAGES[folder]}/{f.relative_to(ROOT / folder).as_posix()}"
            for folder in PACKAGES for f in (ROOT / folder).rglob("*.py") if "__pycache__" not in f.parts}
    assert len(want) > 100 and want - names == set()
    assert "zeppelin/schemas/data/sample_manifest.jsonl" in names
