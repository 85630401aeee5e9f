"""Run inside a subprocess with vLLM or SGLang importable (tests.helpers.engines): exercise eplb's
plugin through the engine's own loader and code, and write what happened as JSON for the tests.

``python -m tests.helpers.engine_checks vllm|sglang OUT.json`` (or ``NAME``: the ``run`` of
tests.helpers.NAME_checks). Maps travel as nested lists; the
tests judge them (validity, balance, equality with the engine's own functions) in their process.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

L, E, G, P, GROUPS = 4, 32, 8, 40, 8
"""Test model: 4 MoE layers, 32 experts in 8 groups, 8 EP ranks, 8 redundant slots."""


def skewed_load(seed: int, steps: int = 1) -> np.ndarray:
    """int64 [steps, L, E]: Zipf-like expert popularity, a different ranking per layer."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, E + 1) ** 1.2
    out = np.empty((steps, L, E), dtype=np.int64)
    for layer in range(L):
        p = popularity[rng.permutation(E)]
        out[:, layer] = rng.multinomial(4000, p / p.sum(), size=steps)
    return out


DRIFT_WINDOWS, DRIFT_PASSES, DRIFT_SEEDS = 14, 40, (5, 6, 7)
"""Drifting input: windows of passes, each window a rebalance (the tests score plan t on window t+1)."""


def drifting_load(seed: int) -> np.ndarray:
    """int64 [windows, passes, L, E]: log-normal popularity whose log drifts pass by pass (an AR(1)
    walk keeping 0.97 of itself per window, 0.2 of innovation per window), with the experts'
    ranks shuffled midway (a domain shift); every pass routes 6000 tokens' choices."""
    rng = np.random.default_rng(seed)
    base_LE = 1.1 * rng.standard_normal((L, E))
    drift_LE = np.zeros((L, E))
    keep, step = 0.97 ** (1 / DRIFT_PASSES), 0.2 / np.sqrt(DRIFT_PASSES)
    out = np.empty((DRIFT_WINDOWS, DRIFT_PASSES, L, E), dtype=np.int64)
    for w in range(DRIFT_WINDOWS):
        if w == DRIFT_WINDOWS // 2:
            base_LE = base_LE[:, rng.permutation(E)]
        for n in range(DRIFT_PASSES):
            drift_LE = keep * drift_LE + step * rng.standard_normal((L, E))
            p_LE = np.exp(base_LE + drift_LE)
            for layer in range(L):
                out[w, n, layer] = rng.multinomial(6000, p_LE[layer] / p_LE[layer].sum())
    return out


def drift_scores(cases: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, float]]:
    """(eplb, engine): mean next-window model balancedness of each plan (an even split) over the
    drifting cases, and the expert copies across GPUs their plans moved in all."""
    from eplb.placement.balance import model_balancedness
    from eplb.placement.diff import diff_placements
    from eplb.placement.model import Placement

    out = []
    for side in ("eplb", "engine"):
        scores, copies = [], 0
        for case in cases:
            load_WLE = np.asarray(case["load"], dtype=np.float64)
            maps = [Placement.from_phy2log(np.asarray(m), G) for m in case[side]]
            start = Placement.from_phy2log(trivial_map().numpy(), G)
            for t, placement in enumerate(maps):
                copies += diff_placements(
                    start if t == 0 else maps[t - 1], placement
                ).experts_moved_across_gpus
                if t + 1 < len(maps):
                    scores.append(float(model_balancedness(load_WLE[t + 1], placement)))
        out.append({"next_window": float(np.mean(scores)), "copies": float(copies)})
    return out[0], out[1]


def trivial_map() -> torch.Tensor:
    return torch.arange(P, dtype=torch.int64).remainder(E).expand(L, P).contiguous()


