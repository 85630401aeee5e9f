"""OpenEvolve / ADRS EPLB traces: ``{"load_history": [{"logical_expert_load": [L][E]}, ...]}``.

One entry per step. Their evaluation plans on window i and scores on window i+1; so does ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eplb.traces.trace import Trace, TraceFormatError


def read_openevolve(path: str | Path) -> Trace:
    """Read an OpenEvolve ``expert-load.json``."""
    try:
        data = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("load_history"), list):
        raise TraceFormatError(f"{path}: no 'load_history' list")
    rows = []
    for i, entry in enumerate(data["load_history"]):
        if not isinstance(entry, dict) or "logical_expert_load" not in entry:
            raise TraceFormatError(f"{path}: load_history[{i}] has no 'logical_expert_load'")
        try:
            rows.append(np.asarray(entry["logical_expert_load"], dtype=np.float64))
        except (ValueError, TypeError) as exc:
            raise TraceFormatError(
                f"{path}: load_history[{i}] is not a numeric [L][E] table ({exc})"
            ) from None
    if not rows:
        raise TraceFormatError(f"{path}: load_history is empty")
    if any(r.shape != rows[0].shape or r.ndim != 2 for r in rows):
        raise TraceFormatError(f"{path}: load_history entries differ in shape or are not [L][E]")
    try:
        return Trace.from_counts(np.stack(rows), meta={"source": "openevolve"})
    except ValueError as exc:
        raise TraceFormatError(f"{path}: {exc}") from None


def write_openevolve(trace: Trace, path: str | Path) -> Path:
    """Write a trace as OpenEvolve JSON (counts only; per-step metadata is not part of that format)."""
    path = Path(path)
    history = [{"logical_expert_load": step.tolist()} for step in trace.counts_TLE]
    path.write_text(json.dumps({"load_history": history}, separators=(",", ":")))
    return path
