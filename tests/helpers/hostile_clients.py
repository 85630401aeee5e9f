"""Hostile clients of the metrics exporter, in a process of their own, and a scraper measuring them.

The attack (``python -m tests.helpers.hostile_clients PORT CONFIG_JSON``): ``tricklers`` connections,
spread round-robin over the ``sources`` addresses, each sending one byte of a request head that
never ends every ``every_s`` and reconnecting at once whenever the server closes it (at a deadline,
or evicting it); at ``burst_at_s``, ``burst`` connections at the same moment, each asking for
``/metrics`` once. It prints ``ready`` once every trickler is connected, and a JSON line of counts
at the end. :func:`scrape_under_attack` runs it against a port and scrapes meanwhile, as
Prometheus would: a fresh connection every ``every_s`` with a 1 s timeout.

Any 127.0.0.0/8 address is the loopback on Linux, so clients from 127.0.0.2, 127.0.0.3, ... are
distinct clients of a server on 127.0.0.1 for its per-client caps.
"""

from __future__ import annotations

import json
import selectors
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HEAD_START = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class Attack:
    """What the hostile process does."""

    sources: list[str] = field(default_factory=lambda: [f"127.0.0.{i}" for i in range(2, 22)])
    """Source addresses the tricklers and the burst connect from, round-robin."""
    tricklers: int = 20
    """Connections trickling a request head, each reconnecting whenever closed."""
    every_s: float = 0.25
    """Seconds between a trickler's bytes."""
    duration_s: float = 3.0
    """Seconds the tricklers run after ``ready``."""
    burst: int = 200
    """Connections opened and asking at the same moment, once."""
    burst_at_s: float = 1.5
    """When the burst comes, in seconds after ``ready``."""


def connect(port: int, source: str, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((source, 0))
        sock.settimeout(timeout_s)
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


def ask(port: int, source: str, timeout_s: float) -> int | None:
    """The status of one ``GET /metrics`` (``Connection: close``), or None if not answered in time."""
    deadline = time.monotonic() + timeout_s
    try:
        with connect(port, source, timeout_s) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while True:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
    except OSError:
        return None
    head, _, body = answer.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
    except (IndexError, ValueError, StopIteration):
        return None
    return status if len(body) == length else None


def _burst(port: int, attack: Attack, outcomes: dict[str, int]) -> None:
    barrier = threading.Barrier(attack.burst)
    lock = threading.Lock()

    def one(i: int) -> None:
        barrier.wait()
        status = ask(port, attack.sources[i % len(attack.sources)], timeout_s=10.0)
        with lock:
            outcomes[str(status)] = outcomes.get(str(status), 0) + 1

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(attack.burst)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20.0)


def run_attack(port: int, attack: Attack) -> dict[str, Any]:
    """The attack of the module docstring; returns its counts."""
    selector = selectors.DefaultSelector()
    sent: dict[socket.socket, int] = {}
    counts: dict[str, Any] = {"reconnects": 0, "refused_503": 0, "connect_errors": 0, "burst": {}}

    def open_one(source: str) -> None:
        try:
            sock = connect(port, source, timeout_s=5.0)
        except OSError:
            counts["connect_errors"] += 1
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, source)
        sent[sock] = 0

    for i in range(attack.tricklers):
        open_one(attack.sources[i % len(attack.sources)])
    print("ready", flush=True)
    start = time.monotonic()
    burst = threading.Thread(target=_burst, args=(port, attack, counts["burst"]), daemon=True)
    next_byte = start
    while time.monotonic() - start < attack.duration_s:
        if attack.burst and burst.ident is None and time.monotonic() - start >= attack.burst_at_s:
            burst.start()
        for key, _ in selector.select(max(0.0, min(next_byte - time.monotonic(), 0.05))):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if data.startswith(b"HTTP/1.1 503"):
                counts["refused_503"] += 1
            if not data or data.startswith(b"HTTP/"):  # closed, or answered (then closed): reconnect
                selector.unregister(sock)
                sent.pop(sock, None)
                sock.close()
                counts["reconnects"] += 1
                open_one(key.data)
        if time.monotonic() >= next_byte:
            next_byte += attack.every_s
            for sock, n in list(sent.items()):
                byte = HEAD_START[n : n + 1] or b"a"
                try:
                    sock.send(byte)
                    sent[sock] = n + 1
                except OSError:
                    pass  # closed under us: the next select sees it
    if burst.ident is not None:
        burst.join(timeout=20.0)
    for sock in sent:
        sock.close()
    return counts


@dataclass(frozen=True, kw_only=True)
class Scrapes:
    """What the scraper saw under an attack."""

    statuses: list[int | None]
    """Each scrape's status, None where no whole answer came within ``timeout_s``."""
    latencies_s: list[float]
    """Each scrape's seconds from connect to the end of the answer (or to giving up)."""
    attack: dict[str, Any]
    """The hostile process's counts."""

    @property
    def answered(self) -> float:
        """The fraction of scrapes answered 200 in time."""
        return sum(s == 200 for s in self.statuses) / max(len(self.statuses), 1)


def scrape_under_attack(
    port: int, attack: Attack, *, source: str = "127.0.0.1", every_s: float = 0.1, timeout_s: float = 1.0
) -> Scrapes:
    """Run ``attack`` against ``port`` in a child process and scrape from ``source`` meanwhile."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.hostile_clients", str(port), json.dumps(asdict(attack))],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready", "the hostile process did not start"
        start = time.monotonic()
        statuses: list[int | None] = []
        latencies: list[float] = []
        while time.monotonic() - start < attack.duration_s:
            t0 = time.monotonic()
            statuses.append(ask(port, source, timeout_s))
            latencies.append(time.monotonic() - t0)
            time.sleep(max(0.0, every_s - (time.monotonic() - t0)))
        out, _ = child.communicate(timeout=60.0)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return Scrapes(statuses=statuses, latencies_s=latencies, attack=json.loads(out.strip().splitlines()[-1]))


if __name__ == "__main__":
    print(json.dumps(run_attack(int(sys.argv[1]), Attack(**json.loads(sys.argv[2])))), flush=True)
