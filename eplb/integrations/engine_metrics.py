"""eplb's metrics from inside an engine: rank 0 exports what the adapter saw at each rebalance.

Shape legend: L layers, E logical experts, G GPUs (EP ranks).

With ``EPLB_METRICS_PORT`` set, the first rebalance (or, under SGLang, the construction of its
``EPLBManager``) on rank 0 starts eplb's exporter (eplb.metrics.exporter.sink_for_rank) with the
``engine`` and ``model_name`` labels of eplb.integrations.engine_env; every other rank reports to
a NullSink. Each rebalance then reports, as eplb's manager does, through the one sink protocol
(eplb.metrics.sink): the window the engine handed over (per expert and per GPU under the live
placement), the outcome with its cause (eplb.metrics.causes), the solve time, the copies and
bytes the plan moves, the balancedness before and after, the last plan's prediction and what
the window it served realized, and the phase (solving, then idle), from which the exporter derives
the seconds since the last rebalance at each scrape: a rebalancer that stops being called shows as
a growing age. Series are bounded as eplb's own are (layers x ranks, the fixed causes).

The engine moves the weights and runs the passes, so the adapters hook those and tell this object
(:meth:`EngineMetrics.forward_pass`, :meth:`EngineMetrics.transfer`): with ``transfers_follow``
set (the adapter hooked the engine's weight transfer), an applied plan's rebalance is reported
once the engine has moved its last layer, with the seconds the transfers took, in the phase
``applying`` until then; a plan that moves nothing is reported at once. A pending report is
reported before the next one in any case (a transfer the engine never ran then reads 0 s).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from eplb.metrics.sink import MetricsSink, NullSink
from eplb.placement.balance import gpu_load, model_balancedness

if TYPE_CHECKING:
    from eplb.integrations.engine_env import EngineEnv
    from eplb.metrics.exporter import MetricsExporter
    from eplb.metrics.sink import PassKind
    from eplb.placement.model import Placement


def process_rank() -> int:
    """This process's global rank (torch.distributed), 0 where no process group is set up."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency of every engine
        return 0
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


@dataclass(frozen=True, kw_only=True)
class RebalanceReport:
    """What one adapter rebalance did, for the metrics."""

    load_LE: np.ndarray
    """The window the plan was made from, summed over its passes."""
    live: Placement
    """The placement that served the window."""
    placement: Placement
    """The placement after the rebalance (``live`` when kept)."""
    applied: bool
    reason: str
    solve_seconds: float
    failed: bool = False
    """Whether the rebalance failed (a plan that did not fit the model) rather than was skipped."""
    copies: int
    """Expert copies across GPUs the plan moves (0 when kept)."""
    bytes_per_expert: int
    """0 when unknown (the moved bytes then read 0)."""
    predicted: float | None
    """The predicted balancedness of the placement that serves next (the plan's, or the kept
    placement's) over the passes before the next rebalance (None: no prediction)."""


