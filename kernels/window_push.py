"""The recorder's end of pass in one launch: sum a pass's count rows into a window row, zero the rows.

Shape legend: L layers, C count rows, P physical slots.

The recorder's kernels add each pass's slot counts into C count rows ``[L, C, P]`` (fewer atomics
on one address); at the end of a pass the stat window keeps their sum over C as one row ``[L, P]``
and the rows start the next pass at zero. In torch that is two device ops (a sum into the row and
a fill), each paying the host cost of a torch op on every pass; here it is one kernel, launched
directly after its first call (eplb.kernels.direct_launch), so the recorder's per-pass host cost
stays small (docs/benchmarks.md, "Recorder host cost"). Integer sums: the row equals
``pass_counts_LCP.sum(dim=1)`` bit for bit.

Three layers: the private ``@triton.jit`` kernel, the typed launcher :class:`WindowPush` (checks once per recorder), and the
caller, eplb.recorder.buffers.StatWindow (torch on other devices).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eplb.kernels.direct_launch import DirectLaunchCache, direct_launch_supported

BLOCK = 1024
"""Window entries per program."""
NUM_WARPS = 4


@triton.jit(do_not_specialize=["numel", "num_physical"])
def _window_push_kernel(  # type: ignore[no-untyped-def]  # Triton types kernel arguments itself
    rows_ptr,
    out_ptr,
    numel,
    num_physical,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
    ZERO: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    layer = offs // num_physical
    src = rows_ptr + (offs + layer * ((C - 1) * num_physical))  # [l, c, p] at (l * C + c) * P + p
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for c in tl.static_range(C):
        acc += tl.load(src + c * num_physical, mask=mask, other=0)
    tl.store(out_ptr + offs, acc, mask=mask)
    if ZERO:
        # Every load of the program before any zero: the compiler may give a zero store to another
        # thread than the load of the same entry (seen on the H200 as lost counts without it).
        tl.debug_barrier()
        for c in tl.static_range(C):
            tl.store(src + c * num_physical, tl.zeros([BLOCK], dtype=tl.int32), mask=mask)


_CACHE = DirectLaunchCache(direct_launch_supported(_window_push_kernel))


class WindowPush:
    """Pushes of one recorder's count rows into the rows of its window, checked once.

    ``rows_LCP`` int32 [L, C, P] and ``window_WLP`` int32 [W, L, P], contiguous, on one device, not
    overlapping. A call ``push(w, zero=...)`` sets ``window_WLP[w] = rows_LCP.sum(dim=1)`` (exact
    int32) and then zeroes ``rows_LCP`` when ``zero``: one launch, no host sync.
    """

    def __init__(self, rows_LCP: torch.Tensor, window_WLP: torch.Tensor) -> None:
        if rows_LCP.dtype != torch.int32 or window_WLP.dtype != torch.int32:
            raise ValueError(f"need int32 count rows and window, got {rows_LCP.dtype} and {window_WLP.dtype}")
        if (
            rows_LCP.dim() != 3
            or window_WLP.dim() != 3
            or window_WLP.shape[1:]
            != (
                rows_LCP.shape[0],
                rows_LCP.shape[2],
            )
        ):
            raise ValueError(
                f"need rows [L, C, P] and a window [W, L, P], got {tuple(rows_LCP.shape)} and {tuple(window_WLP.shape)}"
            )
        if (
            not (rows_LCP.is_contiguous() and window_WLP.is_contiguous())
            or rows_LCP.device != window_WLP.device
        ):
            raise ValueError("count rows and window must be contiguous and on one device")
        L, C, P = rows_LCP.shape
        if C * L * P >= 2**31:
            raise ValueError(f"{L} x {C} x {P} count rows are too many for int32 offsets")
        self.rows_LCP = rows_LCP
        self._window_rows = list(window_WLP.unbind(0))
        self._C, self._P, self._numel = C, P, L * P
        self._grid = triton.cdiv(L * P, BLOCK)
        self._src = rows_LCP.data_ptr()
        self._dst = [row.data_ptr() for row in self._window_rows]
        self._device = rows_LCP.get_device() if rows_LCP.device.type == "cuda" else None

    def __call__(self, w: int, *, zero: bool) -> None:
        if self._numel == 0:
            return
        cache = _CACHE
        key = None
        if self._device is not None and cache.usable():
            device, stream = cache.device_and_stream()
            if device == self._device:
                src, dst = self._src, self._dst[w]
                key = (device, self._C, zero, src & 15, dst & 15)
                entry = cache.get(key)
                if entry is not None:
                    entry(self._grid, stream, (src, dst, self._numel, self._P))
                    return
        compiled = _window_push_kernel[(self._grid,)](
            self.rows_LCP,
            self._window_rows[w],
            self._numel,
            self._P,
            C=self._C,
            BLOCK=BLOCK,
            ZERO=bool(zero),
            num_warps=NUM_WARPS,
        )
        if key is not None:
            cache.keep(key, compiled, (self._C, BLOCK, bool(zero)))


__all__ = ["BLOCK", "WindowPush"]
