"""The rebalance manager: the control loop every rank runs beside its forward passes.

Pass hooks feed the recorder; every interval rank 0 plans in the background, the plan is agreed,
and the hot-swap moves a chunk of layers per pass, reporting each rebalance to a metrics sink.
"""

from __future__ import annotations

from eplb.manager.manager import EplbManager
from eplb.manager.types import ExpertEngine, ManagerState, RebalanceRecord

__all__ = ["EplbManager", "ExpertEngine", "ManagerState", "RebalanceRecord"]
