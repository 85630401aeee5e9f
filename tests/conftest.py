"""Shared test setup: Triton's interpreter on CPU-only machines, the gpu and interpreter markers, fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

# Kernel modules read TRITON_INTERPRET when they are imported, so it is set before any test runs.
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny ops on a shared 2-core machine: intra-op threads only add spin-waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
