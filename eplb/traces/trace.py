"""``Trace``: per-step logical expert counts with per-step metadata, and this project's file format.

Shape legend: T steps (forward passes), L MoE layers, E logical experts.

The own format is a safetensors file (or ``.npz``, read with ``allow_pickle=False``) holding
``counts`` int32 [T, L, E], ``is_prefill`` uint8 [T] and ``num_tokens`` int64 [T], plus a JSON
metadata string. Neither reader can execute code from the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_NAME = "eplb-trace"
FORMAT_VERSION = "1"


class TraceFormatError(ValueError):
    """A trace file is corrupt, of an unknown kind, or holds something other than plain data."""


@dataclass(frozen=True, eq=False)
class Trace:
    """Recorded (or synthetic) logical expert load, one row per forward pass."""

    counts_TLE: np.ndarray
    """int32 [T, L, E]: tokens routed to each logical expert in each step."""
    is_prefill_T: np.ndarray
    """bool [T]: whether the step carried prefill tokens."""
    num_tokens_T: np.ndarray
    """int64 [T]: tokens in the step (each routed to top-k experts)."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    """JSON-serialisable facts: model, top_k, source, generator parameters..."""

    def __post_init__(self) -> None:
        c = self.counts_TLE
        if not isinstance(c, np.ndarray) or c.dtype != np.int32 or c.ndim != 3:
            raise ValueError(
                f"counts must be an int32 [T, L, E] array, got {getattr(c, 'dtype', type(c))} "
                f"{getattr(c, 'shape', '')}"
            )
        T = c.shape[0]
        if self.is_prefill_T.shape != (T,) or self.is_prefill_T.dtype != np.bool_:
            raise ValueError(
                f"is_prefill must be bool [{T}], got {self.is_prefill_T.dtype} {self.is_prefill_T.shape}"
            )
        if self.num_tokens_T.shape != (T,) or self.num_tokens_T.dtype != np.int64:
            raise ValueError(
                f"num_tokens must be int64 [{T}], got {self.num_tokens_T.dtype} {self.num_tokens_T.shape}"
            )
        if c.size and c.min() < 0:
            raise ValueError("counts must be non-negative")

    @classmethod
    def from_counts(
        cls,
        counts: Any,
        *,
        is_prefill: Any = None,
        num_tokens: Any = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Trace:
        """Build from any array-like of counts [T, L, E] (or one step [L, E]), checking values.

        NaN, infinite, negative or fractional counts are refused. Unknown ``is_prefill`` counts
        every step as prefill; unknown ``num_tokens`` is the busiest layer's routed count / top_k.
        """
        meta = dict(meta or {})
        arr = np.asarray(counts)
        if arr.ndim == 2:
            arr = arr[None]
        if arr.ndim != 3:
            raise ValueError(f"counts must be [T, L, E] or [L, E], got shape {arr.shape}")
        if arr.dtype.kind == "f":
            if not np.isfinite(arr).all():
                raise ValueError("counts hold NaN or infinite values")
            if (arr != np.round(arr)).any():
                raise ValueError("counts hold fractional values")
        elif arr.size and arr.dtype.kind not in "iub":
            raise ValueError(f"counts must be numeric, got dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            raise ValueError("counts must lie in [0, 2**31)")
        counts_TLE = np.ascontiguousarray(arr, dtype=np.int32)
        T = counts_TLE.shape[0]
        prefill = (
            np.ones(T, dtype=bool) if is_prefill is None else np.asarray(is_prefill, dtype=bool).reshape(T)
        )
        if num_tokens is None:
            top_k = int(meta.get("top_k", 1))
            routed = (
                counts_TLE.sum(axis=2, dtype=np.int64).max(axis=1, initial=0) if T else np.zeros(0, np.int64)
            )
            tokens = routed // max(top_k, 1)
        else:
            tokens = np.asarray(num_tokens, dtype=np.int64).reshape(T)
        return cls(counts_TLE, prefill, tokens.astype(np.int64), meta)

    # ---- shape and slicing --------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return int(self.counts_TLE.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.counts_TLE.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.counts_TLE.shape[2])

    def __len__(self) -> int:
        return self.num_steps

    def slice(self, start: int, stop: int) -> Trace:
        """Steps [start, stop) as a new Trace sharing memory."""
        s = slice(start, stop)
        return Trace(self.counts_TLE[s], self.is_prefill_T[s], self.num_tokens_T[s], dict(self.meta))

    def prefill_only(self) -> Trace:
        """Only the steps that carried prefill tokens."""
        keep = self.is_prefill_T
        return Trace(self.counts_TLE[keep], keep[keep], self.num_tokens_T[keep], dict(self.meta))

    def total_LE(self) -> np.ndarray:
        """int64 [L, E]: counts summed over all steps."""
        return self.counts_TLE.sum(axis=0, dtype=np.int64)

    def equals(self, other: Trace) -> bool:
        return (
            np.array_equal(self.counts_TLE, other.counts_TLE)
            and np.array_equal(self.is_prefill_T, other.is_prefill_T)
            and np.array_equal(self.num_tokens_T, other.num_tokens_T)
            and dict(self.meta) == dict(other.meta)
        )

    # ---- own format -------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the own format: ``.npz`` by suffix, else safetensors. Returns the path."""
        path = Path(path)
        arrays = {
            "counts": self.counts_TLE,
            "is_prefill": self.is_prefill_T.astype(np.uint8),
            "num_tokens": self.num_tokens_T,
        }
        meta_json = json.dumps(dict(self.meta), sort_keys=True)
        if path.suffix == ".npz":
            header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "meta": meta_json}
            entries: dict[str, np.ndarray] = {**arrays, **{k: np.array(v) for k, v in header.items()}}
            with path.open("wb") as f:
                np.savez_compressed(f, **entries)  # type: ignore[arg-type]  # numpy stubs type **kwds as bool
        else:
            from safetensors.numpy import save_file

            save_file(
                {k: np.ascontiguousarray(v) for k, v in arrays.items()},
                str(path),
                metadata={"format": FORMAT_NAME, "version": FORMAT_VERSION, "meta": meta_json},
            )
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read the own format (safetensors or npz); corrupt or foreign files raise TraceFormatError."""
        path = Path(path)
        try:
            if _is_zip(path):
                with np.load(path, allow_pickle=False) as z:
                    header = {k: str(z[k]) for k in ("format", "version", "meta") if k in z.files}
                    arrays = {k: z[k] for k in ("counts", "is_prefill", "num_tokens") if k in z.files}
            else:
                from safetensors import safe_open

                with safe_open(str(path), framework="np") as f:
                    header = dict(f.metadata() or {})
                    arrays = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        except (OSError, ValueError, EOFError) as exc:
            raise TraceFormatError(f"{path}: not a readable eplb trace ({exc})") from None
        except Exception as exc:  # safetensors raises its own SafetensorError for corrupt headers
            raise TraceFormatError(
                f"{path}: not a readable eplb trace ({type(exc).__name__}: {exc})"
            ) from None
        if header.get("format") != FORMAT_NAME:
            raise TraceFormatError(f"{path}: not an eplb trace (format tag {header.get('format')!r})")
        if header.get("version") != FORMAT_VERSION:
            raise TraceFormatError(f"{path}: eplb trace version {header.get('version')!r} is not supported")
        missing = {"counts", "is_prefill", "num_tokens"} - arrays.keys()
        if missing:
            raise TraceFormatError(f"{path}: eplb trace lacks {sorted(missing)}")
        try:
            meta = json.loads(header.get("meta", "{}"))
            return cls(
                np.ascontiguousarray(arrays["counts"]),
                np.asarray(arrays["is_prefill"]).astype(bool),
                np.asarray(arrays["num_tokens"]),
                meta,
            )
        except (ValueError, json.JSONDecodeError) as exc:
            raise TraceFormatError(f"{path}: inconsistent eplb trace ({exc})") from None


def _is_zip(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"PK\x03\x04"
