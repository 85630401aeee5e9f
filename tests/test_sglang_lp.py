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

``EPLB_SGLANG_LP=auto`` (tests.helpers.sglang_auto_checks): through SGLang's loader and hook
registry, nothing is hooked unless asked (``ModelRunner.forward`` and the graph runners'
``capture_prepare`` untouched with the variable unset or 1); a small decode pass maps statically
(every rank's ids equal its static map, tests.helpers' reference eplb.placement.dispatch_map, and no
rank exchanges) and a large prefill pass with an idle DP rank by ``lp`` (the brute force of the
rule), every rank taking the same mode from its ``ForwardBatch``; a graph captured at a padded size
holds that size's mode; the window of SGLang's rebalance is what the choice is modeled on. The same
passes run in this process through the hook functions, beside the settings' refusals.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from eplb.config import EplbConfig
from eplb.integrations import sglang, sglang_lp
from eplb.integrations.engine_env import (
    DISPATCH_COST_ENV,
    SGLANG_LP_ENV,
    dispatch_cost_from_env,
    sglang_lp_mode,
    sglang_lp_requested,
)
from eplb.placement.dispatch_map import static_dispatch_map
from eplb.placement.model import Placement
from eplb.policy.auto_dispatch import AutoDispatch, largest_passes
from eplb.policy.cost_model import CostModel
from eplb.remap.lp_rule import lp_quotas, lp_tables
from tests.helpers import sglang_auto_checks as auto_checks
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


def test_the_switch_reads_the_usual_spellings_and_auto_and_refuses_others_naming_itself() -> None:
    assert not sglang_lp_requested({}) and not sglang_lp_requested({SGLANG_LP_ENV: " off "})
    assert sglang_lp_requested({SGLANG_LP_ENV: "1"}) and sglang_lp_requested({SGLANG_LP_ENV: "Yes"})
    assert [sglang_lp_mode({SGLANG_LP_ENV: v}) for v in ("", "0", "on", " Auto ")] == [
        "off",
        "off",
        "lp",
        "auto",
    ]
    assert sglang_lp_requested({SGLANG_LP_ENV: "auto"})
    for bad in ("lp", "2", "automatic"):
        with pytest.raises(ValueError, match=SGLANG_LP_ENV):
            sglang_lp_mode({SGLANG_LP_ENV: bad})


@pytest.mark.parametrize(
    ("var", "value"),
    [
        (SGLANG_LP_ENV, "maybe"),
        (DISPATCH_COST_ENV, "h300"),
        (DISPATCH_COST_ENV, '{"tokens": [1], "static": [0]}'),
    ],
)
def test_a_bad_value_stops_sglang_at_registration(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(SGLANG_LP_ENV, "auto")
    monkeypatch.setenv(var, value)
    with pytest.raises(sglang.SettingsExit, match=var):
        sglang.register()  # raised before SGLang (absent here) is imported


def test_the_cost_table_is_read_by_the_flags_own_parser(tmp_path: Path) -> None:
    table = {"decode": {"tokens": [1, 64], "static": [1.0, 2.0], "lp": [20.0, 30.0]},
             "prefill": {"tokens": [8], "static": [3.0], "lp": [40.0]}}  # fmt: skip
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(table))
    for value in ("h100-sglang", "none", json.dumps(table), str(path)):
        assert (
            dispatch_cost_from_env({DISPATCH_COST_ENV: value})
            == EplbConfig(eplb_dispatch_cost=value).dispatch_cost
        )
    assert dispatch_cost_from_env({}) == EplbConfig().dispatch_cost  # unset: the flag's default
    with pytest.raises(ValueError, match=f"{DISPATCH_COST_ENV}: .*neither a table"):
        dispatch_cost_from_env({DISPATCH_COST_ENV: str(tmp_path / "missing.json")})


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


# ---- EPLB_SGLANG_LP=auto ------------------------------------------------------------------------


