"""eplb's ``lp`` dispatch behind SGLang's ``--ep-dispatch-algorithm lp`` (``EPLB_SGLANG_LP=1``, or ``auto``).

Shape legend: T tokens, K top-k, L layers, E logical experts, P physical slots, G GPUs (EP ranks).

SGLang 0.5.23 serves ``lp`` with one ``LPLBSolver`` per MoE layer, built by
``moe_ep_setup.init_lplb_solvers`` at start-up and after every rebalance chunk: ``solve(topk_ids)``
counts the rank's tokens, all-reduces the counts over the EP group and solves the layer's min-max
LP on the GPU (an interior-point method JIT-compiled with Math-DX, SM90 only, 20-40 s per shape;
``init_lplb_solvers`` refuses every model outside the DeepSeek family); it returns a
``log2phy_prob`` table that ``topk_ids_logical_to_physical(topk_ids, info, log2phy_prob)`` samples
each token's replica from. Every EP rank calls ``solve`` on every layer, an idle one with no ids
(``TopK.empty_topk_output``), or the all-reduce waits.

Two hooks (SGLang's ``HookRegistry``) put eplb there instead:

- ``init_lplb_solvers`` (REPLACE): one :class:`EplbLpSolver` per layer over one set of eplb
  dispatch tables of the live placement (``get_global_expert_location_metadata()``), registered
  through SGLang's own ``set_global_lplb_solver``. After a rebalance the tables are updated in
  place (addresses kept, so captured CUDA graphs stay valid). No JIT step, no model-family gate.
- ``topk_ids_logical_to_physical`` (AROUND), for ``lp`` only: the ids the solver mapped.

``EplbLpSolver.solve`` runs ``eplb.remap.remap_and_record(mode="lp")`` (its rule:
eplb.remap.lp_rule; Triton on CUDA and ROCm, torch on the CPU): count, one int32 all-gather of
[G, E] over SGLang's EP group (``all_gather_into_tensor``, idle ranks with zeros), quotas, each
token's replica. It returns the mapped ids as an :class:`LpDispatch`, which SGLang carries to its
map call in place of ``log2phy_prob``. Where SGLang maps without solving first (its ROCm branch of
``select_experts`` has no ``lp`` solve), the map call solves for the layer of the dispatch info.
A layer whose experts all have one replica maps statically and exchanges nothing (every rank
agrees: the placement is the same everywhere). Padded rows are counted as SGLang's solver counts
them (SGLang masks them to -1 after the map).

``auto`` (eplb.policy.auto_dispatch; :func:`enable_auto`): each pass maps every layer by ``lp`` or
statically (no exchange), whichever the model prices lower for the pass's size and phase. Every
rank must be told the same pass, before its first layer, through :meth:`LpServing.begin_pass`: the
pass's global token count (summed over the DP ranks, as SGLang's ``global_num_tokens_cpu`` holds
it; under CUDA graphs the captured batch size's padded count, so a graph keeps the mode it was
captured with) and whether it is prefill, values every rank holds alike, so all take the same mode
without a collective. Until a pass is begun every layer runs ``lp``. The ids returned are physical
either way, so SGLang's recorder counts either.

``EPLB_SGLANG_LP=auto`` (:func:`register_auto`, with SGLang's ``--ep-dispatch-algorithm lp``: SGLang
has no ``auto`` choice of its own) adds AROUND hooks that begin every pass: ``ModelRunner.forward``
(each pass, from its ``ForwardBatch``: :func:`pass_of`) and the CUDA graph runners'
``capture_prepare`` (each captured shape, from the padded batch it builds: a replayed graph runs
the kernels of the mode it was captured with, whatever a later choice says). The kernels are
priced by ``EPLB_DISPATCH_COST`` (``--eplb-dispatch-cost``'s tables), the MoE time by the default
:class:`~eplb.policy.cost_model.CostModel`, the routed copies by the model's top-k (read from
SGLang's model config at ``init_lplb_solvers``); after every rebalance the adapter hands over the
window it planned from (:func:`set_window`, eplb.integrations.sglang).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eplb.placement.model import Placement

if TYPE_CHECKING:
    import numpy as np
    import torch

    from eplb.policy.auto_dispatch import AutoDispatch
    from eplb.policy.cost_model import CostModel, DispatchKernelCost
    from eplb.remap.exchange import GatherFn, LpExchange
    from eplb.remap.tables import DispatchTables

_SETUP = "sglang.srt.model_executor.model_runner_components.moe_ep_setup.init_lplb_solvers"
_DISPATCH = "sglang.srt.eplb.expert_location_dispatch.topk_ids_logical_to_physical"
_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
_CAPTURES = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_prepare",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.capture_prepare",
)
"""SGLang 0.5.23's CUDA graph runners' ``capture_prepare``: each returns the padded batch a graph is
captured with (its ``ForwardBatch`` first)."""
BACKEND = "auto"
"""The remap backend of the ``lp`` kernels (Triton on a GPU, torch on the CPU)."""

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LpDispatch:
    """What :meth:`EplbLpSolver.solve` returns where SGLang's solver returns ``log2phy_prob``: the
    physical ids of the ids it was given, for SGLang's map call to hand back."""

    source_TK: torch.Tensor
    """The router ids [T, K] ``solve`` was given (the map call must pass the same)."""
    phys_TK: torch.Tensor
    """Their physical slot ids [T, K], in the ids' dtype."""


