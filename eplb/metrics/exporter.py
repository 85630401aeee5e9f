"""The HTTP endpoint Prometheus scrapes: ``GET /metrics`` on 127.0.0.1 unless told otherwise.

The server runs in its own daemon thread, in the process that holds the manager; a scrape reads
the sink's counters and the cached window text and never waits on the forward path (which only
swaps references under short locks). Each connection gets a thread, so a stalled client does not
stall the next scrape, but both are bounded: a connection idle (or stalled mid-request) for
``idle_timeout_s`` is closed, and past ``max_connections`` open connections a new one is answered
503 at once, so no client can hold threads or sockets forever. A client that sends
``Accept-Encoding: gzip`` (Prometheus does) gets the text gzipped, about a tenth of its size.

With several EP ranks only rank 0 exports: :func:`sink_for_rank` gives rank 0 a
:class:`~eplb.metrics.prometheus.PrometheusSink` and a started exporter, and every other rank a
:class:`~eplb.metrics.sink.NullSink`, so the manager can report on every rank unconditionally.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import TracebackType
from typing import Any

from eplb.metrics import names
from eplb.metrics.prometheus import PrometheusSink
from eplb.metrics.sink import MetricsSink, NullSink

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_IDLE_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 16
# Level 1: a DeepSeek-V3-sized scrape (240 kB) compresses 10x in 0.4 ms; level 6 saves 15% more
# bytes for three times the CPU, level 9 ten times.
GZIP_LEVEL = 1
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 25\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n\r\ntoo many open connections"
)


def accepts_gzip(header: str | None) -> bool:
    """Whether an ``Accept-Encoding`` header value accepts gzip (``gzip;q=0`` refuses it)."""
    weights: dict[str, float] = {}
    for item in (header or "").split(","):
        coding, *params = (part.strip() for part in item.split(";"))
        weight = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        if coding:
            weights[coding.lower()] = weight
    return weights.get("gzip", weights.get("x-gzip", weights.get("*", 0.0))) > 0.0


class _Server(socketserver.ThreadingMixIn, HTTPServer):
    """One daemon thread per connection, at most ``max_connections`` at a time; tracks them to close."""

    daemon_threads = True
    block_on_close = False  # stop() closes the connections itself instead of waiting for them

    def __init__(
        self, address: tuple[str, int], *, sink: PrometheusSink, idle_timeout_s: float, max_connections: int
    ) -> None:
        self.sink = sink
        self.idle_timeout_s = idle_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._gzip_lock = threading.Lock()
        self._gzipped: tuple[bytes, bytes] = (b"", gzip.compress(b"", compresslevel=GZIP_LEVEL))
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse(request)
            self.shutdown_request(request)
            return
        with self._open_lock:
            self._open.add(request)
        thread = threading.Thread(
            target=self._serve_connection,
            args=(request, client_address),
            name="eplb-metrics-conn",
            daemon=True,
        )
        thread.start()

    def _serve_connection(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._open_lock:
                self._open.discard(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanished mid-response is routine; never a traceback on the server's stderr.
        log.debug("metrics connection from %s ended with an error", client_address, exc_info=True)

    @property
    def open_connections(self) -> int:
        with self._open_lock:
            return len(self._open)

    def close_connections(self) -> None:
        """Wake every connection's thread (its read fails at once, and the thread ends)."""
        with self._open_lock:
            open_now = list(self._open)
        for conn in open_now:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def gzipped(self, body: bytes) -> bytes:
        """``body`` gzipped; the last result is reused while the text does not change (an idle server)."""
        with self._gzip_lock:
            last_body, last = self._gzipped
            if body != last_body:
                last = gzip.compress(body, compresslevel=GZIP_LEVEL)
                self._gzipped = (body, last)
            return last


class _Server6(_Server):
    address_family = socket.AF_INET6


def _refuse(request: socket.socket) -> None:
    """Answer 503 and close without a thread; never blocks the accept loop for long."""
    with contextlib.suppress(OSError):
        request.settimeout(0.05)
        with contextlib.suppress(OSError):
            request.recv(65536)  # the request, if sent already: closing on unread data resets instead
        request.sendall(_BUSY)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # Keep-alive: Prometheus reuses its connection, so a scrape costs no new connection or thread.
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        # The socket timeout bounds every read and write: an idle keep-alive connection, or a client
        # stalled mid-request, is closed after it (BaseHTTPRequestHandler handles the TimeoutError).
        super().setup()
        self.connection.settimeout(self.server.idle_timeout_s)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        headers = {"Content-Type": "text/plain"}
        if path == "/metrics":
            body, status = self.server.sink.render(), 200
            headers = {"Content-Type": CONTENT_TYPE, "Vary": "Accept-Encoding"}
            if accepts_gzip(self.headers.get("Accept-Encoding")):
                body = self.server.gzipped(body)
                headers["Content-Encoding"] = "gzip"
        elif path == "/":
            body, status = b'eplb metrics: <a href="/metrics">/metrics</a>\n', 200
            headers["Content-Type"] = "text/html"
        else:
            body, status = b"not found\n", 404
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        # One line per scrape on stderr at 20 Hz would drown the server's own logs.
        return None


class MetricsExporter:
    """Serves ``sink.render()`` over HTTP from a background thread; ``port=0`` picks a free port.

    ``idle_timeout_s``: a connection that sends nothing for this long is closed (keep it above the
    scrape interval, or each scrape opens a new connection); ``max_connections``: connections served
    at once, each by a thread (more are answered 503).
    """

    def __init__(
        self,
        sink: PrometheusSink,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        if not 0 < idle_timeout_s < float("inf"):
            raise ValueError(f"idle_timeout_s must be a finite number > 0, got {idle_timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.sink = sink
        self.host = host
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self._requested_port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetricsExporter:
        if self._server is not None:
            return self
        server_class = _Server6 if ":" in self.host else _Server
        try:
            server = server_class(
                (self.host, self._requested_port),
                sink=self.sink,
                idle_timeout_s=self.idle_timeout_s,
                max_connections=self.max_connections,
            )
        except OSError as exc:
            raise ValueError(f"cannot serve metrics on {self.host}:{self._requested_port}: {exc}") from exc
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

    @property
    def open_connections(self) -> int:
        """Connections being served now (each holds one thread)."""
        return 0 if self._server is None else self._server.open_connections

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server, self._thread = None, None
        if server is None:
            return
        server.shutdown()
        server.close_connections()
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
    engine: str = names.DEFAULT_ENGINE,
    model_name: str = names.DEFAULT_MODEL_NAME,
) -> tuple[MetricsSink, MetricsExporter | None]:
    """The sink a rank's manager reports to, and the started exporter (rank 0 with a port only).

    Rank 0 reports the window the manager aggregated over all ranks; other ranks export nothing.
    ``port=None`` disables exporting (a :class:`NullSink` on every rank). ``engine`` and
    ``model_name`` label every series (pass the serving engine's values, so queries join them).
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if port is None or rank != 0:
        names.engine_labels(engine=engine, model_name=model_name)  # the same errors on every rank
        return NullSink(), None
    sink = PrometheusSink(
        hot_experts_per_layer=hot_experts_per_layer,
        per_expert=per_expert,
        engine=engine,
        model_name=model_name,
    )
    exporter = MetricsExporter(sink, host=host, port=port).start()
    return sink, exporter
