"""Prometheus metrics for EPLB: the ``MetricsSink`` the manager reports to, in its own registry.

Shape legend: L layers, E logical experts, G GPUs (EP ranks).

``PrometheusSink`` subclasses :class:`eplb.metrics.sink.MetricsSink` (where the events are
documented) and overrides every event. Every call is O(1) apart from copying the window arrays
it is handed: counters and histograms are pre-bound children, and the window goes to
:class:`eplb.metrics.window.WindowCollector` as one reference swap. Nothing is
registered in prometheus_client's global registry; ``sink.registry`` holds it all, and
:meth:`PrometheusSink.render` is the fast text exposition the exporter serves
(:mod:`eplb.metrics.exporter`). Metric names come from :mod:`eplb.metrics.names` only; every
series carries the sink's engine labels, and rebalances are labelled by outcome and cause only
(:mod:`eplb.metrics.causes`), so the series set is fixed by the topology and the options.

With several ranks, only rank 0 builds a sink and an exporter (see
:func:`eplb.metrics.exporter.sink_for_rank`); the manager hands it the window it aggregated
over ranks, so Prometheus sees one process and the whole model.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from typing_extensions import Unpack

from eplb._version import __version__
from eplb.metrics import names
from eplb.metrics.causes import causes_of, check_cause, rebalance_cause
from eplb.metrics.names import ManagerPhase
from eplb.metrics.sink import MetricsSink, PassKind, RebalanceEvent
from eplb.metrics.window import WindowCollector

# Solve: milliseconds (greedy) to the solver's time budget; transfer: one expert (~44 MB at
# ~300 GB/s, 0.15 ms) to a whole model over a slow link (tens of seconds).
SOLVE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_Metric = TypeVar("_Metric", Counter, Histogram, Info)


class PrometheusSink(MetricsSink):
    """Receives manager events and keeps them as Prometheus metrics in ``self.registry``."""

    def __init__(
        self,
        *,
        hot_experts_per_layer: int = 8,
        per_expert: bool = False,
        min_render_interval_s: float = 1.0,
        engine: str = names.DEFAULT_ENGINE,
        model_name: str = names.DEFAULT_MODEL_NAME,
    ) -> None:
        """``hot_experts_per_layer``: K experts exported per layer by ``eplb_hot_expert_tokens``;
        ``per_expert``: also export every (layer, expert) as ``eplb_expert_tokens`` (L x E series);
        ``min_render_interval_s``: scrapes re-render the window at most this often (see
        :class:`~eplb.metrics.window.WindowCollector`); ``engine``, ``model_name``: the values of
        :data:`~eplb.metrics.names.ENGINE_LABELS` on every series (use the serving engine's own)."""
        self.engine_labels = names.engine_labels(engine=engine, model_name=model_name)
        const = dict(self.engine_labels)
        self.registry = CollectorRegistry(auto_describe=True)
        # Event metrics also live in a registry of their own, so render() can write them with
        # prometheus_client and append the window's cached text.
        self._events = CollectorRegistry(auto_describe=True)
        spec = names.BY_NAME

        def labelled(cls: type[_Metric], name: str, *labels: str, **kwargs: Any) -> _Metric:
            # prometheus_client appends the _info suffix itself.
            short = name.removesuffix("_info") if cls is Info else name
            return cls(short, spec[name].help, [*labels, *names.ENGINE_LABELS], registry=None, **kwargs)

        info = labelled(Info, names.INFO)
        self._info = info.labels(**const)
        self._info.info({"version": __version__})  # the topology labels join at on_topology
        passes = labelled(Counter, names.FORWARD_PASSES, "kind", "recorded")
        self._passes = {
            (kind, recorded): passes.labels(kind=kind, recorded=str(recorded).lower(), **const)
            for kind in names.PASS_KINDS
            for recorded in (False, True)
        }
        rebalances = labelled(Counter, names.REBALANCES, "outcome", "cause")
        # Every (outcome, cause) from the start: a fixed series set, and rate() sees the first one.
        self._rebalances = {
            (o, c): rebalances.labels(outcome=o, cause=c, **const)
            for o in names.REBALANCE_OUTCOMES
            for c in causes_of(o)
        }
        solve = labelled(Histogram, names.SOLVE_SECONDS, buckets=SOLVE_BUCKETS)
        transfer = labelled(Histogram, names.TRANSFER_SECONDS, buckets=TRANSFER_BUCKETS)
        experts_moved = labelled(Counter, names.EXPERTS_MOVED)
        bytes_moved = labelled(Counter, names.MOVED_BYTES)
        self._solve, self._transfer = solve.labels(**const), transfer.labels(**const)
        self._experts_moved, self._bytes_moved = experts_moved.labels(**const), bytes_moved.labels(**const)
        self._last_rebalance = _LastRebalanceCollector(self.engine_labels)
        self.phase = _PhaseCollector(self.engine_labels)
        self.window = WindowCollector(
            hot_experts_per_layer=hot_experts_per_layer,
            per_expert=per_expert,
            min_render_interval_s=min_render_interval_s,
            const_labels=self.engine_labels,
        )
        event_metrics: list[Collector] = [
            info,
            passes,
            rebalances,
            solve,
            transfer,
            experts_moved,
            bytes_moved,
            self._last_rebalance,
            self.phase,
        ]
        for metric in event_metrics:
            self._events.register(metric)
            self.registry.register(metric)
        self.registry.register(self.window)
        self._topology: tuple[int, int, int, int, int] | None = None

    # -- MetricsSink (each event's meaning is documented there) ------------------------------

    def on_forward_pass(self, *, kind: PassKind, recorded: bool) -> None:
        try:
            child = self._passes[(kind, bool(recorded))]
        except KeyError:
            raise ValueError(f"pass kind must be one of {names.PASS_KINDS}, got {kind!r}") from None
        child.inc()

    def on_window(self, *, logical_load_LE: np.ndarray, gpu_load_LG: np.ndarray) -> None:
        topology = self._topology
        if topology is not None:
            L, E, _, G, _ = topology
            if np.shape(logical_load_LE) != (L, E) or np.shape(gpu_load_LG) != (L, G):
                raise ValueError(
                    f"window shapes {np.shape(logical_load_LE)} and {np.shape(gpu_load_LG)} do not match "
                    f"the topology [L, E] = [{L}, {E}] and [L, G] = [{L}, {G}]"
                )
        self.window.update(logical_load_LE=logical_load_LE, gpu_load_LG=gpu_load_LG)

    def on_rebalance(self, **event: Unpack[RebalanceEvent]) -> None:
        outcome, reason = event["outcome"], event["reason"]
        solve_seconds, transfer_seconds = event["solve_seconds"], event["transfer_seconds"]
        experts_moved, bytes_moved = event["experts_moved"], event["bytes_moved"]
        given = event.get("cause")
        # The one place free text becomes a label value: a cause from the fixed list.
        cause = rebalance_cause(outcome, reason) if given is None else check_cause(outcome, given)
        for what, seconds in (("solve_seconds", solve_seconds), ("transfer_seconds", transfer_seconds)):
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"{what} must be a finite number >= 0, got {seconds}")
        if experts_moved < 0 or bytes_moved < 0:
            raise ValueError(
                f"experts_moved and bytes_moved must be >= 0, got {experts_moved}, {bytes_moved}"
            )
        self._rebalances[(outcome, cause)].inc()
        self._solve.observe(solve_seconds)
        if outcome != "skipped":
            # A skipped rebalance moves nothing; its planned moves are not traffic.
            self._transfer.observe(transfer_seconds)
            self._experts_moved.inc(experts_moved)
            self._bytes_moved.inc(bytes_moved)
        self._last_rebalance.record(
            outcome,
            cause,
            event["balancedness_before"],
            event["balancedness_after"],
            event.get("predicted_balancedness"),
            event.get("realized_balancedness"),
        )

    def on_topology(
        self, *, num_layers: int, num_logical: int, num_physical: int, num_gpus: int, num_nodes: int
    ) -> None:
        values = (num_layers, num_logical, num_physical, num_gpus, num_nodes)
        if min(values) < 1 or num_physical < num_logical or num_physical % num_gpus or num_gpus % num_nodes:
            raise ValueError(
                "topology needs every count >= 1, num_physical >= num_logical, num_physical divisible "
                f"by num_gpus and num_gpus by num_nodes; got layers={num_layers} logical={num_logical} "
                f"physical={num_physical} gpus={num_gpus} nodes={num_nodes}"
            )
        self._topology = values
        labels = dict(zip(names.TOPOLOGY_LABELS, (__version__, *(str(v) for v in values)), strict=True))
        self._info.info(labels)

    def on_phase(
        self, *, phase: ManagerPhase, in_flight_since: float | None, last_rebalance_at: float
    ) -> None:
        self.phase.record(phase, in_flight_since, last_rebalance_at)

    # -- exposition ----------------------------------------------------------------------------

    def render(self) -> bytes:
        """The text exposition of every metric: ``generate_latest(self.registry)``'s samples, with the
        window metrics re-rendered at most every ``min_render_interval_s``."""
        return generate_latest(self._events) + self.window.render().encode()


