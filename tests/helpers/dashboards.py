"""The scripts in dashboards/ (not a package) loaded as modules for the metrics tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"eplb_dashboards_{name}", DASHBOARDS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


generate = _load("generate")
promstack = _load("promstack")
