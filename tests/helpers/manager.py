"""The manager's test kit: a tiny model on one rank, a recording sink, plans and pass loops."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eplb.manager.manager import EplbManager
from eplb.moe.model import MoEModel, MoEModelConfig, logical_weights
from eplb.placement.model import Placement
from tests.helpers.placements import random_phy2log

CPU = torch.device("cpu")
CFG = MoEModelConfig(num_layers=3, num_experts=8, top_k=2, hidden=32, intermediate=16)


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def on_forward_pass(self, **kw: Any) -> None:
        self.events.append(("pass", kw))

    def on_window(self, **kw: Any) -> None:
        self.events.append(("window", kw))

    def on_rebalance(self, **kw: Any) -> None:
        self.events.append(("rebalance", kw))

    def on_topology(self, **kw: Any) -> None:
        self.events.append(("topology", kw))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [kw for k, kw in self.events if k == kind]


@dataclass
class FakePlan:
    placement: Placement
    dispatch_weights_LER: np.ndarray | None = None
    predicted_balancedness: float = 0.99
    apply: bool = True
    reason: str = "test plan"


def make(num_redundant: int = 4, **cfg_kw: Any) -> tuple[MoEModel, Placement, dict[str, torch.Tensor]]:
    w = logical_weights(CFG)
    placement = Placement.trivial(CFG.num_layers, CFG.num_experts, 1, num_redundant=num_redundant)
    return MoEModel(CFG, placement, rank=0, device=CPU, weights=w, remap_backend="torch"), placement, w


def other_placement(placement: Placement, seed: int = 0) -> Placement:
    rng = np.random.default_rng(seed)
    p2l = random_phy2log(rng, placement.num_layers, placement.num_logical, placement.num_physical)
    return Placement.from_phy2log(p2l, placement.num_gpus, max_replicas=placement.max_replicas)


def run_passes(
    manager: EplbManager, model: MoEModel, n: int, *, prefill: bool = False, seed: int = 0
) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        manager.on_forward_pass_begin(is_prefill=prefill, num_tokens=6)
        model(torch.randn(6, CFG.hidden, generator=g))
        manager.on_forward_pass_end()


def until_idle(manager: EplbManager, model: MoEModel, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while manager.state().phase != "idle":
        assert time.monotonic() < deadline, "the manager never went back to idle"
        run_passes(manager, model, 1)
        time.sleep(0.005)
