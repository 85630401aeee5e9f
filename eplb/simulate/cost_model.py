"""The simulator's cost model: MoE time per step from per-GPU load, and rebalance transfer time.

Shape legend: T steps, L layers, E logical experts, G GPUs.

Per step and layer, GPU g spends ``a + max(b * active_experts_g, c * tokens_g)`` µs on its
experts (a roofline fitted to grouped-GEMM timings on an H200 with DeepSeek-V3 dims):
in decode the GPU is bound by reading its distinct active experts' weights, in prefill by
its routed tokens. The layer waits for its busiest GPU and a step is the sum over layers. A
rebalance stalls serving for the time the busiest receiving GPU needs to pull its new experts:
intra-node bytes over NVLink, cross-node bytes over the inter-node network.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from eplb.placement.diff import PlacementDiff

# One DeepSeek-V3 expert of one layer (3 * H * I with H=7168, I=2048) in fp8: about 44 MB.
DEEPSEEK_V3_BYTES_PER_EXPERT = 3 * 7168 * 2048


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Parameters of the modeled MoE time and transfer time. Defaults: DeepSeek-V3 dims on an H200."""

    base_us: float = 40.0
    """a: fixed µs per GPU per layer (launches, routing, all-to-all latency)."""
    per_expert_us: float = 30.0
    """b: µs per distinct active expert on a GPU (reading its weights; dominates decode)."""
    per_token_us: float = 0.153
    """c: µs per routed token on a GPU (compute; dominates prefill)."""
    nvlink_gbps: float = 316.0
    """Bandwidth into one GPU from GPUs of its node, GB/s (NCCL send/recv at 44 MB on H200)."""
    internode_gbps: float = 50.0
    """Bandwidth into one GPU from other nodes, GB/s (about one 400 Gb/s NIC per GPU)."""

    def __post_init__(self) -> None:
        for name in ("base_us", "per_expert_us", "per_token_us"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"cost model {name} must be a finite number >= 0, got {value}")
        for name in ("nvlink_gbps", "internode_gbps"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"cost model {name} must be a finite number > 0, got {value}")

    def layer_times_us(self, tokens_xG: np.ndarray, active_xG: np.ndarray) -> np.ndarray:
        """float64 [...]: µs of one MoE layer, the busiest GPU's time, from per-GPU tokens and active experts."""
        per_gpu = np.maximum(self.per_expert_us * active_xG, self.per_token_us * tokens_xG)
        return self.base_us + per_gpu.max(axis=-1).astype(np.float64)

    def transfer_seconds(self, diff: PlacementDiff) -> float:
        """Seconds the busiest receiving GPU needs for the expert weights ``diff`` moves onto it."""
        arrivals_G = diff.arrivals_LGE.sum(axis=(0, 2))
        cross_node_G = diff.cross_node_arrivals_LGE.sum(axis=(0, 2))
        intra_node_G = arrivals_G - cross_node_G
        bytes_per = float(diff.bytes_per_expert)
        seconds_G = bytes_per * (
            intra_node_G / (self.nvlink_gbps * 1e9) + cross_node_G / (self.internode_gbps * 1e9)
        )
        return float(seconds_G.max(initial=0.0))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
