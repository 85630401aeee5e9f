"""``eplb demo``: a small MoE model serving a skewed synthetic workload with EPLB on, on CPU or GPUs.

Each rank runs its own batch per pass (prefill and decode passes as the workload draws them) through
L expert-parallel MoE layers; the router is biased by the workload's per-step expert popularity
(eplb.workloads), so load is skewed and drifts. The manager (eplb.manager.manager) records, solves in the
background and hot-swaps; rank 0 prints the balancedness before and after each rebalance. The demo runs
eplb's own manager, so ``--eplb-rebalance-mode`` defaults to continuous (``periodic`` is SGLang's
schedule, at a demo-sized interval unless one is given); eplb.commands.flags states each of the
demo's own defaults and why.

``run_demo(config, sink=...)`` is the entry point for callers with their own metrics sink.

With one rank (``--nproc 1``) there is nothing to balance: every rebalance is skipped, saying so
(eplb.policy.decision.ONE_GPU), and the run goes to its end. Ctrl-C or SIGTERM ends the demo and
every rank process within a second or two: one line, exit status 130 or 143
(eplb.commands.common.run_until_signalled, eplb.moe.spawn). A rank process that dies (killed,
out of memory) ends the demo with one line naming the rank and the signal or exit code, and exit
status :data:`RANK_DIED_EXIT`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from eplb.commands import flags
from eplb.commands.common import (
    Parser,
    check_outputs,
    emit,
    json_to_stdout,
    run_until_signalled,
)
from eplb.commands.flags import DEMO_PERIODIC_INTERVAL
from eplb.commands.sizes import MAX_DEMO_RANKS, check_demo
from eplb.config import SERVER_GROUP, EplbConfig, add_cli_args, config_from_args
from eplb.flags import float_in, int_in
from eplb.metrics.sink import MetricsSink
from eplb.policy.dispatch import dispatch_mode

if TYPE_CHECKING:
    from eplb.placement.model import Placement

RANK_DIED_EXIT = 1
"""Exit status when a rank process died: not an error in the flags (2), not a signal to eplb."""

HELP = "run a small MoE model with EPLB on (CPU ranks over Gloo or GPUs over NCCL), printing balancedness"


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything one demo run needs (it pickles: spawned ranks receive it)."""

    nproc: int = 4
    """EP ranks (local processes)."""
    device: str = "cpu"
    """cpu (Gloo) or cuda (NCCL, one GPU per rank)."""
    steps: int = flags.DEMO_STEPS
    """Forward passes per rank (the run also stops at ``duration_s`` when given)."""
    duration_s: float | None = None
    """Stop after this many seconds (rank 0 decides; every rank stops on the same pass)."""
    preset: str = flags.DEMO_PRESET
    """Workload preset: the model has its layers, experts and top-k."""
    hidden: int = 64
    """Model width H."""
    intermediate: int = 32
    """Expert FFN width I."""
    token_divisor: int = 32
    """Tokens per pass = the workload's tokens // this (prefill 2048-16384 become 64-512)."""
    seed: int = 0
    """Seed of the workload, the weights and the tokens."""
    eplb: EplbConfig
    """EPLB flags (SGLang names); ep_size equals nproc."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig(eplb=EplbConfig())
    parser.add_argument(
        "--nproc", type=int_in(1, MAX_DEMO_RANKS), default=d.nproc, help="EP ranks (default: %(default)s)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=d.device, help="cpu (Gloo) or cuda (NCCL)"
    )
    flags.add(parser, "demo", "--steps")
    parser.add_argument(
        "--duration-s", type=float_in(0, above=True), default=None, help="stop after this many seconds"
    )
    flags.add(parser, "demo", "--preset")
    parser.add_argument(
        "--hidden", type=int_in(1), default=d.hidden, help="model width (default: %(default)s)"
    )
    parser.add_argument(
        "--intermediate", type=int_in(1), default=d.intermediate, help="expert width (default: %(default)s)"
    )
    parser.add_argument(
        "--token-divisor", type=int_in(1), default=d.token_divisor, help="scale workload tokens down"
    )
    # The server's flags, with the demo's own defaults where the table gives it one (the namespace
    # is adjusted, then checked: config_from_namespace).
    flags.add(parser, "demo", *flags.SERVER_NAMES, title=SERVER_GROUP)
    flags.add(parser, "demo", "--seed", "--json")
    parser.add_argument(
        "--metrics-port",
        type=int_in(0, 65535),
        default=None,
        help="export Prometheus metrics on this port (0: any free one)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint binds (default: %(default)s)",
    )


def config_from_namespace(args: argparse.Namespace) -> DemoConfig:
    """The demo's config; --ep-size follows --nproc, redundant slots default to one per rank and the
    periodic interval to ``DEMO_PERIODIC_INTERVAL``."""
    if args.nproc < 1 or args.steps < 0 or args.token_divisor < 1:
        raise ValueError("--nproc and --token-divisor must be >= 1 and --steps >= 0")
    check_demo(args)
    if args.ep_dispatch_algorithm is not None and dispatch_mode(args.ep_dispatch_algorithm).per_pass:
        raise ValueError(
            f"--ep-dispatch-algorithm {args.ep_dispatch_algorithm}: the demo's model runs one dispatch "
            "mode on every pass (static, lp, ...); per-pass choice is served through SGLang's lp path "
            "and modeled by eplb simulate"
        )
    if args.ep_size is not None and args.ep_size != args.nproc:
        raise ValueError(
            f"--ep-size {args.ep_size}: the demo's EP ranks are the processes --nproc starts "
            f"({args.nproc}); give --nproc {args.ep_size} instead"
        )
    args = argparse.Namespace(**vars(args))
    args.ep_size = args.nproc
    if args.ep_num_redundant_experts is None:
        args.ep_num_redundant_experts = args.nproc
    # EplbConfig refuses --enable-eplb on one rank (nothing to balance). The manager rebalances
    # whatever the flag says, and on one rank each rebalance is skipped, saying why
    # (eplb.policy.decision.ONE_GPU, from eplb.solver.solve).
    args.enable_eplb = args.enable_eplb and args.nproc > 1
    if args.eplb_rebalance_num_iterations is None and args.eplb_rebalance_mode == "periodic":
        args.eplb_rebalance_num_iterations = DEMO_PERIODIC_INTERVAL
    parser = add_cli_args(Parser(prog="eplb demo"))
    eplb = config_from_args(parser, args)
    return DemoConfig(
        nproc=args.nproc,
        device=args.device,
        steps=args.steps,
        duration_s=args.duration_s,
        preset=args.preset,
        hidden=args.hidden,
        intermediate=args.intermediate,
        token_divisor=args.token_divisor,
        seed=args.seed,
        eplb=eplb,
    )


def run(args: argparse.Namespace) -> int:
    # A hard exit after a signal: rank 0's thread may still be inside a collective of the group
    # whose other ranks were just killed, and interpreter shutdown with it there can abort in C++.
    return run_until_signalled("demo", lambda: _demo(args), hard_exit=True)


def _demo(args: argparse.Namespace) -> int:
    from eplb.metrics.exporter import sink_for_rank

    config = config_from_namespace(args)
    check_outputs(args.json_out)  # an unwritable output fails now, not after the run
    # Rank 0 runs in this process and reports the window it aggregated over all ranks.
    sink, exporter = sink_for_rank(0, port=args.metrics_port, host=args.metrics_host)
    # Progress goes to stderr when the JSON goes to stdout, so stdout stays one JSON document.
    stream = sys.stderr if json_to_stdout(args.json_out) else sys.stdout
    if exporter is not None:
        print(f"eplb demo: metrics on {exporter.url}", file=stream, flush=True)
    from eplb.moe.spawn import RankDied

    try:
        result = run_demo(config, sink=sink, out=lambda line: print(line, file=stream, flush=True))
    except RankDied as exc:
        print(f"eplb demo: {exc}", file=sys.stderr, flush=True)
        return RANK_DIED_EXIT
    finally:
        if exporter is not None:
            exporter.stop()
    keys = [
        "ranks",
        "device",
        "passes",
        "seconds",
        "rebalances_applied",
        "balancedness_first",
        "balancedness_last",
    ]
    emit(result, keys, args.json_out)
    return 0


def run_demo(
    config: DemoConfig,
    *,
    sink: MetricsSink | None = None,
    out: Callable[[str], None] | None = None,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run the demo; rank 0 runs in this process and reports to ``sink``. Returns rank 0's summary."""
    from eplb.moe.spawn import run_ranks
    from eplb.workloads import PRESETS

    preset = PRESETS[config.preset]
    slots = preset.num_experts + config.eplb.ep_num_redundant_experts
    if slots % config.nproc:
        raise ValueError(
            f"{preset.num_experts} experts + {config.eplb.ep_num_redundant_experts} redundant = "
            f"{slots} slots do not divide over --nproc {config.nproc}"
        )
    if config.eplb.num_layers not in (None, preset.num_layers):
        raise ValueError(
            f"--num-layers {config.eplb.num_layers}: the {config.preset} model has {preset.num_layers}"
        )
    if config.device == "cuda":
        import torch

        if torch.cuda.device_count() < config.nproc:
            raise ValueError(
                f"--nproc {config.nproc} needs as many GPUs; {torch.cuda.device_count()} visible"
            )
    initial = initial_placement(config)  # a bad file fails here, before any rank starts
    printer = out or (lambda line: print(line, file=sys.stdout, flush=True))
    start = time.perf_counter()
    results = run_ranks(
        demo_rank,
        config.nproc,
        args=(replace(config), initial),
        backend="nccl" if config.device == "cuda" else "gloo",
        timeout_s=timeout_s,
        rank0_in_process=True,
        rank0_kwargs={"sink": sink, "out": printer},
    )
    summary: dict[str, Any] = dict(results[0])
    summary["seconds"] = round(time.perf_counter() - start, 2)
    summary["config"] = {k: v for k, v in asdict(config).items() if k != "eplb"}
    return summary


