"""SGLang's expert weight updater done by eplb's hot-swap (opt-in: ``EPLB_SGLANG_WEIGHT_UPDATER=1``).

Shape legend: L layers, P physical slots, S slots per GPU.

SGLang 0.5.23 moves expert weights after a rebalance in ``ExpertLocationUpdater.update(
routed_experts_weights_of_layer, new_expert_location_metadata, update_layer_ids, nnodes, rank)``,
which ``EPLBManager.rebalance`` calls once per chunk of layers: point-to-point transfers on the
serving communicator straight into the live slots, then ``ExpertLocationMetadata.update``. With
:func:`install` (the SGLang plugin calls it when ``EPLB_SGLANG_WEIGHT_UPDATER=1``) an AROUND hook
does the same through eplb's hot-swap (eplb.hotswap): every tensor SGLang lists for a layer
(weights and quantisation scales, in whatever per-slot layout the MoE kernels read) moves into
staging on a process group of its own, is checksummed, and the chunk of layers commits on every
rank or on none; the metadata follows only a committed swap. The return value is SGLang's: the
logical experts missing per layer, always none here (SGLang fills it only under elastic EP,
which this path hands back to SGLang's own code).

A failed swap leaves the old weights and the old metadata of the chunk (earlier chunks of the
rebalance stay applied: consistent per layer), logs an error, reports a failed rebalance to the
metrics sink, and disables rebalancing through ``EPLBManager.disable_rebalance`` (SGLang's own
switch, as its elastic EP uses it); serving goes on. A swap given up with transfers in flight
(a peer late or interrupted) drops its group and the next swap makes a fresh one; one where a
rank may be gone stops this updater for good (old weights, no collective again).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from eplb.integrations.engine_env import SGLANG_GBPS_ENV, SGLANG_TIMEOUT_ENV, SGLANG_UPDATER_ENV, env_flag

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from eplb.hotswap.layout import SlotLayout
    from eplb.hotswap.swap import FaultHook, HotSwapOptions, HotSwapResult
    from eplb.metrics.causes import RebalanceCause
    from eplb.metrics.sink import MetricsSink
    from eplb.placement.model import Placement

# The variables (eplb.integrations.engine_env.ENV_VARS): ``EPLB_SGLANG_WEIGHT_UPDATER`` turns the
# replacement on, ``EPLB_SGLANG_TRANSFER_GBPS`` paces each swap (GB/s into the busiest GPU; unset:
# as fast as the link), ``EPLB_SGLANG_SWAP_TIMEOUT_S`` is the deadline of every wait (unset: 60).
ENV = SGLANG_UPDATER_ENV
GBPS_ENV = SGLANG_GBPS_ENV
TIMEOUT_ENV = SGLANG_TIMEOUT_ENV
UPDATER_ENV = (ENV, GBPS_ENV, TIMEOUT_ENV)
"""This module's ``EPLB_*`` variables (metrics: the plugin's shared ``EPLB_METRICS_PORT``)."""
UPDATER_TARGET = "sglang.srt.eplb.expert_location_updater.ExpertLocationUpdater.update"
MANAGER_TARGET = "sglang.srt.eplb.eplb_manager.EPLBManager.__init__"
_CAUSES: dict[str, RebalanceCause] = {
    "checksum": "failed_checksum",
    "timeout": "failed_timeout",
    "peer lost": "failed_peer",
    "shape": "failed_shape",
}
"""A hot-swap's cause as the metrics' rebalance cause (anything else: ``failed_other``)."""

log = logging.getLogger("eplb.integrations.sglang_updater")


def requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``EPLB_SGLANG_WEIGHT_UPDATER`` asks for the replacement; ValueError naming it otherwise."""
    return env_flag(os.environ if environ is None else environ, ENV, False)


