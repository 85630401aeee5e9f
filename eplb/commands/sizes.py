"""What a command's flags ask to allocate, checked before anything is allocated from them.

Shape legend: F steps (forward passes), L layers, E logical experts, P physical slots, G GPUs
(EP ranks), H hidden size, I intermediate size.

A flag that sizes an array (``--steps``, ``--ep-num-redundant-experts``, ``--ep-size``, the demo's
``--nproc``, ``--hidden`` and ``--intermediate``) is checked here: counts against the limits a trace
file has (eplb.traces.checks), bytes against what this process can have
(eplb.fileio.check_memory), so an impossible request ends at once in one line naming the flag and
the limit, not in NumPy's MemoryError (or a run that swaps for an hour) later.
"""

from __future__ import annotations

import argparse

from eplb.fileio import check_memory
from eplb.traces.checks import MAX_SLOTS

COUNT_BYTES = 4
"""A count of the trace (int32)."""
STEP_BYTES = 1 + 8 + 8
"""Per step besides its counts: the prefill flag, the token count and the domain index."""
WEIGHT_BYTES = 4
"""A weight of the demo's model on CPU ranks (float32)."""
MAX_DEMO_RANKS = 64
"""``eplb demo --nproc``: rank processes on one machine (each imports torch, a few hundred MB)."""


def workload_bytes(steps: int, num_layers: int, num_experts: int) -> int:
    """Bytes of a generated workload of ``steps`` steps: its counts [F, L, E] and per-step facts."""
    return steps * (num_layers * num_experts * COUNT_BYTES + STEP_BYTES)


def check_workload(args: argparse.Namespace, *, copies: int = 1, steps: int | None = None) -> None:
    """Refuse a built-in workload (no ``--trace``) larger than memory: ``--steps`` of ``--preset``,
    held ``copies`` times (the demo's ranks each generate the whole workload)."""
    from eplb.workloads import PRESETS

    if getattr(args, "trace", None):
        return
    preset = PRESETS[args.preset]
    F = args.steps if steps is None else steps
    nbytes = copies * workload_bytes(F, preset.num_layers, preset.num_experts)
    check_memory(nbytes, f"--steps {args.steps} of the {args.preset} workload ({preset.num_layers} layers x "
                 f"{preset.num_experts} experts{', once per rank' if copies > 1 else ''})")  # fmt: skip


def check_slots(args: argparse.Namespace, *, redundant: list[int] | None = None) -> None:
    """Refuse topology flags past what any placement may have: ``--ep-size`` and the slots per
    layer (the preset's experts, or for a trace at least one, plus each redundant count; ``redundant``
    adds a sweep's candidates) above eplb.traces.checks.MAX_SLOTS, before placements [L, P] are
    allocated from them."""
    from eplb.workloads import PRESETS

    experts = 1 if getattr(args, "trace", None) else PRESETS[args.preset].num_experts
    for flag, value in (("--ep-size", args.ep_size), ("--nnodes", args.nnodes)):
        if value is not None and value > MAX_SLOTS:
            raise ValueError(f"{flag} {value}: at most {MAX_SLOTS} (a placement has at most that many slots)")
    counts = [args.ep_num_redundant_experts, *(redundant or [])]
    for count in (c for c in counts if c is not None):
        if experts + count > MAX_SLOTS:
            raise ValueError(
                f"--ep-num-redundant-experts {count}: {experts} experts + {count} redundant is past the "
                f"{MAX_SLOTS} physical slots per layer a placement may have"
            )


def check_demo(args: argparse.Namespace) -> None:
    """Refuse a demo whose ranks together would hold more than memory: each of ``--nproc`` ranks
    generates the whole workload (``--steps`` per rank, times the ranks) and builds the model's
    logical weights [L, E, 3 I, H] plus its own slots' copy of them."""
    from eplb.workloads import PRESETS

    G = args.nproc
    check_workload(args, copies=G, steps=max(args.steps, 1) * G)
    preset = PRESETS[args.preset]
    L, E = preset.num_layers, preset.num_experts
    redundant = args.ep_num_redundant_experts if args.ep_num_redundant_experts is not None else G
    check_slots(args)
    slots_per_rank = -(-(E + redundant) // G)
    H, inter = args.hidden, args.intermediate
    per_rank = L * (E + slots_per_rank) * (3 * inter * H + H) * WEIGHT_BYTES
    check_memory(
        G * per_rank, f"--hidden {H} --intermediate {inter} on {G} rank(s) of the {args.preset} model"
    )
