"""``Trace``: per-step logical expert counts with per-step metadata, and this project's file format.

Shape legend: F steps (forward passes), L layers, E logical experts.

The own format is a safetensors file (or ``.npz``, read with ``allow_pickle=False``) holding
``counts`` int32 [F, L, E], ``is_prefill`` uint8 [F] and ``num_tokens`` int64 [F], plus a JSON
metadata string. The file is mapped through eplb.fileio.map_input (a regular file, at most
``MAX_TRACE_FILE_BYTES``): a safetensors trace's arrays are read-only views of the mapped pages,
so even a trace larger than memory costs page cache, not memory the process holds; an ``.npz``
is inflated into memory, after checking that what its members' npy headers declare fits the
limits (eplb.traces.checks.MAX_NPZ_ARRAY_BYTES, MAX_NPZ_HEADER_BYTES) and this process's memory
(eplb.fileio.check_memory). Neither parser can execute code from the file, and both check the
shapes it declares against the bytes it holds before decoding an array (eplb.traces.checks).
Writes are atomic (eplb.fileio): a failed or interrupted save leaves no partial file.
"""

from __future__ import annotations

import io
import json
import math
import mmap
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from eplb.fileio import (
    MemoryLimitError,
    OutputSet,
    atomic_path,
    check_memory,
    map_input,
    safetensors_header,
    safetensors_views,
)
from eplb.traces.checks import (
    MAX_NPZ_ARRAY_BYTES,
    MAX_NPZ_HEADER_BYTES,
    MAX_TRACE_FILE_BYTES,
    TraceFormatError,
    check_dims,
    check_zip_sizes,
    count_array,
    npy_header,
)

FORMAT_NAME = "eplb-trace"
FORMAT_VERSION = "1"
ARRAY_KEYS = ("counts", "is_prefill", "num_tokens")
HEADER_KEYS = ("format", "version", "meta")
NPZ_COMPRESSION_LEVEL = 1
"""zlib level of .npz traces: level 6 takes 12x as long for a file only 14% smaller."""

PREFILL_UNKNOWN = "prefill_unknown"
"""Metadata key: True when the source recorded no prefill flags (every step counts as prefill)."""

ProgressFn = Callable[[int, int], None]
"""``progress(done, total)``, called as a long read or write advances (units: bytes or steps)."""


