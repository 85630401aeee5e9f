"""MetricsExporter: loopback by default, serves the sink's text (gzipped when asked), frees its port,
closes idle connections, bounds its threads; only rank 0 exports."""

from __future__ import annotations

import gzip
import http.client
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eplb.metrics import names
from eplb.metrics.exporter import CONTENT_TYPE, MetricsExporter, accepts_gzip, sink_for_rank
from eplb.metrics.prometheus import PrometheusSink
from eplb.metrics.sink import NullSink
from tests.helpers.polling import wait_until


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def passes(body: bytes, kind: str, recorded: str) -> float | None:
    """The forward-pass counter of one (kind, recorded) in a scrape, whatever its engine labels."""
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == names.FORWARD_PASSES and (s.labels["kind"], s.labels["recorded"]) == (
                kind,
                recorded,
            ):
                return float(s.value)
    return None


def test_serves_metrics_on_loopback() -> None:
    sink = PrometheusSink()
    sink.on_window(logical_load_LE=np.arange(6.0).reshape(2, 3), gpu_load_LG=np.ones((2, 2)))
    with MetricsExporter(sink) as exporter:
        assert exporter.host == "127.0.0.1"
        assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        status, ctype, body = get(exporter.url)
        assert status == 200 and ctype == CONTENT_TYPE
        assert body == sink.render()
        families = {f.name for f in text_string_to_metric_families(body.decode())}
        assert names.RANK_TOKENS in families
        # Later events show up in the next scrape.
        sink.on_forward_pass(kind="decode", recorded=True)
        assert passes(get(exporter.url)[2], "decode", "true") == 1.0
        assert get(exporter.url + "?x=1")[0] == 200
        assert get(f"http://127.0.0.1:{exporter.port}/")[0] == 200
        assert get(f"http://127.0.0.1:{exporter.port}/nope")[0] == 404


def test_stop_frees_the_port_and_is_idempotent() -> None:
    exporter = MetricsExporter(PrometheusSink()).start()
    port = exporter.port
    exporter.stop()
    exporter.stop()
    with pytest.raises(RuntimeError):
        _ = exporter.port
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_busy_port_and_bad_port_are_value_errors() -> None:
    with MetricsExporter(PrometheusSink()) as first, pytest.raises(ValueError, match=str(first.port)):
        MetricsExporter(PrometheusSink(), port=first.port).start()
    with pytest.raises(ValueError):
        MetricsExporter(PrometheusSink(), port=70000)


def test_a_stalled_client_does_not_block_scrapes() -> None:
    with (
        MetricsExporter(PrometheusSink()) as exporter,
        socket.create_connection(("127.0.0.1", exporter.port)),
    ):
        # The open connection above sends nothing; the scrape below still gets its answer.
        start = time.monotonic()
        assert get(exporter.url)[0] == 200
        assert time.monotonic() - start < 2.0


def test_scrapes_and_sink_calls_run_concurrently() -> None:
    # A thread reporting passes as fast as it can while scrapes run: nothing deadlocks, no count is lost.
    sink = PrometheusSink()
    sink.on_window(logical_load_LE=np.ones((4, 8)), gpu_load_LG=np.ones((4, 2)))
    done = threading.Event()
    calls = 0

    def forward() -> None:
        nonlocal calls
        while not done.is_set():
            sink.on_forward_pass(kind="prefill", recorded=True)
            calls += 1

    thread = threading.Thread(target=forward)
    thread.start()
    try:
        with MetricsExporter(sink) as exporter:
            for _ in range(20):
                assert get(exporter.url)[0] == 200
    finally:
        done.set()
        thread.join(timeout=5)
    assert calls > 0
    assert passes(sink.render(), "prefill", "true") == calls


def test_only_rank_zero_exports() -> None:
    sink0, exporter0 = sink_for_rank(0, port=0)
    try:
        assert isinstance(sink0, PrometheusSink) and exporter0 is not None
        assert get(exporter0.url)[0] == 200
    finally:
        assert exporter0 is not None
        exporter0.stop()
    sink1, exporter1 = sink_for_rank(1, port=0)
    assert isinstance(sink1, NullSink) and exporter1 is None
    sink_off, exporter_off = sink_for_rank(0, port=None)
    assert isinstance(sink_off, NullSink) and exporter_off is None
    with pytest.raises(ValueError):
        sink_for_rank(-1, port=0)


