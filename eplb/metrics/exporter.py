"""The HTTP endpoint Prometheus scrapes: ``GET /metrics`` on 127.0.0.1 unless told otherwise.

The server runs in the process that holds the manager: one event-loop thread owns every socket
and a few worker threads only render answers; a scrape reads the sink's counters and the cached
window text and never waits on the forward path (which only swaps references under short locks).

No client can hold a thread: the loop reads request heads and writes answers without blocking,
and a worker gets a connection only once its whole head is in, for the milliseconds a render
takes. Requests waiting for a worker are queued per client (source address) and taken in turn,
so one client's burst cannot take every worker. Each connection is bounded:

- its request head (line and headers) to ``max_head_bytes`` and ``max_head_lines`` in all
  (``431`` past either), and a malformed one is answered ``400``;
- the whole request, head in and answer out, to ``request_deadline_s`` from the accept (or, on a
  kept-alive connection, from the next request's first byte), however slowly it trickles;
- the wait between requests of a kept-alive connection to ``idle_timeout_s``.

Open connections are capped per client (``max_connections_per_client``) and in all
(``max_connections``). A connection past a cap evicts the oldest connection still waiting for its
request, taken from the client holding the most (the newcomer's own when that is its client), and
that one is answered ``503``; only when nothing can be evicted is the newcomer answered ``503``.
A client that reconnects after each cut-off thus only ever replaces its own connections, and a
scrape, whose head arrives in one segment, is in a worker's queue before anyone could evict it.
A client that sends ``Accept-Encoding: gzip`` (Prometheus does) gets the text gzipped, about a
tenth of its size.

With several EP ranks only rank 0 exports: :func:`sink_for_rank` gives rank 0 a
:class:`~eplb.metrics.prometheus.PrometheusSink` and a started exporter, and every other rank a
:class:`~eplb.metrics.sink.NullSink`, so the manager can report on every rank unconditionally.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import gzip
import io
import logging
import selectors
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import Any

from eplb.metrics import names
from eplb.metrics.prometheus import PrometheusSink
from eplb.metrics.sink import MetricsSink, NullSink

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_IDLE_TIMEOUT_S = 30.0
# Prometheus sends its few hundred bytes of request head in one segment and reads a 23 kB answer;
# 5 s leaves a loaded host and a slow link ample room while bounding how long a trickling client
# holds a connection.
DEFAULT_REQUEST_DEADLINE_S = 5.0
# Open connections cost a socket and a few kB, never a thread: a few Prometheus servers, browsers
# and curl need a handful; the caps only bound what a hostile client can hold.
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 32
# Prometheus' request head is about 200 bytes; a browser's with cookies a few kB.
DEFAULT_MAX_HEAD_BYTES = 16384
DEFAULT_MAX_HEAD_LINES = 64
# Rendering holds the GIL except while gzipping, so more workers would only queue on it.
DEFAULT_WORKERS = 2
# A refused or errored connection is kept half-closed this long (or until the client closes) to
# read and drop what it sends: closing with data unread would reset the connection, and a reset can
# lose the answer on its way. At most MAX_LINGERING are kept; past that the oldest is closed at once.
LINGER_S = 2.0
MAX_LINGERING = 256
# Accepts per turn of the loop: heads already received are read before more connections come in,
# so a burst of connections cannot push a waiting scrape towards eviction.
ACCEPTS_PER_TURN = 16
# Deadlines are checked at least this often (and the loop wakes for nothing else).
SWEEP_S = 0.05
# Level 1: a DeepSeek-V3-sized scrape (240 kB) compresses 10x in 0.4 ms; level 6 saves 15% more
# bytes for three times the CPU, level 9 ten times.
GZIP_LEVEL = 1


def _plain(status: str, text: str) -> bytes:
    body = text.encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        + ("Retry-After: 1\r\n" if status.startswith("503") else "")
        + "Connection: close\r\n\r\n"
    ).encode() + body


_BUSY = _plain("503 Service Unavailable", "too many open connections")
_TOO_LARGE = _plain("431 Request Header Fields Too Large", "request head too large")


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


class _State(enum.Enum):
    READING = "reading"  # waiting for (the rest of) a request head, or idle between requests
    QUEUED = "queued"  # head complete: waiting for a worker, or being answered by one
    WRITING = "writing"  # the answer is going out


class _Conn:
    """One open connection and where its current request stands; touched by the loop thread only
    (a worker sees it only between taking it from the queue and handing its answer back)."""

    def __init__(self, sock: socket.socket, address: Any, *, now: float, deadline_s: float) -> None:
        self.sock = sock
        self.address = address
        self.client: str = str(address[0])  # the source address: what the per-client caps count
        self.state = _State.READING
        self.buffer = bytearray()
        self.idle = False  # READING with no byte of the next request yet: due at the idle timeout
        self.since = now  # when it started waiting in its state (eviction takes the oldest READING)
        self.due = now + deadline_s
        self.active = now  # the last byte read or written: none for idle_timeout_s closes it too
        self.head = b""
        self.answer = memoryview(b"")
        self.close_after = True


def _head_end(buffer: bytearray) -> int:
    """Where the request head in ``buffer`` ends (after its empty line), or -1 if it has not yet."""
    ends = [i + n for i, n in ((buffer.find(b"\r\n\r\n"), 4), (buffer.find(b"\n\n"), 2)) if i >= 0]
    return min(ends) if ends else -1


class _Server:
    """The event loop (one thread: accepts, reads heads, writes answers, keeps deadlines and caps)
    and the worker threads that turn a complete head into an answer."""

    def __init__(self, exporter: MetricsExporter) -> None:
        self.sink = exporter.sink
        self.idle_timeout_s = exporter.idle_timeout_s
        self.request_deadline_s = exporter.request_deadline_s
        self.max_connections = exporter.max_connections
        self.max_per_client = exporter.max_connections_per_client
        self.max_head_bytes = exporter.max_head_bytes
        self.max_head_lines = exporter.max_head_lines
        family = socket.AF_INET6 if ":" in exporter.host else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind((exporter.host, exporter.requested_port))
            # A burst waits in the kernel's queue for the loop (the OS caps this at its own limit);
            # with a queue of 5 the rest would be dropped and retry the handshake seconds later.
            self.listener.listen(socket.SOMAXCONN)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            raise
        self.port = int(self.listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[socket.socket, _Conn] = {}
        self._by_client: dict[str, dict[_Conn, None]] = {}
        self._count_lock = threading.Lock()  # open_connections is read from other threads
        # Refused connections: (when to close at the latest, socket), oldest first.
        self._lingering: collections.OrderedDict[socket.socket, float] = collections.OrderedDict()
        self._last_sweep = 0.0
        self._stopping = False
        # Complete heads waiting for a worker, per client in arrival order; clients take turns.
        self._queue: collections.OrderedDict[str, collections.deque[_Conn]] = collections.OrderedDict()
        self._queue_cv = threading.Condition()
        self._answered: collections.deque[_Conn] = collections.deque()  # workers -> loop
        self._gzip_lock = threading.Lock()
        self._gzipped: tuple[bytes, bytes] = (b"", gzip.compress(b"", compresslevel=GZIP_LEVEL))
        self._threads = [threading.Thread(target=self._serve, name="eplb-metrics", daemon=True)] + [
            threading.Thread(target=self._work, name=f"eplb-metrics-worker-{i}", daemon=True)
            for i in range(exporter.workers)
        ]

    # -- life cycle (other threads) ---------------------------------------------------------

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """End the loop and the workers; every open connection is closed."""
        self._stopping = True
        with self._queue_cv:
            self._queue_cv.notify_all()
        self._wake()
        for thread in self._threads:
            thread.join(timeout=5.0)

    @property
    def open_connections(self) -> int:
        with self._count_lock:
            return len(self._conns)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (the loop wakes anyway) or closed (stopping)
            self._wake_w.send(b"x")

    # -- the event loop ---------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._turn()
                except Exception:  # a bug must not end the endpoint: log it and go on
                    log.exception("metrics server loop error")
                    time.sleep(SWEEP_S)
        finally:
            self._close_everything()

    def _turn(self) -> None:
        events = self._selector.select(self._until_next_deadline())
        accept = False
        for key, mask in events:
            if key.data == "listener":
                accept = True
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            elif key.data == "linger":
                self._drain_lingering(key.fileobj)  # type: ignore[arg-type]
            else:
                conn: _Conn = key.data
                try:
                    if mask & selectors.EVENT_READ and conn.state is _State.READING:
                        self._read(conn)
                    elif mask & selectors.EVENT_WRITE and conn.state is _State.WRITING:
                        self._write(conn)
                except Exception:
                    log.debug("metrics connection from %s ended with an error", conn.address, exc_info=True)
                    self._drop(conn)
        while self._answered:
            conn = self._answered.popleft()
            if conn.sock in self._conns:
                self._start_writing(conn)
        if accept:
            self._accept()
        self._sweep()

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, address = self.listener.accept()
            except BlockingIOError:
                return
            except OSError:  # out of file descriptors, say: try again on a later turn
                log.debug("metrics accept failed", exc_info=True)
                time.sleep(SWEEP_S)
                return
            sock.setblocking(False)
            conn = _Conn(sock, address, now=time.monotonic(), deadline_s=self.request_deadline_s)
            if not self._make_room(conn.client):
                self._refuse(sock, _BUSY)
                continue
            self._add(conn)
            self._read(conn)  # the head is often in already

    def _make_room(self, client: str) -> bool:
        """Evict a connection if ``client``'s new one would pass a cap; False if none can go."""
        held = len(self._by_client.get(client, ()))
        if held >= self.max_per_client:
            victim = self._oldest_waiting(client)
        elif len(self._conns) >= self.max_connections:
            # The client holding the most (counting the newcomer), ties to the oldest waiting one.
            best: tuple[int, float] | None = None
            victim = None
            for other, conns in self._by_client.items():
                oldest = self._oldest_waiting(other)
                if oldest is None:
                    continue
                rank = (len(conns) + (other == client), -oldest.since)
                if best is None or rank > best:
                    best, victim = rank, oldest
        else:
            return True
        if victim is None:
            return False
        self._remove(victim)
        self._refuse(victim.sock, _BUSY)
        return True

    def _oldest_waiting(self, client: str) -> _Conn | None:
        waiting = [c for c in self._by_client.get(client, ()) if c.state is _State.READING]
        return min(waiting, key=lambda c: c.since) if waiting else None

    def _add(self, conn: _Conn) -> None:
        with self._count_lock:
            self._conns[conn.sock] = conn
        self._by_client.setdefault(conn.client, {})[conn] = None
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _remove(self, conn: _Conn) -> None:
        """Forget ``conn`` (the caller closes or refuses its socket)."""
        with self._count_lock:
            self._conns.pop(conn.sock, None)
        held = self._by_client.get(conn.client)
        if held is not None:
            held.pop(conn, None)
            if not held:
                del self._by_client[conn.client]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)

    def _drop(self, conn: _Conn) -> None:
        self._remove(conn)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)  # the client closed
            return
        now = time.monotonic()
        conn.active = now
        if conn.idle:  # the next request's first byte: its deadline starts now
            conn.idle, conn.since, conn.due = False, now, now + self.request_deadline_s
        conn.buffer += data
        self._parse(conn)

    def _parse(self, conn: _Conn) -> None:
        """Hand a complete head to the workers, refuse one past the bounds, or wait for more."""
        end = _head_end(conn.buffer)
        head = conn.buffer if end < 0 else conn.buffer[:end]
        if len(head) > self.max_head_bytes or head.count(b"\n") > self.max_head_lines:
            self._remove(conn)
            self._refuse(conn.sock, _TOO_LARGE)
            return
        if end < 0:
            return
        conn.head = bytes(head)
        # Anything after the head (a pipelined request) waits in the buffer for the next turn.
        del conn.buffer[:end]
        conn.state = _State.QUEUED
        self._selector.unregister(conn.sock)  # nothing more is read until this one is answered
        with self._queue_cv:
            self._queue.setdefault(conn.client, collections.deque()).append(conn)
            self._queue_cv.notify()

    def _start_writing(self, conn: _Conn) -> None:
        if not conn.answer:  # the handler wrote nothing (an empty or unreadable request line)
            self._remove(conn)
            self._refuse(conn.sock, b"")
            return
        conn.state = _State.WRITING
        self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.answer)
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        conn.answer = conn.answer[sent:]
        conn.active = time.monotonic()
        if conn.answer:
            return
        if conn.close_after:
            self._remove(conn)
            self._refuse(conn.sock, b"")  # the answer is out: end the stream, drop what follows
            return
        now = time.monotonic()
        conn.state, conn.since = _State.READING, now
        self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
        if conn.buffer:  # a pipelined request: its deadline starts now
            conn.idle, conn.due = False, now + self.request_deadline_s
            self._parse(conn)
        else:
            conn.idle, conn.due = True, now + self.idle_timeout_s

    def _refuse(self, sock: socket.socket, answer: bytes) -> None:
        """Send ``answer`` (a fresh socket's send buffer takes it whole), end the stream, and keep the
        socket half-closed to drop what the client still sends, until it closes or ``LINGER_S``."""
        try:
            with contextlib.suppress(BlockingIOError):
                sock.recv(65536)
            if answer:
                sock.send(answer)
            sock.shutdown(socket.SHUT_WR)
            self._selector.register(sock, selectors.EVENT_READ, "linger")
        except (OSError, ValueError, KeyError):
            sock.close()  # the client is gone already
            return
        self._lingering[sock] = time.monotonic() + LINGER_S
        while len(self._lingering) > MAX_LINGERING:
            self._close_lingering(next(iter(self._lingering)))

    def _drain_lingering(self, sock: socket.socket) -> None:
        try:
            done = not sock.recv(65536)  # b"": the client has closed
        except BlockingIOError:
            done = False
        except OSError:
            done = True
        if done:
            self._close_lingering(sock)

    def _close_lingering(self, sock: socket.socket) -> None:
        self._lingering.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()

    def _until_next_deadline(self) -> float | None:
        """How long the loop may wait for events: until the nearest deadline (no sooner than
        ``SWEEP_S``, the sweep's granularity), or for good when none runs, so an idle endpoint or
        one idle keep-alive connection costs the serving process no periodic wake-ups."""
        if self._answered:
            return 0.0
        dues = list(self._lingering.values())
        idle_s = self.idle_timeout_s
        dues += [min(c.due, c.active + idle_s) for c in self._conns.values() if c.state is not _State.QUEUED]
        if not dues:
            return None
        return max(SWEEP_S, min(dues) - time.monotonic())

    def _sweep(self) -> None:
        """Close what is past its deadline: heads and answers (silently), idle keep-alives, lingerers."""
        now = time.monotonic()
        if now - self._last_sweep < SWEEP_S:
            return
        self._last_sweep = now
        idle_since = now - self.idle_timeout_s
        for conn in [
            c
            for c in self._conns.values()
            if c.state is not _State.QUEUED and (c.due <= now or c.active <= idle_since)
        ]:
            self._drop(conn)
        while self._lingering:
            sock, due = next(iter(self._lingering.items()))
            if due > now:
                break
            self._close_lingering(sock)

    def _close_everything(self) -> None:
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
            self._drop(conn)
        for sock in list(self._lingering):
            self._close_lingering(sock)
        self._selector.close()
        for sock in (self.listener, self._wake_r, self._wake_w):
            sock.close()

    # -- the workers ------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._queue_cv:
                while not self._queue and not self._stopping:
                    self._queue_cv.wait()
                if self._stopping:
                    return
                client, waiting = next(iter(self._queue.items()))
                conn = waiting.popleft()
                if waiting:
                    self._queue.move_to_end(client)  # the next client's turn
                else:
                    del self._queue[client]
            try:
                answer, close_after = _Handler.answer(conn.head, conn.address, self)
            except Exception:  # never a dead worker: the connection is closed unanswered
                log.exception("metrics request from %s failed", conn.address)
                answer, close_after = b"", True
            conn.answer, conn.close_after = memoryview(answer), close_after
            self._answered.append(conn)
            self._wake()

    def gzipped(self, body: bytes) -> bytes:
        """``body`` gzipped; the last result is reused while the text does not change (an idle server)."""
        with self._gzip_lock:
            last_body, last = self._gzipped
            if body != last_body:
                last = gzip.compress(body, compresslevel=GZIP_LEVEL)
                self._gzipped = (body, last)
            return last


