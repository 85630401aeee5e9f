"""MetricsExporter: loopback by default, serves the sink's text, frees its port; only rank 0 exports."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eplb.metrics import names
from eplb.metrics.exporter import CONTENT_TYPE, MetricsExporter, sink_for_rank
from eplb.metrics.prometheus import PrometheusSink
from eplb.metrics.sink import NullSink


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


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
        assert b'eplb_forward_passes_total{kind="decode",recorded="true"} 1.0' in get(exporter.url)[2]
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
    assert (
        sink.registry.get_sample_value(names.FORWARD_PASSES, {"kind": "prefill", "recorded": "true"}) == calls
    )


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
    assert b'eplb_forward_passes_total{kind="prefill",recorded="true"} 1.0' in seen["body"]  # type: ignore[operator]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(str(seen["url"]), timeout=2)
    # Without --metrics-port the demo reports to no exporter.
    monkeypatch.setattr(demo, "run_demo", lambda config, *, sink=None, **kw: seen.update(sink=sink) or {})
    assert main(["demo", "--nproc", "2"]) == 0
    assert isinstance(seen["sink"], NullSink)


def test_one_kept_alive_connection_serves_many_scrapes() -> None:
    import http.client

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
                assert (
                    f'eplb_forward_passes_total{{kind="decode",recorded="false"}} {i + 1}.0'.encode() in body
                )
        finally:
            conn.close()