def vllm_checks() -> dict[str, Any]:
    import vllm.plugins
    from vllm.config.parallel import EPLBConfig
    from vllm.distributed.eplb.policy import EPLB_POLICIES
    from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    out: dict[str, Any] = {}
    os.environ.pop("EPLB_VLLM_POLICY", None)
    vllm.plugins.load_general_plugins()
    out["off_policy_is_default"] = EPLB_POLICIES["default"] is DefaultEplbPolicy

    os.environ["EPLB_VLLM_POLICY"] = "1"
    vllm.plugins.plugins_loaded = False  # a fresh process's state: load again, now asked for
    vllm.plugins.load_general_plugins()
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()  # loaded twice (vLLM may): nothing changes
    from eplb.integrations.vllm import EplbVllmPolicy

    config_policy = EPLBConfig().policy  # what vLLM's EplbState looks up: EPLB_POLICIES[config.policy]
    policy = EPLB_POLICIES[config_policy]
    out["config_policy"] = config_policy
    out["policy_is_eplb"] = issubclass(policy, EplbVllmPolicy)
    out["policy_is_vllm_policy"] = issubclass(policy, AbstractEplbPolicy)
    out["vllm_default_kept"] = policy.vllm_default is DefaultEplbPolicy
    out["keys"] = sorted(EPLB_POLICIES)

    weight = torch.from_numpy(skewed_load(1)[0])
    old = trivial_map()
    policy.reset()
    first = policy.rebalance_experts(weight, P, GROUPS, 1, G, old)
    policy.reset()
    second = policy.rebalance_experts(weight, P, GROUPS, 1, G, old)
    out["eplb_map"] = first.tolist()
    out["eplb_dtype"] = str(first.dtype)
    out["repeat_map"] = second.tolist()
    out["default_map"] = DefaultEplbPolicy.rebalance_experts(weight, P, GROUPS, 1, G, old).tolist()
    out["load"] = weight.tolist()

    # Elastic EP: empty slots (-1) in the live map; the plan is still full and valid.
    holes = old.clone()
    holes[:, -3:] = -1
    policy.reset()
    out["holes_map"] = policy.rebalance_experts(weight, P, GROUPS, 1, G, holes).tolist()

    # History: a sequence of windows gives the same plans on two "ranks" (fresh states), and the
    # plan from the live placement it produced keeps it when the load does not change.
    windows = skewed_load(2, steps=5)
    runs = []
    for _ in range(2):
        policy.reset()
        current = old
        plans = []
        for w in windows:
            current = policy.rebalance_experts(torch.from_numpy(w), P, GROUPS, 1, G, current)
            plans.append(current.tolist())
        runs.append(plans)
    out["history_runs"] = runs
    out["history_kept"] = next(iter(policy._decisions.values())).kept_rows

    # Drifting load, one summed window per rebalance: each policy from its own live map.
    out["drift"] = []
    for seed in DRIFT_SEEDS:
        policy.reset()
        drift = drifting_load(seed)
        ours, theirs = trivial_map(), trivial_map()
        case: dict[str, Any] = {"eplb": [], "engine": [], "load": drift.sum(axis=1).tolist()}
        for window in drift:
            weight = torch.from_numpy(window.sum(axis=0))
            ours = policy.rebalance_experts(weight, P, GROUPS, 1, G, ours)
            theirs = DefaultEplbPolicy.rebalance_experts(weight, P, GROUPS, 1, G, theirs)
            case["eplb"].append(ours.tolist())
            case["engine"].append(theirs.tolist())
        out["drift"].append(case)
    return out