class _Handler(BaseHTTPRequestHandler):
    """Parses one complete request head (http.server's rules: ``400`` if malformed, ``501`` for a
    method other than GET) and writes its answer into a buffer the loop sends."""

    server: _Server  # type: ignore[assignment]
    # Keep-alive: Prometheus reuses its connection, so a scrape costs no new connection.
    protocol_version = "HTTP/1.1"
    # Errors in a request line too broken to name its version get a status line too (HTTP/0.9's
    # bare body would read as garbage to any client today).
    default_request_version = "HTTP/1.0"

    def __init__(self, head: bytes, client_address: Any, server: _Server) -> None:
        # Not BaseRequestHandler's __init__: there is no socket here to set up, read or finish.
        self.client_address = client_address
        self.server = server
        self.rfile = io.BytesIO(head)
        self.out = io.BytesIO()
        self.wfile = self.out
        self.close_connection = True

    @classmethod
    def answer(cls, head: bytes, client_address: Any, server: _Server) -> tuple[bytes, bool]:
        """The bytes answering ``head``, and whether the connection closes after them."""
        handler = cls(head, client_address, server)
        handler.handle_one_request()
        return handler.out.getvalue(), handler.close_connection

    def do_GET(self) -> None:
        if self.headers.get("Content-Length", "0").strip() != "0" or "Transfer-Encoding" in self.headers:
            self.close_connection = True  # a body is never read: close rather than parse it as a request
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
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        # One line per scrape on stderr at 20 Hz would drown the server's own logs.
        return None


