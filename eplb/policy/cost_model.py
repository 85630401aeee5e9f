"""The pass-time and transfer model: MoE time per pass from per-GPU load, and what a rebalance costs.

The simulator charges it, and the rebalance decision (eplb.policy.decision) prices plans with it,
so a plan is applied offline exactly when a server would apply it.

Shape legend: F steps, n passes, W window (passes), L layers, E logical experts, G GPUs, x any
leading dimensions.

Per step and layer, GPU g spends ``a + max(b * active_experts_g, c * tokens_g)`` µs on its
experts (a roofline fitted to grouped-GEMM timings on an H200 with DeepSeek-V3 dims):
in decode the GPU is bound by reading its distinct active experts' weights, in prefill by
its routed tokens. The layer waits for its busiest GPU and a step is the sum over layers. A
rebalance's transfer takes the link time the busiest receiving GPU needs to pull its new experts:
intra-node bytes over NVLink, cross-node bytes over the inter-node network, each at most at the
pace of the swap when it has one.

Periodic rebalancing (SGLang's) stalls serving for all of that time. A continuous swap is sent
beside the following passes (:func:`swap_beside_passes`): it costs no stall while the passes
last longer than its link time, and stalls for the excess when they do not; meanwhile every pass
runs ``1 + slowdown`` times slower, where the slowdown depends on the swap's pace and kind
(:meth:`CostModel.interference_slowdown`, from H200 measurements until a two-GPU run refines them).
An engine's own swap pays per chunk of layers (:meth:`CostModel.chunk_transfer_seconds`): SGLang's
stalls serving for each chunk's busiest GPU, vLLM's sends one layer per pass beside the passes.

Every pass also runs its dispatch kernels, once per layer (:class:`DispatchKernelCost`): µs per layer
by the rank's tokens, measured per GPU kind (``DISPATCH_KERNEL_TABLES``), interpolated in
log(tokens) and held at the table's ends; ``--eplb-dispatch-cost`` picks a table or gives one.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from eplb.placement.diff import PlacementDiff

# One DeepSeek-V3 expert of one layer (3 * H * I with H=7168, I=2048) in fp8: about 44 MB.
DEEPSEEK_V3_BYTES_PER_EXPERT = 3 * 7168 * 2048

TRANSFER_KINDS = ("copy_engine", "sm")
"""How a swap beside the passes moves bytes: paced copy-engine copies, or SM copy kernels (NCCL P2P)."""

# Slowdown of DeepSeek-V3 expert FFNs of 256-4096 tokens (one H200, a side stream beside nine
# FFNs) while a copy runs, as (pace GB/s, slowdown) points interpolated linearly in the pace and
# held at the ends; midpoints of the measured ranges. Copy-engine copies paced in 4 MB chunks:
# about 2-3% at 78-500 GB/s. SM copy kernels: 22-76% on one CTA (53 GB/s), up to 90% on more
# (the GEMMs lose a wave); "more" is put at NVLink speed.
INTERFERENCE_POINTS: dict[str, tuple[tuple[float, float], ...]] = {
    "copy_engine": ((78.0, 0.02), (500.0, 0.03)),
    "sm": ((53.0, 0.49), (316.0, 0.90)),
}
UNPACED_SLOWDOWN = {"copy_engine": 1.05, "sm": 0.90}
"""Slowdown of an unpaced swap: full-speed copy-engine copies 46-164% (memory bandwidth), SM kernels up to 90%."""


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
    transfer_kind: str = "copy_engine"
    """How a swap beside the passes copies: copy_engine | sm (TRANSFER_KINDS)."""
    interference: float | None = None
    """Slowdown of a pass while a swap runs beside it (0.03: 3% slower); None: from the H200
    figures by ``transfer_kind`` and pace (INTERFERENCE_POINTS)."""

    def __post_init__(self) -> None:
        for name in ("base_us", "per_expert_us", "per_token_us"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"cost model {name} must be a finite number >= 0, got {value}")
        for name in ("nvlink_gbps", "internode_gbps"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"cost model {name} must be a finite number > 0, got {value}")
        if self.transfer_kind not in TRANSFER_KINDS:
            raise ValueError(f"unknown transfer kind {self.transfer_kind!r}; choose from {TRANSFER_KINDS}")
        if self.interference is not None and not (np.isfinite(self.interference) and self.interference >= 0):
            raise ValueError(f"cost model interference must be a finite number >= 0, got {self.interference}")

    def layer_times_us(self, tokens_xG: np.ndarray, active_xG: np.ndarray) -> np.ndarray:
        """float64 [...]: µs of one MoE layer, the busiest GPU's time, from per-GPU tokens and active experts."""
        per_gpu = np.maximum(self.per_expert_us * active_xG, self.per_token_us * tokens_xG)
        return self.base_us + per_gpu.max(axis=-1).astype(np.float64)

    def transfer_seconds(self, diff: PlacementDiff, gbps: float | None = None) -> float:
        """Seconds the busiest receiving GPU needs for the expert weights ``diff`` moves onto it,
        each link at most at ``gbps`` (the swap's pace; None: link speed)."""
        arrivals_G = diff.arrivals_LGE.sum(axis=(0, 2))
        cross_node_G = diff.cross_node_arrivals_LGE.sum(axis=(0, 2))
        return float(self._link_seconds_xG(diff, arrivals_G, cross_node_G, gbps).max(initial=0.0))

    def chunk_transfer_seconds(
        self, diff: PlacementDiff, layers_per_chunk: int | None, gbps: float | None = None
    ) -> np.ndarray:
        """float64 [k]: link seconds of each chunk of ``layers_per_chunk`` consecutive layers (None:
        one chunk of all, equal to :meth:`transfer_seconds`), each on its own busiest receiving GPU.

        An engine that swaps chunk by chunk pays each chunk's busiest GPU in turn, so their sum is at
        least :meth:`transfer_seconds`: SGLang's synchronous ``ExpertLocationUpdater`` stalls serving
        for each chunk (``--eplb-rebalance-layers-per-chunk``), vLLM's asynchronous worker sends one
        layer per pass (chunks of 1) beside the passes."""
        if layers_per_chunk is not None and layers_per_chunk < 1:
            raise ValueError(f"--eplb-rebalance-layers-per-chunk must be >= 1, got {layers_per_chunk}")
        L = diff.arrivals_LGE.shape[0]
        if L == 0:
            return np.zeros(0)
        starts_k = np.arange(0, L, L if layers_per_chunk is None else layers_per_chunk)
        arrivals_kG = np.add.reduceat(diff.arrivals_LGE.sum(axis=2), starts_k, axis=0)
        cross_node_kG = np.add.reduceat(diff.cross_node_arrivals_LGE.sum(axis=2), starts_k, axis=0)
        return self._link_seconds_xG(diff, arrivals_kG, cross_node_kG, gbps).max(axis=-1, initial=0.0)

    def _link_seconds_xG(
        self, diff: PlacementDiff, arrivals_xG: np.ndarray, cross_node_xG: np.ndarray, gbps: float | None
    ) -> np.ndarray:
        """float64 [..., G]: link seconds of each GPU's arriving expert copies (intra-node over
        NVLink, cross-node over the network), each link at most at ``gbps``."""
        intra_node_xG = arrivals_xG - cross_node_xG
        pace = np.inf if gbps is None else gbps
        bytes_per = float(diff.bytes_per_expert)
        return bytes_per * (
            intra_node_xG / (min(self.nvlink_gbps, pace) * 1e9)
            + cross_node_xG / (min(self.internode_gbps, pace) * 1e9)
        )

    def interference_slowdown(self, gbps: float | None) -> float:
        """Fraction by which a pass slows while a swap paced at ``gbps`` (None: unpaced) runs beside it."""
        if self.interference is not None:
            return self.interference
        if gbps is None:
            return UNPACED_SLOWDOWN[self.transfer_kind]
        pace_x, slowdown_x = zip(*INTERFERENCE_POINTS[self.transfer_kind], strict=True)
        return float(np.interp(gbps, pace_x, slowdown_x))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SwapProgress:
    """How far a swap got beside a run of passes (:func:`swap_beside_passes`)."""

    passes: int
    """Passes that ran beside it; when ``remaining_seconds`` is 0, the maps switch after the last one."""
    remaining_seconds: float
    """Link time still needed after those passes (0: it arrived)."""
    interference_seconds: float
    """Time those passes lost to the swap."""


