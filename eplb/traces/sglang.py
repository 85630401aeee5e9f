"""Read SGLang expert-distribution dumps (stat and per_pass) into a :class:`Trace`.

Shape legend: W window (steps), F steps, L layers, E logical experts, P physical slots.

SGLang writes these with ``torch.save``. They are loaded with ``weights_only=True`` only, so a
file that carries code (or any object beyond tensors, numbers, strings, lists and dicts) is
refused instead of executed. What a file can make the reader allocate is bounded by the file:
its zip members must be stored as torch stores them (a compressed member could inflate), and
its tensors together may not declare more bytes than the file holds (a stride-0 or shared
tensor could claim terabytes). Expert ids must name a slot of the map (E <= P).

- stat: ``{"rank", "logical_count": int [W, L, E] (or [L, E]), "average_utilization_rate_over_window"}``.
  The W rows are SGLang's ring buffer in storage order, not necessarily chronological.
- per_pass: ``{"records": [{"forward_pass_id", "rank", "global_physical_count": [L, P], ...}],
  "last_physical_to_logical_map": [L, P]}``, one file per rank; records of the same pass from
  several files are summed. Physical counts become logical through the dump's last map.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eplb.fileio import read_input
from eplb.traces.checks import (
    MAX_LAYERS,
    MAX_SLOTS,
    MAX_TRACE_FILE_BYTES,
    TraceFormatError,
    check_dims,
    check_zip_sizes,
    count_array,
    int_field,
    tensor_bytes,
)
from eplb.traces.trace import ProgressFn, Trace


def safe_torch_load(data: bytes, path: str) -> Any:
    """``torch.load(weights_only=True)`` of a dump's bytes (``path`` names it) whose sizes were
    checked first; every failure is a TraceFormatError."""
    import torch

    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise TraceFormatError(
            f"{path}: not a torch.save zip file (the legacy pre-1.6 format is not read: it allocates "
            f"what it declares before reading)"
        )
    check_zip_sizes(data, path, stored_only=True)
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        culprit = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported global" in ln), "")
        raise TraceFormatError(
            f"{path}: refused: the file holds objects other than plain tensors and containers, "
            f"and untrusted files are never unpickled. {culprit}".rstrip()
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, AttributeError, TypeError, RecursionError) as exc:
        raise TraceFormatError(f"{path}: not a readable torch dump ({type(exc).__name__}: {exc})") from None
    declared, held = tensor_bytes(obj, path), len(data)
    if declared > held:
        raise TraceFormatError(
            f"{path}: its tensors declare {declared} bytes but the file holds {held} "
            f"(expanded or shared tensors are not dump data)"
        )
    return obj


def _load_dump(path: str | Path) -> Any:
    """One dump file, read through eplb.fileio.read_input, then loaded."""
    return safe_torch_load(read_input(path, limit=MAX_TRACE_FILE_BYTES, what="trace file"), str(path))


def _to_numpy(where: str, value: Any) -> np.ndarray:
    """A copy of a dense tensor's values (dumps hold tensors, never lists, for arrays)."""
    if not hasattr(value, "detach"):
        raise TraceFormatError(f"{where} must be a tensor, got {type(value).__name__}")
    try:
        return np.array(value.detach().cpu().numpy(), copy=True)
    except (TypeError, RuntimeError) as exc:
        raise TraceFormatError(f"{where}: a {value.dtype} tensor cannot be read ({exc})") from None


def trace_from_sglang_object(obj: Any, source: str) -> Trace:
    """Interpret an already-loaded SGLang dump object (stat or per_pass)."""
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{source}: an SGLang dump is a dict, got {type(obj).__name__}")
    if "logical_count" in obj:
        counts = _to_numpy(f"{source}: logical_count", obj["logical_count"])
        if counts.ndim not in (2, 3):
            raise TraceFormatError(f"{source}: logical_count must be [W, L, E] or [L, E], got {counts.shape}")
        check_dims(counts.shape[-2], counts.shape[-1], source)
        rank = obj.get("rank")
        meta = {
            "source": "sglang-stat",
            "rank": None if rank is None else int_field(rank, f"{source}: rank", high=2**31 - 1),
            "chronological": False,
        }
        return Trace.from_counts(count_array(counts, f"{source}: logical_count"), meta=meta)
    if "records" in obj:
        return _per_pass_trace([obj], [source])
    keys = [k if isinstance(k, str) else type(k).__name__ for k in list(obj)[:20]]
    raise TraceFormatError(
        f"{source}: neither an SGLang stat dump ('logical_count') nor a per_pass dump ('records'); "
        f"keys: {sorted(keys)}"
    )


def read_sglang_dump(path: str | Path) -> Trace:
    """One SGLang stat or per_pass dump file."""
    return trace_from_sglang_object(_load_dump(path), str(path))


def parse_sglang_dump(data: bytes, path: str) -> Trace:
    """One SGLang stat or per_pass dump from a file's bytes (``path`` names it in errors)."""
    return trace_from_sglang_object(safe_torch_load(data, path), path)


