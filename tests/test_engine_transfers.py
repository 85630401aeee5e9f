"""eplb's continuous plans moved by the engines' own transfer code, on real Gloo ranks (2 and 4).

Shape legend: G GPUs.

vLLM 0.33's ``rearrange_expert_weights_inplace`` through the communicator its factory builds for
``torch_gloo``, and SGLang 0.5.23's ``update_expert_weights_single_layer`` (both from PyPI,
tests.helpers.engine_transfer_ranks), carry out a sequence of budgeted plans from
``eplb.solver.solve`` on a drifting load. After every plan each rank's slots hold, in every tensor
(fp8 weights and fp32 scales, or bf16), the bytes of the expert the plan places there; the bytes
the engine hands to ``batch_isend_irecv`` are exactly the plan's copies across GPUs times the bytes
of one expert (so within the budget), and each rank receives exactly its arrivals. vLLM's Gloo
communicator does not run as shipped on a host without an accelerator: the errors are recorded
and checked here, and the two stand-ins the ranks use instead are in the helper's docstring.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.engine_transfer_ranks import NO_ACCELERATOR, NO_PINNED, bytes_per_expert, run


def _cases(world: int) -> list[dict[str, Any]]:
    base: dict[str, Any] = dict(L=3, E=16, P=24, W=20, drift=0.3, nnodes=1)
    cases: list[dict[str, Any]] = [
        dict(name="fp8_budget5", kind="fp8", budget=5, steps=5),
        dict(name="bf16_budget2", kind="bf16", budget=2, steps=5),
        # Nasty: a budget of nothing (local rewrites at most, never a byte sent).
        dict(name="fp8_budget0", kind="fp8", budget=0, steps=3),
    ]
    if world == 4:
        cases.append(dict(name="fp8_two_nodes", kind="fp8", budget=6, steps=5, nnodes=2))
    return [dict(base, seed=10 * world + i, **c) for i, c in enumerate(cases)]


@pytest.fixture(
    scope="module",
    params=[("vllm", 2), ("vllm", 4), ("sglang", 2), ("sglang", 4)],
    ids=["vllm-2ranks", "vllm-4ranks", "sglang-2ranks", "sglang-4ranks"],
)
def moved(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]], list[list[dict[str, Any]]]]:
    engine, world = request.param
    cases = _cases(world)
    return engine, cases, run(engine, world, cases)


def _steps(per_rank: list[list[dict[str, Any]]], i: int) -> list[list[dict[str, Any]]]:
    """Case ``i``'s steps, each as the list of every rank's result."""
    return [list(step) for step in zip(*(outs[i]["steps"] for outs in per_rank), strict=True)]


@pytest.mark.slow
def test_every_slot_holds_the_plans_expert_in_every_tensor(moved: Any) -> None:
    _, cases, per_rank = moved
    for i, case in enumerate(cases):
        assert all(outs[i]["name"] == case["name"] for outs in per_rank)
        for step in _steps(per_rank, i):
            assert all(r["holds_plan"] for r in step), (case["name"], step)
            assert len({r["map"] for r in step}) == 1, (case["name"], step)  # the same plan on every rank


@pytest.mark.slow
def test_the_engine_sends_the_plans_copies_and_stays_within_the_budget(moved: Any) -> None:
    _, cases, per_rank = moved
    world = len(per_rank)
    for i, case in enumerate(cases):
        per_expert = bytes_per_expert(case["kind"])
        for step in _steps(per_rank, i):
            copies = step[0]["copies"]
            assert copies <= case["budget"], (case["name"], step[0])
            sent = sum(r["sent"] for r in step)
            assert sent == sum(r["received"] for r in step) == copies * per_expert, (case["name"], step)
            assert sent <= case["budget"] * per_expert
            for rank, r in enumerate(step):  # each GPU receives its arrivals, once each
                assert r["received"] == r["arrivals_G"][rank] * per_expert, (case["name"], rank, r)
                assert str(rank) not in r["sent_to"] and all(0 <= int(p) < world for p in r["sent_to"])
            if not step[0]["applied"]:
                assert sent == 0 and all(r["calls"] == 0 for r in step)


@pytest.mark.slow
def test_the_runs_exercise_remote_copies_local_copies_and_a_zero_budget(moved: Any) -> None:
    """Not vacuous: plans were applied and moved experts across GPUs in every budgeted case, the
    engine's same-GPU copy path ran, and a zero budget sent nothing."""
    _, cases, per_rank = moved
    local = 0
    for i, case in enumerate(cases):
        steps = [s[0] for s in _steps(per_rank, i)]
        local += sum(s["local_copies"] for s in steps)
        if case["budget"] == 0:
            assert all(s["copies"] == 0 for s in steps), steps
        else:
            assert any(s["applied"] and s["copies"] > 0 for s in steps), (case["name"], steps)
    assert local > 0


@pytest.mark.slow
def test_vllm_uses_its_gloo_communicator_which_needs_an_accelerator_as_shipped(moved: Any) -> None:
    engine, _, per_rank = moved
    if engine != "vllm":
        pytest.skip("vLLM's communicator only")
    for outs in per_rank:
        for o in outs:
            assert o["communicator"] == "TorchDistGlooStagedEplbCommunicator", o
            if not torch.accelerator.is_available():
                assert o["cpu_errors"]["send"] == NO_ACCELERATOR, o
                assert o["cpu_errors"]["recv"].startswith(NO_PINNED), o
