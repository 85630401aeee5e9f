"""Run one function per rank in real processes (spawned), for the multi-rank Gloo tests."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any


def rendezvous(folder: str | Path) -> str:
    """A fresh file rendezvous in ``folder`` for one spawned group: no TCP port to pick, so no other
    process on the machine can take it between the pick and the bind (EADDRINUSE under load)."""
    return f"file://{Path(folder).resolve() / f'rendezvous-{uuid.uuid4().hex}'}"


def init_gloo(init: str, rank: int, world: int, timeout_s: float = 60) -> None:
    """Join the Gloo group of :func:`rendezvous` ``init`` as ``rank`` of ``world`` (in a spawned rank)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


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
