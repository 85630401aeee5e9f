"""Very hot experts: replica counts chosen with the placement (eplb.solver.search.recount).

Checked against a brute force (every replica count vector times every placement of a layer, up
to the order of GPUs and of slots within one, in plain numpy) on small seeded instances, and on
vLLM's own test inputs: ``tests/distributed/test_eplb_algo.py`` read from vLLM's sdist on PyPI
at test time (benchmarks.peers.fetch_vllm_test; never copied into this repository), whose
``extreme_weight_imbalance`` case (one expert 1000x the others, 12 slots on 4 GPUs) the greedy
counts stacked at max/mean 1.593.
"""

from __future__ import annotations

import ast
import itertools
from functools import cache
from typing import Any

import numpy as np
import pytest

from eplb.placement.balance import gpu_load
from eplb.placement.model import Placement
from eplb.solver import SolveOptions, Topology, rebalance_experts, solve
from eplb.solver.policies.deepseek import deepseek_rebalance
from eplb.solver.search.recount import SEARCH_FROM, recount_phy2log, stacked_layers


@cache
def _every_placement(E: int, S: int, G: int) -> tuple[np.ndarray, np.ndarray]:
    """(replicas [n, G, E] of each expert on each GPU, counts [n, E]) of every placement in
    which every expert has a replica, GPUs as a multiset of slot multisets."""
    per_gpu = np.array(
        [np.bincount(c, minlength=E) for c in itertools.combinations_with_replacement(range(E), S)]
    )
    pick = np.array(list(itertools.combinations_with_replacement(range(len(per_gpu)), G)))
    holds = per_gpu[pick]
    counts = holds.sum(axis=1)
    ok = (counts >= 1).all(axis=1)
    return holds[ok], counts[ok]


def _brute_ratio(load_E: np.ndarray, G: int, S: int) -> float:
    """The least max/mean GPU load over every count vector and placement (an even split)."""
    holds, counts = _every_placement(load_E.size, S, G)
    gpu = (holds * (load_E / counts)[:, None, :]).sum(axis=-1)
    return float((gpu.max(axis=1) / gpu.mean(axis=1)).min())


def _ratio(load_LE: np.ndarray, phy2log_LP: np.ndarray, G: int, N: int) -> np.ndarray:
    g = gpu_load(load_LE.astype(np.float64), Placement.from_phy2log(np.asarray(phy2log_LP), G, N))
    return np.asarray(g.max(axis=-1) / g.mean(axis=-1))


def _small_case(rng: np.random.Generator) -> tuple[np.ndarray, int, int, int]:
    """(load [E], G, N, S): 4-6 experts, 2-4 GPUs, 1-2 nodes, at most 12 slots; hot experts often."""
    while True:
        E, G = int(rng.integers(4, 7)), int(rng.choice([2, 3, 4]))
        N = int(rng.choice([n for n in (1, 2) if G % n == 0]))
        S = -(-E // G) + int(rng.integers(0, 2))
        if G * S <= 12:
            break
    kind = int(rng.integers(0, 3))
    if kind == 0:
        load = rng.gamma(0.5, 100.0, E)
    elif kind == 1:
        load = np.ones(E)
        load[rng.integers(E)] = rng.uniform(5.0, 1000.0)
    else:
        load = rng.integers(0, 20, E).astype(np.float64)
        load[0] += rng.integers(50, 500)
    return np.round(load).astype(np.float32) + np.float32(load.sum() == 0), G, N, S


@pytest.mark.parametrize("seed", range(3))
def test_within_two_percent_wherever_a_plan_within_one_exists(seed: int) -> None:
    rng = np.random.default_rng(seed)
    reached = 0
    for _ in range(40):
        load, G, N, S = _small_case(rng)
        best = _brute_ratio(load.astype(np.float64), G, S)
        phy2log = rebalance_experts(load[None], G * S, 1, N, G)[0].numpy()
        got = float(_ratio(load[None], phy2log, G, N)[0])
        assert got >= best - 1e-9, "the brute force is the least"
        if best <= 1.01:
            reached += 1
            assert got <= 1.02, (load.tolist(), G, N, S, best, got, phy2log.tolist())
    assert reached >= 10, "the instances include plans within 1%"


def test_never_worse_and_plans_without_stacking_stay() -> None:
    rng = np.random.default_rng(7)
    L, E, G, P = 12, 16, 4, 24
    load_LE = rng.gamma(0.6, 50.0, (L, E))
    load_LE[::3, 0] = load_LE[::3].sum(axis=1) * 20  # a very hot expert every third layer
    # Random rows, and where the expert is very hot the greedy's (its counts stack it).
    rows = np.stack(
        [rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, P - E)])) for _ in range(L)]
    )
    rows[::3] = deepseek_rebalance(load_LE[::3], P, 1, 1, G)[0]
    scenarios = load_LE[None]
    one = np.ones(1)
    stats: dict[str, float] = {}
    out = recount_phy2log(rows, scenarios, one, G, stats)
    before, after = _ratio(load_LE, rows, G, 1), _ratio(load_LE, out, G, 1)
    assert (after <= before + 1e-9).all()
    stacked = set(stacked_layers(rows, scenarios, one, G).tolist())
    for layer in range(L):
        if before[layer] <= SEARCH_FROM:  # within 2% of even: left exactly as it was
            np.testing.assert_array_equal(out[layer], rows[layer])
    hot = [layer for layer in range(0, L, 3) if layer in stacked and before[layer] > SEARCH_FROM]
    assert hot and stats["recounted_layers"] >= len(hot)
    assert (after[hot] <= 1.02).all(), after[hot]
    assert (np.sort(out, axis=1)[:, :E] >= 0).all() and all(np.unique(r).size == E for r in out)