@dataclass(frozen=True, eq=False)
class Trace:
    """Recorded (or synthetic) logical expert load, one row per forward pass."""

    counts_FLE: np.ndarray
    """int32 [F, L, E]: tokens routed to each logical expert in each step."""
    is_prefill_F: np.ndarray
    """bool [F]: whether the step carried prefill tokens."""
    num_tokens_F: np.ndarray
    """int64 [F]: tokens in the step (each routed to top-k experts)."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    """JSON-serialisable facts: model, top_k, source, generator parameters..."""

    def __post_init__(self) -> None:
        c = self.counts_FLE
        if not isinstance(c, np.ndarray) or c.dtype != np.int32 or c.ndim != 3:
            raise ValueError(
                f"counts must be an int32 [F, L, E] array, got {getattr(c, 'dtype', type(c))} "
                f"{getattr(c, 'shape', '')}"
            )
        F = c.shape[0]
        if self.is_prefill_F.shape != (F,) or self.is_prefill_F.dtype != np.bool_:
            raise ValueError(
                f"is_prefill must be bool [{F}], got {self.is_prefill_F.dtype} {self.is_prefill_F.shape}"
            )
        if self.num_tokens_F.shape != (F,) or self.num_tokens_F.dtype != np.int64:
            raise ValueError(
                f"num_tokens must be int64 [{F}], got {self.num_tokens_F.dtype} {self.num_tokens_F.shape}"
            )
        check_dims(c.shape[1], c.shape[2], "trace")
        if c.size and c.min() < 0:
            raise ValueError("counts must be non-negative")
        if F and self.num_tokens_F.min() < 0:
            raise ValueError("num_tokens must be non-negative")

    @classmethod
    def from_counts(
        cls,
        counts: Any,
        *,
        is_prefill: Any = None,
        num_tokens: Any = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Trace:
        """Build from any array-like of counts [F, L, E] (or one step [L, E]), checking values.

        NaN, infinite, negative, fractional and boolean counts are refused, as are L = 0 and E = 0.
        Unknown ``is_prefill`` counts every step as prefill and says so in the metadata
        (``PREFILL_UNKNOWN``, kept when saved; :meth:`prefill_note`); unknown ``num_tokens`` is the
        busiest layer's routed count / top_k.
        """
        meta = dict(meta or {})
        if is_prefill is None:
            meta[PREFILL_UNKNOWN] = True
        arr = np.asarray(counts)
        if arr.ndim == 2:
            arr = arr[None]
        if arr.ndim != 3:
            raise ValueError(f"counts must be [F, L, E] or [L, E], got shape {arr.shape}")
        check_dims(arr.shape[1], arr.shape[2], "counts")
        counts_FLE = count_array(arr, "counts")
        F = counts_FLE.shape[0]
        prefill = (
            np.ones(F, dtype=bool) if is_prefill is None else np.asarray(is_prefill, dtype=bool).reshape(F)
        )
        if num_tokens is None:
            top_k = int(meta.get("top_k", 1))
            routed = (
                counts_FLE.sum(axis=2, dtype=np.int64).max(axis=1, initial=0) if F else np.zeros(0, np.int64)
            )
            tokens = routed // max(top_k, 1)
        else:
            # Checked as counts are (whole, non-negative, int32): 1.5 tokens is an error, not 1.
            tokens = count_array(np.asarray(num_tokens), "num_tokens").reshape(F)
        return cls(counts_FLE, prefill, tokens.astype(np.int64), meta)

    @property
    def prefill_known(self) -> bool:
        """False for traces whose format carries no prefill flags (SGLang dumps, OpenEvolve JSON):
        every step then counts as prefill."""
        return not self.meta.get(PREFILL_UNKNOWN, False)

    def prefill_note(self) -> str | None:
        """One line for readers of prefill figures when the flags are unknown, else None."""
        if self.prefill_known:
            return None
        source = self.meta.get("source", "unknown source")
        return (
            f"the trace ({source}) records no prefill flags: every step counts as prefill, so "
            "prefill figures (bal prefill, --eplb-record-prefill-only) cover all steps"
        )

    # ---- shape and slicing --------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return int(self.counts_FLE.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.counts_FLE.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.counts_FLE.shape[2])

    def __len__(self) -> int:
        return self.num_steps

    def slice(self, start: int, stop: int) -> Trace:
        """Steps [start, stop) as a new Trace sharing memory."""
        s = slice(start, stop)
        return Trace(self.counts_FLE[s], self.is_prefill_F[s], self.num_tokens_F[s], dict(self.meta))

    def prefill_only(self) -> Trace:
        """Only the steps that carried prefill tokens."""
        keep = self.is_prefill_F
        return Trace(self.counts_FLE[keep], keep[keep], self.num_tokens_F[keep], dict(self.meta))

    def total_LE(self) -> np.ndarray:
        """int64 [L, E]: counts summed over all steps."""
        return self.counts_FLE.sum(axis=0, dtype=np.int64)

    def equals(self, other: Trace) -> bool:
        return (
            np.array_equal(self.counts_FLE, other.counts_FLE)
            and np.array_equal(self.is_prefill_F, other.is_prefill_F)
            and np.array_equal(self.num_tokens_F, other.num_tokens_F)
            and dict(self.meta) == dict(other.meta)
        )

    # ---- own format -------------------------------------------------------------------------
    def save(
        self, path: str | Path, *, outputs: OutputSet | None = None, progress: ProgressFn | None = None
    ) -> Path:
        """Write the own format atomically: ``.npz`` by suffix, else safetensors. Returns the path.

        With ``outputs`` the file is staged there and appears when that set commits.
        """
        path = Path(path)
        arrays = {
            "counts": self.counts_FLE,
            "is_prefill": self.is_prefill_F.astype(np.uint8),
            "num_tokens": self.num_tokens_F,
        }
        header = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "meta": json.dumps(dict(self.meta), sort_keys=True),
        }
        with atomic_path(path, outputs=outputs) as tmp:
            if path.suffix == ".npz":
                entries = {**arrays, **{k: np.array(v) for k, v in header.items()}}
                _write_npz(tmp, entries, progress)
            else:
                from safetensors.numpy import save_file

                save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp), metadata=header)
                if progress is not None:
                    nbytes = sum(int(a.nbytes) for a in arrays.values())
                    progress(nbytes, nbytes)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read the own format (safetensors or npz); corrupt or foreign files raise TraceFormatError."""
        return cls.from_bytes(map_input(path, limit=MAX_TRACE_FILE_BYTES, what="trace file"), str(path))

    @classmethod
    def from_bytes(cls, data: bytes | mmap.mmap, path: str) -> Trace:
        """The own format from a file's bytes or its map (``path`` names it in errors); a
        safetensors trace's arrays share ``data``'s memory."""
        try:
            header, arrays = _read_npz(data, path) if _is_zip(data) else _read_safetensors(data, path)
        except (TraceFormatError, MemoryLimitError):
            raise
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise TraceFormatError(f"{path}: not a readable eplb trace ({exc})") from None
        except Exception as exc:  # safetensors raises its own SafetensorError for corrupt headers
            raise TraceFormatError(
                f"{path}: not a readable eplb trace ({type(exc).__name__}: {exc})"
            ) from None
        try:
            meta = json.loads(header.get("meta", "{}"))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError; an integer past the digit limit
            raise TraceFormatError(f"{path}: the metadata is not valid JSON ({type(exc).__name__})") from None
        if not isinstance(meta, dict):
            raise TraceFormatError(f"{path}: the metadata must be a JSON object")
        prefill = arrays["is_prefill"]
        if prefill.dtype not in (np.uint8, np.bool_) or (prefill.size and prefill.max() > 1):
            raise TraceFormatError(f"{path}: is_prefill must hold 0 or 1 per step")
        try:
            return cls(
                np.ascontiguousarray(arrays["counts"]), prefill.astype(bool), arrays["num_tokens"], meta
            )
        except ValueError as exc:
            raise TraceFormatError(f"{path}: inconsistent eplb trace ({exc})") from None


