"""Read SGLang expert-distribution dumps (stat and per_pass) into a :class:`Trace`.

Shape legend: W window steps, T steps, L layers, E logical experts, P physical slots.

SGLang writes these with ``torch.save``. They are loaded with ``weights_only=True`` only, so a
file that carries code (or any object beyond tensors, numbers, strings, lists and dicts) is
refused instead of executed.

- stat: ``{"rank", "logical_count": int [W, L, E] (or [L, E]), "average_utilization_rate_over_window"}``.
  The W rows are SGLang's ring buffer in storage order, not necessarily chronological.
- per_pass: ``{"records": [{"forward_pass_id", "rank", "global_physical_count": [L, P], ...}],
  "last_physical_to_logical_map": [L, P]}``, one file per rank; records of the same pass from
  several files are summed. Physical counts become logical through the dump's last map.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eplb.traces.trace import Trace, TraceFormatError


def safe_torch_load(path: str | Path) -> Any:
    """``torch.load(weights_only=True)``, with every failure turned into a TraceFormatError."""
    import torch

    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        culprit = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported global" in ln), "")
        raise TraceFormatError(
            f"{path}: refused: the file holds objects other than plain tensors and containers, "
            f"and untrusted files are never unpickled. {culprit}".rstrip()
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, AttributeError) as exc:
        raise TraceFormatError(f"{path}: not a readable torch dump ({type(exc).__name__}: {exc})") from None


def _to_numpy(name: str, value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except Exception as exc:
        raise TraceFormatError(f"{name}: not an array ({exc})") from None


def trace_from_sglang_object(obj: Any, source: str) -> Trace:
    """Interpret an already-loaded SGLang dump object (stat or per_pass)."""
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{source}: an SGLang dump is a dict, got {type(obj).__name__}")
    if "logical_count" in obj:
        counts = _to_numpy("logical_count", obj["logical_count"])
        if counts.ndim not in (2, 3):
            raise TraceFormatError(f"{source}: logical_count must be [W, L, E] or [L, E], got {counts.shape}")
        meta = {"source": "sglang-stat", "rank": _scalar(obj.get("rank")), "chronological": False}
        try:
            return Trace.from_counts(counts, meta=meta)
        except ValueError as exc:
            raise TraceFormatError(f"{source}: {exc}") from None
    if "records" in obj:
        return _per_pass_trace([obj], [source])
    raise TraceFormatError(
        f"{source}: neither an SGLang stat dump ('logical_count') nor a per_pass dump ('records'); "
        f"keys: {sorted(map(str, obj))}"
    )


def read_sglang_dump(path: str | Path) -> Trace:
    """One SGLang stat or per_pass dump file."""
    return trace_from_sglang_object(safe_torch_load(path), str(path))


def read_sglang_per_pass(paths: Sequence[str | Path]) -> Trace:
    """Several per_pass dump files (one per rank); counts of the same forward pass are summed."""
    if not paths:
        raise ValueError("no per_pass dump files given")
    objs = [safe_torch_load(p) for p in paths]
    for obj, p in zip(objs, paths, strict=True):
        if not isinstance(obj, dict) or "records" not in obj:
            raise TraceFormatError(f"{p}: not an SGLang per_pass dump (no 'records')")
    return _per_pass_trace(objs, [str(p) for p in paths])


def _per_pass_trace(objs: Sequence[dict[str, Any]], sources: Sequence[str]) -> Trace:
    by_pass: dict[int, np.ndarray] = {}
    num_experts: int | None = None
    for obj, source in zip(objs, sources, strict=True):
        p2l = obj.get("last_physical_to_logical_map")
        p2l_LP = None if p2l is None else _to_numpy("last_physical_to_logical_map", p2l).astype(np.int64)
        records = obj["records"]
        if not isinstance(records, list):
            raise TraceFormatError(f"{source}: 'records' must be a list")
        for i, rec in enumerate(records):
            if not isinstance(rec, dict) or "forward_pass_id" not in rec:
                raise TraceFormatError(f"{source}: record {i} has no forward_pass_id")
            logical_LE = _record_logical_counts(rec, p2l_LP, f"{source} record {i}")
            if num_experts is None:
                num_experts = logical_LE.shape[1]
            pass_id = int(_scalar(rec["forward_pass_id"]))
            prev = by_pass.get(pass_id)
            if prev is not None and prev.shape != logical_LE.shape:
                raise TraceFormatError(
                    f"{source} record {i}: shape {logical_LE.shape} differs from {prev.shape}"
                )
            by_pass[pass_id] = logical_LE if prev is None else prev + logical_LE
    if not by_pass:
        raise TraceFormatError(f"{', '.join(sources)}: per_pass dump holds no records")
    ids = sorted(by_pass)
    meta = {"source": "sglang-per-pass", "forward_pass_ids": ids, "chronological": True}
    try:
        return Trace.from_counts(np.stack([by_pass[i] for i in ids]), meta=meta)
    except ValueError as exc:
        raise TraceFormatError(f"{', '.join(sources)}: {exc}") from None


def _record_logical_counts(rec: dict[str, Any], p2l_LP: np.ndarray | None, where: str) -> np.ndarray:
    if "logical_count" in rec:
        counts = _to_numpy("logical_count", rec["logical_count"]).astype(np.int64)
        if counts.ndim != 2:
            raise TraceFormatError(f"{where}: logical_count must be [L, E], got {counts.shape}")
        return counts
    if "global_physical_count" not in rec:
        raise TraceFormatError(f"{where}: no 'global_physical_count' (per_token dumps are not supported)")
    phys_LP = _to_numpy("global_physical_count", rec["global_physical_count"]).astype(np.int64)
    if p2l_LP is None:
        raise TraceFormatError(f"{where}: physical counts need the dump's 'last_physical_to_logical_map'")
    if phys_LP.shape != p2l_LP.shape:
        raise TraceFormatError(f"{where}: counts {phys_LP.shape} and map {p2l_LP.shape} differ in shape")
    if p2l_LP.size and p2l_LP.min() < 0:
        raise TraceFormatError(f"{where}: physical_to_logical_map holds negative ids")
    L = p2l_LP.shape[0]
    E = int(p2l_LP.max(initial=-1)) + 1
    flat = (p2l_LP + np.arange(L)[:, None] * E).ravel()
    return np.bincount(flat, weights=phys_LP.ravel(), minlength=L * E).reshape(L, E).round().astype(np.int64)


def _scalar(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value
