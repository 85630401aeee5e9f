"""An engine's own swap in the simulator: SGLang's synchronous chunks stall, vLLM's layers overlap.

Shape legend: F steps, L layers, E logical experts, P physical slots, G GPUs.

The stall and overlap are checked against hand computations on a four-layer, four-GPU case (bytes
per GPU over the link rate, chunk by chunk) and the per-chunk link time against a brute force
over the slot maps on random placements.
"""

from __future__ import annotations

import numpy as np
import pytest

from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.policy import LoadHistory, Proposal
from eplb.policy.decision import VLLM_IN_FLIGHT
from eplb.simulate import CostModel, RunResult, RunSpec, SimulationConfig, simulate
from eplb.traces import Trace
from tests.helpers.simulation import server

GB = 1_000_000_000

# Four layers, four GPUs (one slot each) on two nodes (GPUs 0-1, 2-3), all starting trivial.
# Layer 0 swaps GPUs 0 and 2 (cross-node), layer 1 GPUs 1 and 3 (cross-node), layer 2 GPUs 0 and 1
# (NVLink), layer 3 keeps its experts.
TARGET_LP = np.array([[2, 1, 0, 3], [0, 3, 2, 1], [1, 0, 2, 3], [0, 1, 2, 3]])
# One expert is 1 GB; NVLink 10 GB/s (0.1 s an expert), the network 5 GB/s (0.2 s an expert).
LAYER_SECONDS = [0.2, 0.2, 0.1, 0.0]
"""By hand: each changed layer's two GPUs receive one expert each, over the network or NVLink."""


def _cost(nvlink_gbps: float = 10.0, internode_gbps: float = 5.0) -> CostModel:
    # Each layer takes 10 ms whatever its load: a pass is 40 ms; a swap beside it doubles it.
    return CostModel(
        base_us=10_000.0,
        per_expert_us=0.0,
        per_token_us=0.0,
        nvlink_gbps=nvlink_gbps,
        internode_gbps=internode_gbps,
        interference=1.0,
    )


def _target() -> Placement:
    return Placement.from_phy2log(TARGET_LP, num_gpus=4, num_nodes=2)


def test_chunk_link_seconds_are_each_chunks_busiest_gpu_by_hand() -> None:
    diff = diff_placements(Placement.trivial(4, 4, num_gpus=4, num_nodes=2), _target(), GB)
    cost = _cost()
    np.testing.assert_allclose(cost.chunk_transfer_seconds(diff, 1), LAYER_SECONDS)
    # Layers 0-1: every GPU receives one expert over the network (0.2 s); layers 2-3: GPUs 0, 1 by NVLink.
    np.testing.assert_allclose(cost.chunk_transfer_seconds(diff, 2), [0.2, 0.1])
    # Layers 0-2: GPUs 0 and 1 receive 0.2 + 0.1 s, GPUs 2 and 3 0.2 s.
    np.testing.assert_allclose(cost.chunk_transfer_seconds(diff, 3), [0.3, 0.0])
    np.testing.assert_allclose(cost.chunk_transfer_seconds(diff, None), [0.3])
    assert cost.chunk_transfer_seconds(diff, None)[0] == cost.transfer_seconds(diff)
    # A 4 GB/s pace caps both links: 0.25 s an expert.
    np.testing.assert_allclose(cost.chunk_transfer_seconds(diff, 1, gbps=4.0), [0.25, 0.25, 0.25, 0.0])
    with pytest.raises(ValueError, match="layers-per-chunk"):
        cost.chunk_transfer_seconds(diff, 0)


def _brute_force_chunks(old_LP: np.ndarray, new_LP: np.ndarray, chunk: int, G: int, N: int) -> list[float]:
    """Per chunk, the busiest GPU's seconds (1 GB experts, NVLink 10 GB/s, network 5 GB/s), by loops."""
    L, P = old_LP.shape
    per_gpu, per_node = P // G, G // N
    out = []
    for first in range(0, L, chunk):
        seconds = [0.0] * G
        for layer in range(first, min(first + chunk, L)):
            for g in range(G):
                old_here = set(old_LP[layer, g * per_gpu : (g + 1) * per_gpu].tolist())
                node = g // per_node
                old_node = set(
                    old_LP[layer, node * per_node * per_gpu : (node + 1) * per_node * per_gpu].tolist()
                )
                for e in set(new_LP[layer, g * per_gpu : (g + 1) * per_gpu].tolist()) - old_here:
                    seconds[g] += 0.1 if e in old_node else 0.2
        out.append(max(seconds))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_chunk_link_seconds_match_a_brute_force_on_random_placements(seed: int) -> None:
    rng = np.random.default_rng(seed)
    L, E, G, N = int(rng.integers(1, 9)), 12, 8, 2
    P = E + 4

    def random_LP() -> np.ndarray:
        # Every expert once, plus four random replicas, shuffled over the slots.
        rows = [rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, P - E)])) for _ in range(L)]
        return np.stack(rows)

    old_LP, new_LP = random_LP(), random_LP()
    old = Placement.from_phy2log(old_LP, num_gpus=G, num_nodes=N, max_replicas=P)
    new = Placement.from_phy2log(new_LP, num_gpus=G, num_nodes=N, max_replicas=P)
    diff = diff_placements(old, new, GB)
    for chunk in (1, 2, 3, L):
        got = _cost().chunk_transfer_seconds(diff, chunk)
        np.testing.assert_allclose(got, _brute_force_chunks(old_LP, new_LP, chunk, G, N), atol=1e-12)