@dataclass(frozen=True, kw_only=True)
class UpdaterConfig:
    """How the replacement moves weights; every rank must use the same values."""

    transfer_gbps: float | None = None
    """Pace: GB/s into the busiest GPU, averaged over a swap's staging chunks (None: unpaced).
    SGLang's ``update`` blocks its pass while the swap runs, so pacing makes that stall longer
    and leaves link bandwidth to other traffic (KV transfers); ``--eplb-rebalance-layers-per-chunk``
    is what spreads a rebalance over passes."""
    timeout_s: float = 60.0
    """Deadline of every wait of a swap; a rank this late, or whose heartbeat stops, fails it."""
    chunk_bytes: int | None = None
    """Most bytes one GPU receives per agreed chunk of a swap (None: 2 GiB unpaced, 10 ms of the
    pace when paced). Staging holds every expert a call writes on a rank, whatever this is."""
    verify: bool = True
    """Checksum every moved expert on both sides and fail the swap on a mismatch."""

    def __post_init__(self) -> None:
        gbps = self.transfer_gbps
        if gbps is not None and not (math.isfinite(gbps) and gbps > 0):
            raise ValueError(f"transfer_gbps must be a finite number > 0, got {gbps}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
        if self.chunk_bytes is not None and self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> UpdaterConfig:
        """The configuration the environment sets; ValueError naming the variable otherwise."""
        env = os.environ if environ is None else environ

        def read(name: str, parse: Callable[[str], Any]) -> Any:
            raw = env.get(name, "").strip()
            if not raw:
                return None
            try:
                return parse(raw)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None

        values = {"transfer_gbps": read(GBPS_ENV, float), "timeout_s": read(TIMEOUT_ENV, float)}
        names = {"transfer_gbps": GBPS_ENV, "timeout_s": TIMEOUT_ENV}
        try:
            return cls(**{k: v for k, v in values.items() if v is not None})
        except ValueError as exc:
            bad = next((names[k] for k in names if str(exc).startswith(k)), ENV)
            raise ValueError(f"{bad}: {exc}") from None

    def options(self) -> HotSwapOptions:
        """The hot-swap options of one call."""
        from eplb.hotswap.swap import HotSwapOptions

        pace = None if self.transfer_gbps is None else self.transfer_gbps * 1e9
        chunk = self.chunk_bytes
        if chunk is None:
            chunk = 2 << 30 if pace is None else max(1, int(pace * 0.01))
        return HotSwapOptions(
            staging_budget_bytes=chunk, timeout_s=self.timeout_s, verify=self.verify, pace_bytes_per_s=pace
        )


@dataclass(frozen=True)
class SwapReport:
    """What one ``update`` call did on this rank (kept for logs, tests and ``eplb`` metrics)."""

    layers: tuple[int, ...]
    ok: bool
    cause: str | None
    """None when committed; else the hot-swap's cause (``checksum``, ``timeout``, ``peer lost``, ...)."""
    error: str | None
    seconds: float
    experts_moved: int
    bytes_moved: int
    phase_seconds: dict[str, float] = field(default_factory=dict)


class EplbWeightUpdater:
    """This process's replacement of ``ExpertLocationUpdater.update``: its swap group and state."""

    def __init__(
        self,
        config: UpdaterConfig | None = None,
        *,
        sink: Callable[[], MetricsSink] | None = None,
        layout: SlotLayout | None = None,
    ) -> None:
        self.config = config or UpdaterConfig()
        self.layout = layout
        self.sink_of = sink
        """Gives the sink failed swaps are reported to (called at each failure; None: logs only)."""
        self.group: dist.ProcessGroup | None = None
        self.stopped: str | None = None
        """Why this updater never swaps again (a rank may be gone, or this rank's state is undefined)."""
        self.reports: collections.deque[SwapReport] = collections.deque(maxlen=64)
        self.managers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.fault: FaultHook | None = None
        """Tests inject failures through it (eplb.hotswap.FaultHook)."""
        """SGLang's ``EPLBManager`` objects of this process (recorded by the hook on their __init__)."""
        self._given_up: list[Any] = []
        self._fallbacks: set[str] = set()
        self._lock = threading.Lock()

    # ---- SGLang's contract ------------------------------------------------------------------
    def update(
        self,
        original: Callable[..., Any],
        sglang_updater: Any,
        routed_experts_weights_of_layer: Mapping[int, list[torch.Tensor]],
        new_expert_location_metadata: Any,
        update_layer_ids: list[int],
        nnodes: int,
        rank: int,
        use_flat_topology: bool = False,
    ) -> dict[int, list[int]]:
        """``ExpertLocationUpdater.update`` (AROUND hook): the same arguments, effects and return."""
        import torch
        import torch.distributed as dist
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        def sglang() -> dict[int, list[int]]:
            result: dict[int, list[int]] = original(
                sglang_updater,
                routed_experts_weights_of_layer,
                new_expert_location_metadata,
                update_layer_ids=update_layer_ids,
                nnodes=nnodes,
                rank=rank,
                use_flat_topology=use_flat_topology,
            )
            return result

        old = get_global_expert_location_metadata()
        assert old is not None, "SGLang updates expert weights only once it has a placement"
        weights = routed_experts_weights_of_layer
        layers = tuple(int(x) for x in update_layer_ids)
        reason = _unsupported(old, new_expert_location_metadata, weights, layers, rank)
        if reason is not None:
            if reason not in self._fallbacks:
                self._fallbacks.add(reason)
                log.warning("eplb weight updater: %s; SGLang's own updater moves these weights", reason)
            return sglang()
        if getattr(sglang_updater, "_first_execution", False):
            sglang_updater._first_execution = False  # as SGLang does: room for what the swap stages
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self.stopped is not None:
            self._fail(layers, f"not swapped: this updater stopped earlier ({self.stopped})", "error")
            return {}
        sample = weights[layers[0]][0]
        nodes = 1 if use_flat_topology else max(int(nnodes), 1)
        world = dist.get_world_size()
        if world % nodes:
            nodes = 1  # SGLang's own updater then counts every GPU as one node's too
        with self._lock:
            if world > 1 and self.group is None:
                from eplb.hotswap.runtime import swap_group

                # Collective over every rank: each calls update for the same chunk on the same pass.
                self.group = swap_group(None, sample.device, timeout_s=self.config.timeout_s)
        self._swap(old, new_expert_location_metadata, weights, layers, world, nodes)
        return {}

    def _swap(
        self,
        old: Any,
        new: Any,
        weights: Mapping[int, list[torch.Tensor]],
        layers: tuple[int, ...],
        world: int,
        nodes: int,
    ) -> None:
        from eplb.hotswap.commit import HotSwapError
        from eplb.hotswap.swap import prepare_swap

        start = time.perf_counter()
        before, after = _placement(old, world, nodes), _placement(new, world, nodes)
        slots_L = slot_buffers(weights, layers, before.num_layers)

        def update_maps() -> None:
            old.update(new, update_layer_ids=list(layers))  # SGLang's call, after the commit only

        try:
            prepared = prepare_swap(
                slots_L,
                before,
                after,
                layers=layers,
                group=self.group,
                options=self.config.options(),
                layout=self.layout,
                fault=self.fault,
            )
        except HotSwapError as exc:
            self._given_up_with(exc, layers, start)
            return
        except (ValueError, RuntimeError) as exc:  # refused on every rank alike: nothing moved
            self._fail(layers, f"{type(exc).__name__}: {exc}", getattr(exc, "cause", None) or "error", start)
            return
        try:
            result = prepared.execute(update_maps=update_maps, fault=self.fault)
        except HotSwapError as exc:
            self._given_up_with(exc, layers, start)
            if not exc.consistent:
                raise  # this rank's slots or metadata are undefined: serving on them would be wrong
            return
        except BaseException:  # interrupted (KeyboardInterrupt): its side is done; say so, re-raise
            try:
                self._report(prepared.decided(), start)
            except HotSwapError as exc:
                self._given_up_with(exc, layers, start)
            raise
        self._report(result, start)

    # ---- outcomes ---------------------------------------------------------------------------
    def _report(self, result: HotSwapResult, start: float) -> None:
        if not result.ok:
            self._fail(result.layers, result.error or "failed", result.cause or "error", start, result)
            return
        report = SwapReport(
            result.layers,
            True,
            None,
            None,
            time.perf_counter() - start,
            result.experts_moved,
            result.bytes_moved,
            dict(result.phase_seconds),
        )
        self.reports.append(report)
        log.info(
            "eplb hot-swap committed layers %s: %d experts, %d bytes across GPUs in %.3f s",
            list(result.layers),
            result.experts_moved,
            result.bytes_moved,
            report.seconds,
        )

    def _given_up_with(self, exc: Any, layers: tuple[int, ...], start: float) -> None:
        """A swap given up without every rank's vote: its group is done; maybe this updater too."""
        if self.group is not None:
            self._given_up.append(self.group)  # kept, never destroyed (see eplb.hotswap.swap_group)
        self.group = None
        if not exc.consistent:
            self.stopped = f"rank state undefined: {exc}"
        elif not exc.alive:
            self.stopped = f"a rank may be gone: {exc}"
        self._fail(layers, str(exc), exc.cause, start)

    def _fail(
        self,
        layers: tuple[int, ...],
        error: str,
        cause: str,
        start: float | None = None,
        result: HotSwapResult | None = None,
    ) -> None:
        seconds = 0.0 if start is None else time.perf_counter() - start
        report = SwapReport(
            layers,
            False,
            cause,
            error,
            seconds,
            0 if result is None else result.experts_moved,
            0 if result is None else result.bytes_moved,
            {} if result is None else dict(result.phase_seconds),
        )
        self.reports.append(report)
        reason = f"eplb hot-swap of layers {list(layers)} failed ({cause}): {error}"
        log.error("%s; the old weights and placement of these layers stay, rebalancing disabled", reason)
        self._emit(reason, report)
        for manager in list(self.managers):
            try:
                manager.disable_rebalance(reason)
            except Exception:  # telling SGLang must not end serving
                log.exception("eplb weight updater: EPLBManager.disable_rebalance raised")
        if not self.managers:
            log.error("eplb weight updater: no SGLang EPLBManager known to disable rebalancing on")

    def _emit(self, reason: str, report: SwapReport) -> None:
        """A failed swap as a failed rebalance (the plan it would have applied was reported by the
        planner already; a committed chunk is logged, not counted again)."""
        try:
            if self.sink_of is None:
                return
            self.sink_of().on_rebalance(
                outcome="failed",
                reason=reason,
                cause=_CAUSES.get(report.cause or "", "failed_other"),
                solve_seconds=0.0,
                transfer_seconds=report.seconds,
                experts_moved=report.experts_moved,
                bytes_moved=report.bytes_moved,
                balancedness_before=float("nan"),
                balancedness_after=float("nan"),
            )
        except Exception:  # metrics must not end serving
            log.exception("eplb weight updater: the metrics sink raised")


def _unsupported(
    old: Any, new: Any, weights: Mapping[int, list[torch.Tensor]], layers: tuple[int, ...], rank: int
) -> str | None:
    """Why eplb's swap does not take this call (SGLang's own code then does), or None."""
    import torch.distributed as dist

    try:
        from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

        if ElasticEPStateManager.instance() is not None:
            return "elastic EP is on (ranks may be missing, which SGLang's updater handles)"
    except ImportError:
        pass
    if not (dist.is_available() and dist.is_initialized()):
        return "torch.distributed is not initialised"
    world = dist.get_world_size()
    if old.ep_size != world or new.ep_size != world:
        return f"the EP size ({old.ep_size}) is not the world size ({world})"
    if rank != dist.get_rank():
        return f"the EP rank ({rank}) is not the global rank ({dist.get_rank()})"
    if not layers:
        return "no layers to update"
    S = old.num_local_physical_experts
    for layer in layers:
        tensors = weights.get(layer)
        if not tensors:
            return f"layer {layer} has no expert tensors"
        for t in tensors:
            if t.ndim == 0 or t.shape[0] != S or not t.is_contiguous() or t.device != tensors[0].device:
                return f"a tensor of layer {layer} is not a contiguous [S={S}, ...] slot buffer"
    return None


def _placement(metadata: Any, world: int, nodes: int) -> Placement:
    from eplb.placement.model import Placement

    phy2log_LP = np.asarray(metadata.physical_to_logical_map_cpu.numpy(), dtype=np.int32)
    return Placement.from_phy2log(phy2log_LP, world, nodes)


def slot_buffers(
    weights: Mapping[int, list[torch.Tensor]], layers: tuple[int, ...], num_layers: int
) -> list[dict[str, torch.Tensor]]:
    """Per metadata row l, this rank's slot tensors [S, ...] by name (``t00``, ``t01``, ... in
    SGLang's order). Rows the call does not update (dense layers too) get a layer's tensors as
    stand-ins: the swap only reads their shapes, it never touches a layer it does not update."""
    named = {layer: {f"t{i:02d}": t for i, t in enumerate(tensors)} for layer, tensors in weights.items()}
    stand_in = named[layers[0]]
    return [named.get(layer, stand_in) for layer in range(num_layers)]


# ---- installation -------------------------------------------------------------------------------
_UPDATER: list[EplbWeightUpdater] = []


def current() -> EplbWeightUpdater | None:
    """The installed replacement of this process, or None."""
    return _UPDATER[0] if _UPDATER else None


TransferListener = Callable[[float, bool], None]
"""Told the seconds of each ``update`` call and whether it moved the rebalance's last MoE layer."""
_LISTENERS: list[TransferListener] = []
_HOOKED: list[Any] = []


def update_hook(original: Callable[..., Any], sglang_updater: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ExpertLocationUpdater.update``: eplb's swap (SGLang's own code where it does not
    apply), timed for the listeners (the plugin's metrics: eplb_rebalance_transfer_seconds)."""
    updater = current()
    start = time.perf_counter()
    if updater is None:
        result = original(sglang_updater, *args, **kwargs)
    else:
        result = updater.update(original, sglang_updater, *args, **kwargs)
    if _LISTENERS:
        weights = kwargs.get("routed_experts_weights_of_layer", args[0] if args else {})
        layers = kwargs.get("update_layer_ids", args[2] if len(args) > 2 else ())
        last = bool(layers) and bool(weights) and max(layers) >= max(weights)
        for listener in _LISTENERS:
            try:
                listener(time.perf_counter() - start, last)
            except Exception:  # metrics must not end serving
                log.exception("eplb weight updater: a transfer listener raised")
    return result


def hook_update(registry: Any = None, listener: TransferListener | None = None) -> None:
    """Register :func:`update_hook` with SGLang's ``HookRegistry`` once (eplb's updater or only the
    timing of SGLang's own), and add ``listener``."""
    if listener is not None and listener not in _LISTENERS:
        _LISTENERS.append(listener)
    if _HOOKED:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = HookRegistry if registry is None else registry
    hooks.register(UPDATER_TARGET, update_hook, HookType.AROUND)
    _HOOKED.append(hooks)


def manager_hook(result: Any, manager: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``EPLBManager.__init__``: remember the manager, to disable rebalancing after a failed swap."""
    updater = current()
    if updater is not None:
        updater.managers.add(manager)


def install(
    config: UpdaterConfig | None = None,
    *,
    sink: Callable[[], MetricsSink] | None = None,
    layout: SlotLayout | None = None,
    registry: Any = None,
) -> EplbWeightUpdater:
    """Register the hooks with SGLang's ``HookRegistry`` (SGLang applies them after its plugins ran).

    Idempotent: a second call replaces the configuration, not the hooks. ``config`` defaults to
    the environment's (:meth:`UpdaterConfig.from_env`); ``sink`` gives the metrics sink failed
    swaps are reported to (the plugin's, rank 0's exporter with ``EPLB_METRICS_PORT``); ``layout`` is the slot layout of the
    tensors (None: plain; every registered layout is slot-major, so none changes what moves).
    """
    updater = EplbWeightUpdater(config or UpdaterConfig.from_env(), sink=sink, layout=layout)
    if _UPDATER:
        updater.managers = _UPDATER[0].managers
        _UPDATER[0] = updater
        return updater
    _UPDATER.append(updater)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = HookRegistry if registry is None else registry
    hook_update(hooks)
    hooks.register(MANAGER_TARGET, manager_hook, HookType.AFTER)
    log.info("eplb: %s=1, SGLang's expert weights move through eplb's hot-swap (%s)", ENV, updater.config)
    return updater