def _auto_pass_is_mapped_by_its_mode(one: auto_checks.Pass, result: dict[str, Any], per_layer: int) -> None:
    """Every rank took ``one.want``; its ids equal the static map reference (no exchange) or the
    brute force of the ``lp`` rule (``per_layer`` exchanges per replicated layer on every rank)."""
    pl = lp_ranks.placement(auto_checks.SHAPE)
    G, E = pl.num_gpus, pl.num_logical
    ids_by_rank = one.ids()
    assert result["modes"] == [one.want] * G
    replicated = int((pl.logcnt_LE.max(axis=1) >= 2).sum())
    assert result["exchanges"] == [per_layer * replicated if one.want == "lp" else 0] * G
    for layer in range(lp_ranks.L):
        if one.want == "lp":
            want = brute_lp([ids[layer].tolist() for ids in ids_by_rank], pl, layer, [None] * G)
        else:
            want = []
            for rank, ids in enumerate(ids_by_rank):
                ids_TK = ids[layer]
                valid = (ids_TK >= 0) & (ids_TK < E)
                mapped = static_dispatch_map(pl, rank)[layer][np.clip(ids_TK, 0, E - 1)]
                want.append(np.where(valid, mapped, ids_TK).tolist())
        got = [result["phys"][rank][layer] for rank in range(G)]
        assert got == [w if np.size(w) else [] for w in want], (one.name, layer)


def test_the_passes_take_the_modes_the_model_gives_them() -> None:
    """The model (not the test) picks static for the small decode pass, lp for the large prefill."""
    pl = lp_ranks.placement(auto_checks.SHAPE)
    choice = AutoDispatch.of(pl, auto_checks.window(), top_k=lp_ranks.K, cost=CostModel(),
                             kernels=dispatch_cost_from_env({DISPATCH_COST_ENV: auto_checks.KERNELS}))  # fmt: skip
    for one in auto_checks.PASSES:
        ids = one.ids()
        for rank in range(pl.num_gpus):
            tokens, prefill = sglang_lp.pass_of(auto_checks.forward_batch(ids, rank, one.prefill))
            assert (tokens, prefill) == (sum(x.shape[1] for x in ids), one.prefill)
            assert choice.mode(tokens, prefill) == one.want


def test_a_pass_is_read_from_the_batch_as_every_rank_holds_it() -> None:
    mode = auto_checks.Mode
    # DP sync: the gathered counts and "some rank extends"; an idle DP rank takes its peers' phase.
    idle = type("Batch", (), {"global_num_tokens_cpu": [5, 0, 7], "is_extend_in_batch": True,
                              "forward_mode": mode.IDLE, "input_ids": torch.zeros(0)})()  # fmt: skip
    assert sglang_lp.pass_of(idle) == (12, True)
    # No DP sync: the batch's own rows and mode; a capture batch: its padded counts and mode.
    own = type("Batch", (), {"forward_mode": mode.EXTEND, "input_ids": torch.zeros(9)})()
    assert sglang_lp.pass_of(own) == (9, True)
    assert sglang_lp.pass_of(auto_checks.capture_batch(16, True, 4)) == (64, True)
    assert sglang_lp.pass_of(auto_checks.capture_batch(2, False, 4)) == (8, False)
    embeds = type("Batch", (), {"forward_mode": mode.DECODE, "input_ids": None, "batch_size": 3})()
    assert sglang_lp.pass_of(embeds) == (3, False)


def _metadata(pl: Placement) -> Any:
    """The fields of SGLang's ``ExpertLocationMetadata`` eplb's serving reads."""
    return type("Metadata", (), {
        "physical_to_logical_map": torch.from_numpy(pl.phy2log_LP.astype(np.int64)),
        "num_logical_experts": pl.num_logical, "ep_size": pl.num_gpus,
        "logical_to_all_physical_map": torch.from_numpy(pl.log2phy_LER.astype(np.int64)),
    })()  # fmt: skip


def _auto_settings() -> sglang_lp.AutoSettings:
    kernels = dispatch_cost_from_env({DISPATCH_COST_ENV: auto_checks.KERNELS})
    return sglang_lp.AutoSettings(kernels=kernels, cost=CostModel(), top_k=lp_ranks.K)


