"""Seeded synthetic expert-load workloads with the statistics real MoE routers show.

Shape legend: F steps, L layers, E logical experts, Y workload domains, A drift knots, x any leading
dimensions.

Model (docs/workloads.md states it with the calibrated numbers). For layer l and expert e, the
router's log-popularity at step t is

    z[t, l, e] = s_l * base[l, e] + group[l, g(e)] + domain[d(t), l, e] + drift[t, l, e]

- ``base`` ~ N(0, 1), scaled per layer by s_l ~ sigma * U(1 - layer_spread, 1 + layer_spread):
  a log-normal (heavy-tailed) popularity, different in every layer;
- ``group``: a shared offset per expert group (DeepSeek's group-limited routing);
- ``domain``: one perturbation per workload domain (code, chat, math, ...); the active domain
  switches at random times (a Poisson process), the "code -> chat" shift;
- ``drift``: an Ornstein-Uhlenbeck process (slow drift), evaluated on knots every
  ``drift_knot_steps`` steps and held between them.

Popularity is softmax(z) capped at 1/top_k (a token picks k distinct experts). Step t routes
``tokens[t] * top_k`` choices as one multinomial draw, so small decode batches are noisy and
large prefill batches are close to the popularity. Steps are prefill with probability
``prefill_fraction``; token counts are log-uniform in their ranges. The trace's metadata names
the first step of each new domain (``domain_change_steps``), the shifts no planner can foresee.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from eplb.traces import ProgressFn, Trace


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """Shape of an MoE model's routed experts."""

    name: str
    """Preset name used on the command line."""
    num_layers: int
    """L, MoE layers."""
    num_experts: int
    """E, routed (logical) experts per layer."""
    top_k: int
    """Experts each token is routed to."""
    num_groups: int
    """Expert groups (group-limited routing); 1 when the model has none."""
    bytes_per_expert: int
    """Bytes of one expert's weights in one layer, in the serving dtype."""
    ep_size: int = 32
    """EP ranks it is served on in the simulator's default run (``eplb simulate --preset``)."""
    nnodes: int = 4
    """Nodes those ranks span."""
    redundant: int = 32
    """Redundant expert slots there (E + redundant divisible by ``ep_size``)."""


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        # DeepSeek-V3/R1: 3 * H * I weights of H=7168, I=2048 in fp8 (about 44 MB).
        ModelPreset(
            name="deepseek-v3",
            num_layers=58,
            num_experts=256,
            top_k=8,
            num_groups=8,
            bytes_per_expert=3 * 7168 * 2048,
        ),
        # Qwen3-235B-A22B: H=4096, moe I=1536, bf16.
        ModelPreset(
            name="qwen3-235b-a22b",
            num_layers=94,
            num_experts=128,
            top_k=8,
            num_groups=1,
            bytes_per_expert=3 * 4096 * 1536 * 2,
        ),
        # Mixtral-8x7B: H=4096, I=14336, bf16.
        ModelPreset(
            name="mixtral-8x7b",
            num_layers=32,
            num_experts=8,
            top_k=2,
            num_groups=1,
            bytes_per_expert=3 * 4096 * 14336 * 2,
            ep_size=8,
            nnodes=1,
            redundant=8,
        ),
        ModelPreset(
            name="tiny",
            num_layers=4,
            num_experts=16,
            top_k=4,
            num_groups=4,
            bytes_per_expert=3 * 64 * 32 * 2,
            ep_size=4,
            nnodes=1,
            redundant=4,
        ),
    )
}


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """Parameters of the synthetic generator. Defaults are calibrated (docs/workloads.md)."""

    preset: str = "deepseek-v3"
    """Model preset name (see PRESETS)."""
    num_steps: int = 4000
    """F, forward passes to generate."""
    seed: int = 0
    """Seed of every random draw; the same config and seed give the same trace."""
    popularity_sigma: float = 0.8
    """Std of the log-popularity of experts (before per-layer scaling): the heavy tail."""
    layer_spread: float = 0.3
    """Per-layer scale of popularity_sigma is drawn from U(1 - spread, 1 + spread)."""
    group_sigma: float = 0.25
    """Std of the shared log-popularity offset of each expert group."""
    num_domains: int = 3
    """Workload domains (e.g. code, chat, math) that the traffic switches between."""
    domain_sigma: float = 0.45
    """Std of each domain's log-popularity perturbation."""
    mean_steps_between_shifts: float = 1500.0
    """Mean steps between workload shifts (a Poisson process); 0 disables shifts."""
    drift_sigma: float = 0.35
    """Stationary std of the slow Ornstein-Uhlenbeck drift of log-popularity."""
    drift_timescale_steps: float = 2000.0
    """Correlation time of the drift, in steps."""
    drift_knot_steps: int = 10
    """The drift is evaluated every this many steps and held in between."""
    prefill_fraction: float = 0.3
    """Probability that a step is a prefill pass."""
    prefill_tokens: tuple[int, int] = (2048, 16384)
    """Range of tokens in a prefill pass (log-uniform)."""
    decode_tokens: tuple[int, int] = (32, 512)
    """Range of tokens in a decode pass (log-uniform)."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {sorted(PRESETS)}")
        if self.num_steps < 0:
            raise ValueError("num_steps must be >= 0")
        for name in ("popularity_sigma", "group_sigma", "domain_sigma", "drift_sigma", "layer_spread"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        if not 0.0 <= self.prefill_fraction <= 1.0:
            raise ValueError("prefill_fraction must lie in [0, 1]")
        if self.num_domains < 1 or self.drift_knot_steps < 1 or self.drift_timescale_steps <= 0:
            raise ValueError("num_domains, drift_knot_steps and drift_timescale_steps must be positive")
        for name in ("prefill_tokens", "decode_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {(lo, hi)}")

    @property
    def model(self) -> ModelPreset:
        return PRESETS[self.preset]

    def with_(self, **changes: object) -> WorkloadConfig:
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def of_trace(cls, trace: Trace) -> WorkloadConfig:
        """The config a synthetic trace was generated from (its ``generator`` metadata)."""
        fields = trace.meta.get("generator")
        if not isinstance(fields, dict):
            raise ValueError("the trace has no generator metadata (not made by eplb.workloads.generate)")
        return cls().with_(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


@dataclass(frozen=True)
class Latent:
    """The generator's hidden state: the popularity each step's counts are drawn from.

    No planner sees it; benchmarks plan on it to measure what a perfect forecast of the present
    gives (``eplb.solver`` forecasts estimate it from noisy counts of past steps).
    """

    config: WorkloadConfig
    static_LE: np.ndarray
    """float64 [L, E]: the per-layer base and group log-popularity."""
    domain_YLE: np.ndarray
    """float64 [Y, L, E]: each domain's perturbation."""
    domain_F: np.ndarray
    """int [F]: the active domain of each step."""
    drift_ALE: np.ndarray
    """float64 [A, L, E]: the drift at each knot."""

    def probabilities(self, knot: int, domain: int) -> np.ndarray:
        """float64 [L, E]: the (capped) popularity of a drift knot under a domain."""
        logits_LE = self.static_LE + self.drift_ALE[knot] + self.domain_YLE[domain]
        return _capped_softmax(logits_LE, 1.0 / self.config.model.top_k)

    def shares(self, steps: np.ndarray) -> np.ndarray:
        """float64 [n, L, E]: the popularity each of ``steps`` drew its counts from."""
        steps = np.asarray(steps, dtype=np.int64)
        L, E = self.static_LE.shape
        out = np.empty((steps.size, L, E))
        knot_n = steps // self.config.drift_knot_steps
        for key in sorted(set(zip(knot_n.tolist(), self.domain_F[steps].tolist(), strict=True))):
            rows = (knot_n == key[0]) & (self.domain_F[steps] == key[1])
            out[rows] = self.probabilities(*key)
        return out


