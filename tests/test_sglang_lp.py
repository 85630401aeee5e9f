"""SGLang's ``--ep-dispatch-algorithm lp`` served by eplb's ``lp`` kernels (eplb.integrations.sglang_lp).

Against SGLang 0.5.23's own objects (tests.helpers.sglang_lp_checks, in the engines' subprocess):
its plugin loader and hook registry, its placement metadata, its dispatch info, its solver
registry and map function on both of its branches (CUDA: solve then map; ROCm: map alone), an
idle rank's empty solve, a rebalance. Every rank's ids equal the one-token-at-a-time brute force
of the rule (tests.helpers.remap_reference.brute_lp); the busiest GPU of the realised split is
within 1% of the exact LP optimum on average and 5% on every batch (HiGHS; the same bounds as
tests/test_lp_optimum.py's check of the rule, whose reference it reuses), on random, heavy-tailed,
adversarial counts and with idle ranks, and SGLang's own LP (its ``LPLBSolver``'s matrices, solved
by HiGHS instead of its JIT interior-point kernel) has that same optimum. In this process: the
same ranks without SGLang, real Gloo ranks, the settings, the refusals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from eplb.integrations import sglang_lp
from eplb.integrations.engine_env import SGLANG_LP_ENV, sglang_lp_requested
from eplb.placement.model import Placement
from eplb.remap.lp_rule import lp_quotas, lp_tables
from tests.helpers import sglang_lp_ranks as lp_ranks
from tests.helpers.remap_reference import brute_lp
from tests.helpers.spawn import rendezvous, run_spawned
from tests.test_lp_optimum import _optimum


def _in_process(batch: lp_ranks.Batch, device: str = "cpu") -> tuple[list[list[Any]], list[int]]:
    """Every rank's ids per layer through eplb's SGLang solvers, ranks one after another."""
    pl = lp_ranks.placement(batch.shape)
    ids_by_rank = batch.ids()
    G, E = pl.num_gpus, pl.num_logical
    groups = [lp_ranks.OneProcessGroup(r, np.zeros((G, E))) for r in range(G)]
    servings = [
        sglang_lp.LpServing(pl, r, torch.device(device), sglang_lp.gather_for(groups[r], G, r))
        for r in range(G)
    ]
    phys: list[list[Any]] = [[] for _ in range(G)]
    for layer in range(lp_ranks.L):
        local_GE = np.stack([lp_ranks.local_counts(ids[layer], E) for ids in ids_by_rank])
        for rank in range(G):
            groups[rank].local_GE = local_GE
            ids = torch.from_numpy(ids_by_rank[rank][layer]).to(device)
            phys[rank].append(servings[rank].solvers[layer].solve(ids).phys_TK.cpu().tolist())
    return phys, [g.calls for g in groups]


def _check_against_the_rule(
    batch: lp_ranks.Batch, phys: list[list[Any]], exchanges: list[int], per_layer: list[int]
) -> list[float]:
    """Outputs equal the brute force; ``per_layer[rank]`` exchanges per layer with replicas on
    each rank (none without); the realised GPU loads are the rule's. Returns each layer's excess
    of the busiest GPU over the HiGHS optimum, rounded up."""
    pl = lp_ranks.placement(batch.shape)
    ids_by_rank = batch.ids()
    replicated = int((pl.logcnt_LE.max(axis=1) >= 2).sum())
    assert exchanges == [replicated * n for n in per_layer]
    counts_LE = np.stack([sum(lp_ranks.local_counts(ids[layer], pl.num_logical) for ids in ids_by_rank)
                          for layer in range(lp_ranks.L)])  # fmt: skip
    _, rule_loads_LnG = lp_quotas(counts_LE[:, None], lp_tables(pl))
    excess = []
    for layer in range(lp_ranks.L):
        want = brute_lp([ids[layer].tolist() for ids in ids_by_rank], pl, layer, [None] * pl.num_gpus)
        got = [phys[rank][layer] for rank in range(pl.num_gpus)]
        assert got == want, (batch, layer)
        slots = np.array([s for rows in got for row in rows for s in row], dtype=np.int64)
        loads_G = np.bincount(slots[slots >= 0] // pl.slots_per_gpu, minlength=pl.num_gpus)
        assert np.array_equal(loads_G, rule_loads_LnG[layer, 0])
        floor = np.ceil(_optimum(counts_LE[layer], pl, layer) - 1e-6)
        if floor == 0:
            assert loads_G.max() == 0
            continue
        excess.append(loads_G.max() / floor - 1)
    return excess


def _assert_near_optimum(excess: list[float]) -> None:
    assert min(excess) >= -1e-9  # the LP is a true floor
    assert np.mean(excess) <= 0.01, np.mean(excess)
    assert max(excess) <= 0.05, max(excess)


# ---- through SGLang's own objects ---------------------------------------------------------------


@pytest.fixture(scope="module")
def lp_run(engine_site: Path) -> dict[str, Any]:
    from tests.helpers.engines import run_engine_checks

    return run_engine_checks(engine_site, "sglang_lp", env={SGLANG_LP_ENV: "1"})


def test_nothing_of_lp_is_hooked_until_asked_then_both_hooks_are(lp_run: dict[str, Any]) -> None:
    assert lp_run["off_init_unchanged"] and lp_run["off_map_unchanged"]
    assert lp_run["init_replaced"] and lp_run["map_wrapped"]


def test_one_log_line_says_sglangs_solver_cannot_run_here(lp_run: dict[str, Any]) -> None:
    assert lp_run["log"] == [
        "eplb: --ep-dispatch-algorithm lp runs eplb's lp kernels; SGLang's own LP solver could not run "
        "here: no CUDA device (cpu)"
    ]


def test_sglangs_layers_get_the_rules_split_within_one_percent_of_the_optimum(lp_run: dict[str, Any]) -> None:
    excess = []
    for batch, result in zip(lp_ranks.BATCHES, lp_run["batches"], strict=True):
        G = lp_ranks.SHAPES[batch.shape][2]
        # A rank with tokens exchanges twice per layer (both map branches solve), an idle one once.
        per_layer = [1 if rank in batch.idle_ranks else 2 for rank in range(G)]
        excess += _check_against_the_rule(batch, result["phys"], result["exchanges"], per_layer)
    _assert_near_optimum(excess)


def _sglang_optimum(lp: dict[str, Any], counts_E: np.ndarray) -> float:
    """SGLang's LP for these counts (its ``lp_prep`` kernel's right-hand side, its matrix, its
    objective without the Big-M start column), solved exactly by HiGHS: the busiest GPU's load."""
    total = max(float(counts_E.sum()), 1.0)
    single, replicated = (
        np.asarray(lp["log_single"], dtype=np.int64),
        np.asarray(lp["log_replicated"], dtype=np.int64),
    )
    t1 = counts_E[single] / total
    b = np.concatenate([counts_E[replicated] / total, -(np.asarray(lp["B1"]).reshape(-1, single.size) @ t1)])
    res = linprog(np.asarray(lp["c_vec"])[:-1], A_eq=np.asarray(lp["A_base"]), b_eq=b, bounds=(0, None),
                  method="highs")  # fmt: skip
    assert res.status == 0, res.message
    return float(res.x[-1]) * total


