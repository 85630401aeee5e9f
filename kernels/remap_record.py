"""Fused logical->physical remap and load recording in one pass over ``topk_ids`` (Triton).

Shape legend: T tokens, K top-k, L layers, E logical experts, P physical slots, R max replicas (the
replica capacity).

Three layers, as everywhere in eplb: the private ``@triton.jit`` kernel, the typed launcher
:func:`remap_record_triton` (block sizes, grid, argument plumbing; it takes the
:class:`eplb.remap.call.RemapCall` that the public :func:`eplb.remap.api.remap_and_record` builds
after validating), and the public function.
The launcher's first call of each specialisation goes through ``kernel[grid]``; later ones hand
integer arguments straight to the compiled kernel's launcher (eplb.kernels.remap_record_direct),
which is what an eager prefill pass pays per MoE layer.

Persistent grid: at most ``programs_per_sm`` programs per SM stride over blocks of ``BLOCK`` ids,
each keeping private counts of physical slots (and of logical experts when asked) and flushing
them once at the end with relaxed atomics, skipping empty bins. Where the kernel compiles to PTX
the counts are shared-memory bins incremented with one atomic per id (eplb.kernels.shared_bins);
elsewhere (the interpreter, ROCm) a ``tl.histogram`` per block in registers, where static mode
keeps only the expert histogram (E bins, not P) and scatters it through the map at the flush.
The flush costs one atomic per non-empty bin per program, independent of T (a per-block flush,
as in SGLang's kernel, grows with T); since every program adds into the same addresses, and
those atomics serialise, slot counts may be count rows [C, P]: program i flushes into row i % C.

Semantics (bit-for-bit equal to eplb.remap.torch_backend) are documented in eplb.remap.api and the hash in
eplb.remap.tables.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from eplb.kernels import shared_bins
from eplb.kernels.direct_launch import DirectLaunchCache, direct_launch_supported
from eplb.kernels.remap_record_direct import PreparedDirect, RemapDirectLauncher
from eplb.remap.call import RemapCall
from eplb.remap.tables import DispatchTables, as_int32_bits, hash_rank, salt_base

MODE_IDS = {"static": 0, "dynamic": 1, "dynamic_row": 2, "fake": 3, "weighted": 4}


@triton.jit
def _mix32(x):  # type: ignore[no-untyped-def]  # Triton types kernel arguments itself
    # lowbias32 on uint32 (wrapping multiply): the same bits as eplb.remap.torch_backend.mix32.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit(do_not_specialize=["num_tokens", "num_logical", "num_physical", "layer", "salt_base_bits"])
def _remap_record_kernel(  # type: ignore[no-untyped-def]
    ids_ptr,
    out_ptr,
    static_ptr,
    log2phy_ptr,
    logcnt_ptr,
    cumw_ptr,
    counts_ptr,
    lcounts_ptr,
    nvalid_ptr,
    record_ptr,
    seed_ptr,
    numel,
    num_tokens,
    num_logical,
    num_physical,
    layer,
    salt_base_bits,
    K: tl.constexpr,
    R: tl.constexpr,
    MODE: tl.constexpr,
    SEEDED: tl.constexpr,
    BLOCK: tl.constexpr,
    PBINS: tl.constexpr,
    LBINS: tl.constexpr,
    COUNT_PHYS: tl.constexpr,
    COUNT_LOGICAL: tl.constexpr,
    PHYS_HIST: tl.constexpr,
    LOGICAL_HIST: tl.constexpr,
    HIST_MASK: tl.constexpr,
    HAS_NVALID: tl.constexpr,
    MAP_PADDED: tl.constexpr,
    HAS_RECORD: tl.constexpr,
    GATHER_MAP: tl.constexpr,
    SMEM: tl.constexpr,
    SMEM_DECL: tl.constexpr,
    COUNT_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    limit = numel
    if HAS_NVALID:
        # Clamp before multiplying so a garbage scalar cannot overflow int32.
        nvalid = tl.minimum(tl.maximum(tl.load(nvalid_ptr), 0), num_tokens)
        limit = nvalid * K
    do_count = COUNT_PHYS or COUNT_LOGICAL
    if HAS_RECORD:
        do_count = do_count & (tl.load(record_ptr) != 0)
    salt = salt_base_bits.to(tl.uint32, bitcast=True)
    if SEEDED:
        salt = salt ^ tl.load(seed_ptr).to(tl.uint32, bitcast=True)
    salt = _mix32(salt)
    table_base = layer * num_logical
    # Count rows: consecutive programs flush into different rows, so at most
    # ceil(programs / COUNT_ROWS) relaxed atomics serialise on one address.
    counts_row_ptr = counts_ptr + (pid % COUNT_ROWS) * num_physical

    pacc = tl.zeros([PBINS], dtype=tl.int32)
    lacc = tl.zeros([LBINS], dtype=tl.int32)
    lbins = tl.arange(0, LBINS)
    pbins = tl.arange(0, PBINS)
    if SMEM:
        # Bins in shared memory (eplb.kernels.shared_bins): slots at [0, PBINS), experts after.
        shared_bins.declare(SMEM_DECL)
        if COUNT_PHYS:
            shared_bins.zero(pbins)
        if COUNT_LOGICAL:
            shared_bins.zero(lbins + PBINS)
        tl.debug_barrier()
    if (MODE == 0 and GATHER_MAP) or (LOGICAL_HIST and COUNT_PHYS and not PHYS_HIST):
        # The map row the static-mode flush scatters through (and, with GATHER_MAP, the lookup
        # reads from registers), loaded now so its latency hides behind the ids' load.
        slot_of_expert = tl.load(static_ptr + table_base + lbins, mask=lbins < num_logical, other=-1)
    num_blocks = tl.cdiv(numel, BLOCK)
    for blk in range(pid, num_blocks, nprog):
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        in_bounds = offs < numel
        ids = tl.load(ids_ptr + offs, mask=in_bounds, other=-1)
        in_range = (ids >= 0) & (ids < num_logical)
        valid = in_range & (offs < limit)  # counted
        mapped = in_range if MAP_PADDED else valid  # SGLang's contract: padded rows mapped, not counted
        safe = tl.where(mapped, ids, 0)
        if MODE == 0:
            if GATHER_MAP:
                phys = tl.gather(slot_of_expert, safe, 0)
            else:
                phys = tl.load(static_ptr + table_base + safe, mask=mapped, other=0)
        elif MODE == 3:
            h = _mix32(offs.to(tl.uint32) ^ salt)
            phys = (h % num_physical.to(tl.uint32)).to(tl.int32)
        else:
            cnt = tl.load(logcnt_ptr + table_base + safe, mask=mapped, other=1)
            if MODE == 1:
                h = _mix32(offs.to(tl.uint32) ^ salt)
                replica = (h % cnt.to(tl.uint32)).to(tl.int32)
            elif MODE == 2:
                replica = (offs // K) % cnt
            else:
                h = _mix32(offs.to(tl.uint32) ^ salt)
                u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
                replica = tl.zeros([BLOCK], dtype=tl.int32)
                row_base = (table_base + safe) * R
                for r in range(R - 1):
                    use = mapped & (r < cnt - 1)
                    cw = tl.load(cumw_ptr + row_base + r, mask=use, other=2.0)
                    replica += (cw <= u).to(tl.int32)
            phys = tl.load(log2phy_ptr + (table_base + safe) * R + replica, mask=mapped, other=0)
        tl.store(out_ptr + offs, tl.where(mapped, phys, ids), mask=in_bounds)
        if do_count:
            counted = valid & (phys >= 0) & (phys < num_physical)
            if SMEM:
                if COUNT_PHYS:
                    shared_bins.increment(phys, counted)
                if COUNT_LOGICAL:
                    shared_bins.increment(safe + PBINS, counted)
            if PHYS_HIST:
                pacc += _histogram(phys, counted, PBINS, HIST_MASK)
            if LOGICAL_HIST:
                lacc += _histogram(safe, counted, LBINS, HIST_MASK)
    if do_count and SMEM:
        tl.debug_barrier()  # every warp's increments land before any warp reads the bins
        if COUNT_PHYS:
            pcnt = shared_bins.read(pbins)
            tl.atomic_add(
                counts_row_ptr + pbins, pcnt, mask=(pbins < num_physical) & (pcnt > 0), sem="relaxed"
            )
        if COUNT_LOGICAL:
            lcnt = shared_bins.read(lbins + PBINS)
            tl.atomic_add(lcounts_ptr + lbins, lcnt, mask=(lbins < num_logical) & (lcnt > 0), sem="relaxed")
    if do_count:
        if PHYS_HIST:
            tl.atomic_add(
                counts_row_ptr + pbins, pacc, mask=(pbins < num_physical) & (pacc > 0), sem="relaxed"
            )
        if LOGICAL_HIST:
            nonzero = (lbins < num_logical) & (lacc > 0)
            if COUNT_LOGICAL:
                tl.atomic_add(lcounts_ptr + lbins, lacc, mask=nonzero, sem="relaxed")
            if COUNT_PHYS and not PHYS_HIST:
                # Static mode: each expert goes to one slot, so slot counts are the expert histogram
                # scattered through the map (half the bins of a slot histogram, and one histogram for both).
                ok = nonzero & (slot_of_expert >= 0) & (slot_of_expert < num_physical)
                tl.atomic_add(counts_row_ptr + slot_of_expert, lacc, mask=ok, sem="relaxed")


@triton.jit
def _histogram(values, mask, NBINS: tl.constexpr, HIST_MASK: tl.constexpr):  # type: ignore[no-untyped-def]
    if HIST_MASK:
        hist = tl.histogram(values, NBINS, mask=mask)
    else:
        # Older Triton: park excluded values in the spare last bin, which the flush ignores.
        hist = tl.histogram(tl.where(mask, values, NBINS - 1), NBINS)
    return hist


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Block sizes and grid shape of one launch."""

    block: int
    """Ids per block (a power of two)."""
    num_warps: int
    """Warps per program."""
    programs_per_sm: int
    """Upper bound on programs per SM (persistent grid)."""
    gather_map: bool = True
    """Static mode: look ids up in the map row held in registers (``tl.gather``, Triton >= 3.2)
    instead of a dependent global load per id (0.1-0.3 µs faster per call on an H200)."""
    shared_bins: bool = True
    """Count in shared-memory bins (eplb.kernels.shared_bins) where the kernel compiles to PTX;
    False: ``tl.histogram`` in registers everywhere (the path the interpreter and ROCm take)."""


