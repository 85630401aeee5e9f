"""``eplb simulate --rank-failure``: lost ranks in the replay, against plain numpy, and SGLang's real planner.

SGLang 0.5.23's ``elasticity_aware.py`` comes from benchmarks.peers (fetched from PyPI at test time,
never committed), loaded by eplb.simulate.sglang_peer as the command loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eplb.cli import main
from eplb.placement.model import Placement
from eplb.simulate import RunSpec, SimulationConfig
from eplb.simulate.failure import parse_rank_failures, simulate_rank_failures
from eplb.simulate.failure_results import RankFailure
from eplb.simulate.sglang_peer import ElasticPlanner
from eplb.traces import Trace
from tests.helpers.simulation import server

TINY = ["simulate", "--preset", "tiny", "--ep-size", "4", "--nnodes", "2", "--disable-tqdm", "--steps", "80"]
TINY_OK = [*TINY, "--ep-num-redundant-experts", "8", "--eplb-rebalance-num-iterations", "20"]


@pytest.fixture(scope="module")
def peer() -> Any:
    from benchmarks.peers import load_sglang_elasticity_aware

    return load_sglang_elasticity_aware()


def _trace(seed: int, F: int = 60, L: int = 2, E: int = 8) -> Trace:
    rng = np.random.default_rng(seed)
    hot = rng.gamma(0.6, 1.0, (L, E))
    counts = rng.poisson(hot[None] * 50.0, (F, L, E)).astype(np.int32)
    tokens = counts.sum(axis=(1, 2)).astype(np.int64)
    return Trace(counts_FLE=counts, is_prefill_F=np.ones(F, dtype=bool), num_tokens_F=tokens)


def _config(
    G: int = 4, N: int = 2, R: int = 4, interval: int = 20, dispatch: str = "dynamic"
) -> SimulationConfig:
    flags = server(
        ep_size=G,
        nnodes=N,
        ep_num_redundant_experts=R,
        num_experts=8,
        eplb_rebalance_num_iterations=interval,
        ep_dispatch_algorithm=dispatch,
    )
    return SimulationConfig(eplb=flags, bytes_per_expert=100)


def test_parse_rank_failures() -> None:
    got = parse_rank_failures(["30:1", "10:2-3", "30:0"], 100, 8)
    assert got == [RankFailure(10, (2, 3)), RankFailure(30, (0, 1))]
    for bad, match in [
        ("abc", "STEP:RANK"),
        ("10", "STEP:RANK"),
        ("10:x", "STEP:RANK"),
        ("10:3-x", "STEP:RANK"),
        ("0:1", "not in 1..99"),
        ("100:1", "not in 1..99"),
        ("10:8", r"0\.\.7"),
        ("10:-1", "STEP:RANK"),
        ("10:3-2", r"0\.\.7"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_rank_failures([bad], 100, 8)
    with pytest.raises(ValueError, match="lost twice"):
        parse_rank_failures(["10:1", "20:0-1"], 100, 8)
    with pytest.raises(ValueError, match="every rank is lost"):
        parse_rank_failures(["10:0-3", "20:4-7"], 100, 8)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--rank-failure", "x"], "STEP:RANK"),
        (["--rank-failure", "40:9"], "ranks must lie in 0..3"),
        (["--rank-failure", "500:1"], "not in 1..79"),
        (["--rank-failure", "40:1", "--rank-failure", "50:1"], "lost twice"),
        (["--rank-failure", "40:0-1"], "fewer than the 16 logical experts"),
        (["--rank-failure", "40:1", "--algorithms", "scipy:fake"], "fake dispatch"),
        (["--rank-failure", "40:1", "--sglang-peer", "/nonexistent"], "no SGLang EPLB file"),
        (["--sglang-peer", "/nonexistent"], "needs --rank-failure"),
    ],
)
def test_cli_errors_exit_2_with_one_line(
    extra: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*TINY_OK, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match.replace("\\", "") in err.replace("\\", ""), err


def test_cli_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from benchmarks.peers import fetch_sglang

    out = tmp_path / "r.json"
    args = [*TINY_OK, "--rank-failure", "45:2", "--algorithms", "none", "scipy", "--json", str(out)]
    assert main([*args, "--sglang-peer", str(fetch_sglang())]) == 0
    table = capsys.readouterr().out
    assert "sglang_elasticity_aware:static" in table and "45:2" in table
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["losses"]}
    assert set(rows) == {"none:static", "scipy:static", "sglang_elasticity_aware:static"}
    assert rows["none:static"]["tokens_lost_fraction"] > 0 and rows["none:static"]["bytes_reloaded"] == 0
    for name in ("scipy:static", "sglang_elasticity_aware:static"):
        assert rows[name]["tokens_lost_fraction"] == 0 and rows[name]["live_ranks"] == 3


def test_the_replay_against_numpy() -> None:
    """After the loss (past the last rebalance), every step's balancedness is that of the run's
    placement over the three live GPUs, computed here by hand; no replanning loses what its
    placement's dead slots held."""
    trace = _trace(0)
    config = _config(interval=20)  # rebalances at 20 and 40; the loss at 45
    runs = [RunSpec("scipy", "dynamic"), RunSpec("none", "dynamic")]
    result = simulate_rank_failures(trace, runs, config, [RankFailure(45, (1,))])
    by = {r.name: r for r in result.runs}
    load_FLE = trace.counts_FLE.astype(np.float64)
    eplb = by["scipy:dynamic"].result.final_placement
    assert eplb is not None and eplb.num_gpus == 3
    cnt = eplb.logcnt_LE
    gpu = np.zeros((60, 2, 3))
    for slot, expert_L in enumerate(eplb.phy2log_LP.T):
        for layer, expert in enumerate(expert_L):
            gpu[:, layer, slot // eplb.slots_per_gpu] += load_FLE[:, layer, expert] / cnt[layer, expert]
    want = (gpu.mean(axis=2) / gpu.max(axis=2)).mean(axis=1)
    np.testing.assert_allclose(by["scipy:dynamic"].result.balancedness_F[45:], want[45:], rtol=1e-5)
    frozen = by["none:dynamic"].result.final_placement
    assert frozen is not None and frozen.num_gpus == 4  # the old placement, dead rank included
    S, live = frozen.slots_per_gpu, [0, 2, 3]
    gpu = np.zeros((60, 2, 4))
    for slot, expert_L in enumerate(frozen.phy2log_LP.T):
        for layer, expert in enumerate(expert_L):
            gpu[:, layer, slot // S] += load_FLE[:, layer, expert] / frozen.logcnt_LE[layer, expert]
    kept = gpu[:, :, live]
    want = (kept.mean(axis=2) / kept.max(axis=2)).mean(axis=1)
    np.testing.assert_allclose(by["none:dynamic"].result.balancedness_F[45:], want[45:], rtol=1e-5)
    lost = gpu[45:, :, 1].sum() / load_FLE[45:].sum()
    (row,) = [r for r in result.summaries() if r["name"] == "none:dynamic"]
    assert row["tokens_lost_fraction"] == pytest.approx(lost, rel=1e-5)
    (loss,) = by["scipy:dynamic"].losses
    assert loss.live_ranks == 3 and loss.bytes_reloaded == loss.reloads * 100


def test_two_losses_and_determinism() -> None:
    trace = _trace(1, F=80)
    config = _config(G=4, N=2, R=8, interval=20)  # 16 slots: two live ranks hold 8, enough
    failures = [RankFailure(30, (0,)), RankFailure(50, (3,))]
    runs = [RunSpec("scipy", "dynamic"), RunSpec("none", "dynamic")]
    first = simulate_rank_failures(trace, runs, config, failures)
    again = simulate_rank_failures(trace, runs, config, failures)
    assert first.summaries() == [
        {**r, "solve_seconds": a["solve_seconds"]}
        for r, a in zip(again.summaries(), first.summaries(), strict=True)
    ]
    by = {r.name: r for r in first.runs}
    final = by["scipy:dynamic"].result.final_placement
    assert final is not None and final.num_gpus == 2
    assert [e.live_ranks for e in by["scipy:dynamic"].losses] == [3, 2]
    assert set(final.phy2log_LP.ravel().tolist()) == set(range(8))
    # The rebalance at step 60, after both losses, planned over the two survivors.
    assert any(e.step == 60 for e in by["scipy:dynamic"].result.events)


def test_elastic_planner_is_sglangs_plan_over_the_live_ranks(peer: Any) -> None:
    rng = np.random.default_rng(4)
    G, N, S, E, L = 4, 2, 3, 8, 2
    window = rng.poisson(rng.gamma(0.6, 10.0, (L, E))[None], (5, L, E)).astype(np.float64)
    alive = np.array([True, False, True, True])
    planner = ElasticPlanner(peer, G, N, 1, alive)
    current = Placement.trivial(L, E, 3, 3 * S - E, 1)
    proposal = planner(window, current)
    weight = torch.from_numpy(window.sum(axis=0))
    phy2log, log2phy, logcnt = peer(weight, G * S, 1, N, G, False, torch.tensor([1, 0, 1, 1]))
    full = phy2log.numpy()
    np.testing.assert_array_equal(proposal.placement.phy2log_LP, full[:, [0, 1, 2, 6, 7, 8, 9, 10, 11]])
    np.testing.assert_array_equal(proposal.placement.logcnt_LE, logcnt.numpy())
    # SGLang fills the dead rank's slots with expert 0 and leaves them out of log2phy.
    assert (full[:, 3:6] == 0).all()
    assert not np.isin(log2phy.numpy(), [3, 4, 5]).any()


def test_sglang_run_in_the_replay(peer: Any) -> None:
    trace = _trace(2)
    config = _config(interval=20)
    result = simulate_rank_failures(
        trace, [RunSpec("scipy", "dynamic")], config, [RankFailure(30, (2,))], sglang=peer
    )
    names = [r.name for r in result.runs]
    assert names == ["scipy:dynamic", "sglang_elasticity_aware:dynamic"]
    sglang = result.runs[1]
    (loss,) = sglang.losses
    assert loss.live_ranks == 3 and sglang.result.final_placement is not None
    assert sglang.result.final_placement.num_gpus == 3
    # Its last plan (at step 40, over the survivors) is SGLang's on the 20 steps before it.
    weight = torch.from_numpy(trace.counts_FLE[20:40].sum(axis=0).astype(np.float64))
    phy2log, _, _ = peer(weight, 12, 1, 2, 4, False, torch.tensor([1, 1, 0, 1]))
    live = [0, 1, 2, 3, 4, 5, 9, 10, 11]
    np.testing.assert_array_equal(sglang.result.final_placement.phy2log_LP, phy2log.numpy()[:, live])
    assert loss.reload_experts == loss.reloads and loss.bytes_moved == loss.survivor_copies * 100
