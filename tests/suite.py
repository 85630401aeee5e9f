"""Which tests are slow: the one list ``python -m pytest`` leaves out and ``python -m pytest -m slow`` runs.

The default run (pyproject's ``addopts``: ``-m "not slow"``) checks every module's behaviour in a
few minutes on 2 cores: each slow check below keeps a quick sibling there (fewer ranks, a smaller
shape or workload, fewer seeds, another parametrisation of the same test), and the engine files'
adapters have theirs in tests/test_adapters_in_process.py. The slow set is the rest, and CI runs
both (.ci/run). A test is slow when its file is in ``SLOW_FILES``, its node id matches an entry of
``SLOW_TESTS`` (an entry without ``[params]`` takes every parametrisation, and ``*`` stands for
any characters), it uses a fixture in ``SLOW_FIXTURES``, or it carries ``@pytest.mark.slow``
itself. tests/conftest.py marks the first three at collection; tests/test_suite.py checks that
every test is in exactly one set and that every entry here still marks some test.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache

SLOW_FIXTURES: dict[str, str] = {
    "engine_site": "vLLM's and SGLang's wheels installed from PyPI (a minute, once) and run in subprocesses",
}
"""Fixture name -> why every test that uses it is slow."""

SLOW_FILES: dict[str, str] = {
    "tests/test_hotswap_serving.py": (
        "Gloo ranks in processes; a swap group given up, the manager on: test_manager_recovery's two ranks"
    ),
    "tests/test_fault_harness.py": (
        "Gloo ranks in processes, peers asleep past the swaps' and the serving group's timeouts (2-3 min "
        "in all on 2 cores); the manager's plan shape check runs by default in tests/test_manager_plan_shape.py"
    ),
    "tests/test_lp_dist.py": (
        "Gloo ranks in processes; the same rule on real Gloo ranks runs by default in tests/test_sglang_lp.py"
    ),
}
"""Test file (from the repository root) -> why all of it is slow."""


def _each(file: str, why: str, *tests: str) -> dict[str, str]:
    return {f"tests/{file}::{test}": why for test in tests}


SLOW_TESTS: dict[str, str] = {
    **_each(
        "test_docs_examples.py",
        "every block in a fresh interpreter, simulations among them; the blocks' own checks run by default",
        "test_examples_run_as_written",
    ),
    # Triton's interpreter
    **_each(
        "test_remap_lp.py",
        "interpreted on large shapes; the one-expert shape and the torch reference run by default",
        "test_kernels_equal_the_torch_reference[0-nasty-True]",
        "test_kernels_equal_the_torch_reference[1-skewed-True]",
        "test_kernels_equal_the_torch_reference[2-nasty-True]",
        "test_kernels_equal_the_torch_reference[4-skewed-True]",
        "test_kernels_equal_the_torch_reference[4-nasty-False]",
        "test_an_expert_wider_than_the_fill_width_keeps_the_even_split",
        "test_one_exchange_serves_call_after_call_and_survives_a_failed_gather",
        "test_direct_launches_of_the_lp_kernels_equal_the_reference",
        "test_the_proportional_start_is_one_rule_in_every_backend[8-2]",
    ),
    **_each(
        "test_remap_kernel.py", "interpreted; the weighted shares run by default on one shape", "*[*weighted]"
    ),
    **_each(
        "test_sglang_lp.py",
        "interpreted on the largest shape; the two others run by default",
        "test_ranks_one_after_another_split_as_the_rule_says[0]",
    ),
    # ranks in processes: the two-rank or shorter run of each check runs by default
    **{
        f"tests/{file}::*[4ranks]": "four Gloo ranks in processes; two run the same checks by default"
        for file in ("test_hotswap_faults.py", "test_hotswap_dist.py")
    },
    **_each(
        "test_hotswap_faults.py",
        "ranks in processes, one killed; test_hotswap_faults_manager's lost peer runs by default",
        "test_a_peer_that_dies_leaves_every_survivor_consistent",
    ),
    **_each("test_manager_recovery.py", "four Gloo ranks in processes; two by default", "*[4ranks]"),
    **_each(
        "test_manager_recovery.py",
        "ranks in processes waiting out a hung solve and transfer; the one-rank watchdog runs by default",
        "test_the_watchdog_ends_a_hung_solve_and_a_hung_transfer_on_every_rank",
    ),
    **_each(
        "test_manager_rank_loss.py",
        "ranks in processes waiting out a lost peer; the loss mid-serving runs by default",
        "test_a_rank_lost_in_a_swap_is_found_by_the_swap_and_the_survivors_reload_through_the_loader",
    ),
    **_each(
        "test_demo_signals.py",
        "a demo in processes signalled; one signal to the process and one to the group run by default",
        "test_a_signal_ends_the_demo_and_every_rank_at_once[*serving*]",
        "test_a_signal_ends_the_demo_and_every_rank_at_once[process-starting-SIGINT]",
        "test_a_signal_ends_the_demo_and_every_rank_at_once[group-starting-SIGTERM]",
    ),
    **_each(
        "test_cli_inputs.py",
        "a demo in processes with a rank killed; the SIGKILL case runs by default",
        "test_a_killed_rank_ends_the_demo_in_one_line[SIGSEGV]",
    ),
    **_each(
        "test_manager_demo.py",
        "a demo run; mode0 runs by default",
        "test_demo_cli_rebalances_and_reports[mode1]",
        "test_demo_cli_rebalances_and_reports[mode2]",
    ),
    **_each(
        "test_manager_continuous.py",
        "ranks in processes; the budgets in process and the paced ranks run by default",
        "test_real_solver_keeps_every_rebalance_within_the_budget",
        "test_with_the_initial_full_plan_only_the_first_plan_may_exceed_the_budget",
    ),
    **_each(
        "test_solve_outputs.py",
        "a solve killed at every rename; the exchange path runs by default",
        "test_solve_stopped_at_every_rename_leaves_the_old_or_the_new_set[two-renames]",
    ),
    **_each(
        "test_suite.py",
        "the whole suite collected three times in subprocesses (about 20 s); slow_reason's rules run by default",
        "test_the_default_and_slow_sets_split_the_whole_suite",
        "test_the_suite_is_every_test_file_on_disk",
        "test_every_name_in_the_slow_lists_marks_a_test",
    ),
    **_each(
        "test_manager.py",
        "two Gloo ranks in processes; test_manager_continuous's paced ranks switch on one pass by default",
        "test_two_ranks_adopt_the_same_plan_on_the_same_pass",
    ),
    **_each(
        "test_decisions_agree.py",
        "thousands of passes through the manager and the simulator; the idle-passes case runs by default",
        "test_the_manager_and_the_simulator_take_the_same_decisions[periodic]",
        "test_the_manager_and_the_simulator_take_the_same_decisions[continuous]",
        "test_the_manager_and_the_simulator_take_the_same_decisions[continuous-prefill-only]",
    ),
    # simulations and solves over long or many workloads
    **_each(
        "test_quality.py", "a DeepSeek-V3-shaped simulation; the tiny preset runs by default", "*[drifting]"
    ),
    **_each(
        "test_solver_continuous.py",
        "hundreds of solves on a drifting or stationary load; the other prediction converges by default",
        "test_the_prediction_is_calibrated_on_a_drifting_workload",
        "test_repeated_solves_on_stationary_load_converge_and_then_move_little[True]",
    ),
    **_each(
        "test_solver_budget.py",
        "seeds 8-23; seeds 0-7 run by default",
        *(f"test_the_budget_is_never_exceeded[{seed}]" for seed in range(8, 24)),
    ),
    **_each(
        "test_spread.py",
        "the dynamic dispatch's solve; the static one runs by default",
        "test_through_solve_and_the_degraded_plan[gpu-dynamic]",
    ),
}
"""Test node id or pattern -> why it is slow."""


@cache
def _pattern(entry: str) -> re.Pattern[str]:
    return re.compile(re.escape(entry).replace(r"\*", ".*") + r"(\[.*\])?")


def slow_reason(nodeid: str, fixturenames: Iterable[str]) -> str | None:
    """The entry of the lists above that makes a test slow, or None (its own marker may still do)."""
    file = nodeid.partition("::")[0]
    if file in SLOW_FILES:
        return file
    listed = next((entry for entry in SLOW_TESTS if _pattern(entry).fullmatch(nodeid)), None)
    if listed is not None:
        return listed
    return next((f"fixture {f}" for f in fixturenames if f in SLOW_FIXTURES), None)
