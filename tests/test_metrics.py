"""PrometheusSink: values against plain numpy, names against eplb.metrics.names, bounded series, copies.

Shape legend: L layers, E logical experts, G GPUs, K hottest experts per layer.

Every sample carries the sink's engine labels; ``by_name`` checks them on each sample and drops
them, so the assertions below compare each metric's own labels.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from eplb import __version__
from eplb.metrics import names
from eplb.metrics.causes import REBALANCE_CAUSES, causes_of
from eplb.metrics.prometheus import PrometheusSink
from eplb.metrics.sink import MetricsSink, NullSink

Sample = tuple[str, tuple[tuple[str, str], ...], float]
DEFAULT_ENGINE = {"engine": "0", "model_name": "unknown"}


def samples(text: bytes | str) -> list[Sample]:
    raw = text.decode() if isinstance(text, bytes) else text
    return [
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in text_string_to_metric_families(raw)
        for s in family.samples
    ]


def by_name(
    text: bytes, name: str, engine: dict[str, str] = DEFAULT_ENGINE
) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of ``name`` by their own labels, after checking each carries exactly ``engine``'s."""
    out = {}
    for n, labels, value in samples(text):
        if n == name:
            assert {k: v for k, v in labels if k in engine} == engine, labels
            out[tuple((k, v) for k, v in labels if k not in engine)] = value
    return out


def sample_value(sink: PrometheusSink, name: str, labels: dict[str, str] | None = None) -> float | None:
    """``sink.registry.get_sample_value`` with the default engine labels added."""
    return sink.registry.get_sample_value(name, {**(labels or {}), **DEFAULT_ENGINE})


GOOD_REBALANCE: dict[str, object] = dict(
    outcome="applied",
    reason="",
    solve_seconds=0.0,
    transfer_seconds=0.0,
    experts_moved=0,
    bytes_moved=0,
    balancedness_before=1.0,
    balancedness_after=1.0,
)
GOOD_TOPOLOGY = dict(num_layers=2, num_logical=8, num_physical=8, num_gpus=2, num_nodes=1)


def window(rng: np.random.Generator, L: int, E: int, G: int) -> tuple[np.ndarray, np.ndarray]:
    logical_LE = rng.integers(0, 1000, size=(L, E)).astype(np.float64)
    gpu_LG = rng.integers(0, 5000, size=(L, G)).astype(np.float64)
    return logical_LE, gpu_LG


def full_sink(*, per_expert: bool = False, top_k: int = 3) -> tuple[PrometheusSink, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    sink = PrometheusSink(hot_experts_per_layer=top_k, per_expert=per_expert)
    sink.on_topology(num_layers=12, num_logical=10, num_physical=12, num_gpus=4, num_nodes=2)
    logical_LE, gpu_LG = window(rng, 12, 10, 4)
    sink.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG)
    for kind, recorded in [("prefill", True), ("prefill", True), ("decode", False)]:
        sink.on_forward_pass(kind=kind, recorded=recorded)  # type: ignore[arg-type]
    sink.on_rebalance(
        outcome="applied",
        reason="gain 0.12 > cost",
        solve_seconds=0.3,
        transfer_seconds=2.0,
        experts_moved=7,
        bytes_moved=7 * 44_040_192,
        balancedness_before=0.61,
        balancedness_after=0.93,
    )
    sink.phase.clock = lambda: 107.5  # the phase gauges derive seconds at scrape time: a fixed clock
    sink.on_phase(phase="solving", in_flight_since=100.0, last_rebalance_at=40.0)
    return sink, logical_LE, gpu_LG


def test_implements_the_manager_protocol() -> None:
    sink: MetricsSink = PrometheusSink()
    null: MetricsSink = NullSink()
    assert callable(sink.on_window) and callable(null.on_window)


def test_null_sink_ignores_every_event() -> None:
    null = NullSink()
    logical_LE, gpu_LG = window(np.random.default_rng(0), 2, 8, 2)
    assert null.on_topology(**GOOD_TOPOLOGY) is None
    assert null.on_forward_pass(kind="prefill", recorded=True) is None
    assert null.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG) is None
    assert null.on_rebalance(**GOOD_REBALANCE) is None
    assert vars(null) == {}


