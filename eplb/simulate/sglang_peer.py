"""SGLang's ``elasticity_aware`` planner, run from SGLang's own files, as a simulated run.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs (EP ranks).

SGLang 0.5.23 plans elastic EP with ``sglang/srt/eplb/eplb_algorithms/elasticity_aware.py``
(DeepSeek's greedy over the active ranks' slots, repacked from scratch, the dead ranks' slots
filled with expert 0 and left out of log2phy). :func:`load_elasticity_aware` loads that file and
the ``deepseek.py`` it imports by path from an unpacked SGLang (``python -m benchmarks.peers``
puts one in ``.peers/sglang-0.5.23``; an installed SGLang's folder works too), without importing
the rest of SGLang. :class:`ElasticPlanner` calls it as SGLang's manager does: the window summed
over its passes, every physical slot, the active-rank mask.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eplb.placement.degraded import live_slots, survivor_nodes
from eplb.placement.model import Placement
from eplb.policy.base import LoadHistory, Proposal

_ALGORITHMS = "sglang/srt/eplb/eplb_algorithms"
_DEEPSEEK = "sglang.srt.eplb.eplb_algorithms.deepseek"


def load_elasticity_aware(folder: str | Path) -> Callable[..., Any]:
    """SGLang's ``elasticity_aware.rebalance_experts`` from ``folder`` (which holds ``sglang/``).

    Its one SGLang import (``sglang.srt.eplb.eplb_algorithms.deepseek``) is bound to the
    ``deepseek.py`` beside it while the module loads; ``sys.modules`` is left as it was.
    """
    base = Path(folder) / _ALGORITHMS
    files = {name: base / f"{name}.py" for name in ("deepseek", "elasticity_aware")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise ValueError(
            f"--sglang-peer: no SGLang EPLB file {missing[0]} (python -m benchmarks.peers unpacks one)"
        )
    stubs = ("sglang", "sglang.srt", "sglang.srt.eplb", "sglang.srt.eplb.eplb_algorithms", _DEEPSEEK)
    saved = {name: sys.modules.get(name) for name in stubs}
    try:
        for parent in stubs[:-1]:
            sys.modules[parent] = types.ModuleType(parent)
        sys.modules[_DEEPSEEK] = _load(_DEEPSEEK, files["deepseek"])
        elastic = _load("_peer_sglang_elasticity_aware", files["elasticity_aware"])
    finally:
        # Only the stubs go: what the files imported (torch) stays imported.
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    function: Callable[..., Any] = elastic.rebalance_experts
    return function


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--sglang-peer: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class ElasticPlanner:
    """An ``eplb.policy.Planner`` that plans with SGLang's ``elasticity_aware`` over the live ranks.

    The placement it is given and returns spans the live ranks only (eplb.placement.degraded's
    survivors); SGLang plans over every rank with the mask, and its live slots are kept.
    """

    rebalance: Callable[..., Any]
    """SGLang's ``elasticity_aware.rebalance_experts``."""
    num_gpus: int
    """G, EP ranks at start-up (SGLang's ``num_gpus``)."""
    num_nodes: int
    num_groups: int = 1
    alive_G: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    """bool [G]: the ranks alive (every one when empty)."""

    def __call__(
        self, window_WLE: np.ndarray, current: Placement, history: LoadHistory | None = None
    ) -> Proposal:
        import torch

        alive_G = self.alive_G if self.alive_G.size else np.ones(self.num_gpus, dtype=bool)
        live = int(alive_G.sum())
        S = current.slots_per_gpu
        weight = torch.from_numpy(np.asarray(window_WLE, dtype=np.float64).sum(axis=0))
        active = torch.from_numpy(alive_G.astype(np.int64))
        phy2log, _, _ = self.rebalance(
            weight, S * self.num_gpus, self.num_groups, self.num_nodes, self.num_gpus, False, active
        )
        # Dead ranks' slots hold expert 0 in SGLang's map (not in its log2phy): only live slots count.
        live_LP = phy2log.numpy().astype(np.int32)[:, live_slots(alive_G, S)]
        nodes = survivor_nodes(alive_G, self.num_nodes)
        placement = Placement.from_phy2log(
            live_LP, live, nodes, max_replicas=live * S - current.num_logical + 1
        )
        return Proposal(placement=placement, reason=f"SGLang elasticity_aware over {live} active ranks")
