"""Logical -> physical expert remap with load recording: the public entry point and its backends.

Shape legend: T tokens, K top-k, L layers, E logical experts, P physical slots, R max replicas (the
replica capacity, P - E + 1), C count rows.

One call per MoE layer per forward pass::

    tables = DispatchTables.from_placement(placement, rank, device)          # once; update_() after a swap
    phys_TK = remap_and_record(topk_ids_TK, tables, layer, mode="static",
                               counts_P=pass_counts_LP[layer],                # int32 [P], added to
                               logical_counts_E=None,                         # int32 [E], added to
                               num_valid_tokens=n_valid_1,                   # int32 [1] on the device
                               record=record_flag_1)                          # int32 [1] on the device

Semantics (every backend, bit for bit):

- ``topk_ids_TK`` int32 [T, K] (int64 -> TypeError; no silent upcast). Output int32 [T, K].
- An element is *valid* when ``0 <= id < E`` and its row is below ``num_valid_tokens`` (all rows
  when None). Invalid elements (-1 padding, ids out of range, padded rows) are copied through
  unchanged and never counted.
- Modes: ``static`` (``tables.static_LE[layer, id]``), ``lp`` (this batch's tokens of each
  replicated expert split over its GPUs by the rule in eplb.remap.lp_rule, from counts
  all-gathered over the EP group by ``lp``, an :class:`eplb.remap.lp.LpExchange`: every rank
  calls, an idle one with T = 0 too), ``dynamic`` (uniform over the expert's
  replicas, hashed from the element index, rank, layer and ``tables.seed_1``), ``dynamic_row``
  (rank-invariant: replica ``row % logcnt``), ``fake`` (uniform over all P slots, ignoring the
  id; for benchmarks), ``weighted`` (replica drawn by ``tables.cumweights_LER`` from a hash of
  the element index and layer only, so ranks and replays agree). Hash details: eplb.remap.tables.
- Counting: each valid element adds 1 to ``counts_P[physical id]`` and to
  ``logical_counts_E[logical id]``, when those int32 buffers are given, and only when the
  device-side int32 scalar ``record`` is nonzero (None: always). ``counts_P`` may also be int32
  [C, P] *count rows* (1 <= C <= MAX_COUNT_ROWS): each element then adds to one row, chosen by
  the backend, and the count is the rows' sum (:func:`count_rows_sum`); the Triton kernel spreads its
  programs' flushes over the rows, so fewer of them add into the same address (eplb.recorder
  passes 16 rows on CUDA). Neither flag nor
  ``num_valid_tokens`` is read on the host, so one captured CUDA graph serves every case.

Backends (``backend=``): ``triton`` (CUDA and ROCm; CPU under TRITON_INTERPRET=1), ``torch``
(reference, any device), ``aiter`` (ROCm with amd-aiter installed), ``auto`` (triton on a GPU,
else torch). Backends are imported only when chosen: importing this module loads no Triton.
Each takes one :class:`eplb.remap.call.RemapCall`, built here after the checks; ``lp`` has a
function of its own in each backend (two kernels around the collective). For a layer's fixed
arguments checked once, see eplb.remap.prepared.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from eplb.policy.dispatch import dispatch_mode_names
from eplb.remap.call import RemapCall
from eplb.remap.tables import DispatchTables

if TYPE_CHECKING:
    from eplb.remap.exchange import LpExchange

RemapBackend = Callable[[RemapCall], None]
"""A backend: writes ``call.out_TK`` and adds the call's counts (semantics above)."""

MODES = dispatch_mode_names()

# name -> "module:function"; imported on first use only.
_BACKENDS: dict[str, str] = {
    "torch": "eplb.remap.torch_backend:remap_record_torch",
    "triton": "eplb.kernels.remap_record:remap_record_triton",
    "aiter": "eplb.remap.aiter_backend:remap_record_aiter",
}
# The same for mode "lp" (aiter: the Triton kernels, which run on ROCm as they are).
_LP_BACKENDS: dict[str, str] = {
    "torch": "eplb.remap.lp:remap_record_lp_torch",
    "triton": "eplb.kernels.remap_lp_launch:remap_record_lp_triton",
    "aiter": "eplb.kernels.remap_lp_launch:remap_record_lp_triton",
}


