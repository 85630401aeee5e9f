"""The events the control loop reports, as one protocol: the manager calls it, metrics implement it.

Shape legend: L layers, E logical experts, G GPUs (EP ranks).

Keeping this protocol apart from the Prometheus code lets the manager, the simulator and tests
report events without importing prometheus_client. Its methods are written once, here, with
no-op bodies: ``NullSink`` is the protocol as it stands, and a sink that subclasses it (as
``PrometheusSink`` does) overrides only what it records; any object with these five methods is
also a sink (structural typing; the manager skips ``on_phase`` on an object without it, a sink
written before it existed). Implementations must return quickly and never block: they are called
on the serving process's control path.
"""

from __future__ import annotations

from typing import Literal, Protocol, TypedDict

import numpy as np
from typing_extensions import NotRequired, Unpack

from eplb.metrics.causes import RebalanceCause, RebalanceOutcome
from eplb.metrics.names import ManagerPhase

__all__ = [
    "ManagerPhase",
    "MetricsSink",
    "NullSink",
    "PassKind",
    "RebalanceCause",
    "RebalanceEvent",
    "RebalanceOutcome",
]

PassKind = Literal["prefill", "decode"]


class RebalanceEvent(TypedDict):
    """The keyword arguments of :meth:`MetricsSink.on_rebalance`, listed once for every sink."""

    outcome: RebalanceOutcome
    reason: str
    """Free text for logs (never a label)."""
    solve_seconds: float
    transfer_seconds: float
    experts_moved: int
    bytes_moved: int
    balancedness_before: float
    balancedness_after: float
    cause: NotRequired[RebalanceCause | None]
    """One of :data:`eplb.metrics.causes.REBALANCE_CAUSES`; absent or None: derived from ``reason``."""
    predicted_balancedness: NotRequired[float | None]
    """What the previous rebalance predicted for the placement that then served the window
    (the engine adapters report it; absent or None: not exported)."""
    realized_balancedness: NotRequired[float | None]
    """What that placement realized on the window (absent or None: not exported)."""


class MetricsSink(Protocol):
    """Receiver of EPLB control-loop events (all arguments keyword-only); each event is ignored
    unless a subclass overrides it."""

    def on_forward_pass(self, *, kind: PassKind, recorded: bool) -> None:
        """A forward pass ended; ``recorded`` says whether the recorder counted it."""
        return None

    def on_window(self, *, logical_load_LE: np.ndarray, gpu_load_LG: np.ndarray) -> None:
        """Load of the recorder's current window: per logical expert, and per GPU under the live placement."""
        return None

    def on_rebalance(self, **event: Unpack[RebalanceEvent]) -> None:
        """A rebalance was decided: applied, skipped (gain too small, threshold) or failed (rolled back).

        The fields are :class:`RebalanceEvent`'s: ``reason`` is free text for logs; ``cause`` is one
        of :data:`eplb.metrics.causes.REBALANCE_CAUSES`, or None to derive it from ``reason``
        (:func:`eplb.metrics.causes.rebalance_cause`)."""
        return None

    def on_topology(
        self, *, num_layers: int, num_logical: int, num_physical: int, num_gpus: int, num_nodes: int
    ) -> None:
        """The model and EP topology the manager serves (reported once at start)."""
        return None

    def on_phase(
        self, *, phase: ManagerPhase, in_flight_since: float | None, last_rebalance_at: float
    ) -> None:
        """The manager's phase, at start and at each change; times are this process's
        ``time.monotonic()``. ``in_flight_since``: when the rebalance in progress began (None: none
        is); ``last_rebalance_at``: when the last rebalance ended (any outcome), or when the manager
        started. A sink derives the seconds since then when it is read, so they keep growing while
        the manager's thread is blocked (a rebalance that hangs)."""
        return None


class NullSink(MetricsSink):
    """A sink that ignores every event: the protocol's no-op methods, unchanged."""