class MetricsExporter:
    """Serves ``sink.render()`` over HTTP from background threads; ``port=0`` picks a free port.

    ``idle_timeout_s``: a kept-alive connection that sends nothing for this long is closed (keep it
    above the scrape interval, or each scrape opens a new connection); ``request_deadline_s``: a
    request's line and headers must arrive and its answer go out within this long, counted from the
    accept (or, on a kept-alive connection, from the request's first byte), however slowly either
    trickles, else the connection is closed; ``max_connections`` and
    ``max_connections_per_client``: open connections in all and per source address (past a cap, the
    oldest connection still waiting for its request is evicted from the client holding the most,
    else the newcomer is answered 503); ``max_head_bytes`` and ``max_head_lines``: the request
    line and headers in all (431 past either); ``workers``: threads rendering answers.
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
        max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
        max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
        max_head_lines: int = DEFAULT_MAX_HEAD_LINES,
        workers: int = DEFAULT_WORKERS,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        if not 0 < idle_timeout_s < float("inf"):
            raise ValueError(f"idle_timeout_s must be a finite number > 0, got {idle_timeout_s}")
        if not 0 < request_deadline_s < float("inf"):
            raise ValueError(f"request_deadline_s must be a finite number > 0, got {request_deadline_s}")
        for name, value, least in (
            ("max_connections", max_connections, 1),
            ("max_connections_per_client", max_connections_per_client, 1),
            ("max_head_bytes", max_head_bytes, 64),  # room for a request line and a Host header
            ("max_head_lines", max_head_lines, 2),
            ("workers", workers, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.sink = sink
        self.host = host
        self.idle_timeout_s = idle_timeout_s
        self.request_deadline_s = request_deadline_s
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.max_head_bytes = max_head_bytes
        self.max_head_lines = max_head_lines
        self.workers = workers
        self.requested_port = port
        self._server: _Server | None = None

    def start(self) -> MetricsExporter:
        if self._server is not None:
            return self
        try:
            server = _Server(self)
        except OSError as exc:
            raise ValueError(f"cannot serve metrics on {self.host}:{self.requested_port}: {exc}") from exc
        server.start()
        self._server = server
        return self

    @property
    def port(self) -> int:
        """The bound port (the free one the OS chose when constructed with ``port=0``)."""
        if self._server is None:
            raise RuntimeError("exporter not started")
        return self._server.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def open_connections(self) -> int:
        """Connections open now (refused ones draining their last bytes not counted)."""
        return 0 if self._server is None else self._server.open_connections

    def stop(self) -> None:
        """Stop serving: the port is freed and every open connection closed."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()

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