def available_backends() -> list[str]:
    """Backend names usable in this process (aiter only on ROCm with amd-aiter importable)."""
    names = ["torch"]
    if importlib.util.find_spec("triton") is not None:
        names.append("triton")
    if _aiter_usable():
        names.append("aiter")
    return names


def _aiter_usable() -> bool:
    if getattr(torch.version, "hip", None) is None:
        return False
    return importlib.util.find_spec("aiter") is not None


_RESOLVED: dict[tuple[str, ...], RemapBackend] = {}
# The same by torch.device, for the per-call lookup (device.type costs more than hashing the device).
_BY_DEVICE: dict[tuple[str, torch.device, bool], RemapBackend] = {}


def get_backend(name: str, device: torch.device, mode: str = "static") -> RemapBackend:
    """Resolve a backend name (``auto`` included) for tensors on ``device`` (cached: once per pair).

    ``mode="lp"`` gives the backend's ``lp`` function; every other mode shares one function.
    """
    key: tuple[str, ...] = (name, device.type) if mode != "lp" else (name, device.type, "lp")
    fn = _RESOLVED.get(key)
    if fn is None:
        fn = _RESOLVED[key] = _resolve_backend(name, device, mode == "lp")
    return fn


def _resolve_backend(name: str, device: torch.device, lp: bool = False) -> RemapBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown remap backend {name!r}; choose from {('auto', *_BACKENDS)}")
    if name == "aiter" and not _aiter_usable():
        raise RuntimeError(
            "remap backend 'aiter' needs a ROCm build of torch and the amd-aiter package "
            "(pip install 'eplb[rocm]'); use backend='triton' or 'torch' here"
        )
    module_name, func_name = (_LP_BACKENDS if lp else _BACKENDS)[name].split(":")
    fn: RemapBackend = getattr(importlib.import_module(module_name), func_name)
    return fn


def remap_and_record(
    topk_ids_TK: torch.Tensor,
    tables: DispatchTables,
    layer: int,
    *,
    mode: str = "static",
    counts_P: torch.Tensor | None = None,
    logical_counts_E: torch.Tensor | None = None,
    num_valid_tokens: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
    out_TK: torch.Tensor | None = None,
    backend: str = "auto",
    lp: LpExchange | None = None,
) -> torch.Tensor:
    """Map router ids [T, K] int32 to physical slot ids [T, K] int32 and add the layer's counts.

    ``counts_P`` int32 [P] (or count rows [C, P]: module docstring) and ``logical_counts_E`` int32
    [E] are added to in place (contiguous, on the ids' device). ``num_valid_tokens`` and ``record`` are int32 tensors of one element on
    that device. ``out_TK`` (int32 [T, K], contiguous) receives the result when given: pass it to
    skip an allocation per call. ``lp``: the rank's counts exchange in mode ``lp`` (None: the
    tables' own, over the default process group). See the module docstring for each mode.
    """
    device = check_remap_args(
        topk_ids_TK, tables, layer, mode, counts_P, logical_counts_E, num_valid_tokens, record
    )
    if out_TK is None:
        out_TK = torch.empty_like(topk_ids_TK)  # int32 and contiguous, as checked; the fastest allocator call
    else:
        check_tensor("out_TK", out_TK, topk_ids_TK.shape, device)
    exchange = None
    if mode == "lp":
        from eplb.remap.exchange import exchange_for

        exchange = exchange_for(tables, lp)
    if topk_ids_TK.numel() == 0:
        if exchange is not None:
            exchange.idle()  # the other ranks wait for this rank's counts
        return out_TK
    key = (backend, device, mode == "lp")
    fn = _BY_DEVICE.get(key)
    if fn is None:
        fn = _BY_DEVICE[key] = get_backend(backend, device, mode)
    fn(
        RemapCall(
            topk_ids_TK=topk_ids_TK,
            tables=tables,
            layer=layer,
            mode=mode,
            out_TK=out_TK,
            counts_P=counts_P,
            logical_counts_E=logical_counts_E,
            num_valid_tokens=num_valid_tokens,
            record=record,
            lp=exchange,
        )
    )
    return out_TK