def test_sglangs_own_lp_has_the_optimum_eplb_is_checked_against(lp_run: dict[str, Any]) -> None:
    for batch in lp_ranks.BATCHES:
        pl = lp_ranks.placement(batch.shape)
        ids_by_rank = batch.ids()
        for layer in range(lp_ranks.L):
            counts_E = sum(lp_ranks.local_counts(ids[layer], pl.num_logical) for ids in ids_by_rank)
            ours = _optimum(counts_E, pl, layer)
            theirs = _sglang_optimum(lp_run["sglang_lp"][batch.shape][layer], counts_E.astype(np.float64))
            assert theirs == pytest.approx(ours, rel=1e-6, abs=1e-6), (batch, layer)


def test_a_rebalance_updates_the_tables_in_place_and_the_split_follows(lp_run: dict[str, Any]) -> None:
    got = lp_run["rebalance"]
    assert got["same_tables"]  # addresses kept: a captured CUDA graph stays valid
    for key, name in (("before", "first"), ("after", "second")):
        pl = Placement.from_phy2log(np.asarray(got[name]), num_gpus=1)
        for layer in range(2):
            assert got[key][layer] == brute_lp([got["ids"]], pl, layer, [None])[0]
    assert got["before"] != got["after"]


# ---- in this process, without SGLang ------------------------------------------------------------


