"""The remap kernel's per-call path once a specialisation has been launched: a direct launch.

Shape legend: T tokens, K top-k, L layers, E logical experts, P physical slots, R max replicas (the
replica capacity).

:meth:`RemapDirectLauncher.launch` takes one :class:`eplb.remap.call.RemapCall` and computes, with
integer arithmetic and attribute reads only, the default launch shape and a key naming everything
Triton specialises the kernel on (eplb.kernels.direct_launch), then launches the compiled kernel
kept for that key:

- device index, mode, K, block and num_warps (the constexprs and options besides the tables');
- the tables' E, P, R and the alignment of their five tensors (computed once per tables);
- whether ``numel`` (the one integer argument Triton may specialise) is 1 or a multiple of 16;
- which optional tensors are given, and each pointer's address mod 16 (16-byte alignment);
- the count rows of the slot counts (eplb.remap.call.RemapCall.count_rows).

``HIST_MASK`` is not in the key: it is detected once at import. On a miss the caller launches
through ``kernel[grid]`` and keeps the compiled kernel (eplb.kernels.remap_record).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple

import torch

from eplb.kernels.direct_launch import DirectLaunchCache
from eplb.remap.call import RemapCall
from eplb.remap.tables import DispatchTables, as_int32_bits, hash_rank, salt_base

_FACTS = "triton_direct"


class TableFacts(NamedTuple):
    """What the direct launch needs from one DispatchTables, as host integers."""

    pointers: tuple[int, int, int, int]
    """Addresses of static_LE, log2phy_LER, logcnt_LE, cumweights_LER."""
    seed: int
    """Address of seed_1."""
    num_logical: int
    num_physical: int
    key: tuple[int, ...]
    """E, P, R and each tensor's address mod 16."""
    salts: tuple[tuple[int, ...], tuple[int, ...]]
    """int32 salt bits per layer: (this rank's, the rank-invariant weighted mode's)."""


def table_facts(tables: DispatchTables) -> TableFacts:
    """The tables' facts, derived on first use and kept in ``tables.derived``."""
    facts: TableFacts | None = tables.derived.get(_FACTS)
    if facts is None:
        tensors = (tables.static_LE, tables.log2phy_LER, tables.logcnt_LE, tables.cumweights_LER)
        pointers = tuple(t.data_ptr() for t in tensors)
        seed = tables.seed_1.data_ptr()
        salts = tuple(
            tuple(
                as_int32_bits(salt_base(layer, hash_rank(mode, tables.rank)))
                for layer in range(tables.num_layers)
            )
            for mode in ("static", "weighted")
        )
        facts = TableFacts(
            (pointers[0], pointers[1], pointers[2], pointers[3]),
            seed,
            tables.num_logical,
            tables.num_physical,
            (
                tables.num_logical,
                tables.num_physical,
                tables.max_replicas,
                *(p & 15 for p in (*pointers, seed)),
            ),
            (salts[0], salts[1]),
        )
        tables.derived[_FACTS] = facts
    return facts


class RemapDirectLauncher:
    """Direct launches of the remap kernel with the default launch config."""

    def __init__(
        self, launch_shape: Callable[[int, int, int], tuple[int, int, int]], cache: DirectLaunchCache
    ) -> None:
        """``launch_shape(numel, device_index, count_rows) -> (block, num_warps, grid)``: the default config's."""
        self.cache = cache
        self._launch_shape = launch_shape
        # (numel, device) -> launch shape: every MoE layer of a pass has the same T, so all but
        # the first layer's call find it here (a dict lookup instead of integer logarithms).
        self._shapes: dict[tuple[int, int, int], tuple[int, int, int]] = {}

    def launch(self, call: RemapCall) -> tuple[bool, Hashable | None]:
        """(launched, key): launched directly, or not, with the key to keep the compiled kernel under.

        The key is None where a direct launch cannot be used now (see DirectLaunchCache.usable, or
        ids on another device than the current one, where ``kernel[grid]`` decides what happens).
        The call is validated (eplb.remap.api.check_remap_args, and numel > 0).
        """
        cache = self.cache
        if not cache.usable():
            return False, None
        device, stream = cache.device_and_stream()
        ids_TK = call.topk_ids_TK
        if ids_TK.get_device() != device:
            return False, None
        tables = call.tables
        facts = tables.derived.get(_FACTS) or table_facts(tables)
        T, K = ids_TK.shape
        numel = T * K
        rows = call.count_rows()
        shape = self._shapes.get((numel, device, rows))
        if shape is None:
            if len(self._shapes) >= 4096:
                self._shapes.clear()
            shape = self._shapes[numel, device, rows] = self._launch_shape(numel, device, rows)
        grid = shape[2]
        counts_P, logical_counts_E = call.counts_P, call.logical_counts_E
        num_valid_tokens, record = call.num_valid_tokens, call.record
        p_ids = ids_TK.data_ptr()
        p_out = call.out_TK.data_ptr()
        # Absent tensors: out_TK's address, as the kernel[grid] path passes (never dereferenced).
        p_counts = p_out if counts_P is None else counts_P.data_ptr()
        p_logical = p_out if logical_counts_E is None else logical_counts_E.data_ptr()
        p_nvalid = p_out if num_valid_tokens is None else num_valid_tokens.data_ptr()
        p_record = p_out if record is None else record.data_ptr()
        mode, layer = call.mode, call.layer
        key = launch_key(
            device,
            mode,
            K,
            shape,
            numel,
            (counts_P is None, logical_counts_E is None, num_valid_tokens is None, record is None),
            (p_ids & 15, p_out & 15, p_counts & 15, p_logical & 15, p_nvalid & 15, p_record & 15),
            facts.key,
            rows,
            call.map_padded_rows,
        )
        entry = cache.get(key)
        if entry is None:
            return False, key
        pointers = (p_ids, p_out, p_counts, p_logical, p_nvalid, p_record)
        runtime_args = runtime_arguments(
            facts, pointers, numel, T, (layer, facts.salts[mode == "weighted"][layer])
        )
        try:
            entry(grid, stream, runtime_args)
        except TypeError:
            # The launcher refused the arguments before launching (a Triton whose launch
            # convention differs): use kernel[grid] from now on.
            cache.disable()
            return False, None
        return True, key

    def prepare(self, call: RemapCall) -> PreparedDirect:
        """The direct path of ``call``'s layer, its fixed arguments resolved once (ids and output vary)."""
        return PreparedDirect(self, call)


