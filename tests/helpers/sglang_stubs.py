"""Stand-ins that make SGLang 0.5.23's recorder and dispatch modules importable without a server.

Run inside the engines' subprocess (tests.helpers.engines). Three modules SGLang's
``sglang.srt.eplb.expert_distribution`` imports at its top cannot load here: ``einops`` (not among
the engines' pinned packages), ``sglang.srt.model_executor.forward_batch_info`` and
``sglang.srt.observability.metrics_collector`` (both pull SGLang's model configs, which import
torchvision). They are replaced by the few names the recorder reads from them; every class and
function the tests exercise (the recorder, its gatherers and accumulators, the placement metadata,
the dispatch info, the map, the LP solver's registry and matrices, the hook registry) is SGLang's
own code, its config getters pointed at stand-in settings; only ``moe_ep_setup`` (which imports
SGLang's MoE layers) is a stand-in module with the one function eplb replaces.
"""

from __future__ import annotations

import enum
import sys
import types
from typing import Any


class ForwardMode(enum.IntEnum):
    """The members ``should_record_forward_pass`` compares against."""

    EXTEND = 1
    DECODE = 2
    SPLIT_PREFILL = 3


def install() -> None:
    """Put the three stand-in modules in ``sys.modules`` (before any ``sglang.srt.eplb`` import)."""
    sys.modules.setdefault("einops", types.ModuleType("einops"))
    batch = types.ModuleType("sglang.srt.model_executor.forward_batch_info")
    batch.__dict__.update(ForwardBatch=types.SimpleNamespace, ForwardMode=ForwardMode)
    sys.modules.setdefault(batch.__name__, batch)
    metrics = types.ModuleType("sglang.srt.observability.metrics_collector")
    metrics.__dict__.update(
        STAT_LOGGER_ROLE_EXPERT_DISPATCH="expert_dispatch",
        ExpertDispatchCollector=object,
        resolve_collector_class=lambda *_: None,
    )
    sys.modules.setdefault(metrics.__name__, metrics)


def moe_settings(**overrides: Any) -> types.SimpleNamespace:
    """SGLang's ``get_exec().moe`` fields these tests' code paths read."""
    fields: dict[str, Any] = dict(
        expert_distribution_recorder_mode="stat",
        expert_distribution_recorder_buffer_size=16,
        moe_a2a_backend="deepep",
        deepep_mode="normal",
        ep_dispatch_algorithm="static",
        eplb_min_rebalancing_utilization_threshold=1.0,
    )
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def configure_recorder(moe: types.SimpleNamespace) -> Any:
    """SGLang's recorder module with its config getters pointed at ``moe`` on the CPU, off ROCm."""
    install()
    import sglang.srt.eplb.expert_distribution as ed

    ed.get_exec = lambda: types.SimpleNamespace(moe=moe)
    ed.get_device = lambda: "cpu"
    ed.get_device_namespace = lambda: types.SimpleNamespace(device="cpu")
    # Off ROCm this is False; SGLang's body imports sglang.srt.layers.moe (model configs) first.
    ed.megamoe_prefill_only_recorder_enabled = lambda: False
    ed.reports_expert_balancedness = lambda: False
    return ed


def configure_dispatch(moe: types.SimpleNamespace) -> Any:
    """SGLang's dispatch-info module with ``get_exec`` pointed at ``moe``."""
    install()
    import sglang.srt.eplb.expert_location_dispatch as dispatch

    dispatch.get_exec = lambda: types.SimpleNamespace(moe=moe)
    return dispatch


def configure_location(moe: types.SimpleNamespace, parallel: types.SimpleNamespace, L: int, E: int) -> Any:
    """SGLang's placement module with its config getters pointed at ``moe`` and ``parallel`` on
    the CPU, and a model of ``L`` MoE layers of ``E`` experts (what ``init_by_mapping`` reads)."""
    install()
    import sglang.srt.eplb.expert_location as el
    import sglang.srt.runtime_context as runtime

    el.get_exec = lambda: types.SimpleNamespace(moe=moe)
    el.get_parallel = lambda: parallel
    runtime.get_parallel = lambda: parallel  # read at call time by eplb's init_lplb_solvers
    el.get_device = lambda: types.SimpleNamespace(device="cpu")
    config = el.ModelConfigForExpertLocation(num_layers=L, num_logical_experts=E, num_groups=1)
    el.ModelConfigForExpertLocation.from_model_config = staticmethod(lambda _: config)
    return el


def stub_moe_ep_setup() -> types.ModuleType:
    """SGLang's ``moe_ep_setup`` (its real module imports the MoE layers, hence torchvision): the
    one function eplb replaces, raising if it ever runs (its JIT solver cannot run here)."""
    module = types.ModuleType("sglang.srt.model_executor.model_runner_components.moe_ep_setup")

    def init_lplb_solvers(*, model_config: Any) -> None:
        raise RuntimeError("SGLang's own init_lplb_solvers ran (its LP solver needs SM90 and Math-DX)")

    module.__dict__["init_lplb_solvers"] = init_lplb_solvers
    sys.modules[module.__name__] = module
    return module


__all__ = [
    "ForwardMode",
    "configure_dispatch",
    "configure_location",
    "configure_recorder",
    "install",
    "moe_settings",
    "stub_moe_ep_setup",
]