def test_window_values_match_numpy_reference() -> None:
    sink, logical_LE, gpu_LG = full_sink()
    text = sink.render()
    layers, ranks = [str(i) for i in range(12)], [str(g) for g in range(4)]
    balance_L = gpu_LG.mean(axis=1) / gpu_LG.max(axis=1)
    got = by_name(text, names.LAYER_BALANCEDNESS)
    assert got == pytest.approx({(("layer", layers[i]),): balance_L[i] for i in range(12)})
    assert by_name(text, names.MODEL_BALANCEDNESS)[()] == pytest.approx(balance_L.mean())
    tokens = by_name(text, names.RANK_TOKENS)
    assert tokens == {
        (("layer", layers[i]), ("rank", ranks[g])): gpu_LG[i, g] for i in range(12) for g in range(4)
    }
    # Hottest: brute force over each row, ties broken by the lower expert id.
    hot = by_name(text, names.HOT_EXPERT_TOKENS)
    expect = {}
    for i in range(12):
        order = sorted(range(10), key=lambda e, i=i: (-logical_LE[i, e], e))[:3]
        expect.update({(("expert", str(e)), ("layer", layers[i])): logical_LE[i, e] for e in order})
    assert hot == expect


def test_event_values() -> None:
    sink, _, _ = full_sink()
    assert sample_value(sink, names.FORWARD_PASSES, {"kind": "prefill", "recorded": "true"}) == 2
    assert sample_value(sink, names.FORWARD_PASSES, {"kind": "decode", "recorded": "false"}) == 1
    assert sample_value(sink, names.FORWARD_PASSES, {"kind": "decode", "recorded": "true"}) == 0
    assert sample_value(sink, names.REBALANCES, {"outcome": "applied", "cause": "applied"}) == 1
    assert sample_value(sink, names.EXPERTS_MOVED) == 7
    assert sample_value(sink, names.MOVED_BYTES) == 7 * 44_040_192
    assert sample_value(sink, names.SOLVE_SECONDS + "_sum") == pytest.approx(0.3)
    assert sample_value(sink, names.SOLVE_SECONDS + "_bucket", {"le": "0.25"}) == 0
    assert sample_value(sink, names.SOLVE_SECONDS + "_bucket", {"le": "0.5"}) == 1
    assert sample_value(sink, names.TRANSFER_SECONDS + "_count") == 1
    assert sample_value(sink, names.LAST_REBALANCE_BALANCEDNESS, {"when": "after"}) == pytest.approx(0.93)
    info = {
        "version": __version__,
        "num_layers": "12",
        "num_logical": "10",
        "num_physical": "12",
        "num_gpus": "4",
        "num_nodes": "2",
    }
    assert sample_value(sink, names.INFO, info) == 1


def test_phase_in_flight_and_age_are_derived_when_scraped() -> None:
    sink, _, _ = full_sink()
    phases = by_name(sink.render(), names.MANAGER_PHASE)
    assert phases == {(("phase", p),): float(p == "solving") for p in names.MANAGER_PHASES}
    assert by_name(sink.render(), names.IN_FLIGHT_SECONDS) == {(): 7.5}
    assert by_name(sink.render(), names.LAST_REBALANCE_AGE) == {(): 67.5}
    sink.phase.clock = lambda: 110.0  # nothing reported meanwhile (the manager may be blocked)
    assert by_name(sink.render(), names.IN_FLIGHT_SECONDS) == {(): 10.0}
    sink.on_phase(phase="idle", in_flight_since=None, last_rebalance_at=109.0)
    assert by_name(sink.render(), names.IN_FLIGHT_SECONDS) == {(): 0.0}
    assert by_name(sink.render(), names.LAST_REBALANCE_AGE) == {(): 1.0}
    assert by_name(sink.render(), names.MANAGER_PHASE)[(("phase", "idle"),)] == 1.0
    with pytest.raises(ValueError, match="phase"):
        sink.on_phase(phase="resting", in_flight_since=None, last_rebalance_at=0.0)  # type: ignore[arg-type]


def test_skipped_rebalance_counts_but_moves_nothing() -> None:
    sink = PrometheusSink()
    for outcome in ("skipped", "skipped", "failed"):
        sink.on_rebalance(
            outcome=outcome,
            reason="threshold",
            solve_seconds=0.01,
            transfer_seconds=0.0 if outcome == "skipped" else 1.5,
            experts_moved=5,
            bytes_moved=500,
            balancedness_before=0.95,
            balancedness_after=0.96,
        )
    assert sample_value(sink, names.REBALANCES, {"outcome": "skipped", "cause": "skipped_threshold"}) == 2
    assert sample_value(sink, names.REBALANCES, {"outcome": "failed", "cause": "failed_other"}) == 1
    assert sample_value(sink, names.SOLVE_SECONDS + "_count") == 3
    assert sample_value(sink, names.TRANSFER_SECONDS + "_count") == 1  # only the failed one transferred
    assert sample_value(sink, names.EXPERTS_MOVED) == 5
    assert sample_value(sink, names.MOVED_BYTES) == 500