class EplbLpSolver:
    """One layer's stand-in for SGLang's ``LPLBSolver`` (``solve`` is all SGLang calls)."""

    def __init__(self, serving: LpServing, layer: int) -> None:
        self.serving = serving
        self.layer = layer

    def solve(self, topk_ids: torch.Tensor) -> LpDispatch:
        """Map this rank's ids [T, K] (T = 0 on an idle rank) by the batch's global counts."""
        return self.serving.map(self.layer, topk_ids)


class LpServing:
    """One process's eplb ``lp`` state: dispatch tables of every layer, their counts exchange, and
    one solver per layer."""

    def __init__(self, placement: Placement, rank: int, device: torch.device, gather: GatherFn) -> None:
        from eplb.remap.exchange import LpExchange
        from eplb.remap.tables import DispatchTables

        self.tables: DispatchTables = DispatchTables.from_placement(placement, rank, device)
        self.exchange: LpExchange = LpExchange(self.tables, gather=gather)
        self.solvers = [EplbLpSolver(self, layer) for layer in range(placement.num_layers)]
        self.rank = rank
        self._shape = _shape(placement)
        self._replicated = _replicated_layers(placement)
        self.layer_by_map: dict[int, int] = {}
        """Address of SGLang's ``logical_to_all_physical_map[layer]`` -> layer (dispatch info rows)."""
        self.placement = placement
        self.auto: AutoSettings | None = None
        """``auto`` dispatch's settings (None: every pass runs ``lp``)."""
        self.choice: AutoDispatch | None = None
        """``auto``'s per-pass choice on the placement now."""
        self.pass_lp = True
        """Whether the pass now maps by ``lp`` (``auto``: set by :meth:`begin_pass`)."""

        self.window_WLE: np.ndarray | None = None
        """``auto``: recorded passes [W, L, E] the choice is modeled on (None: the replica counts)."""

    def set_auto(self, auto: AutoSettings | None) -> None:
        """Serve ``auto`` with ``auto``'s settings (None: ``lp`` on every pass)."""
        self.auto = auto
        self.pass_lp = True
        self._choose()

    def set_window(self, window_WLE: np.ndarray | None) -> None:
        """``auto``: model the choice on these recorded passes [W, L, E] of global counts (the same
        on every rank, as a window summed over the ranks is; None: on the replica counts)."""
        self.window_WLE = window_WLE
        self._choose()

    def _choose(self) -> None:
        window = self.window_WLE
        if window is not None and window.shape[1:] != self.placement.logcnt_LE.shape:
            window = None
        self.choice = None if self.auto is None else self.auto.choice(self.placement, window)

    def begin_pass(self, global_tokens: int, prefill: bool) -> str:
        """``auto``: the mode of the pass about to run (``lp`` or ``static``), from its global token
        count and phase; every rank must pass the same values. Without ``auto``: ``lp``."""
        if global_tokens < 0:
            raise ValueError(f"a pass's global token count must be >= 0, got {global_tokens}")
        self.pass_lp = self.choice is None or self.choice.mode(global_tokens, prefill) == "lp"
        return "lp" if self.pass_lp else "static"

    def fits(self, placement: Placement, rank: int, device: torch.device) -> bool:
        """Whether these tables can take ``placement`` in place (same shapes, rank and device)."""
        return (_shape(placement), rank, device) == (self._shape, self.rank, self.tables.device)

    def update(self, placement: Placement) -> None:
        """Copy a new placement into the tables (their addresses kept); ``auto`` models it anew."""
        self.tables.update_(placement)
        self._replicated = _replicated_layers(placement)
        self.placement = placement
        self._choose()

    def map(self, layer: int, topk_ids: torch.Tensor) -> LpDispatch:
        """This rank's physical ids for ``topk_ids`` [T, K] of ``layer`` (every rank calls, T >= 0)."""
        import torch

        from eplb.remap import remap_and_record

        ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
        ids = ids.contiguous()
        if self._replicated[layer] and self.pass_lp:
            phys = remap_and_record(ids, self.tables, layer, mode="lp", lp=self.exchange, backend=BACKEND)
        else:  # one replica each, or auto's static pass: no rank exchanges (every rank agrees)
            phys = remap_and_record(ids, self.tables, layer, mode="static", backend=BACKEND)
        phys = phys.view(topk_ids.shape)
        return LpDispatch(topk_ids, phys if phys.dtype == topk_ids.dtype else phys.to(topk_ids.dtype))

    def layer_of(self, info: Any) -> int:
        """The layer of SGLang's ``ExpertLocationDispatchInfo`` (its row of the metadata's map)."""
        layer = self.layer_by_map.get(int(info.partial_logical_to_all_physical_map.data_ptr()))
        if layer is None:
            raise RuntimeError(
                "eplb lp dispatch: this dispatch info's expert map is not a layer of the placement "
                "the lp solvers were built for (init_lplb_solvers has not run since it changed)"
            )
        return layer


