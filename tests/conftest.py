"""Shared test setup: Triton's interpreter on CPU-only machines, the slow/gpu/interpreter marks, fixtures."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.suite import slow_reason

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

# Kernel modules read TRITON_INTERPRET when they are imported, so it is set before any test runs.
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A runner started in the background (no job control) hands its children SIGINT ignored, and the
# processes the signal tests start would inherit that and never see the Ctrl-C they are sent.
# A Python handler is reset to the default at exec, so they start with SIGINT as a terminal gives it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# First among the implementations: the slow marks must be on before ``-m`` deselects by them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark what tests/suite.py lists as ``slow`` and what installs the engines' wheels as
    ``engines``; skip ``gpu`` tests without CUDA, and ``interpreter`` tests where kernels are compiled."""
    slow, engines = pytest.mark.slow, pytest.mark.engines
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    # Interpreter-only tests pass CPU tensors or stand-ins for compiled kernels, which a compiled
    # kernel cannot take; their compiled counterparts are gpu tests.
    skip_interpreter = pytest.mark.skip(reason="needs Triton's interpreter (TRITON_INTERPRET=1)")
    interpreting = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "y", "yes")
    for item in items:
        if slow_reason(item.nodeid, getattr(item, "fixturenames", ())) is not None:
            item.add_marker(slow)
        if "engine_site" in getattr(item, "fixturenames", ()):
            item.add_marker(engines)
        if not _HAS_CUDA and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
        if not interpreting and item.get_closest_marker("interpreter") is not None:
            item.add_marker(skip_interpreter)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny ops on a shared 2-core machine: intra-op threads only add spin-waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def engine_site() -> Path:
    """vLLM 0.33.0 and SGLang 0.5.23 from PyPI in a cached folder (tests.helpers.engines); fails, never skips."""
    from tests.helpers.engines import ensure_engines

    return ensure_engines()


@pytest.fixture(scope="session")
def vllm_checks(engine_site: Path) -> dict[str, Any]:
    """What eplb's plugin did inside vLLM's own plugin loader and policy table (tests.helpers.engine_checks)."""
    from tests.helpers.engines import run_engine_checks

    return run_engine_checks(engine_site, "vllm")


@pytest.fixture(scope="session")
def sglang_checks(engine_site: Path) -> dict[str, Any]:
    """What eplb's plugin did inside SGLang's plugin loader, algorithms and fused kernel."""
    from tests.helpers.engines import run_engine_checks

    return run_engine_checks(engine_site, "sglang")
