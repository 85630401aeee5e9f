"""Checks that run before anything read from a trace file is trusted or allocated.

Shape legend: F steps, L layers, E logical experts, P physical slots.

A file is untrusted input: its declared shapes, ids and sizes are checked against sane limits and
against the bytes the file actually holds before any array is allocated from them, so a small
hostile file is refused at once instead of costing gigabytes. Counts must be plain non-negative
integers: booleans, strings, fractions, NaN and values past int32 are refused, never coerced.
"""

from __future__ import annotations

import io
import math
import zipfile
from typing import Any

import numpy as np

MAX_LAYERS = 4096
"""Most MoE layers a trace may have (real models have fewer than 100)."""
MAX_EXPERTS = 1 << 16
"""Most logical experts per layer (real models have at most a few hundred)."""
MAX_SLOTS = 1 << 20
"""Most physical slots per layer in a dump's map."""
MAX_EXPANSION = 256
"""A compressed zip member may inflate to this many times its stored size..."""
FREE_EXPANSION_BYTES = 64 << 20
"""...or to this many bytes, whichever is larger (all-zero test traces compress extremely well)."""
COUNT_LIMIT = int(np.iinfo(np.int32).max)
"""Counts are stored as int32."""
MAX_TRACE_FILE_BYTES = 16 << 30
"""Most bytes a trace file may hold (read whole through eplb.fileio.read_input before parsing; a
DeepSeek-V3 trace of 4000 passes is 240 MB)."""
MAX_NPZ_ARRAY_BYTES = MAX_TRACE_FILE_BYTES
"""Most bytes a ``.npz`` trace's arrays may inflate to, together: what a trace file may hold (its
safetensors form holds the same arrays uncompressed). A few MB of deflated zeros can claim that
much, so it is checked, with this process's memory, before any member is inflated."""
MAX_NPZ_HEADER_BYTES = 1 << 20
"""Most bytes each of a ``.npz`` trace's header members (format tag, version, JSON metadata) may
inflate to; eplb writes a few hundred."""


class TraceFormatError(ValueError):
    """A trace file is corrupt, of an unknown kind, or holds something other than plain data."""


def check_dims(num_layers: int, num_experts: int, where: str) -> None:
    """Refuse L or E outside [1, MAX_LAYERS] / [1, MAX_EXPERTS] (call before allocating)."""
    if not 1 <= num_layers <= MAX_LAYERS:
        raise TraceFormatError(f"{where}: {num_layers} layers; a trace needs 1 to {MAX_LAYERS}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise TraceFormatError(f"{where}: {num_experts} experts per layer; a trace needs 1 to {MAX_EXPERTS}")


def count_array(arr: np.ndarray, where: str) -> np.ndarray:
    """``arr`` as int32 counts, refusing anything a count cannot be (never coercing it).

    Integer and whole floating-point values in [0, 2**31) pass; booleans, strings, objects, NaN,
    infinities, fractions and negative or too-large values raise TraceFormatError.
    """
    kind = arr.dtype.kind
    if kind == "b":
        raise TraceFormatError(f"{where}: counts are booleans, not numbers")
    if kind not in "iuf":
        raise TraceFormatError(f"{where}: counts must be numbers, got dtype {arr.dtype}")
    if kind == "f" and arr.size:
        if not np.isfinite(arr).all():
            raise TraceFormatError(f"{where}: counts hold NaN or infinite values")
        if (arr != np.floor(arr)).any():
            raise TraceFormatError(f"{where}: counts hold fractional values")
    if arr.size and (arr.min() < 0 or arr.max() > COUNT_LIMIT):
        raise TraceFormatError(f"{where}: counts must lie in [0, 2**31)")
    return np.ascontiguousarray(arr, dtype=np.int32)


def int_field(value: Any, where: str, *, low: int = 0, high: int = 2**63 - 1) -> int:
    """A plain integer in [low, high]: a Python int or a one-element integer tensor, not a bool."""
    if hasattr(value, "numel") and hasattr(value, "dtype"):  # torch tensor, without importing torch
        if (
            value.numel() != 1
            or value.dtype.is_floating_point
            or value.dtype.is_complex
            or str(value.dtype) == "torch.bool"
        ):
            raise TraceFormatError(
                f"{where} must be one integer, got a {value.dtype} tensor of shape {list(value.shape)}"
            )
        value = int(value.item())
    elif isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        shown = str(value) if abs(value) < 10**30 else f"a {len(str(abs(value)))}-digit number"
        raise TraceFormatError(f"{where} is {shown}, outside [{low}, {high}]")
    return value


def check_zip_sizes(data: bytes, where: str, *, stored_only: bool) -> dict[str, zipfile.ZipInfo]:
    """The members of the zip file ``data`` (named ``where``), after checking what they declare
    against the file.

    ``stored_only`` (torch dumps, which torch never compresses): every member must be stored
    uncompressed and all of them together must fit in the file. Otherwise (npz) members may be
    deflated, each inflating at most MAX_EXPANSION times (or to FREE_EXPANSION_BYTES).
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
        raise TraceFormatError(f"{where}: not a readable zip ({exc})") from None
    declared = 0
    for info in infos:
        if stored_only and info.compress_type != zipfile.ZIP_STORED:
            raise TraceFormatError(
                f"{where}: member {info.filename!r} is compressed; torch.save never compresses, "
                f"so the file was made by something else"
            )
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise TraceFormatError(f"{where}: member {info.filename!r} uses an unsupported compression")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise TraceFormatError(f"{where}: member {info.filename!r} declares inconsistent sizes")
        limit = max(MAX_EXPANSION * info.compress_size, FREE_EXPANSION_BYTES)
        if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > limit:
            raise TraceFormatError(
                f"{where}: member {info.filename!r} would inflate {info.compress_size} bytes to "
                f"{info.file_size}; refusing more than {MAX_EXPANSION}x (a zip bomb?)"
            )
        declared += info.compress_size
    if declared > len(data):
        raise TraceFormatError(f"{where}: members declare {declared} bytes but the file holds {len(data)}")
    return {info.filename: info for info in infos}


def npy_header(zf: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype an npz member declares, checked against the member's size before reading it."""
    try:
        with zf.open(info) as f:
            major, _ = np.lib.format.read_magic(f)
            if major == 1:
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            header_end = f.tell()
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, SyntaxError) as exc:
        raise TraceFormatError(f"{where}: not a readable .npy member ({exc})") from None
    if dtype.hasobject:
        raise TraceFormatError(f"{where}: holds Python objects, which are never unpickled")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != info.file_size - header_end:
        raise TraceFormatError(
            f"{where}: declares shape {list(shape)} of {dtype} ({nbytes} bytes) but holds "
            f"{info.file_size - header_end} bytes"
        )
    return tuple(shape), dtype


def tensor_bytes(obj: Any, where: str) -> int:
    """Bytes that the tensors inside a loaded dump (dicts, lists, tuples) declare, walked
    without recursion; only strided tensors count as data, any other layout is refused."""
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "untyped_storage"):
            if str(getattr(item, "layout", "torch.strided")) != "torch.strided":
                raise TraceFormatError(f"{where}: holds a {item.layout} tensor; only dense tensors are read")
            total += int(item.numel()) * int(item.element_size())
    return total