class _CudaLooking(torch.Tensor):
    """A CPU tensor that passes SGLang's ``is_cuda`` gate, so its Triton kernel runs in the interpreter."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def sglang_checks() -> dict[str, Any]:
    import sglang.srt.eplb.eplb_map_record_fused as fused_module
    import sglang.srt.plugins as plugins
    from sglang.srt.eplb import eplb_algorithms as algorithms
    from sglang.srt.eplb.eplb_algorithms import deepseek
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    out: dict[str, Any] = {}
    sglang_fused = fused_module.eplb_map_and_record_fused
    sglang_compute = algorithms.compute_algorithm

    # Off: EPLB_SGLANG=0 keeps SGLang's functions.
    os.environ["EPLB_SGLANG"] = "0"
    plugins.load_plugins()
    out["off_compute_unchanged"] = algorithms.compute_algorithm is sglang_compute
    # On, fused remap not asked for: the algorithms are wrapped, the kernel is SGLang's.
    os.environ.pop("EPLB_SGLANG")
    plugins._plugins_loaded = False
    plugins.load_plugins()
    out["default_fused_unchanged"] = fused_module.eplb_map_and_record_fused is sglang_fused
    # And asked for.
    os.environ["EPLB_SGLANG_FUSED_REMAP"] = "1"
    plugins._plugins_loaded = False
    plugins.load_plugins()
    out["fused_replaced"] = fused_module.eplb_map_and_record_fused is not sglang_fused

    from eplb.integrations import sglang as plugin
    from eplb.integrations.sglang import EplbSolverAlgorithm

    choices = {name: algorithms.compute_algorithm(name, GROUPS, 1) for name in
               ("scipy", "eplb", "eplb:deepseek", "deepseek", "deepseek_hierarchical", "auto")}  # fmt: skip
    out["choices"] = {
        name: (["eplb", c.name] if isinstance(c, EplbSolverAlgorithm) else ["sglang", c.name])
        for name, c in choices.items()
    }
    try:
        algorithms.compute_algorithm("magic", GROUPS, 1)
        out["unknown_raises"] = None
    except KeyError:
        out["unknown_raises"] = "KeyError"

    tokens = torch.from_numpy(skewed_load(3, steps=40))
    kwargs = dict(tokens_per_expert=tokens, num_physical_experts=P, num_local_physical_experts=P // G,
                  num_groups=GROUPS, num_nodes=1)  # fmt: skip
    scipy_choice = algorithms.compute_algorithm(raw_algorithm="scipy", num_groups=GROUPS, num_nodes=1)
    first = algorithms.rebalance_experts(**kwargs, algorithm=scipy_choice)
    second = algorithms.rebalance_experts(**kwargs, algorithm=scipy_choice)
    out["scipy"] = [t.tolist() for t in first]
    out["scipy_dtypes"] = [str(t.dtype) for t in first]
    out["scipy_repeat"] = [t.tolist() for t in second]
    out["tokens"] = tokens.tolist()

    # SGLang's own algorithm through the wrapped function equals SGLang's DeepSeek module.
    wrapped = algorithms.rebalance_experts(**kwargs, algorithm=algorithms.EplbAlgorithm.deepseek)
    direct = deepseek.rebalance_experts(weight=tokens.sum(dim=0), num_replicas=P, num_groups=GROUPS,
                                        num_nodes=1, num_gpus=G, enable_hierarchical=False)  # fmt: skip
    out["deepseek_wrapped"] = [t.tolist() for t in wrapped]
    out["deepseek_direct"] = [t.tolist() for t in direct]
    out["deepseek_dtypes"] = [str(t.dtype) for t in direct]

    # The live placement: with the plan just made installed, the same window keeps it.
    phy2log = first[0]
    log2phy = torch.nn.functional.pad(first[1], (0, P - first[1].shape[-1]), value=-1)
    metadata = ExpertLocationMetadata(
        physical_to_logical_map=phy2log, physical_to_logical_map_cpu=phy2log, logical_to_all_physical_map=log2phy,
        logical_to_all_physical_map_cpu=log2phy, logical_to_all_physical_map_num_valid=first[2], ep_size=G,
        logical_to_rank_dispatch_physical_map=None,
    )  # fmt: skip
    set_global_expert_location_metadata(metadata)
    out["live_kept"] = [t.tolist() for t in algorithms.rebalance_experts(**kwargs, algorithm=scipy_choice)]

    # Drifting load, one window of passes per rebalance, through SGLang's wrapped function: eplb
    # from the live placement SGLang holds (its own last plan), SGLang's deepseek from scratch.
    out["drift"] = []
    for seed in DRIFT_SEEDS:
        drift = drifting_load(seed)
        case = {"eplb": [], "engine": [], "load": drift.sum(axis=1).tolist()}
        live = trivial_map()
        plugin._DECISIONS.clear()  # a fresh server process per input
        for window in drift:
            # As SGLang installs a plan: the global metadata (set once above) updated in place.
            get_global_expert_location_metadata().update(
                _metadata(ExpertLocationMetadata, live), update_layer_ids=list(range(L))
            )
            step = dict(kwargs, tokens_per_expert=torch.from_numpy(window))
            live = algorithms.rebalance_experts(**step, algorithm=scipy_choice)[0]
            theirs = algorithms.rebalance_experts(**step, algorithm=algorithms.EplbAlgorithm.deepseek)[0]
            case["eplb"].append(live.tolist())
            case["engine"].append(theirs.tolist())
        out["drift"].append(case)

    out["fused"] = fused_cases(
        fused_module.eplb_map_and_record_fused, sglang_fused, ExpertLocationDispatchInfo
    )
    out["fused_update"] = fused_update_case(
        fused_module.eplb_map_and_record_fused,
        sglang_fused,
        ExpertLocationDispatchInfo,
        ExpertLocationMetadata,
    )
    return out


def _metadata(metadata_cls: Any, phy2log: torch.Tensor) -> Any:
    """SGLang's ExpertLocationMetadata of a map [L, P], as SGLang builds it after a rebalance."""
    counts = torch.stack([torch.bincount(row, minlength=E) for row in phy2log])
    log2phy = torch.full((L, E, P), -1, dtype=torch.int64)
    for layer in range(L):
        for expert in range(E):
            slots = torch.nonzero(phy2log[layer] == expert).flatten()
            log2phy[layer, expert, : slots.numel()] = slots
    return metadata_cls(
        physical_to_logical_map=phy2log, physical_to_logical_map_cpu=phy2log, logical_to_all_physical_map=log2phy,
        logical_to_all_physical_map_cpu=log2phy, logical_to_all_physical_map_num_valid=counts, ep_size=G,
        logical_to_rank_dispatch_physical_map=None,
    )  # fmt: skip


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _call_both(
    ours: Any, theirs: Any, ids: torch.Tensor, info: Any, nvalid: torch.Tensor | None
) -> dict[str, Any]:
    """Both kernels on the same input, each with its own zeroed load buffer."""
    num_physical = P if info is None else info.num_physical_experts
    dev = ids.device
    load_ours = torch.zeros(num_physical, dtype=torch.int32, device=dev)
    load_theirs = torch.zeros(num_physical, dtype=torch.int32, device=dev)
    got = ours(ids, info, load_ours, nvalid)
    sg_ids = ids if dev.type == "cuda" else ids.as_subclass(_CudaLooking)
    want = theirs(sg_ids, info, load_theirs, nvalid)
    return {
        "ours": None if got is None else got.cpu().tolist(),
        "ours_dtype": None if got is None else str(got.dtype),
        "sglang": None if want is None else want.cpu().tolist(),
        "sglang_dtype": None if want is None else str(want.dtype),
        "load_ours": load_ours.cpu().tolist(),
        "load_sglang": load_theirs.cpu().tolist(),
    }


