"""The HTTP endpoint Prometheus scrapes: ``GET /metrics`` on 127.0.0.1 unless told otherwise.

The server runs in its own daemon thread, in the process that holds the manager; a scrape reads
the sink's counters and the cached window text and never waits on the forward path (which only
swaps references under short locks). Each connection gets a thread, so a stalled client does not
stall the next scrape, but both are bounded: a connection idle for ``idle_timeout_s`` is closed; a
request's line and headers must all arrive within ``request_deadline_s`` (from the accept, or from
the first byte of a kept-alive connection's next request), however slowly they trickle in, else the
connection is closed and its slot freed; and past ``max_connections`` open connections a new one is
answered 503 at once, without waiting for its request, so no client can hold threads or sockets
for long. A client that sends ``Accept-Encoding: gzip`` (Prometheus does) gets the text gzipped,
about a tenth of its size.

With several EP ranks only rank 0 exports: :func:`sink_for_rank` gives rank 0 a
:class:`~eplb.metrics.prometheus.PrometheusSink` and a started exporter, and every other rank a
:class:`~eplb.metrics.sink.NullSink`, so the manager can report on every rank unconditionally.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import io
import logging
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

from eplb.metrics import names
from eplb.metrics.prometheus import PrometheusSink
from eplb.metrics.sink import MetricsSink, NullSink

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_IDLE_TIMEOUT_S = 30.0
# Prometheus sends its few hundred bytes of request head in one segment; 5 s leaves a loaded
# host and a slow link ample room while bounding how long a trickling client holds a slot.
DEFAULT_REQUEST_DEADLINE_S = 5.0
DEFAULT_MAX_CONNECTIONS = 16
# A refused connection is kept half-closed this long (or until the client closes) to read and drop
# its request: closing with the request unread would reset the connection, and a reset can lose
# the 503 on its way. At most MAX_LINGERING are kept; past that the oldest is closed at once.
LINGER_S = 2.0
MAX_LINGERING = 256
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
    """One daemon thread per connection, at most ``max_connections`` at a time; tracks them to close.

    Refusals are answered in the accept loop without blocking it, and linger there (see
    :meth:`_refuse`) until the client has read them.
    """

    daemon_threads = True
    block_on_close = False  # stop() closes the connections itself instead of waiting for them
    # A burst of connections waits in the kernel's queue for the accept loop (the OS caps this at
    # its own limit); with the default of 5, the rest are dropped and their clients retry the
    # handshake seconds later, or time out.
    request_queue_size = socket.SOMAXCONN

    def __init__(
        self,
        address: tuple[str, int],
        *,
        sink: PrometheusSink,
        idle_timeout_s: float,
        request_deadline_s: float,
        max_connections: int,
    ) -> None:
        self.sink = sink
        self.idle_timeout_s = idle_timeout_s
        self.request_deadline_s = request_deadline_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: dict[socket.socket, float] = {}  # connection -> when it was accepted
        self._open_lock = threading.Lock()
        # Refused connections: (when to close at the latest, socket), oldest first.
        self._lingering: collections.deque[tuple[float, socket.socket]] = collections.deque()
        self._lingering_lock = threading.Lock()
        self._last_sweep = 0.0
        self._gzip_lock = threading.Lock()
        self._gzipped: tuple[bytes, bytes] = (b"", gzip.compress(b"", compresslevel=GZIP_LEVEL))
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        with self._open_lock:
            self._open[request] = time.monotonic()
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
                self._open.pop(request, None)
            self._slots.release()

    def accepted_at(self, request: socket.socket) -> float:
        """When ``request`` was accepted (``time.monotonic()``): its first request's deadline counts from it."""
        with self._open_lock:
            return self._open[request]

    def _refuse(self, request: socket.socket) -> None:
        """Answer 503 at once, and keep the socket half-closed to drop the request when it comes.

        Runs in the accept loop, so it never waits: the request may not have arrived yet, and the
        next connection of a burst is already queued. The 503 and the end of the stream are sent
        now; :meth:`service_actions` reads and drops whatever the client sends and closes the
        socket once the client has closed its end, or after ``LINGER_S``.
        """
        try:
            request.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                request.recv(65536)
            request.send(_BUSY)  # a fresh socket's send buffer takes these 150 bytes whole
            request.shutdown(socket.SHUT_WR)
        except OSError:
            request.close()  # the client is gone already
            return
        with self._lingering_lock:
            self._lingering.append((time.monotonic() + LINGER_S, request))
            overflow = [self._lingering.popleft()[1] for _ in range(len(self._lingering) - MAX_LINGERING)]
        for sock in overflow:
            sock.close()

    def service_actions(self) -> None:
        """Close refused connections whose client has closed (or that lingered ``LINGER_S``).

        serve_forever calls this after every accept and at least every poll interval; a burst of
        accepts would sweep the whole list each time, so sweeps are at most every 50 ms.
        """
        now = time.monotonic()
        if now - self._last_sweep < 0.05:
            return
        self._last_sweep = now
        with self._lingering_lock:
            keep: collections.deque[tuple[float, socket.socket]] = collections.deque()
            for due, sock in self._lingering:
                try:
                    done = due <= now or not sock.recv(65536)  # b"": the client has closed
                except BlockingIOError:
                    done = False  # nothing more sent yet
                except OSError:
                    done = True
                if done:
                    sock.close()
                else:
                    keep.append((due, sock))
            self._lingering = keep

    def server_close(self) -> None:
        super().server_close()
        with self._lingering_lock:
            lingering = list(self._lingering)
            self._lingering.clear()
        for _, sock in lingering:
            sock.close()

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


