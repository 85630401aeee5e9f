"""MetricsExporter under hostile clients: reconnecting tricklers and a burst do not starve scrapes,
the whole request head is bounded, the per-client and overall caps evict the oldest waiting
connection of the client holding the most. Real sockets; the attackers run in a process of their
own (tests/helpers/hostile_clients.py), from 127.0.0.2, 127.0.0.3, ... (all the loopback on Linux)
unless a case puts everyone on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time

import numpy as np
import pytest

from eplb.metrics.exporter import DEFAULT_MAX_HEAD_BYTES, DEFAULT_MAX_HEAD_LINES, MetricsExporter
from eplb.metrics.prometheus import PrometheusSink
from tests.helpers import polling
from tests.helpers.hostile_clients import Attack, ask, connect, scrape_under_attack

CLIENT_TIMEOUT_S = 10.0
wait_until = functools.partial(polling.wait_until, timeout_s=CLIENT_TIMEOUT_S)
ATTACKERS = [f"127.0.0.{i}" for i in range(2, 22)]


def loopback_sources_work() -> bool:
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            with connect(server.getsockname()[1], "127.0.0.2", timeout_s=2.0):
                return server.accept()[1][0] == "127.0.0.2"
    except OSError:
        return False


needs_loopback_sources = pytest.mark.skipif(
    not loopback_sources_work(), reason="cannot connect from 127.0.0.2 (not Linux's 127.0.0.0/8 loopback)"
)


@needs_loopback_sources
@pytest.mark.parametrize(
    ("sources", "tricklers", "caps"),
    [
        pytest.param(ATTACKERS, 20, {}, id="attackers-apart"),
        pytest.param(["127.0.0.1"], 20, {}, id="all-on-127.0.0.1"),
        # Three tricklers per address against caps of 4 per client and 24 in all: every reconnect
        # evicts, and the scraper (holding the fewest) is never the one evicted.
        pytest.param(ATTACKERS, 60, {"max_connections": 24, "max_connections_per_client": 4}, id="caps-full"),
    ],
)
def test_scrapes_are_answered_under_reconnecting_tricklers_and_a_burst(
    sources: list[str], tricklers: int, caps: dict[str, int]
) -> None:
    # The trickled heads are cut at a 1 s deadline and reconnect at once, for 4 s, with a burst of
    # 200 connections halfway; a scrape every 0.1 s from 127.0.0.1 must be answered within 1 s.
    # Meanwhile the sink's writer hands over DeepSeek-V3-sized windows and is never held up.
    sink = PrometheusSink()
    rng = np.random.default_rng(0)
    load_LE, gpu_LG = rng.random((58, 256)), rng.random((58, 32))
    stop, slowest_s = threading.Event(), [0.0]

    def writer() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            sink.on_window(logical_load_LE=load_LE, gpu_load_LG=gpu_LG)
            sink.on_forward_pass(kind="decode", recorded=True)
            slowest_s[0] = max(slowest_s[0], time.perf_counter() - t0)
            time.sleep(0.01)

    thread = threading.Thread(target=writer, daemon=True)
    with MetricsExporter(sink, request_deadline_s=1.0, **caps) as exporter:
        thread.start()
        try:
            # 4 s: 40 scrapes, so the one or two that a same-address burst can cost stay within 5%.
            attack = Attack(sources=sources, tricklers=tricklers, duration_s=4.0, burst_at_s=2.0)
            seen = scrape_under_attack(exporter.port, attack)
        finally:
            stop.set()
            thread.join(timeout=CLIENT_TIMEOUT_S)
        assert seen.answered >= 0.95, (seen.statuses, seen.attack)
        assert len(seen.statuses) >= 30  # a scrape every 0.1 s for 4 s, none hanging
        # The attack happened as meant: every trickler was cut off and came back, the burst got
        # answers (served, or refused at once) and no connection was left to time out.
        assert seen.attack["reconnects"] >= tricklers and seen.attack["connect_errors"] == 0, seen.attack
        burst = seen.attack["burst"]
        assert set(burst) <= {"200", "503"} and sum(burst.values()) == 200, burst
        if caps:
            assert seen.attack["refused_503"] > 0  # evictions did happen
        else:
            assert burst.get("200", 0) >= 32  # the per-client cap, at least, is served
        assert slowest_s[0] < 0.5, slowest_s  # on_window never waits on a scrape (a few µs alone)
        wait_until(lambda: exporter.open_connections == 0)
        assert ask(exporter.port, "127.0.0.1", CLIENT_TIMEOUT_S) == 200


def send_head(port: int, head: bytes) -> bytes:
    """Everything the server sends back for ``head`` (sent whole), up to its end of stream."""
    with connect(port, "127.0.0.1", CLIENT_TIMEOUT_S) as sock:
        with contextlib.suppress(OSError):  # refused before the whole head went out: the answer waits
            sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def lines_head(count: int, length: int) -> bytes:
    header = b"X-Pad: " + b"a" * (length - 9) + b"\r\n"
    return b"GET /metrics HTTP/1.1\r\nConnection: close\r\n" + header * count + b"\r\n"


def test_the_whole_request_head_is_bounded() -> None:
    with MetricsExporter(PrometheusSink()) as exporter:
        # Many 60 KB lines, 1 MB in all (each line under http.server's own 64 KB limit): refused.
        big = lines_head(17, 60_000)
        assert len(big) > 1_000_000
        start = time.monotonic()
        assert send_head(exporter.port, big).startswith(b"HTTP/1.1 431 ")
        assert time.monotonic() - start < 3.0
        # Too many short lines, or too many bytes in a few lines: refused too.
        assert send_head(exporter.port, lines_head(DEFAULT_MAX_HEAD_LINES, 20)).startswith(b"HTTP/1.1 431 ")
        assert send_head(exporter.port, lines_head(2, DEFAULT_MAX_HEAD_BYTES // 2)).startswith(
            b"HTTP/1.1 431 "
        )
        # Just inside both bounds: served.
        inside = lines_head(
            DEFAULT_MAX_HEAD_LINES - 4, (DEFAULT_MAX_HEAD_BYTES - 64) // (DEFAULT_MAX_HEAD_LINES - 4)
        )
        assert len(inside) <= DEFAULT_MAX_HEAD_BYTES
        assert send_head(exporter.port, inside).startswith(b"HTTP/1.1 200 ")
        assert exporter.open_connections == 0
    # The bound is what refused it: raised, the same 1 MB head is served.
    with MetricsExporter(PrometheusSink(), max_head_bytes=2_000_000) as exporter:
        assert send_head(exporter.port, big).startswith(b"HTTP/1.1 200 ")


def test_malformed_requests_and_other_methods() -> None:
    with MetricsExporter(PrometheusSink()) as exporter:
        for head in (
            b"nonsense\r\n\r\n",
            b"GET /metrics HTTP/9\r\n\r\n",
            b"GET /metrics HTTP/1.1 extra\r\n\r\n",
        ):
            assert send_head(exporter.port, head).startswith(b"HTTP/1.1 400 "), head
        assert send_head(exporter.port, b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
            b"HTTP/1.1 501 "
        )
        # A body is never read as the next request: answered, then closed.
        answer = send_head(
            exporter.port, b"GET /metrics HTTP/1.1\r\nContent-Length: 30\r\n\r\nGET /x HTTP/1.1\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1") == 1
        assert b"Connection: close" in answer
        # Pipelined requests are answered in order on one connection; a bare \n ends a head too.
        answer = send_head(
            exporter.port, b"GET /nope HTTP/1.1\n\nGET / HTTP/1.1\r\nConnection: close\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 404 ") and answer.count(b"HTTP/1.1 200 ") == 1
        assert exporter.open_connections == 0
        assert ask(exporter.port, "127.0.0.1", CLIENT_TIMEOUT_S) == 200


def evicted(sock: socket.socket) -> bool:
    """Whether the server answered ``sock`` 503 and ended it (without waiting)."""
    sock.settimeout(0.05)
    try:
        answer = sock.recv(65536)
    except TimeoutError:
        return False
    return answer.startswith(b"HTTP/1.1 503 ")


@needs_loopback_sources
def test_caps_evict_the_oldest_waiting_connection_of_the_client_holding_the_most() -> None:
    with MetricsExporter(
        PrometheusSink(), max_connections=5, max_connections_per_client=3, request_deadline_s=30.0
    ) as exporter:
        port = exporter.port
        socks: list[tuple[str, socket.socket]] = []  # every one opened, in order

        def open_from(source: str, expected: int) -> socket.socket:
            # Each opened once the previous is in, so "oldest" is well defined; ``expected``: the
            # connections the server holds after it.
            sock = connect(port, source, CLIENT_TIMEOUT_S)
            socks.append((source, sock))
            wait_until(lambda: exporter.open_connections == expected)
            time.sleep(0.01)
            return sock

        try:
            a1, a2, a3 = (open_from("127.0.0.2", n) for n in (1, 2, 3))
            # Past its own cap, a client replaces its oldest connection, not another client's.
            a4 = open_from("127.0.0.2", 3)
            assert evicted(a1) and not any(evicted(s) for s in (a2, a3, a4))
            a1.close()
            b1 = open_from("127.0.0.3", 4)
            c1 = open_from("127.0.0.4", 5)  # five open: every cap reached
            # A sixth from a client holding one: the oldest of the client holding three goes.
            d1 = open_from("127.0.0.5", 5)
            assert evicted(a2) and not any(evicted(s) for s in (a3, a4, b1, c1, d1))
            a2.close()
            # The newcomer's own client counts with it: 127.0.0.3 would hold 2, as many as
            # 127.0.0.2; on a tie the client with the oldest waiting connection gives it up.
            b2 = open_from("127.0.0.3", 5)
            assert evicted(a3) and not any(evicted(s) for s in (a4, b1, c1, d1, b2))
            a3.close()
            # Now 127.0.0.3 holds 2 (b1, b2) and the others 1: a newcomer of 127.0.0.3 makes 3 and
            # replaces its own oldest.
            b3 = open_from("127.0.0.3", 5)
            assert evicted(b1) and not any(evicted(s) for s in (a4, c1, d1, b2, b3))
            b1.close()
            # Requests that arrived are answered whatever the caps.
            assert ask(port, "127.0.0.6", CLIENT_TIMEOUT_S) == 200
        finally:
            for _, sock in socks:
                sock.close()
        wait_until(lambda: exporter.open_connections == 0)


def test_cap_and_head_bound_validation() -> None:
    for name, bad in (
        ("max_connections", 0),
        ("max_connections_per_client", 0),
        ("max_head_bytes", 10),
        ("max_head_lines", 1),
        ("workers", 0),
        ("workers", 1.5),
        ("max_connections", True),
    ):
        with pytest.raises(ValueError, match=name):
            MetricsExporter(PrometheusSink(), **{name: bad})  # type: ignore[arg-type]