def swap_beside_passes(link_seconds: float, pass_us_n: np.ndarray, slowdown: float) -> SwapProgress:
    """A swap needing ``link_seconds`` of link time, sent beside passes of ``pass_us_n`` µs each.

    Each pass beside it takes ``1 + slowdown`` times as long, and the swap moves on during all of
    that time. It arrives during the first pass at whose end the elapsed time reaches its link time.
    """
    assert slowdown >= 0 and link_seconds >= 0
    if link_seconds == 0:
        return SwapProgress(0, 0.0, 0.0)
    wall_n = pass_us_n.astype(np.float64) * 1e-6 * (1.0 + slowdown)
    elapsed_n = np.cumsum(wall_n)
    arrive = int(np.searchsorted(elapsed_n, link_seconds))
    if arrive >= len(wall_n):
        spent = float(elapsed_n[-1]) if len(wall_n) else 0.0
        return SwapProgress(len(wall_n), max(link_seconds - spent, 0.0), spent * slowdown / (1.0 + slowdown))
    # Of the link time spent beside passes, the share slowdown / (1 + slowdown) is time they lost.
    return SwapProgress(arrive + 1, 0.0, link_seconds * slowdown / (1.0 + slowdown))


@dataclass(frozen=True)
class PassTimes:
    """The pass-time model on a window's passes: what balance buys, and how long a pass takes."""

    tokens_WL: np.ndarray
    """float64 [W, L]: routed tokens per GPU (the layer's mean)."""
    active_WL: np.ndarray
    """float64 [W, L]: active expert replicas per GPU (the layer's mean)."""
    cost: CostModel

    @classmethod
    def of(
        cls,
        layer_load_WL: np.ndarray,
        loaded_WL: np.ndarray,
        num_logical: int,
        num_gpus: int,
        num_physical: int,
        cost: CostModel,
    ) -> PassTimes:
        """The model from a window's per-pass layer loads and loaded expert counts [W, L] (``solve``
        reads both from its one pass over the window, eplb.solver.types.LoadWindow)."""
        tokens_WL = layer_load_WL / num_gpus
        # Every loaded expert's replicas receive tokens; replicas spread over the GPUs.
        active_WL = loaded_WL * (num_physical / num_logical) / num_gpus
        return cls(tokens_WL, active_WL, cost)

    def token_seconds(self, balancedness: float) -> float:
        """Mean seconds of a pass's token term when every layer's busiest GPU carries mean /
        balancedness: the part of the MoE time that balance changes. (A decode pass bound by
        reading its experts' weights does not speed up at all; counting its few tokens
        overstates the saving by about 5% on the presets, and keeps a gain visible on loads too
        small for the token term to bind, such as a test model's.)"""
        peak_WL = self.tokens_WL / max(balancedness, 1e-6)
        return float((self.cost.per_token_us * peak_WL).sum(axis=1).mean()) * 1e-6

    def pass_seconds(self, balancedness: float) -> float:
        """Mean MoE seconds of a pass at ``balancedness`` (:meth:`CostModel.layer_times_us`)."""
        c = self.cost
        peak_WL = self.tokens_WL / max(balancedness, 1e-6)
        per_WL = c.base_us + np.maximum(c.per_expert_us * self.active_WL, c.per_token_us * peak_WL)
        return float(per_WL.sum(axis=1).mean()) * 1e-6

    def seconds_per_balancedness(self, balancedness: float) -> float:
        """Seconds one pass saves per unit of model balancedness gained near ``balancedness``."""
        step = 1e-3
        low = max(balancedness - step, 1e-3)
        high = min(low + 2 * step, 1.0)
        return (self.token_seconds(low) - self.token_seconds(high)) / (high - low)