def runtime_arguments(
    facts: TableFacts,
    pointers: tuple[int, int, int, int, int, int],
    numel: int,
    num_tokens: int,
    layer_args: tuple[int, int],
) -> tuple[int, ...]:
    """The kernel's runtime arguments in order, from the ids, output and optional tensors' pointers
    (absent ones: the output's), ``numel``, T and (layer, salt bits)."""
    p_ids, p_out, p_counts, p_logical, p_nvalid, p_record = pointers
    return (
        p_ids,
        p_out,
        *facts.pointers,
        p_counts,
        p_logical,
        p_nvalid,
        p_record,
        facts.seed,
        numel,
        num_tokens,
        facts.num_logical,
        facts.num_physical,
        *layer_args,
    )


def launch_key(
    device: int,
    mode: str,
    K: int,
    shape: tuple[int, int, int],
    numel: int,
    absent: tuple[bool, bool, bool, bool],
    pointer_mods: tuple[int, int, int, int, int, int],
    tables_key: tuple[int, ...],
    count_rows: int,
    map_padded: bool,
) -> Hashable:
    """The key of one specialisation (module docstring): one definition for both launch paths."""
    return (
        device,
        mode,
        K,
        *shape[:2],
        numel == 1,
        numel & 15 == 0,
        *absent,
        *pointer_mods,
        tables_key,
        count_rows,
        map_padded,
    )


class PreparedDirect:
    """A layer's direct launch with the fixed tensors' pointers, alignment and salt resolved once.

    :meth:`launch` computes what varies per call (ids and output pointers, the launch shape of
    ``numel``) and builds the same key as :meth:`RemapDirectLauncher.launch`, so the compiled
    kernels that path keeps serve this one too.
    """

    __slots__ = (
        "_absent",
        "_cache",
        "_count_rows",
        "_facts",
        "_fixed",
        "_launcher",
        "_layer_args",
        "_map_padded",
        "_mode",
        "_shapes",
    )

    def __init__(self, launcher: RemapDirectLauncher, call: RemapCall) -> None:
        self._launcher = launcher
        self._cache = launcher.cache
        self._shapes = launcher._shapes
        tables = call.tables
        facts = self._facts = table_facts(tables)
        optional = (call.counts_P, call.logical_counts_E, call.num_valid_tokens, call.record)
        self._absent = tuple(t is None for t in optional)
        # Pointers of the given optional tensors (0 where absent: the output's, per call).
        self._fixed = tuple(0 if t is None else t.data_ptr() for t in optional)
        self._mode = call.mode
        self._count_rows = call.count_rows()
        self._map_padded = call.map_padded_rows
        self._layer_args = (call.layer, facts.salts[call.mode == "weighted"][call.layer])

    def launch(self, ids_TK: torch.Tensor, out_TK: torch.Tensor) -> bool:
        """Launch on validated int32 ids and output (same shape, ``numel > 0``); False: not launched."""
        cache = self._cache
        if not cache.usable():
            return False
        device, stream = cache.device_and_stream()
        if ids_TK.get_device() != device:
            return False
        T, K = ids_TK.shape
        numel = T * K
        shape = self._shapes.get((numel, device, self._count_rows))
        if shape is None:
            return False  # the general path computes and keeps it
        p_ids, p_out = ids_TK.data_ptr(), out_TK.data_ptr()
        p_counts, p_logical, p_nvalid, p_record = (p or p_out for p in self._fixed)
        key = launch_key(
            device,
            self._mode,
            K,
            shape,
            numel,
            self._absent,  # type: ignore[arg-type]
            (p_ids & 15, p_out & 15, p_counts & 15, p_logical & 15, p_nvalid & 15, p_record & 15),
            self._facts.key,
            self._count_rows,
            self._map_padded,
        )
        entry = cache.get(key)
        if entry is None:
            return False
        pointers = (p_ids, p_out, p_counts, p_logical, p_nvalid, p_record)
        try:
            entry(shape[2], stream, runtime_arguments(self._facts, pointers, numel, T, self._layer_args))
        except TypeError:
            cache.disable()
            return False
        return True


__all__ = [
    "PreparedDirect",
    "RemapDirectLauncher",
    "TableFacts",
    "launch_key",
    "runtime_arguments",
    "table_facts",
]
