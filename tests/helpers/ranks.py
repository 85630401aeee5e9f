"""Functions the multi-rank tests run on each rank (real processes pickle them by module name)."""

from __future__ import annotations

import os
from typing import Any


def rank1_fails(ctx: Any, how: str) -> int:
    """For run_ranks tests: rank 1 raises or exits abruptly; rank 0 returns its rank."""
    if ctx.rank == 1:
        if how == "raise":
            raise ValueError("boom")
        os._exit(3)
    return int(ctx.rank)