class _RequestReader(io.RawIOBase):
    """A connection's reads, each bounded by the idle timeout and by the request head's deadline.

    A socket timeout alone restarts at every byte, so a client trickling one byte at a time could
    hold its connection, and its slot, forever. Here each read also waits at most until the head of
    the request being read is due: ``request_deadline_s`` after the accept for a connection's first
    request; for the next one on a kept-alive connection, the wait for its first byte is an idle
    wait (a scrape interval is longer than the deadline), and the head is due from that byte on.
    A read past the deadline raises ``TimeoutError``, which closes the connection.
    """

    def __init__(
        self, sock: socket.socket, *, idle_timeout_s: float, request_deadline_s: float, accepted_at: float
    ) -> None:
        super().__init__()
        self._sock = sock
        self._idle_timeout_s = idle_timeout_s
        self._request_deadline_s = request_deadline_s
        self._due: float | None = accepted_at + request_deadline_s
        self._awaiting_first_byte = False

    def readable(self) -> bool:
        return True

    def next_request(self) -> None:
        """The previous request is answered: wait for the next one's first byte as long as idle."""
        self._due, self._awaiting_first_byte = None, True

    def head_read(self) -> None:
        """The request line and headers are in: later reads (none for a GET) have no deadline."""
        self._due, self._awaiting_first_byte = None, False

    def readinto(self, buffer: WriteableBuffer, /) -> int:
        timeout = self._idle_timeout_s
        if self._due is not None:
            # Past the deadline, one last look without waiting: a head that did arrive in time is
            # still read on a host too loaded to have run this thread sooner.
            timeout = min(timeout, max(self._due - time.monotonic(), 0.0))
        try:
            self._sock.settimeout(timeout)
            received = self._sock.recv_into(buffer)
        except BlockingIOError:
            raise TimeoutError("request head not complete by its deadline") from None
        finally:
            self._sock.settimeout(self._idle_timeout_s)  # what the response's writes wait at most
        if received and self._awaiting_first_byte:
            self._due, self._awaiting_first_byte = time.monotonic() + self._request_deadline_s, False
        return received


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # Keep-alive: Prometheus reuses its connection, so a scrape costs no new connection or thread.
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        # The socket timeout bounds every read and write: an idle keep-alive connection, or a client
        # stalled mid-request, is closed after it (BaseHTTPRequestHandler handles the TimeoutError).
        # Reads go through a _RequestReader, which also keeps each request head's deadline.
        super().setup()
        self.connection.settimeout(self.server.idle_timeout_s)
        self.rfile.close()  # the plain reader setup() made; the socket stays open
        self._reader = _RequestReader(
            self.connection,
            idle_timeout_s=self.server.idle_timeout_s,
            request_deadline_s=self.server.request_deadline_s,
            accepted_at=self.server.accepted_at(self.connection),
        )
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        super().handle_one_request()
        self._reader.next_request()

    def parse_request(self) -> bool:
        # Reads the headers (after the request line): the head is complete once it returns.
        try:
            return super().parse_request()
        finally:
            self._reader.head_read()

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
    scrape interval, or each scrape opens a new connection); ``request_deadline_s``: a request's line
    and headers must all arrive within this long, counted from the accept (or, on a kept-alive
    connection, from the request's first byte), however slowly they trickle in, else the connection
    is closed and its slot freed; ``max_connections``: connections served at once, each by a thread
    (more are answered 503 at once).
    """

    def __init__(
        self,
        sink: PrometheusSink,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        request_deadline_s: float = DEFAULT_REQUEST_DEADLINE_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        if not 0 < idle_timeout_s < float("inf"):
            raise ValueError(f"idle_timeout_s must be a finite number > 0, got {idle_timeout_s}")
        if not 0 < request_deadline_s < float("inf"):
            raise ValueError(f"request_deadline_s must be a finite number > 0, got {request_deadline_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.sink = sink
        self.host = host
        self.idle_timeout_s = idle_timeout_s
        self.request_deadline_s = request_deadline_s
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
                request_deadline_s=self.request_deadline_s,
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