def _dispatch_info(info_cls: Any, algorithm: str, dispatch_E: torch.Tensor | None) -> Any:
    dev = _device()
    return info_cls(
        ep_dispatch_algorithm=algorithm,
        partial_logical_to_rank_dispatch_physical_map=dispatch_E,
        partial_logical_to_all_physical_map=torch.zeros(E, 1, dtype=torch.int64, device=dev),
        partial_logical_to_all_physical_map_num_valid=torch.ones(E, dtype=torch.int64, device=dev),
        num_physical_experts=P,
    )


def fused_cases(ours: Any, theirs: Any, info_cls: Any) -> dict[str, Any]:
    """SGLang's fused kernel and its replacement on the cases its callers produce."""
    dev = _device()
    gen = torch.Generator().manual_seed(7)
    dispatch_E = torch.randint(0, P, (E,), generator=gen).to(dev)  # int64, as SGLang builds it
    cases: dict[str, Any] = {}
    for rows in (1, 37, 300):
        ids = torch.randint(-1, E + 3, (rows, 8), generator=gen, dtype=torch.int32).to(dev)
        static = _dispatch_info(info_cls, "static", dispatch_E)
        nvalid = torch.tensor([max(rows - 5, 0)], dtype=torch.int32, device=dev)
        cases[f"static_{rows}"] = _call_both(ours, theirs, ids, static, None)
        cases[f"static_padded_{rows}"] = _call_both(ours, theirs, ids, static, nvalid)
        ids_p = torch.randint(-1, P + 2, (rows, 8), generator=gen, dtype=torch.int32).to(dev)
        cases[f"identity_{rows}"] = _call_both(ours, theirs, ids_p, None, nvalid)
    ids = torch.randint(0, E, (16, 8), generator=gen, dtype=torch.int32).to(dev)
    cases["dynamic"] = _call_both(ours, theirs, ids, _dispatch_info(info_cls, "dynamic", dispatch_E), None)
    cases["no_map"] = _call_both(ours, theirs, ids, _dispatch_info(info_cls, "static", None), None)
    cases["empty"] = _call_both(ours, theirs, ids[:0], _dispatch_info(info_cls, "static", dispatch_E), None)
    return cases


