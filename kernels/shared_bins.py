"""Per-program count bins in shared memory, incremented with one shared-memory atomic per id (NVIDIA).

Why: the remap kernel's recording is a histogram per program. Triton up to 3.6 lowers
``tl.histogram`` to warp ballots and popcounts, about 50-100 instructions per id for 256 bins, and
offers no shared-memory atomics; at 58 layers of T = 4096..65536 that made recording cost more
than the remap itself (docs/benchmarks.md, "Remap +
record"). Here one ``red.shared.add`` per id
counts into a ``.shared`` array the helpers declare in inline PTX, and the bins are laid out by
slot, so the flush into the slot counts is contiguous (a static map's slots are a permutation,
whose scattered atomics cost more than the count).

Use, inside one ``@triton.jit`` kernel, in this order: :func:`declare` once (its ``decl`` is
:func:`declaration`'s string, a constexpr), :func:`zero` of every bin, ``tl.debug_barrier()``,
:func:`increment` per id, ``tl.debug_barrier()``, :func:`read`. PTX only: the kernel takes the
``tl.histogram`` path under the interpreter and on ROCm (:func:`shared_bins_supported`).
"""

from __future__ import annotations

import triton
import triton.language as tl

SYMBOL = "eplb_bins"
MAX_WORDS = 8192
"""Bins per program at most (32 KiB of the 48 KiB of static shared memory a CTA may declare)."""


def declaration(words: int) -> str:
    """The PTX declaring ``words`` int32 bins (the kernel's constexpr string for :func:`declare`)."""
    assert 0 < words <= MAX_WORDS, words
    return f".shared .align 16 .b32 {SYMBOL}[{words}];"


def shared_bins_supported(jit_fn: object) -> bool:
    """Whether ``jit_fn`` compiles to PTX: a compiled (not interpreted) kernel on an NVIDIA build of torch."""
    import torch
    from triton.runtime.jit import JITFunction

    return getattr(torch.version, "hip", None) is None and isinstance(jit_fn, JITFunction)


@triton.jit
def declare(decl: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton types kernel arguments itself
    # One element, so one copy of the declaration in the PTX; the result is unused.
    return tl.inline_asm_elementwise(
        decl + "\nmov.b32 $0, $1;", "=r,r", [tl.full([1], 0, tl.int32)], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def zero(index):  # type: ignore[no-untyped-def]
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, eplb_bins; mad.lo.u32 a, $1, 4, a; st.shared.u32 [a], 0; mov.b32 $0, $1; }",
        "=r,r",
        [index],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def increment(index, ok):  # type: ignore[no-untyped-def]
    # Fire-and-forget (red, not atom): nothing waits for the old value.
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; .reg .pred p; setp.ne.u32 p, $2, 0; mov.u32 a, eplb_bins; mad.lo.u32 a, $1, 4, a; "
        "@p red.shared.add.u32 [a], 1; mov.b32 $0, $1; }",
        "=r,r,r",
        [index, ok.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def read(index):  # type: ignore[no-untyped-def]
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, eplb_bins; mad.lo.u32 a, $1, 4, a; ld.shared.u32 $0, [a]; }",
        "=r,r",
        [index],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


__all__ = ["MAX_WORDS", "declaration", "declare", "increment", "read", "shared_bins_supported", "zero"]
