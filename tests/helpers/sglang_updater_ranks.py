"""SGLang 0.5.23's expert weight updater beside eplb's replacement, on real Gloo ranks.

Runs in a subprocess where SGLang (PyPI, ``--no-deps``) is importable (:func:`run`); that process
spawns the ranks (eplb.moe.spawn.run_ranks) and writes their JSON results. In each rank:

- SGLang's config getters, which its ``ExpertLocationMetadata`` construction reads, are stand-ins
  (:func:`sglang_config`): SGLang's own ``ServerArgs`` cannot be built without torchvision and a
  model. Everything else is SGLang's code: placements from its DeepSeek algorithm,
  ``ExpertLocationMetadata.init_by_mapping`` (dispatch maps included), its updater's transfers on
  Gloo (torch.cpu has no ``empty_cache``, so its first-call cache flush is skipped), its
  ``EPLBManager`` (its recorder and LPLB set-up stubbed out), its ``HookRegistry``.
- Expert tensors are SGLang's for DeepSeek-V3 (fp8 block-quantised weights with their fp32
  ``scale_inv`` blocks, or bf16), scaled down; their bytes are a function of (layer, logical
  expert, tensor), so what every slot must hold is known independently of both updaters.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eplb.moe.spawn import RankContext

# DeepSeek-V3's expert tensors, scaled down: H 7168 -> 256, I 2048 -> 128, 128 x 128 fp8 blocks.
HIDDEN, INTER, BLOCK = 256, 128, 128
E, L, DENSE = 16, 4, 1
"""Logical experts, layers (the first DENSE dense, as DeepSeek-V3's first three), per model."""
TIMEOUT_S, STALL_S = 2.0, 3.5
FIELDS = (
    "physical_to_logical_map",
    "physical_to_logical_map_cpu",
    "logical_to_all_physical_map",
    "logical_to_all_physical_map_cpu",
    "logical_to_all_physical_map_num_valid",
    "logical_to_rank_dispatch_physical_map",
)


def tensor_specs(kind: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per expert, the tensors SGLang's ``get_moe_weights`` lists, in its order (fp8 or bf16)."""
    if kind == "fp8":
        return [
            ((2 * INTER, HIDDEN), torch.float8_e4m3fn),  # w13_weight
            ((HIDDEN, INTER), torch.float8_e4m3fn),  # w2_weight
            ((2 * INTER // BLOCK, HIDDEN // BLOCK), torch.float32),  # w13_weight_scale_inv
            ((HIDDEN // BLOCK, INTER // BLOCK), torch.float32),  # w2_weight_scale_inv
        ]
    assert kind == "bf16"
    return [((2 * INTER, HIDDEN), torch.bfloat16), ((HIDDEN, INTER), torch.bfloat16)]


def sglang_config(world: int, num_physical: int, nnodes: int) -> None:
    """Stand-ins for SGLang's config getters and model config (what ``init_by_mapping`` reads)."""
    import sglang.srt.eplb.expert_location as el

    moe = types.SimpleNamespace(
        ep_num_redundant_experts=num_physical - E,
        ep_dispatch_algorithm="static",
        moe_a2a_backend="deepep",
        ep_join_mode="none",
        eplb_algorithm="deepseek",
        eplb_rebalance_layers_per_chunk=1,
        eplb_rebalance_num_iterations=10,
        expert_distribution_recorder_buffer_size=10,
        eplb_min_rebalancing_utilization_threshold=1.0,
    )
    parallel = types.SimpleNamespace(
        ep_size=world,
        tp_size=world,
        nnodes=nnodes,
        elastic_ep_initial_size=None,
        ep_join_rank_offset=0,
        max_ep_size=None,
        tp_rank=int(torch.distributed.get_rank()),
    )
    el.get_exec = lambda: types.SimpleNamespace(moe=moe)
    el.get_parallel = lambda: parallel
    el.get_device = lambda: types.SimpleNamespace(device="cpu")
    config = el.ModelConfigForExpertLocation(num_layers=L, num_logical_experts=E, num_groups=4)
    el.ModelConfigForExpertLocation.from_model_config = staticmethod(lambda _: config)
    _stub_manager_imports(moe, parallel)


def _stub_manager_imports(moe: Any, parallel: Any) -> None:
    """Make ``sglang.srt.eplb.eplb_manager`` importable: its recorder and LPLB modules stubbed."""
    recorder = types.SimpleNamespace(recording=True, start_record=lambda: None, dump=None)
    dist_mod = types.ModuleType("sglang.srt.eplb.expert_distribution")
    dist_mod.__dict__["get_global_expert_distribution_recorder"] = lambda: recorder
    lplb = types.ModuleType("sglang.srt.model_executor.model_runner_components.moe_ep_setup")
    lplb.__dict__["init_lplb_solvers"] = lambda **_: None
    sys.modules.setdefault(dist_mod.__name__, dist_mod)
    sys.modules.setdefault(lplb.__name__, lplb)
    import sglang.srt.eplb.eplb_manager as mgr

    mgr.get_exec = lambda: types.SimpleNamespace(moe=moe)
    mgr.get_parallel = lambda: parallel


def recorder() -> Any:
    from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder

    return get_global_expert_distribution_recorder()


def metadata(phy2log_LP: np.ndarray, rank: int) -> Any:
    """SGLang's ExpertLocationMetadata of a map [L, P], built by SGLang's ``init_by_mapping``."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    return ExpertLocationMetadata.init_by_mapping(
        None, torch.from_numpy(phy2log_LP.astype(np.int64)), moe_ep_rank=rank
    )


def deepseek_phy2log(rng: np.random.Generator, num_physical: int, world: int, nnodes: int) -> np.ndarray:
    """int32 [L, P]: SGLang's DeepSeek algorithm on random skewed load."""
    from sglang.srt.eplb.eplb_algorithms import deepseek

    load = torch.from_numpy(rng.gamma(0.6, 100.0, size=(L, E)))
    phy2log, _, _ = deepseek.rebalance_experts(
        weight=load, num_replicas=num_physical, num_groups=4, num_nodes=nnodes, num_gpus=world,
        enable_hierarchical=nnodes > 1,
    )  # fmt: skip
    return np.asarray(phy2log.numpy(), dtype=np.int32)


def placements(case: dict[str, Any], world: int) -> tuple[np.ndarray, np.ndarray]:
    """(old, new) int32 [L, P] for a case: DeepSeek plans, random maps, or unchanged layers mixed in."""
    from tests.helpers.placements import random_phy2log

    rng = np.random.default_rng(case["seed"])
    P, nodes = case["P"], case["nnodes"]
    if case["maps"] == "deepseek":
        old, new = deepseek_phy2log(rng, P, world, nodes), deepseek_phy2log(rng, P, world, nodes)
    else:
        old, new = random_phy2log(rng, L, E, P), random_phy2log(rng, L, E, P)
    if case.get("unchanged"):
        new[case["unchanged"]] = old[case["unchanged"]]
    return old, new


def expert_bytes(layer: int, expert: int, i: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The content of tensor ``i`` of ``expert`` in ``layer``: random bytes from its identity."""
    g = torch.Generator().manual_seed(((layer * 1009 + expert) * 31 + i) * 7919 + 1)
    n = int(np.prod(shape)) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def slot_weights(
    phy2log_LP: np.ndarray, rank: int, S: int, kind: str, layout: Any, device: Any = "cpu"
) -> dict[int, list[Any]]:
    """This rank's slot tensors [S, ...] per MoE layer as ``phy2log_LP`` places the experts, in the
    engine layout (``layout``: the weights pre-shuffled per slot, scales as SGLang keeps them)."""
    out: dict[int, list[Any]] = {}
    for layer in range(DENSE, L):
        experts = phy2log_LP[layer, rank * S : (rank + 1) * S]
        tensors = []
        for i, (shape, dtype) in enumerate(tensor_specs(kind)):
            t = torch.stack([expert_bytes(layer, int(x), i, shape, dtype) for x in experts])
            if layout is not None and i < 2:
                t = layout.to_engine(f"w{i}", t)
            tensors.append(t.contiguous().to(device))
        out[layer] = tensors
    return out


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def same_weights(a: dict[int, list[Any]], b: dict[int, list[Any]]) -> bool:
    return a.keys() == b.keys() and all(
        len(a[k]) == len(b[k])
        and all(torch.equal(bytes_of(x), bytes_of(y)) for x, y in zip(a[k], b[k], strict=True))
        for k in a
    )


def snapshot(meta: Any) -> dict[str, Any]:
    return {f: (None if getattr(meta, f) is None else getattr(meta, f).clone()) for f in FIELDS} | {
        "ep_size": meta.ep_size
    }


def same_metadata(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        (a[f] is None and b[f] is None) or (a[f] is not None and b[f] is not None and torch.equal(a[f], b[f]))
        for f in FIELDS
    ) and (a["ep_size"] == b["ep_size"])


def set_live(meta: Any) -> None:
    from sglang.srt.eplb.expert_location import set_global_expert_location_metadata

    set_global_expert_location_metadata(copy.deepcopy(meta), allow_overwrite=True)


def live() -> Any:
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    return get_global_expert_location_metadata()


def setup(ctx: RankContext, P: int, nnodes: int) -> tuple[Any, Any, Any]:
    """SGLang's config stand-ins, eplb's replacement installed and applied by SGLang's HookRegistry:
    (SGLang's own ``update``, the hooked class, the replacement)."""
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    from sglang.srt.plugins.hook_registry import HookRegistry

    from eplb.integrations import sglang as plugin
    from eplb.integrations import sglang_updater

    sglang_config(ctx.world_size, P, nnodes)
    original = ExpertLocationUpdater.update
    os.environ[sglang_updater.ENV] = "maybe"  # stops SGLang at start-up, naming the variable
    try:
        plugin.register()
        raise AssertionError("a bad EPLB_SGLANG_WEIGHT_UPDATER was accepted")
    except SystemExit as exc:  # SGLang's plugin loader lets it through (it logs an Exception, goes on)
        assert sglang_updater.ENV in str(exc) and sglang_updater.current() is None, exc
    os.environ[sglang_updater.ENV] = "1"
    plugin.register()  # the plugin's entry point, as SGLang's loader calls it
    del os.environ[sglang_updater.ENV]
    HookRegistry.apply_hooks()
    assert ExpertLocationUpdater.update is not original, "the hook was not applied"
    updater = sglang_updater.install(sglang_updater.UpdaterConfig(timeout_s=TIMEOUT_S))
    return original, ExpertLocationUpdater, updater


def layout_of(name: str) -> Any:
    from eplb.hotswap.layout import get_layout

    return None if name == "plain" else get_layout(name)


def equivalence(ctx: RankContext, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: SGLang's ``update`` and eplb's replacement on the same inputs, chunk by chunk."""
    from eplb.integrations import sglang_updater

    original, updater_cls, _ = setup(ctx, cases[0]["P"], cases[0]["nnodes"])
    results = []
    for case in cases:
        P, rank = case["P"], ctx.rank
        sglang_config(ctx.world_size, P, case["nnodes"])
        S = P // ctx.world_size
        layout = layout_of(case["layout"])
        replacement = sglang_updater.install(
            sglang_updater.UpdaterConfig(
                timeout_s=TIMEOUT_S, transfer_gbps=case.get("gbps"), chunk_bytes=case.get("chunk_bytes")
            ),
            layout=layout,
        )
        old_LP, new_LP = placements(case, ctx.world_size)
        old, new = metadata(old_LP, rank), metadata(new_LP, rank)
        chunks = case["chunks"]
        outs: dict[str, Any] = {}
        for path in ("sglang", "eplb"):
            set_live(old)
            weights = slot_weights(old_LP, rank, S, case["kind"], layout, ctx.device)
            sg = updater_cls()
            sg._first_execution = False  # torch.cpu has no empty_cache (a cache flush, no weight changes)
            returns = []
            for chunk in chunks:
                kwargs = dict(update_layer_ids=chunk, nnodes=case["nnodes"], rank=rank)
                if path == "sglang":
                    returns.append(original(sg, weights, new, **kwargs))
                else:
                    returns.append(sg.update(weights, new, **kwargs))
            outs[path] = (weights, snapshot(live()), returns)
        (w_sg, m_sg, r_sg), (w_ours, m_ours, r_ours) = outs["sglang"], outs["eplb"]
        updated = sorted({x for c in chunks for x in c})
        want_LP = old_LP.copy()
        want_LP[updated] = new_LP[updated]
        expected = slot_weights(want_LP, rank, S, case["kind"], layout, ctx.device)
        plain = (
            layout is not None
            and all(  # the engine layout un-shuffles to the expected experts
                torch.equal(bytes_of(layout.to_plain(f"w{i}", w_ours[k][i])), bytes_of(expert_plain))
                for k in expected
                for i, expert_plain in enumerate(
                    slot_weights(want_LP, rank, S, case["kind"], None, ctx.device)[k][:2]
                )
            )
        )
        reports = list(replacement.reports)
        results.append(
            {
                "name": case["name"],
                "weights_same": same_weights(w_sg, w_ours),
                "weights_expected": same_weights(w_ours, expected),
                "sglang_expected": same_weights(w_sg, expected),
                "metadata_same": same_metadata(m_sg, m_ours),
                "metadata_new": bool(
                    torch.equal(m_ours["physical_to_logical_map_cpu"], torch.from_numpy(want_LP).long())
                ),
                "returns": [repr(r_sg), repr(r_ours)],
                "reports_ok": [r.ok for r in reports],
                "pace_s": sum(r.phase_seconds.get("pace", 0.0) for r in reports),
                "layout_plain": plain,
                "tensors": len(w_ours[DENSE]),
            }
        )
        replacement.reports.clear()
    return results


# ---- faults -------------------------------------------------------------------------------------
class Manager:
    """Records ``disable_rebalance`` as SGLang's EPLBManager receives it (and is the metrics sink)."""

    def __init__(self) -> None:
        self.disabled: list[str] = []
        self.events: list[tuple[str, str]] = []

    def disable_rebalance(self, reason: str) -> None:
        self.disabled.append(reason)

    def on_rebalance(self, **event: Any) -> None:
        """And the metrics sink's rebalance events (outcome, cause)."""
        self.events.append((event["outcome"], event["cause"]))


def layer_states(weights: dict[int, list[Any]], old_LP: np.ndarray, new_LP: np.ndarray, rank: int, S: int,
                 kind: str) -> list[tuple[bool, ...]]:  # fmt: skip
    """Per MoE layer: (weights old, weights new, metadata old, metadata new), against references."""
    meta = live().physical_to_logical_map_cpu
    out = []
    for layer in range(DENSE, L):
        got = {layer: weights[layer]}
        w = [
            same_weights(got, {layer: slot_weights(p, rank, S, kind, None)[layer]}) for p in (old_LP, new_LP)
        ]
        m = [bool(torch.equal(meta[layer], torch.from_numpy(p[layer]).long())) for p in (old_LP, new_LP)]
        out.append((*w, *m))
    return out


def faults(ctx: RankContext, cases: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Per case: one rank faults inside the replacement's swap; what every rank ended with."""
    import torch.distributed as dist

    from eplb.hotswap.control import group_store, root_store

    P, nnodes = cases[0]["P"], 1
    _, updater_cls, replacement = setup(ctx, P, nnodes)
    S, rank = P // ctx.world_size, ctx.rank
    store = root_store(group_store(None))
    results: list[dict[str, Any] | None] = []
    for case in cases:
        from eplb.integrations import sglang_updater

        manager = Manager()
        replacement = sglang_updater.install(
            sglang_updater.UpdaterConfig(timeout_s=TIMEOUT_S, chunk_bytes=case.get("chunk_bytes")),
            sink=functools.partial(lambda m: m, manager),
        )
        replacement.managers.add(manager)
        old_LP, new_LP = placements(case, ctx.world_size)
        old, new = metadata(old_LP, rank), metadata(new_LP, rank)
        set_live(old)
        weights = slot_weights(old_LP, rank, S, case["kind"], None, ctx.device)
        mine, kind = rank == case["rank"], case["fault"]
        fired: list[bool] = []

        def fault(
            stage: str,
            chunk: int,
            bufs: list[torch.Tensor],
            kind: str = kind,
            mine: bool = mine,
            case: dict[str, Any] = case,
            fired: list[bool] = fired,
        ) -> None:
            if kind == "corrupt":  # the first arrival this rank receives, whichever chunk it is in
                if mine and stage == "received" and bufs and not fired:
                    fired.append(True)
                    store.set(f"test/{case['name']}/fault_at", str(time.time()))
                    bufs[0].view(torch.uint8).reshape(-1)[:4] ^= 0xFF
                return
            if not (mine and stage == case["stage"] and chunk == case.get("chunk", -1)):
                return
            store.set(f"test/{case['name']}/fault_at", str(time.time()))
            if kind == "exit":
                os._exit(1)
            if kind == "stall":
                time.sleep(STALL_S)
            if kind == "interrupt":
                raise KeyboardInterrupt

        replacement.fault = fault
        sg = updater_cls()
        sg._first_execution = False
        out: dict[str, Any] = {"rank": rank}
        try:
            out["returned"] = repr(sg.update(weights, new, update_layer_ids=list(range(DENSE, L)), nnodes=1,
                                             rank=rank))  # fmt: skip
        except KeyboardInterrupt:
            out["returned"] = "KeyboardInterrupt"
        replacement.fault = None
        out["ended_at"] = time.time()
        out["layers"] = layer_states(weights, old_LP, new_LP, rank, S, case["kind"])
        out["reports"] = [(r.ok, r.cause) for r in replacement.reports]
        out["disabled"] = manager.disabled
        out["events"] = manager.events
        out["stopped"] = replacement.stopped
        replacement.reports.clear()
        if kind != "exit":
            # The serving group is intact: its collectives work, and a fresh swap commits.
            total = torch.ones(1)
            dist.all_reduce(total)
            got = torch.empty(ctx.world_size)
            dist.all_to_all_single(got, torch.full((ctx.world_size,), float(rank)))
            out["serving_ok"] = total.item() == ctx.world_size and got.tolist() == list(range(ctx.world_size))
            sg.update(weights, new, update_layer_ids=list(range(DENSE, L)), nnodes=1, rank=rank)
            out["then"] = layer_states(weights, old_LP, new_LP, rank, S, case["kind"])
            out["then_reports"] = [(r.ok, r.cause) for r in replacement.reports]
            replacement.reports.clear()
        store.set(f"test/{case['name']}/result/{rank}", json.dumps(out))
        results.append(out)
    return results


# ---- SGLang's EPLBManager -----------------------------------------------------------------------
def manager_rebalance(ctx: RankContext, case: dict[str, Any]) -> dict[str, Any]:
    """SGLang's own ``EPLBManager.rebalance`` with the replacement behind it: a clean rebalance,
    then one whose swap fails (a corrupted arrival on ``case["rank"]``)."""
    P, rank = case["P"], ctx.rank
    S = P // ctx.world_size
    _, _, replacement = setup(ctx, P, 1)
    rng = np.random.default_rng(case["seed"])
    manager, weights = serving_manager(ctx, rng, P, case["kind"])
    out: dict[str, Any] = {"known": manager in replacement.managers}
    for step, fault in enumerate((False, True)):
        counts = torch.from_numpy(rng.gamma(0.6, 100.0, size=(1, L, E))).round()
        recorder().dump_record = lambda output_mode, c=counts: {
            "logical_count": c, "average_utilization_rate_over_window": None,
        }  # fmt: skip
        before_LP = live().physical_to_logical_map_cpu.numpy().astype(np.int32)
        if fault:
            target_rank = case["rank"]

            def corrupt(
                stage: str, chunk: int, bufs: list[torch.Tensor], target_rank: int = target_rank
            ) -> None:
                if rank == target_rank and stage == "received" and bufs:  # every arrival there
                    bufs[0].view(torch.uint8).reshape(-1)[:4] ^= 0xFF

            replacement.fault = corrupt
        # As SGLang drives it: one call per forward pass; the rebalance starts after the interval
        # and runs one chunk of layers per pass (a failed swap resets the generator).
        for _ in range(PASSES):
            manager.on_forward_pass_end()
        replacement.fault = None
        after_LP = live().physical_to_logical_map_cpu.numpy().astype(np.int32)
        out[f"step{step}"] = {
            "changed": bool((after_LP != before_LP).any()),
            "moved": bool((before_LP[DENSE:] != deepseek_target(counts, P, ctx.world_size)[DENSE:]).any()),
            "weights_match_metadata": all(
                s[1] and s[3] for s in layer_states(weights, before_LP, after_LP, rank, S, case["kind"])
            ),
            "after_is_plan": bool(
                (after_LP[DENSE:] == deepseek_target(counts, P, ctx.world_size)[DENSE:]).all()
            ),
            "layers_changed": [bool((after_LP[x] != before_LP[x]).any()) for x in range(DENSE, L)],
            "disabled": manager._rebalance_disabled_reason,
            "reports": [(r.ok, r.cause) for r in replacement.reports],
        }
        replacement.reports.clear()
    return out


def serving_manager(
    ctx: RankContext, rng: np.random.Generator, P: int, kind: str
) -> tuple[Any, dict[int, list[Any]]]:
    """SGLang's own ``EPLBManager`` over this rank's slot weights of a DeepSeek placement (live),
    moving them with SGLang's ``ExpertLocationUpdater``: (manager, weights)."""
    from sglang.srt.eplb.eplb_manager import EPLBManager  # importable once setup stubbed its recorder
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater

    S = P // ctx.world_size
    old_LP = deepseek_phy2log(rng, P, ctx.world_size, 1)
    set_live(metadata(old_LP, ctx.rank))
    weights = slot_weights(old_LP, ctx.rank, S, kind, None, ctx.device)
    model = types.SimpleNamespace(routed_experts_weights_of_layer=weights)
    sg = ExpertLocationUpdater()
    sg._first_execution = False
    manager = EPLBManager(
        model_config=None, get_model=lambda: model, get_expert_location_updater=lambda: sg,
        get_expert_backup_client=lambda: None,
        get_weight_updater=lambda: types.SimpleNamespace(update_weights_from_disk=None),
    )  # fmt: skip
    return manager, weights


PASSES = 10 + (L - DENSE) + 1
"""Forward passes that take SGLang's manager through its interval and one chunk per MoE layer."""


def deepseek_target(counts: torch.Tensor, P: int, world: int) -> np.ndarray:
    """What SGLang's ``init_by_eplb`` plans from ``counts`` (its DeepSeek algorithm, one node)."""
    from sglang.srt.eplb import eplb_algorithms

    phy2log, _, _ = eplb_algorithms.rebalance_experts(
        tokens_per_expert=counts, num_physical_experts=P, num_local_physical_experts=P // world,
        num_groups=4, num_nodes=1, algorithm=eplb_algorithms.EplbAlgorithm.deepseek,
    )  # fmt: skip
    return np.asarray(phy2log.numpy(), dtype=np.int32)


# ---- the subprocess -----------------------------------------------------------------------------
SCENARIOS: dict[str, Callable[..., Any]] = {
    "equivalence": equivalence,
    "faults": faults,
    "manager": manager_rebalance,
}


def main(argv: list[str]) -> int:
    """``python -m tests.helpers.sglang_updater_ranks SCENARIO WORLD CASES.json OUT.json``."""
    from eplb.moe.spawn import host_store, run_ranks

    scenario, world, cases_path, out_path = argv[0], int(argv[1]), Path(argv[2]), Path(argv[3])
    backend = argv[4] if len(argv) > 4 else "gloo"
    cases = json.loads(cases_path.read_text())
    server = host_store()
    may_die = {c["rank"] for c in cases if c.get("fault") == "exit"} if scenario == "faults" else set()
    results = run_ranks(
        SCENARIOS[scenario],
        world,
        args=(cases,),
        timeout_s=240,
        store=server,
        may_die=may_die,
        backend=backend,
    )
    if scenario == "faults":  # a rank that died reported what it could before, through the store
        for r in range(world):
            if results[r] is None:
                results[r] = [reported(server, c, r) for c in cases]
        fault_at = {c["name"]: float(server.get(f"test/{c['name']}/fault_at")) for c in cases}
        out_path.write_text(json.dumps({"results": results, "fault_at": fault_at}))
    else:
        out_path.write_text(json.dumps({"results": results}))
    return 0


def reported(server: Any, case: dict[str, Any], rank: int) -> dict[str, Any] | None:
    key = f"test/{case['name']}/result/{rank}"
    return json.loads(server.get(key)) if server.check([key]) else None


def run(scenario: str, world: int, cases: Any, backend: str = "gloo") -> dict[str, Any]:
    """Run a scenario in a subprocess with SGLang importable; its JSON result."""
    import subprocess
    import tempfile

    from tests.helpers.engines import ROOT, ensure_engines

    site, extra = ensure_engines(), ensure_extra()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPLB_", "VLLM_", "SGLANG_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(extra), str(ROOT)])
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out = Path(tmp) / "cases.json", Path(tmp) / "out.json"
        cases_path.write_text(json.dumps(cases))
        cmd = [sys.executable, "-m", "tests.helpers.sglang_updater_ranks", scenario, str(world), str(cases_path),
               str(out), backend]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not out.is_file():
            raise AssertionError(
                f"{scenario} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-8000:]}"
            )
        result: dict[str, Any] = json.loads(out.read_text())
    return result


EXTRA = ("einops==0.8.2",)
"""What SGLang's updater imports beyond tests.helpers.engines' set (installed beside it, --no-deps)."""


def ensure_extra() -> Path:
    """``EXTRA`` in a folder beside the engines' (installed once)."""
    import hashlib
    import shutil
    import subprocess
    import tempfile

    from tests.helpers.engines import ROOT, engines_dir

    key = hashlib.sha256("\n".join((*EXTRA, sys.version)).encode()).hexdigest()[:12]
    target = engines_dir().parent / f"sglang-updater-extra-{key}"
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="extra-", dir=target.parent))
    links = [
        a for d in (ROOT / ".peers" / "wheels", ROOT / ".whl") if d.is_dir() for a in ("--find-links", str(d))
    ]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--quiet",
        "--target",
        str(staging),
        *links,
        *EXTRA,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"installing {EXTRA} failed:\n{done.stdout}\n{done.stderr}")
    (staging / ".complete").write_text("\n".join(EXTRA) + "\n")
    if target.exists():
        shutil.rmtree(staging, ignore_errors=True)
    else:
        staging.rename(target)
    return target


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
