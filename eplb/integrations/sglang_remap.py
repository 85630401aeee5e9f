"""eplb's remap+record kernel behind SGLang's ``eplb_map_and_record_fused`` (the MegaMoE path).

Shape legend: T tokens, K top-k, L layers, E logical experts, P physical slots, C count rows.

SGLang calls ``eplb_map_and_record_fused(topk_ids [T, K], dispatch_info, load_buffer int32 [P],
num_token_non_padded [1] | None)`` once per MoE layer on recorded prefill passes: map each router
id to this rank's static physical slot and add every valid element of the first
``num_token_non_padded`` rows to the layer's count in ``load_buffer``; it returns None where it
cannot (SGLang then maps and records the unfused way). :func:`eplb_map_and_record_fused` keeps
that contract and runs ``eplb.remap.remap_and_record`` on any device (Triton on CUDA and ROCm, the
torch backend on the CPU; ``EPLB_SGLANG_REMAP_BACKEND`` picks another), returning int32 ids.

Dispatch tables are translated once per placement: one :class:`DispatchTables` per dispatch-map
storage (SGLang builds a new view of the same rows on every call), refreshed in place when SGLang
changes the placement, which it does through ``ExpertLocationMetadata.update`` (in place) or
``set_global_expert_location_metadata`` (new maps); both are wrapped (a generation count, and a
fresh cache for new maps).

SGLang maps every row, padded ones included, and stops only the counting at
``num_token_non_padded``; eplb's kernel passes rows at or past ``num_valid_tokens`` through
unmapped unless asked to map them (``map_padded_rows=True``), which a call with padding does: one
launch returns exactly SGLang's ids.

Count rows: SGLang's ``load_buffer`` is one row ``[P]`` of its recorder's per-pass buffer
``_SelectExpertsSinglePassGatherer._data`` int32 [L, P], so every program of the kernel would
flush into the same P addresses (the single-row form: 1.9-2.7x a copy of the same bytes at
T = 65536). The gatherer's ``reset`` (at the start of every recorded pass) and ``collect`` (where
SGLang reads the pass, at its end) are wrapped: ``reset`` gives the buffer count rows of its own,
int32 [L, C, P] with C = :data:`COUNT_ROWS`, zeroed; the kernel adds into the layer's rows
instead of ``load_buffer`` (the 16-row form eplb's recorder uses); ``collect`` adds the rows' sum
into the buffer before SGLang reads it, so SGLang reads the same totals. A buffer without rows
(one ``reset`` never saw, or a backend that does not spread its counts: torch, aiter) is counted
into directly, as before.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eplb.integrations.engine_env import SGLANG_BACKEND_ENV
from eplb.recorder.recorder import CUDA_COUNT_ROWS
from eplb.remap import DispatchTables, available_backends, remap_and_record

if TYPE_CHECKING:
    import torch

BACKEND_ENV = SGLANG_BACKEND_ENV
"""Environment variable: the remap backend (auto | triton | torch | aiter; default auto; its entry
in eplb.integrations.engine_env.ENV_VARS)."""
_MODULE = "sglang.srt.eplb"
_GATHERER = f"{_MODULE}.expert_distribution._SelectExpertsSinglePassGatherer"
"""SGLang's per-pass buffer owner on the select-experts path (the only one whose
``get_current_pass_count_buffer`` hands out a ``load_buffer``)."""
COUNT_ROWS = CUDA_COUNT_ROWS
"""Count rows C the kernel spreads SGLang's counts over (as eplb's recorder on CUDA)."""


@dataclass
class _Entry:
    """A dispatch map's tables; ``source`` keeps the map's storage alive, so its address stays its own."""

    source: torch.Tensor
    tables: DispatchTables
    generation: int


@dataclass
class _Rows:
    """Count rows of one SGLang per-pass buffer; ``source`` keeps the buffer alive, so the
    addresses of its layer rows stay its own."""

    source: torch.Tensor
    """SGLang's int32 [L, P] buffer (``_SelectExpertsSinglePassGatherer._data``)."""
    rows_LCP: torch.Tensor
    """int32 [L, C, P]: this pass's counts not yet in ``source`` (their sum over C)."""


_BACKEND = ["auto"]
"""The remap backend, read from ``EPLB_SGLANG_REMAP_BACKEND`` once, when the plugin registers."""
_CACHE: dict[tuple[Any, ...], _Entry] = {}
_LOCK = threading.Lock()
_GENERATION = [0]
TRANSLATIONS = [0]
"""How many times a dispatch map was translated into tables (for tests and logs)."""
_ROWS: dict[int, _Rows] = {}
"""Count rows by the address of the SGLang buffer they belong to."""
_ROW_OF: dict[int, torch.Tensor] = {}
"""A layer row's address in a buffer of ``_ROWS`` -> that layer's count rows [C, P] (one view,
made once, so the remap's per-object preparation is kept across calls)."""
_MAX_BUFFERS = 8
"""Buffers given rows at most (SGLang makes one recorder per process; a new one replaces it)."""


