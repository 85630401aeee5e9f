"""SwapControl.lost_peer names the lost rank even when the watch has not yet (eplb.hotswap.control).

A broken collective sends a rank to lost_peer; its watch discounts gaps in the rank's own looks
(a busy machine spaces them out), so it may not name the dead rank within the wait. The rank whose
heartbeat stood still over the whole wait is named then; a peer whose heartbeat moves is not.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from eplb.hotswap.control import SwapControl

KEY = "eplb/hotswap/hb/1"


def _control(store: dist.Store) -> SwapControl:
    control = SwapControl(store, rank=0, peers=[0, 1], seq=1, timeout_s=0.6, name="g")
    control.watch.lost = lambda: None  # type: ignore[method-assign]  # the watch never names it
    return control


def test_a_heartbeat_that_stood_still_over_the_wait_is_named() -> None:
    store = dist.HashStore()
    store.set(KEY, "0 g:1:3:prepare")
    failure = _control(store).lost_peer("chunk 1's agreement", RuntimeError("Connection closed by peer"))
    assert (failure.cause, failure.rank, failure.alive) == ("peer lost", 1, False)
    assert (
        "rank 1's heartbeat stood still" in failure.detail and "Connection closed by peer" in failure.detail
    )


def test_a_heartbeat_that_moves_is_not_blamed() -> None:
    store = dist.HashStore()
    store.set(KEY, "0 g:1:3:prepare")
    stop = threading.Event()

    def beat() -> None:
        n = 0
        while not stop.wait(0.05):
            n += 1
            store.set(KEY, f"{n} g:1:3:prepare")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        failure = _control(store).lost_peer("chunk 1's agreement", RuntimeError("Connection reset"))
    finally:
        stop.set()
        thread.join()
    assert (failure.cause, failure.rank) == ("peer lost", None)
