"""Which tests are slow: the one list ``python -m pytest`` leaves out and ``python -m pytest -m slow`` runs.

The default run (pyproject's ``addopts``: ``-m "not slow"``) checks every module's behaviour in a
few minutes on 2 cores: each slow check below keeps a quick sibling there (fewer ranks, a smaller
shape or workload, fewer seeds, another parametrisation of the same test). The slow set is the
rest, and CI runs both (.ci/run). A test is slow when its file is in ``SLOW_FILES``, its node id
matches an entry of ``SLOW_TESTS`` (an entry without ``[params]`` takes every parametrisation, and
``*`` stands for any characters), it uses a fixture in ``SLOW_FIXTURES``, or it carries
``@pytest.mark.slow`` itself. tests/conftest.py marks the first three at collection;
tests/test_suite.py checks that every test is in exactly one set and that every entry here still
marks some test.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache

SLOW_FIXTURES: dict[str, str] = {
    "engine_site": "installs vLLM's and SGLang's wheels from PyPI (a minute, once) and runs them in subprocesses",
}
"""Fixture name -> why every test that uses it is slow (the engines' adapters keep in-process checks)."""

SLOW_FILES: dict[str, str] = {}
"""Test file (from the repository root) -> why all of it is slow."""

_FOUR_RANKS = "four Gloo ranks in processes; the two-rank run of the same checks is quick"
SLOW_TESTS: dict[str, str] = {
    # docs: the other documents' examples run by default
    "tests/test_docs_examples.py::test_examples_run_as_written[README.md]": "its examples run simulations",
    "tests/test_docs_examples.py::test_examples_run_as_written[docs/simulate.md]": "simulations and sweeps",
    "tests/test_docs_examples.py::test_examples_run_as_written[docs/traces.md]": "workloads drawn and converted",
    # Triton's interpreter: the small shapes and other backends run by default
    "tests/test_remap_lp.py::test_kernels_equal_the_torch_reference[0-nasty-True]": "interpreted, large shape",
    "tests/test_remap_lp.py::test_kernels_equal_the_torch_reference[1-skewed-True]": "interpreted, large shape",
    "tests/test_remap_lp.py::test_kernels_equal_the_torch_reference[2-nasty-True]": "interpreted, large shape",
    "tests/test_remap_lp.py::test_kernels_equal_the_torch_reference[4-skewed-True]": "interpreted, large shape",
    "tests/test_remap_lp.py::test_kernels_equal_the_torch_reference[4-nasty-False]": "interpreted, large shape",
    "tests/test_remap_lp.py::test_an_expert_wider_than_the_fill_width_keeps_the_even_split": "interpreted, wide",
    "tests/test_remap_lp.py::test_one_exchange_serves_call_after_call_and_survives_a_failed_gather": "interpreted",
    "tests/test_remap_lp.py::test_direct_launches_of_the_lp_kernels_equal_the_reference": "interpreted",
    "tests/test_remap_kernel.py::*[*weighted]": "interpreted; weighted shares run by default on one shape",
    "tests/test_sglang_lp.py::test_ranks_one_after_another_split_as_the_rule_says[0]": "interpreted, largest shape",
    # multi-process runs: the two-rank or shorter run of each runs by default
    "tests/test_hotswap_faults.py::*[4ranks]": _FOUR_RANKS,
    "tests/test_hotswap_dist.py::*[4ranks]": _FOUR_RANKS,
    "tests/test_hotswap_serving.py::*[4ranks]": _FOUR_RANKS,
    "tests/test_manager_recovery.py::*[4ranks]": _FOUR_RANKS,
    "tests/test_lp_dist.py::test_ranks_split_replicated_experts_by_the_global_counts[4]": _FOUR_RANKS,
    "tests/test_manager_rank_loss.py::test_a_rank_lost_in_a_swap_is_found_by_the_swap_and_the_survivors_reload_through_the_loader": (
        "ranks in processes waiting out a lost peer; the loss mid-serving runs by default"
    ),
    "tests/test_demo_signals.py::test_a_signal_ends_the_demo_and_every_rank_at_once[*serving*]": (
        "a demo served until signalled; the signals while starting run by default"
    ),
    "tests/test_manager_demo.py::test_demo_cli_rebalances_and_reports[mode1]": "a demo run; mode0 runs by default",
    "tests/test_manager_demo.py::test_demo_cli_rebalances_and_reports[mode2]": "a demo run; mode0 runs by default",
    "tests/test_manager_continuous.py::test_real_solver_keeps_every_rebalance_within_the_budget[1]": (
        "ranks in processes; seed 0 runs by default"
    ),
    "tests/test_manager_continuous.py::test_with_the_initial_full_plan_only_the_first_plan_may_exceed_the_budget": (
        "ranks in processes; the first plan's budget is checked in process by default"
    ),
    "tests/test_solve_outputs.py::test_solve_stopped_at_every_rename_leaves_the_old_or_the_new_set[two-renames]": (
        "a solve killed at every rename; the exchange path runs by default"
    ),
    # the manager and the simulator agree: the two short cases run by default
    "tests/test_decisions_agree.py::test_the_manager_and_the_simulator_take_the_same_decisions[periodic]": (
        "thousands of passes through both"
    ),
    "tests/test_decisions_agree.py::test_the_manager_and_the_simulator_take_the_same_decisions[continuous]": (
        "thousands of passes through both"
    ),
    # simulations and solver runs over long or many workloads
    "tests/test_quality.py::*[drifting]": "a DeepSeek-V3-shaped simulation; the tiny preset runs by default",
    "tests/test_solver_continuous.py::test_the_prediction_is_calibrated_on_a_drifting_workload": (
        "hundreds of solves on a drifting workload"
    ),
    "tests/test_solver_continuous.py::test_repeated_solves_on_stationary_load_converge_and_then_move_little[True]": (
        "repeated solves; the other prediction runs by default"
    ),
    **{
        f"tests/test_solver_budget.py::test_the_budget_is_never_exceeded[{seed}]": "seeds 0-7 run by default"
        for seed in range(8, 24)
    },
    "tests/test_spread.py::test_through_solve_and_the_degraded_plan[gpu-dynamic]": "the static dispatch runs by default",
}
"""Test node id or pattern -> why it is slow."""


@cache
def _pattern(entry: str) -> re.Pattern[str]:
    return re.compile(re.escape(entry).replace(r"\*", ".*") + r"(\[.*\])?")


def slow_reason(nodeid: str, fixturenames: Iterable[str]) -> str | None:
    """The entry of the lists above that makes a test slow, or None (its own marker may still do)."""
    if nodeid.partition("::")[0] in SLOW_FILES:
        return nodeid.partition("::")[0]
    listed = next((entry for entry in SLOW_TESTS if _pattern(entry).fullmatch(nodeid)), None)
    if listed is not None:
        return listed
    return next((f"fixture {f}" for f in fixturenames if f in SLOW_FIXTURES), None)
