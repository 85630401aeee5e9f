"""Dispatch kernels charged in the simulator (``--eplb-dispatch-cost``) and ``auto`` dispatch per pass.

References: the tables' figures and a hand-written log-linear interpolation; the simulator's own
``static`` and ``lp`` runs on the same placement (an ``auto`` pass must equal the mode it chose);
the static remap and the ``lp`` rule's brute force for the SGLang path's ranks.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb.config import ConfigError, EplbConfig, parse_config
from eplb.integrations import sglang_lp
from eplb.placement.dispatch_map import static_dispatch_map
from eplb.placement.model import Placement
from eplb.policy.auto_dispatch import AutoDispatch
from eplb.policy.cost_model import DISPATCH_KERNEL_TABLES, CostModel, dispatch_kernel_cost
from eplb.policy.dispatch import dispatch_mode
from eplb.simulate import RunSpec, SimulationConfig, simulate
from eplb.simulate.planners import make_planner
from eplb.traces import Trace
from eplb.workloads import WorkloadConfig, generate
from tests.helpers import sglang_lp_ranks as lp_ranks
from tests.helpers.remap_reference import brute_lp

TABLE: dict[str, list[float]] = {"tokens": [64, 4096], "static": [2.0, 8.0], "lp": [20.0, 50.0]}


def _log_interp(t: float, t0: float, t1: float, y0: float, y1: float) -> float:
    if t <= t0:
        return y0
    if t >= t1:
        return y1
    f = (math.log(t) - math.log(t0)) / (math.log(t1) - math.log(t0))
    return y0 + f * (y1 - y0)


def test_a_table_interpolates_in_log_tokens_and_holds_at_its_ends() -> None:
    cost = dispatch_kernel_cost(json.dumps(TABLE))
    tokens = np.array([1.0, 64.0, 512.0, 1000.0, 4096.0, 1e6])
    for mode in ("static", "lp"):
        got = cost.layer_us(mode, tokens, np.zeros(tokens.size, dtype=bool))
        low, high = TABLE[mode]
        want = [_log_interp(t, 64, 4096, low, high) for t in tokens]
        np.testing.assert_allclose(got, want, rtol=1e-12)
    # 512 is the geometric midpoint of 64 and 4096: the mean of their figures.
    assert cost.layer_us("lp", np.array([512.0]), np.array([True]))[0] == pytest.approx(35.0)
    # Modes without a row of their own are charged static's.
    np.testing.assert_array_equal(
        cost.layer_us("dynamic", tokens, np.zeros(6, bool)),
        cost.layer_us("static", tokens, np.zeros(6, bool)),
    )


def test_named_tables_hold_the_measured_figures_and_phases_apart() -> None:
    h100 = dispatch_kernel_cost("h100-sglang")
    at = np.array([64.0, 65536.0])
    np.testing.assert_allclose(h100.layer_us("lp", at, np.array([False, False])), [30.4, 43.0])
    np.testing.assert_allclose(h100.layer_us("lp", at, np.array([True, True])), [89.4, 102.0])
    np.testing.assert_allclose(
        dispatch_kernel_cost("h200").layer_us("static", at, np.zeros(2, bool)), [1.43, 4.19]
    )
    assert not dispatch_kernel_cost("none").layer_us("lp", at, np.ones(2, bool)).any()
    assert EplbConfig().dispatch_cost.name == "h200"
    assert set(DISPATCH_KERNEL_TABLES) >= {"h200", "h100", "h100-eager", "none"}


def test_a_table_may_come_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"decode": TABLE, "prefill": {**TABLE, "lp": [200.0, 500.0]}}))
    cost = EplbConfig(eplb_dispatch_cost=str(path)).dispatch_cost
    assert cost.layer_us("lp", np.array([64.0]), np.array([True]))[0] == 200.0
    assert cost.layer_us("lp", np.array([64.0]), np.array([False]))[0] == 20.0


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("h300", "neither a table"),
        ("{", "not valid JSON"),
        ("[1, 2]", "neither a table"),
        ('{"tokens": [64], "static": [1.0]}', "needs a 'lp' row"),
        ('{"tokens": [64, 64], "static": [1, 2], "lp": [1, 2]}', "ascending"),
        ('{"tokens": [0, 64], "static": [1, 2], "lp": [1, 2]}', "positive"),
        ('{"tokens": [64, 128], "static": [1], "lp": [1, 2]}', "must list 2 figures"),
        ('{"tokens": [64], "static": [-1], "lp": [1]}', ">= 0"),
        ('{"tokens": [64], "static": [NaN], "lp": [1]}', ">= 0"),
        ('{"tokens": [64], "static": [1], "lp": [1], "auto": [1]}', "unknown dispatch mode"),
        ('{"decode": {"tokens": [64], "static": [1], "lp": [1]}}', "exactly the keys"),
    ],
)
def test_bad_tables_are_refused_naming_the_flag(value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=f"^--eplb-dispatch-cost: .*{says}"):
        EplbConfig(eplb_dispatch_cost=value)


def test_the_command_line_says_one_line_and_exits_2() -> None:
    cmd = [sys.executable, "-m", "eplb", "simulate", "--preset", "tiny", "--steps", "20", "--disable-tqdm"]
    done = subprocess.run(
        [*cmd, "--eplb-dispatch-cost", '{"tokens": [64], "static": [1]}'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if not line.startswith("generating")]
    assert errors == ["eplb simulate: error: --eplb-dispatch-cost: table: needs a 'lp' row"]


def test_auto_is_a_flag_that_plans_for_static_maps_and_picks_per_pass() -> None:
    assert parse_config(["--ep-dispatch-algorithm", "auto"]).dispatch_algorithm == "auto"
    mode = dispatch_mode("auto")
    assert mode.static_maps and mode.per_pass == ("static", "lp") and not mode.collective


# ---- the simulator --------------------------------------------------------------------------------


def _trace(steps: int = 400) -> Trace:
    return generate(WorkloadConfig(preset="tiny", num_steps=steps, seed=3, prefill_tokens=(256, 65536)))


def _config(trace: Trace, cost: str) -> SimulationConfig:
    eplb = EplbConfig(
        enable_eplb=True,
        ep_size=4,
        ep_num_redundant_experts=4,
        eplb_rebalance_num_iterations=100,
        eplb_dispatch_cost=cost,
    )
    return SimulationConfig.for_trace(trace, eplb=eplb, cost=CostModel(base_us=5.0, per_expert_us=3.0))


def test_every_pass_is_charged_its_modes_kernels_at_the_ranks_tokens() -> None:
    trace = _trace()
    runs = [RunSpec("scipy", "static"), RunSpec("scipy", "lp")]
    charged = simulate(trace, runs, _config(trace, json.dumps(TABLE)))
    free = simulate(trace, runs, _config(trace, "none"))
    L, G = trace.num_layers, 4
    for name, mode in (("scipy:static", "static"), ("scipy:lp", "lp"), ("none:static", "static")):
        run = charged.run(name) if name != "none:static" else charged.baseline
        bare = free.run(name) if name != "none:static" else free.baseline
        low, high = TABLE[mode]
        want = [L * _log_interp(t / G, 64, 4096, low, high) for t in trace.num_tokens_F]
        assert run.dispatch_us_F is not None and bare.dispatch_us_F is not None
        np.testing.assert_allclose(run.dispatch_us_F, np.array(want), rtol=1e-12)
        # The MoE time and every plan are the same; only the charged kernels differ.
        np.testing.assert_array_equal(run.moe_us_F, bare.moe_us_F)
        assert [e.step for e in run.events] == [e.step for e in bare.events]
        s0 = charged.scored_from
        assert run.total_seconds(s0) == pytest.approx(bare.total_seconds(s0) + sum(want[s0:]) * 1e-6)
        assert not bare.dispatch_us_F.any()
    summary = {s["name"]: s for s in charged.summaries()}
    s0 = charged.scored_from
    base = charged.baseline.total_seconds(s0)
    assert summary["scipy:lp"]["speedup_vs_none"] == pytest.approx(
        base / charged.run("scipy:lp").total_seconds(s0)
    )
    assert (
        summary["scipy:lp"]["lp_pass_fraction"] == 1.0 and summary["scipy:static"]["lp_pass_fraction"] == 0.0
    )
    assert "dispatch s" in charged.table()


@pytest.mark.parametrize("lp_us", [0.0, 1e6])
def test_auto_passes_equal_the_mode_they_chose_on_the_same_placement(lp_us: float) -> None:
    trace = _trace()
    table = json.dumps({"tokens": [1], "static": [0.0], "lp": [lp_us]})
    config = _config(trace, table)
    # lp dispatch on the plans auto serves (packed for static maps): the reference of its lp passes.
    planner = make_planner(RunSpec("scipy", "static"), config)
    assert planner is not None
    runs = [RunSpec("scipy", "static"), RunSpec("auto", "lp"), RunSpec("scipy", "auto")]
    result = simulate(trace, runs, config, planners={"auto:lp": planner})
    static, lp, auto = result.run("scipy:static"), result.run("auto:lp"), result.run("scipy:auto")
    assert auto.lp_F is not None and lp.dispatch_us_F is not None and static.dispatch_us_F is not None
    chose = auto.lp_F
    for field in ("balancedness_F", "moe_us_F"):
        np.testing.assert_array_equal(getattr(auto, field)[chose], getattr(lp, field)[chose])
        np.testing.assert_array_equal(getattr(auto, field)[~chose], getattr(static, field)[~chose])
    np.testing.assert_array_equal(auto.dispatch_us_F, np.where(chose, lp.dispatch_us_F, static.dispatch_us_F))
    prefill = trace.is_prefill_F
    if lp_us > 0:  # lp costs more than any pass can gain: never chosen
        assert not chose.any()
    else:  # free lp: chosen on prefill passes once a plan serves, never on the smallest passes
        assert chose[prefill].mean() > 0.3
        assert not chose[trace.num_tokens_F < 16].any()


def test_auto_plans_what_static_plans() -> None:
    trace = _trace()
    result = simulate(trace, [RunSpec("scipy", "static"), RunSpec("scipy", "auto")], _config(trace, "h200"))
    static, auto = result.run("scipy:static"), result.run("scipy:auto")
    assert static.final_placement is not None and auto.final_placement is not None
    np.testing.assert_array_equal(static.final_placement.phy2log_LP, auto.final_placement.phy2log_LP)
    assert [e.changed_slots for e in static.events] == [e.changed_slots for e in auto.events]


def test_a_layer_without_replicas_never_gains_from_lp() -> None:
    placement = Placement.trivial(2, 8, 4, 0, 1)
    free = dispatch_kernel_cost('{"tokens": [1], "static": [0], "lp": [0]}')
    window = np.random.default_rng(0).integers(0, 1000, size=(5, 2, 8))
    choice = AutoDispatch.of(placement, window, top_k=2, cost=CostModel(), kernels=free)
    np.testing.assert_allclose(choice.gain_us_n, 0.0, atol=1e-9)
    assert choice.mode(1 << 20, True) == "static"


# ---- the SGLang path ------------------------------------------------------------------------------


def test_sglang_ranks_take_the_same_mode_and_map_by_it() -> None:
    batch = next(b for b in lp_ranks.BATCHES if b.shape == 0)
    pl = lp_ranks.placement(batch.shape)
    G, E = pl.num_gpus, pl.num_logical
    ids_by_rank = batch.ids()
    groups = [lp_ranks.OneProcessGroup(r, np.zeros((G, E))) for r in range(G)]
    servings = [
        sglang_lp.LpServing(pl, r, torch.device("cpu"), sglang_lp.gather_for(groups[r], G, r))
        for r in range(G)
    ]
    window_WLE = np.stack([lp_ranks.global_counts("heavy", pl, seed) for seed in range(8)])
    # lp at no cost beyond static's: chosen where the model gains; at a prohibitive cost: never.
    for lp_us, tokens, want in ((0.0, 1 << 22, "lp"), (1e9, 1 << 22, "static"), (0.0, 1, "static")):
        kernels = dispatch_kernel_cost(json.dumps({"tokens": [1], "static": [0.0], "lp": [lp_us]}))
        settings = sglang_lp.AutoSettings(kernels=kernels, cost=CostModel(), top_k=lp_ranks.K)
        modes = set()
        for s in servings:
            s.set_auto(settings)
            s.set_window(window_WLE)
            modes.add(s.begin_pass(tokens, prefill=True))
        assert modes == {want}
        calls = [g.calls for g in groups]
        local_GE = np.stack([lp_ranks.local_counts(ids[0], E) for ids in ids_by_rank])
        for rank, s in enumerate(servings):
            groups[rank].local_GE = local_GE
            phys = s.solvers[0].solve(torch.from_numpy(ids_by_rank[rank][0])).phys_TK.numpy()
            ids = ids_by_rank[rank][0]
            if want == "static":
                valid = (ids >= 0) & (ids < E)
                expect = np.where(valid, static_dispatch_map(pl, rank)[0][np.clip(ids, 0, E - 1)], ids)
                np.testing.assert_array_equal(phys, expect)
            else:
                want_ids = brute_lp([x[0].tolist() for x in ids_by_rank], pl, 0, [None] * G)[rank]
                assert phys.tolist() == want_ids
        exchanged = [g.calls - c for g, c in zip(groups, calls, strict=True)]
        assert exchanged == ([1] * G if want == "lp" else [0] * G)