@dataclass(frozen=True)
class AutoSettings:
    """What ``auto`` dispatch prices each pass with (eplb.policy.auto_dispatch)."""

    kernels: DispatchKernelCost
    """The dispatch kernels' µs per layer (``--eplb-dispatch-cost``)."""
    cost: CostModel
    """The MoE time model."""
    top_k: int
    """Experts per token."""

    def choice(self, placement: Placement, window_WLE: np.ndarray | None = None) -> AutoDispatch:
        """The per-pass choice on ``placement`` for passes like ``window_WLE`` [W, L, E] (None: the
        replica counts standing for the load)."""
        from eplb.policy.auto_dispatch import AutoDispatch

        return AutoDispatch.of(placement, window_WLE, top_k=self.top_k, cost=self.cost, kernels=self.kernels)


def _shape(placement: Placement) -> tuple[int, int, int, int]:
    return (placement.num_layers, placement.num_logical, placement.num_physical, placement.num_gpus)


def _replicated_layers(placement: Placement) -> list[bool]:
    """Per layer: whether some expert has more than one replica (host booleans, read per call)."""
    return [bool(row.max(initial=0) >= 2) for row in placement.logcnt_LE]


_STATE: dict[str, Any] = {}
"""``serving``: this process's :class:`LpServing`; ``logged``: the start-up line was written;
``auto``: the :class:`AutoSettings` :func:`enable_auto` gave; ``auto_kernels``: the kernel table
:func:`register_auto` gave (auto starts once the model's top-k is known); ``window``: the window
:func:`set_window` gave."""


def enable_auto(settings: AutoSettings | None) -> None:
    """Serve ``auto`` dispatch with ``settings`` from now on (None: ``lp`` on every pass), in this
    process's serving state and in any made later."""
    _STATE["auto"] = settings
    found = serving()
    if found is not None:
        found.set_auto(settings)