@dataclass(frozen=True)
class TransferCost:
    """What moving a plan costs, as the simulator charges it."""

    seconds: float
    """Stall plus the time the passes lose to a swap beside them."""
    delay_passes: int
    """Passes served on the old placement before the new one takes over (beside the passes)."""


def transfer_cost(
    cost: CostModel,
    diff: PlacementDiff,
    *,
    beside_passes: bool,
    gbps: float | None,
    horizon: int,
    pass_seconds: float,
) -> TransferCost:
    """The cost of ``diff``: a stall for its whole link time (periodic), or, sent ``beside_passes``
    at ``gbps`` during the ``horizon`` passes of ``pass_seconds`` before the next rebalance, the
    time those passes lose to it and a stall for the part they do not cover (as
    :func:`swap_beside_passes` charges it)."""
    if not beside_passes:
        return TransferCost(cost.transfer_seconds(diff, None), 0)
    link = cost.transfer_seconds(diff, gbps)
    slowdown = cost.interference_slowdown(gbps)
    wall = max(pass_seconds, 1e-9) * (1.0 + slowdown)
    delay = int(np.ceil(link / wall)) if link > 0 else 0
    if delay <= horizon:  # it arrives beside the passes: they lose the slowdown's share of its time
        return TransferCost(link * slowdown / (1.0 + slowdown), delay)
    covered = horizon * wall
    return TransferCost(covered * slowdown / (1.0 + slowdown) + (link - covered), horizon)