class _LastRebalanceCollector(Collector):
    """The last rebalance: its balancedness before/after, and the time of the last one of each cause.

    ``eplb_last_rebalance_timestamp_seconds{outcome, cause}`` places Grafana's annotations; its
    series are bounded by the fixed list of causes and never change labels (each cause keeps one
    series once seen). Nothing is exported before the first rebalance (no made-up zeros).
    """

    def __init__(self, engine_labels: tuple[tuple[str, str], ...]) -> None:
        self._engine_values = [value for _, value in engine_labels]
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}
        self._balancedness: tuple[float, float] | None = None
        # when=predicted / when=realized, once a reporter (the engine adapters) gave them.
        self._forecast: dict[str, float] = {}

    def record(
        self,
        outcome: str,
        cause: str,
        before: float,
        after: float,
        predicted: float | None = None,
        realized: float | None = None,
    ) -> None:
        with self._lock:
            self._last[(outcome, cause)] = time.time()
            self._balancedness = (before, after)
            for when, value in (("predicted", predicted), ("realized", realized)):
                if value is not None:
                    self._forecast[when] = float(value)

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        stamps, balance = self._families()
        with self._lock:
            last, balancedness, forecast = dict(self._last), self._balancedness, dict(self._forecast)
        for outcome in names.REBALANCE_OUTCOMES:
            for cause in causes_of(outcome):
                if (outcome, cause) in last:
                    stamps.add_metric([outcome, cause, *self._engine_values], last[(outcome, cause)])
        if balancedness is not None:
            balance.add_metric(["before", *self._engine_values], balancedness[0])
            balance.add_metric(["after", *self._engine_values], balancedness[1])
        for when, value in sorted(forecast.items()):
            balance.add_metric([when, *self._engine_values], value)
        yield stamps
        yield balance

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        stamp = names.BY_NAME[names.LAST_REBALANCE_TIMESTAMP]
        balance = names.BY_NAME[names.LAST_REBALANCE_BALANCEDNESS]
        return (
            GaugeMetricFamily(stamp.name, stamp.help, labels=[*stamp.labels, *names.ENGINE_LABELS]),
            GaugeMetricFamily(balance.name, balance.help, labels=[*balance.labels, *names.ENGINE_LABELS]),
        )


