"""Logical → physical remap of the router's int32 ids, fused with per-slot load recording.

``remap_and_record`` is the one entry point, dispatching to a backend (Triton kernel, torch
reference, aiter) through a lazy registry; ``DispatchTables`` are the per-layer device tables it
reads, updated in place after a hot-swap so captured CUDA graphs stay valid; a ``RemapCall`` is
one call's validated arguments, what every backend takes.
"""

from __future__ import annotations

from eplb.remap.api import MODES, available_backends, get_backend, remap_and_record
from eplb.remap.call import RemapCall
from eplb.remap.tables import DispatchTables

__all__ = ["MODES", "DispatchTables", "RemapCall", "available_backends", "get_backend", "remap_and_record"]