# ---- dispatch kernels ----------------------------------------------------------------------------

PHASES = ("decode", "prefill")
"""The pass phases a dispatch-kernel table may price apart (SGLang runs decode in CUDA graphs,
prefill eagerly)."""

_H200_TOKENS = (64, 4096, 16384, 65536)
_H200_GRAPH = {
    # docs/benchmarks.md "lp on 58 solved layers": 58 calls in one CUDA graph, µs per call, the
    # deepseek-v3 lp plan at EP32 (H200, 2026-12-03; lp with its default 4 passes).
    "static": (1.43, 2.21, 2.83, 4.19),
    "lp": (30.2, 32.8, 36.2, 43.0),
}
_H100_GRAPH = {  # the same benchmark on an H100 (torch 2.11, triton 3.6), lp with 4 passes
    "static": (1.51, 2.20, 2.83, 4.24),
    "lp": (30.4, 33.3, 36.3, 43.0),
}
_H100_EAGER = {  # one call between events, host launch included (the same H100 run)
    "static": (19.3, 19.7, 19.8, 19.5),
    "lp": (89.4, 95.6, 99.4, 102.0),
}


def _table(rows: Mapping[str, tuple[float, ...]]) -> dict[str, Any]:
    return {"tokens": list(_H200_TOKENS), **{mode: list(us) for mode, us in rows.items()}}


DISPATCH_KERNEL_TABLES: dict[str, dict[str, Any]] = {
    "h200": _table(_H200_GRAPH),
    "h100": _table(_H100_GRAPH),
    "h100-eager": _table(_H100_EAGER),
    "h100-sglang": {"decode": _table(_H100_GRAPH), "prefill": _table(_H100_EAGER)},
    "none": {"tokens": [1], "static": [0.0], "lp": [0.0]},
}
"""Named ``--eplb-dispatch-cost`` tables (JSON form): µs per layer of each dispatch mode's kernels
at the rank's ``tokens``. ``h200`` / ``h100``: 58 layers in one CUDA graph (what a server pays where
its MoE layers run in CUDA graphs, decode); ``h100-eager``: launched one by one; ``h100-sglang``:
graph figures for decode, eager for prefill (SGLang's default, CUDA graphs for decode only);
``none``: dispatch costs nothing (the simulator before it charged dispatch). Modes a table does not
list (dynamic, weighted, fake: one launch of the same remap kernel as static, not measured apart)
are charged static's row."""
DEFAULT_DISPATCH_COST = "h200"
"""The default table: graph figures, on the GPU the cost model's other defaults were fitted on."""
DISPATCH_COST_MAX_BYTES = 1 << 20
"""Largest dispatch-cost JSON file read."""


@dataclass(frozen=True)
class KernelRows:
    """One phase's table: µs per layer of each mode at ``tokens``."""

    tokens: tuple[float, ...]
    """Tokens of the rank, ascending (> 0)."""
    us: Mapping[str, tuple[float, ...]]
    """mode -> µs per layer at each of ``tokens``; ``static`` and ``lp`` at least."""

    def layer_us(self, mode: str, tokens_n: np.ndarray) -> np.ndarray:
        """float64 [n]: µs per layer of ``mode`` at the rank's ``tokens_n``, interpolated in log(tokens)."""
        row = self.us.get(mode, self.us["static"])
        log_n = np.log(np.maximum(np.asarray(tokens_n, dtype=np.float64), 1.0))
        return np.interp(log_n, np.log(np.asarray(self.tokens)), np.asarray(row, dtype=np.float64))


