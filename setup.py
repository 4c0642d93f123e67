"""The package list, found rather than written out: zeppelin.schemas, zeppelin.planner and
zeppelin.runtime live in schemas/, planner/ and runtime/, and every subpackage below them (a folder
with an ``__init__.py``) is part of the distribution. Everything else is declared in pyproject.toml."""

from setuptools import find_packages, setup

ROOTS = {"zeppelin.schemas": "schemas", "zeppelin.planner": "planner", "zeppelin.runtime": "runtime"}

setup(
    package_dir=ROOTS,
    packages=[name + (f".{sub}" if sub else "") for name, folder in ROOTS.items()
              for sub in ("", *find_packages(folder))],
)
