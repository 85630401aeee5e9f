"""SGLang 0.5.23's ``lp`` dispatch served by eplb: what the engines' subprocess records.

Shape legend: L layers, E logical experts, P physical slots, G GPUs (EP ranks), T tokens, K top-k.

:func:`run` (in the subprocess, ``EPLB_SGLANG_LP=1``) loads the plugin through SGLang's own
``load_plugins`` (once without the variable: nothing of ``lp`` is hooked), builds SGLang's
placement metadata with its own ``ExpertLocationMetadata.init_by_mapping`` and runs each batch of
tests.helpers.sglang_lp_ranks rank by rank in this process (tests.helpers.sglang_lp_ranks.
OneProcessGroup as the EP group), as SGLang's layers do: ``init_lplb_solvers`` (the hooked one),
``ExpertLocationDispatchInfo.init_new(layer)``, the layer's solver from SGLang's own registry
(``get_global_lplb_solver``), ``solve(ids)`` and ``topk_ids_logical_to_physical(ids, info, prob)``
(SGLang's CUDA branch), ``topk_ids_logical_to_physical(ids, info)`` (its ROCm branch, no solve
first), ``solve(empty)`` on an idle rank (``TopK.empty_topk_output``). It also builds SGLang's own
``LPLBSolver`` per layer (its JIT warm-up skipped) for its LP matrices, which the test solves with
HiGHS, and a rebalance (``ExpertLocationMetadata.update``, then ``init_lplb_solvers`` again).
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

import numpy as np

from tests.helpers import sglang_lp_ranks as lp_ranks


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run() -> dict[str, Any]:
    """Every batch through SGLang's objects and eplb's hooks; SGLang's LP matrices; a rebalance."""
    import torch

    from tests.helpers import sglang_stubs as stubs

    parallel = types.SimpleNamespace(moe_ep_rank=0, moe_ep_group=None, ep_size=1, nnodes=1, tp_size=1,
                                     elastic_ep_initial_size=None, ep_join_rank_offset=0)  # fmt: skip
    moe = stubs.moe_settings(ep_dispatch_algorithm="lp", ep_num_redundant_experts=0, ep_join_mode="none")
    stubs.configure_dispatch(moe)
    setup = stubs.stub_moe_ep_setup()
    sglang_init = setup.init_lplb_solvers
    lines = _Lines()
    logging.getLogger("eplb").addHandler(lines)
    logging.getLogger("eplb").setLevel(logging.INFO)

    import sglang.kernels.ops.lplb.torch_solver as ipm
    import sglang.srt.eplb.expert_location_dispatch as dispatch
    import sglang.srt.plugins as plugins
    from sglang.srt.eplb.lplb_solver import LPLBSolver, get_global_lplb_solver

    sglang_map = dispatch.topk_ids_logical_to_physical
    lp_asked = os.environ.pop("EPLB_SGLANG_LP")
    plugins.load_plugins()
    out: dict[str, Any] = {
        "off_init_unchanged": setup.init_lplb_solvers is sglang_init,
        "off_map_unchanged": dispatch.topk_ids_logical_to_physical is sglang_map,
    }
    os.environ["EPLB_SGLANG_LP"] = lp_asked
    plugins._plugins_loaded = False
    plugins.load_plugins()
    out["init_replaced"] = setup.init_lplb_solvers is not sglang_init
    out["map_wrapped"] = getattr(dispatch.topk_ids_logical_to_physical, "__wrapped__", None) is sglang_map
    ipm.warmup = lambda *args, **kwargs: None  # SGLang's solver JIT-compiles here; only its matrices are read

    results: list[dict[str, Any]] = []
    for batch in lp_ranks.BATCHES:
        pl = lp_ranks.placement(batch.shape)
        metadata = _install(stubs, moe, parallel, pl)
        ids_by_rank = batch.ids()
        local_GLE = np.stack([[lp_ranks.local_counts(r[layer], pl.num_logical) for layer in range(lp_ranks.L)]
                              for r in ids_by_rank])  # fmt: skip
        groups = [lp_ranks.OneProcessGroup(r, local_GLE[:, 0]) for r in range(pl.num_gpus)]
        phys: list[list[Any]] = []
        for rank, ids_LTK in enumerate(ids_by_rank):
            parallel.moe_ep_rank, parallel.moe_ep_group = rank, groups[rank]
            setup.init_lplb_solvers(model_config=None)
            phys.append([])
            for layer in range(lp_ranks.L):
                groups[rank].local_GE = local_GLE[:, layer]
                solver = get_global_lplb_solver(layer)
                ids = torch.from_numpy(ids_LTK[layer])
                if ids.shape[0] == 0:  # an idle rank: TopK.empty_topk_output's solve, nothing to map
                    solver.solve(ids)
                    phys[rank].append([])
                    continue
                info = dispatch.ExpertLocationDispatchInfo.init_new(layer)
                prob = solver.solve(ids)
                cuda = dispatch.topk_ids_logical_to_physical(ids, info, prob)
                rocm = dispatch.topk_ids_logical_to_physical(ids, info)
                assert cuda is prob.phys_TK and torch.equal(cuda, rocm) and cuda.dtype == ids.dtype
                phys[rank].append(cuda.tolist())
        results.append({"phys": phys, "exchanges": [g.calls for g in groups]})
    out["batches"] = results

    out["sglang_lp"] = []
    for shape in range(len(lp_ranks.SHAPES)):
        metadata = _install(stubs, moe, parallel, lp_ranks.placement(shape))
        layers = []
        for layer in range(lp_ranks.L):
            solver = LPLBSolver(
                phy2log=metadata.physical_to_logical_map[layer],
                log2phy=metadata.logical_to_all_physical_map[layer],
                num_gpus=metadata.ep_size,
                ep_group=None,
                logical_to_all_physical_map_num_valid=metadata.logical_to_all_physical_map_num_valid[layer],
            )
            layers.append({name: getattr(solver, name).tolist()
                           for name in ("A_base", "c_vec", "log_single", "log_replicated", "B1")})  # fmt: skip
        out["sglang_lp"].append(layers)

    out["rebalance"] = _rebalance(stubs, moe, parallel, setup)
    out["log"] = [line for line in lines.lines if "dispatch-algorithm lp" in line]
    return out