@pytest.fixture
def auto_state(monkeypatch: pytest.MonkeyPatch) -> Any:
    """This process as ``EPLB_SGLANG_LP=auto`` leaves it after registration (fresh, then reset)."""
    sglang_lp.reset()
    monkeypatch.setattr(sglang, "_REGISTERED", ["algorithms", "lp", "auto"])
    sglang_lp._STATE["auto_kernels"] = _auto_settings().kernels
    yield
    sglang_lp.reset()


def _rank_layers(
    serving: Any,
    group: Any,
    local_GLE: np.ndarray,
    ids_LTK: np.ndarray,
    result: dict[str, Any],
    _runner: Any,
    batch: Any,
) -> list[Any]:
    """A rank's MoE layers in this process (the model runner's forward body): each layer's solver."""
    result["modes"].append("lp" if serving.pass_lp else "static")
    out = []
    for layer in range(lp_ranks.L):
        group.local_GE = local_GLE[:, layer]
        out.append(serving.solvers[layer].solve(torch.from_numpy(ids_LTK[layer])).phys_TK.tolist())
    return out


def test_auto_in_process_maps_each_pass_by_its_mode_on_every_rank(auto_state: Any) -> None:
    """The hooks' functions in this process: SGLang's rebalance hands over its window, each rank's
    ``init_lplb_solvers`` (here :func:`sglang_lp.serve` and :func:`sglang_lp._start_auto`) and
    forward (:func:`sglang_lp.forward_hook`) run the layers as the subprocess's do."""
    pl = lp_ranks.placement(auto_checks.SHAPE)
    window = torch.from_numpy(auto_checks.window())
    plan = sglang.rebalance_experts_hook(lambda **kw: ("sglang's", kw["tokens_per_expert"]), window,
                                         pl.num_physical, pl.slots_per_gpu, None, 1, "deepseek")  # fmt: skip
    assert plan[0] == "sglang's" and plan[1] is window  # SGLang's algorithm, its own window
    config = type("Config", (), {"hf_config": type("Hf", (), {"num_experts_per_tok": lp_ranks.K})()})()
    for one in auto_checks.PASSES:
        ids_by_rank = one.ids()
        G, E = pl.num_gpus, pl.num_logical
        local_GLE = np.stack([[lp_ranks.local_counts(r[layer], E) for layer in range(lp_ranks.L)]
                              for r in ids_by_rank])  # fmt: skip
        groups = [lp_ranks.OneProcessGroup(r, local_GLE[:, 0]) for r in range(G)]
        result: dict[str, Any] = {"phys": [], "modes": []}
        for rank in range(G):
            sglang_lp._start_auto(config)
            serving = sglang_lp.serve(_metadata(pl), rank, groups[rank])
            assert serving.window_WLE is not None

            layers = functools.partial(
                _rank_layers, serving, groups[rank], local_GLE, ids_by_rank[rank], result
            )
            batch = auto_checks.forward_batch(ids_by_rank, rank, one.prefill)
            result["phys"].append(sglang_lp.forward_hook(layers, None, batch))
        result["exchanges"] = [g.calls for g in groups]
        _auto_pass_is_mapped_by_its_mode(one, result, per_layer=1)


def test_a_graph_is_captured_in_the_mode_of_its_padded_size(auto_state: Any) -> None:
    pl = lp_ranks.placement(auto_checks.SHAPE)
    sglang_lp.enable_auto(_auto_settings())
    serving = sglang_lp.serve(_metadata(pl), 0, lp_ranks.OneProcessGroup(0, np.zeros((pl.num_gpus, 1))))
    sglang_lp.set_window(auto_checks.window())
    for tokens, prefill, want in ((1, False, "static"), (2048, True, "lp"), (1, False, "static")):
        batch = auto_checks.capture_batch(tokens, prefill, pl.num_gpus)
        prepared = sglang_lp.capture_prepare_hook(
            lambda _runner, size, batch=batch: (batch, "backend"), None, tokens
        )
        assert prepared == (batch, "backend")
        assert ("lp" if serving.pass_lp else "static") == want


