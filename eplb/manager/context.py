"""What the rebalance manager's parts share: the setup they never replace, the ranks served with
now, and the live state every part reads and changes (placement, weights, recorder, phase, history).

Shape legend: L layers, E logical experts, P physical slots, R max replicas.

The manager (eplb.manager.manager) makes one :class:`Setup` and one :class:`Live` and hands both to
its parts: the rebalance from window to record (eplb.manager.rebalance), the swap scheduling
(eplb.manager.schedule) and the lost-rank recovery (eplb.manager.lost_rank). A recovery replaces ``Live.world``, ``Live.swaps`` and ``Live.recorder``;
the rest changes in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from eplb.config import EplbConfig
from eplb.hotswap.swap import HotSwapOptions, HotSwapResult, PreparedSwap
from eplb.manager.collectives import RankAgreement
from eplb.manager.health import SwapGroups
from eplb.manager.types import ExpertEngine, RebalanceRecord
from eplb.manager.watchdog import Watchdog
from eplb.metrics.names import ManagerPhase
from eplb.metrics.sink import MetricsSink
from eplb.placement.balance import model_balancedness
from eplb.placement.model import Placement
from eplb.policy.clock import RebalanceClock
from eplb.recorder.recorder import ExpertDistributionRecorder, RecorderConfig

log = logging.getLogger("eplb.manager.manager")
"""The control loop's log: its parts log under the manager's name, as operators filter it."""


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What the manager's parts share and never replace (its constructor's arguments, resolved)."""

    config: EplbConfig
    """The flags."""
    engine: ExpertEngine
    """The serving engine: slot buffers to swap, maps to update, a world to serve on."""
    device: torch.device
    """Where the collectives' tensors of the data group live."""
    swap_options: HotSwapOptions
    """Every hot-swap's options."""
    bytes_per_expert: int
    """One expert's weights over all slot buffers, in bytes (what one copy moves)."""
    static_dispatch: bool
    """The dispatch mode uses static maps: before/after are scored with their replica shares, as
    the plans are."""

    def served(self, load_LE: np.ndarray, placement: Placement, weights_LER: np.ndarray | None) -> float:
        """Balancedness of ``load_LE`` on ``placement`` as this server dispatches
        (eplb.solver.scoring.served)."""
        if not self.static_dispatch or weights_LER is not None:
            return float(model_balancedness(load_LE, placement, weights_LER))
        from eplb.solver.scoring.served import served_balancedness  # SciPy's module only where it is used

        return served_balancedness(load_LE, placement, dispatch=self.config.dispatch_algorithm)


@dataclass(frozen=True, kw_only=True)
class World:
    """The ranks the manager serves with (replaced whole when the survivors of a lost rank regroup)."""

    group: dist.ProcessGroup | None
    """The serving group (None: the default group)."""
    rank: int
    """This rank's rank in ``group``."""
    ranks: tuple[int, ...]
    """The group's global ranks, in group order."""
    agree: RankAgreement
    """The group's collectives (eplb.manager.collectives)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def me(self) -> int:
        """This rank's global rank."""
        return self.ranks[self.rank]


def start_recorder(
    config: EplbConfig, placement: Placement, device: torch.device, world: World
) -> ExpertDistributionRecorder:
    """A started recorder over ``placement`` that counts on ``world``'s group."""
    recorder = ExpertDistributionRecorder(
        RecorderConfig.from_eplb_config(config),
        placement,
        device=device,
        group=world.group,
        flag_group=world.agree.control,
    )
    recorder.start()
    return recorder


@dataclass(kw_only=True, eq=False)
class Live:
    """What the manager's parts read and change from pass to pass, and how they report it."""

    sink: MetricsSink
    """Where every event goes (never replaced)."""
    watchdog: Watchdog
    """Bounds the rebalance in flight (never replaced; eplb.manager.watchdog)."""
    world: World
    swaps: SwapGroups
    """The hot-swap's group, and whether the manager may still swap (eplb.manager.health)."""
    recorder: ExpertDistributionRecorder
    """Records the window over ``placement`` (a new one after a lost rank: P' slots)."""
    placement: Placement
    """The placement served now."""
    weights_LER: np.ndarray | None = None
    """Its per-replica dispatch weights (None: uniform)."""
    phase: ManagerPhase = "idle"
    """idle | solving | applying | stopped."""
    passes: int = 0
    """Forward passes ended (after a lost rank: the most any survivor had)."""
    clock: RebalanceClock
    """The counted passes and the next rebalance's (eplb.policy.clock; after a lost rank it
    restarts from the most any survivor had)."""
    history: list[RebalanceRecord] = field(default_factory=list)
    """Every rebalance's record, in order."""
    last_rebalance_at: float
    """``time.monotonic()`` when the last rebalance ended (any outcome), or when the manager started."""
    leaving: BaseException | None = None
    """What interrupted this rank's swap (KeyboardInterrupt), re-raised at the end of the pass."""
    on_phase: Callable[..., None] | None = field(init=False)
    """The sink's ``on_phase`` (None: a sink older than the event)."""

    def __post_init__(self) -> None:
        self.on_phase = getattr(self.sink, "on_phase", None)

    def enter(self, phase: ManagerPhase) -> None:
        """The manager's phase (reported to the sink, with the rebalance in flight if any)."""
        self.phase = phase
        if self.on_phase is not None:
            self.on_phase(
                phase=phase, in_flight_since=self.watchdog.began, last_rebalance_at=self.last_rebalance_at
            )

    def stop(self) -> None:
        """Rebalancing stopped for good on this rank (eplb.manager.health): no collective again."""
        self.recorder.stop()
        self.enter("stopped")

    def serve(self, placement: Placement, weights_LER: np.ndarray | None) -> None:
        """The slots hold ``placement`` now: serve and record through it."""
        self.placement, self.weights_LER = placement, weights_LER
        self.recorder.set_placement(placement)  # passes from now on count through the new map

    def report_topology(self, placement: Placement) -> None:
        self.sink.on_topology(
            num_layers=placement.num_layers,
            num_logical=placement.num_logical,
            num_physical=placement.num_physical,
            num_gpus=placement.num_gpus,
            num_nodes=placement.num_nodes,
        )

    def agreed(self, *flags: bool) -> list[bool]:
        """Flags agreed over the ranks (each true if true on some rank): the pass's agreement, which
        waits for every rank (the watchdog's log says so, should one not come)."""
        doing = self.watchdog.doing
        self.watchdog.doing = f"{doing} (the pass's agreement)"
        try:
            return self.world.agree.any_of(*flags)
        finally:
            self.watchdog.doing = doing

    def execute(self, layers: tuple[int, ...], prepared: PreparedSwap, **kwargs: Any) -> HotSwapResult:
        """A swap on the swap group (eplb.manager.health); an interruption of this rank is kept for
        the end of the pass, once the manager's state is the other ranks'."""
        result, leaving = self.swaps.execute(layers, prepared, **kwargs)
        if leaving is not None and self.leaving is None:
            self.leaving = leaving
        return result
