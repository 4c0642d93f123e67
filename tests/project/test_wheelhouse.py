"""The wheelhouse a GPU machine without network installs from (`./dev wheelhouse`,
benchmarks/wheelhouse.txt): it covers every runtime dependency the project declares, except what the
GPU image provides, and everything those need; benchmarks/wheelhouse.py's check catches a folder
pip would refuse."""

import importlib.metadata as md
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import wheelhouse

PROVIDED = {"torch", "transformers", "safetensors", "tokenizers", "numpy", "triton"}


def _runtime_dependencies() -> set[str]:
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {wheelhouse.norm(Requirement(d).name) for d in deps}


def test_list_covers_every_runtime_dependency_but_the_gpu_images():
    lst = wheelhouse.read_list()
    assert set(lst["provided"]) == PROVIDED
    missing = _runtime_dependencies() - PROVIDED - set(lst["wheels"]) - set(lst["not_carried"])
    assert missing == set()
    assert set(lst["not_carried"]) == {"pyarrow"}


def test_not_carried_packages_are_not_imported_by_zeppelin():
    # pyarrow (55 MB) stays out of the wheelhouse because importing zeppelin does not need it
    code = "import json, sys, zeppelin.planner, zeppelin.runtime, zeppelin.planner.cli; print(json.dumps(list(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    mods = set(json.loads(r.stdout))
    for name in wheelhouse.read_list()["not_carried"]:
        assert name not in mods


def test_list_is_closed_under_the_installed_requirements():
    # what each listed package needs (as installed here, markers for the GPU machine) is listed or provided
    lst = wheelhouse.read_list()
    known = set(lst["wheels"]) | set(lst["provided"]) | set(lst["not_carried"])
    for name in lst["wheels"]:
        needs = wheelhouse.requirement_names(md.requires(name) or [])
        assert set(needs) <= known, (name, set(needs) - known)


def _wheel(folder: Path, name: str, version: str, requires=(), size=0) -> None:
    meta = f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        if size:
            z.writestr("pad.bin", b"\0" * size)


def test_check_finds_missing_duplicate_unmet_and_oversized(tmp_path):
    lst = {"wheels": ["alpha", "beta"], "provided": ["numpy"], "not_carried": []}
    _wheel(tmp_path, "alpha", "1.0", ["numpy", "gamma>=2", 'winonly; sys_platform == "win32"'])
    assert wheelhouse.check(tmp_path, lst) == ["no wheel of beta",
                                               "alpha needs gamma, which is neither in the folder nor provided"]
    _wheel(tmp_path, "beta", "1.0")
    _wheel(tmp_path, "beta", "2.0")
    _wheel(tmp_path, "gamma", "2.0")
    assert wheelhouse.check(tmp_path, lst) == ["two wheels of beta (pip would refuse the install)"]
    (tmp_path / "beta-2.0-py3-none-any.whl").unlink()
    assert wheelhouse.check(tmp_path, lst) == []
    _wheel(tmp_path, "delta", "1.0", size=wheelhouse.LIMIT_BYTES + 1)
    assert [p for p in wheelhouse.check(tmp_path, lst) if "MiB" in p] == [
        f"{(tmp_path / 'delta-1.0-py3-none-any.whl').stat().st_size / 2**20:.1f} MiB of wheels, over the 56 MiB limit"]


def test_gpu_check_sh_installs_from_the_wheelhouse_without_network():
    sh = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    assert "pip install -q --no-index --find-links wheelhouse --upgrade -r benchmarks/wheelhouse.txt" in sh
    # zeppelin itself editable: a wheel built from pyproject's package list lacks every subpackage
    assert "pip install -q --no-deps --no-build-isolation -e ." in sh
    assert "/wheelhouse/" in (ROOT / ".gitignore").read_text().splitlines()
