"""Logical → physical remap of the router's int32 ids, fused with per-slot load recording.

``remap_and_record`` is the one entry point, dispatching to a backend (Triton kernel, torch
reference, aiter) through a lazy registry; ``DispatchTables`` are the per-layer device tables it
reads, updated in place after a hot-swap so captured CUDA graphs stay valid; a ``RemapCall`` is
one call's validated arguments, what every backend takes; ``prepare_remap`` validates a layer's
fixed arguments once and returns the per-call path. The names load on first use, so
``eplb.remap.lp_rule`` (numpy only, for the simulator) imports without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eplb.remap.api import MODES, available_backends, get_backend, remap_and_record
    from eplb.remap.call import RemapCall
    from eplb.remap.prepared import PreparedRemap, prepare_remap
    from eplb.remap.tables import DispatchTables

_NAMES = {
    "MODES": "eplb.remap.api",
    "available_backends": "eplb.remap.api",
    "get_backend": "eplb.remap.api",
    "remap_and_record": "eplb.remap.api",
    "RemapCall": "eplb.remap.call",
    "PreparedRemap": "eplb.remap.prepared",
    "prepare_remap": "eplb.remap.prepared",
    "DispatchTables": "eplb.remap.tables",
}


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'eplb.remap' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "MODES",
    "DispatchTables",
    "PreparedRemap",
    "RemapCall",
    "available_backends",
    "get_backend",
    "prepare_remap",
    "remap_and_record",
]