class _PhaseCollector(Collector):
    """The manager's phase, the rebalance in flight and the time since the last one ended.

    The seconds are derived at scrape time from the times the manager reported (``clock``, its
    ``time.monotonic``), so they keep growing while a rebalance hangs and the manager's thread
    reports nothing. Nothing is exported before the manager's first report.
    """

    def __init__(self, engine_labels: tuple[tuple[str, str], ...]) -> None:
        self._engine_values = [value for _, value in engine_labels]
        self._lock = threading.Lock()
        self._state: tuple[ManagerPhase, float | None, float] | None = None
        self.clock = time.monotonic

    def record(self, phase: ManagerPhase, in_flight_since: float | None, last_rebalance_at: float) -> None:
        if phase not in names.MANAGER_PHASES:
            raise ValueError(f"phase must be one of {names.MANAGER_PHASES}, got {phase!r}")
        with self._lock:
            self._state = (phase, in_flight_since, last_rebalance_at)

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        with self._lock:
            state = self._state
        if state is not None:
            phase_family, in_flight, age = families
            current, since, last = state
            now = self.clock()
            for phase in names.MANAGER_PHASES:
                phase_family.add_metric([phase, *self._engine_values], float(phase == current))
            in_flight.add_metric(self._engine_values, 0.0 if since is None else max(0.0, now - since))
            age.add_metric(self._engine_values, max(0.0, now - last))
        yield from families

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        def family(name: str) -> GaugeMetricFamily:
            spec = names.BY_NAME[name]
            return GaugeMetricFamily(spec.name, spec.help, labels=[*spec.labels, *names.ENGINE_LABELS])

        return family(names.MANAGER_PHASE), family(names.IN_FLIGHT_SECONDS), family(names.LAST_REBALANCE_AGE)