@pytest.mark.parametrize("shape", range(len(lp_ranks.SHAPES)))
def test_ranks_one_after_another_split_as_the_rule_says(shape: int) -> None:
    excess = []
    for batch in (b for b in lp_ranks.BATCHES if b.shape == shape):
        phys, exchanges = _in_process(batch)
        excess += _check_against_the_rule(batch, phys, exchanges, [1] * len(phys))
    _assert_near_optimum(excess)


@pytest.mark.gpu
def test_the_triton_kernels_split_as_the_rule_says_on_cuda() -> None:
    for batch in lp_ranks.BATCHES:
        phys, exchanges = _in_process(batch, "cuda")
        _check_against_the_rule(batch, phys, exchanges, [1] * len(phys))


def test_real_gloo_ranks_with_an_idle_one(tmp_path: Path) -> None:
    batch = lp_ranks.Batch(1, "idle", 5)
    world = lp_ranks.SHAPES[1][2]
    run_spawned(lp_ranks.gloo_rank, world, world, rendezvous(tmp_path), str(tmp_path), timeout=240)
    phys = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    pl = lp_ranks.placement(1)
    ids_by_rank = batch.ids()
    for layer in range(lp_ranks.L):
        want = brute_lp([ids[layer].tolist() for ids in ids_by_rank], pl, layer, [None] * world)
        assert [p[layer] for p in phys] == want


def test_the_switch_reads_the_usual_spellings_and_refuses_others_naming_itself() -> None:
    assert not sglang_lp_requested({}) and not sglang_lp_requested({SGLANG_LP_ENV: " off "})
    assert sglang_lp_requested({SGLANG_LP_ENV: "1"}) and sglang_lp_requested({SGLANG_LP_ENV: "Yes"})
    with pytest.raises(ValueError, match=SGLANG_LP_ENV):
        sglang_lp_requested({SGLANG_LP_ENV: "lp"})


def test_a_bad_value_stops_sglang_at_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    from eplb.integrations import sglang

    monkeypatch.setenv(SGLANG_LP_ENV, "maybe")
    with pytest.raises(sglang.SettingsExit, match=SGLANG_LP_ENV):
        sglang.register()  # raised before SGLang (absent here) is imported


def test_placements_and_groups_that_cannot_serve_are_refused() -> None:
    pl = lp_ranks.placement(1)
    maps = torch.from_numpy(pl.phy2log_LP.astype(np.int64))
    metadata = type("Metadata", (), {"physical_to_logical_map": maps, "num_logical_experts": pl.num_logical,
                                     "ep_size": pl.num_gpus})()  # fmt: skip
    assert np.array_equal(sglang_lp.placement_of(metadata).phy2log_LP, pl.phy2log_LP)
    metadata.physical_to_logical_map = maps.clone().index_fill_(1, torch.tensor([0]), -1)  # elastic EP's hole
    with pytest.raises(ValueError, match="-1"):
        sglang_lp.placement_of(metadata)
    group = lp_ranks.OneProcessGroup(1, np.zeros((4, 2)))
    with pytest.raises(ValueError, match="4 ranks"):
        sglang_lp.gather_for(group, 8, 1)
    with pytest.raises(ValueError, match="this rank 2"):
        sglang_lp.gather_for(group, 4, 2)
    with pytest.raises(ValueError, match="1 ranks"):
        sglang_lp.gather_for(None, 4, 0)


def test_math_dx_is_found_where_sglang_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert sglang_lp.sglang_solver_unavailable(torch.device("cpu")) == "no CUDA device (cpu)"
    monkeypatch.setenv("MATHDX_HOME", str(tmp_path))
    assert not sglang_lp._mathdx_found()  # no include folder there, no nvidia package here
    (tmp_path / "include").mkdir()
    assert sglang_lp._mathdx_found()
