"""The synthetic generator: seeded, shaped like the presets, and with the statistics real routers show."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eplb.traces import Trace, load_trace
from eplb.workloads import PRESETS, WorkloadConfig, generate, unbalanced_imbalance


@pytest.fixture(scope="module")
def deepseek() -> Trace:
    return generate(WorkloadConfig(preset="deepseek-v3", num_steps=1200, seed=0))


def test_calibration_deepseek_v3_ep32_max_over_mean_about_2_5(deepseek: Trace) -> None:
    # docs/workloads.md: no balancing, DeepSeek-V3 at EP32 -> max/mean GPU load of about 2.5.
    assert 2.3 <= unbalanced_imbalance(deepseek, 32) <= 2.7
    other_seed = generate(WorkloadConfig(num_steps=400, seed=11))
    assert 2.3 <= unbalanced_imbalance(other_seed, 32) <= 2.7


def test_seeded_and_deterministic() -> None:
    a = generate(WorkloadConfig(preset="tiny", num_steps=50, seed=3))
    b = generate(WorkloadConfig(preset="tiny", num_steps=50, seed=3))
    c = generate(WorkloadConfig(preset="tiny", num_steps=50, seed=4))
    assert a.equals(b)
    assert not np.array_equal(a.counts_FLE, c.counts_FLE)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_their_shapes_and_token_conservation(name: str) -> None:
    m = PRESETS[name]
    trace = generate(WorkloadConfig(preset=name, num_steps=20, seed=1))
    assert trace.counts_FLE.shape == (20, m.num_layers, m.num_experts)
    # Every layer routes exactly tokens * top_k choices, and no expert gets more than every token.
    routed = trace.counts_FLE.sum(axis=2)
    assert (routed == (trace.num_tokens_F * m.top_k)[:, None]).all()
    assert (trace.counts_FLE <= trace.num_tokens_F[:, None, None]).all()
    assert trace.meta["top_k"] == m.top_k


def test_prefill_and_decode_batch_sizes(deepseek: Trace) -> None:
    tokens, prefill = deepseek.num_tokens_F, deepseek.is_prefill_F
    assert 0.2 < prefill.mean() < 0.4
    assert tokens[prefill].min() >= 2048 and tokens[prefill].max() <= 16384
    assert tokens[~prefill].min() >= 32 and tokens[~prefill].max() <= 512


def test_heavy_tail_and_layers_differ(deepseek: Trace) -> None:
    share_LE = deepseek.total_LE() / deepseek.total_LE().sum(axis=1, keepdims=True)
    # Heavy tail: the hottest expert of a layer carries several times the median expert's load.
    ratio_L = share_LE.max(axis=1) / np.median(share_LE, axis=1)
    assert np.median(ratio_L) > 5
    # Layers differ: popularity of one layer says little about another's.
    corr = np.corrcoef(np.log(share_LE + 1e-9))
    off_diag = corr[~np.eye(len(corr), dtype=bool)]
    assert np.abs(off_diag).mean() < 0.3


def test_decode_is_noisier_than_prefill(deepseek: Trace) -> None:
    share_FLE = deepseek.counts_FLE / deepseek.counts_FLE.sum(axis=2, keepdims=True)
    mean_LE = share_FLE.mean(axis=0)
    dev_F = np.abs(share_FLE - mean_LE).sum(axis=(1, 2))
    assert dev_F[~deepseek.is_prefill_F].mean() > 2 * dev_F[deepseek.is_prefill_F].mean()


def test_slow_drift_and_workload_shifts() -> None:
    cfg = WorkloadConfig(
        preset="deepseek-v3",
        num_steps=3000,
        seed=2,
        prefill_fraction=1.0,
        prefill_tokens=(8192, 8192),
        mean_steps_between_shifts=0.0,
    )
    trace = generate(cfg)
    c = trace.counts_FLE.astype(np.float64)

    def window(a: int, b: int) -> np.ndarray:
        return np.log(c[a:b].sum(axis=0) + 1).ravel()

    near = np.corrcoef(window(0, 100), window(100, 200))[0, 1]
    far = np.corrcoef(window(0, 100), window(2900, 3000))[0, 1]
    assert near > far + 0.02  # popularity drifts slowly: nearby windows agree more than distant ones
    shifting = generate(
        WorkloadConfig(preset="tiny", num_steps=3000, seed=2, mean_steps_between_shifts=300.0)
    )
    assert shifting.meta["domain_per_step_changes"] >= 3


@pytest.mark.parametrize("seed", range(3))
def test_the_meta_names_the_steps_where_the_domain_changes(seed: int, tmp_path: Path) -> None:
    """Domains alone shape the load here (no base popularity, groups or drift; prefill only, so
    little noise): a step's routing shares jump exactly where a new domain starts."""
    cfg = WorkloadConfig(
        preset="tiny", num_steps=1500, seed=seed, num_domains=4, domain_sigma=3.0,
        mean_steps_between_shifts=150.0, popularity_sigma=0.0, group_sigma=0.0, drift_sigma=0.0,
        prefill_fraction=1.0,
    )  # fmt: skip
    trace = generate(cfg)
    share_Fx = trace.counts_FLE.reshape(trace.num_steps, -1).astype(np.float64)
    share_Fx /= share_Fx.sum(axis=1, keepdims=True)
    jump_F = np.abs(np.diff(share_Fx, axis=0)).sum(axis=1)  # within a domain about 0.03, across one > 1
    changes = trace.meta["domain_change_steps"]
    assert changes == (np.flatnonzero(jump_F > 0.5) + 1).tolist()
    assert len(changes) >= 5 and trace.meta["domain_per_step_changes"] == len(changes)
    assert all(type(t) is int for t in changes)  # JSON-serialisable as they are
    assert json.loads(json.dumps(trace.meta))["domain_change_steps"] == changes
    assert load_trace(trace.save(tmp_path / "t.safetensors")).meta["domain_change_steps"] == changes
    steady = generate(cfg.with_(mean_steps_between_shifts=0.0))
    assert steady.meta["domain_change_steps"] == [] and steady.meta["domain_per_step_changes"] == 0


