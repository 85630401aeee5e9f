"""SGLang 0.5.23's own recorder and ``EPLBManager`` cadence: which row of the window its rebalance
hands the planner holds which pass, and what eplb.integrations.sglang.sglang_time_order makes of it.

Runs in a subprocess with SGLang importable (tests.helpers.engines). SGLang's recorder
(``_ExpertDistributionRecorderReal`` in stat mode, its ``_CircularBuffer``), its manager's
generator (``EPLBManager.on_forward_pass_end``) and its ``rebalance`` up to the plan are SGLang's
code, on one Gloo rank; its config getters are stand-ins (tests.helpers.sglang_stubs), and its first
dump's device-cache flush is skipped (torch.cpu has none). Pass n
routes n + 1 tokens of layer 0 to expert 0, so a row's count names its pass.

``python -m tests.helpers.sglang_order_checks BUFFER INTERVAL REBALANCES OUT.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import torch

L, E, G = 2, 4, 1


def run(buffer: int, interval: int, rebalances: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tests.helpers.sglang_stubs import configure_recorder, moe_settings, stub_moe_ep_setup

    with tempfile.NamedTemporaryFile() as init:
        dist.init_process_group("gloo", init_method=f"file://{init.name}", rank=0, world_size=1)
    moe = moe_settings(
        moe_a2a_backend="none", expert_distribution_recorder_buffer_size=buffer,
        eplb_rebalance_num_iterations=interval, eplb_rebalance_layers_per_chunk=None,
    )  # fmt: skip
    ed = configure_recorder(moe)
    stub_moe_ep_setup()
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata, set_global_expert_location_metadata

    phy2log = torch.arange(E, dtype=torch.int64).expand(L, E).contiguous()
    log2phy = torch.full((L, E, E), -1, dtype=torch.int64)  # [L, E, P]: expert e in slot e
    log2phy[:, torch.arange(E), 0] = torch.arange(E)
    metadata = ExpertLocationMetadata(
        physical_to_logical_map=phy2log, physical_to_logical_map_cpu=phy2log, logical_to_all_physical_map=log2phy,
        logical_to_all_physical_map_cpu=log2phy, logical_to_all_physical_map_num_valid=torch.ones(L, E, dtype=torch.int64),
        ep_size=G, logical_to_rank_dispatch_physical_map=None,
    )  # fmt: skip
    set_global_expert_location_metadata(metadata)
    recorder = ed._ExpertDistributionRecorderReal(metadata, rank=0)
    recorder._accumulator._first_dump = False  # its first dump empties the device cache: torch.cpu has none
    ed.set_global_expert_distribution_recorder(recorder)
    import sglang.srt.eplb.eplb_manager as mgr

    mgr.get_exec = lambda: types.SimpleNamespace(moe=moe)
    mgr.get_parallel = lambda: types.SimpleNamespace(tp_rank=0, nnodes=1)
    from eplb.integrations.sglang import sglang_time_order

    manager = mgr.EPLBManager(
        model_config=None, get_model=lambda: None, get_expert_location_updater=lambda: None,
        get_expert_backup_client=lambda: None, get_weight_updater=lambda: None,
    )  # fmt: skip
    windows: list[dict[str, list[int]]] = []

    def plan(logical_count: torch.Tensor, *, broadcast_over_world: bool) -> None:
        # What SGLang's init_by_eplb hands rebalance_experts, and eplb's order of it.
        windows.append({
            "sglang": logical_count[:, 0, 0].tolist(),
            "eplb": sglang_time_order(logical_count)[:, 0, 0].tolist(),
        })  # fmt: skip

    manager._compute_expert_location_metadata = plan  # the plan stops here: no weights to move
    manager._compute_update_layer_ids_chunks = lambda: []
    n = 0
    while len(windows) < rebalances:
        with recorder.with_forward_pass(n, types.SimpleNamespace(forward_mode=None)):
            for layer in range(L):
                ids = torch.zeros((n + 1 if layer == 0 else 1, 1), dtype=torch.int64)
                with recorder.with_current_layer(layer):
                    recorder.on_select_experts(topk_ids=ids)
        manager.on_forward_pass_end()  # as SGLang's model runner calls it after each pass
        n += 1
    dist.destroy_process_group()
    return {"windows": windows}


def main(argv: list[str]) -> int:
    buffer, interval, rebalances, out = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    out.write_text(json.dumps(run(buffer, interval, rebalances)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