@pytest.mark.parametrize(
    ("E", "G", "N", "P"), [(16, 4, 2, 24), (32, 8, 2, 48), (64, 8, 2, 80), (256, 32, 4, 288)]
)
def test_a_very_hot_expert_spreads_over_gpus_and_nodes(E: int, G: int, N: int, P: int) -> None:
    rng = np.random.default_rng(E)
    L = 3
    load_LE = rng.gamma(2.0, 10.0, (L, E))
    hot_L = rng.integers(0, E, L)
    load_LE[np.arange(L), hot_L] = load_LE.sum(axis=1) * np.array([0.5, 1.5, 3.0])
    plan = solve(load_LE, Topology(num_gpus=G, num_nodes=N, num_physical=P), None, SolveOptions())
    assert (_ratio(load_LE, plan.placement.phy2log_LP, G, N) <= 1.02).all()
    phy2log_LP = plan.placement.phy2log_LP
    for layer in range(L):
        _no_unstacking_pays(load_LE[layer], phy2log_LP[layer], G, int(hot_L[layer]))
        on_G = (phy2log_LP[layer] == hot_L[layer]).reshape(G, -1).sum(axis=1)
        if on_G.sum() <= G:
            # No stacking needed: one replica per GPU, and every node its share of them, within one.
            on_N = on_G.reshape(N, -1).sum(axis=1)
            assert on_G.max() == 1 and on_N.max() - on_N.min() <= 1, on_G


def _no_unstacking_pays(load_E: np.ndarray, row_P: np.ndarray, G: int, expert: int) -> None:
    """No replica of ``expert`` on a GPU holding two moves to a GPU holding none (trading slots
    with any of its replicas) for a lower busiest GPU: by exhaustion."""
    S = row_P.size // G
    cnt_E = np.bincount(row_P, minlength=load_E.size)

    def peak(row: np.ndarray) -> float:
        return float((load_E[row] / cnt_E[row]).reshape(G, S).sum(axis=1).max())

    now = peak(row_P)
    holds_G = (row_P == expert).reshape(G, S).sum(axis=1)
    for g in np.flatnonzero(holds_G >= 2):
        a = int(g * S + np.flatnonzero(row_P[g * S : (g + 1) * S] == expert)[0])
        for h in np.flatnonzero(holds_G == 0):
            for b in range(h * S, (h + 1) * S):
                trial = row_P.copy()
                trial[[a, b]] = trial[[b, a]]
                assert peak(trial) >= now * (1 - 1e-9), (g, h, b)


# vLLM's own test inputs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_algo_tests() -> dict[str, dict[str, Any]]:
    from benchmarks.peers import fetch_vllm_test

    try:
        path = fetch_vllm_test("tests/distributed/test_eplb_algo.py")
    except OSError as exc:  # no network: say so rather than pass
        pytest.skip(f"vLLM's sdist could not be fetched from PyPI: {exc}")
    return _literal_cases(path.read_text())


