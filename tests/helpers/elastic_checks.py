"""Run inside a subprocess with vLLM or SGLang importable (tests.helpers.engines): eplb's plugins
with ranks lost, through the engine's own loader, rank masks and map code; the result as JSON.

Shape legend: L layers, E logical experts, P physical slots, G GPUs (EP ranks).

``python -m tests.helpers.elastic_checks vllm|sglang OUT.json``. SGLang: ``ElasticEPStateManager``
built by SGLang's own constructor, ranks marked lost as its fault path leaves them, the plan from
SGLang's (hooked) ``rebalance_experts``, SGLang's ``elasticity_aware`` beside it, and the maps fed to
SGLang's recorder conversion. vLLM: the policy from vLLM's table with the sizes its
``EplbState.rearrange`` computes for the ``rank_mapping`` its elastic EP builds, the answer mapped
back by vLLM's own rank-mapping functions. The tests (tests/test_integrations_elastic.py) judge.
The modules holding vLLM's map functions and SGLang's recorder import packages the engine tests do
not install (cachetools, einops), so :func:`engine_function` runs those functions from the
installed engine's source file alone: the engine's own code, without its module's imports.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers.engine_checks import GROUPS, E, G, L, P, _metadata, skewed_load, trivial_map

SGLANG_DEAD: dict[str, tuple[int, list[int]]] = {
    "one": (G, [3]),
    "first": (G, [0]),
    "too_many": (G, [0, 5]),  # 6 ranks of 5 slots cannot hold the 32 experts
    "reserved": (G + 2, [6]),  # --max-ep-size 10: two reserved, inactive entries past the 8 ranks
}
"""Case -> (mask length, ranks lost)."""
VLLM_NEW_RANKS = 7
"""Scale 8 -> 7 EP ranks (7 * 5 slots hold the 32 experts; 6 would not)."""


def engine_function(package: str, relative: str, name: str) -> Any:
    """Function ``name`` of the installed ``package``'s file ``relative``, defined from its source
    alone with torch in scope (it must use nothing else of its module)."""
    root = Path(importlib.import_module(package).__file__ or "").parent
    tree = ast.parse((root / relative).read_text())
    found: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{package}/{relative} defines {name} {len(found)} times"
    scope: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(root / relative), "exec"), scope)
    return scope[name]


def _maps(triple: Any) -> list[list[Any]]:
    return [t.tolist() for t in triple]


def sglang_elastic() -> dict[str, Any]:
    import sglang.srt.plugins as plugins
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
    from sglang.srt.eplb import eplb_algorithms as algorithms
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )

    recorder_counts = engine_function(
        "sglang", "srt/eplb/expert_distribution.py", "_convert_global_physical_count_to_logical_count"
    )
    os.environ.pop("EPLB_SGLANG", None)
    plugins.load_plugins()
    from eplb.integrations import sglang as plugin

    tokens = torch.from_numpy(skewed_load(5, steps=40))
    kwargs = dict(tokens_per_expert=tokens, num_physical_experts=P, num_local_physical_experts=P // G,
                  num_groups=GROUPS, num_nodes=1)  # fmt: skip
    ours = algorithms.compute_algorithm(raw_algorithm="scipy", num_groups=GROUPS, num_nodes=1)
    theirs = algorithms.compute_algorithm(raw_algorithm="elasticity_aware", num_groups=GROUPS, num_nodes=1)
    out: dict[str, Any] = {
        "tokens": tokens.tolist(),
        "theirs_is_sglang": not isinstance(theirs, plugin.EplbSolverAlgorithm),
    }
    # The live placement every case starts from: eplb's plan with every rank alive.
    live = algorithms.rebalance_experts(**kwargs, algorithm=ours)[0]
    out["live"] = live.tolist()
    set_global_expert_location_metadata(_metadata(ExpertLocationMetadata, live))
    out["cases"] = {}
    for case, (size, dead) in SGLANG_DEAD.items():
        plugin.reset()
        get_global_expert_location_metadata().update(_metadata(ExpertLocationMetadata, live), list(range(L)))
        ElasticEPStateManager._instance = None
        state = ElasticEPStateManager._build_state(ep_size=size, device=torch.device("cpu"))
        state.active_ranks[G:] = 0  # ElasticEPStateManager.init: reserved slots inactive
        ElasticEPStateManager._instance = state
        state.active_ranks[dead] = 0  # what the elastic backend leaves on a fault
        state.snapshot_active_to_last()  # then maybe_rebalance_after_rank_fault, before rebalance()
        state.sync_active_to_cpu()
        try:
            plan = algorithms.rebalance_experts(**kwargs, algorithm=ours)
        except ValueError as exc:
            out["cases"][case] = {"dead": dead, "error": str(exc)}
            continue
        again = algorithms.rebalance_experts(**kwargs, algorithm=ours)
        result: dict[str, Any] = {"dead": dead, "eplb": _maps(plan), "eplb_again": _maps(again)}
        result["dtypes"] = [str(t.dtype) for t in plan]
        # SGLang's recorder turns slot counts into expert counts by phy2log (dead slots count 0).
        count = torch.ones(1, L, P, dtype=torch.int64)
        count[:, :, [s for r in dead for s in range(r * (P // G), (r + 1) * (P // G))]] = 0
        result["recorded"] = recorder_counts(count, L, E, plan[0]).tolist()
        # SGLang installs the plan; the next rebalance with the same ranks lost starts from it.
        get_global_expert_location_metadata().update(
            _metadata(ExpertLocationMetadata, plan[0]), list(range(L))
        )
        result["eplb_next"] = _maps(algorithms.rebalance_experts(**kwargs, algorithm=ours))
        if size == G:  # SGLang's own elasticity_aware takes only a mask of the EP size
            result["sglang"] = _maps(algorithms.rebalance_experts(**kwargs, algorithm=theirs))
        out["cases"][case] = result
    ElasticEPStateManager._instance = None
    return out


def vllm_elastic() -> dict[str, Any]:
    import vllm.plugins
    from vllm.distributed.eplb.policy import EPLB_POLICIES
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    execute = "distributed/eplb/rebalance_execute.py"
    map_new = engine_function("vllm", execute, "_map_new_expert_indices_with_rank_mapping")
    map_old = engine_function("vllm", execute, "_map_old_expert_indices_with_rank_mapping")
    compute_logical_maps = engine_function("vllm", "distributed/eplb/eplb_state.py", "compute_logical_maps")

    os.environ["EPLB_VLLM_POLICY"] = "1"
    vllm.plugins.load_general_plugins()
    policy = EPLB_POLICIES["default"]
    weight = torch.from_numpy(skewed_load(6)[0])
    policy.reset()
    live = policy.rebalance_experts(weight, P, GROUPS, 1, G, trivial_map())
    # ElasticEPScalingExecutor.perform_scale_down_eplb_reshuffle's mapping, and the sizes
    # EplbState.rearrange hands the policy with it.
    rank_mapping = {r: r if r < VLLM_NEW_RANKS else -1 for r in range(G)}
    num_gpus = sum(new != -1 for new in rank_mapping.values())
    num_replicas = P // G * num_gpus
    down = policy.rebalance_experts(weight, num_replicas, GROUPS, 1, num_gpus, live)
    policy.reset()
    down_again = policy.rebalance_experts(weight, num_replicas, GROUPS, 1, num_gpus, live)
    theirs = DefaultEplbPolicy.rebalance_experts(weight, num_replicas, GROUPS, 1, num_gpus, live)
    out: dict[str, Any] = {"load": weight.tolist(), "live": live.tolist(), "new_ranks": num_gpus}
    out["down"], out["down_again"], out["down_vllm"] = down.tolist(), down_again.tolist(), theirs.tolist()
    out["down_dtype"] = str(down.dtype)
    out["down_mapped"] = map_new(down, rank_mapping).tolist()
    out["down_counts"] = compute_logical_maps(down, E)[1].tolist()
    # Scale back up to 8: vLLM's reconfigure_physical_expert_slots leaves -1 in the new slots, and
    # its old-index mapping pads the old ranks' map the same way.
    up_mapping = {r: r for r in range(num_gpus)}
    padded = map_old(down, up_mapping, G)
    out["up_padded"] = padded.tolist()
    policy.reset()
    out["up"] = policy.rebalance_experts(weight, P, GROUPS, 1, G, padded).tolist()
    policy.reset()
    out["up_narrow"] = policy.rebalance_experts(weight, P, GROUPS, 1, G, down).tolist()
    out["up_counts"] = compute_logical_maps(torch.tensor(out["up"]), E)[1].tolist()
    return out


def main() -> int:
    engine, out_path = sys.argv[1], Path(sys.argv[2])
    checks = {"vllm": vllm_elastic, "sglang": sglang_elastic}[engine]
    out_path.write_text(json.dumps(checks()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