class EngineMetrics:
    """One engine process's metrics: a sink on rank 0 with a port set, made on first use."""

    def __init__(
        self, settings: EngineEnv, logger: logging.Logger, *, transfers_follow: bool = False
    ) -> None:
        self.settings = settings
        self._log = logger
        self._lock = threading.Lock()
        self.sink: MetricsSink | None = None
        """None until :meth:`start`; a NullSink on ranks other than 0 or without a port."""
        self.exporter: MetricsExporter | None = None
        self.transfers_follow = transfers_follow
        """Whether the adapter hooked the engine's weight transfer: an applied plan is then reported
        with its transfer time once :meth:`transfer` says the last layer moved."""
        self._topology: tuple[int, ...] | None = None
        self._last_predicted: float | None = None
        self._pending: dict[str, Any] | None = None
        """The rebalance event of an applied plan whose transfer is under way (``transfers_follow``)."""
        self._pending_layers = 0
        self._pending_seconds = 0.0

    @property
    def exporting(self) -> bool:
        """Whether this process exports (rank 0 with a port, once started)."""
        return self.exporter is not None

    def start(self) -> MetricsSink:
        """The sink (starts rank 0's exporter the first time). An exporter that cannot start (the
        port was taken after the start-up probe) is logged once; the process then exports nothing
        rather than fail each rebalance."""
        with self._lock:
            if self.sink is not None:
                return self.sink
            settings = self.settings
            if settings.metrics_port is None:
                self.sink = NullSink()
                return self.sink
            from eplb.metrics.exporter import sink_for_rank

            try:
                self.sink, self.exporter = sink_for_rank(
                    process_rank(),
                    port=settings.metrics_port,
                    host=settings.metrics_host,
                    engine=settings.metrics_engine,
                    model_name=settings.model_name,
                )
            except ValueError as exc:  # bound at start-up, taken since: serving must go on
                self._log.error("eplb: no metrics (EPLB_METRICS_HOST/EPLB_METRICS_PORT): %s", exc)
                self.sink, self.exporter = NullSink(), None
                return self.sink
            if self.exporter is not None:
                self._log.info("eplb: metrics on %s", self.exporter.url)
                self.sink.on_phase(phase="idle", in_flight_since=None, last_rebalance_at=time.monotonic())
            return self.sink

    def solving(self, started: float) -> None:
        """A rebalance began at ``started`` (``time.monotonic()``)."""
        sink = self.start()
        on_phase = getattr(sink, "on_phase", None)
        if on_phase is not None and self.exporter is not None:
            on_phase(phase="solving", in_flight_since=started, last_rebalance_at=started)

    def report(self, event: RebalanceReport) -> None:
        """One rebalance ended: report it (rank 0 with a port; a no-op elsewhere)."""
        sink = self.start()
        if self.exporter is None:
            return
        live = event.live
        L, E = event.load_LE.shape
        topology = (L, E, live.num_physical, live.num_gpus, live.num_nodes)
        if topology != self._topology:
            sink.on_topology(
                num_layers=L,
                num_logical=E,
                num_physical=live.num_physical,
                num_gpus=live.num_gpus,
                num_nodes=live.num_nodes,
            )
            self._topology, self._last_predicted = topology, None
        sink.on_window(logical_load_LE=event.load_LE, gpu_load_LG=gpu_load(event.load_LE, live))
        before = float(model_balancedness(event.load_LE, live))
        after = float(model_balancedness(event.load_LE, event.placement))
        # The window was served by the placement the last rebalance left: what it realized there
        # beside what that rebalance predicted for it.
        realized = before if self._last_predicted is not None else None
        rebalance = dict(
            outcome="applied" if event.applied else "failed" if event.failed else "skipped",
            reason=event.reason,
            solve_seconds=max(event.solve_seconds, 0.0),
            experts_moved=event.copies,
            bytes_moved=event.copies * event.bytes_per_expert,
            balancedness_before=before,
            balancedness_after=after,
            predicted_balancedness=self._last_predicted,
            realized_balancedness=realized,
        )
        self._last_predicted = event.predicted
        with self._lock:
            self._flush(sink)  # a transfer never reported done: its rebalance goes out now
            if event.applied and self.transfers_follow:
                self._pending, self._pending_layers, self._pending_seconds = rebalance, L, 0.0
                on_phase = getattr(sink, "on_phase", None)
                if on_phase is not None:
                    started = time.monotonic()
                    on_phase(phase="applying", in_flight_since=started, last_rebalance_at=started)
                return
            self._pending = rebalance
            self._flush(sink)

    def forward_pass(self, *, kind: PassKind, recorded: bool) -> None:
        """The engine ran a forward pass (counted by rank 0's exporter)."""
        sink = self.start()
        if self.exporter is not None:
            sink.on_forward_pass(kind=kind, recorded=recorded)

    def transfer(self, seconds: float, *, last: bool | None = None, layer: int | None = None) -> None:
        """The engine moved weights for ``seconds``; the plan's transfer is done with ``last``, or
        when ``layer`` is the last of the pending plan's layers. Nothing pending: ignored (a plan
        that is not eplb's)."""
        if self.exporter is None:
            return
        with self._lock:
            if self._pending is None:
                return
            self._pending_seconds += max(float(seconds), 0.0)
            if last or (layer is not None and layer >= self._pending_layers - 1):
                assert self.sink is not None
                self._flush(self.sink)

    def _flush(self, sink: MetricsSink) -> None:
        """Report the pending rebalance with the transfer time counted so far (lock held)."""
        rebalance, self._pending = self._pending, None
        if rebalance is None:
            return
        sink.on_rebalance(transfer_seconds=self._pending_seconds, **rebalance)
        self._pending_seconds = 0.0
        on_phase = getattr(sink, "on_phase", None)
        if on_phase is not None:
            on_phase(phase="idle", in_flight_since=None, last_rebalance_at=time.monotonic())

    def close(self) -> None:
        """Stop the exporter (tests; an engine process keeps it until it exits)."""
        with self._lock:
            if self.exporter is not None:
                self.exporter.stop()
            self.sink, self.exporter = None, None
