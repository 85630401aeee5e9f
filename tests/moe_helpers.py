"""Shared by the MoE, hot-swap and manager tests (imported, not collected)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny ops on a shared 2-core machine: intra-op threads only add spin-waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rank1_fails(ctx: Any, how: str) -> int:
    """For run_ranks tests: rank 1 raises or exits abruptly; rank 0 returns its rank."""
    if ctx.rank == 1:
        if how == "raise":
            raise ValueError("boom")
        os._exit(3)
    return int(ctx.rank)