def test_last_rebalance_keeps_one_series_per_cause_and_no_reason_text() -> None:
    sink = PrometheusSink()
    for i in range(50):
        sink.on_rebalance(**{**GOOD_REBALANCE, "reason": f"reason {i}"})  # type: ignore[arg-type]
    sink.on_rebalance(**{**GOOD_REBALANCE, "outcome": "skipped", "reason": "x\n" * 200})  # type: ignore[arg-type]
    got = by_name(sink.render(), names.LAST_REBALANCE_TIMESTAMP)
    assert len(got) == 2
    labels = [dict(k) for k in got]
    assert {"outcome": "applied", "cause": "applied"} in labels
    assert {"outcome": "skipped", "cause": "skipped_other"} in labels
    # The free text is nowhere in the exposition: not as a label, not truncated.
    assert b"reason 49" not in sink.render() and b"xx" not in sink.render().replace(b"\n", b"")


def test_label_set_is_bounded_after_many_rebalances_with_distinct_reasons() -> None:
    # Two thousand rebalances whose reasons all differ (numbers, layer lists, errors, junk): the
    # scrape keeps the series it had once every cause was seen, and the cause values are the list's.
    rng = np.random.default_rng(3)
    sink = PrometheusSink()
    templates = {
        "applied": [
            "predicted balancedness {a:.4f} -> {b:.4f} for {n} expert copies",
            "no current placement",
        ],
        "skipped": [
            "balancedness {a:.4f} above threshold {b}",
            "the window holds no load",
            "predicted balancedness gain {d:+.4f} ({a:.4f} -> {b:.4f}) < min_gain {c}",
            "moves {n} expert copies ({m} bytes), over max_bytes_moved={m}",
            "the plan equals the current placement",
            "custom planner says no ({n})",
        ],
        "failed": [
            "planner failed: ValueError: bad load {a}",
            "hot-swap of layers [{n}] failed and was rolled back: chunk {n} wait: TimeoutError: not done after {c} s",
            "hot-swap of layers [{n}] failed and was rolled back: chunk {n} verify: checksum mismatch in transfers [{n}]",
            "preparing the swap failed on another rank",
            "hot-swap of layers [{n}] failed and was rolled back: RuntimeError: {n} rank(s) could not allocate {m} bytes",
            "junk {a} {m}",
        ],
    }
    seen: list[set[tuple[str, tuple[tuple[str, str], ...]]]] = []
    for i in range(2000):
        outcome = ("applied", "skipped", "failed")[i % 3]
        reason = templates[outcome][int(rng.integers(len(templates[outcome])))].format(
            a=rng.random(),
            b=rng.random(),
            c=rng.random(),
            d=rng.random() - 0.5,
            n=int(rng.integers(1 << 20)),
            m=int(rng.integers(1 << 40)),
        )
        sink.on_rebalance(**{**GOOD_REBALANCE, "outcome": outcome, "reason": reason})  # type: ignore[arg-type]
        if i in (299, 1999):
            seen.append({(name, labels) for name, labels, _ in samples(sink.render())})
    assert seen[0] == seen[1]
    per_family: dict[str, int] = {}
    for name, labels in seen[1]:
        per_family[name] = per_family.get(name, 0) + 1
        cause = dict(labels).get("cause")
        assert cause is None or cause in REBALANCE_CAUSES, labels
        if name in (names.REBALANCES, names.LAST_REBALANCE_TIMESTAMP):
            assert {k for k, _ in labels} == {"outcome", "cause", *names.ENGINE_LABELS}
    fixed = sum(len(causes_of(o)) for o in names.REBALANCE_OUTCOMES)
    assert fixed == len(REBALANCE_CAUSES)
    assert per_family[names.REBALANCES] == fixed  # every (outcome, cause), from the start
    assert per_family[names.LAST_REBALANCE_TIMESTAMP] == 1 + 6 + 6  # one per cause the reasons hit
    assert len(seen[1]) < 120