@dataclass(frozen=True)
class DispatchKernelCost:
    """µs per layer of each dispatch mode's kernels, by the rank's tokens and the pass's phase."""

    decode: KernelRows
    prefill: KernelRows
    name: str = "custom"
    """The named table it came from (``custom``: given as JSON)."""

    def layer_us(self, mode: str, tokens_n: np.ndarray, prefill_n: np.ndarray) -> np.ndarray:
        """float64 [n]: µs per layer of ``mode``'s kernels on passes of ``tokens_n`` rank tokens."""
        prefill_n = np.asarray(prefill_n, dtype=bool)
        return np.where(
            prefill_n, self.prefill.layer_us(mode, tokens_n), self.decode.layer_us(mode, tokens_n)
        )

    def to_dict(self) -> dict[str, Any]:
        rows = {
            phase: {"tokens": list(r.tokens), **{m: list(u) for m, u in r.us.items()}}
            for phase, r in zip(PHASES, (self.decode, self.prefill), strict=True)
        }
        return {"name": self.name, **rows}


def _rows(table: Any, where: str) -> KernelRows:
    """A phase's table from its JSON form; ValueError naming what is wrong."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected an object of 'tokens' and per-mode rows, got {table!r}")
    tokens = table.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{where}: 'tokens' must be a non-empty list of token counts")
    if not all(_number(t) and t > 0 for t in tokens) or any(b <= a for a, b in itertools.pairwise(tokens)):
        raise ValueError(f"{where}: 'tokens' must be positive numbers in ascending order, got {tokens}")
    us: dict[str, tuple[float, ...]] = {}
    for mode, row in table.items():
        if mode == "tokens":
            continue
        if mode not in _KERNEL_MODES:
            raise ValueError(f"{where}: unknown dispatch mode {mode!r}; choose from {_KERNEL_MODES}")
        if not isinstance(row, list) or len(row) != len(tokens):
            raise ValueError(f"{where}: '{mode}' must list {len(tokens)} figures (one per token count)")
        if not all(_number(u) and u >= 0 for u in row):
            raise ValueError(f"{where}: '{mode}' must hold finite µs >= 0, got {row}")
        us[mode] = tuple(float(u) for u in row)
    for mode in ("static", "lp"):
        if mode not in us:
            raise ValueError(f"{where}: needs a '{mode}' row")
    return KernelRows(tuple(float(t) for t in tokens), us)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and bool(np.isfinite(value))


_KERNEL_MODES = ("static", "dynamic", "fake", "weighted", "lp")
"""Modes a table may price (the modes with kernels of their own; ``auto`` runs static's or lp's)."""


def dispatch_kernel_cost(value: str) -> DispatchKernelCost:
    """The table ``--eplb-dispatch-cost`` names: a name of ``DISPATCH_KERNEL_TABLES``, JSON text
    (``{"tokens": [...], "static": [...], "lp": [...]}``, or ``{"decode": TABLE, "prefill":
    TABLE}``), or the path of a JSON file holding one. ValueError naming the problem."""
    from eplb.fileio import json_error_text, read_input

    text = value.strip()
    name = "custom"
    if text in DISPATCH_KERNEL_TABLES:
        name, table = text, DISPATCH_KERNEL_TABLES[text]
    else:
        if not text.startswith("{"):
            if not text:
                raise ValueError(f"a table name {tuple(DISPATCH_KERNEL_TABLES)}, JSON or a JSON file, got ''")
            try:
                text = read_input(text, limit=DISPATCH_COST_MAX_BYTES, what="dispatch cost file").decode()
            except FileNotFoundError:
                raise ValueError(
                    f"{value!r} is neither a table ({', '.join(DISPATCH_KERNEL_TABLES)}), JSON, nor a file"
                ) from None
            except UnicodeDecodeError:
                raise ValueError(f"{value}: the dispatch cost file is not UTF-8 text") from None
        try:
            table = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {json_error_text(exc)}") from None
    if isinstance(table, dict) and set(table) & set(PHASES):
        extra = set(table) - set(PHASES)
        if extra or set(table) != set(PHASES):
            raise ValueError(f"a table by phase needs exactly the keys {PHASES}, got {sorted(table)}")
        return DispatchKernelCost(_rows(table["decode"], "decode"), _rows(table["prefill"], "prefill"), name)
    rows = _rows(table, "table")
    return DispatchKernelCost(rows, rows, name)
