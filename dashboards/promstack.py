"""A live ``eplb demo`` exporting metrics, and a throwaway local Prometheus scraping it.

Used by tests/test_prometheus.py (every panel query must return data) and dashboards/snapshot.py
(the PNG in docs/observability.md). Prometheus binds 127.0.0.1 on a free port, keeps its TSDB in
a temporary folder, scrapes with the committed dashboards/prometheus.yml (target and interval
substituted). Both are always stopped and cleaned up by ``close()`` / the context managers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

HERE = Path(__file__).resolve().parent
SCRAPE_CONFIG = HERE / "prometheus.yml"
DEFAULT_TARGET = "127.0.0.1:9400"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_config(target: str, interval_s: float) -> str:
    """The committed scrape config, pointed at ``target`` and scraping every ``interval_s`` seconds."""
    text = SCRAPE_CONFIG.read_text()
    if DEFAULT_TARGET not in text or ": 5s" not in text:
        raise ValueError(
            f"{SCRAPE_CONFIG} no longer has the target {DEFAULT_TARGET} and 5s intervals to substitute"
        )
    interval = f"{round(interval_s * 1000)}ms"
    return text.replace(DEFAULT_TARGET, target).replace(": 5s", f": {interval}")


def expand(expr: str, *, rate_interval: str, **variables: str) -> str:
    """Grafana's variables as Grafana would send them: ``variables`` by name, the others All (``.*``)."""

    def value(found: re.Match[str]) -> str:
        name = found.group(1)
        if name in ("__rate_interval", "__interval"):
            return rate_interval
        return variables.get(name, ".*")

    return re.sub(r"\$\{?(\w+)\}?", value, expr)


_Self = TypeVar("_Self", bound="_Background")


class _Background:
    """A child process in a session of its own, logging into a temporary folder.

    ``close()`` ends the whole session (the child and anything it spawned, nothing else: SIGTERM,
    then SIGKILL) and removes the folder; the context manager always calls it.
    """

    name = "process"

    def __init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self: _Self) -> _Self:
        raise NotImplementedError

    def _spawn(self, argv: list[str], prepare: Callable[[Path], object] = lambda root: None) -> Path:
        self._tmp = tempfile.TemporaryDirectory(prefix=f"eplb-{self.name}-")
        root = Path(self._tmp.name)
        prepare(root)
        self._log = open(root / "log", "wb")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True
        )
        return root

    def _raise_if_exited(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self._proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        if self._tmp is None:
            return ""
        path = Path(self._tmp.name) / "log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent, if any
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self: _Self) -> _Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class LocalPrometheus(_Background):
    """``prometheus`` on 127.0.0.1 scraping ``target``; ``binary`` defaults to the one on PATH."""

    name = "prometheus"

    def __init__(self, target: str, *, interval_s: float = 1.0, binary: str | None = None) -> None:
        super().__init__()
        found = binary or shutil.which("prometheus")
        if found is None:
            raise FileNotFoundError("prometheus is not installed (Debian: apt-get install prometheus)")
        self.binary = found
        self.target = target
        self.interval_s = interval_s
        self.port = 0
        self.ready_timeout_s = 30.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalPrometheus:
        self.port = free_port()
        config = scrape_config(self.target, self.interval_s)
        self._spawn(
            [
                self.binary,
                "--config.file=prometheus.yml",
                "--storage.tsdb.path=data",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            prepare=lambda root: (root / "prometheus.yml").write_text(config),
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            self._raise_if_exited()
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.close()
        raise TimeoutError(f"prometheus not ready after {self.ready_timeout_s} s")

    def api(self, endpoint: str, **params: str | float) -> Any:
        """GET /api/v1/<endpoint> and return its ``data``; raises on a non-success answer."""
        query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        with urllib.request.urlopen(f"{self.url}/api/v1/{endpoint}?{query}", timeout=10.0) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {endpoint} {params}: {body}")
        return body["data"]

    def variables(self, dashboard: dict) -> dict[str, str]:
        """The dashboard's query variables as Grafana sets them by default: each single-valued one to
        the first value its ``label_values`` query finds (queries see the variables before them),
        the multi-valued ones to All."""
        chosen: dict[str, str] = {}
        for var in dashboard["templating"]["list"]:
            if var["type"] != "query":
                continue
            if var.get("includeAll"):
                chosen[var["name"]] = var.get("allValue", ".*")
                continue
            found = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["query"])
            if found is None:
                raise ValueError(f"variable ${var['name']}: not a label_values query: {var['query']}")
            selector, label = expand(found.group(1), rate_interval="1m", **chosen), found.group(2)
            params: dict[str, str | float] = {"match[]": selector, "start": time.time() - 3600}
            series = self.api("series", **params)
            values = sorted({s[label] for s in series if label in s})
            if not values:
                raise RuntimeError(f"variable ${var['name']}: no {label} in {selector}")
            chosen[var["name"]] = values[0]
        return chosen

    def wait_for_samples(self, metric: str, count: int, timeout_s: float) -> None:
        """Wait until ``metric`` has at least ``count`` scraped samples."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = self.api("query", query=f"count_over_time({metric}[1h])")["result"]
            if result and max(float(r["value"][1]) for r in result) >= count:
                return
            time.sleep(self.interval_s / 2)
        raise TimeoutError(f"{metric}: fewer than {count} samples after {timeout_s} s\n{self.log_tail()}")


class LiveDemo(_Background):
    """``eplb demo --metrics-port 0 <args>``; ``port`` is the one it bound (read from its output)."""

    name = "demo"

    def __init__(self, *args: str, start_timeout_s: float = 120.0) -> None:
        super().__init__()
        self.args = [sys.executable, "-m", "eplb", "demo", "--metrics-port", "0", *args]
        self.port = 0
        self.start_timeout_s = start_timeout_s

    def start(self) -> LiveDemo:
        self._spawn(self.args)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            found = re.search(r"metrics on http://[^\s]+:(\d+)/metrics", self.log_tail(chars=100_000))
            if found:
                self.port = int(found.group(1))
                return self
            self._raise_if_exited()
            time.sleep(0.2)
        self.close()
        raise TimeoutError(f"eplb demo did not report its metrics port after {self.start_timeout_s} s")


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    """Every finite value in an instant-vector or range-matrix API result."""
    out: list[float] = []
    for series in result:
        points = series.get("values") or [series["value"]]
        out.extend(v for v in (float(p[1]) for p in points) if math.isfinite(v))
    return out
