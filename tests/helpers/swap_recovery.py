"""Swaps given up on a group of their own (the caller's ``swap_group``, or the one ``hot_swap``
makes without a group), on real ranks (tests/test_hotswap_serving.py,
tests/test_manager_recovery.py): the serving group stays usable, a fresh swap group commits, and
the rebalance watchdog ends a rebalance that hangs.

:func:`run_to_exit` spawns the ranks and lets each one end its process on its own (no
``os._exit``), so a rank that a poisoned group aborts (SIGABRT) or that hangs in its exit fails
the test: every process must exit with code 0 (and, when asked, within some seconds of its end).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import wait as mp_wait
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from eplb.hotswap.layout import PlainLayout
from eplb.moe.spawn import RankContext, host_store, init_rank
from tests.helpers.swap_faults import setup

TIMEOUT_S = 2.0
"""The swaps' timeout_s: small, so a late peer fails a swap quickly, yet above what a clean swap
takes on a loaded machine (as in tests/helpers/swap_faults.py)."""
STALL_S = TIMEOUT_S + 1.0
"""How long a late peer sleeps inside a swap: past TIMEOUT_S."""
WATCHDOG_S = 1.5
"""The watchdog's bound in the watchdog test: above what a clean rebalance takes there."""
HANG_S = WATCHDOG_S + 2.0
"""How long a planner or a peer hangs in the watchdog test: well past WATCHDOG_S."""
PASSES = 3000
"""The most passes a scenario runs (it stops once the rebalances it waits for are decided: a
condition every rank agrees on, so every rank runs as many passes)."""


# ---- spawning ranks that must exit on their own ------------------------------------------------
def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    backend: str,
    timeout_s: float,
    args: Sequence[Any],
) -> None:
    ctx = init_rank(rank, world, port, backend, timeout_s)
    from eplb.hotswap.control import group_store, root_store

    store = root_store(group_store(None))
    try:
        value = fn(ctx, *args)
        store.set(f"test/result/{rank}", pickle.dumps(("ok", value, time.time())))
    except BaseException:
        store.set(f"test/result/{rank}", pickle.dumps(("error", traceback.format_exc(), time.time())))
        raise SystemExit(1) from None
    dist.destroy_process_group()  # a process that serves on leaves its groups, swap groups given up too


