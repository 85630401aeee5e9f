"""Run one function per rank in real processes (spawned), for the multi-rank Gloo tests."""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_spawned(target: Callable[..., Any], world: int, *args: Any, timeout: float = 150) -> None:
    """``target(rank, *args)`` in ``world`` processes; fails if one hangs (a collective never completes)
    or exits non-zero."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.terminate()
        p.join(5)
    assert not hung, "a rank hung (a collective did not complete)"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