def begin_pass(global_tokens: int, prefill: bool) -> str:
    """The mode of the pass about to run (:meth:`LpServing.begin_pass`; ``lp`` before the solvers exist)."""
    found = serving()
    return "lp" if found is None else found.begin_pass(global_tokens, prefill)


def set_window(window_WLE: np.ndarray | None) -> None:
    """``auto``: model the choice on these recorded passes [W, L, E] of global counts (the window a
    rebalance planned from, the same on every rank), in this process's serving state and in any
    made later; only its largest passes are kept (eplb.policy.auto_dispatch.largest_passes). Without
    ``auto``: nothing is kept."""
    if _STATE.get("auto") is None and _STATE.get("auto_kernels") is None:
        return
    if window_WLE is not None:
        from eplb.policy.auto_dispatch import largest_passes

        window_WLE = largest_passes(window_WLE)
    _STATE["window"] = window_WLE
    found = serving()
    if found is not None:
        found.set_window(window_WLE)


def pass_of(forward_batch: Any) -> tuple[int, bool]:
    """A pass's global token count and phase from SGLang's ``ForwardBatch``, as every rank holds them.

    Tokens: with SGLang's DP sync (``global_num_tokens_cpu`` set: each DP rank's tokens, gathered)
    their sum; without it every rank runs the same batch: its own (``input_ids``' rows, else
    ``batch_size``). Prefill: ``forward_mode.is_extend()`` or ``is_extend_in_batch`` (the DP sync's
    gathered "some DP rank extends", so an idle DP rank takes its busy peers' phase); a capture
    batch sets only its mode (EXTEND for the prefill graphs, DECODE or a verify mode for decode's).
    """
    counts = getattr(forward_batch, "global_num_tokens_cpu", None)
    if counts is not None:
        tokens = int(sum(int(n) for n in counts))
    else:
        ids = getattr(forward_batch, "input_ids", None)
        tokens = int(ids.shape[0]) if ids is not None else int(getattr(forward_batch, "batch_size", 0) or 0)
    mode = getattr(forward_batch, "forward_mode", None)
    extend = mode is not None and bool(mode.is_extend())
    return tokens, extend or bool(getattr(forward_batch, "is_extend_in_batch", False))


def forward_hook(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ModelRunner.forward(forward_batch, ...)``: begin the pass (:func:`pass_of`), then
    SGLang's forward."""
    batch = args[0] if args else kwargs["forward_batch"]
    begin_pass(*pass_of(batch))
    return original(runner, *args, **kwargs)


def capture_prepare_hook(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND a CUDA graph runner's ``capture_prepare``: SGLang's padded capture batch, then the
    pass begun from it, so the graph captured next holds the mode of its padded size."""
    prepared = original(runner, *args, **kwargs)
    begin_pass(*pass_of(prepared[0]))
    return prepared


def top_k_of(model_config: Any) -> int | None:
    """Experts per token from SGLang's ``ModelConfig`` (its text config's, else its HF config's
    ``num_experts_per_tok``); None where neither has one."""
    for config in (getattr(model_config, "hf_text_config", None), getattr(model_config, "hf_config", None)):
        top_k = getattr(config, "num_experts_per_tok", None)
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1:
            return top_k
    return None


def _start_auto(model_config: Any) -> None:
    """``EPLB_SGLANG_LP=auto``: the :class:`AutoSettings` once the model's top-k is known (the
    first ``init_lplb_solvers``); without one, ``lp`` on every pass, logged."""
    kernels = _STATE.get("auto_kernels")
    if kernels is None or _STATE.get("auto") is not None:
        return
    from eplb.policy.cost_model import CostModel

    top_k = top_k_of(model_config)
    if top_k is None:
        _STATE["auto_kernels"] = None
        _LOG.warning("eplb: EPLB_SGLANG_LP=auto found no top-k in the model config; every pass runs lp")
        return
    enable_auto(AutoSettings(kernels=kernels, cost=CostModel(), top_k=top_k))
    _LOG.info(
        "eplb: auto dispatch: each pass by lp or statically (%s kernel table, top-%d)", kernels.name, top_k
    )


def serving() -> LpServing | None:
    """This process's ``lp`` state, once ``init_lplb_solvers`` ran."""
    found = _STATE.get("serving")
    assert found is None or isinstance(found, LpServing)
    return found


