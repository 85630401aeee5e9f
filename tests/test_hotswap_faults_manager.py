"""Gloo, 2 real ranks: a peer lost in the middle of a rebalance (its second layer chunk's swap). The
survivor keeps serving on a placement that is consistent per layer (the committed chunk new, the
rest old), reports a failed rebalance naming the cause and the rank, stops rebalancing and runs
no collective again, so its passes never block."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from eplb.moe.spawn import RankContext, run_ranks
from tests.helpers.swap_faults import NEW, OLD, TIMEOUT_S, group_timeout_s, layer_states, setup


def manager_loses_a_peer(ctx: RankContext) -> dict[str, Any]:
    """Rank 1 dies in the second layer chunk's swap; rank 0 must keep serving and stop rebalancing."""
    from eplb.config import EplbConfig
    from eplb.hotswap.swap import HotSwapOptions
    from eplb.manager.manager import EplbManager
    from eplb.moe.model import MoEModel
    from tests.helpers.manager import FakePlan, RecordingSink

    cfg, w, old, new = setup(2, 3)
    model = MoEModel(cfg, old, rank=ctx.rank, device=ctx.device, weights=w, remap_backend="torch")
    executes: list[int] = []

    def fault(stage: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        if stage == "prepare" and chunk == 0:
            executes.append(1)
            if ctx.rank == 1 and len(executes) == 2:
                os._exit(1)

    sink = RecordingSink()
    config = EplbConfig(eplb_rebalance_num_iterations=2, eplb_rebalance_layers_per_chunk=1)
    manager = EplbManager(
        config,
        model,
        old,
        device=ctx.device,
        sink=sink,
        planner=lambda load, cur: FakePlan(new),
        swap_options=HotSwapOptions(timeout_s=TIMEOUT_S),
        swap_fault=fault,
    )
    swap_group = manager._live.swaps.group  # made with the manager, for swaps of its options' timeout_s
    assert swap_group is not None
    made_with = group_timeout_s(swap_group)
    for _ in range(60):
        manager.on_forward_pass_begin(is_prefill=False, num_tokens=4)
        manager.recorder.pass_counts_LP[:, 0] = 4  # some load, without a forward (no exchange)
        manager.on_forward_pass_end()
        if manager.state().phase == "stopped":
            break
        time.sleep(0.01)
    start = time.monotonic()
    for _ in range(20):  # serving goes on: no collective, no rebalance
        manager.on_forward_pass_begin(is_prefill=False, num_tokens=4)
        manager.on_forward_pass_end()
    state = manager.state()
    manager.close()
    return {
        "phase": state.phase,
        "passes_s": time.monotonic() - start,
        "history": [(r.outcome, r.reason) for r in state.history],
        "events": [(e["outcome"], e["reason"]) for e in sink.of("rebalance")],
        "layers": layer_states(model, w, old, new, ctx.rank),
        "held": [
            bool((state.placement.phy2log_LP[layer] == new.phy2log_LP[layer]).all()) for layer in range(3)
        ],
        "model_held": model.placement.same_slots(state.placement),
        "swap_group_timeout_s": made_with,
    }


def test_the_manager_serves_on_and_stops_rebalancing_when_a_peer_is_lost() -> None:
    r0, r1 = run_ranks(manager_loses_a_peer, 2, timeout_s=120, may_die=[1])
    assert r1 is None and r0["phase"] == "stopped" and r0["passes_s"] < 1.0
    ((outcome, reason),) = r0["history"]
    assert (
        outcome == "failed"
        and "peer lost" in reason
        and "rank 1" in reason
        and "rebalancing stopped" in reason
    )
    assert r0["events"] == r0["history"]  # reported to the sink (its cause comes from the reason)
    # The first layer chunk committed before the loss; the rest stayed old: consistent per layer.
    assert r0["held"] == [True, False, False] and r0["model_held"]
    assert r0["layers"] == [NEW, OLD, OLD]
    # Its swap group had a timeout of its own, from the swaps' (TIMEOUT_S = 2 s): the 10 s floor.
    assert TIMEOUT_S == 2.0 and r0["swap_group_timeout_s"] == 10.0