class _MoveOnce:
    """Proposes the target placement until it serves."""

    def __call__(
        self, window_WLE: np.ndarray, current: Placement, history: LoadHistory | None = None
    ) -> Proposal:
        target = _target()
        if current.same_slots(target):
            return Proposal(current, apply=False, reason="converged")
        return Proposal(target)


def _run(
    engine_swap: str, *, interval: int = 10, layers_per_chunk: int | None = None, **cost: float
) -> RunResult:
    load_LE = np.array([[40, 1, 30, 2], [3, 50, 4, 20], [9, 8, 7, 6], [5, 5, 5, 5]], dtype=np.int32)
    trace = Trace.from_counts(np.broadcast_to(load_LE, (60, 4, 4)).copy())
    flags = server(
        ep_size=4,
        nnodes=2,
        eplb_rebalance_num_iterations=interval,
        eplb_rebalance_layers_per_chunk=layers_per_chunk,
    )
    config = SimulationConfig(eplb=flags, bytes_per_expert=GB, cost=_cost(**cost), engine_swap=engine_swap)
    result = simulate(trace, [RunSpec("once", "static")], config, planners={"once:static": _MoveOnce()})
    return result.runs[0]


@pytest.mark.parametrize(
    ("layers_per_chunk", "stall", "longest"),
    [(None, 0.3, 0.3), (1, 0.5, 0.2), (2, 0.3, 0.2), (3, 0.3, 0.3)],
)
def test_sglang_swap_stalls_serving_for_every_chunk(
    layers_per_chunk: int | None, stall: float, longest: float
) -> None:
    event = _run("sglang", layers_per_chunk=layers_per_chunk).events[0]
    assert event.applied and event.step == event.switch_step == 10
    # Serving waits for each chunk's busiest GPU: the hand sums of LAYER_SECONDS per chunk.
    assert event.stall_seconds == pytest.approx(stall)
    assert event.transfer_seconds == pytest.approx(stall)
    assert event.longest_stall_seconds == pytest.approx(longest)
    assert event.interference_seconds == 0.0


def test_sglang_swap_of_all_layers_at_once_is_eplbs_periodic_stall() -> None:
    sglang, eplb = _run("sglang").events[0], _run("eplb").events[0]
    assert sglang.stall_seconds == eplb.stall_seconds == pytest.approx(0.3)
    assert sglang.longest_stall_seconds == eplb.longest_stall_seconds


def test_vllm_swap_overlaps_the_passes_layer_by_layer() -> None:
    run = _run("vllm")
    event = run.events[0]
    # One layer after the other: 0.2 + 0.2 + 0.1 s of link time, no stall. Passes of 40 ms run
    # twice as long beside it (interference 1.0): 80 ms each, so it arrives in the 7th pass
    # (0.5 / 0.08 = 6.25) and the passes lose half of its link time.
    assert event.applied and event.step == 10
    assert event.transfer_seconds == pytest.approx(0.5)
    assert event.stall_seconds == 0.0
    assert event.switch_step == 17
    assert event.interference_seconds == pytest.approx(0.25)
    assert run.final_placement is not None and run.final_placement.same_slots(_target())


def test_vllm_swap_takes_at_least_one_pass_per_layer() -> None:
    # A link 100 times faster: 5 ms of link time arrives in the first pass, but vLLM's worker
    # hands over one layer per pass: the fourth layer is in after four passes.
    event = _run("vllm", nvlink_gbps=1000.0, internode_gbps=500.0).events[0]
    assert event.transfer_seconds == pytest.approx(0.005)
    assert event.switch_step == 14
    assert event.stall_seconds == 0.0
    assert event.interference_seconds == pytest.approx(0.0025)


def test_vllm_skips_a_rebalance_due_while_its_swap_is_in_flight() -> None:
    # Every 5 passes: the swap planned at step 5 needs 7 passes, so the rebalance at 10 is skipped
    # (where eplb's own continuous swap would stall serving for the rest of its link time).
    events = _run("vllm", interval=5).events
    assert events[0].applied and events[0].step == 5 and events[0].switch_step == 12
    assert events[1].step == 10 and not events[1].applied and events[1].reason == VLLM_IN_FLIGHT
    assert all(e.stall_seconds == 0.0 for e in events)
    assert all(not e.applied for e in events[1:])


def test_an_unknown_engine_swap_is_refused() -> None:
    with pytest.raises(ValueError, match="engine_swap"):
        SimulationConfig(eplb=server(ep_size=4), engine_swap="trtllm")