def latent(config: WorkloadConfig | None = None) -> Latent:
    """The hidden state :func:`generate` draws ``config``'s trace from (the same draws, so the
    same seed gives the popularity behind the same counts)."""
    cfg = config or WorkloadConfig()
    return _draw_latent(cfg, np.random.default_rng(cfg.seed))


def _draw_latent(cfg: WorkloadConfig, rng: np.random.Generator) -> Latent:
    """The first draws of a trace, in :func:`generate`'s order: base, groups, domains, schedule, drift."""
    m = cfg.model
    F, L, E = cfg.num_steps, m.num_layers, m.num_experts
    layer_scale_L = cfg.popularity_sigma * rng.uniform(1 - cfg.layer_spread, 1 + cfg.layer_spread, size=L)
    static_LE = layer_scale_L[:, None] * rng.standard_normal((L, E))
    group_of_E = np.arange(E) * m.num_groups // E
    static_LE += cfg.group_sigma * rng.standard_normal((L, m.num_groups))[:, group_of_E]
    domain_YLE = cfg.domain_sigma * rng.standard_normal((cfg.num_domains, L, E))
    domain_F = _domain_schedule(rng, F, cfg.num_domains, cfg.mean_steps_between_shifts)
    drift_ALE = _ou_knots(rng, F, L, E, cfg)
    return Latent(cfg, static_LE, domain_YLE, domain_F, drift_ALE)


