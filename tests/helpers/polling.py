"""Waiting in tests for a condition another thread or process brings about."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout_s: float = 5.0) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout_s``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "condition never held"
        time.sleep(0.01)
    return time.monotonic() - start
