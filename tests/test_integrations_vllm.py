"""eplb's vLLM plugin against vLLM 0.33.0's own plugin loader and policy table (installed from PyPI).

What vLLM does is recorded by tests.helpers.engine_checks in a subprocess; the plans are judged here
against vLLM's own default policy and eplb's placement checks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from eplb.integrations.vllm import (
    DEFAULT_HISTORY,
    HISTORY_ENV,
    POLICY_ENV,
    history_from_env,
    launch_flags,
    requested_algorithm,
)
from eplb.placement.balance import model_balancedness
from eplb.placement.model import Placement
from tests.helpers.engine_checks import G, L, P, drift_scores


def _placement(phy2log: list[list[int]]) -> Placement:
    arr = np.asarray(phy2log)
    assert arr.shape == (L, P)
    return Placement.from_phy2log(arr, G)  # validates: every expert present, ids in range


def test_off_unless_asked(vllm_checks: dict[str, Any]) -> None:
    assert vllm_checks["off_policy_is_default"]


def test_vllm_looks_up_eplbs_policy(vllm_checks: dict[str, Any]) -> None:
    # EplbState does EPLB_POLICIES[eplb_config.policy]; the config's only name is "default".
    assert vllm_checks["config_policy"] == "default"
    assert vllm_checks["policy_is_eplb"] and vllm_checks["policy_is_vllm_policy"]
    assert vllm_checks["vllm_default_kept"]
    assert vllm_checks["keys"] == ["default"]  # vLLM asserts its keys match the config's names


def test_plan_valid_repeatable_and_better_than_vllms(vllm_checks: dict[str, Any]) -> None:
    load_LE = np.asarray(vllm_checks["load"])
    ours = _placement(vllm_checks["eplb_map"])
    default = _placement(vllm_checks["default_map"])
    assert vllm_checks["eplb_dtype"] == "torch.int64"
    assert vllm_checks["repeat_map"] == vllm_checks["eplb_map"]
    assert ours.logcnt_LE.sum(axis=1).tolist() == [P] * L
    assert model_balancedness(load_LE, ours) > model_balancedness(load_LE, default)
    assert model_balancedness(load_LE, ours) > 0.98


def test_empty_slots_are_filled(vllm_checks: dict[str, Any]) -> None:
    holes = _placement(vllm_checks["holes_map"])
    assert (holes.phy2log_LP >= 0).all() and (holes.logcnt_LE >= 1).all()


def test_history_gives_every_rank_the_same_plans(vllm_checks: dict[str, Any]) -> None:
    first, second = vllm_checks["history_runs"]
    assert first == second
    for plan in first:
        _placement(plan)
    assert vllm_checks["history_kept"] == DEFAULT_HISTORY  # EPLB_VLLM_HISTORY's default


def test_env_parsing() -> None:
    assert requested_algorithm({}) is None
    assert requested_algorithm({POLICY_ENV: "0"}) is None
    assert requested_algorithm({POLICY_ENV: "1"}) == "auto"
    assert requested_algorithm({POLICY_ENV: "scipy"}) == "scipy"
    with pytest.raises(ValueError, match=POLICY_ENV):
        requested_algorithm({POLICY_ENV: "magic"})
    assert history_from_env({}) == DEFAULT_HISTORY and history_from_env({HISTORY_ENV: "2"}) == 2
    for bad in ("0", "two"):
        with pytest.raises(ValueError, match=HISTORY_ENV):
            history_from_env({HISTORY_ENV: bad})
    assert launch_flags(32).startswith(f"{POLICY_ENV}=1 vllm serve")
    assert "--enable-eplb" in launch_flags(32) and '"num_redundant_experts": 32' in launch_flags(32)


def test_drifting_plans_balance_the_next_window_as_well_as_vllms(vllm_checks: dict[str, Any]) -> None:
    """Each plan, made from one summed window through vLLM's policy table, scored on the next
    window (an even split over replicas), over three drifting inputs: eplb's mean is within 0.005
    of vLLM's default (the same DeepSeek packing of the same window: a summed window leaves no
    recency to exploit), and it moves fewer expert copies."""
    ours, theirs = drift_scores(vllm_checks["drift"])
    assert ours["next_window"] >= theirs["next_window"] - 0.005, (ours, theirs)
    assert ours["copies"] < theirs["copies"], (ours, theirs)