def _install(stubs: Any, moe: Any, parallel: Any, pl: Any) -> Any:
    """SGLang's metadata of ``pl`` (its own ``init_by_mapping``), installed as the global one."""
    import torch
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata, set_global_expert_location_metadata

    moe.ep_num_redundant_experts = pl.num_physical - pl.num_logical
    parallel.ep_size = parallel.tp_size = pl.num_gpus
    stubs.configure_location(moe, parallel, pl.num_layers, pl.num_logical)
    metadata = ExpertLocationMetadata.init_by_mapping(
        None, torch.from_numpy(pl.phy2log_LP.astype(np.int64)), moe_ep_rank=0
    )
    set_global_expert_location_metadata(metadata, allow_overwrite=True)  # a new model per shape
    return metadata


def _rebalance(stubs: Any, moe: Any, parallel: Any, setup: Any) -> dict[str, Any]:
    """Rank 0 alone (one GPU): a placement, then SGLang's in-place update to another, then
    ``init_lplb_solvers`` again, as SGLang's EPLB manager does after each chunk."""
    import torch
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata
    from sglang.srt.eplb.lplb_solver import get_global_lplb_solver

    from eplb.integrations import sglang_lp
    from eplb.placement.model import Placement
    from tests.helpers.placements import random_phy2log

    rng = np.random.default_rng(3)
    E, P = 12, 20
    first, second = (Placement.from_phy2log(random_phy2log(rng, 2, E, P), num_gpus=1) for _ in range(2))
    metadata = _install(stubs, moe, parallel, first)
    parallel.moe_ep_rank, parallel.moe_ep_group = 0, None
    setup.init_lplb_solvers(model_config=None)
    serving = sglang_lp.serving()
    assert serving is not None
    addresses = serving.tables.static_LE.data_ptr(), serving.tables.lp_slot_LXD.data_ptr()
    ids = torch.from_numpy(np.random.default_rng(4).integers(-1, E, size=(300, 4)).astype(np.int32))
    before = [get_global_lplb_solver(layer).solve(ids).phys_TK.tolist() for layer in range(2)]
    new = ExpertLocationMetadata.init_by_mapping(
        None, torch.from_numpy(second.phy2log_LP.astype(np.int64)), 0
    )
    metadata.update(new, update_layer_ids=[0, 1])
    setup.init_lplb_solvers(model_config=None)
    after_serving = sglang_lp.serving()
    assert after_serving is not None
    after = [get_global_lplb_solver(layer).solve(ids).phys_TK.tolist() for layer in range(2)]
    return {
        "same_tables": after_serving is serving
        and (serving.tables.static_LE.data_ptr(), serving.tables.lp_slot_LXD.data_ptr()) == addresses,
        "ids": ids.tolist(),
        "before": before,
        "after": after,
        "first": first.phy2log_LP.tolist(),
        "second": second.phy2log_LP.tolist(),
    }


__all__ = ["run"]
