"""Write small SGLang expert-distribution dumps from a seeded synthetic workload.

Shape legend: W window passes, L layers, E logical experts, P physical slots.

The README and docs examples read these files, so a reader without an SGLang server can run
every command as written. They have SGLang 0.5.23's layouts (what its
``/dump_expert_distribution_record`` endpoint writes with ``torch.save``), built from eplb's
``tiny`` preset (4 MoE layers x 16 experts, top-4, seed 0):

- ``sglang_stat_dump.pt`` (``--expert-distribution-recorder-mode stat``): ``{"rank": 0,
  "logical_count": int32 [W, L, E] summed over ranks, "average_utilization_rate_over_window":
  None}``. Like SGLang's ring buffer, the rows are in storage order: the recorder ran past its
  window, so the newest passes overwrote the oldest and the rows are not in time order.
- ``sglang_per_pass_rank{0,1}.pt`` (``per_pass``, two EP ranks): ``{"records": [{"forward_pass_id",
  "rank", "gatherer_key", "global_physical_count": int32 [L, P]}], "last_physical_to_logical_map":
  int64 [L, P]}``, each rank's share of the tokens of each pass, on SGLang's trivial placement
  with 4 redundant slots (slot p holds expert p mod E).

Run ``python examples/make_sample_dump.py`` (optionally ``--out DIR``); the same seed always gives
the same counts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from eplb.workloads import WorkloadConfig, generate

PRESET = "tiny"
SEED = 0
STAT_WINDOW = 40
"""W of the stat dump (SGLang's --expert-distribution-recorder-buffer-size)."""
STAT_PASSES = 52
"""Passes the stat recorder saw: more than its window, so the ring buffer wrapped."""
PER_PASS_PASSES = 12
"""Passes in the per_pass dumps."""
NUM_RANKS = 2
NUM_REDUNDANT = 4


def stat_dump(counts_FLE: np.ndarray, window: int) -> dict[str, object]:
    """SGLang's stat layout: the last ``window`` passes as its ring buffer holds them."""
    ring_WLE = np.zeros((window, *counts_FLE.shape[1:]), dtype=np.int32)
    for t, counts_LE in enumerate(counts_FLE):
        ring_WLE[t % window] = counts_LE  # pass t lands in slot t mod W, overwriting pass t - W
    return {
        "rank": 0,
        "logical_count": torch.from_numpy(ring_WLE),
        "average_utilization_rate_over_window": None,  # SGLang: None unless a threshold is set
    }


def per_pass_dumps(counts_FLE: np.ndarray, rng: np.random.Generator) -> list[dict[str, object]]:
    """One per_pass dump per rank: each pass's tokens split over the ranks and the replicas."""
    T, L, E = counts_FLE.shape
    P = E + NUM_REDUNDANT
    phy2log_LP = np.broadcast_to(np.arange(P) % E, (L, P)).copy()
    dumps: list[dict[str, object]] = [{"records": []} for _ in range(NUM_RANKS)]
    for t in range(T):
        # Each slot of an expert gets an even share in expectation; each rank a binomial share.
        phys_LP = np.zeros((L, P), dtype=np.int64)
        for slots in (np.flatnonzero(phy2log_LP[0] == e) for e in range(E)):
            share = np.full(len(slots), 1.0 / len(slots))
            phys_LP[:, slots] = np.stack([rng.multinomial(c, share) for c in counts_FLE[t][:, slots[0]]])
        rest_LP = phys_LP
        for rank in range(NUM_RANKS):
            mine_LP = rest_LP if rank == NUM_RANKS - 1 else rng.binomial(rest_LP, 1.0 / (NUM_RANKS - rank))
            rest_LP = rest_LP - mine_LP
            record = {
                "forward_pass_id": t,
                "rank": rank,
                "gatherer_key": "primary",
                "global_physical_count": torch.from_numpy(mine_LP.astype(np.int32)),
            }
            dumps[rank]["records"].append(record)  # type: ignore[attr-defined]
    for dump in dumps:
        dump["last_physical_to_logical_map"] = torch.from_numpy(phy2log_LP)
    return dumps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="output folder")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    trace = generate(WorkloadConfig(preset=PRESET, num_steps=STAT_PASSES, seed=SEED))
    written = [args.out / "sglang_stat_dump.pt"]
    torch.save(stat_dump(trace.counts_FLE, STAT_WINDOW), str(written[0]))
    rng = np.random.default_rng(SEED)
    for rank, dump in enumerate(per_pass_dumps(trace.counts_FLE[:PER_PASS_PASSES], rng)):
        written.append(args.out / f"sglang_per_pass_rank{rank}.pt")
        torch.save(dump, str(written[-1]))
    for path in written:
        print(f"{path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