def test_invalid_config() -> None:
    with pytest.raises(ValueError, match="preset"):
        WorkloadConfig(preset="gpt-5")
    with pytest.raises(ValueError, match="prefill_fraction"):
        WorkloadConfig(prefill_fraction=1.5)
    with pytest.raises(ValueError, match="decode_tokens"):
        WorkloadConfig(decode_tokens=(10, 5))
    assert generate(WorkloadConfig(preset="tiny", num_steps=0)).num_steps == 0


def test_the_latent_state_is_what_the_counts_were_drawn_from() -> None:
    """``latent`` replays generate's first draws: its domain schedule names the trace's shifts, and
    each step's counts are a multinomial sample of its shares: pooled over the steps of one drift
    knot and domain, the frequencies differ from the shares by the total variation sampling noise
    alone gives (within 10%), and from a neighbouring domain's shares by more."""
    from eplb.workloads import latent

    cfg = WorkloadConfig(
        preset="qwen3-235b-a22b", num_steps=400, seed=5, mean_steps_between_shifts=60.0, drift_knot_steps=20
    )
    trace = generate(cfg)
    hidden = latent(WorkloadConfig.of_trace(trace))
    assert hidden.config == cfg
    changes = (np.flatnonzero(np.diff(hidden.domain_F) != 0) + 1).tolist()
    assert changes == trace.meta["domain_change_steps"] and changes
    shares_FLE = hidden.shares(np.arange(cfg.num_steps))
    np.testing.assert_allclose(shares_FLE.sum(axis=-1), 1.0, atol=1e-12)
    assert (shares_FLE <= 1.0 / cfg.model.top_k + 1e-12).all()  # capped like the draws
    ratios, own, other = [], [], []
    for t0 in range(0, cfg.num_steps - cfg.drift_knot_steps, cfg.drift_knot_steps):
        steps = np.arange(t0, t0 + cfg.drift_knot_steps)
        same = steps[hidden.domain_F[steps] == hidden.domain_F[t0]]
        counts_LE = trace.counts_FLE[same].sum(axis=0).astype(np.float64)
        n_L1 = counts_LE.sum(axis=-1, keepdims=True)
        p_LE = shares_FLE[t0]
        tv = 0.5 * np.abs(counts_LE / n_L1 - p_LE).sum(axis=-1).mean()
        # E|X| = sigma sqrt(2 / pi) for each share's normal approximation.
        noise = 0.5 * np.sqrt(2.0 / np.pi) * np.sqrt(p_LE * (1.0 - p_LE) / n_L1).sum(axis=-1).mean()
        ratios.append(tv / noise)
        later = t0 + cfg.drift_knot_steps
        if hidden.domain_F[later] != hidden.domain_F[t0]:
            own.append(tv)
            other.append(0.5 * np.abs(counts_LE / n_L1 - shares_FLE[later]).sum(axis=-1).mean())
    assert min(ratios) > 0.9 and max(ratios) < 1.1, ratios
    assert other and min(other) > 1.5 * max(own), (other, own)


def test_of_trace_needs_generator_metadata() -> None:
    from eplb.traces import Trace

    bare = Trace(np.zeros((1, 1, 4), dtype=np.int32), np.ones(1, dtype=bool), np.ones(1, dtype=np.int64), {})
    with pytest.raises(ValueError, match="no generator metadata"):
        WorkloadConfig.of_trace(bare)
