"""A rank lost while four Gloo ranks serve (tests/test_manager_rank_loss.py): the engine that can
serve on the survivors' group, and what each rank runs.

Each rank serves a small MoE model through the manager; one rank ends itself (``os._exit``) either
at the start of a pass (its peers' forward then fails, and the engine reports the loss) or in the
first rebalance's swap (the swap reports ``peer lost``). The survivors serve on, and each reports
what its model computes against the dense reference, for routed tokens and for every logical
expert of every layer, plus its manager's state, recorder window and metrics.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from eplb.moe.model import MoEModel
from eplb.moe.spawn import RankContext

DEAD_PASS = 5
"""The pass at whose start the lost rank ends itself (case ``serving``)."""
PASSES = 400
"""The most passes a rank runs (it stops once a rebalance after the loss applied: a condition
every survivor agrees on, so every survivor runs as many passes)."""
TIMEOUT_S = 2.0
"""The swaps' timeout_s (so a lost heartbeat counts after 1 s)."""


class SurvivingModel(MoEModel):
    """MoEModel that can serve on the survivors' group (the engine side of eplb.manager.recovery)."""

    def set_world(self, world: Any) -> None:
        from eplb.remap.tables import DispatchTables

        tables = DispatchTables.from_placement(
            world.placement, world.rank, self.device, world.dispatch_weights_LER
        )
        exchange = self.layers[0].exchange.on_group(world.group, world.placement.num_gpus)
        for layer in self.layers:
            layer.serve_on(exchange, tables)
        self.tables, self.placement, self.rank, self.recorder = (
            tables,
            world.placement,
            world.rank,
            world.recorder,
        )


def rolled(cur: Any) -> Any:
    """``cur`` with every layer's slots rolled by one: a plan that moves experts on any world."""
    from eplb.placement.model import Placement
    from tests.helpers.manager import FakePlan

    p2l = np.roll(cur.phy2log_LP, 1, axis=1)
    return FakePlan(Placement.from_phy2log(p2l, cur.num_gpus, cur.num_nodes, max_replicas=cur.max_replicas))


def _setup(
    ctx: RankContext, host_backup: bool, use_loader: bool, interval: int, fault: Any
) -> tuple[Any, ...]:
    from eplb.config import EplbConfig
    from eplb.hotswap import HotSwapOptions
    from eplb.manager.manager import EplbManager
    from eplb.metrics.prometheus import PrometheusSink
    from eplb.moe.model import MoEModelConfig, logical_weights
    from eplb.placement.model import Placement
    from tests.helpers.placements import random_phy2log

    cfg = MoEModelConfig(num_layers=3, num_experts=8, top_k=2, hidden=16, intermediate=8)
    w = logical_weights(cfg)
    G = ctx.world_size
    p2l = random_phy2log(np.random.default_rng(7), cfg.num_layers, cfg.num_experts, 12)
    placement = Placement.from_phy2log(p2l, G, max_replicas=12 - cfg.num_experts + 1)
    model = SurvivingModel(cfg, placement, rank=ctx.rank, device=ctx.device, weights=w, remap_backend="torch")
    loads: list[tuple[int, int]] = []

    def loader(layer: int, expert: int) -> dict[str, torch.Tensor]:
        loads.append((layer, expert))
        return {name: w[name][layer, expert].clone() for name in ("w13", "w2")}

    sink = PrometheusSink()
    manager = EplbManager(
        EplbConfig(eplb_rebalance_num_iterations=interval, eplb_host_backup=host_backup),
        model,
        placement,
        device=ctx.device,
        sink=sink,
        planner=lambda load, cur: rolled(cur),
        swap_options=HotSwapOptions(timeout_s=TIMEOUT_S),
        swap_fault=fault,
        loader=loader if use_loader else None,
        recovery_timeout_s=30.0,
    )
    model.recorder = manager.recorder
    return cfg, w, model, manager, sink, loads, placement