def initial_placement(config: DemoConfig) -> Placement | None:
    """``--init-expert-location``: None for trivial, else the placement its file or JSON holds,
    which must fit the demo's model (the preset's layers and experts) on its ranks and slots."""
    from eplb.placement.model import Placement
    from eplb.workloads import PRESETS

    source, flags = config.eplb.init_expert_location, config.eplb
    if source == "trivial":
        return None
    if source.endswith(".safetensors"):
        from eplb.placement.io import load_placement

        placement, _ = load_placement(source)
    else:
        placement = Placement.from_sglang(source, flags.ep_size, flags.nnodes)
    preset = PRESETS[config.preset]
    want = (preset.num_layers, preset.num_experts, preset.num_experts + flags.ep_num_redundant_experts)
    want_on = (flags.ep_size, flags.nnodes)
    have = (placement.num_layers, placement.num_logical, placement.num_physical)
    if have != want or (placement.num_gpus, placement.num_nodes) != want_on:
        raise ValueError(
            f"--init-expert-location: the placement is [L={have[0]}, E={have[1]}, P={have[2]}] on "
            f"{placement.num_gpus} GPUs / {placement.num_nodes} nodes, but the {config.preset} model on "
            f"--nproc {config.nproc} needs [L={want[0]}, E={want[1]}, P={want[2]}] on {want_on[0]} / {want_on[1]}"
        )
    return placement


