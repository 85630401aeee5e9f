"""``eplb solve``: plan a placement from a recorded trace and write it for eplb and each engine.

Writes ``DIR/placement.safetensors`` (int32 phy2log / log2phy / logcnt, plus float32 dispatch
weights with ``--ep-dispatch-algorithm weighted``), ``DIR/init_expert_location.json`` (SGLang's
``--init-expert-location``) and TensorRT-LLM's offline load balancer
(``DIR/trtllm_load_balancer.yaml`` and the ``--extra_llm_api_options`` file naming it), then prints
the launch flags per engine (docs/integrations.md). For SGLang there are two: rebalance online with
eplb's solver through eplb's plugin, or EPLB off with the placement fixed; never ``--enable-eplb``
with SGLang's own planner, which would replace the placement with its own at the first rebalance.

DIR is written all or nothing (eplb.fileio.OutputSet with a folder): the files (and ``--json``
when it names a file in DIR) go into a temporary folder beside DIR, which then takes DIR's place
in one rename, so DIR holds the whole old set or the whole new set whenever the command is
stopped. DIR must hold nothing else (it is refused before any work). Ctrl-C and SIGTERM remove
the temporary folder; one that a ``kill -9`` left is removed at the start of the next run. A
``--json`` elsewhere is written, on its own, just after DIR.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eplb.commands import flags
from eplb.commands.common import (
    json_to_stdout,
    run_until_signalled,
    write_json,
)
from eplb.commands.sizes import check_slots, check_workload
from eplb.flags import int_in
from eplb.traces.checks import MAX_LAYERS

PLACEMENT_FILE = "placement.safetensors"
SGLANG_FILE = "init_expert_location.json"
PRINTED_KEYS = (
    "placement",
    "sglang_init_expert_location",
    "trtllm_load_balancer",
    "sglang_flags",
    "sglang_flags_static",
    "vllm_flags",
    "trtllm_flags",
)
"""Result keys printed as they are (paths and command lines)."""

HELP = "solve a placement from a trace; write it for eplb, SGLang and TensorRT-LLM, and print each engine's flags"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    flags.add(parser, "solve", "--eplb-algorithm")
    parser.add_argument(
        "--trtllm-layer-offset",
        type=int_in(0, MAX_LAYERS),
        default=0,
        metavar="N",
        help="model layer index of the first MoE layer, for TensorRT-LLM's per-layer keys "
        "(DeepSeek-V3/R1: 3; default: %(default)s)",
    )
    flags.add_groups(parser, "solve", flags.INPUT, flags.TOPOLOGY, (flags.SCHEDULE[0], flags.RECORDING))
    flags.add(parser, "solve", "--seed", "--disable-tqdm", "--json")


def run(args: argparse.Namespace) -> int:
    return run_until_signalled("solve", lambda: _solve(args))


def _solve(args: argparse.Namespace) -> int:
    import numpy as np

    from eplb.fileio import OutputSet
    from eplb.integrations import trtllm
    from eplb.placement.model import Placement
    from eplb.simulate.options import initial_placement, load_input, simulation_config
    from eplb.simulate.planners import PastView

    out_dir: Path = args.out
    # One folder set, checked before any work; what a killed run left is swept now.
    staged = OutputSet(parents=True, folder=out_dir)
    files = (PLACEMENT_FILE, SGLANG_FILE, trtllm.LOAD_BALANCER_FILE, trtllm.OPTIONS_FILE)
    report = None if json_to_stdout(args.json_out) else args.json_out
    staged.prepare([*(out_dir / name for name in files), report])
    check_slots(args)
    check_workload(args)
    trace = load_input(args, quiet=args.disable_tqdm)
    # The window is the whole trace unless --expert-distribution-recorder-buffer-size says less.
    recorded_F = trace.is_prefill_F if args.eplb_record_prefill_only else np.ones(trace.num_steps, dtype=bool)
    num_recorded = int(recorded_F.sum())
    window = args.expert_distribution_recorder_buffer_size or num_recorded
    config = simulation_config(args, trace, eplb_rebalance_num_iterations=max(window, 1))
    current = initial_placement(args, trace, config)
    past = PastView(trace, recorded_F)
    past.now = trace.num_steps
    window_WLE = past.window(window)
    if window_WLE.shape[0] == 0:
        raise ValueError("the trace has no recorded steps to plan from")

    # The solver stack (SciPy) is imported once the inputs are known good, so a bad one fails fast.
    from eplb.integrations import sglang as sglang_plugin
    from eplb.integrations import vllm as vllm_plugin
    from eplb.placement.diff import diff_placements
    from eplb.placement.io import save_placement
    from eplb.policy import dispatch_mode
    from eplb.policy.decision import Decider, Request
    from eplb.simulate.planners import RunSpec, make_planner
    from eplb.solver.scoring.served import served_balancedness

    flags = config.eplb
    start = current or Placement.trivial(
        trace.num_layers, trace.num_experts, flags.ep_size, flags.ep_num_redundant_experts, flags.nnodes
    )
    mode = dispatch_mode(flags.dispatch_algorithm)
    load_LE = window_WLE.sum(axis=0, dtype=np.int64)
    before = served_balancedness(load_LE, start, dispatch=mode.name)
    # The first rebalance of a server with these flags, its interval the window (as the simulator
    # and the manager plan it): started from a given placement, that one counts as fitted.
    planner = make_planner(RunSpec(flags.eplb_algorithm, mode.name), config)
    assert planner is not None
    decider = Decider(flags, fitted=flags.init_expert_location != "trivial", cost=config.cost)
    request = Request(
        window_WLE=window_WLE,
        current=start,
        planner=planner,
        history=past,
        bytes_per_expert=config.bytes_per_expert,
    )
    outcome = decider.rebalance(request, counted_pass=num_recorded, window_balancedness=before)
    placement = outcome.placement or start
    trace_meta = {k: v for k, v in trace.meta.items() if k != "generator"}
    meta = {"algorithm": flags.eplb_algorithm, "window_steps": int(window_WLE.shape[0]), "trace": trace_meta}
    # Bytes only where the trace or --bytes-per-expert says them; a dump does not.
    bytes_known = args.bytes_per_expert is not None or "bytes_per_expert" in trace.meta
    moves = diff_placements(start, placement, config.bytes_per_expert if bytes_known else 0)
    notes = [n for n in (trace.prefill_note(),) if n and args.eplb_record_prefill_only]
    with staged:
        own = save_placement(out_dir / PLACEMENT_FILE, placement, outcome.weights_LER, meta, outputs=staged)
        sglang = placement.write_sglang_json(out_dir / SGLANG_FILE, outputs=staged)
        trtllm_balancer, trtllm_options = trtllm.write_load_balancer(
            placement, out_dir, args.trtllm_layer_offset, outputs=staged
        )
        sglang_flags = sglang_plugin.launch_flags(placement, str(sglang), flags.eplb_algorithm)
        result: dict[str, Any] = {
            "algorithm": flags.eplb_algorithm,
            "window_steps": int(window_WLE.shape[0]),
            "layers": placement.num_layers,
            "experts": placement.num_logical,
            "physical_slots": placement.num_physical,
            "ep_size": placement.num_gpus,
            "nnodes": placement.num_nodes,
            # As the server will split each expert's tokens (static maps, weights or evenly).
            "balancedness_on_window": served_balancedness(
                load_LE, placement, outcome.weights_LER, dispatch=mode.name
            ),
            "balancedness_on_window_before": before,
            "solver_predicted_balancedness": outcome.predicted,
            "solver_says_apply": outcome.applied,
            "solver_reason": outcome.reason,
            "moves": moves.summary(),
            "notes": notes,
            "placement": str(own),
            "sglang_init_expert_location": str(sglang),
            "trtllm_load_balancer": str(trtllm_balancer),
            "sglang_flags": sglang_flags["plugin"],
            "sglang_flags_static": sglang_flags["static"],
            "vllm_flags": vllm_plugin.launch_flags(placement.num_redundant),
            "trtllm_flags": trtllm.launch_flags(placement, trtllm_options),
        }
        if not json_to_stdout(args.json_out):
            print_summary(result, initial="initial" if current is not None else "trivial")
        write_json(result, args.json_out, outputs=staged)
    return 0


def print_summary(result: dict[str, Any], *, initial: str) -> None:
    """What a reader needs, labelled and rounded (the JSON keeps every digit)."""
    from eplb.simulate.results import format_bytes

    moves = result["moves"]
    copies = moves["experts_moved_across_gpus"]
    moved = moves["bytes_across_gpus"]
    predicted = result["solver_predicted_balancedness"]
    rows = {
        "window": f"{result['window_steps']} recorded steps of {result['layers']} layers x "
        f"{result['experts']} experts",
        "placement": f"EP{result['ep_size']} on {result['nnodes']} node(s), {result['physical_slots']} "
        f"slots ({result['physical_slots'] - result['experts']} redundant), algorithm {result['algorithm']}",
        "balancedness on the window": f"{result['balancedness_on_window_before']:.3f} ({initial}) -> "
        f"{result['balancedness_on_window']:.3f} (solved); mean / max GPU load, 1 is perfect",
        "predicted next window": "-" if predicted is None else f"{predicted:.3f} (the solver's estimate)",
        "solver decision": ("apply" if result["solver_says_apply"] else "keep the initial placement")
        + (f" ({result['solver_reason']})" if result["solver_reason"] else ""),
        "moves from the start": f"{copies} expert copies across GPUs, "
        + (format_bytes(moved) if isinstance(moved, int) else f"{moved} (give --bytes-per-expert)"),
    }
    for note in result["notes"]:
        rows.setdefault("note", note)
    width = max(len(k) for k in (*rows, *PRINTED_KEYS))
    for key, value in rows.items():
        print(f"{key:>{width}}: {value}")
    for key in PRINTED_KEYS:
        print(f"{key:>{width}}: {result[key]}")
