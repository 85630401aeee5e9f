"""Launching the ``lp`` kernels (eplb.kernels.remap_lp): shapes, scratch, the exchange between them.

Shape legend: T tokens, K top-k, E logical experts, P physical slots, G GPUs (EP ranks), X
replicated experts, C count rows (one per program).

:func:`remap_record_lp_triton` runs the count kernel, the exchange
(eplb.remap.exchange.LpExchange), the quota kernel and the map kernel, all on the current stream
(the rank's counts ``local_E`` are zero between calls: the quota kernel zeroes them):
the launch shapes depend only on T and the tables' shapes, so the whole call captures in a CUDA
graph (with an NCCL group). After the first call of each specialisation every kernel launches
directly (eplb.kernels.direct_launch), so an eager call pays three launcher calls, not three
``JITFunction.run``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from eplb.kernels import shared_bins
from eplb.kernels.direct_launch import DirectLaunchCache, direct_launch_supported
from eplb.kernels.remap_lp import (
    COUNT_BLOCK,
    MAX_PROGRAMS,
    SUB,
    _lp_count_kernel,
    _lp_map_kernel,
    _lp_quota_kernel,
)
from eplb.kernels.remap_record import HAS_GATHER, HIST_MASK, MAX_NUMEL, _num_bins, num_compute_units
from eplb.remap.call import RemapCall
from eplb.remap.exchange import LpExchange
from eplb.remap.lp_rule import LP_PASSES, LP_SCALE_ROUNDS

SHARED_BINS = shared_bins.shared_bins_supported(_lp_count_kernel)
"""Whether the count kernel counts in shared-memory bins (it compiles to PTX, not interpreted)."""
GATHER_MAP = HAS_GATHER
"""Whether the map kernel keeps its program's map in registers (``tl.gather``, Triton >= 3.2)
instead of two dependent global loads per id; the tests run both forms."""


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(n, 1)))


LP_PROGRAMS = 32
"""Programs the count and the map kernel aim at: every count program's flush adds into the same
``local_E`` and slot-count addresses, and those atomics serialise, so few programs beat many
(256 programs of 128 ids cost 7.9 µs per count launch at T = 4096 on an H200)."""
LP_MAX_CHUNK = 4096
"""Ids per program at most; more programs beyond ``LP_PROGRAMS * LP_MAX_CHUNK`` ids."""
COUNT_WIDE_WARPS = 8
"""Warps of the count kernel when its block gives every thread an id (more warps in flight hide
the shared-memory atomics, as for the static kernel); 4 below."""


def lp_launch_shape(numel: int, units: int) -> tuple[int, int]:
    """(chunk, programs): contiguous chunks of a multiple of SUB ids, about ``LP_PROGRAMS``
    programs (more where a chunk would pass ``LP_MAX_CHUNK``), at most 2 per compute unit."""
    blocks = triton.cdiv(numel, SUB)
    wanted = max(LP_PROGRAMS, triton.cdiv(numel, LP_MAX_CHUNK))
    target = max(1, min(MAX_PROGRAMS, 2 * units, wanted))
    chunk = SUB * triton.cdiv(blocks, target)
    return chunk, triton.cdiv(numel, chunk)


def remap_record_lp_triton(call: RemapCall) -> None:
    """Run ``lp`` dispatch of one call (validated by eplb.remap.api.remap_and_record, ``T * K > 0``)."""
    ids_TK, out_TK, tables, lp = call.topk_ids_TK, call.out_TK, call.tables, call.lp
    assert lp is not None and tables.lp_expert_LX is not None and tables.lp_slot_LXG is not None
    assert (
        tables.lp_index_LE is not None and tables.lp_colors_L is not None and tables.lp_color_LX is not None
    )
    numel = ids_TK.numel()
    if numel >= MAX_NUMEL:
        raise ValueError(f"topk_ids has {numel} elements; the kernel indexes with int32 (< 2**31)")
    T, K = ids_TK.shape
    E, P, G = tables.num_logical, tables.num_physical, tables.num_gpus
    X = tables.lp_slot_LXG.shape[1]
    ebins, nbins, gbins = _num_bins(E), _pow2(X), _pow2(G)
    chunk, programs = lp_launch_shape(numel, num_compute_units(ids_TK.device))
    hist_CE, before_CX, starts_XG = _scratch(lp, ebins, nbins, gbins)
    optional = (call.counts_row_P(), call.logical_counts_E, call.num_valid_tokens, call.record)
    counts, lcounts, nvalid, record = (out_TK if t is None else t for t in optional)
    has_nvalid, has_record = call.num_valid_tokens is not None, call.record is not None
    block = min(COUNT_BLOCK, triton.next_power_of_2(chunk))
    count_warps = COUNT_WIDE_WARPS if block >= 32 * COUNT_WIDE_WARPS else COUNT.num_warps
    # Fewer ids than threads would replicate ids over threads, and shared bins count each copy.
    smem = SHARED_BINS and ebins <= shared_bins.MAX_WORDS and block >= 32 * count_warps
    # lp.local_E is zero here: the quota kernel of the call before zeroed it (one launch fewer).
    COUNT.launch(
        programs,
        (ids_TK, tables.static_LE, tables.lp_index_LE, lp.local_E, hist_CE, counts, lcounts, nvalid, record),
        (numel, T, E, P, call.layer, chunk),
        # K, BLOCK, EBINS, COUNT_PHYS, COUNT_LOGICAL, HAS_NVALID, HAS_RECORD, HIST_MASK, SMEM, SMEM_DECL
        (
            K,
            block,
            ebins,
            call.counts_P is not None,
            call.logical_counts_E is not None,
            has_nvalid,
            has_record,
            HIST_MASK,
            smem,
            shared_bins.declaration(ebins) if smem else "",
        ),
        count_warps,
    )
    try:
        lp.exchange()
    except BaseException:
        lp.local_E.zero_()  # keep it zero for the next call, which counts into it
        raise
    QUOTA.launch(
        1,
        (
            tables.static_LE,
            tables.lp_index_LE,
            tables.lp_expert_LX,
            tables.lp_slot_LXG,
            tables.lp_colors_L,
            tables.lp_color_LX,
            lp.gathered_GE,
            lp.local_E,
            hist_CE,
            before_CX,
            starts_XG,
            counts,
            record,
        ),
        (E, P, G, tables.slots_per_gpu, tables.rank, call.layer, programs),
        # X, EBINS, GBINS, NBINS, CBINS, SCALE_ROUNDS, PASSES, COUNT_PHYS, HAS_RECORD
        (
            X,
            ebins,
            gbins,
            nbins,
            _pow2(programs),
            LP_SCALE_ROUNDS,
            LP_PASSES,
            call.counts_P is not None,
            has_record,
        ),
    )
    MAP.launch(
        programs,
        (
            ids_TK,
            out_TK,
            tables.static_LE,
            tables.lp_index_LE,
            tables.lp_expert_LX,
            tables.lp_slot_LXG,
            lp.gathered_GE,
            hist_CE,
            before_CX,
            starts_XG,
            _direct(lp, nbins),
            nvalid,
        ),
        (numel, T, E, G, tables.rank, call.layer, chunk),
        # K, X, BLOCK, EBINS, GBINS, LOG2_GBINS, NBINS, HAS_NVALID, GATHER_MAP
        (K, X, block, ebins, gbins, gbins.bit_length() - 1, nbins, has_nvalid, GATHER_MAP),
    )


class _Launcher:
    """One of the kernels: ``kernel[grid]`` the first time per specialisation, then direct.

    Every integer argument is unspecialised (``do_not_specialize``), so a specialisation is the
    device, the warps, the constexprs and each pointer's 16-byte alignment
    (eplb.kernels.direct_launch).
    """

    def __init__(self, kernel: Any, num_warps: int = 4) -> None:
        self.kernel = kernel
        self.num_warps = num_warps
        """Warps per program (part of the specialisation; the benchmark's sweep varies it)."""
        self.cache = DirectLaunchCache(direct_launch_supported(kernel))

    def launch(
        self,
        grid: int,
        tensors: tuple[torch.Tensor, ...],
        ints: tuple[int, ...],
        constexprs: tuple[Any, ...],
        num_warps: int | None = None,
    ) -> None:
        """Launch ``grid`` programs (``num_warps`` warps each; None: ``self.num_warps``)."""
        warps = self.num_warps if num_warps is None else num_warps
        cache = self.cache
        key = None
        if cache.usable():
            device, stream = cache.device_and_stream()
            if tensors[0].get_device() == device:
                pointers = tuple(t.data_ptr() for t in tensors)
                key = (device, warps, constexprs, tuple(p & 15 for p in pointers))
                entry = cache.get(key)
                if entry is not None:
                    try:
                        entry(grid, stream, (*pointers, *ints))
                        return
                    except TypeError:
                        cache.disable()
                        key = None
        names = self.kernel.arg_names[len(tensors) + len(ints) :]
        compiled = self.kernel[(grid,)](
            *tensors, *ints, **dict(zip(names, constexprs, strict=True)), num_warps=warps
        )
        if key is not None:
            cache.keep(key, compiled, constexprs)


COUNT = _Launcher(_lp_count_kernel)
QUOTA = _Launcher(_lp_quota_kernel, num_warps=8)
"""One program; 8 warps measured faster than 2 and 4 (docs/benchmarks.md, "lp on 58 solved layers")."""
MAP = _Launcher(_lp_map_kernel)


def _direct(lp: LpExchange, nbins: int) -> torch.Tensor:
    """The map kernel's per-program table and list of split experts (int32 [C, 2X]), made once."""
    direct = lp.scratch.get("direct_C2X")
    if direct is None or direct.shape[1] != 2 * nbins:
        direct = lp.scratch["direct_C2X"] = torch.zeros(
            (MAX_PROGRAMS, 2 * nbins), dtype=torch.int32, device=lp.local_E.device
        )
    return direct


def _scratch(
    lp: LpExchange, ebins: int, nbins: int, gbins: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' scratch (per-program histograms [C, E], their scan over programs [C, X] and
    quota starts [X, G]), made once."""
    hist = lp.scratch.get("hist_CE")
    if hist is None:
        device = lp.local_E.device
        hist = lp.scratch["hist_CE"] = torch.zeros((MAX_PROGRAMS, ebins), dtype=torch.int32, device=device)
        lp.scratch["before_CX"] = torch.zeros((MAX_PROGRAMS, nbins), dtype=torch.int32, device=device)
        lp.scratch["starts_XG"] = torch.zeros((nbins, gbins), dtype=torch.int32, device=device)
    return hist, lp.scratch["before_CX"], lp.scratch["starts_XG"]


__all__ = ["COUNT", "MAP", "QUOTA", "lp_launch_shape", "remap_record_lp_triton"]