DEFAULT_PROGRAMS_PER_SM = 2


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def num_compute_units(device: torch.device) -> int:
    """SMs (CUDA) or CUs (ROCm) of ``device``; 4 on the CPU (the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


SPREAD_ROWS = 8
"""Count rows from which the flushes count as spread (:func:`default_block`)."""
FEW_PROGRAMS = 32
"""Programs aimed at when the flushes all go to one row (fewer rows than SPREAD_ROWS)."""


def default_block(numel: int, units: int, count_rows: int = 1) -> tuple[int, int]:
    """(block, num_warps) for ``numel`` ids on ``units`` compute units, 8 warps.

    Measured on an H200 with shared-memory bins (docs/benchmarks.md, "Remap + record"): every
    program's flush adds into the same addresses of its count row, and those atomics serialise,
    so the cost of the flush grows with programs per row. With SPREAD_ROWS rows or more, about
    one block of 512..2048 ids per compute unit (all of them busy); with fewer, blocks of
    512..4096 ids for about FEW_PROGRAMS programs (fewer flushes beat more SMs). 8 warps beat 4
    at every T (more warps in flight hide the shared atomics); blocks under 256 ids keep 4, since
    a block must give every thread an id (ids replicated over threads would be counted twice in
    the shared bins). Integer arithmetic only (it runs on every call).
    """
    numel = max(numel, 1)
    spread = count_rows >= SPREAD_ROWS
    per_block = -(-numel // (units if spread else FEW_PROGRAMS))
    block = min(2048 if spread else 4096, max(512, 1 << (per_block - 1).bit_length()))
    block = min(block, max(128, 1 << (numel - 1).bit_length()))
    return block, 8 if block >= 256 else 4


def programs_per_unit(count_rows: int) -> int:
    """Programs per compute unit at most in the default launch: two with spread count rows, one
    otherwise (:func:`default_block`)."""
    return DEFAULT_PROGRAMS_PER_SM if count_rows >= SPREAD_ROWS else 1


def default_config(numel: int, device: torch.device, count_rows: int = 1) -> LaunchConfig:
    """The launch config used when none is given: :func:`default_block`; two programs per unit at
    most with spread count rows, one otherwise."""
    block, num_warps = default_block(numel, num_compute_units(device), count_rows)
    return LaunchConfig(block=block, num_warps=num_warps, programs_per_sm=programs_per_unit(count_rows))


def launch_shape(numel: int, units: int, count_rows: int = 1) -> tuple[int, int, int]:
    """(block, num_warps, grid) of :func:`default_config` for ``numel`` ids on ``units`` compute units."""
    block, num_warps = default_block(numel, units, count_rows)
    return block, num_warps, max(1, min(-(-numel // block), programs_per_unit(count_rows) * units))


def default_launch(numel: int, device_index: int, count_rows: int = 1) -> tuple[int, int, int]:
    """:func:`launch_shape` on CUDA device ``device_index`` (the direct path's launch shape)."""
    return launch_shape(numel, _num_sms(device_index), count_rows)


def grid_size(numel: int, config: LaunchConfig, device: torch.device) -> int:
    """Programs to launch: one per block, capped at programs_per_sm per compute unit."""
    num_blocks = triton.cdiv(numel, config.block)
    return max(1, min(num_blocks, config.programs_per_sm * num_compute_units(device)))


# tl.histogram takes a mask since Triton 3.3; before, excluded ids go to a spare bin.
HIST_MASK = "mask" in inspect.signature(tl.histogram).parameters
HAS_GATHER = hasattr(tl, "gather")  # Triton >= 3.2
MAX_NUMEL = 2**31 - 2**16


def _num_bins(n: int) -> int:
    # At least a warp's width (tl.histogram's lowering needs it); a spare bin without mask support.
    return max(32, triton.next_power_of_2(n if HIST_MASK else n + 1))


def constexpr_args(
    K: int,
    tables: DispatchTables,
    mode: str,
    block: int,
    flags: tuple[bool, bool, bool, bool],
    gather_map: bool = False,
    shared: bool = False,
    count_rows: int = 1,
    map_padded: bool = False,
) -> tuple[int | bool | str, ...]:
    """The kernel's compile-time arguments, in order (K .. COUNT_ROWS).

    ``flags``: whether slot counts, logical counts, ``num_valid_tokens`` and ``record`` are given.
    ``map_padded``: rows at or past ``num_valid_tokens`` are mapped too (RemapCall.map_padded_rows).
    ``shared``: count in shared-memory bins where they fit (the caller knows the kernel compiles to PTX).
    ``count_rows``: rows of the slot counts (RemapCall.count_rows).
    """
    count_phys, count_logical, has_nvalid, has_record = flags
    pbins, lbins = _num_bins(tables.num_physical), _num_bins(tables.num_logical)
    words = pbins + lbins
    smem = shared and (count_phys or count_logical) and words <= shared_bins.MAX_WORDS
    return (
        K,
        tables.max_replicas,
        MODE_IDS[mode],
        mode in ("dynamic", "fake"),
        block,
        pbins,
        lbins,
        count_phys,
        count_logical,
        not smem and count_phys and mode != "static",
        not smem and (count_logical or (count_phys and mode == "static")),
        HIST_MASK,
        has_nvalid,
        map_padded and has_nvalid,
        has_record,
        gather_map and mode == "static" and HAS_GATHER,
        smem,
        shared_bins.declaration(words) if smem else "",
        count_rows,
    )


def salt_bits(tables: DispatchTables, layer: int, mode: str) -> int:
    """The kernel's ``salt_base_bits`` argument (rank -1 in weighted mode: rank-invariant)."""
    return as_int32_bits(salt_base(layer, hash_rank(mode, tables.rank)))


def remap_record_triton(call: RemapCall, config: LaunchConfig | None = None) -> None:
    """Launch the fused kernel on one call (validated by eplb.remap.api.remap_and_record).

    With the default config, launches after the first of each specialisation go straight to the
    compiled kernel's launcher (eplb.kernels.remap_record_direct); otherwise through ``kernel[grid]``.
    """
    ids_TK, out_TK = call.topk_ids_TK, call.out_TK
    numel = ids_TK.numel()
    if numel == 0:
        return
    if config is not None and config.shared_bins and SHARED_BINS and config.block < 32 * config.num_warps:
        # Fewer ids than threads: Triton replicates ids over threads, and shared bins would count each copy.
        raise ValueError(f"block {config.block} gives some of the {32 * config.num_warps} threads no id")
    if numel >= MAX_NUMEL:
        raise ValueError(f"topk_ids has {numel} elements; the kernel indexes with int32 (< 2**31)")
    if ids_TK.dtype != torch.int32 or out_TK.dtype != torch.int32:
        raise TypeError(f"topk_ids and out must be int32, got {ids_TK.dtype} and {out_TK.dtype}")
    direct_key = None
    if config is None:
        launched, direct_key = DIRECT.launch(call)
        if launched:
            return
    device = ids_TK.device
    cfg = config or default_config(numel, device, call.count_rows())
    runtime, constexprs = kernel_args(call, cfg.block, cfg.gather_map, cfg.shared_bins)
    grid = grid_size(numel, cfg, device)
    compiled = _remap_record_kernel[(grid,)](*runtime, *constexprs, num_warps=cfg.num_warps)
    if direct_key is not None:
        DIRECT.cache.keep(direct_key, compiled, constexprs)


def kernel_args(
    call: RemapCall, block: int, gather_map: bool = True, shared: bool = True
) -> tuple[tuple[Any, ...], tuple[int | bool | str, ...]]:
    """The kernel's arguments in order: (runtime arguments, compile-time arguments).

    Absent optional tensors are replaced by ``call.out_TK``, never dereferenced (their flag is off).
    ``shared``: shared-memory bins where this kernel compiles to PTX (:data:`SHARED_BINS`).
    """
    tables, out_TK = call.tables, call.out_TK
    T, K = call.topk_ids_TK.shape
    optional = (call.counts_P, call.logical_counts_E, call.num_valid_tokens, call.record)
    runtime = (
        call.topk_ids_TK,
        out_TK,
        tables.static_LE,
        tables.log2phy_LER,
        tables.logcnt_LE,
        tables.cumweights_LER,
        *(out_TK if t is None else t for t in optional),
        tables.seed_1,
        T * K,
        T,
        tables.num_logical,
        tables.num_physical,
        call.layer,
        salt_bits(tables, call.layer, call.mode),
    )
    flags = (
        call.counts_P is not None,
        call.logical_counts_E is not None,
        call.num_valid_tokens is not None,
        call.record is not None,
    )
    return runtime, constexpr_args(
        K,
        tables,
        call.mode,
        block,
        flags,
        gather_map,
        shared and SHARED_BINS,
        call.count_rows(),
        call.map_padded_rows,
    )


SHARED_BINS = shared_bins.shared_bins_supported(_remap_record_kernel)
"""Whether the kernel counts in shared-memory bins (compiled for NVIDIA; not the interpreter, not ROCm)."""

DIRECT = RemapDirectLauncher(default_launch, DirectLaunchCache(direct_launch_supported(_remap_record_kernel)))
"""Direct launches of the default config (disabled under the interpreter, on ROCm, with hooks)."""


def prepare_direct(call: RemapCall) -> PreparedDirect | None:
    """``call``'s layer on the direct path with its fixed arguments resolved (eplb.remap.prepared);
    None where direct launches are off (the interpreter, ROCm)."""
    if not DIRECT.cache.usable():
        return None
    return DIRECT.prepare(call)


__all__ = [
    "DIRECT",
    "MODE_IDS",
    "SHARED_BINS",
    "LaunchConfig",
    "constexpr_args",
    "default_block",
    "default_config",
    "default_launch",
    "grid_size",
    "kernel_args",
    "launch_shape",
    "prepare_direct",
    "remap_record_triton",
]
