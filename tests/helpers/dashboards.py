"""The scripts in dashboards/ (a folder of scripts, not a package) loaded as modules for the tests.

The scripts import each other by file name (``import panels``), which Python resolves from a
running script's own folder. Here each is loaded from its path under that same name, siblings
before the scripts that import them, so those imports find the module already loaded and
dashboards/ never goes on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def _load(name: str) -> ModuleType:
    path = DASHBOARDS / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None:
        # A module of this name from anywhere else would shadow the script's import of its sibling.
        assert getattr(loaded, "__file__", None) == str(path), f"{name!r} is already {loaded!r}"
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


promql = _load("promql")
panels = _load("panels")
generate = _load("generate")
promstack = _load("promstack")
