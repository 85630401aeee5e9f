"""What every benchmark shares: its timers, the run's machine and versions, and its result file.

Every benchmark runs as ``python -m benchmarks.NAME`` from the repository root and times with these
helpers, so a figure in docs/benchmarks.md means the same thing whichever benchmark measured it:

- GPU work: CUDA events recorded around one call (:func:`event_us`: eager, the host's launch cost
  included); a CUDA graph of N back-to-back calls replayed between events (:func:`capture_graph`,
  :func:`graph_us`: the cost of one call inside a captured forward pass); :func:`warm_up_gpu` keeps
  the GPU busy until its clocks have left idle, before eager timings.
- Host and CPU work: wall seconds between optional syncs (:func:`wall_times`, ``perf_counter``);
  the calling thread's CPU clock (:func:`host_us`, ``thread_time``: other processes on a shared
  machine do not count); wall and process CPU time of one block (:class:`Stopwatch`).
- :func:`run_info` (date, Python, torch, Triton, numpy, GPU, CPU count) and :func:`write_result`,
  which adds it to a benchmark's JSON and writes the file atomically (a temporary file, then a
  rename), so a run cut short never leaves half a result.

torch is imported only inside the functions that need it: importing the harness does not load it
into a CPU benchmark's process.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


# ---- GPU: CUDA events and graphs ------------------------------------------------------------------
def event_us(fn: Callable[[], object]) -> float:
    """µs between CUDA events recorded on the current stream around one call of ``fn``."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3


def event_times_us(fn: Callable[[], object], reps: int, *, warmup: int = 0) -> list[float]:
    """:func:`event_us` of ``reps`` calls of ``fn`` after ``warmup`` calls whose times are dropped."""
    return [event_us(fn) for _ in range(warmup + reps)][warmup:]


def capture_graph(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph holding ``calls`` back-to-back calls of ``fn`` (compiled and warmed up first)."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_us(fn: Callable[[], object], calls: int, reps: int) -> float:
    """Median µs per call of replaying a graph that holds ``calls`` calls of ``fn`` (replay launch included)."""
    graph = capture_graph(fn, calls)
    return statistics.median(event_us(graph.replay) / calls for _ in range(reps))


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Keep the GPU busy until its clocks have left idle (the first timings ran slow without this)."""
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


# ---- host and CPU ---------------------------------------------------------------------------------
def wall_times(
    fn: Callable[[], object],
    reps: int,
    *,
    warmup: int = 0,
    sync: Callable[[], object] | None = None,
    setup: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds (``perf_counter``) of ``reps`` calls of ``fn`` after ``warmup`` calls whose times are dropped.

    Each call: ``setup()`` and ``sync()`` untimed, then the clock runs over ``fn()`` and a second
    ``sync()`` (a CUDA sync, or a barrier across ranks, so the work done is the work timed).
    """
    times = []
    for _ in range(warmup + reps):
        if setup is not None:
            setup()
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return times[warmup:]


def host_us(fn: Callable[[], object], calls: int, rounds: int, sync: Callable[[], object]) -> float:
    """Minimum over ``rounds`` of the calling thread's CPU µs per call of ``fn`` over ``calls`` calls.

    ``sync`` runs before each round, untimed: GPU work is queued during a round, not waited for.
    """
    best = float("inf")
    for _ in range(rounds):
        sync()
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls * 1e6)
    sync()
    return best


class Stopwatch:
    """Wall (``perf_counter``) and process CPU (``process_time``) seconds of a ``with`` block."""

    wall_s: float
    """Wall seconds of the block (set when it ends)."""
    cpu_s: float
    """CPU seconds of every thread of this process during the block (set when it ends)."""

    def __enter__(self) -> Stopwatch:
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._wall0
        self.cpu_s = time.process_time() - self._cpu0


# ---- run info and result files --------------------------------------------------------------------
def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_info() -> dict[str, Any]:
    """Date (UTC), machine and versions of this run: the block every result file carries as ``info``."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }


def _json_default(obj: object) -> object:
    """numpy scalars (and 0-d arrays or tensors) as the Python numbers they hold."""
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def write_result(
    path: Path, payload: Mapping[str, Any], *, info: Mapping[str, Any] | None = None, indent: int = 1
) -> None:
    """Write ``payload`` plus ``"info"`` (``info``, else :func:`run_info` now) as JSON to ``path``.

    Atomic: the text goes to a temporary file in the same folder, which then replaces ``path``.
    """
    if "info" in payload:
        raise ValueError("the payload already has an 'info' key; write_result adds it")
    data = {**payload, "info": dict(info if info is not None else run_info())}
    text = json.dumps(data, indent=indent, default=_json_default) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes the file private; a result file is for everyone
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


__all__ = [
    "Stopwatch",
    "capture_graph",
    "event_times_us",
    "event_us",
    "graph_us",
    "host_us",
    "run_info",
    "wall_times",
    "warm_up_gpu",
    "write_result",
]
