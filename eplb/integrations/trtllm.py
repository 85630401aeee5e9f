"""TensorRT-LLM: a placement as the ``moe_config.load_balancer`` file of its offline EP load balancer.

Shape legend: L layers, P physical slots (``num_slots``), G GPUs (EP ranks).

TensorRT-LLM's load balancer reads ``num_slots``, ``initial_global_assignments`` ({model layer index:
[expert id per slot]}, slots rank-major: rank g holds slots [g*P/G, (g+1)*P/G), eplb's layout too)
and ``layer_updates_per_iter`` (0: offline, the placement stays fixed). Its layer keys are the
model's layer indices, so MoE layer 0 is ``layer_offset`` (3 for DeepSeek-V3/R1, whose first three
layers are dense). The YAML is written by hand (plain ints and lists) so eplb needs no YAML package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eplb.fileio import OutputSet, write_text
from eplb.placement.model import Placement

LOAD_BALANCER_FILE = "trtllm_load_balancer.yaml"
"""The ``load_balancer`` file ``eplb solve`` writes."""
OPTIONS_FILE = "trtllm_extra_llm_api_options.yaml"
"""The ``--extra_llm_api_options`` file ``eplb solve`` writes; it points at the load balancer file."""


def load_balancer_config(placement: Placement, layer_offset: int = 0) -> dict[str, Any]:
    """``{num_slots, initial_global_assignments, layer_updates_per_iter: 0}`` for ``placement``."""
    if layer_offset < 0:
        raise ValueError(f"layer_offset must be >= 0, got {layer_offset}")
    return {
        "num_slots": placement.num_physical,
        "initial_global_assignments": {
            layer_offset + layer: row for layer, row in enumerate(placement.phy2log_LP.tolist())
        },
        "layer_updates_per_iter": 0,
    }


def load_balancer_yaml(placement: Placement, layer_offset: int = 0) -> str:
    """The load balancer file's text (YAML: one flow list of expert ids per layer)."""
    config = load_balancer_config(placement, layer_offset)
    lines = [
        "# TensorRT-LLM offline EP load balancer (moe_config.load_balancer), written by eplb solve.",
        f"# {placement.num_gpus} EP ranks x {placement.slots_per_gpu} slots; slots are rank-major.",
        f"num_slots: {config['num_slots']}",
        "initial_global_assignments:",
    ]
    for layer, row in config["initial_global_assignments"].items():
        lines.append(f"  {layer}: [{', '.join(str(int(e)) for e in row)}]")
    lines.append(f"layer_updates_per_iter: {config['layer_updates_per_iter']}")
    return "\n".join(lines) + "\n"


def write_load_balancer(
    placement: Placement, out_dir: Path, layer_offset: int = 0, *, outputs: OutputSet | None = None
) -> tuple[Path, Path]:
    """Write the load balancer file and an ``--extra_llm_api_options`` file naming it; return both
    paths (atomic writes; with ``outputs`` staged there until it commits)."""
    balancer = out_dir / LOAD_BALANCER_FILE
    write_text(balancer, load_balancer_yaml(placement, layer_offset), outputs=outputs, parents=True)
    options = out_dir / OPTIONS_FILE
    write_text(
        options,
        "# TensorRT-LLM --extra_llm_api_options: the MoE backend's load balancer from eplb solve.\n"
        f"moe_config:\n  load_balancer: {_yaml_string(str(balancer.resolve()))}\n",
        outputs=outputs,
        parents=True,
    )
    return balancer, options


def launch_flags(placement: Placement, options_path: Path) -> str:
    """The trtllm-serve command line that starts from the placement (offline: it stays fixed).

    One EP rank per GPU (expert parallelism across the whole tensor-parallel group).
    """
    G = placement.num_gpus
    return f"trtllm-serve MODEL --tp_size {G} --ep_size {G} --extra_llm_api_options {options_path}"


def _yaml_string(text: str) -> str:
    """A double-quoted YAML scalar (paths may hold ':' or '#')."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