def _serve(manager: Any, model: Any, g: torch.Generator, hidden: int) -> str | None:
    """One pass; the error of a forward whose collective lost a peer (the engine then reports it)."""
    manager.on_forward_pass_begin(is_prefill=True, num_tokens=8)
    try:
        model(torch.randn(8, hidden, generator=g))
    except RuntimeError as exc:  # Gloo: "Connection closed by peer"
        return str(exc)
    manager.on_forward_pass_end()
    return None


def _errors(model: Any, cfg: Any, w: dict[str, torch.Tensor], g: torch.Generator) -> tuple[float, float]:
    """(max |model - dense reference| on routed tokens, the same for every logical expert of
    every layer, each token sent to one expert): 0 when weights and maps agree everywhere."""
    from eplb.moe.model import rms_norm
    from eplb.moe.reference import dense_moe, reference_forward

    x = torch.randn(6, cfg.hidden, generator=g)
    routed = float((model(x) - reference_forward(cfg, w, x)).abs().max())
    E, K = cfg.num_experts, cfg.top_k
    ids_TK = (torch.arange(E)[:, None] + torch.arange(K)[None, :] * 3) % E  # each expert, K times
    h = rms_norm(torch.randn(E, cfg.hidden, generator=g))
    weights_TK = torch.full((E, K), 1.0 / K)
    every = 0.0
    for layer, moe in enumerate(model.layers):
        got = moe(h, ids_TK.to(torch.int32), weights_TK)
        want = dense_moe(h, ids_TK, weights_TK, w["w13"][layer], w["w2"][layer])
        every = max(every, float((got - want).abs().max()))
    return routed, every


def loses_a_rank(
    ctx: RankContext, case: str, dead: int, host_backup: bool, use_loader: bool
) -> dict[str, Any]:
    """Serve until rank ``dead`` ends itself (``case``: ``serving`` at the start of pass
    DEAD_PASS; ``swap`` in the first rebalance's swap), then until a rebalance after the loss
    applied on the survivors; what this survivor ends with."""
    swaps = [0]

    def fault(stage: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        if stage == "check":
            swaps[0] += 1
        if case == "swap" and ctx.rank == dead and swaps[0] == 1 and (stage, chunk) == ("prepare", 0):
            os._exit(1)

    cfg, w, model, manager, sink, loads, start = _setup(
        ctx, host_backup, use_loader, 4 if case == "swap" else 12, fault
    )
    g = torch.Generator().manual_seed(ctx.rank)
    reported: list[str] = []
    began = time.monotonic()
    for step in range(PASSES):
        if case == "serving" and ctx.rank == dead and step == DEAD_PASS:
            os._exit(1)
        error = _serve(manager, model, g, cfg.hidden)
        if error is not None:
            reported.append(error)
            manager.on_rank_lost()  # every survivor's forward failed on the same pass
        state = manager.state()
        if state.recoveries and sum(r.outcome == "applied" for r in state.history) == 2:
            break  # the degraded plan and a rebalance among the survivors
    state = manager.state()
    routed, every = _errors(model, cfg, w, g)
    infos, phys_FLP = manager.recorder.window_passes()
    text = sink.render().decode()
    out = {
        "rank": ctx.rank,
        "seconds": time.monotonic() - began,
        "reported": reported,
        "ranks": state.ranks,
        "rank_now": manager.rank,
        "recoveries": [vars(r) for r in state.recoveries],
        "history": [(r.outcome, r.reason) for r in state.history],
        "phase": state.phase,
        "stopped": state.stopped,
        "routed_err": routed,
        "every_err": every,
        "placement": state.placement.phy2log_LP.tolist(),
        "logcnt_min": int(state.placement.logcnt_LE.min()),
        "degraded": None if state.degraded is None else state.degraded.phy2log_LP.tolist(),
        "start": start.phy2log_LP.tolist(),
        "window_shape": list(phys_FLP.shape),
        "window_passes": len(infos),
        "loads": loads,
        "topology": [line for line in text.splitlines() if line.startswith("eplb_info")],
        "rank_tokens": sorted(
            line.split('rank="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("eplb_rank_tokens{")
        ),
    }
    manager.close()
    return out
