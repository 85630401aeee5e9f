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
function of its own in each backend (two kernels around the collective); the registry is
eplb.remap.backends.

Per-call cost: a forward pass calls this once per MoE layer with the same fixed arguments (tables,
layer, mode, the recorder's counts and flag, ``num_valid_tokens``). The second call with the same
tensor *objects* builds a :class:`eplb.remap.prepared.PreparedRemap` for them and keeps it in the
tables (``derived``, per layer: the last argument set and up to three earlier ones); later calls
find it by the layer, compare the fixed arguments with its own by identity, and go through it
(it checks the ids and the output; on Triton it launches directly): the cost of ``rec.prepare()``
plus a dict lookup and eight comparisons. A bad argument raises as before, since a new tensor
object is checked in full. A tensor passed here must keep its shape, dtype, device and storage
while it is used (no ``resize_``/``set_`` on a counts buffer in place), as for a prepared call;
an argument that is a new object on every call (a fresh view, a new ``num_valid_tokens`` per pass)
is checked in full on every call. Python's own keyword passing is the caller's: ``**kwargs``
unpacking costs more per call than the cache (docs/benchmarks.md, "Recorder host cost per
documented path"). :func:`clear_prepared_cache` forgets every kept preparation.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from eplb.remap.backends import RemapBackend, available_backends, get_backend
from eplb.remap.call import (
    MAX_COUNT_ROWS,
    MODES,
    RemapArgs,
    RemapCall,
    check_remap_args,
    check_tensor,
    count_rows_sum,
)
from eplb.remap.prepared import PreparedRemap
from eplb.remap.tables import DispatchTables

if TYPE_CHECKING:
    from eplb.remap.exchange import LpExchange

# The same as get_backend's cache, by torch.device, for the per-call lookup (device.type costs more
# than hashing the device).
_BY_DEVICE: dict[tuple[str, torch.device, bool], RemapBackend] = {}

# The per-layer cache of prepared calls, kept in each tables' ``derived``: under _KEPT, {layer:
# the PreparedRemap of the argument set prepared last there}, which links (``earlier``) to those
# of up to _EARLIER_PER_LAYER earlier sets (an engine may call one layer with two sets, SGLang's
# adapter does). A call finds its entry with one attribute read and two dict lookups, and
# compares its six optional arguments with the kept ones by identity (``is``: the entry holds
# them, so no id can be reused) and its mode and backend by equality: that is all a cached call
# pays above a prepared one (an earlier set: those comparisons once more per entry before it).
# Any other call builds its RemapArgs.
_KEPT = "remap_and_record:prepared"
_EARLIER_PER_LAYER = 3
_KEPT_IN: weakref.WeakSet[DispatchTables] = weakref.WeakSet()  # tables holding such entries

# (id of the tables, layer, the fixed arguments' RemapArgs.key) -> the PreparedRemap for them, or,
# after their first call, a tuple holding the tables and the RemapArgs (a marker: prepare on the
# second call, so a caller that passes a fresh view every call pays no preparation). Consulted only when no layer entry matches:
# first calls, fresh objects, or more argument sets on one layer than the entries hold (a set
# found here is kept again, without the checks). Each value holds its key's objects, so no id in
# a live key can be reused by another object. Bounded: a caller of fresh views fills it, and it is
# emptied when full.
_PREPARED: dict[tuple[Any, ...], Any] = {}
_PREPARED_MAX = 4096


def clear_prepared_cache() -> None:
    """Forget every preparation :func:`remap_and_record` kept (and the objects they hold)."""
    _PREPARED.clear()
    for tables in list(_KEPT_IN):
        tables.derived.pop(_KEPT, None)
    _KEPT_IN.clear()


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
    map_padded_rows: bool = False,
) -> torch.Tensor:
    """Map router ids [T, K] int32 to physical slot ids [T, K] int32 and add the layer's counts.

    ``counts_P`` int32 [P] (or count rows [C, P]: module docstring) and ``logical_counts_E`` int32
    [E] are added to in place (contiguous, on the ids' device). ``num_valid_tokens`` and ``record``
    are int32 tensors of one element on that device. ``out_TK`` (int32 [T, K], contiguous) receives
    the result when given: pass it to skip an allocation per call. ``lp``: the rank's counts exchange
    in mode ``lp`` (None: the tables' own, over the default process group).
    ``map_padded_rows``: rows at or past ``num_valid_tokens`` are mapped too, still not counted
    (SGLang's fused kernel's contract; not in ``lp`` mode). See the module
    docstring for each mode, and for the per-object cache of the fixed arguments' checks.
    """
    try:
        kept: PreparedRemap | None = tables.derived[_KEPT][layer]
    except (AttributeError, KeyError, TypeError):  # none kept yet, or not tables: checked below
        kept = None
    while kept is not None:  # the layer's kept preparations, the last one first
        if (
            kept.counts_P is counts_P
            and kept.record is record
            and kept.num_valid_tokens is num_valid_tokens
            and kept.logical_counts_E is logical_counts_E
            and kept.lp is lp
            and kept.map_padded_rows is map_padded_rows
            and kept.mode == mode
            and kept.backend == backend
        ):
            # RemapArgs.key's comparison, inlined on the keywords (building the record costs
            # more); the call checks the ids and the output, as below.
            return kept.__call__(topk_ids_TK, out_TK)
        kept = kept.earlier
    args = RemapArgs(
        mode=mode,
        counts_P=counts_P,
        logical_counts_E=logical_counts_E,
        num_valid_tokens=num_valid_tokens,
        record=record,
        backend=backend,
        lp=lp,
        map_padded_rows=map_padded_rows,
    )
    return _call_uncached(topk_ids_TK, tables, layer, out_TK, args)


def _call_uncached(
    topk_ids_TK: torch.Tensor,
    tables: DispatchTables,
    layer: int,
    out_TK: torch.Tensor | None,
    args: RemapArgs,
) -> torch.Tensor:
    """:func:`remap_and_record` where none of the layer's kept preparations matches: one found in
    the global table, or every argument checked (prepared, and kept, on the second call with the
    same objects)."""
    key = (id(tables), layer, *args.key())
    try:
        found, cacheable = _PREPARED.get(key), True
    except TypeError:  # an unhashable layer or mode: the checks below say what is wrong
        found, cacheable = None, False
    if found is not None and found.__class__ is not tuple:  # prepared (so checked) before
        return _keep(tables, layer, found)(topk_ids_TK, out_TK)
    device = check_remap_args(topk_ids_TK, tables, layer, args)
    if cacheable:
        if len(_PREPARED) >= _PREPARED_MAX:
            _PREPARED.clear()
        if found is None:  # first call with these objects: keep them, prepare on the next one
            _PREPARED[key] = (tables, args)
        else:
            prepared = _PREPARED[key] = PreparedRemap.of(tables, layer, args)
            return _keep(tables, layer, prepared)(topk_ids_TK, out_TK)
    if out_TK is None:
        out_TK = torch.empty_like(topk_ids_TK)  # int32 and contiguous, as checked; the fastest allocator call
    else:
        check_tensor("out_TK", out_TK, topk_ids_TK.shape, device)
    exchange = None
    if args.mode == "lp":
        from eplb.remap.exchange import exchange_for

        exchange = exchange_for(tables, args.lp)
    if topk_ids_TK.numel() == 0:
        if exchange is not None:
            exchange.idle()  # the other ranks wait for this rank's counts
        return out_TK
    fn_key = (args.backend, device, args.mode == "lp")
    fn = _BY_DEVICE.get(fn_key)
    if fn is None:
        fn = _BY_DEVICE[fn_key] = get_backend(args.backend, device, args.mode)
    fn(args.remap_call(topk_ids_TK, tables, layer, out_TK, exchange))
    return out_TK


def _keep(tables: DispatchTables, layer: int, prepared: PreparedRemap) -> PreparedRemap:
    """Make ``prepared`` the layer's last entry, the ones kept before it its earlier ones (at most
    ``_EARLIER_PER_LAYER``); returns it."""
    last = tables.derived.setdefault(_KEPT, {})
    chain = [prepared]
    node = last.get(layer)
    while node is not None and len(chain) <= _EARLIER_PER_LAYER:
        if node is not prepared:
            chain.append(node)
        node = node.earlier
    for entry, earlier in zip(chain, [*chain[1:], None], strict=True):
        entry.earlier = earlier
    last[layer] = prepared
    _KEPT_IN.add(tables)
    return prepared


__all__ = [
    "MAX_COUNT_ROWS",
    "MODES",
    "DispatchTables",
    "RemapBackend",
    "RemapCall",
    "available_backends",
    "clear_prepared_cache",
    "count_rows_sum",
    "get_backend",
    "remap_and_record",
]
