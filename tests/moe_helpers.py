"""Shared by the MoE, hot-swap and manager tests (imported, not collected)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny ops on a shared 2-core machine: intra-op threads only add spin-waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