def test_ipv6_loopback_when_available() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        exporter = MetricsExporter(PrometheusSink(), host="::1").start()
    except ValueError as exc:
        pytest.skip(f"cannot bind ::1 here: {exc}")
    try:
        assert exporter.url.startswith("http://[::1]:")
        assert get(exporter.url)[0] == 200
    finally:
        exporter.stop()


def test_demo_flags_export_the_sink_the_demo_reports_to(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # eplb demo --metrics-port/--metrics-host: the sink handed to run_demo is the one served on that
    # address while the demo runs, and the endpoint is gone when it returns.
    from eplb.cli import main
    from eplb.commands import demo

    seen: dict[str, object] = {}

    def fake_run_demo(config: object, *, sink: object = None, **kwargs: object) -> dict[str, object]:
        url = capsys.readouterr().out.split("metrics on ", 1)[1].split()[0]
        assert isinstance(sink, PrometheusSink)
        sink.on_forward_pass(kind="prefill", recorded=True)
        status, _, body = get(url)
        seen.update(url=url, status=status, body=body)
        return {"ranks": 2, "passes": 1}

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    assert main(["demo", "--nproc", "2", "--metrics-port", "0", "--metrics-host", "127.0.0.2"]) == 0
    assert str(seen["url"]).startswith("http://127.0.0.2:") and seen["status"] == 200
    assert passes(seen["body"], "prefill", "true") == 1.0  # type: ignore[arg-type]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(str(seen["url"]), timeout=2)
    # Without --metrics-port the demo reports to no exporter.
    monkeypatch.setattr(demo, "run_demo", lambda config, *, sink=None, **kw: seen.update(sink=sink) or {})
    assert main(["demo", "--nproc", "2"]) == 0
    assert isinstance(seen["sink"], NullSink)


def test_one_kept_alive_connection_serves_many_scrapes() -> None:
    sink = PrometheusSink()
    with MetricsExporter(sink) as exporter:
        conn = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=5)
        try:
            for i in range(3):
                sink.on_forward_pass(kind="decode", recorded=False)
                conn.request("GET", "/metrics")
                resp = conn.getresponse()
                body = resp.read()
                assert resp.status == 200 and not resp.will_close
                assert passes(body, "decode", "false") == i + 1
        finally:
            conn.close()


def _deepseek_sized_sink() -> PrometheusSink:
    L, E, G = 58, 256, 32
    sink = PrometheusSink(model_name="deepseek-ai/DeepSeek-V3")
    sink.on_topology(num_layers=L, num_logical=E, num_physical=288, num_gpus=G, num_nodes=4)
    rng = np.random.default_rng(0)
    sink.on_window(
        logical_load_LE=rng.integers(0, 10_000, (L, E)).astype(np.float64),
        gpu_load_LG=rng.integers(0, 100_000, (L, G)).astype(np.float64),
    )
    return sink