def fused_update_case(ours: Any, theirs: Any, info_cls: Any, metadata_cls: Any) -> dict[str, Any]:
    """A placement change through ``ExpertLocationMetadata.update``: the replacement follows it."""
    from eplb.integrations import sglang_remap

    dev = _device()
    gen = torch.Generator().manual_seed(11)

    def metadata(seed: int) -> Any:
        rank_map = torch.randint(0, P, (L, E), generator=torch.Generator().manual_seed(seed)).to(dev)
        phy2log = trivial_map().to(dev)
        log2phy = torch.zeros(L, E, P, dtype=torch.int64, device=dev)
        return metadata_cls(
            physical_to_logical_map=phy2log, physical_to_logical_map_cpu=phy2log.cpu(),
            logical_to_all_physical_map=log2phy, logical_to_all_physical_map_cpu=log2phy.cpu(),
            logical_to_all_physical_map_num_valid=torch.ones(L, E, dtype=torch.int64, device=dev), ep_size=G,
            logical_to_rank_dispatch_physical_map=rank_map,
        )  # fmt: skip

    live, new = metadata(1), metadata(2)
    ids = torch.randint(-1, E, (50, 8), generator=gen, dtype=torch.int32).to(dev)
    before = sglang_remap.TRANSLATIONS[0]
    results = []
    for step in range(3):  # a fresh view of layer 2's row on every call, as SGLang's routing makes
        if step == 2:
            live.update(new, update_layer_ids=[2])
        info = _dispatch_info(info_cls, "static", live.logical_to_rank_dispatch_physical_map[2, :])
        results.append(_call_both(ours, theirs, ids, info, None))
    return {"results": results, "translations": sglang_remap.TRANSLATIONS[0] - before}


def main() -> int:
    engine, out_path = sys.argv[1], Path(sys.argv[2])
    checks = {"vllm": vllm_checks, "sglang": sglang_checks}.get(engine)
    if checks is None:  # another helper's checks: tests.helpers.ENGINE_checks.run (e.g. sglang_rows)
        checks = importlib.import_module(f"tests.helpers.{engine}_checks").run
    result = checks()
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
