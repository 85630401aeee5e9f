"""eplb: expert-parallel load balancing for serving Mixture-of-Experts LLMs.

The public API, loaded lazily: ``import eplb`` imports nothing heavy (no torch, no Triton, no
SciPy); ``eplb.solve`` or ``from eplb import Placement`` imports only the package that defines it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from eplb._version import __version__

# public name -> module that defines it (one place; __all__ is its keys)
_EXPORTS: dict[str, str] = {
    # placement model
    "Placement": "eplb.placement",
    "PlacementDiff": "eplb.placement",
    "diff_placements": "eplb.placement",
    "balancedness": "eplb.placement",
    "model_balancedness": "eplb.placement",
    "gpu_load": "eplb.placement",
    "static_dispatch_maps": "eplb.placement",
    "save_placement": "eplb.placement",
    "load_placement": "eplb.placement",
    # configuration
    "EplbConfig": "eplb.config",
    "add_cli_args": "eplb.config",
    # policies (placement algorithms) and dispatch modes
    "Policy": "eplb.solver",
    "get_policy": "eplb.policy",
    "policy_names": "eplb.policy",
    # traces and synthetic workloads
    "Trace": "eplb.traces",
    "load_trace": "eplb.traces",
    "WorkloadConfig": "eplb.workloads",
    "generate_workload": "eplb.workloads",
    # solver
    "solve": "eplb.solver",
    "rebalance_experts": "eplb.solver",
    "Topology": "eplb.solver",
    "SolveOptions": "eplb.solver",
    "Plan": "eplb.solver",
    # serving path
    "remap_and_record": "eplb.remap",
    "DispatchTables": "eplb.remap",
    "ExpertDistributionRecorder": "eplb.recorder",
    "RecorderConfig": "eplb.recorder",
    "hot_swap": "eplb.hotswap",
    "prepare_swap": "eplb.hotswap",
    "HotSwapOptions": "eplb.hotswap",
    "HotSwapError": "eplb.hotswap",
    "EplbManager": "eplb.manager",
    # observability
    "MetricsSink": "eplb.metrics",
    "PrometheusSink": "eplb.metrics",
    "MetricsExporter": "eplb.metrics",
    "sink_for_rank": "eplb.metrics",
    # offline simulation
    "simulate": "eplb.simulate",
    "SimulationConfig": "eplb.simulate",
    "RunSpec": "eplb.simulate",
}

__all__ = ["__version__", *sorted(_EXPORTS)]

# names the lazy loader may rename on the way out (module attribute -> public name)
_RENAMED = {"generate_workload": "generate"}


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'eplb' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), _RENAMED.get(name, name))
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers see the real names
    from eplb.config import EplbConfig, add_cli_args
    from eplb.hotswap import HotSwapError, HotSwapOptions, hot_swap, prepare_swap
    from eplb.manager import EplbManager
    from eplb.metrics import MetricsExporter, MetricsSink, PrometheusSink, sink_for_rank
    from eplb.placement import (
        Placement,
        PlacementDiff,
        balancedness,
        diff_placements,
        gpu_load,
        load_placement,
        model_balancedness,
        save_placement,
        static_dispatch_maps,
    )
    from eplb.policy import get_policy, policy_names
    from eplb.recorder import ExpertDistributionRecorder, RecorderConfig
    from eplb.remap import DispatchTables, remap_and_record
    from eplb.simulate import RunSpec, SimulationConfig, simulate
    from eplb.solver import Plan, Policy, SolveOptions, Topology, rebalance_experts, solve
    from eplb.traces import Trace, load_trace
    from eplb.workloads import WorkloadConfig
    from eplb.workloads import generate as generate_workload