def _literal_cases(source: str) -> dict[str, dict[str, Any]]:
    """Each test function's literal assignments (``weight = torch.tensor([...])``, ``num_gpus = 4``)
    where it calls ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)``."""
    cases: dict[str, dict[str, Any]] = {}
    for fn in ast.parse(source).body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        values: dict[str, Any] = {}
        for node in fn.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                value = node.value
                if isinstance(value, ast.Call) and getattr(value.func, "attr", "") == "tensor" and value.args:
                    value = value.args[0]
                try:
                    values[node.targets[0].id] = ast.literal_eval(value)
                except ValueError:
                    continue
        calls = "rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus" in ast.unparse(fn)
        wanted = {"weight", "num_replicas", "num_groups", "num_nodes", "num_gpus"}
        if calls and wanted <= values.keys():
            cases[fn.name] = {k: values[k] for k in wanted}
    return cases


def _plan_ratio(case: dict[str, Any], algorithm: str) -> np.ndarray:
    weight = np.asarray(case["weight"], dtype=np.float32)
    G, N = case["num_gpus"], case["num_nodes"]
    options = SolveOptions(algorithm=algorithm)
    phy2log = rebalance_experts(weight, case["num_replicas"], case["num_groups"], N, G, options=options)[0]
    return _ratio(weight, phy2log.numpy(), G, N)


def test_vllm_extreme_weight_imbalance(vllm_algo_tests: dict[str, dict[str, Any]]) -> None:
    case = vllm_algo_tests["test_extreme_weight_imbalance"]
    assert case["weight"][0][0] >= 100 * max(case["weight"][0][1:]), "the input is the very hot expert"
    ratio = _plan_ratio(case, "auto")
    assert ratio.max() <= 1.05, ratio
    # vLLM's own assertion: the hot expert has more replicas than the others.
    weight = np.asarray(case["weight"], dtype=np.float32)
    phy2log = rebalance_experts(
        weight, case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"]
    )
    logcnt = phy2log[2].numpy()
    assert logcnt[0, 0] > logcnt[0, 1]


def test_vllm_inputs_no_worse_than_deepseek(vllm_algo_tests: dict[str, dict[str, Any]]) -> None:
    """On every input of vLLM's algorithm tests, eplb's plan is as balanced as DeepSeek's
    algorithm (vLLM's default policy) or more, layer by layer."""
    assert len(vllm_algo_tests) >= 5, sorted(vllm_algo_tests)
    for name, case in vllm_algo_tests.items():
        ours, theirs = _plan_ratio(case, "auto"), _plan_ratio(case, "deepseek")
        assert (ours <= theirs + 1e-6).all(), (name, ours, theirs)


def _best_single_change(load_E: np.ndarray, row_P: np.ndarray, G: int, N: int) -> float:
    """The least max/mean over every placement one slot's change of expert away from ``row_P``
    (every expert keeping a replica): by exhaustion."""
    best = float(_ratio(load_E[None], row_P[None], G, N)[0])
    for slot in range(row_P.size):
        for expert in range(load_E.size):
            trial = row_P.copy()
            trial[slot] = expert
            if np.unique(trial).size == load_E.size:
                best = min(best, float(_ratio(load_E[None], trial[None], G, N)[0]))
    return best


@pytest.mark.parametrize(("E", "G", "N"), [(8, 4, 2), (12, 4, 1), (20, 8, 2)])
def test_a_budgeted_plan_unstacks_an_expert_held_by_every_gpu(E: int, G: int, N: int) -> None:
    """The hot expert on every GPU and twice on one (the greedy's counts): no swap helps and no
    other expert has a replica to give; a plan under a one-copy budget frees the stacked slot."""
    rng = np.random.default_rng(E + G)
    S = (E + G) // G + 1
    load_E = rng.gamma(2.0, 10.0, E)
    load_E[0] = 1000.0 * load_E[1:].max()
    rows_GS = np.zeros((G, S), dtype=np.int64)  # slot 0 of every GPU and slot 1 of GPU 0: expert 0
    others = np.concatenate([np.arange(1, E), rng.integers(1, E, G * S - G - 1 - (E - 1))])
    free = np.ones((G, S), dtype=bool)
    free[:, 0] = free[0, 1] = False
    rows_GS[free] = rng.permutation(others)
    row_P = rows_GS.ravel()
    current = Placement.from_phy2log(row_P[None], G, N)
    before = float(_ratio(load_E[None], row_P[None], G, N)[0])
    topology = Topology(num_gpus=G, num_nodes=N, num_physical=G * S)
    plan = solve(
        np.repeat(load_E[None, None], 50, axis=0), topology, current, SolveOptions(max_moved_experts=1)
    )
    after = float(_ratio(load_E[None], plan.placement.phy2log_LP, G, N)[0])
    assert plan.apply and after < before
    assert after <= _best_single_change(load_E, row_P, G, N) + 0.01, (before, after)


