"""Where each expert lives: the int32 placement model, what changes between two, the load it gives each GPU.

``Placement`` holds phy2log [L, P], log2phy [L, E, R] and logcnt [L, E]; ``diff_placements`` counts
the copies a change needs; ``balancedness`` is mean / max GPU load; ``static_dispatch_maps`` picks
the replica each rank sends to; ``save_placement`` / ``load_placement`` are the safetensors format.
"""

from __future__ import annotations

from eplb.placement.balance import balancedness, gpu_load, imbalance_ratio, model_balancedness
from eplb.placement.diff import PlacementDiff, diff_placements
from eplb.placement.dispatch_map import static_dispatch_map, static_dispatch_maps
from eplb.placement.io import load_placement, save_placement
from eplb.placement.model import INT32, DevicePlacement, Placement

__all__ = [
    "INT32",
    "DevicePlacement",
    "Placement",
    "PlacementDiff",
    "balancedness",
    "diff_placements",
    "gpu_load",
    "imbalance_ratio",
    "load_placement",
    "model_balancedness",
    "save_placement",
    "static_dispatch_map",
    "static_dispatch_maps",
]