@pytest.mark.parametrize("per_expert", [False, True])
def test_render_equals_prometheus_client_and_names_come_from_one_place(per_expert: bool) -> None:
    sink, logical_LE, _ = full_sink(per_expert=per_expert)
    fast, reference = sink.render(), generate_latest(sink.registry)
    assert sorted(samples(fast)) == sorted(samples(reference))
    exported = {name for name, _, _ in samples(fast)}
    assert exported <= names.all_series_names(per_expert=per_expert)
    for spec in names.METRICS:
        # Every declared family is exported once its event happened (the optional one only when enabled).
        assert bool(exported & spec.series_names()) == (per_expert or not spec.per_expert), spec.name
    expert = by_name(fast, names.EXPERT_TOKENS)
    assert len(expert) == (logical_LE.size if per_expert else 0)


def test_series_count_is_bounded_by_layers_times_ranks() -> None:
    L, E, G = 58, 256, 32
    sink = PrometheusSink(hot_experts_per_layer=8)
    sink.on_topology(num_layers=L, num_logical=E, num_physical=288, num_gpus=G, num_nodes=4)
    logical_LE, gpu_LG = window(np.random.default_rng(0), L, E, G)
    sink.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG)
    counts: dict[str, int] = {}
    for name, _, _ in samples(sink.render()):
        counts[name] = counts.get(name, 0) + 1
    assert counts[names.RANK_TOKENS] == L * G
    assert counts[names.HOT_EXPERT_TOKENS] == L * 8
    assert counts[names.LAYER_BALANCEDNESS] == L
    assert names.EXPERT_TOKENS not in counts
    assert sum(counts.values()) < L * G + L * 8 + L + 200


def test_label_values_are_plain_integers() -> None:
    # As SGLang (layer="7") and vLLM write them, so queries join on them: never "07".
    assert names.index_labels(0) == []
    assert names.index_labels(1) == ["0"]
    labels = names.index_labels(58)
    assert labels[:2] == ["0", "1"] and labels[7] == "7" and labels[-1] == "57"
    assert labels == [str(int(v)) for v in labels] and sorted(labels, key=int) == labels
    with pytest.raises(ValueError):
        names.index_labels(-1)
    # The exposition: every layer, rank and expert label of a 12-layer window is str(int).
    sink, _, _ = full_sink()
    for name, labels_, _ in samples(sink.render()):
        for key, value in labels_:
            if key in ("layer", "rank", "expert"):
                assert value == str(int(value)), (name, labels_)


def test_window_is_copied_not_referenced() -> None:
    sink = PrometheusSink(hot_experts_per_layer=1)
    logical_LE = np.ones((2, 3))
    gpu_LG = np.array([[1.0, 3.0], [2.0, 2.0]])
    sink.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG)
    gpu_LG[:] = 100.0
    logical_LE[:] = 7.0
    assert by_name(sink.render(), names.RANK_TOKENS)[(("layer", "0"), ("rank", "1"))] == 3.0
    assert by_name(sink.render(), names.MODEL_BALANCEDNESS)[()] == pytest.approx((2 / 3 + 1) / 2)


def test_nasty_windows() -> None:
    sink = PrometheusSink(hot_experts_per_layer=5, min_render_interval_s=0.0)
    # NaN loads, an all-zero layer, one expert taking everything, K larger than E, int32 input.
    logical_LE = np.array([[np.nan, 1, 2, 3], [0, 0, 0, 0], [0, 0, 9, 0]], dtype=np.float64)
    gpu_LG = np.array([[np.nan, 1.0], [0.0, 0.0], [9.0, 0.0]])
    sink.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG)
    text = sink.render()
    assert sorted(map(str, samples(text))) == sorted(map(str, samples(generate_latest(sink.registry))))
    balance = by_name(text, names.LAYER_BALANCEDNESS)
    assert math.isnan(balance[(("layer", "0"),)])
    assert balance[(("layer", "1"),)] == 1.0  # no load counts as balanced
    assert balance[(("layer", "2"),)] == 0.5
    hot = by_name(text, names.HOT_EXPERT_TOKENS)
    layer0 = {dict(k)["expert"]: v for k, v in hot.items() if dict(k)["layer"] == "0"}
    assert len(layer0) == 4 and list(layer0)[:3] == ["3", "2", "1"] and math.isnan(layer0["0"])
    assert max((v, dict(k)["expert"]) for k, v in hot.items() if dict(k)["layer"] == "2") == (9.0, "2")
    sink.on_window(
        logical_load_LE=np.zeros((2, 3), dtype=np.int32), gpu_load_LG=np.zeros((2, 1), dtype=np.int32)
    )
    assert by_name(sink.render(), names.MODEL_BALANCEDNESS)[()] == 1.0