def generate(config: WorkloadConfig | None = None, *, progress: ProgressFn | None = None) -> Trace:
    """Generate a synthetic trace [F, L, E] (int32 counts) from ``config`` (default: deepseek-v3).

    ``progress(done, total)`` is called in steps as the counts are drawn (it draws nothing random).
    """
    cfg = config or WorkloadConfig()
    m = cfg.model
    F, L, E = cfg.num_steps, m.num_layers, m.num_experts
    rng = np.random.default_rng(cfg.seed)
    hidden = _draw_latent(cfg, rng)
    domain_F = hidden.domain_F

    is_prefill_F = rng.random(F) < cfg.prefill_fraction
    lo = np.where(is_prefill_F, cfg.prefill_tokens[0], cfg.decode_tokens[0])
    hi = np.where(is_prefill_F, cfg.prefill_tokens[1], cfg.decode_tokens[1])
    tokens_F = np.exp(rng.uniform(np.log(lo), np.log(hi + 1))).astype(np.int64).clip(lo, hi)

    counts_FLE = np.empty((F, L, E), dtype=np.int32)
    for t0 in range(0, F, cfg.drift_knot_steps):
        # Steps inside one drift knot share the domain-free part of the logits.
        t1 = min(t0 + cfg.drift_knot_steps, F)
        for d in np.unique(domain_F[t0:t1]):
            steps = np.arange(t0, t1)[domain_F[t0:t1] == d]
            prob_LE = hidden.probabilities(t0 // cfg.drift_knot_steps, int(d))
            pvals = np.broadcast_to(prob_LE, (len(steps), L, E)).reshape(-1, E)
            tokens_rows = np.repeat(tokens_F[steps], L)
            counts = _sample_topk_counts(rng, tokens_rows, m.top_k, pvals)
            counts_FLE[steps] = counts.reshape(len(steps), L, E)
        if progress is not None:
            progress(t1, F)

    # First step of each new domain: a shift no planner can foresee from the steps before it.
    change_steps = (np.flatnonzero(np.diff(domain_F) != 0) + 1).tolist()
    meta = {
        "source": "synthetic",
        "model": m.name,
        "top_k": m.top_k,
        "num_groups": m.num_groups,
        "bytes_per_expert": m.bytes_per_expert,
        "generator": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
        "domain_per_step_changes": len(change_steps),
        "domain_change_steps": change_steps,
    }
    return Trace(counts_FLE, is_prefill_F, tokens_F, meta)


def _domain_schedule(rng: np.random.Generator, F: int, Y: int, mean_gap: float) -> np.ndarray:
    """int [F]: active domain per step; switches to a different domain at Poisson times."""
    domain_F = np.zeros(F, dtype=np.int64)
    if Y == 1 or mean_gap <= 0 or F == 0:
        return domain_F
    current, t = int(rng.integers(Y)), 0
    while t < F:
        gap = max(1, int(rng.exponential(mean_gap)))
        domain_F[t : t + gap] = current
        t += gap
        current = (current + int(rng.integers(1, Y))) % Y
    return domain_F


def _ou_knots(rng: np.random.Generator, F: int, L: int, E: int, cfg: WorkloadConfig) -> np.ndarray:
    """float [A, L, E]: a stationary Ornstein-Uhlenbeck process sampled every knot."""
    A = max(1, -(-F // cfg.drift_knot_steps))
    decay = np.exp(-cfg.drift_knot_steps / cfg.drift_timescale_steps)
    innovation = cfg.drift_sigma * np.sqrt(1 - decay**2)
    drift_ALE = np.empty((A, L, E))
    drift_ALE[0] = cfg.drift_sigma * rng.standard_normal((L, E))
    for c in range(1, A):
        drift_ALE[c] = decay * drift_ALE[c - 1] + innovation * rng.standard_normal((L, E))
    return drift_ALE


def _sample_topk_counts(
    rng: np.random.Generator, tokens_x: np.ndarray, top_k: int, pvals_xE: np.ndarray
) -> np.ndarray:
    """int [x, E]: tokens*top_k routed choices per row, no expert above the row's token count.

    One multinomial draw per row; choices beyond an expert's token count (a token picks k
    distinct experts) are redrawn over the experts still below it.
    """
    counts = rng.multinomial(tokens_x * top_k, pvals_xE)
    for _ in range(pvals_xE.shape[1]):
        over = counts > tokens_x[:, None]
        rows = np.flatnonzero(over.any(axis=1))
        if rows.size == 0:
            break
        excess = np.where(over[rows], counts[rows] - tokens_x[rows, None], 0).sum(axis=1)
        counts[rows] = np.minimum(counts[rows], tokens_x[rows, None])
        room = counts[rows] < tokens_x[rows, None]
        p = np.where(room, pvals_xE[rows], 0.0)
        p /= p.sum(axis=1, keepdims=True)
        counts[rows] += rng.multinomial(excess, p)
    return counts


def _capped_softmax(logits_LE: np.ndarray, cap: float) -> np.ndarray:
    """Softmax over experts with every probability at most ``cap`` (excess spread proportionally)."""
    z = logits_LE - logits_LE.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    for _ in range(p.shape[-1]):
        over = p > cap
        if not over.any():
            break
        excess = np.where(over, p - cap, 0.0).sum(axis=-1, keepdims=True)
        free = np.where(over, 0.0, p)
        p = np.where(over, cap, p + excess * free / np.maximum(free.sum(axis=-1, keepdims=True), 1e-300))
    return p / p.sum(axis=-1, keepdims=True)


def unbalanced_imbalance(trace: Trace, num_gpus: int) -> float:
    """The calibration figure: max/mean GPU load with no balancing, over prefill steps.

    Experts sit in identity order (E / num_gpus consecutive experts per GPU); the ratio is taken
    per layer and step, then averaged. TensorRT-LLM reports (max - mean) / mean = 1.56, that is
    2.56 on this scale, for DeepSeek-R1 at EP32; the deepseek-v3 preset is calibrated to about 2.5.
    """
    from eplb.placement.balance import imbalance_ratio
    from eplb.placement.model import Placement

    steps = trace.prefill_only() if trace.is_prefill_F.any() else trace
    if steps.num_steps == 0:
        raise ValueError("trace has no steps")
    placement = Placement.trivial(steps.num_layers, steps.num_experts, num_gpus)
    return float(imbalance_ratio(steps.counts_FLE, placement).mean())
