"""Prometheus metrics of expert load and rebalances: names in one list, a sink, an exporter.

``names`` defines every ``eplb_*`` series (the exporter, the dashboard and the docs read it);
``PrometheusSink`` takes the manager's events; ``MetricsExporter`` serves ``/metrics``.
"""

from __future__ import annotations

from eplb.metrics.exporter import MetricsExporter, sink_for_rank
from eplb.metrics.prometheus import PrometheusSink
from eplb.metrics.sink import MetricsSink, NullSink

__all__ = ["MetricsExporter", "MetricsSink", "NullSink", "PrometheusSink", "sink_for_rank"]
