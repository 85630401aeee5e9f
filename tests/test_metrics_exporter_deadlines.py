"""MetricsExporter deadlines: a request's head is due within ``request_deadline_s`` however its
bytes trickle in, which closes the connection; refusals never wait; a burst of 200 connections is
served or refused at once. Real sockets on 127.0.0.1, ephemeral ports (hostile clients from
several addresses: tests/test_metrics_exporter_hostile.py).

Client timeouts are several times the server's deadlines, so a loaded machine slows these tests
down but does not fail them; a client timeout is the failure they look for.
"""

from __future__ import annotations

import functools
import http.client
import itertools
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from eplb.metrics.exporter import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_REQUEST_DEADLINE_S,
    MetricsExporter,
)
from eplb.metrics.prometheus import PrometheusSink
from tests.helpers import polling

CLIENT_TIMEOUT_S = 10.0  # what "hanging" means here: far above every server bound under test
wait_until = functools.partial(polling.wait_until, timeout_s=CLIENT_TIMEOUT_S)


def scrape(port: int) -> int:
    """The status of one ``GET /metrics`` on a fresh connection; raises if it hangs or resets."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def request_bytes() -> Iterator[int]:
    """A request whose head never ends: a request line, then one header growing forever."""
    return itertools.chain(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ", itertools.repeat(ord("a")))


def closed_by_server(sock: socket.socket) -> tuple[bool, bytes, bool]:
    """Whether the server ended the connection (without blocking), what it sent before, and
    whether it ended in a reset: a 503 at accept closes without reading the request, so the
    kernel may answer the bytes already sent with a reset that discards the 503 before it is read."""
    received = b""
    while select.select([sock], [], [], 0)[0]:
        try:
            chunk = sock.recv(65536)
        except OSError:
            return True, received, True
        if not chunk:
            return True, received, False
        received += chunk
    return False, received, False


def trickle_until_closed(sock: socket.socket, every_s: float, give_up_s: float) -> float:
    """Send one byte every ``every_s`` until the server closes; the seconds from the first byte."""
    start = time.monotonic()
    for byte in request_bytes():
        if closed_by_server(sock)[0]:
            return time.monotonic() - start
        assert time.monotonic() - start < give_up_s, "the server never closed the trickling connection"
        sock.sendall(bytes([byte]))
        time.sleep(every_s)
    raise AssertionError("unreachable")


class Trickler(threading.Thread):
    """A client that holds a connection by trickling a request head, and reconnects when closed.

    Records how long each connection lasted that the server closed without answering (the deadline);
    connections answered 503 at once (no slot free), or reset before any answer, are counted apart.
    """

    def __init__(self, port: int, every_s: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port, self.every_s, self.stop = port, every_s, stop
        self.lifetimes: list[float] = []
        self.refused = 0

    def run(self) -> None:
        while not self.stop.is_set():
            with socket.create_connection(("127.0.0.1", self.port), timeout=CLIENT_TIMEOUT_S) as sock:
                opened = time.monotonic()
                # What the server sent over the whole connection: a 503 can arrive one check
                # before the end of the stream that follows it.
                received = b""
                for byte in request_bytes():
                    closed, chunk, reset = closed_by_server(sock)
                    received += chunk
                    if closed:
                        if received.startswith(b"HTTP/1.1 503") or (reset and not received):
                            # Refused at accept (the deadline closes in order, after reading every byte).
                            self.refused += 1
                        else:
                            assert not received, received
                            self.lifetimes.append(time.monotonic() - opened)
                        break
                    if self.stop.is_set():
                        return
                    try:
                        sock.sendall(bytes([byte]))
                    except OSError:
                        continue  # closed under us: the next check sees it
                    time.sleep(self.every_s)


@pytest.mark.slow
def test_trickling_clients_do_not_block_a_scrape() -> None:
    # 16 clients trickle one byte each 0.25 s for five deadlines, reconnecting whenever closed. The
    # idle timeout (30 s) restarts at each byte and never fires; the deadline does. No trickler
    # holds a thread, so every scrape meanwhile gets 200.
    deadline_s, every_s, trickle_for_s = 1.0, 0.25, 5.0
    stop = threading.Event()
    with MetricsExporter(PrometheusSink(), request_deadline_s=deadline_s) as exporter:
        assert exporter.idle_timeout_s == DEFAULT_IDLE_TIMEOUT_S > 10 * every_s
        tricklers = [Trickler(exporter.port, every_s, stop) for _ in range(16)]
        try:
            for trickler in tricklers:
                trickler.start()
            wait_until(lambda: exporter.open_connections == 16)
            start = time.monotonic()
            statuses: list[int] = []
            first_served_s: float | None = None
            while time.monotonic() - start < trickle_for_s:
                statuses.append(scrape(exporter.port))  # served or refused, never hanging
                if statuses[-1] == 200 and first_served_s is None:
                    first_served_s = time.monotonic() - start
                time.sleep(0.1)
        finally:
            stop.set()
            for trickler in tricklers:
                trickler.join(timeout=CLIENT_TIMEOUT_S)
        assert set(statuses) == {200}, statuses
        assert first_served_s is not None and first_served_s < 1.0, statuses
        for trickler in tricklers:
            # Each was closed by the deadline at least once, and never before it.
            assert trickler.lifetimes, "a trickling connection outlived the test"
            assert min(trickler.lifetimes) >= 0.9 * deadline_s, trickler.lifetimes
        # Every slot comes back once the tricklers stop.
        wait_until(lambda: exporter.open_connections == 0)
        assert scrape(exporter.port) == 200


def test_a_silent_connection_is_closed_at_the_deadline() -> None:
    # A client that connects and sends nothing holds its slot until the deadline, not the idle timeout.
    with (
        MetricsExporter(PrometheusSink(), request_deadline_s=0.5, idle_timeout_s=30.0) as exporter,
        socket.create_connection(("127.0.0.1", exporter.port), timeout=CLIENT_TIMEOUT_S) as silent,
    ):
        start = time.monotonic()
        wait_until(lambda: exporter.open_connections == 1)
        assert silent.recv(1) == b""
        assert time.monotonic() - start >= 0.45
        wait_until(lambda: exporter.open_connections == 0)


def test_kept_alive_connections_idle_past_the_deadline_and_their_next_request_has_one() -> None:
    # Between scrapes a kept-alive connection waits for the idle timeout (Prometheus scrapes every
    # 15 s or so, longer than the deadline); once the next request's first byte arrives, its head is
    # due within the deadline.
    deadline_s = 0.5
    with MetricsExporter(PrometheusSink(), request_deadline_s=deadline_s, idle_timeout_s=30.0) as exporter:
        conn = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=CLIENT_TIMEOUT_S)
        try:
            socks = []
            for _ in range(2):
                conn.request("GET", "/metrics")
                resp = conn.getresponse()
                resp.read()
                assert resp.status == 200 and not resp.will_close
                socks.append(conn.sock)
                time.sleep(3 * deadline_s)
            assert socks[0] is socks[1] is not None  # one connection served both
            assert conn.sock is not None
            seconds = trickle_until_closed(conn.sock, every_s=0.1, give_up_s=CLIENT_TIMEOUT_S)
            assert seconds >= 0.9 * deadline_s
        finally:
            conn.close()
        wait_until(lambda: exporter.open_connections == 0)


def test_an_eviction_is_answered_even_when_the_request_comes_after_it() -> None:
    # With the cap reached, a newcomer evicts the oldest silent connection: its 503 goes out at
    # once, before that client's request arrives; the server reads and drops that request instead
    # of resetting the connection, so the client reads its 503 rather than ECONNRESET.
    with (
        MetricsExporter(PrometheusSink(), max_connections=1, request_deadline_s=30.0) as exporter,
        socket.create_connection(("127.0.0.1", exporter.port), timeout=CLIENT_TIMEOUT_S) as early,
    ):
        wait_until(lambda: exporter.open_connections == 1)
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=CLIENT_TIMEOUT_S):
            time.sleep(0.3)  # the 503 has been sent by now
            early.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.3)  # the request has reached the server
            answer = b""
            while chunk := early.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 503") and answer.endswith(b"too many open connections")
            assert exporter.open_connections == 1  # the newcomer


def burst(port: int, clients: int) -> list[object]:
    """What each of ``clients`` connections, opened and asking at the same moment, got: a status or an error."""
    barrier = threading.Barrier(clients)
    outcomes: list[object] = [None] * clients

    def client(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = scrape(port)
        except Exception as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=3 * CLIENT_TIMEOUT_S)
    return outcomes


@pytest.mark.parametrize("slots_held", [0, DEFAULT_MAX_CONNECTIONS_PER_CLIENT])
def test_a_burst_of_200_connections_is_served_or_refused_at_once(slots_held: int) -> None:
    # 200 clients connect and ask at the same moment from one address; every one gets 200 or 503,
    # none times out. With the address's cap held by silent clients, those are evicted first.
    with MetricsExporter(PrometheusSink(), request_deadline_s=30.0) as exporter:
        held = [socket.create_connection(("127.0.0.1", exporter.port)) for _ in range(slots_held)]
        try:
            wait_until(lambda: exporter.open_connections == slots_held)
            outcomes = burst(exporter.port, 200)
            for sock in held:
                sock.settimeout(CLIENT_TIMEOUT_S)
                assert sock.recv(65536).startswith(b"HTTP/1.1 503")  # evicted first: the oldest waiting
        finally:
            for sock in held:
                sock.close()
        failures = [o for o in outcomes if o not in (200, 503)]
        assert not failures, failures[:5]
        assert outcomes.count(200) >= DEFAULT_MAX_CONNECTIONS_PER_CLIENT, outcomes
        wait_until(lambda: exporter.open_connections == 0)
        assert scrape(exporter.port) == 200


def test_request_deadline_validation_and_default() -> None:
    assert MetricsExporter(PrometheusSink()).request_deadline_s == DEFAULT_REQUEST_DEADLINE_S
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="request_deadline_s"):
            MetricsExporter(PrometheusSink(), request_deadline_s=bad)