def placement_changed() -> None:
    """Mark every cached table stale (SGLang changed its placement)."""
    with _LOCK:
        _GENERATION[0] += 1


def _static_tables(static_E: torch.Tensor, num_physical: int) -> DispatchTables:
    """One-layer tables for static dispatch with ``static_E`` (only ``static_LE`` is read in static mode)."""
    import torch

    E = int(static_E.numel())
    device = static_E.device
    static_LE = static_E.reshape(1, E).to(torch.int32).clone()
    return DispatchTables(
        static_LE=static_LE,
        log2phy_LER=static_LE.reshape(1, E, 1).clone(),
        logcnt_LE=torch.ones(1, E, dtype=torch.int32, device=device),
        cumweights_LER=torch.full((1, E, 1), 2.0, dtype=torch.float32, device=device),
        seed_1=torch.zeros(1, dtype=torch.int32, device=device),
        num_physical=num_physical,
        rank=0,
    )


def tables_for(dispatch_map: torch.Tensor | None, num_physical: int, device: torch.device) -> DispatchTables:
    """The cached tables for ``dispatch_map`` [E] (None: identity over P slots), translated once per placement."""
    import torch

    if dispatch_map is None:
        key: tuple[Any, ...] = ("identity", device, num_physical)
    else:
        key = ("map", dispatch_map.data_ptr(), dispatch_map.numel(), dispatch_map.device, num_physical)
    with _LOCK:
        generation = _GENERATION[0]
        entry = _CACHE.get(key)
        if entry is None:
            source = (
                torch.arange(num_physical, dtype=torch.int32, device=device)
                if dispatch_map is None
                else dispatch_map
            )
            entry = _CACHE[key] = _Entry(source, _static_tables(source, num_physical), generation)
            TRANSLATIONS[0] += 1
        elif entry.generation != generation:
            if dispatch_map is not None:  # same storage, new contents: copy in place (addresses kept)
                entry.tables.static_LE.copy_(dispatch_map.reshape(1, -1))
                entry.tables.log2phy_LER.copy_(dispatch_map.reshape(1, -1, 1))
                TRANSLATIONS[0] += 1
            entry.generation = generation
        return entry.tables


def _spreads_rows(device: torch.device) -> bool:
    """Whether this process's backend spreads counts over rows on ``device`` (Triton's kernel:
    ``triton``, or ``auto`` on a GPU); torch and aiter add every count to the first row."""
    backend = _BACKEND[0]
    return backend == "triton" or (backend == "auto" and device.type == "cuda")


def attach_rows(data_LP: torch.Tensor) -> None:
    """Give SGLang's per-pass buffer ``data_LP`` (int32 [L, P]) zeroed count rows, or zero those
    it has. Called where SGLang zeroes the buffer, at the start of a recorded pass (eagerly, so no
    CUDA graph captures an allocation or a zeroing)."""
    import torch

    if data_LP.dtype != torch.int32 or data_LP.dim() != 2 or not data_LP.is_contiguous():
        return
    if not _spreads_rows(data_LP.device):
        return
    with _LOCK:
        entry = _ROWS.get(data_LP.data_ptr())
        if entry is not None and entry.source.shape == data_LP.shape:
            entry.rows_LCP.zero_()
            return
        if entry is not None or len(_ROWS) >= _MAX_BUFFERS:
            _forget_rows(entry.source if entry is not None else next(iter(_ROWS.values())).source)
        L, P = data_LP.shape
        rows_LCP = torch.zeros((L, COUNT_ROWS, P), dtype=torch.int32, device=data_LP.device)
        _ROWS[data_LP.data_ptr()] = _Rows(data_LP, rows_LCP)
        for layer, rows_CP in enumerate(rows_LCP.unbind(0)):
            _ROW_OF[data_LP[layer].data_ptr()] = rows_CP


def _forget_rows(data_LP: torch.Tensor) -> None:
    """Drop a buffer's rows (under ``_LOCK``); its counts not yet folded are lost, as SGLang's
    own are when it replaces the buffer."""
    entry = _ROWS.pop(data_LP.data_ptr())
    for layer in range(entry.source.shape[0]):
        _ROW_OF.pop(entry.source[layer].data_ptr(), None)


def fold_rows(data_LP: torch.Tensor) -> None:
    """Add the count rows of ``data_LP`` into it and zero them: where SGLang reads the pass."""
    import torch

    entry = _ROWS.get(data_LP.data_ptr())
    if entry is None or entry.source.shape != data_LP.shape:
        return
    data_LP.add_(entry.rows_LCP.sum(dim=1, dtype=torch.int32))
    entry.rows_LCP.zero_()


