"""Run one function on several local ranks joined by torch.distributed, never hanging the caller.

Gloo on CPU (several processes on one machine) or NCCL with one GPU per rank. Every rank gets a
:class:`RankContext`; results come back through a queue and must pickle. A rank that raises makes
:func:`run_ranks` end every other rank and raise with that rank's traceback; a rank process that
dies (killed, or ending without a result) raises :class:`RankDied`, whose message is one line
saying which rank and how, also when its peers' collectives fail because of it; a run past
``timeout_s`` ends all ranks and raises ``TimeoutError``. Collectives inherit the same timeout
(``init_process_group(timeout=...)``), so a rank stuck in one also fails instead of waiting forever.
With ``rank0_in_process`` rank 0 runs on a thread of the caller's process while the caller's
thread watches the spawned ranks, so a rank that dies early ends the run at once.

The rendezvous store is hosted by the caller (as torchrun's agent hosts it), so it outlives any
rank: fault tests let ranks in ``may_die`` end abruptly (``os._exit``) and read the store after.
A rank leaves its process group on a deadline, so one whose group was given up (operations
still posted) does not hang its exit.

Spawned ranks ignore Ctrl-C (SIGINT; blocked from their start): a terminal sends it to every
process of the group, and a rank that raised KeyboardInterrupt in its start-up or in a collective
would print its traceback and leave its peers waiting. The caller gets it too, and a
KeyboardInterrupt in the caller (SIGTERM turned into one included, eplb.commands.common) kills
every spawned rank at once and re-raises, without waiting for rank 0's thread, which is left to
fail in its collective.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """Where one rank runs."""

    rank: int
    """This process's rank in [0, world_size)."""
    world_size: int
    """Number of ranks (EP size)."""
    device: torch.device
    """cpu for Gloo, cuda:<rank> for NCCL."""
    backend: str
    """gloo | nccl."""


class RankDied(RuntimeError):
    """A spawned rank's process ended without a result: killed by a signal, or exited."""

    def __init__(self, rank: int, exitcode: int) -> None:
        self.rank, self.exitcode = rank, exitcode
        if exitcode < 0:
            try:
                how = f"killed by {signal.Signals(-exitcode).name}"
            except ValueError:
                how = f"killed by signal {-exitcode}"
        else:
            how = f"exit code {exitcode}"
        super().__init__(f"rank {rank} died ({how})")


DEATH_GRACE_S = 0.5
"""After a rank reports an error, how long to look for a peer process that died: a peer's death
makes the survivors' collectives fail, and the death, not their tracebacks, is what to report."""


def host_store(timeout_s: float = 120.0) -> dist.TCPStore:
    """A rendezvous store served by this process on 127.0.0.1 (its ``port`` for :func:`run_ranks`)."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def init_rank(rank: int, world_size: int, port: int, backend: str, timeout_s: float) -> RankContext:
    """Join the process group through the store at ``port`` (one thread per rank on CPU: the ranks
    share the machine's cores)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if backend == "nccl":
        device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    return RankContext(rank=rank, world_size=world_size, device=device, backend=backend)


def leave_group(seconds: float = 2.0) -> bool:
    """Destroy the default process group, giving up after ``seconds`` (operations may still be posted)."""
    done = threading.Event()

    def destroy() -> None:
        with contextlib.suppress(Exception):  # a group with a lost peer may refuse: the process ends anyway
            dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, daemon=True, name="leave-group").start()
    return done.wait(seconds)


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    args: Sequence[Any],
    results: Any,
) -> None:
    _ignore_sigint()
    try:
        ctx = init_rank(rank, world_size, port, backend, timeout_s)
        try:
            results.put(("ok", rank, fn(ctx, *args)))
        finally:
            left = leave_group()
    except BaseException:  # report everything, including KeyboardInterrupt, then exit
        results.put(("error", rank, traceback.format_exc()))
        left = False
    if not left:  # a thread may still wait inside the group: flush the result and end now
        results.close()
        results.join_thread()
        os._exit(0)