def test_vllm_extreme_weight_imbalance_under_a_move_budget(
    vllm_algo_tests: dict[str, dict[str, Any]],
) -> None:
    """From the greedy counts' plan of vLLM's input (DeepSeek's global policy: five replicas of the
    hot expert, one on every GPU and two on one, 1.593), a continuous-style plan with a budget of
    one copy reaches <= 1.05 (it stayed at 1.593: no swap or giver off the hot GPU helps)."""
    case = vllm_algo_tests["test_extreme_weight_imbalance"]
    weight = np.asarray(case["weight"], dtype=np.float32)
    G, N, P = case["num_gpus"], case["num_nodes"], case["num_replicas"]
    current = Placement.from_phy2log(np.asarray(deepseek_rebalance(weight, P, 1, 1, G)[0]), G, N)
    assert _ratio(weight, current.phy2log_LP, G, N).max() > 1.5, "the greedy's counts stack the hot expert"
    topology = Topology(num_gpus=G, num_nodes=N, num_physical=P, num_groups=case["num_groups"])
    plan = solve(np.repeat(weight[None], 50, axis=0), topology, current, SolveOptions(max_moved_experts=1))
    assert plan.apply and _ratio(weight, plan.placement.phy2log_LP, G, N).max() <= 1.05


def _best_changes(load_E: np.ndarray, row_P: np.ndarray, G: int, N: int, k: int) -> tuple[float, float]:
    """(the least max/mean over every placement at most one change of ``k`` slots away, with one
    change only): by exhaustion over every set of ``k`` slots and every expert for each."""
    E = load_E.size
    best = {1: float(_ratio(load_E[None], row_P[None], G, N)[0]), k: np.inf}
    for n in (1, k):
        for slots in itertools.combinations(range(row_P.size), n):
            for experts in itertools.product(range(E), repeat=n):
                trial = row_P.copy()
                trial[list(slots)] = experts
                if np.unique(trial).size == E:
                    best[n] = min(best[n], float(_ratio(load_E[None], trial[None], G, N)[0]))
    return min(best[k], best[1]), best[1]


@pytest.mark.parametrize(("N", "seed"), [(1, 0), (2, 1), (3, 2)])
def test_a_budgeted_plan_unstacks_an_expert_stacked_on_two_gpus(N: int, seed: int) -> None:
    """Two very hot experts, A once on each GPU of one half and again on two of them, B once on
    each GPU of the other half, every other expert once (DeepSeek's counts at EP32 with two hot
    experts): no single change gains (no expert has a replica to give; moving a stacked A
    makes its new GPU as hot), so a one-move search stops there; a plan under a two-copy budget
    frees both stacked slots at once, within 0.01 of the best two changes found by exhaustion."""
    G, S = 6, 3
    E = G * S - G  # A's G/2 + 2 replicas and B's G/2 take G + 2 slots, the other experts one each
    rng = np.random.default_rng(seed)
    load_E = rng.gamma(2.0, 10.0, E)
    load_E[0] = 100.0 * load_E[2:].max()
    load_E[1] = load_E[0] * rng.uniform(0.9, 1.1)
    rows_GS = np.zeros((G, S), dtype=np.int64)
    rows_GS[G // 2 :, 0] = 1
    free = np.ones((G, S), dtype=bool)
    free[:, 0] = free[0, 1] = free[1, 1] = False
    rows_GS[free] = rng.permutation(np.arange(2, E))
    row_P = rows_GS.ravel()
    before = float(_ratio(load_E[None], row_P[None], G, N)[0])
    best_two, best_one = _best_changes(load_E, row_P, G, N, 2)
    assert best_one >= before - 1e-9 and best_two < before - 0.05, "only two changes at once gain"
    topology = Topology(num_gpus=G, num_nodes=N, num_physical=G * S)
    current = Placement.from_phy2log(row_P[None], G, N)
    plan = solve(
        np.repeat(load_E[None, None], 50, axis=0), topology, current, SolveOptions(max_moved_experts=2)
    )
    after = float(_ratio(load_E[None], plan.placement.phy2log_LP, G, N)[0])
    assert plan.apply and after <= best_two + 0.01, (before, after, best_two)
    assert plan.stats["budget_unstacks"] == 1