def demo_rank(
    ctx: Any,
    config: DemoConfig,
    initial: Placement | None = None,
    *,
    sink: MetricsSink | None = None,
    out: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One rank's serving loop (``ctx``: eplb.moe.spawn.RankContext), from ``initial`` (None:
    the trivial placement). Returns a summary."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from eplb.manager.manager import EplbManager
    from eplb.moe.model import MoEModel, MoEModelConfig
    from eplb.placement.model import Placement
    from eplb.workloads import WorkloadConfig, generate

    G, rank = ctx.world_size, ctx.rank
    # One workload step per (pass, rank): its popularity biases the router of pass t on every rank
    # (taken from the step of rank 0), its kind and tokens are this rank's batch.
    trace = generate(
        WorkloadConfig(preset=config.preset, num_steps=max(config.steps, 1) * G, seed=config.seed)
    )
    preset = trace.meta["model"]
    model_cfg = MoEModelConfig(
        num_layers=trace.num_layers,
        num_experts=trace.num_experts,
        top_k=int(trace.meta["top_k"]),
        hidden=config.hidden,
        intermediate=config.intermediate,
        seed=config.seed,
        dtype="bfloat16" if ctx.device.type == "cuda" else "float32",
    )
    placement = initial or Placement.trivial(
        model_cfg.num_layers, model_cfg.num_experts, G, num_redundant=config.eplb.ep_num_redundant_experts
    )
    model = MoEModel(model_cfg, placement, rank=rank, device=ctx.device, mode=config.eplb.dispatch_algorithm)
    manager = EplbManager(
        config.eplb,
        model,
        placement,
        device=ctx.device,
        sink=sink,
        num_groups=int(trace.meta["num_groups"]),
    )
    model.recorder = manager.recorder
    say = out if (rank == 0 and out is not None) else (lambda line: None)
    say(
        f"eplb demo: {G} rank{'s' if G > 1 else ''} on {ctx.device.type}, model {preset} (L={model_cfg.num_layers}, "
        f"E={model_cfg.num_experts}, top-{model_cfg.top_k}, P={placement.num_physical}), "
        f"{_schedule(manager.config)}"
    )
    gen = torch.Generator().manual_seed(config.seed * 1000 + rank)
    start = time.perf_counter()
    seen = seen_windows = 0
    passes = 0
    for step in range(config.steps):
        if config.duration_s is not None and _agreed_stop(start, config.duration_s, ctx.device, G):
            break
        shared = step * G
        counts_LE = trace.counts_FLE[shared].astype(np.float64)
        bias_LE = torch.from_numpy(np.log((counts_LE + 0.5) / (counts_LE.sum(axis=1, keepdims=True) + 0.5)))
        mine = shared + rank
        tokens = max(1, int(trace.num_tokens_F[mine]) // config.token_divisor)
        x = torch.randn(tokens, model_cfg.hidden, generator=gen).to(ctx.device, model_cfg.torch_dtype)
        manager.on_forward_pass_begin(is_prefill=bool(trace.is_prefill_F[mine]), num_tokens=tokens)
        model(x, bias_LE.to(ctx.device))
        manager.on_forward_pass_end()
        passes += 1
        state = manager.state()
        for at, value in state.windows[seen_windows:]:
            say(f"pass {at:>6}: window balancedness {value:.3f} over the last {state.window_passes} passes")
        for record in state.history[seen:]:
            say(_describe(record, config.eplb.rebalance_interval))
        seen, seen_windows = len(state.history), len(state.windows)
    state = manager.state()
    manager.close()
    if G > 1:
        dist.barrier()
    windows = [value for _, value in state.windows]
    return {
        "ranks": G,
        "device": ctx.device.type,
        "passes": passes,
        "rebalances_applied": sum(r.outcome == "applied" for r in state.history),
        "rebalances": [asdict(r) for r in state.history],
        "balancedness_first": round(windows[0], 4) if windows else None,
        "balancedness_last": round(windows[-1], 4) if windows else None,
        "phy2log": state.placement.phy2log_LP.tolist(),
    }


def _agreed_stop(start: float, duration_s: float, device: Any, world_size: int) -> bool:
    """Rank 0's clock decides; every rank stops on the same pass."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(time.perf_counter() - start >= duration_s)], dtype=torch.int32, device=device)
    if world_size > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def _schedule(config: EplbConfig) -> str:
    line = f"{config.eplb_rebalance_mode} rebalancing every {config.rebalance_interval} passes"
    if config.max_moved_experts is not None:
        line += f", at most {config.max_moved_experts} experts moved each"
    if config.eplb_transfer_gbps is not None:
        line += f", swaps paced at {config.eplb_transfer_gbps:g} GB/s per GPU"
    return line


def _describe(record: Any, interval: int) -> str:
    line = (
        f"pass {record.at_pass:>6}: rebalance {record.outcome}: window balancedness "
        f"{record.balancedness_before:.3f}"
    )
    if record.outcome == "applied":
        line += (
            f" -> {record.balancedness_after:.3f} (the window it was planned from; predicted over the next "
            f"{interval} passes {record.predicted_balancedness:.3f}), {record.experts_moved} experts moved across ranks "
            f"({record.bytes_moved / 1e6:.2f} MB) in {record.transfer_seconds * 1e3:.1f} ms, "
            f"solve {record.solve_seconds * 1e3:.1f} ms"
        )
    else:
        line += f" ({record.reason})"
    return line