def _rank0_thread(
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    results: Any,
) -> None:
    try:
        ctx = init_rank(0, world_size, port, backend, timeout_s)
        try:
            results.put(("ok", 0, fn(ctx, *args, **kwargs)))
        finally:
            leave_group()
    except BaseException:
        results.put(("error", 0, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
    rank0_in_process: bool = False,
    rank0_kwargs: Mapping[str, Any] | None = None,
    may_die: Collection[int] = (),
    store: dist.TCPStore | None = None,
) -> list[Any]:
    """Call ``fn(ctx, *args)`` on ``world_size`` ranks; return the results ordered by rank.

    ``fn`` must be importable by name (spawned processes re-import it). With ``rank0_in_process``
    rank 0 runs in this process (so it can use objects that do not pickle, such as a metrics
    sink, passed in ``rank0_kwargs``); the other ranks are spawned. A spawned rank in ``may_die``
    that ends without a result gets None. ``store``: a store this process serves
    (:func:`host_store`), to read after the run; by default one is made for the run.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx_mp = mp.get_context("spawn")
    results: Any = ctx_mp.Queue()
    server = store if store is not None else host_store(timeout_s)
    port = int(server.port)
    first_child = 1 if rank0_in_process else 0
    procs = [
        ctx_mp.Process(
            target=_child,
            args=(fn, rank, world_size, port, backend, timeout_s, tuple(args), results),
            daemon=True,
        )
        for rank in range(first_child, world_size)
    ]
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    rank0: threading.Thread | None = None
    interrupted = False
    try:
        _start_holding_signals(procs)
        if rank0_in_process:
            # Rank 0 runs on a thread, so this thread keeps watching the children: a child that dies
            # at start-up must not leave rank 0 waiting in the rendezvous until the timeout.
            rank0 = threading.Thread(
                target=_rank0_thread,
                args=(
                    fn,
                    world_size,
                    port,
                    backend,
                    timeout_s,
                    tuple(args),
                    dict(rank0_kwargs or {}),
                    results,
                ),
                daemon=True,
            )
            rank0.start()
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout_s} s"
                )
            try:
                status, rank, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                for rank, p in enumerate(procs, start=first_child):
                    if p.exitcode in (None, 0) or rank in out:  # exit 0: its result is on the way
                        continue
                    if rank not in may_die:
                        raise RankDied(rank, p.exitcode) from None
                    out[rank] = None
                continue
            if status == "error":
                dead = _dead_rank(procs, first_child, set(may_die) | set(out), DEATH_GRACE_S)
                if dead is not None:
                    raise dead from None
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    except KeyboardInterrupt:
        interrupted = True  # the caller is being stopped: end the ranks now, wait for nothing
        raise
    finally:
        if rank0 is not None and not interrupted:
            # Give rank 0 a moment to leave its process group, so this process can start another.
            rank0.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.pid is not None and not interrupted:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    return [out[r] for r in range(world_size)]


def _dead_rank(procs: Sequence[Any], first: int, skip: Collection[int], wait_s: float) -> RankDied | None:
    """The first process among ``procs`` (ranks from ``first``, those in ``skip`` aside) that
    ended non-zero, waiting up to ``wait_s`` for one to; None when all still run or ended 0."""
    deadline = time.monotonic() + wait_s
    while True:
        for rank, p in enumerate(procs, start=first):
            if rank not in skip and p.exitcode not in (None, 0):
                return RankDied(rank, p.exitcode)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _start_holding_signals(procs: Sequence[Any]) -> None:
    """Start ``procs``, holding SIGINT and SIGTERM until all have started: a process whose start
    is cut short reads a truncated pipe and prints a traceback. The held signals take effect right
    after (their handlers, or SIGTERM's default action, run then). SIGINT is also blocked in this
    thread meanwhile: a spawned process inherits the mask through its exec, so Ctrl-C cannot
    raise KeyboardInterrupt in its start-up, and :func:`_child` then ignores it for good."""
    if threading.current_thread() is not threading.main_thread():
        for p in procs:
            p.start()
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        held.append(signum)

    previous = {signum: signal.signal(signum, hold) for signum in (signal.SIGINT, signal.SIGTERM)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for p in procs:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for caught in dict.fromkeys(held):
            signal.raise_signal(caught)


def _ignore_sigint() -> None:
    """In a spawned rank: ignore SIGINT (the caller ends the ranks), then take back the signal
    mask it was started with; a Ctrl-C held until now is dropped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def is_distributed() -> bool:
    """Whether a default process group exists (false: a single local rank)."""
    return dist.is_available() and dist.is_initialized()


def world() -> tuple[int, int]:
    """(rank, world_size) of the default group, or (0, 1) without one."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()