def reset() -> None:
    """Forget this process's ``lp`` state (a fresh process's; tests)."""
    _STATE.clear()


def placement_of(metadata: Any) -> Placement:
    """SGLang's ``ExpertLocationMetadata`` as an eplb Placement (ValueError where it has no
    expert in a slot, as elastic EP leaves, or its experts are not 0..E-1)."""
    cpu = getattr(metadata, "physical_to_logical_map_cpu", None)
    phy2log = (cpu if cpu is not None else metadata.physical_to_logical_map).detach().cpu().numpy()
    E = int(metadata.num_logical_experts)
    if phy2log.size and phy2log.min() < 0:
        raise ValueError("eplb lp dispatch needs an expert in every physical slot (the map holds -1)")
    placement = Placement.from_phy2log(phy2log, int(metadata.ep_size))
    if placement.num_logical != E:
        raise ValueError(f"the placement holds {placement.num_logical} experts, SGLang's metadata {E}")
    return placement


def gather_for(group: Any, num_gpus: int, rank: int) -> GatherFn:
    """The all-gather of [G, E] counts over SGLang's EP ``GroupCoordinator`` (None: one rank)."""
    world = 1 if group is None else int(group.world_size)
    if world != num_gpus or (group is not None and int(group.rank_in_group) != rank):
        me = None if group is None else group.rank_in_group
        raise ValueError(
            f"eplb lp dispatch: SGLang's EP group has {world} ranks (this one {me}) but the "
            f"placement {num_gpus} GPUs, this rank {rank}"
        )
    if world == 1:

        def copy(local_E: torch.Tensor, out_GE: torch.Tensor) -> None:
            out_GE.copy_(local_E[None])

        return copy

    def gather(local_E: torch.Tensor, out_GE: torch.Tensor) -> None:
        group.all_gather_into_tensor(out_GE.view(-1), local_E)

    return gather


def serve(metadata: Any, rank: int, group: Any) -> LpServing:
    """This process's :class:`LpServing` for SGLang's live metadata: built once, updated in place."""
    placement = placement_of(metadata)
    device = metadata.logical_to_all_physical_map.device
    found = serving()
    if found is not None and found.fits(placement, rank, device):
        found.update(placement)
    else:
        found = LpServing(placement, rank, device, gather_for(group, placement.num_gpus, rank))
        found.window_WLE = _STATE.get("window")
        found.set_auto(_STATE.get("auto"))
        _STATE["serving"] = found
    maps = metadata.logical_to_all_physical_map
    found.layer_by_map = {int(maps[layer].data_ptr()): layer for layer in range(maps.shape[0])}
    return found


def sglang_solver_unavailable(device: torch.device) -> str | None:
    """Why SGLang's own LP solver cannot run on ``device`` (None: it could), by SGLang 0.5.23's
    own conditions: CUDA (not ROCm), SM 9.0 or newer, Math-DX's cuBLASDx headers (``MATHDX_HOME``
    or the ``nvidia-mathdx`` package)."""
    import torch

    if device.type != "cuda":
        return f"no CUDA device ({device.type})"
    if torch.version.hip is not None:
        return "ROCm (SGLang's LP solver is CUDA only)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"GPU SM {major}.{minor} < 9.0"
    if not _mathdx_found():
        return "Math-DX (cuBLASDx) headers not found: neither MATHDX_HOME nor the nvidia-mathdx package"
    return None


def _mathdx_found() -> bool:
    """SGLang's ``get_mathdx_root`` lookup (``sglang.kernels.jit.utils.deps``), which itself raises
    where no ``nvidia`` package exists at all."""
    home = os.environ.get("MATHDX_HOME")
    if home and (Path(home).expanduser() / "include").exists():
        return True
    try:
        spec = importlib.util.find_spec("nvidia.mathdx")
    except ModuleNotFoundError:
        return False
    if spec is None:
        return False
    roots = [
        *(spec.submodule_search_locations or []),
        *([str(Path(spec.origin).parent)] if spec.origin else []),
    ]
    return any((Path(root) / "include").exists() for root in roots)