def test_windows_faster_than_the_render_interval_are_served_from_the_last_render() -> None:
    sink = PrometheusSink(min_render_interval_s=0.3)

    def scraped_tokens() -> float:
        return by_name(sink.render(), names.RANK_TOKENS)[(("layer", "0"), ("rank", "0"))]

    sink.on_window(logical_load_LE=np.ones((1, 2)), gpu_load_LG=np.full((1, 1), 1.0))
    assert scraped_tokens() == 1.0
    sink.on_window(logical_load_LE=np.ones((1, 2)), gpu_load_LG=np.full((1, 1), 2.0))
    assert scraped_tokens() == 1.0  # within the interval: the last render
    # The registry path is never throttled.
    assert sample_value(sink, names.RANK_TOKENS, {"layer": "0", "rank": "0"}) == 2.0
    time.sleep(0.35)
    assert scraped_tokens() == 2.0
    with pytest.raises(ValueError):
        PrometheusSink(min_render_interval_s=-1.0)


def test_before_any_event_nothing_is_made_up() -> None:
    sink = PrometheusSink()
    exported = {n for n, _, _ in samples(sink.render())}
    for name in (
        names.RANK_TOKENS,
        names.LAST_REBALANCE_BALANCEDNESS,
        names.LAST_REBALANCE_TIMESTAMP,
        names.MANAGER_PHASE,
        names.IN_FLIGHT_SECONDS,
    ):
        assert name not in exported
    assert sorted(samples(sink.render())) == sorted(samples(generate_latest(sink.registry)))
    # The version is known from the start; the topology joins it once reported.
    assert by_name(sink.render(), names.INFO) == {(("version", __version__),): 1.0}


def test_sinks_use_their_own_registry() -> None:
    before = {m.name for m in REGISTRY.collect()}
    a, b = PrometheusSink(), PrometheusSink()
    a.on_forward_pass(kind="decode", recorded=False)
    assert sample_value(b, names.FORWARD_PASSES, {"kind": "decode", "recorded": "false"}) == 0
    assert {m.name for m in REGISTRY.collect()} == before


@pytest.mark.parametrize(
    ("method", "kwargs"),
    [
        ("on_forward_pass", dict(kind="extend", recorded=True)),
        ("on_rebalance", {**GOOD_REBALANCE, "outcome": "maybe"}),
        ("on_rebalance", {**GOOD_REBALANCE, "solve_seconds": float("nan")}),
        ("on_rebalance", {**GOOD_REBALANCE, "transfer_seconds": -1.0}),
        ("on_rebalance", {**GOOD_REBALANCE, "experts_moved": -3}),
        ("on_window", dict(logical_load_LE=np.zeros(4), gpu_load_LG=np.zeros((1, 4)))),
        ("on_window", dict(logical_load_LE=np.zeros((2, 4)), gpu_load_LG=np.zeros((3, 4)))),
        ("on_topology", {**GOOD_TOPOLOGY, "num_physical": 6}),  # fewer slots than experts
        ("on_topology", {**GOOD_TOPOLOGY, "num_physical": 9}),  # not divisible by GPUs
        ("on_topology", {**GOOD_TOPOLOGY, "num_layers": 0}),
        ("on_topology", {**GOOD_TOPOLOGY, "num_nodes": 4}),  # more nodes than GPUs
    ],
)
def test_bad_input_is_a_value_error(method: str, kwargs: dict[str, object]) -> None:
    sink = PrometheusSink()
    with pytest.raises(ValueError):
        getattr(sink, method)(**kwargs)


def test_good_input_of_the_bad_input_cases_is_accepted() -> None:
    # The cases above fail for the one field they change, not for the rest.
    sink = PrometheusSink()
    sink.on_rebalance(**GOOD_REBALANCE)  # type: ignore[arg-type]
    sink.on_topology(**GOOD_TOPOLOGY)
    assert sample_value(sink, names.REBALANCES, {"outcome": "applied", "cause": "applied"}) == 1


def test_window_shape_must_match_the_topology() -> None:
    sink = PrometheusSink()
    sink.on_topology(num_layers=2, num_logical=8, num_physical=8, num_gpus=2, num_nodes=1)
    sink.on_window(logical_load_LE=np.zeros((2, 8)), gpu_load_LG=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="topology"):
        sink.on_window(logical_load_LE=np.zeros((2, 8)), gpu_load_LG=np.zeros((2, 4)))


