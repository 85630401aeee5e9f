"""``EPLB_SGLANG_LP=auto`` inside SGLang 0.5.23: the passes the tests run and what the engines'
subprocess records.

Shape legend: L layers, E logical experts, G GPUs (EP ranks), T tokens, K top-k, W window (passes).

Two passes on the placement of tests.helpers.sglang_lp_ranks' shape 1 (E 16, 24 slots, G 4), priced
by the ``h200`` kernel table: a small decode pass (one token a rank, :data:`SMALL`), which the
model maps statically, and a large prefill pass (about 4,000 tokens over three ranks, the fourth an
idle DP rank, :data:`LARGE`), which it maps by ``lp``; the choice is modeled on :data:`window`.
:func:`forward_batch` is the pass as SGLang's DP sync hands it to each rank (``global_num_tokens_cpu``,
``is_extend_in_batch``, the rank's own mode).

:func:`run` (in the subprocess) loads eplb's plugin through SGLang's own ``load_plugins`` three times
(``EPLB_SGLANG_LP`` unset, ``1``, ``auto``) and records whether ``ModelRunner.forward`` and the
graph runners' ``capture_prepare`` were left alone or wrapped; hands the window over through SGLang's
hooked ``rebalance_experts`` (SGLang's own ``deepseek`` algorithm planning); then runs every rank of
each pass as SGLang does: the hooked ``init_lplb_solvers`` (with a model config of top-k K), the
hooked ``ModelRunner.forward`` whose body (a stand-in: SGLang's real model runner imports its model
stack) runs each layer's ``solve`` and ``topk_ids_logical_to_physical`` from SGLang's own registry
and dispatch info; and one capture of each graph runner at a small and a large padded size.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.helpers import sglang_lp_ranks as lp_ranks

SHAPE = 1
KERNELS = "h200"
"""The ``EPLB_DISPATCH_COST`` table the subprocess runs with (also the in-process tests')."""


class Mode(enum.Enum):
    """The ``ForwardMode`` members the passes use (``is_extend`` as SGLang's)."""

    EXTEND = 1
    DECODE = 2
    IDLE = 3

    def is_extend(self) -> bool:
        return self is Mode.EXTEND


@dataclass(frozen=True)
class Pass:
    """One pass: its global counts' kind, phase, and the mode every rank must take."""

    name: str
    prefill: bool
    want: str
    """``static`` or ``lp``: what the model picks (tests/test_sglang_lp.py checks the ids by it)."""
    idle_ranks: tuple[int, ...] = ()

    def counts(self) -> np.ndarray:
        """int64 [L, E]: the pass's global counts."""
        pl = lp_ranks.placement(SHAPE)
        if self.name == "small":
            return np.random.default_rng(5).integers(0, 3, size=(lp_ranks.L, pl.num_logical))
        return 2 * lp_ranks.global_counts("heavy", pl, 21)

    def ids(self) -> list[np.ndarray]:
        """Per rank int32 [L, T_r, K] (T_r = 0 on an idle rank)."""
        return lp_ranks.rank_ids(self.counts(), lp_ranks.placement(SHAPE).num_gpus, 22, self.idle_ranks)


SMALL = Pass("small", prefill=False, want="static")
LARGE = Pass("large", prefill=True, want="lp", idle_ranks=(lp_ranks.SHAPES[SHAPE][2] - 1,))
PASSES = (SMALL, LARGE)


def window() -> np.ndarray:
    """float64 [W, L, E]: the recorded passes a rebalance planned from (heavy-tailed, W = 8)."""
    pl = lp_ranks.placement(SHAPE)
    return np.stack([lp_ranks.global_counts("heavy", pl, seed) for seed in range(8)]).astype(np.float64)


def forward_batch(ids_by_rank: list[np.ndarray], rank: int, prefill: bool) -> types.SimpleNamespace:
    """The rank's ``ForwardBatch`` fields eplb reads, as SGLang's DP sync fills them: every rank's
    rows, whether some rank extends, the rank's own mode (IDLE without tokens)."""
    rows = int(ids_by_rank[rank].shape[1])
    mode = Mode.IDLE if rows == 0 else Mode.EXTEND if prefill else Mode.DECODE
    return types.SimpleNamespace(
        global_num_tokens_cpu=[int(ids.shape[1]) for ids in ids_by_rank],
        is_extend_in_batch=prefill,
        forward_mode=mode,
        input_ids=np.zeros(rows, dtype=np.int64),
        batch_size=rows,
    )


def capture_batch(tokens: int, prefill: bool, num_gpus: int) -> types.SimpleNamespace:
    """A graph runner's capture batch of ``tokens`` padded tokens a rank (``capture_prepare``'s:
    the mode set, ``is_extend_in_batch`` left False)."""
    return types.SimpleNamespace(
        global_num_tokens_cpu=[tokens] * num_gpus,
        is_extend_in_batch=False,
        forward_mode=Mode.EXTEND if prefill else Mode.DECODE,
        input_ids=np.zeros(tokens, dtype=np.int64),
        batch_size=tokens,
    )


CAPTURES = {"decode": (1, False), "prefill": (2048, True)}
"""Graph runner -> (padded tokens a rank, prefill) of the one shape captured."""


def _stub_runner_modules() -> dict[str, Any]:
    """SGLang 0.5.23's ``model_runner`` and graph runner modules (their real ones import the model
    stack and CUDA kernels): stand-ins with the methods eplb hooks, their signatures SGLang's. The
    model runner's forward runs the rank's layers through ``self.layers``; ``capture_prepare``
    returns the padded batch first, as SGLang's do."""
    from tests.helpers import sglang_stubs as stubs

    stubs.install()

    class ModelRunner:
        def __init__(self, layers: Any) -> None:
            self.layers = layers

        def forward(self, forward_batch: Any, skip_attn_backend_init: Any = None, pp_proxy_tensors: Any = None,
                    reinit_attn_backend: bool = False, split_forward_count: int = 1) -> Any:  # fmt: skip
            return self.layers(forward_batch)

    class DecodeCudaGraphRunner:
        def capture_prepare(self, size: int, stream_idx: Any = None, num_tokens: Any = None) -> Any:
            tokens, prefill = CAPTURES["decode"]
            return capture_batch(tokens, prefill, lp_ranks.SHAPES[SHAPE][2]), None, None

    class PrefillCudaGraphRunner:
        def capture_prepare(self, num_tokens: int) -> Any:
            tokens, prefill = CAPTURES["prefill"]
            return capture_batch(tokens, prefill, lp_ranks.SHAPES[SHAPE][2]), None

    found = {}
    base = "sglang.srt.model_executor"
    package = types.ModuleType(f"{base}.runner")  # SGLang's package __init__ imports every runner
    package.__path__ = []
    sys.modules[package.__name__] = package
    for name, attr, cls in (
        ("model_runner", "ModelRunner", ModelRunner),
        ("runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner", DecodeCudaGraphRunner),
        ("runner.prefill_cuda_graph_runner", "PrefillCudaGraphRunner", PrefillCudaGraphRunner),
    ):
        module = types.ModuleType(f"{base}.{name}")
        cls.__module__ = module.__name__
        module.__dict__[attr] = cls
        sys.modules[module.__name__] = module
        found[attr] = cls
    return found


def _methods(classes: dict[str, Any]) -> dict[str, Any]:
    return {
        "forward": classes["ModelRunner"].forward,
        "decode_capture": classes["DecodeCudaGraphRunner"].capture_prepare,
        "prefill_capture": classes["PrefillCudaGraphRunner"].capture_prepare,
    }


def _layers(
    serving: Any, group: Any, local_GLE: np.ndarray, ids_LTK: np.ndarray, modes: list[str], batch: Any
) -> list[Any]:
    """A rank's MoE layers as SGLang's run them (the stand-in forward's body): each layer's solver
    from SGLang's registry, ``solve``, then SGLang's map with the layer's dispatch info."""
    import sglang.srt.eplb.expert_location_dispatch as dispatch
    import torch
    from sglang.srt.eplb.lplb_solver import get_global_lplb_solver

    modes.append("lp" if serving.pass_lp else "static")
    got: list[Any] = []
    for layer in range(lp_ranks.L):
        group.local_GE = local_GLE[:, layer]
        ids = torch.from_numpy(ids_LTK[layer])
        prob = get_global_lplb_solver(layer).solve(ids)
        if ids.shape[0] == 0:  # an idle rank: its solve joins any exchange, nothing to map
            got.append([])
            continue
        info = dispatch.ExpertLocationDispatchInfo.init_new(layer)
        got.append(dispatch.topk_ids_logical_to_physical(ids, info, prob).tolist())
    return got


def run() -> dict[str, Any]:
    """The hooks through SGLang's loader with the variable unset, 1 and auto; the passes and the
    captures on every rank; the choice's window."""
    import torch

    from tests.helpers import sglang_stubs as stubs

    classes = _stub_runner_modules()
    parallel = types.SimpleNamespace(moe_ep_rank=0, moe_ep_group=None, ep_size=1, nnodes=1, tp_size=1,
                                     elastic_ep_initial_size=None, ep_join_rank_offset=0)  # fmt: skip
    moe = stubs.moe_settings(ep_dispatch_algorithm="lp", ep_num_redundant_experts=0, ep_join_mode="none")
    stubs.configure_dispatch(moe)
    setup = stubs.stub_moe_ep_setup()

    import sglang.srt.eplb.eplb_algorithms as algorithms
    import sglang.srt.plugins as plugins

    from eplb.integrations import sglang_lp
    from tests.helpers.sglang_lp_checks import _install

    asked = os.environ.pop("EPLB_SGLANG_LP")
    sglang_methods = _methods(classes)
    out: dict[str, Any] = {}
    for value in ("", "1", asked):
        if value:
            os.environ["EPLB_SGLANG_LP"] = value
        plugins._plugins_loaded = False
        plugins.load_plugins()
        now = _methods(classes)
        out[f"untouched[{value}]"] = {name: now[name] is sglang_methods[name] for name in now}
        out[f"wrapped[{value}]"] = {
            name: getattr(now[name], "__wrapped__", None) is sglang_methods[name] for name in now
        }

    pl = lp_ranks.placement(SHAPE)
    _install(stubs, moe, parallel, pl)
    # A rebalance through SGLang's hooked rebalance_experts (its own deepseek algorithm plans): the
    # window it planned from is what auto's choice is modeled on.
    algorithms.rebalance_experts(
        tokens_per_expert=torch.from_numpy(window()),
        num_physical_experts=pl.num_physical,
        num_local_physical_experts=pl.slots_per_gpu,
        num_groups=None,
        num_nodes=1,
        algorithm=algorithms.EplbAlgorithm.deepseek,
    )
    model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["DeepseekV3ForCausalLM"], num_experts_per_tok=lp_ranks.K),
        hf_text_config=types.SimpleNamespace(num_experts_per_tok=lp_ranks.K),
    )  # fmt: skip

    passes: dict[str, Any] = {}
    for one in PASSES:
        ids_by_rank = one.ids()
        local_GLE = np.stack([[lp_ranks.local_counts(r[layer], pl.num_logical) for layer in range(lp_ranks.L)]
                              for r in ids_by_rank])  # fmt: skip
        groups = [lp_ranks.OneProcessGroup(r, local_GLE[:, 0]) for r in range(pl.num_gpus)]
        phys: list[list[Any]] = []
        modes: list[str] = []
        for rank, ids_LTK in enumerate(ids_by_rank):
            parallel.moe_ep_rank, parallel.moe_ep_group = rank, groups[rank]
            setup.init_lplb_solvers(model_config=model_config)
            serving = sglang_lp.serving()
            assert serving is not None and serving.choice is not None

            layers = functools.partial(_layers, serving, groups[rank], local_GLE, ids_LTK, modes)
            runner = classes["ModelRunner"](layers)
            phys.append(runner.forward(forward_batch(ids_by_rank, rank, one.prefill)))
        passes[one.name] = {"phys": phys, "modes": modes, "exchanges": [g.calls for g in groups]}
    out["passes"] = passes

    serving = sglang_lp.serving()
    assert serving is not None and serving.window_WLE is not None
    out["window"] = serving.window_WLE.tolist()
    out["captures"] = {}
    for name, cls in (("decode", "DecodeCudaGraphRunner"), ("prefill", "PrefillCudaGraphRunner")):
        classes[cls]().capture_prepare(CAPTURES[name][0])
        out["captures"][name] = "lp" if serving.pass_lp else "static"
    return out


__all__ = [
    "CAPTURES",
    "KERNELS",
    "LARGE",
    "PASSES",
    "SHAPE",
    "SMALL",
    "Pass",
    "capture_batch",
    "forward_batch",
    "run",
    "window",
]
