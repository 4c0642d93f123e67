"""Imports every planner module so that it registers itself in ``base.PLANNERS``.

Each import is guarded so that a planner under construction does not break the others.
"""

import importlib

_MODULES = [
    "zeppelin.planner.zeppelin.planner",
    "zeppelin.planner.baselines",
]

for _m in _MODULES:
    try:
        importlib.import_module(_m)
    except ModuleNotFoundError as e:  # module not written yet
        if e.name != _m:
            raise