def run_to_exit(
    fn: Callable[..., Any],
    world: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 60.0,
    backend: str = "gloo",
    serving_timeout_s: float | None = None,
    exit_within_s: float | None = None,
) -> list[Any]:
    """``fn(ctx, *args)`` on ``world`` spawned ranks: the results by rank, once every process has
    ended by itself with exit code 0 (AssertionError otherwise, with the codes).

    ``serving_timeout_s``: the default (serving) group's timeout (default ``timeout_s``).
    ``exit_within_s``: each process must also have exited within this many seconds of the end of
    its ``fn`` (AssertionError naming the ranks and their delays).
    """
    server = host_store(timeout_s)
    spawn = mp.get_context("spawn")
    serving = timeout_s if serving_timeout_s is None else serving_timeout_s
    procs = [
        spawn.Process(target=_rank_main, args=(fn, r, world, int(server.port), backend, serving, tuple(args)))
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.start()
    exited_at: dict[int, float] = {}
    while len(exited_at) < world and time.monotonic() < deadline:
        waiting: dict[Any, int] = {p.sentinel: r for r, p in enumerate(procs) if r not in exited_at}
        for sentinel in mp_wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
            exited_at[waiting[sentinel]] = time.time()
    hung = [r for r in range(world) if r not in exited_at]
    for r, p in enumerate(procs):
        if r in hung:
            p.kill()
        p.join(5.0)
    results, ended_at = [], {}
    for r in range(world):
        key = f"test/result/{r}"
        got = pickle.loads(server.get(key)) if server.check([key]) else ("missing", None, None)
        status, value, ended_at[r] = got
        if status == "error":
            raise RuntimeError(f"rank {r} failed:\n{value}")
        results.append(value)
    assert not hung, f"ranks {hung} did not exit within {timeout_s} s"
    assert [p.exitcode for p in procs] == [0] * world, [p.exitcode for p in procs]
    if exit_within_s is not None:
        late = {r: round(exited_at[r] - ended_at[r], 1) for r in range(world)}
        assert all(d <= exit_within_s for d in late.values()), f"seconds from the end to the exit: {late}"
    return results


def serving_collectives(ctx: RankContext, group: dist.ProcessGroup | None = None) -> bool:
    """An all_reduce and an all_to_all on the serving group, each checked against its expected sum."""
    G = ctx.world_size
    summed = torch.full((3,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(summed, group=group)
    sent = (torch.arange(G, dtype=torch.float32) + 100 * ctx.rank).to(ctx.device)
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)
    want = torch.tensor([ctx.rank + 100.0 * j for j in range(G)])
    return bool((summed.cpu() == G * (G + 1) / 2).all()) and torch.equal(got.cpu(), want)


# ---- the hot-swap alone: a swap given up on its own group ---------------------------------------
GIVEN_UP = {"stall": "prepare", "interrupt": "received", "sigint": "received", "early": ""}
"""Faults of :func:`hotswap_given_up`, and the stage of chunk 1 at which each fires: ``stall``
sleeps STALL_S (past timeout_s) before chunk 1 is posted, ``interrupt`` raises KeyboardInterrupt
once chunk 1 arrived, ``sigint`` sends its own process SIGINT then (Python's handler raises
KeyboardInterrupt in the swap); ``early`` raises KeyboardInterrupt while the swap is prepared,
before this rank's check (its layout's ``slot_views``)."""


class InterruptedLayout(PlainLayout):
    """The plain layout, whose ``slot_views`` raises KeyboardInterrupt (the "early" fault)."""

    def slot_views(self, tensors: Mapping[str, torch.Tensor], slot: int) -> list[torch.Tensor]:
        raise KeyboardInterrupt


def _swap_setup(ctx: RankContext) -> tuple[Any, ...]:
    """(model, weights, old, new, options): a swap of many chunks (one expert each) with TIMEOUT_S."""
    from eplb.hotswap import HotSwapOptions
    from eplb.moe.model import MoEModel

    cfg, w, old, new = setup(ctx.world_size, 11)
    model = MoEModel(cfg, old, rank=ctx.rank, device=ctx.device, weights=w, remap_backend="torch")
    per_expert = sum(t[0].numel() * t.element_size() for t in model.slots_L[0].values())
    return model, w, old, new, HotSwapOptions(staging_budget_bytes=per_expert, timeout_s=TIMEOUT_S)


def _fire(kind: str, stall_s: float) -> None:
    """Rank's fault ``kind`` (see GIVEN_UP)."""
    if kind == "stall":
        time.sleep(stall_s)
    elif kind == "interrupt":
        raise KeyboardInterrupt
    elif kind == "sigint":
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5.0)  # the handler raises KeyboardInterrupt in here
        raise AssertionError("SIGINT did not interrupt the swap")
    else:
        raise ValueError(f"no fault {kind!r} fires in a fault hook")


def hotswap_given_up(
    ctx: RankContext, at: int, own_groups: bool, kinds: Sequence[str]
) -> list[dict[str, Any]]:
    """One swap per fault of ``kinds`` (GIVEN_UP), on rank ``at``, then the same swap again with no
    fault; between them the serving group (the default one) runs its collectives. ``own_groups``:
    each swap runs on a group of ``swap_group`` (a fresh one after each fault); else ``hot_swap``
    gets no group (it makes and drops its own). What each rank saw, per fault."""
    from eplb.hotswap import HotSwapError, hot_swap, swap_group
    from tests.helpers.swap_faults import NEW, OLD, layer_states

    model, w, old, new, options = _swap_setup(ctx)

    def group() -> dist.ProcessGroup | None:
        return swap_group(None, ctx.device, timeout_s=TIMEOUT_S) if own_groups else None

    out = []
    src, dst = old, new
    for kind in kinds:

        def fault(s: str, chunk: int, bufs: list[torch.Tensor], kind: str = kind) -> None:
            if ctx.rank == at and s == GIVEN_UP[kind] and chunk == 1:
                _fire(kind, STALL_S)

        got: dict[str, Any] = {"kind": kind}
        layout = InterruptedLayout() if kind == "early" and ctx.rank == at else None
        try:
            hot_swap(model.slots_L, src, dst, group=group(), options=options, layout=layout, fault=fault)
            got["type"] = "result"
        except HotSwapError as exc:
            got.update(type="HotSwapError", cause=exc.cause, blamed=exc.rank, alive=exc.alive)
        except KeyboardInterrupt:
            got["type"] = "KeyboardInterrupt"
        got["kept_old"] = all(
            s == (OLD if src is old else NEW) for s in layer_states(model, w, old, new, ctx.rank)
        )
        got["serving"] = serving_collectives(ctx)
        res = hot_swap(  # on a fresh group: the one given up is never used again
            model.slots_L,
            src,
            dst,
            group=group(),
            options=options,
            update_maps=lambda d=dst: model.set_placement(d),
        )
        got["then_ok"] = res.ok and all(
            s == (NEW if dst is new else OLD) for s in layer_states(model, w, old, new, ctx.rank)
        )
        out.append(got)
        src, dst = dst, src
    return out


def stall_past_the_serving_timeout(
    ctx: RankContext, at: int, stall_s: float, group_timeout_s: float | None
) -> dict[str, Any]:
    """Rank ``at`` sleeps ``stall_s`` (past the serving group's own timeout) in a swap; then every
    rank tries the serving group's collectives, which time out or fail (a peer asleep, or gone) on
    every rank: what each rank saw. ``group_timeout_s``: the swap runs on a group of ``swap_group``
    made for swaps of this timeout_s (its work given up stays posted that much longer); None: on
    the one ``hot_swap`` makes."""
    from eplb.hotswap import HotSwapError, hot_swap, swap_group

    model, _, old, new, options = _swap_setup(ctx)
    group = None if group_timeout_s is None else swap_group(None, ctx.device, timeout_s=group_timeout_s)

    def fault(s: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        if ctx.rank == at and s == "prepare" and chunk == 1:
            _fire("stall", stall_s)

    got: dict[str, Any] = {}
    try:
        hot_swap(model.slots_L, old, new, group=group, options=options, fault=fault)
        got["type"] = "result"
    except HotSwapError as exc:
        got.update(type="HotSwapError", cause=exc.cause, blamed=exc.rank, alive=exc.alive)
    try:
        got["serving"] = serving_collectives(ctx)
    except RuntimeError as exc:  # Gloo: timed out waiting, or the connection closed by a peer gone
        got["serving"] = f"{type(exc).__name__}: {str(exc)[-80:]}"
    return got


# ---- the manager: drop the swap group, serve on, renew ------------------------------------------
def _logged(name: str) -> list[str]:
    """Messages of logger ``name`` from now on."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger(name)
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    return lines


def _manager(ctx: RankContext, planner: Any, fault: Any, sink: Any, **kw: float) -> tuple[Any, ...]:
    """Rank ``ctx``'s model and manager (``kw``: ``watchdog_s``, the swaps' ``timeout_s``):
    (manager, model, weights, old, new)."""
    from eplb.config import EplbConfig
    from eplb.hotswap import HotSwapOptions
    from eplb.manager.manager import EplbManager
    from eplb.moe.model import MoEModel

    cfg, w, old, new = setup(ctx.world_size, 5)
    model = MoEModel(cfg, old, rank=ctx.rank, device=ctx.device, weights=w, remap_backend="torch")
    per_expert = sum(t[0].numel() * t.element_size() for t in model.slots_L[0].values())
    manager = EplbManager(
        EplbConfig(eplb_rebalance_num_iterations=2),
        model,
        old,
        device=ctx.device,
        sink=sink,
        planner=planner(old, new),
        swap_options=HotSwapOptions(
            timeout_s=kw.get("timeout_s", TIMEOUT_S), staging_budget_bytes=per_expert
        ),
        swap_fault=fault,
        watchdog_s=kw.get("watchdog_s", 600.0),
    )
    model.recorder = manager.recorder
    return manager, model, w, old, new


def back_and_forth(old: Any, new: Any) -> Callable[[np.ndarray, Any], Any]:
    """A planner that moves the live placement to the other of ``old`` and ``new``."""
    from tests.helpers.manager import FakePlan

    return lambda load, cur: FakePlan(new if cur.same_slots(old) else old)


def _pass(manager: Any, model: Any, g: torch.Generator, hidden: int) -> BaseException | None:
    """One forward pass (its all-to-all runs on the serving group); what interrupted it, if anything."""
    manager.on_forward_pass_begin(is_prefill=True, num_tokens=8)
    model(torch.randn(8, hidden, generator=g).to(model.device))
    try:
        manager.on_forward_pass_end()
    except KeyboardInterrupt as exc:  # the engine handles it and serves on
        return exc
    return None


def _served(manager: Any, model: Any, w: dict[str, torch.Tensor], g: torch.Generator) -> float:
    """How far the model's output is from the dense reference: 0 when weights and maps agree."""
    from eplb.moe.reference import reference_forward

    x = torch.randn(5, model.cfg.hidden, generator=g)
    return float((model(x.to(model.device)).cpu() - reference_forward(model.cfg, w, x)).abs().max())


def manager_recovers(ctx: RankContext, at: int) -> dict[str, Any]:
    """Four rebalances, back and forth: rank ``at`` sleeps past timeout_s in the first swap and
    raises KeyboardInterrupt in the third; after each failure the serving group runs its
    collectives, and the next rebalance commits on a fresh swap group."""
    from tests.helpers.manager import RecordingSink

    swaps = [0]

    def fault(stage: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        if stage == "check":
            swaps[0] += 1
        elif ctx.rank == at and chunk == 1 and (swaps[0], stage) == (1, "prepare"):
            time.sleep(STALL_S)
        elif ctx.rank == at and chunk == 1 and (swaps[0], stage) == (3, "received"):
            raise KeyboardInterrupt

    manager, model, w, old, _ = _manager(ctx, back_and_forth, fault, RecordingSink())
    g = torch.Generator().manual_seed(ctx.rank)
    interrupted, serving, groups, seen = [], [], [], 0
    for step in range(PASSES):
        time.sleep(0.001)  # the solve's thread runs meanwhile
        if _pass(manager, model, g, model.cfg.hidden) is not None:
            interrupted.append(step)
        state = manager.state()
        if len(state.history) > seen:  # the same pass on every rank
            seen = len(state.history)
            groups.append(state.swap_groups)
            if state.history[-1].outcome == "failed":
                serving.append(serving_collectives(ctx))
        if seen == 4:
            break
    state = manager.state()
    out = {
        "history": [(r.outcome, r.reason) for r in state.history],
        "phase": state.phase,
        "groups": groups,
        "interrupted": interrupted,
        "serving": [*serving, serving_collectives(ctx)],
        "err": _served(manager, model, w, g),
        "placement": state.placement.phy2log_LP.tolist(),
        "back_to_old": state.placement.same_slots(old),
    }
    manager.close()
    return out


# ---- the watchdog ------------------------------------------------------------------------------
class Scraper:
    """Rank 0's exporter, scraped every 50 ms from a thread of its own (as Prometheus would, while
    the manager's thread may be blocked): the largest in-flight seconds seen in each phase."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.most: dict[str, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from eplb.metrics import names

        while not self.stop.wait(0.05):
            phase, seconds = None, 0.0
            for line in self.sink.render().decode().splitlines():
                if line.startswith(names.MANAGER_PHASE + "{") and line.endswith(" 1.0"):
                    phase = line.split('phase="')[1].split('"')[0]
                elif line.startswith(names.IN_FLIGHT_SECONDS + "{"):
                    seconds = float(line.rsplit(" ", 1)[1])
            if phase is not None:
                self.most[phase] = max(self.most.get(phase, 0.0), seconds)

    def close(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        return self.most


def manager_watchdog(ctx: RankContext) -> dict[str, Any]:
    """Rank 0's planner hangs in the first solve; rank 1 hangs in the transfer of the second
    rebalance's swap (whose timeout_s is far longer): the watchdog ends both, and the next
    rebalance applies on a fresh swap group."""
    from eplb.metrics import names
    from eplb.metrics.prometheus import PrometheusSink
    from eplb.metrics.sink import NullSink
    from tests.helpers.manager import FakePlan

    solves, swaps = [0], [0]

    def planner(old: Any, new: Any) -> Callable[[np.ndarray, Any], Any]:
        def plan(load: np.ndarray, cur: Any) -> Any:
            solves[0] += 1
            if solves[0] == 1:
                time.sleep(HANG_S)
            return FakePlan(new if cur.same_slots(old) else old)

        return plan

    def fault(stage: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        if stage == "check":
            swaps[0] += 1
        elif ctx.rank == 1 and swaps[0] == 1 and (stage, chunk) == ("prepare", 1):
            time.sleep(HANG_S)

    logged = _logged("eplb.manager.watchdog")
    sink = PrometheusSink() if ctx.rank == 0 else NullSink()
    scraper = Scraper(sink) if ctx.rank == 0 else None
    manager, model, w, _, _ = _manager(ctx, planner, fault, sink, watchdog_s=WATCHDOG_S, timeout_s=60.0)
    g = torch.Generator().manual_seed(ctx.rank)
    ended: list[float] = []
    for _ in range(PASSES):
        began = time.monotonic()
        _pass(manager, model, g, model.cfg.hidden)
        state = manager.state()
        if len(state.history) > len(ended):
            ended.append(time.monotonic() - began)  # how long the pass that ended it took
        if len(state.history) == 3:
            break
        time.sleep(0.005)
    state = manager.state()
    out: dict[str, Any] = {
        "history": [(r.outcome, r.reason) for r in state.history],
        "ended_in_s": ended,
        "logged": logged,
        "groups": state.swap_groups,
        "phase": state.phase,
        "err": _served(manager, model, w, g),
        "serving": serving_collectives(ctx),
    }
    manager.close()
    if scraper is not None:
        out["most_in_flight"] = scraper.close()
        text = sink.render().decode()
        out["watchdog_count"] = [
            line
            for line in text.splitlines()
            if line.startswith(names.REBALANCES) and "failed_watchdog" in line
        ]
    return out
