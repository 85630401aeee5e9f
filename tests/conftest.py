"""Shared test setup: Triton's interpreter on CPU-only machines, the gpu marker, random placements."""

from __future__ import annotations

import os

import numpy as np
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


def random_phy2log(
    rng: np.random.Generator, num_layers: int, num_logical: int, num_physical: int
) -> np.ndarray:
    """int32 [L, P]: every expert at least once, extra replicas drawn at random, slots shuffled."""
    rows = []
    for _ in range(num_layers):
        extra = rng.integers(0, num_logical, size=num_physical - num_logical)
        rows.append(rng.permutation(np.concatenate([np.arange(num_logical), extra])))
    return np.asarray(rows, dtype=np.int32).reshape(num_layers, num_physical)