def _scrape(port: int, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics", headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_gzip_when_the_client_accepts_it_and_the_same_text() -> None:
    sink = _deepseek_sized_sink()
    with MetricsExporter(sink) as exporter:
        status, plain_headers, plain = _scrape(exporter.port, {})
        assert status == 200 and "content-encoding" not in plain_headers
        for accept in ("gzip", "deflate, gzip;q=0.5", "*", "br, GZIP"):
            status, headers, zipped = _scrape(exporter.port, {"Accept-Encoding": accept})
            assert status == 200 and headers["content-encoding"] == "gzip", accept
            assert headers["content-type"] == CONTENT_TYPE and "Accept-Encoding" in headers["vary"]
            assert int(headers["content-length"]) == len(zipped)
            assert gzip.decompress(zipped) == plain == sink.render()
            assert len(zipped) * 5 < len(plain), (len(zipped), len(plain))  # 240 kB -> about 23 kB
        for refuse in ("identity", "gzip;q=0", "deflate", "*;q=0", "gzip;q=0, *"):
            status, headers, body = _scrape(exporter.port, {"Accept-Encoding": refuse})
            assert "content-encoding" not in headers and body == plain, refuse
        # The text changes with the next event, and so does the gzipped answer.
        sink.on_forward_pass(kind="decode", recorded=True)
        _, _, zipped = _scrape(exporter.port, {"Accept-Encoding": "gzip"})
        assert passes(gzip.decompress(zipped), "decode", "true") == 1.0


def test_accept_encoding_parsing() -> None:
    assert accepts_gzip("gzip") and accepts_gzip(" x-gzip ") and accepts_gzip("gzip;q=0.001")
    assert accepts_gzip("*;q=1") and accepts_gzip("identity, *")
    for header in (None, "", "identity", "gzip;q=0", "gzip; q=0.0", "gzip;q=bad", "*;q=0, identity"):
        assert not accepts_gzip(header), header


def test_an_idle_connection_is_closed_after_the_timeout() -> None:
    with MetricsExporter(PrometheusSink(), idle_timeout_s=0.3) as exporter:
        # One that never sends a byte, and one kept alive after a scrape: both are closed.
        silent = socket.create_connection(("127.0.0.1", exporter.port))
        kept = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=5)
        try:
            kept.request("GET", "/metrics")
            resp = kept.getresponse()
            resp.read()
            assert resp.status == 200 and not resp.will_close
            wait_until(lambda: exporter.open_connections == 2)
            start = time.monotonic()
            silent.settimeout(5)
            assert silent.recv(1) == b""  # the server closed it
            assert 0.2 < time.monotonic() - start < 3.0
            wait_until(lambda: exporter.open_connections == 0, timeout_s=3.0)
            assert kept.sock is not None and kept.sock.recv(1) == b""
        finally:
            silent.close()
            kept.close()
        # A client stalled mid-request is closed too, and nothing else is affected.
        with socket.create_connection(("127.0.0.1", exporter.port)) as stalled:
            stalled.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never end
            stalled.settimeout(5)
            assert get(exporter.url)[0] == 200
            assert stalled.recv(1) == b""
    with pytest.raises(ValueError):
        MetricsExporter(PrometheusSink(), idle_timeout_s=0)
    with pytest.raises(ValueError):
        MetricsExporter(PrometheusSink(), idle_timeout_s=float("inf"))


def test_connections_and_threads_are_bounded() -> None:
    threads_before = threading.active_count()
    # Silent connections would hold their place for the whole test (the deadline is not under test).
    with MetricsExporter(
        PrometheusSink(), max_connections=3, idle_timeout_s=30.0, request_deadline_s=30.0, workers=2
    ) as exporter:
        idle = [socket.create_connection(("127.0.0.1", exporter.port)) for _ in range(3)]
        try:
            wait_until(lambda: exporter.open_connections == 3)
            # Past the bound a newcomer evicts the oldest connection still waiting for its request
            # (answered 503): three newer silent ones replace the three, in order, and a scrape is
            # served. No connection ever gets a thread of its own.
            for sock in list(idle):
                idle.append(socket.create_connection(("127.0.0.1", exporter.port)))
                sock.settimeout(5)
                assert sock.recv(65536).startswith(b"HTTP/1.1 503")
            wait_until(lambda: exporter.open_connections == 3)
            for _ in range(20):
                assert _scrape(exporter.port, {})[0] == 200
            assert threading.active_count() <= threads_before + 1 + 2  # the loop + 2 workers
        finally:
            for sock in idle:
                sock.close()
        wait_until(lambda: exporter.open_connections == 0)
        assert get(exporter.url)[0] == 200
    with pytest.raises(ValueError):
        MetricsExporter(PrometheusSink(), max_connections=0)


def test_stop_closes_open_connections_and_their_threads() -> None:
    threads_before = threading.active_count()
    exporter = MetricsExporter(PrometheusSink(), idle_timeout_s=60.0, request_deadline_s=60.0).start()
    idle = [socket.create_connection(("127.0.0.1", exporter.port)) for _ in range(4)]
    try:
        wait_until(lambda: exporter.open_connections == 4)
        exporter.stop()
        for sock in idle:
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed by stop(), not 60 s later (idle timeout and deadline)
        wait_until(lambda: threading.active_count() <= threads_before)
    finally:
        for sock in idle:
            sock.close()