def _check_header(path: str, header: Mapping[str, str]) -> None:
    if header.get("format") != FORMAT_NAME:
        raise TraceFormatError(f"{path}: not an eplb trace (format tag {header.get('format')!r})")
    if header.get("version") != FORMAT_VERSION:
        raise TraceFormatError(f"{path}: eplb trace version {header.get('version')!r} is not supported")


def _check_shapes(path: str, shapes: Mapping[str, Any]) -> None:
    """The declared array shapes, before any array is read."""
    missing = set(ARRAY_KEYS) - shapes.keys()
    if missing:
        raise TraceFormatError(f"{path}: eplb trace lacks {sorted(missing)}")
    counts = list(shapes["counts"])
    if len(counts) != 3:
        raise TraceFormatError(f"{path}: counts must be [F, L, E], got shape {counts}")
    check_dims(counts[1], counts[2], path)
    for key in ("is_prefill", "num_tokens"):
        if list(shapes[key]) != counts[:1]:
            raise TraceFormatError(f"{path}: {key} must be [{counts[0]}], got shape {list(shapes[key])}")


def _read_safetensors(data: bytes | mmap.mmap, path: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    header, shapes = safetensors_header(data)
    _check_header(path, header)
    _check_shapes(path, {k: shapes[k] for k in ARRAY_KEYS if k in shapes})
    return header, safetensors_views(data, ARRAY_KEYS)


def _read_npz(data: bytes | mmap.mmap, path: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    if isinstance(data, mmap.mmap):  # zipfile and np.load read from a copy in memory
        check_memory(len(data), f"{path}: reading the .npz trace whole")
        data = data[:]
    infos = check_zip_sizes(data, path, stored_only=False)
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        declared = {
            key: npy_header(zf, infos[f"{key}.npy"], f"{path}: {key}")
            for key in (*HEADER_KEYS, *ARRAY_KEYS)
            if f"{key}.npy" in infos
        }
    _check_npz_sizes(path, declared)
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        header = {k: str(z[k]) for k in HEADER_KEYS if k in declared and declared[k][1].kind == "U"}
        _check_header(path, header)
        _check_shapes(path, {k: shape for k, (shape, _) in declared.items()})
        return header, {k: z[k] for k in ARRAY_KEYS}


def _check_npz_sizes(path: str, declared: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    """Refuse an npz trace whose members (their npy headers' shapes and dtypes, ``declared``) would
    inflate past the limits (eplb.traces.checks.MAX_NPZ_HEADER_BYTES each for the header members,
    MAX_NPZ_ARRAY_BYTES for the arrays together) or past this process's memory, before any member
    is inflated: a small deflated file can hold gigabytes of zeros."""
    nbytes = {key: math.prod(shape) * dtype.itemsize for key, (shape, dtype) in declared.items()}
    for key in HEADER_KEYS:
        if nbytes.get(key, 0) > MAX_NPZ_HEADER_BYTES:
            raise TraceFormatError(
                f"{path}: header member {key!r} would inflate to {nbytes[key]} bytes; refusing more "
                f"than {MAX_NPZ_HEADER_BYTES}"
            )
    inflated = sum(nbytes.get(key, 0) for key in ARRAY_KEYS)
    if inflated > MAX_NPZ_ARRAY_BYTES:
        raise TraceFormatError(
            f"{path}: the arrays would inflate to {inflated} bytes; refusing more than "
            f"{MAX_NPZ_ARRAY_BYTES} (what a trace file may hold)"
        )
    check_memory(inflated, f"{path}: the .npz trace's arrays")


def _write_npz(path: Path, entries: Mapping[str, np.ndarray], progress: ProgressFn | None) -> None:
    """What ``np.savez_compressed`` writes, at a faster zlib level and reporting bytes written."""
    total = sum(int(a.nbytes) for a in entries.values())
    done = 0
    with zipfile.ZipFile(
        path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=NPZ_COMPRESSION_LEVEL
    ) as zf:
        for key, arr in entries.items():
            with zf.open(f"{key}.npy", "w", force_zip64=True) as member:
                sink = member if progress is None else _Counting(member, progress, done, total)
                np.lib.format.write_array(sink, np.asanyarray(arr), allow_pickle=False)
            done += int(arr.nbytes)
            if progress is not None:
                progress(done, total)


class _Counting:
    """A write-only file wrapper that reports ``(start + bytes written, total)``."""

    def __init__(self, f: IO[bytes], progress: ProgressFn, start: int, total: int) -> None:
        self._f, self._progress, self._done, self._total = f, progress, start, total

    def write(self, data: bytes) -> int:
        written = self._f.write(data)
        self._done += len(data)
        self._progress(self._done, self._total)
        return written


def _is_zip(data: bytes | mmap.mmap) -> bool:
    return data[:4] == b"PK\x03\x04"
