"""One "rank" of an engine running eplb's policy with ``EPLB_METRICS_PORT`` set (a subprocess with
vLLM importable, tests.helpers.engines): loads eplb through vLLM's plugin loader, joins a Gloo
group of ``WORLD`` processes, calls vLLM's policy table for ``REBALANCES`` drifting windows, then
keeps the process (and rank 0's exporter) alive without rebalancing until it is ended.

``python -m tests.helpers.engine_metrics_worker RANK WORLD INIT_FILE REBALANCES OUT.json``. It prints
``metrics at URL`` (rank 0) or ``no exporter`` once the first rebalance ran, and writes OUT.json
(what it did, with the window balancedness computed here in plain numpy) after the last one.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.helpers.engine_checks import DRIFT_PASSES, GROUPS, G, L, P, drifting_load, trivial_map


def _balancedness(load_LE: np.ndarray, phy2log_LP: np.ndarray) -> float:
    E = load_LE.shape[1]
    replicas_LE = np.stack([np.bincount(row, minlength=E) for row in phy2log_LP])
    share_LP = np.take_along_axis(load_LE / replicas_LE, phy2log_LP, axis=1)
    gpu_LG = share_LP.reshape(L, G, -1).sum(axis=2)
    return float(np.mean(gpu_LG.mean(axis=1) / gpu_LG.max(axis=1)))


def main() -> int:
    rank, world, init_file, rebalances, out = (
        int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), Path(sys.argv[5])
    )  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import vllm.plugins
    from vllm.distributed.eplb.policy import EPLB_POLICIES

    vllm.plugins.load_general_plugins()
    policy = EPLB_POLICIES["default"]
    live = trivial_map()
    drift = drifting_load(5)
    windows = drift.reshape(-1, DRIFT_PASSES // 4, L, drift.shape[-1])  # 10-pass windows
    events = []
    for i in range(rebalances):
        load_LE = windows[i % len(windows)].sum(axis=0)
        before = _balancedness(load_LE.astype(np.float64), live.numpy())
        new = policy.rebalance_experts(torch.from_numpy(load_LE), P, GROUPS, 1, G, live)
        plan = policy.last_plan
        events.append({"applied": bool(plan.applied), "copies": int(plan.copies), "before": before})
        live = new
        if i == 0:
            exporter = policy.metrics.exporter
            print(f"metrics at {exporter.url}" if exporter is not None else "no exporter", flush=True)
        time.sleep(0.2)
    out.write_text(json.dumps(events))
    print("rebalances done", flush=True)
    while True:  # serve the metrics, rebalance no more: the age since the last rebalance grows
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
