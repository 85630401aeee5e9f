"""Every Prometheus metric eplb exports, named in one place: the exporter, the dashboard and the docs read this.

Shape legend: L layers, E logical experts, G GPUs (EP ranks), e experts (the hottest kept per
layer).

Conventions (Prometheus naming guide): the ``eplb_`` prefix, base units (seconds, bytes), ``_total``
on counters, ``_seconds``/``_bytes`` suffixes. Label cardinality is bounded: per layer x rank
(L x G) by default, per layer x expert (L x E) only when explicitly enabled; rebalances by
``outcome`` and a ``cause`` from a fixed list (eplb.metrics.causes), never free text, and the
manager's ``phase`` from :data:`MANAGER_PHASES`. Layers, ranks
and experts are plain integers (``layer="7"``), as SGLang and vLLM write them, so queries join on
them. Every series also carries :data:`ENGINE_LABELS`, constant per process, that join the
serving engine's own series.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

# The values of the outcome and cause labels, re-exported with the label names.
from eplb.metrics.causes import REBALANCE_CAUSES as REBALANCE_CAUSES
from eplb.metrics.causes import REBALANCE_OUTCOMES as REBALANCE_OUTCOMES

MetricKind = Literal["counter", "gauge", "histogram", "info"]

PREFIX = "eplb_"


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    """One exported metric family."""

    name: str
    """Name of the sample users query (counters end in ``_total``; histograms add ``_bucket`` etc.)."""
    kind: MetricKind
    """Prometheus type."""
    labels: tuple[str, ...]
    """Label names of its own (every series also has :data:`ENGINE_LABELS`); their product bounds
    the family's series count."""
    unit: str
    """Unit of the value, for the docs ("" for plain ratios and counts of events)."""
    help: str
    """HELP text: what the value means."""
    per_expert: bool = False
    """Exported only when per-(layer, expert) metrics are enabled (L x E series)."""

    def series_names(self) -> frozenset[str]:
        """Every sample name this family produces in the text exposition."""
        if self.kind == "counter":
            base = self.name.removesuffix("_total")
            return frozenset({self.name, base + "_created"})
        if self.kind == "histogram":
            suffixes = ("_bucket", "_sum", "_count", "_created")
            return frozenset(self.name + s for s in suffixes)
        return frozenset({self.name})


INFO = "eplb_info"
FORWARD_PASSES = "eplb_forward_passes_total"
WINDOW_TIMESTAMP = "eplb_window_timestamp_seconds"
LAYER_BALANCEDNESS = "eplb_layer_balancedness"
MODEL_BALANCEDNESS = "eplb_model_balancedness"
RANK_TOKENS = "eplb_rank_tokens"
HOT_EXPERT_TOKENS = "eplb_hot_expert_tokens"
EXPERT_TOKENS = "eplb_expert_tokens"
REBALANCES = "eplb_rebalances_total"
SOLVE_SECONDS = "eplb_rebalance_solve_seconds"
TRANSFER_SECONDS = "eplb_rebalance_transfer_seconds"
EXPERTS_MOVED = "eplb_experts_moved_total"
MOVED_BYTES = "eplb_moved_bytes_total"
LAST_REBALANCE_BALANCEDNESS = "eplb_last_rebalance_balancedness"
LAST_REBALANCE_TIMESTAMP = "eplb_last_rebalance_timestamp_seconds"
MANAGER_PHASE = "eplb_manager_phase"
IN_FLIGHT_SECONDS = "eplb_rebalance_in_flight_seconds"
LAST_REBALANCE_AGE = "eplb_last_rebalance_age_seconds"

ManagerPhase = Literal["idle", "solving", "applying", "stopped"]
"""What the rebalance manager does: waits for the next rebalance, solves one (rank 0, in the
background), applies its plan a chunk of layers at a time, or has stopped rebalancing for good."""
MANAGER_PHASES: tuple[ManagerPhase, ...] = get_args(ManagerPhase)

TOPOLOGY_LABELS = ("version", "num_layers", "num_logical", "num_physical", "num_gpus", "num_nodes")
PASS_KINDS = ("prefill", "decode")