def read_sglang_per_pass(paths: Sequence[str | Path], *, progress: ProgressFn | None = None) -> Trace:
    """Several per_pass dump files (one per rank); counts of the same forward pass are summed.

    ``progress`` counts files loaded, then records read.
    """
    if not paths:
        raise ValueError("no per_pass dump files given")
    objs = []
    for i, p in enumerate(paths):
        objs.append(_load_dump(p))
        if progress is not None:
            progress(i + 1, len(paths))
    for obj, p in zip(objs, paths, strict=True):
        if not isinstance(obj, dict) or "records" not in obj:
            raise TraceFormatError(f"{p}: not an SGLang per_pass dump (no 'records')")
    return _per_pass_trace(objs, [str(p) for p in paths], progress)


def _per_pass_trace(
    objs: Sequence[dict[str, Any]], sources: Sequence[str], progress: ProgressFn | None = None
) -> Trace:
    by_pass: dict[int, np.ndarray] = {}
    total = sum(len(obj["records"]) for obj in objs if isinstance(obj["records"], list))
    done = 0
    for obj, source in zip(objs, sources, strict=True):
        p2l = obj.get("last_physical_to_logical_map")
        p2l_LP = None if p2l is None else _checked_map(_to_numpy(f"{source}: physical map", p2l), source)
        records = obj["records"]
        if not isinstance(records, list):
            raise TraceFormatError(f"{source}: 'records' must be a list")
        for i, rec in enumerate(records):
            where = f"{source} record {i}"
            if not isinstance(rec, dict) or "forward_pass_id" not in rec:
                raise TraceFormatError(f"{where} has no forward_pass_id")
            pass_id = int_field(rec["forward_pass_id"], f"{where}: forward_pass_id")
            if "rank" in rec:
                int_field(rec["rank"], f"{where}: rank", high=2**31 - 1)
            logical_LE = _record_logical_counts(rec, p2l_LP, where)
            prev = by_pass.get(pass_id)
            if prev is not None and prev.shape != logical_LE.shape:
                raise TraceFormatError(f"{where}: shape {logical_LE.shape} differs from {prev.shape}")
            by_pass[pass_id] = logical_LE if prev is None else prev + logical_LE
            done += 1
            if progress is not None:
                progress(done, total)
    if not by_pass:
        raise TraceFormatError(f"{', '.join(sources)}: per_pass dump holds no records")
    ids = sorted(by_pass)
    meta = {"source": "sglang-per-pass", "forward_pass_ids": ids, "chronological": True}
    counts_FLE = np.stack([by_pass[i] for i in ids])
    return Trace.from_counts(count_array(counts_FLE, f"{', '.join(sources)}: summed counts"), meta=meta)


def _checked_map(p2l_LP: np.ndarray, source: str) -> np.ndarray:
    """int64 [L, P] physical-to-logical map whose ids name slots (E <= P), checked before any
    array is sized by it."""
    if p2l_LP.ndim != 2 or not 1 <= p2l_LP.shape[0] <= MAX_LAYERS or not 1 <= p2l_LP.shape[1] <= MAX_SLOTS:
        raise TraceFormatError(
            f"{source}: physical_to_logical_map must be [L, P] with 1 <= L <= {MAX_LAYERS} and "
            f"1 <= P <= {MAX_SLOTS}, got {list(p2l_LP.shape)}"
        )
    if p2l_LP.dtype.kind not in "iu":
        raise TraceFormatError(f"{source}: physical_to_logical_map must hold integers, got {p2l_LP.dtype}")
    P = p2l_LP.shape[1]
    if p2l_LP.min() < 0 or p2l_LP.max() >= P:
        raise TraceFormatError(
            f"{source}: physical_to_logical_map holds ids outside [0, {P}); every logical expert "
            f"needs one of the {P} slots"
        )
    return p2l_LP.astype(np.int64)


def _record_logical_counts(rec: dict[str, Any], p2l_LP: np.ndarray | None, where: str) -> np.ndarray:
    if "logical_count" in rec:
        counts = count_array(_to_numpy(f"{where}: logical_count", rec["logical_count"]), where)
        if counts.ndim != 2:
            raise TraceFormatError(f"{where}: logical_count must be [L, E], got {counts.shape}")
        check_dims(counts.shape[0], counts.shape[1], where)
        return counts.astype(np.int64)
    if "global_physical_count" not in rec:
        raise TraceFormatError(f"{where}: no 'global_physical_count' (per_token dumps are not supported)")
    phys_LP = count_array(_to_numpy(f"{where}: global_physical_count", rec["global_physical_count"]), where)
    if p2l_LP is None:
        raise TraceFormatError(f"{where}: physical counts need the dump's 'last_physical_to_logical_map'")
    if phys_LP.shape != p2l_LP.shape:
        raise TraceFormatError(f"{where}: counts {phys_LP.shape} and map {p2l_LP.shape} differ in shape")
    L = p2l_LP.shape[0]
    E = int(p2l_LP.max()) + 1
    check_dims(L, E, where)
    flat = (p2l_LP + np.arange(L)[:, None] * E).ravel()
    # float64 weights are exact here: each slot count is below 2**31 and P <= 2**20.
    summed = np.bincount(flat, weights=phys_LP.ravel().astype(np.float64), minlength=L * E)
    return summed.reshape(L, E).astype(np.int64)