def test_concurrent_windows_and_scrapes_are_consistent() -> None:
    # Each window has all-equal GPU loads of one value v, so a torn read (tokens of one window with
    # balancedness of another) is visible; rendering must also never raise while windows swap.
    sink = PrometheusSink(hot_experts_per_layer=2)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        v = 1.0
        while not stop.is_set():
            gpu_LG = np.full((8, 4), v)
            gpu_LG[:, 0] = 2 * v  # balancedness (1.25 v) / (2 v) = 0.625 whatever v is
            sink.on_window(logical_load_LE=np.full((8, 16), v), gpu_load_LG=gpu_LG)
            v += 1.0

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(50):
            text = sink.render()
            if not text:
                continue
            tokens = by_name(text, names.RANK_TOKENS)
            hot = by_name(text, names.HOT_EXPERT_TOKENS)
            if not tokens:
                continue
            v = tokens[(("layer", "0"), ("rank", "1"))]
            assert all(t in (v, 2 * v) for t in tokens.values())
            assert set(hot.values()) == {v}
            assert by_name(text, names.MODEL_BALANCEDNESS)[()] == pytest.approx(0.625)
    except BaseException as exc:  # pragma: no cover - reported below
        errors.append(exc)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not errors, errors


def test_engine_labels_are_on_every_series_and_join_the_engines() -> None:
    # A model name with the characters the text format escapes: the fast render and
    # prometheus_client's writer agree, and every sample carries exactly these two values.
    engine = {"engine": "1", "model_name": 'org/Model-3.1 "chat" \\ v2'}
    sink = PrometheusSink(hot_experts_per_layer=2, per_expert=True, **engine)
    sink.on_topology(**GOOD_TOPOLOGY)
    logical_LE, gpu_LG = window(np.random.default_rng(2), 2, 8, 2)
    sink.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG)
    sink.on_forward_pass(kind="decode", recorded=True)
    sink.on_rebalance(**GOOD_REBALANCE)  # type: ignore[arg-type]
    fast = sink.render()
    assert sorted(samples(fast)) == sorted(samples(generate_latest(sink.registry)))
    exported = samples(fast)
    assert len(exported) > 50
    for name, labels, _ in exported:
        assert {k: v for k, v in labels if k in names.ENGINE_LABELS} == engine, name
    # The same as a default sink's series, label for label, once the engine labels are set aside.
    assert by_name(fast, names.RANK_TOKENS, engine) == pytest.approx(
        {(("layer", str(i)), ("rank", str(g))): gpu_LG[i, g] for i in range(2) for g in range(2)}
    )
    assert sink.engine_labels == tuple(engine.items())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(model_name=""),
        dict(engine=""),
        dict(model_name="two\nlines"),
        dict(engine="tab\there"),
        dict(model_name="m" * (names.MAX_LABEL_CHARS + 1)),
        dict(engine=3),
    ],
)
def test_bad_engine_labels_are_value_errors(kwargs: dict[str, object]) -> None:
    from eplb.metrics.exporter import sink_for_rank

    with pytest.raises(ValueError):
        PrometheusSink(**kwargs)  # type: ignore[arg-type]
    for rank in (0, 1):  # every rank refuses the same flags, whether it exports or not
        with pytest.raises(ValueError):
            sink_for_rank(rank, port=None, **kwargs)  # type: ignore[arg-type]
    PrometheusSink(model_name="m" * names.MAX_LABEL_CHARS, engine="prefill-0")  # the limits themselves pass


def test_explicit_cause_is_checked_against_the_outcome() -> None:
    sink = PrometheusSink()
    sink.on_rebalance(**{**GOOD_REBALANCE, "outcome": "skipped", "cause": "skipped_budget"})  # type: ignore[arg-type]
    assert sample_value(sink, names.REBALANCES, {"outcome": "skipped", "cause": "skipped_budget"}) == 1
    for outcome, cause in [("skipped", "failed_timeout"), ("applied", "skipped_gain"), ("failed", "oops")]:
        with pytest.raises(ValueError):
            sink.on_rebalance(**{**GOOD_REBALANCE, "outcome": outcome, "cause": cause})  # type: ignore[arg-type]
    # A refused event counts nothing.
    assert sum(v for n, _, v in samples(sink.render()) if n == names.REBALANCES) == 1