def init_lplb_solvers(*args: Any, **kwargs: Any) -> None:
    """REPLACE for SGLang's ``init_lplb_solvers(*, model_config)``: eplb's solver on every layer
    of the live placement, registered where SGLang's layers look their solver up."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.eplb.lplb_solver import clear_global_lplb_solvers, set_global_lplb_solver
    from sglang.srt.runtime_context import get_parallel

    _start_auto(kwargs.get("model_config", args[0] if args else None))
    metadata = get_global_expert_location_metadata()
    if metadata is None:
        return
    parallel = get_parallel()
    found = serve(metadata, int(parallel.moe_ep_rank), parallel.moe_ep_group)
    clear_global_lplb_solvers()
    for layer, solver in enumerate(found.solvers):
        set_global_lplb_solver(layer, solver)
    if not _STATE.get("logged"):
        _STATE["logged"] = True
        reason = sglang_solver_unavailable(found.tables.device)
        if reason is None:
            _LOG.info(
                "eplb: --ep-dispatch-algorithm lp runs eplb's lp kernels (SGLang's LP solver is not used)"
            )
        else:
            _LOG.info(
                "eplb: --ep-dispatch-algorithm lp runs eplb's lp kernels; SGLang's own LP solver "
                "could not run here: %s",
                reason,
            )


def topk_ids_logical_to_physical_hook(
    original: Any, topk_ids: torch.Tensor, info: Any, log2phy_prob: Any = None
) -> torch.Tensor:
    """AROUND ``topk_ids_logical_to_physical``: ``lp`` ids from eplb's solver; else SGLang's code."""
    found = serving()
    if info is None or found is None or info.ep_dispatch_algorithm != "lp":
        return original(topk_ids, info, log2phy_prob)
    if isinstance(log2phy_prob, LpDispatch):
        source = log2phy_prob.source_TK
        if source.data_ptr() != topk_ids.data_ptr() or source.shape != topk_ids.shape:
            raise RuntimeError(
                "eplb lp dispatch: the ids to map are not the ids the layer's solver was given"
            )
        return log2phy_prob.phys_TK
    if log2phy_prob is None:  # mapped without a solve first (SGLang's ROCm branch): solve here
        return found.map(found.layer_of(info), topk_ids).phys_TK
    return original(topk_ids, info, log2phy_prob)


def register_lp(registry: Any, hook_type: Any) -> None:
    """Register both hooks with SGLang's HookRegistry (``EPLB_SGLANG_LP=1``)."""
    registry.register(_SETUP, init_lplb_solvers, hook_type.REPLACE)
    registry.register(_DISPATCH, topk_ids_logical_to_physical_hook, hook_type.AROUND)


def register_auto(registry: Any, hook_type: Any, kernels: DispatchKernelCost) -> None:
    """``EPLB_SGLANG_LP=auto``: priced by ``kernels``, every pass begun before its first layer
    (``ModelRunner.forward`` and each graph runner's ``capture_prepare``, AROUND); with
    :func:`register_lp`'s hooks."""
    _STATE["auto_kernels"] = kernels
    registry.register(_FORWARD, forward_hook, hook_type.AROUND)
    for target in _CAPTURES:
        registry.register(target, capture_prepare_hook, hook_type.AROUND)


__all__ = [
    "AutoSettings",
    "EplbLpSolver",
    "LpDispatch",
    "LpServing",
    "begin_pass",
    "capture_prepare_hook",
    "enable_auto",
    "forward_hook",
    "gather_for",
    "init_lplb_solvers",
    "pass_of",
    "placement_of",
    "register_auto",
    "register_lp",
    "reset",
    "serve",
    "serving",
    "set_window",
    "sglang_solver_unavailable",
    "top_k_of",
    "topk_ids_logical_to_physical_hook",
]