def test_the_window_of_each_rebalance_models_the_choice(
    auto_state: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pl = lp_ranks.placement(auto_checks.SHAPE)
    settings = _auto_settings()
    sglang_lp.enable_auto(settings)
    serving = sglang_lp.serve(_metadata(pl), 0, lp_ranks.OneProcessGroup(0, np.zeros((pl.num_gpus, 1))))
    before = serving.choice
    assert before is not None
    np.testing.assert_array_equal(before.gain_us_n, settings.choice(pl).gain_us_n)  # the replica counts
    rng = np.random.default_rng(7)
    window_WLE = rng.pareto(1.1, size=(40, lp_ranks.L, pl.num_logical)) * rng.integers(1, 50, size=(40, 1, 1))
    sglang.rebalance_experts_hook(lambda **kw: None, torch.from_numpy(window_WLE), pl.num_physical,
                                  pl.slots_per_gpu, None, 1, "deepseek")  # fmt: skip
    assert serving.window_WLE is not None
    np.testing.assert_array_equal(serving.window_WLE, largest_passes(window_WLE))
    assert serving.window_WLE.shape[0] == 16  # only the passes the choice samples are kept
    assert serving.choice is not None
    np.testing.assert_allclose(serving.choice.gain_us_n, settings.choice(pl, window_WLE).gain_us_n)
    # A start-up load file's [L, E] window is one pass.
    sglang.hand_window_to_auto(torch.from_numpy(window_WLE[0]))
    np.testing.assert_array_equal(serving.window_WLE, window_WLE[:1])
    # Without auto nothing is handed over.
    monkeypatch.setattr(sglang, "_REGISTERED", ["algorithms", "lp"])
    sglang.hand_window_to_auto(torch.from_numpy(window_WLE))
    np.testing.assert_array_equal(serving.window_WLE, window_WLE[:1])


def test_auto_without_a_top_k_in_the_model_config_runs_lp(
    auto_state: Any, caplog: pytest.LogCaptureFixture
) -> None:
    assert (
        sglang_lp.top_k_of(type("C", (), {"hf_text_config": type("T", (), {"num_experts_per_tok": 6})()})())
        == 6
    )
    with caplog.at_level("WARNING", logger="eplb"):
        sglang_lp._start_auto(type("C", (), {"hf_config": object()})())
    assert "no top-k" in caplog.text and sglang_lp._STATE.get("auto") is None
    assert sglang_lp.begin_pass(1 << 20, True) == "lp"  # no serving yet either


@pytest.fixture(scope="module")
def auto_run(engine_site: Path) -> dict[str, Any]:
    from tests.helpers.engines import run_engine_checks

    env = {SGLANG_LP_ENV: "auto", DISPATCH_COST_ENV: auto_checks.KERNELS}
    return run_engine_checks(engine_site, "sglang_auto", env=env)


def test_auto_hooks_sglangs_forward_and_captures_only_when_asked(auto_run: dict[str, Any]) -> None:
    names = {"forward", "decode_capture", "prefill_capture"}
    assert auto_run["untouched[]"] == dict.fromkeys(names, True)  # EPLB_SGLANG_LP unset
    assert auto_run["untouched[1]"] == dict.fromkeys(names, True)  # lp alone begins no pass
    assert auto_run["wrapped[auto]"] == dict.fromkeys(names, True)


def test_auto_inside_sglang_maps_each_pass_by_its_mode_on_every_rank(auto_run: dict[str, Any]) -> None:
    for one in auto_checks.PASSES:
        _auto_pass_is_mapped_by_its_mode(one, auto_run["passes"][one.name], per_layer=1)
    assert auto_run["window"] == largest_passes(auto_checks.window()).tolist()  # SGLang's rebalance's
    assert auto_run["captures"] == {"decode": "static", "prefill": "lp"}
