"""The wheelhouse of a GPU machine without network (``./dev wheelhouse``): download the wheels that
benchmarks/wheelhouse.txt lists, for CPython 3.12 on manylinux x86_64, into one folder, and check it.

    python benchmarks/wheelhouse.py [--dest wheelhouse] [--python .venv/bin/python] [--check-only]

Versions: the ones installed in ``--python``'s environment (the project's .venv: what the tests ran
with) where it has the package, else the newest. Checks after the download: one wheel per listed
package, every wheel's requirements (markers evaluated for Linux, CPython 3.12) either in the folder
or among the list's ``provided`` / ``not carried`` packages, and the folder's size under the limit.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIST = HERE / "wheelhouse.txt"
LIMIT_BYTES = 56 * 2**20  # of the 64 MiB a GPU run carries, 8 MiB left for the working tree
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
#: the GPU machine: environment markers of its interpreter
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def norm(name: str) -> str:
    """A distribution name in its normal form (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path = LIST) -> dict[str, list[str]]:
    """``{"wheels": [...], "provided": [...], "not_carried": [...]}`` (normalised names) of a list file."""
    out: dict[str, list[str]] = {"wheels": [], "provided": [], "not_carried": []}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("# provided:"):
            out["provided"] += [norm(x) for x in line.split(":", 1)[1].split()]
        elif line.startswith("# not carried:"):
            out["not_carried"].append(norm(line.split(":", 1)[1].split("--")[0].strip()))
        elif line and not line.startswith("#"):
            out["wheels"].append(norm(line))
    return out


def requirement_names(reqs: list[str]) -> list[str]:
    """Names of the requirements (``Requires-Dist`` strings) that apply on the GPU machine."""
    from packaging.requirements import Requirement

    names = []
    for r in reqs:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate(TARGET):
            names.append(norm(req.name))
    return names


def wheel_metadata(path: Path) -> tuple[str, list[str]]:
    """``(normalised name, Requires-Dist lines)`` of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    name = re.search(r"^Name: (.+)$", text, re.MULTILINE).group(1).strip()
    return norm(name), [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Requires-Dist:")]


def check(dest: Path, lst: dict[str, list[str]]) -> list[str]:
    """Problems of the folder ``dest`` against the list (empty: usable)."""
    wheels = sorted(dest.glob("*.whl"))
    have: dict[str, list[str]] = {}
    problems = []
    for w in wheels:
        name, reqs = wheel_metadata(w)
        if name in have:
            problems.append(f"two wheels of {name} (pip would refuse the install)")
        have[name] = reqs
    known = set(have) | set(lst["provided"]) | set(lst["not_carried"])
    problems += [f"no wheel of {n}" for n in lst["wheels"] if n not in have]
    for name, reqs in sorted(have.items()):
        problems += [f"{name} needs {r}, which is neither in the folder nor provided" for r in requirement_names(reqs)
                     if r not in known]
    size = sum(w.stat().st_size for w in wheels)
    if size > LIMIT_BYTES:
        problems.append(f"{size / 2**20:.1f} MiB of wheels, over the {LIMIT_BYTES / 2**20:.0f} MiB limit")
    return problems


def pins(names: list[str], python: str | None) -> list[str]:
    """``name==version`` where ``python``'s environment has the package, else ``name``."""
    if not python or not Path(python).exists():
        return names
    code = ("import importlib.metadata as m, sys\n"
            "for n in sys.argv[1:]:\n"
            "    try: print(n + '==' + m.version(n))\n"
            "    except m.PackageNotFoundError: print(n)\n")
    r = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, check=True)
    return r.stdout.split()


def download(dest: Path, python: str | None) -> None:
    lst = read_list()
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # one version of each: a fresh folder every time
        old.unlink()
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *plat, "-d", str(dest), *pins(lst["wheels"], python)]
    print("[wheelhouse] " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", default=str(HERE.parent / "wheelhouse"))
    ap.add_argument("--python", default=str(HERE.parent / ".venv" / "bin" / "python"),
                    help="the environment whose versions are downloaded (default: the project's .venv)")
    ap.add_argument("--check-only", action="store_true", help="check an existing folder, download nothing")
    a = ap.parse_args(argv)
    dest = Path(a.dest)
    if not a.check_only:
        download(dest, a.python)
    problems = check(dest, read_list())
    wheels = sorted(dest.glob("*.whl"))
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    print(f"{sum(w.stat().st_size for w in wheels) / 2**20:8.2f} MiB  in {len(wheels)} wheels ({dest})")
    for p in problems:
        print(f"zeppelin: error: wheelhouse: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
