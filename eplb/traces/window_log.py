"""An engine's load windows kept as an eplb trace file, one row per window.

Shape legend: F steps (one per window kept), L layers, E logical experts.

vLLM records expert load but never writes it out. When ``EPLB_VLLM_DUMP_DIR`` names a folder,
eplb's vLLM plugin hands every rebalance window it receives (vLLM's ``window_size`` passes summed,
[L, E]) to :class:`WindowLogs`, so that load can be replayed offline (``eplb trace``, ``simulate``,
``solve``). Each row of the file is one window, not one pass. The file is rewritten atomically
after each window and keeps the last ``MAX_WINDOWS``, so a reader never sees a torn file and the
file stays bounded however long the server runs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from eplb.traces.trace import Trace

MAX_WINDOWS = 1000
"""Windows kept per file (58 x 256 DeepSeek-V3 windows: 59 MB); older ones are dropped."""

ROW_MEANING = "one engine rebalance window per row (its passes summed), not one forward pass"
"""The ``row`` metadata of a window log, for whoever replays it."""


class WindowLog:
    """The windows of one model shape, written to ``path`` after every :meth:`append`."""

    def __init__(self, path: str | Path, *, source: str, max_windows: int = MAX_WINDOWS) -> None:
        if max_windows < 1:
            raise ValueError(f"max_windows must be >= 1, got {max_windows}")
        self.path = Path(path)
        self.source = source
        self.max_windows = max_windows
        self.dropped = 0
        self._rows: list[np.ndarray] = []

    def append(self, load_LE: Any) -> Path:
        """Add one window (whole, non-negative counts [L, E]) and rewrite the file."""
        row_LE = np.asarray(load_LE)
        if self._rows and row_LE.shape != self._rows[0].shape:
            raise ValueError(f"window shape {row_LE.shape} differs from {self._rows[0].shape} in {self.path}")
        trace = Trace.from_counts(row_LE)  # checks the counts (whole, finite, non-negative, int32)
        self._rows.append(trace.counts_FLE[0])
        if len(self._rows) > self.max_windows:
            del self._rows[0]
            self.dropped += 1
        meta = {"source": self.source, "row": ROW_MEANING, "windows_dropped": self.dropped}
        return Trace.from_counts(np.stack(self._rows), meta=meta).save(self.path)


class WindowLogs:
    """For an engine plugin: one :class:`WindowLog` per model shape in the folder named by the
    environment variable ``env``, written on rank 0 only (every rank sees the same window).

    :meth:`record` never raises: a window that cannot be written is logged and serving goes on.
    """

    def __init__(self, source: str, env: str, logger: logging.Logger) -> None:
        self.source = source
        self.env = env
        self._logger = logger
        self._logs: dict[tuple[Path, tuple[int, ...]], WindowLog] = {}

    def record(self, load_LE: Any) -> Path | None:
        """Append ``load_LE`` [L, E] when ``env`` is set and this is rank 0; the file written, or None."""
        folder = os.environ.get(self.env, "").strip()
        if not folder or _rank() != 0:
            return None
        row_LE = np.asarray(load_LE)
        key = (Path(folder), row_LE.shape)
        try:
            if key not in self._logs:
                name = f"{self.source}_expert_load_{'x'.join(map(str, row_LE.shape))}.safetensors"
                Path(folder).mkdir(parents=True, exist_ok=True)
                self._logs[key] = WindowLog(Path(folder) / name, source=f"{self.source}-windows")
            path = self._logs[key].append(row_LE)
        except (OSError, ValueError) as exc:
            self._logger.warning("eplb: %s=%s: load window not written (%s)", self.env, folder, exc)
            return None
        self._logger.debug("eplb: load window appended to %s", path)
        return path


def _rank() -> int:
    """The process's global rank (0 outside torch.distributed)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 0
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