# Every check below runs on every call of every MoE layer, mostly eagerly (prefill): attribute
# reads and comparisons only, nothing that allocates, synchronises or formats a string unless
# it is about to raise.
_INT32 = torch.int32


def check_remap_args(
    topk_ids_TK: torch.Tensor,
    tables: DispatchTables,
    layer: int,
    mode: str,
    counts_P: torch.Tensor | None,
    logical_counts_E: torch.Tensor | None,
    num_valid_tokens: torch.Tensor | None,
    record: torch.Tensor | None,
) -> torch.device:
    """Validate every argument of :func:`remap_and_record`; TypeError for dtypes, ValueError otherwise.

    Returns the ids' device.
    """
    check_ids(topk_ids_TK)
    if mode not in MODES:
        raise ValueError(f"unknown dispatch mode {mode!r}; choose from {MODES}")
    if not 0 <= layer < tables.num_layers:
        raise ValueError(f"layer {layer} outside [0, {tables.num_layers})")
    device = topk_ids_TK.device
    if tables.device != device:
        raise ValueError(f"dispatch tables live on {tables.device} but topk_ids on {device}")
    if counts_P is not None:
        rows = (counts_P.shape[0],) if isinstance(counts_P, torch.Tensor) and counts_P.dim() == 2 else ()
        if rows and not 1 <= rows[0] <= MAX_COUNT_ROWS:
            raise ValueError(f"counts_P has {rows[0]} count rows; at most {MAX_COUNT_ROWS} (and at least 1)")
        check_tensor("counts_P", counts_P, (*rows, tables.num_physical), device)
    if logical_counts_E is not None:
        check_tensor("logical_counts_E", logical_counts_E, (tables.num_logical,), device)
    if num_valid_tokens is not None:
        check_tensor("num_valid_tokens", num_valid_tokens, None, device)
    if record is not None:
        check_tensor("record", record, None, device)
    return device


def check_ids(topk_ids_TK: torch.Tensor) -> None:
    """The router's ids: a contiguous int32 tensor [T, K] (TypeError naming a wrong dtype)."""
    if not isinstance(topk_ids_TK, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids_TK).__name__}")
    if topk_ids_TK.dtype != _INT32:
        raise TypeError(
            f"topk_ids must be int32, got {topk_ids_TK.dtype}: convert at the router "
            "(an int64 id would silently turn every map lookup into int64)"
        )
    if topk_ids_TK.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids_TK.shape)}")
    if not topk_ids_TK.is_contiguous():
        raise ValueError("topk_ids must be contiguous")


MAX_COUNT_ROWS = 64
"""Count rows a ``counts_P`` of shape [C, P] may have at most."""


def count_rows_sum(counts: torch.Tensor) -> torch.Tensor:
    """The counts of a ``counts_P`` of count rows [C, P] (int64 [P]); a [P] buffer as int64."""
    return counts.to(torch.int64).sum(0) if counts.dim() == 2 else counts.to(torch.int64)


def check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...] | None, device: torch.device) -> None:
    """An int32 contiguous tensor on ``device`` of ``shape`` (None: one element)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != _INT32:
        raise TypeError(f"{name} must be {_INT32}, got {t.dtype}")
    if shape is None:
        if t.numel() != 1:
            raise ValueError(f"{name} must hold one element, got shape {tuple(t.shape)}")
    elif t.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but topk_ids on {device}")
    if shape is not None and not t.is_contiguous():  # one element is always contiguous
        raise ValueError(f"{name} must be contiguous")


__all__ = [
    "MAX_COUNT_ROWS",
    "MODES",
    "DispatchTables",
    "RemapBackend",
    "RemapCall",
    "available_backends",
    "count_rows_sum",
    "get_backend",
    "remap_and_record",
]
