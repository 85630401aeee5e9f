"""Launching the ``lp`` kernels (eplb.kernels.remap_lp): shapes, scratch, the exchange between them.

Shape legend: T tokens, K top-k, E logical experts, P physical slots, G GPUs (EP ranks), X
replicated experts, C count rows (one per program).

:func:`remap_record_lp_triton` zeroes the rank's counts, runs the count kernel, the exchange
(eplb.remap.exchange.LpExchange) and the assign kernel, all on the current stream: the launch
shapes depend only on T and the tables' shapes, so the whole call captures in a CUDA graph (with
an NCCL group). After the first call of each specialisation both kernels launch directly
(eplb.kernels.direct_launch), so an eager call pays two launcher calls, not two ``JITFunction.run``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from eplb.kernels.direct_launch import DirectLaunchCache, direct_launch_supported
from eplb.kernels.remap_lp import COUNT_BLOCK, MAX_PROGRAMS, SUB, _lp_assign_kernel, _lp_count_kernel
from eplb.kernels.remap_record import HIST_MASK, MAX_NUMEL, _num_bins, num_compute_units
from eplb.remap.call import RemapCall
from eplb.remap.exchange import LpExchange
from eplb.remap.lp_rule import LP_PASSES


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(n, 1)))


def lp_launch_shape(numel: int, units: int) -> tuple[int, int]:
    """(chunk, programs): contiguous chunks of a multiple of SUB ids, at most 2 per compute unit."""
    target = max(1, min(MAX_PROGRAMS, 2 * units))
    blocks = triton.cdiv(numel, SUB)
    chunk = SUB * triton.cdiv(blocks, target)
    return chunk, triton.cdiv(numel, chunk)


def remap_record_lp_triton(call: RemapCall) -> None:
    """Run ``lp`` dispatch of one call (validated by eplb.remap.api.remap_and_record, ``T * K > 0``)."""
    ids_TK, out_TK, tables, lp = call.topk_ids_TK, call.out_TK, call.tables, call.lp
    assert lp is not None and tables.lp_expert_LX is not None and tables.lp_slot_LXG is not None
    assert (
        tables.lp_index_LE is not None and tables.lp_colors_L is not None and tables.lp_cover_LXG is not None
    )
    numel = ids_TK.numel()
    if numel >= MAX_NUMEL:
        raise ValueError(f"topk_ids has {numel} elements; the kernel indexes with int32 (< 2**31)")
    T, K = ids_TK.shape
    E, P, G = tables.num_logical, tables.num_physical, tables.num_gpus
    X = tables.lp_slot_LXG.shape[1]
    ebins, nbins, gbins = _num_bins(E), _pow2(X), _pow2(G)
    chunk, programs = lp_launch_shape(numel, num_compute_units(ids_TK.device))
    hist_CE, starts_XG = _scratch(lp, ebins, nbins, gbins)
    optional = (call.counts_row_P(), call.logical_counts_E, call.num_valid_tokens, call.record)
    counts, lcounts, nvalid, record = (out_TK if t is None else t for t in optional)
    has_nvalid, has_record = call.num_valid_tokens is not None, call.record is not None
    lp.local_E.zero_()
    COUNT.launch(
        programs,
        (ids_TK, tables.static_LE, tables.lp_index_LE, lp.local_E, hist_CE, counts, lcounts, nvalid, record),
        (numel, T, E, P, call.layer, chunk),
        # K, BLOCK, EBINS, COUNT_PHYS, COUNT_LOGICAL, HAS_NVALID, HAS_RECORD, HIST_MASK
        (
            K,
            min(COUNT_BLOCK, triton.next_power_of_2(chunk)),
            ebins,
            call.counts_P is not None,
            call.logical_counts_E is not None,
            has_nvalid,
            has_record,
            HIST_MASK,
        ),
    )
    lp.exchange()
    ASSIGN.launch(
        programs,
        (
            ids_TK,
            out_TK,
            tables.static_LE,
            tables.lp_index_LE,
            tables.lp_expert_LX,
            tables.lp_slot_LXG,
            tables.lp_colors_L,
            tables.lp_cover_LXG,
            lp.gathered_GE,
            hist_CE,
            starts_XG,
            counts,
            nvalid,
            record,
        ),
        (numel, T, E, P, G, tables.slots_per_gpu, tables.rank, call.layer, chunk),
        # K, X, SUB, EBINS, GBINS, LOG2_GBINS, NBINS, CBINS, PASSES, COUNT_PHYS, HAS_NVALID, HAS_RECORD
        (
            K,
            X,
            SUB,
            ebins,
            gbins,
            gbins.bit_length() - 1,
            nbins,
            _pow2(programs),
            LP_PASSES,
            call.counts_P is not None,
            has_nvalid,
            has_record,
        ),
    )


class _Launcher:
    """One of the two kernels: ``kernel[grid]`` the first time per specialisation, then direct.

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
        self, grid: int, tensors: tuple[torch.Tensor, ...], ints: tuple[int, ...], constexprs: tuple[Any, ...]
    ) -> None:
        cache = self.cache
        key = None
        if cache.usable():
            device, stream = cache.device_and_stream()
            if tensors[0].get_device() == device:
                pointers = tuple(t.data_ptr() for t in tensors)
                key = (device, self.num_warps, constexprs, tuple(p & 15 for p in pointers))
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
            *tensors, *ints, **dict(zip(names, constexprs, strict=True)), num_warps=self.num_warps
        )
        if key is not None:
            cache.keep(key, compiled, constexprs)


COUNT = _Launcher(_lp_count_kernel)
ASSIGN = _Launcher(_lp_assign_kernel)


def _scratch(lp: LpExchange, ebins: int, nbins: int, gbins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' scratch (per-program histograms [C, E] and quota starts [X, G]), made once."""
    hist = lp.scratch.get("hist_CE")
    if hist is None:
        device = lp.local_E.device
        hist = lp.scratch["hist_CE"] = torch.zeros((MAX_PROGRAMS, ebins), dtype=torch.int32, device=device)
        lp.scratch["starts_XG"] = torch.zeros((nbins, gbins), dtype=torch.int32, device=device)
    return hist, lp.scratch["starts_XG"]


__all__ = ["ASSIGN", "COUNT", "lp_launch_shape", "remap_record_lp_triton"]
