"""The check before a hot-swap moves anything: every rank runs the same swap and can stage it.

Each rank publishes one value through the swap's control (eplb.hotswap.control): a digest of the
swap's input, its shape, whether it could allocate its staging, and a problem of its own (a
placement of another shape). Every rank gets every value and reaches the same verdict, so a rank
that alone got another placement makes every rank refuse the swap with a
:class:`HotSwapShapeError` naming it, before any byte moves and with the group still usable.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eplb.hotswap.control import Cause


class HotSwapShapeError(ValueError):
    """A swap refused before anything moved: a rank's placements or slot buffers do not fit it.

    A ValueError (the caller passed placements or buffers of the wrong shape) with the swap's
    cause, ``shape``, and the rank it names (None: unknown). After the check (collective), every
    rank raises it alike and the group stays usable; ``prepare_swap(check=False)`` raises it on the
    rank that found it only.
    """

    cause: Cause = "shape"

    def __init__(self, message: str, *, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True, kw_only=True)
class CheckValue:
    """One rank's side of the check."""

    fingerprint: int
    """A 32-bit digest of the swap's input (placements, layers, options)."""
    shape: str
    """The swap's shapes: placements, topology, layers, bytes per expert."""
    staged: bool
    """The staging buffer could be allocated."""
    problem: str | None = None
    """Why this rank cannot run the swap at all (a shape error found locally)."""

    def encode(self) -> str:
        return json.dumps([self.fingerprint, self.shape, self.staged, self.problem])

    @classmethod
    def decode(cls, text: str) -> CheckValue:
        fingerprint, shape, staged, problem = json.loads(text)
        return cls(fingerprint=fingerprint, shape=shape, staged=staged, problem=problem)


def verdict(values: Sequence[CheckValue], staging_bytes: int) -> None:
    """Raise on every rank unless every rank runs this swap and staged it: HotSwapShapeError (a
    rank's shapes), ValueError (ranks plan different swaps) or RuntimeError (no staging memory)."""
    for r, v in enumerate(values):
        if v.problem is not None:
            raise HotSwapShapeError(f"shape: rank {r} cannot run this hot-swap: {v.problem}", rank=r)
    odd, usual = _odd_one([v.shape for v in values])
    if odd is not None:
        raise HotSwapShapeError(
            f"shape: rank {odd} swaps {values[odd].shape}, rank {usual} swaps {values[usual].shape}",
            rank=odd,
        )
    odd, usual = _odd_one([v.fingerprint for v in values])
    if odd is not None:
        raise ValueError(
            f"ranks disagree on the placements or layers of this hot-swap: rank {odd} differs from rank {usual}"
        )
    short = [r for r, v in enumerate(values) if not v.staged]
    if short:
        raise RuntimeError(f"rank(s) {short} could not allocate {staging_bytes} bytes of swap staging")


def _odd_one(keys: Sequence[object]) -> tuple[int | None, int]:
    """(the first rank whose key differs from the most common one, or None; a rank with that one)."""
    common = Counter(keys).most_common(1)[0][0]  # ties: the key seen first (the lowest rank's)
    return next((r for r, k in enumerate(keys) if k != common), None), list(keys).index(common)


def fingerprint(
    cur_LP: np.ndarray, tgt_LP: np.ndarray, layers: tuple[int, ...], options: Sequence[float]
) -> int:
    """A 32-bit digest of the swap's input, to check that every rank plans the same swap."""
    digest = zlib.crc32(np.ascontiguousarray(cur_LP, dtype=np.int32).tobytes())
    digest = zlib.crc32(np.ascontiguousarray(tgt_LP, dtype=np.int32).tobytes(), digest)
    digest = zlib.crc32(np.asarray(options, dtype=np.float64).tobytes(), digest)
    return zlib.crc32(np.asarray(layers, dtype=np.int64).tobytes(), digest)
