"""eplb's SGLang plugin against SGLang 0.5.23's own plugin loader, algorithms and fused kernel (from PyPI).

What SGLang does is recorded by tests.helpers.engine_checks in a subprocess; here the placements
are validated and the replaced fused kernel is compared with SGLang's own, element for element
(on the CPU SGLang's Triton kernel runs in the interpreter, eplb's torch backend replaces it; on a
GPU both run compiled).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from eplb.integrations.sglang import PREFIX, launch_flags, route_algorithm, sglang_algorithm_name
from eplb.placement.balance import model_balancedness
from eplb.placement.model import Placement
from tests.helpers.engine_checks import E, G, L, P, drift_scores


def _placement(triple: list[Any]) -> Placement:
    phy2log, log2phy, logcnt = (np.asarray(t) for t in triple)
    assert phy2log.shape == (L, P) and logcnt.shape == (L, E) and log2phy.shape[:2] == (L, E)
    return Placement.from_deepseek(phy2log, log2phy, logcnt, G)  # validates all three maps together


def test_plugin_off_and_fused_opt_in(sglang_checks: dict[str, Any]) -> None:
    assert sglang_checks["off_compute_unchanged"]
    assert sglang_checks["default_fused_unchanged"]
    assert sglang_checks["fused_replaced"]


def test_algorithm_names_route(sglang_checks: dict[str, Any]) -> None:
    assert sglang_checks["choices"] == {
        "scipy": ["eplb", "scipy"],
        "eplb": ["eplb", "auto"],
        "eplb:deepseek": ["eplb", "deepseek"],
        "deepseek": ["sglang", "deepseek"],
        "deepseek_hierarchical": ["sglang", "deepseek_hierarchical"],
        "auto": ["sglang", "deepseek_hierarchical"],  # SGLang's auto stays SGLang's
    }
    assert sglang_checks["unknown_raises"] == "KeyError"


def test_scipy_rebalance_is_valid_repeatable_and_balanced(sglang_checks: dict[str, Any]) -> None:
    placement = _placement(sglang_checks["scipy"])
    assert sglang_checks["scipy_dtypes"] == sglang_checks["deepseek_dtypes"] == ["torch.int64"] * 3
    assert sglang_checks["scipy_repeat"] == sglang_checks["scipy"]
    # The plan forecasts from the window (recent passes weigh more), so it is judged on the window's
    # load against no balancing; the comparison with a DeepSeek plan is vLLM's test (one window).
    load_LE = np.asarray(sglang_checks["tokens"]).sum(axis=0)
    unbalanced = Placement.trivial(L, E, num_gpus=G, num_redundant=P - E)
    assert model_balancedness(load_LE, placement) > max(0.98, model_balancedness(load_LE, unbalanced) + 0.1)


def test_live_placement_is_kept_when_moving_does_not_pay(sglang_checks: dict[str, Any]) -> None:
    assert sglang_checks["live_kept"][0] == sglang_checks["scipy"][0]


def test_sglang_deepseek_unchanged(sglang_checks: dict[str, Any]) -> None:
    assert sglang_checks["deepseek_wrapped"] == sglang_checks["deepseek_direct"]


@pytest.mark.parametrize(
    "case",
    [f"{kind}_{rows}" for kind in ("static", "static_padded", "identity") for rows in (1, 37, 300)]
    + ["dynamic", "no_map", "empty"],
)
def test_fused_kernel_returns_what_sglangs_returns(sglang_checks: dict[str, Any], case: str) -> None:
    got = sglang_checks["fused"][case]
    assert got["ours"] == got["sglang"]
    assert got["ours_dtype"] == got["sglang_dtype"]
    assert got["load_ours"] == got["load_sglang"]
    if case in ("dynamic", "no_map", "empty"):
        assert got["ours"] is None  # SGLang's unfused path takes these
    else:
        assert got["ours_dtype"] == "torch.int32"


def test_fused_tables_follow_placement_updates(sglang_checks: dict[str, Any]) -> None:
    update = sglang_checks["fused_update"]
    for got in update["results"]:
        assert got["ours"] == got["sglang"] and got["load_ours"] == got["load_sglang"]
    assert update["results"][0]["ours"] == update["results"][1]["ours"] != update["results"][2]["ours"]
    assert update["translations"] == 2  # once for the placement, once after the update


def test_names_and_flags() -> None:
    assert route_algorithm("scipy") is not None and route_algorithm("deepseek") is None
    assert route_algorithm("auto") is None and route_algorithm("magic") is None
    with pytest.raises(ValueError, match="unknown algorithm"):
        route_algorithm(f"{PREFIX}magic")
    assert sglang_algorithm_name("auto") == sglang_algorithm_name("scipy") == "scipy"
    assert sglang_algorithm_name("deepseek") == f"{PREFIX}deepseek"
    placement = Placement.trivial(2, 8, num_gpus=4, num_redundant=4, num_nodes=2)
    flags = launch_flags(placement, "plan/init.json", "auto")
    assert flags["plugin"].startswith("--enable-eplb --eplb-algorithm scipy ")
    assert "--enable-eplb" not in flags["static"] and "--eplb-algorithm" not in flags["static"]
    for text in flags.values():
        assert "--ep-size 4 --ep-num-redundant-experts 4 --init-expert-location plan/init.json" in text
        assert "--nnodes 2" in text


def test_drifting_plans_balance_the_next_window_at_least_as_well_as_sglangs(
    sglang_checks: dict[str, Any],
) -> None:
    """Each plan, made from one window of passes through SGLang's own wrapped function, scored on
    the next window (an even split over replicas), over three drifting inputs: eplb's mean is at
    least SGLang's deepseek's, and it moves fewer expert copies."""
    ours, theirs = drift_scores(sglang_checks["drift"])
    assert ours["next_window"] >= theirs["next_window"], (ours, theirs)
    assert ours["copies"] < theirs["copies"], (ours, theirs)
