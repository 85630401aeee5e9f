"""Simulation configs for tests: the flags of a server with EPLB on, as ``SimulationConfig.eplb``."""

from __future__ import annotations

from typing import Any

from eplb.config import EplbConfig


def server(**flags: Any) -> EplbConfig:
    """``EplbConfig(enable_eplb=True, **flags)``: a simulation replays a server that rebalances."""
    return EplbConfig(enable_eplb=True, **flags)
