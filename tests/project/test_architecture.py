"""The package's import directions (docs/ARCHITECTURE.md): a module may import only the layers below it.

    schemas  <-  costmodel  <-  core  <-  sim  <-  zeppelin, baselines  <-  tools  <-  cli
    schemas  <-  runtime   (the runtime reads plans; it never imports the planner, except the cost
                            model's profile fitting inside ``zeppelin profile``)

Imports are read with ``ast`` (statements anywhere in a module, function bodies included). The
planner registry loads planner modules by name (``core/registry.py``), which is not an import
statement and so not a dependency of ``core``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"schemas": "zeppelin.schemas", "planner": "zeppelin.planner", "runtime": "zeppelin.runtime"}

# layer -> the layers it may import (besides itself and schemas)
ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "planner.costmodel": set(),
    "planner.core": {"planner.costmodel"},
    "planner.sim": {"planner.costmodel", "planner.core"},
    "planner.zeppelin": {"planner.costmodel", "planner.core", "planner.sim"},
    "planner.baselines": {"planner.costmodel", "planner.core", "planner.sim"},
    "planner.tools": {"planner.costmodel", "planner.core", "planner.sim", "planner.zeppelin", "planner.baselines"},
    "planner.cli": {"planner.costmodel", "planner.core", "planner.sim", "planner.zeppelin", "planner.baselines",
                    "planner.tools", "runtime"},
    "runtime": {"planner.costmodel.profile_fit"},
}


def layer_of(module: str) -> str | None:
    """``zeppelin.planner.core.base`` -> ``planner.core``; ``zeppelin.runtime.x`` -> ``runtime``."""
    parts = module.split(".")
    if parts[0] != "zeppelin" or len(parts) < 2:
        return None
    if parts[1] == "planner":
        return "planner." + parts[2] if len(parts) > 2 and parts[2] != "__init__" else "planner"
    return parts[1] if parts[1] in ("schemas", "runtime") else None


def imports_of(source: str, module: str, is_package: bool = False) -> list[str]:
    """Absolute names of every module imported by ``source`` (the text of ``module``)."""
    out = []
    pkg = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            out.append(stem)
            out += [f"{stem}.{a.name}" for a in node.names]  # `from pkg import module`
    return out


def violations(module: str, imported: list[str]) -> list[str]:
    here = layer_of(module)
    if here is None or here == "planner":
        return []
    allowed = ALLOWED[here] | {here, "schemas"}
    bad = []
    for name in imported:
        there = layer_of(name)
        if there is None or there == "planner":
            continue
        rel = name.removeprefix("zeppelin.")
        if there in allowed or any(rel == a or rel.startswith(a + ".") for a in allowed):
            continue
        bad.append(f"{module} imports {name} ({here} may not import {there})")
    return sorted(set(bad))


def package_modules():
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([pkg, *parts]), path, path.name == "__init__.py"


def test_every_module_imports_only_downwards():
    bad = []
    for module, path, is_pkg in package_modules():
        bad += violations(module, imports_of(path.read_text(), module, is_pkg))
    assert not bad, "\n".join(bad)


def test_every_planner_module_belongs_to_a_layer():
    loose = [m for m, _, _ in package_modules() if layer_of(m) == "planner" and m != "zeppelin.planner"]
    assert not loose, f"planner modules outside a subpackage: {loose}"


@pytest.mark.parametrize(
    "module, source, culprit",
    [
        ("zeppelin.planner.baselines.flexsp", "from zeppelin.planner.zeppelin.tiering import Tiering",
         "planner.baselines may not import planner.zeppelin"),
        ("zeppelin.planner.baselines.flexsp", "from zeppelin.planner import zeppelin",
         "planner.baselines may not import planner.zeppelin"),
        ("zeppelin.planner.sim.simulate", "def f():\n    from ..baselines import common",
         "planner.sim may not import planner.baselines"),
        ("zeppelin.planner.core.driver", "import zeppelin.planner.cli", "planner.core may not import planner.cli"),
        ("zeppelin.planner.costmodel.cost", "from ..core.base import Planner",
         "planner.costmodel may not import planner.core"),
        ("zeppelin.runtime.engine", "from zeppelin.planner.zeppelin import routing",
         "runtime may not import planner.zeppelin"),
        ("zeppelin.schemas.plan", "from zeppelin.runtime import data", "schemas may not import runtime"),
    ],
)
def test_an_upward_import_is_caught(module, source, culprit):
    found = violations(module, imports_of(source, module))
    assert found and all(culprit in v for v in found), found


def test_downward_imports_pass():
    src = "from zeppelin.planner.core.base import Planner\nfrom ..costmodel import predict\nfrom . import common"
    assert violations("zeppelin.planner.baselines.flexsp", imports_of(src, "zeppelin.planner.baselines.flexsp")) == []


def test_readme_and_architecture_page_match_the_tree():
    readme = (ROOT / "README.md").read_text()
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    subpackages = sorted(p.name for p in (ROOT / "planner").iterdir() if (p / "__init__.py").exists())
    for name in subpackages:
        assert f"\n  {name}/" in readme, f"README layout misses planner/{name}/"
        assert f"`planner/{name}/`" in page, f"docs/ARCHITECTURE.md misses planner/{name}/"
        for mod in sorted((ROOT / "planner" / name).glob("*.py")):
            if mod.stem != "__init__":
                assert f"`{mod.stem}" in page, f"docs/ARCHITECTURE.md does not name planner/{name}/{mod.name}"
    for folder in ("schemas", "planner", "runtime", "examples", "tests", "plans", "benchmarks", "docs"):
        assert f"\n{folder}/" in readme, f"README layout misses {folder}/"


#: the longest function or method (lines, decorators excluded) allowed in the package
MAX_FUNCTION_LINES = 80
#: the packages held to it, and the functions allowed longer ("path:name" -> the reason); empty
SHORT_FUNCTION_FOLDERS = ("planner", "runtime", "schemas")
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}
#: the step engine's module keeps the engine only (the trainer is runtime/train/)
MAX_EXECUTOR_LINES = 400


def long_functions(root: Path) -> list[str]:
    """Every function or method (nested ones included) of the package longer than the limit."""
    long = []
    for folder in SHORT_FUNCTION_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in LONG_FUNCTIONS_ALLOWED:
                        long.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return long


def test_package_functions_are_short():
    """Every function and method of planner/, runtime/ and schemas/ fits on a screen, so each does
    one job (docs/ARCHITECTURE.md); LONG_FUNCTIONS_ALLOWED names any exception and why."""
    long = long_functions(ROOT)
    assert not long, "\n".join(long)


def test_a_long_function_is_caught(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "m.py").write_text(f"def short():\n    return 1\n\n\ndef f():\n{body}\n")
    assert long_functions(tmp_path) == [f"runtime/m.py:5 f ({MAX_FUNCTION_LINES + 1} lines)"]


def test_the_executor_keeps_the_step_engine_only():
    lines = len((ROOT / "runtime" / "executor.py").read_text().splitlines())
    assert lines <= MAX_EXECUTOR_LINES, f"runtime/executor.py has {lines} lines (at most {MAX_EXECUTOR_LINES})"
