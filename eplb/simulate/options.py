"""From parsed flags to what a replay or a solve runs on: the input, its topology, the config.

``eplb simulate``, ``eplb sweep`` and ``eplb solve`` take the server's flags by SGLang's names and
eplb's offline ones (declared once in eplb.commands.flags); the server's become the
``eplb.config.EplbConfig`` the simulation holds (``SimulationConfig.eplb``): their combinations are
checked by it, so an invalid one fails with the same message a server would give, and every value
derived from them (interval, window, budget, initial full plan, dispatch) is its, the server's
defaults included. The EP topology not given is an input's: the preset's serving topology, or
:data:`TRACE_TOPOLOGY` for a recorded trace (:func:`default_topology`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any

from eplb.config import EplbConfig
from eplb.placement.model import Placement
from eplb.policy.cost_model import CostModel
from eplb.simulate.config import SimulationConfig
from eplb.simulate.planners import parse_solver_options
from eplb.traces import Trace


def load_input(args: argparse.Namespace, quiet: bool = False) -> Trace:
    """The trace named by ``--trace``, or the built-in workload ``--preset`` / ``--steps`` / ``--seed``."""
    if args.trace:
        from eplb.traces import load_trace

        return load_trace(args.trace, args.trace_format)
    from eplb.workloads import WorkloadConfig, generate

    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2, got {args.steps}")
    cfg = WorkloadConfig(preset=args.preset, num_steps=args.steps, seed=args.seed)
    if args.prefill_fraction is not None:
        cfg = cfg.with_(prefill_fraction=args.prefill_fraction)
    if not quiet:
        print(f"generating the {args.preset} workload: {args.steps} steps, seed {args.seed}", file=sys.stderr)
    return generate(cfg)


TRACE_TOPOLOGY = {"ep_size": 32, "nnodes": 4, "ep_num_redundant_experts": 32}
"""EP32 over 4 nodes with 32 redundant experts: the topology a recorded trace is replayed on by default."""


def default_topology(args: argparse.Namespace) -> dict[str, int]:
    """The EP topology flags not given take: the preset's serving topology (eplb.workloads.PRESETS;
    a preset's experts must spread over its ranks), or :data:`TRACE_TOPOLOGY` for a trace."""
    if getattr(args, "trace", None) or not hasattr(args, "preset"):
        return dict(TRACE_TOPOLOGY)
    from eplb.workloads import PRESETS

    preset = PRESETS[args.preset]
    return {"ep_size": preset.ep_size, "nnodes": preset.nnodes, "ep_num_redundant_experts": preset.redundant}


def simulation_config(args: argparse.Namespace, trace: Trace, **overrides: Any) -> SimulationConfig:
    """The server's flags as an ``EplbConfig`` (checked against ``trace`` as a server would check
    them), with the offline flags, as the simulation config; ``overrides`` replace flags by
    ``EplbConfig`` field name."""
    unknown = set(overrides) - {f.name for f in fields(EplbConfig)}
    if unknown:
        raise TypeError(f"unknown overrides {sorted(unknown)}")
    values = {**vars(args), **overrides, "enable_eplb": True, "num_experts": trace.num_experts}
    for name, value in default_topology(args).items():
        if values.get(name) is None:
            values[name] = value
    server = EplbConfig.from_namespace(argparse.Namespace(**values)).for_layers(trace.num_layers)
    if server.eplb_record_prefill_only and not trace.is_prefill_F.any():
        raise ValueError("--eplb-record-prefill-only: the trace has no prefill steps")
    given = {"bytes_per_expert": args.bytes_per_expert, "num_groups": args.num_groups}
    return SimulationConfig.for_trace(
        trace,
        eplb=server,
        **{name: value for name, value in given.items() if value is not None},
        seed=args.seed,
        cost=cost_model(args),
        solver_options=parse_solver_options(args.solver_option),
        score_from=getattr(args, "score_from", None),
    )


def cost_model(args: argparse.Namespace) -> CostModel:
    """The cost model of the ``--cost-*`` / ``--*-gbps`` flags (defaults where a command has none)."""
    if not hasattr(args, "cost_base_us"):
        return CostModel()
    return CostModel(
        base_us=args.cost_base_us,
        per_expert_us=args.cost_per_expert_us,
        per_token_us=args.cost_per_token_us,
        nvlink_gbps=args.nvlink_gbps,
        internode_gbps=args.internode_gbps,
        transfer_kind=args.cost_transfer_kind,
        interference=args.cost_interference,
    )


def initial_placement(args: argparse.Namespace, trace: Trace, config: SimulationConfig) -> Placement | None:
    """``--init-expert-location``: None for trivial, else the placement the file holds."""
    source = args.init_expert_location
    if source == "trivial":
        return None
    flags = config.eplb
    if str(source).endswith(".safetensors"):
        from eplb.placement.io import load_placement

        placement, _ = load_placement(source)
    else:
        placement = Placement.from_sglang(source, flags.ep_size, flags.nnodes)
    if (placement.num_layers, placement.num_logical, placement.num_gpus, placement.num_nodes) != (
        trace.num_layers,
        trace.num_experts,
        flags.ep_size,
        flags.nnodes,
    ) or placement.num_redundant != flags.ep_num_redundant_experts:
        raise ValueError(
            f"--init-expert-location: the placement is [L={placement.num_layers}, E={placement.num_logical}, "
            f"P={placement.num_physical}] on {placement.num_gpus} GPUs / {placement.num_nodes} nodes, but the trace "
            f"and flags need [L={trace.num_layers}, E={trace.num_experts}, "
            f"P={trace.num_experts + flags.ep_num_redundant_experts}] on {flags.ep_size} / {flags.nnodes}"
        )
    return placement