ENGINE_LABELS = ("engine", "model_name")
"""On every series, constant per process: the names vLLM (``model_name``, ``engine``) and SGLang
(``model_name``) put on their own series, so ``on (model_name)`` joins eplb's with the engine's."""
DEFAULT_ENGINE = "0"
"""vLLM's label for its first (often only) engine."""
DEFAULT_MODEL_NAME = "unknown"
TARGET_LABELS = ("instance", "job")
"""Added by Prometheus to every scraped series (the scrape target), not by the exporter."""
MAX_LABEL_CHARS = 256

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        name=INFO,
        kind="info",
        labels=TOPOLOGY_LABELS,
        unit="",
        help="Constant 1; labels carry the eplb version and the served topology (layers, experts, slots, GPUs, nodes).",
    ),
    MetricSpec(
        name=FORWARD_PASSES,
        kind="counter",
        labels=("kind", "recorded"),
        unit="passes",
        help="Forward passes seen by the manager, by kind (prefill, decode) and whether the recorder counted them.",
    ),
    MetricSpec(
        name=WINDOW_TIMESTAMP,
        kind="gauge",
        labels=(),
        unit="seconds",
        help="Unix time at which the load window behind the window metrics was handed over.",
    ),
    MetricSpec(
        name=LAYER_BALANCEDNESS,
        kind="gauge",
        labels=("layer",),
        unit="ratio",
        help="Mean over max GPU load of each layer over the last window (1 is perfect), under the live placement.",
    ),
    MetricSpec(
        name=MODEL_BALANCEDNESS,
        kind="gauge",
        labels=(),
        unit="ratio",
        help="Layer balancedness averaged over layers, over the last window.",
    ),
    MetricSpec(
        name=RANK_TOKENS,
        kind="gauge",
        labels=("layer", "rank"),
        unit="tokens",
        help="Tokens routed to each EP rank in each layer over the last window, under the live placement.",
    ),
    MetricSpec(
        name=HOT_EXPERT_TOKENS,
        kind="gauge",
        labels=("layer", "expert"),
        unit="tokens",
        help="Tokens of the K most loaded logical experts of each layer over the last window (K per layer).",
    ),
    MetricSpec(
        name=EXPERT_TOKENS,
        kind="gauge",
        labels=("layer", "expert"),
        unit="tokens",
        help="Tokens of every logical expert of every layer over the last window (only when enabled: L x E series).",
        per_expert=True,
    ),
    MetricSpec(
        name=REBALANCES,
        kind="counter",
        labels=("outcome", "cause"),
        unit="rebalances",
        help="Rebalances decided, by outcome (applied, skipped, failed: rolled back) and cause (a fixed list).",
    ),
    MetricSpec(
        name=SOLVE_SECONDS,
        kind="histogram",
        labels=(),
        unit="seconds",
        help="Wall time of each rebalance's placement solve (every outcome).",
    ),
    MetricSpec(
        name=TRANSFER_SECONDS,
        kind="histogram",
        labels=(),
        unit="seconds",
        help="Wall time of each rebalance's weight transfer (applied and failed rebalances; skipped ones move nothing).",
    ),
    MetricSpec(
        name=EXPERTS_MOVED,
        kind="counter",
        labels=(),
        unit="experts",
        help="Expert weights (one expert of one layer each) moved between GPUs by applied and failed rebalances.",
    ),
    MetricSpec(
        name=MOVED_BYTES,
        kind="counter",
        labels=(),
        unit="bytes",
        help="Bytes of expert weights moved between GPUs by applied and failed rebalances.",
    ),
    MetricSpec(
        name=LAST_REBALANCE_BALANCEDNESS,
        kind="gauge",
        labels=("when",),
        unit="ratio",
        help="Model balancedness the last rebalance started from (when=before) and expected or reached (when=after); "
        "inside an engine also what the previous rebalance predicted for the window (when=predicted) and what it "
        "realized (when=realized).",
    ),
    MetricSpec(
        name=LAST_REBALANCE_TIMESTAMP,
        kind="gauge",
        labels=("outcome", "cause"),
        unit="seconds",
        help="Unix time of the last rebalance of each outcome and cause (one series per cause seen).",
    ),
    MetricSpec(
        name=MANAGER_PHASE,
        kind="gauge",
        labels=("phase",),
        unit="",
        help="1 for the phase the rebalance manager is in (idle, solving, applying, stopped), 0 for the others.",
    ),
    MetricSpec(
        name=IN_FLIGHT_SECONDS,
        kind="gauge",
        labels=(),
        unit="seconds",
        help="Seconds the rebalance in progress (solve, agreement, transfer) has been in flight; 0 when none is.",
    ),
    MetricSpec(
        name=LAST_REBALANCE_AGE,
        kind="gauge",
        labels=(),
        unit="seconds",
        help="Seconds since the last rebalance ended (any outcome), or since the manager started before the first.",
    ),
)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}


def all_series_names(*, per_expert: bool = True) -> frozenset[str]:
    """Every sample name eplb can export (with ``per_expert=False``, those exported by default)."""
    names: set[str] = set()
    for spec in METRICS:
        if per_expert or not spec.per_expert:
            names |= spec.series_names()
    return frozenset(names)


def index_labels(count: int) -> list[str]:
    """Label values "0".."count-1", plain integers (``"7"``, never ``"07"``) as engines write them."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return [str(i) for i in range(count)]


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f]")


def engine_labels(*, engine: str, model_name: str) -> tuple[tuple[str, str], ...]:
    """The (name, value) pairs of :data:`ENGINE_LABELS`; ValueError unless each value is a short,
    non-empty line (an empty value would drop the label, a newline would break the exposition)."""
    pairs = tuple(zip(ENGINE_LABELS, (engine, model_name), strict=True))
    for name, value in pairs:
        if not isinstance(value, str) or not value or len(value) > MAX_LABEL_CHARS:
            raise ValueError(
                f"{name} must be a non-empty string of at most {MAX_LABEL_CHARS} characters, got {value!r}"
            )
        if _UNPRINTABLE.search(value):
            raise ValueError(f"{name} must not contain control characters, got {value!r}")
    return pairs


def escape_label_value(value: str) -> str:
    """A label value as the text exposition writes it between double quotes."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