def _counts_for(load_buffer: torch.Tensor) -> torch.Tensor:
    """The count rows [C, P] that stand for ``load_buffer`` [P], or the buffer itself."""
    rows_CP = _ROW_OF.get(load_buffer.data_ptr())
    if rows_CP is None or rows_CP.shape[1] != load_buffer.numel() or rows_CP.device != load_buffer.device:
        return load_buffer
    return rows_CP


def eplb_map_and_record_fused(
    topk_ids: torch.Tensor,
    dispatch_info: Any,
    load_buffer: torch.Tensor,
    num_token_non_padded: torch.Tensor | None,
) -> torch.Tensor | None:
    """SGLang's ``eplb_map_and_record_fused`` contract on eplb's kernel: int32 ids [T, K], or None."""
    import torch

    if topk_ids.numel() == 0:
        return None
    if dispatch_info is not None and dispatch_info.ep_dispatch_algorithm != "static":
        return None  # SGLang's own dispatch modes stay SGLang's
    dispatch = None if dispatch_info is None else dispatch_info.partial_logical_to_rank_dispatch_physical_map
    if dispatch_info is not None and dispatch is None:
        return None
    if load_buffer.dtype != torch.int32 or load_buffer.dim() != 1 or not load_buffer.is_contiguous():
        return None  # the recorder's buffers are int32 [P]; anything else goes SGLang's unfused way
    ids = topk_ids.contiguous()
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    tables = tables_for(dispatch, int(load_buffer.numel()), ids.device)
    backend = _BACKEND[0]
    valid = _valid(num_token_non_padded)
    counts = _counts_for(load_buffer)
    return remap_and_record(
        ids,
        tables,
        0,
        counts_P=counts,
        num_valid_tokens=valid,
        backend=backend,
        map_padded_rows=valid is not None,
    )


def _valid(num_token_non_padded: torch.Tensor | None) -> torch.Tensor | None:
    """The valid-row count as the int32 [1] device tensor eplb's kernel reads (no host sync)."""
    import torch

    if num_token_non_padded is None:
        return None
    if num_token_non_padded.dtype != torch.int32:
        num_token_non_padded = num_token_non_padded.to(torch.int32)
    if num_token_non_padded.shape == (1,):
        return num_token_non_padded  # the same object every layer: the remap keeps its preparation
    return num_token_non_padded.reshape(1)


def _after_update(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ExpertLocationMetadata.update`` (maps rewritten in place): mark cached tables stale."""
    result = original(*args, **kwargs)
    placement_changed()
    return result


def _after_replace(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``set_global_expert_location_metadata`` (new maps): drop the tables of the old ones."""
    result = original(*args, **kwargs)
    with _LOCK:
        _CACHE.clear()
        _GENERATION[0] += 1
    return result


def _after_reset(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``_SelectExpertsSinglePassGatherer.reset`` (a recorded pass starts): zeroed count rows."""
    result = original(*args, **kwargs)
    data = getattr(args[0], "_data", None) if args else None
    if data is not None:
        attach_rows(data)
    return result


def _before_collect(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``_SelectExpertsSinglePassGatherer.collect`` (SGLang reads the pass): rows folded first."""
    data = getattr(args[0], "_data", None) if args else None
    if data is not None:
        fold_rows(data)
    return original(*args, **kwargs)


def register_fused(registry: Any, hook_type: Any) -> None:
    """Register the replacement, the count rows' hooks and the placement-change hooks with
    SGLang's HookRegistry.

    ``EPLB_SGLANG_REMAP_BACKEND`` is read here: a backend this process cannot run raises
    ValueError at start-up, not at the first prefill.
    """
    backend = os.environ.get(BACKEND_ENV, "").strip() or "auto"
    usable = ("auto", *available_backends())
    if backend not in usable:
        raise ValueError(f"{BACKEND_ENV}={backend!r}: choose from {usable} (usable in this process)")
    _BACKEND[0] = backend
    registry.register(
        f"{_MODULE}.eplb_map_record_fused.eplb_map_and_record_fused",
        eplb_map_and_record_fused,
        hook_type.REPLACE,
    )
    registry.register(f"{_GATHERER}.reset", _after_reset, hook_type.AROUND)
    registry.register(f"{_GATHERER}.collect", _before_collect, hook_type.AROUND)
    registry.register(
        f"{_MODULE}.expert_location.ExpertLocationMetadata.update", _after_update, hook_type.AROUND
    )
    registry.register(
        f"{_MODULE}.expert_location.set_global_expert_location_metadata", _after_replace, hook_type.AROUND
    )
