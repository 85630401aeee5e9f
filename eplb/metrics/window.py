"""The load-window metrics: one host copy of the last window, read at scrape time.

Shape legend: L layers, E logical experts, G GPUs (EP ranks), e experts (the hottest kept per
layer).

``on_window`` copies the two arrays it is handed and swaps one reference under a lock; nothing
else happens on the caller's thread. Everything derived (balancedness, top-K experts, label
strings, the text exposition) is computed by the scraping thread, once per window, and cached:
Prometheus scraping many times per window costs one cached string each time. When windows
arrive faster than ``min_render_interval_s``, :meth:`WindowCollector.render` keeps serving the
text it rendered last until that interval has passed (the window metrics are then at most that
much older than the newest window), so the scrape's CPU cost per second is bounded however often
the manager hands windows over.

Two read paths give the same samples: :meth:`WindowCollector.collect` yields prometheus_client
metric families (for any registry), and :meth:`WindowCollector.render` writes the text format
directly, about twenty times faster than prometheus_client's generic writer at DeepSeek-V3 sizes
(L x G = 58 x 32 samples), so a 20 Hz scrape stays off the serving process's CPU budget.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from eplb.metrics import names
from eplb.placement.balance import balancedness


@dataclass
class _Snapshot:
    """One window as handed over, plus what scrapes derive from it (computed once, lazily)."""

    logical_load_LE: np.ndarray
    gpu_load_LG: np.ndarray
    timestamp: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    families: list[_Family] | None = None


@dataclass(frozen=True)
class _Family:
    """A gauge family as label tuples, their rendered text prefixes, and float values."""

    name: str
    help: str
    label_names: tuple[str, ...]
    label_values: Sequence[tuple[str, ...]]
    prefixes: Sequence[str]
    """``name{label="value",...} `` for each sample, as the text format writes it."""
    values: list[float]


class WindowCollector(Collector):
    """Exports the last load window: balancedness, tokens per (layer, rank), hottest experts."""

    def __init__(
        self,
        *,
        hot_experts_per_layer: int = 8,
        per_expert: bool = False,
        min_render_interval_s: float = 1.0,
        const_labels: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """``const_labels``: (name, value) pairs every sample carries after its own labels."""
        if hot_experts_per_layer < 0:
            raise ValueError(f"hot_experts_per_layer must be >= 0, got {hot_experts_per_layer}")
        if not min_render_interval_s >= 0:
            raise ValueError(f"min_render_interval_s must be >= 0, got {min_render_interval_s}")
        self._top_k = hot_experts_per_layer
        self._per_expert = per_expert
        self._min_render_interval_s = min_render_interval_s
        self._const_names = tuple(name for name, _ in const_labels)
        self._const_values = [value for _, value in const_labels]
        # Rendered once: ',engine="0",model_name="..."' (escaped) closes every sample's label set.
        self._const_text = "".join(f',{k}="{names.escape_label_value(v)}"' for k, v in const_labels)
        self._lock = threading.Lock()
        self._snapshot: _Snapshot | None = None
        self._render_lock = threading.Lock()
        self._rendered: tuple[_Snapshot, str, float] | None = None

    def update(self, *, logical_load_LE: np.ndarray, gpu_load_LG: np.ndarray) -> None:
        """Keep a copy of the window; O(L x (E + G)) copy, then a reference swap under the lock."""
        logical = np.array(logical_load_LE, dtype=np.float64, copy=True)
        gpu = np.array(gpu_load_LG, dtype=np.float64, copy=True)
        if logical.ndim != 2 or gpu.ndim != 2 or logical.shape[0] != gpu.shape[0]:
            raise ValueError(
                f"expected logical_load_LE [L, E] and gpu_load_LG [L, G] with the same L, "
                f"got {logical.shape} and {gpu.shape}"
            )
        snapshot = _Snapshot(logical_load_LE=logical, gpu_load_LG=gpu, timestamp=time.time())
        with self._lock:
            self._snapshot = snapshot

    def _current(self) -> _Snapshot | None:
        with self._lock:
            return self._snapshot

    def _families(self, snap: _Snapshot) -> list[_Family]:
        with snap.lock:
            if snap.families is None:
                snap.families = _derive(snap, self._top_k, self._per_expert, self._const_text)
            return snap.families

    def describe(self) -> Iterator[Metric]:
        # Lets the registry check names without collecting a window (and without one existing).
        for spec in names.METRICS:
            if spec.name in _WINDOW_METRICS and (self._per_expert or not spec.per_expert):
                yield GaugeMetricFamily(spec.name, spec.help, labels=[*spec.labels, *self._const_names])

    def collect(self) -> Iterator[Metric]:
        snap = self._current()
        if snap is None:
            return
        for fam in self._families(snap):
            metric = GaugeMetricFamily(fam.name, fam.help, labels=[*fam.label_names, *self._const_names])
            for labels, value in zip(fam.label_values, fam.values, strict=True):
                metric.add_metric([*labels, *self._const_values], value)
            yield metric

    def render(self) -> str:
        """Text exposition (format 0.0.4) of the window metrics; "" before the first window."""
        snap = self._current()
        if snap is None:
            return ""
        with self._render_lock:
            now = time.monotonic()
            last = self._rendered
            if last is not None and (last[0] is snap or now - last[2] < self._min_render_interval_s):
                return last[1]
            text = "".join(_render_family(fam) for fam in self._families(snap))
            self._rendered = (snap, text, now)
            return text


_WINDOW_METRICS = frozenset(
    {
        names.WINDOW_TIMESTAMP,
        names.LAYER_BALANCEDNESS,
        names.MODEL_BALANCEDNESS,
        names.RANK_TOKENS,
        names.HOT_EXPERT_TOKENS,
        names.EXPERT_TOKENS,
    }
)


def _prefix(name: str, label_names: tuple[str, ...], label_values: tuple[str, ...], const: str) -> str:
    # Own label values are integers: nothing to escape; ``const`` is escaped already.
    pairs = "".join(f',{k}="{v}"' for k, v in zip(label_names, label_values, strict=True)) + const
    return f"{name}{{{pairs[1:]}}} " if pairs else name + " "


@functools.lru_cache(maxsize=32)
def _grid(
    name: str, sizes: tuple[int, ...], const: str
) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """Label tuples over the product of index ranges of ``sizes``, and their text prefixes.

    Cached: the (layer, rank) grid is the same for every window of a topology, and building its
    L x G strings is most of the cost of rendering one.
    """
    label_names = names.BY_NAME[name].labels
    labels = tuple(itertools.product(*(names.index_labels(n) for n in sizes)))
    return labels, tuple(_prefix(name, label_names, lv, const) for lv in labels)


def _family(
    name: str,
    values: list[float],
    const: str,
    sizes: tuple[int, ...] = (),
    labels: Sequence[tuple[str, ...]] = (),
) -> _Family:
    """A family over the full grid of ``sizes``, or over the explicit ``labels`` when given."""
    spec = names.BY_NAME[name]
    if labels:
        prefixes: Sequence[str] = [_prefix(name, spec.labels, lv, const) for lv in labels]
    else:
        labels, prefixes = _grid(name, sizes, const)
    assert len(labels) == len(values), (name, len(labels), len(values))
    return _Family(name, spec.help, spec.labels, labels, prefixes, values)


def _derive(snap: _Snapshot, top_k: int, per_expert: bool, const: str) -> list[_Family]:
    logical_LE, gpu_LG = snap.logical_load_LE, snap.gpu_load_LG
    L, E = logical_LE.shape
    G = gpu_LG.shape[1]
    balance_L = balancedness(gpu_LG) if G > 0 else np.ones(L)
    model = float(balance_L.mean()) if L > 0 else 1.0
    out = [
        _family(names.WINDOW_TIMESTAMP, [snap.timestamp], const),
        _family(names.MODEL_BALANCEDNESS, [model], const),
        _family(names.LAYER_BALANCEDNESS, balance_L.tolist(), const, (L,)),
        _family(names.RANK_TOKENS, gpu_LG.ravel().tolist(), const, (L, G)),
    ]
    k = min(top_k, E)
    if k > 0 and L > 0:
        # NaN loads sort as the largest by argsort of the negation; map them to -inf so they come last.
        ranked_LE = np.where(np.isnan(logical_LE), -np.inf, logical_LE)
        hot_Le = np.argsort(-ranked_LE, axis=1, kind="stable")[:, :k]
        hot_values = np.take_along_axis(logical_LE, hot_Le, axis=1)
        layers, experts = names.index_labels(L), names.index_labels(E)
        hot_labels = [(layers[i], experts[e]) for i in range(L) for e in hot_Le[i].tolist()]
        out.append(_family(names.HOT_EXPERT_TOKENS, hot_values.ravel().tolist(), const, labels=hot_labels))
    if per_expert:
        out.append(_family(names.EXPERT_TOKENS, logical_LE.ravel().tolist(), const, (L, E)))
    return out


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _render_family(fam: _Family) -> str:
    help_text = fam.help.replace("\\", r"\\").replace("\n", r"\n")
    head = f"# HELP {fam.name} {help_text}\n# TYPE {fam.name} gauge\n"
    fmt = repr if all(map(math.isfinite, fam.values)) else _format_value
    return head + "".join([p + fmt(v) + "\n" for p, v in zip(fam.prefixes, fam.values, strict=True)])
