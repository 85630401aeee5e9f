"""The HTTP endpoint Prometheus scrapes: ``GET /metrics`` on 127.0.0.1 unless told otherwise.

The server runs in its own daemon thread, in the process that holds the manager; a scrape reads
the sink's counters and the cached window text and never waits on the forward path (which only
swaps references under short locks). Each connection gets a thread, so a stalled client does not
stall the next scrape.

With several EP ranks only rank 0 exports: :func:`sink_for_rank` gives rank 0 a
:class:`~eplb.metrics.prometheus.PrometheusSink` and a started exporter, and every other rank a
:class:`~eplb.metrics.sink.NullSink`, so the manager can report on every rank unconditionally.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

from eplb.metrics.prometheus import PrometheusSink
from eplb.metrics.sink import MetricsSink, NullSink

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_HOST = "127.0.0.1"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    sink: PrometheusSink


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # Keep-alive: Prometheus reuses its connection, so a scrape costs no new connection or thread.
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, status, ctype = self.server.sink.render(), 200, CONTENT_TYPE
        elif path == "/":
            body, status, ctype = b'eplb metrics: <a href="/metrics">/metrics</a>\n', 200, "text/html"
        else:
            body, status, ctype = b"not found\n", 404, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        # One line per scrape on stderr at 20 Hz would drown the server's own logs.
        return None


class MetricsExporter:
    """Serves ``sink.render()`` over HTTP from a background thread; ``port=0`` picks a free port."""

    def __init__(self, sink: PrometheusSink, *, host: str = DEFAULT_HOST, port: int = 0) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        self.sink = sink
        self.host = host
        self._requested_port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsExporter:
        if self._server is not None:
            return self
        server_class = _Server6 if ":" in self.host else _Server
        try:
            server = server_class((self.host, self._requested_port), _Handler)
        except OSError as exc:
            raise ValueError(f"cannot serve metrics on {self.host}:{self._requested_port}: {exc}") from exc
        server.sink = self.sink
        self._server = server
        # poll_interval only bounds how long stop() waits for the loop to notice; requests wake it at once.
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="eplb-metrics", daemon=True
        )
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        """The bound port (the free one the OS chose when constructed with ``port=0``)."""
        if self._server is None:
            raise RuntimeError("exporter not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server, self._thread = None, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)

    def __enter__(self) -> MetricsExporter:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def sink_for_rank(
    rank: int,
    *,
    port: int | None,
    host: str = DEFAULT_HOST,
    hot_experts_per_layer: int = 8,
    per_expert: bool = False,
) -> tuple[MetricsSink, MetricsExporter | None]:
    """The sink a rank's manager reports to, and the started exporter (rank 0 with a port only).

    Rank 0 reports the window the manager aggregated over all ranks; other ranks export nothing.
    ``port=None`` disables exporting (a :class:`NullSink` on every rank).
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if port is None or rank != 0:
        return NullSink(), None
    sink = PrometheusSink(hot_experts_per_layer=hot_experts_per_layer, per_expert=per_expert)
    exporter = MetricsExporter(sink, host=host, port=port).start()
    return sink, exporter
