"""eplb's metrics scraped from inside vLLM 0.33 and SGLang 0.5.23 on real Gloo ranks: the passes
the engine ran and the weight transfers it made, through the hooks the plugins install.

Runs in a subprocess where both engines (PyPI, ``--no-deps``) are importable (:func:`run`); that
process spawns the ranks (eplb.moe.spawn.run_ranks), each with ``EPLB_METRICS_PORT=0`` and the
engine's plugin loaded by the engine's own loader. Rank 0 scrapes its exporter over HTTP after the
rebalances and returns the samples; every rank returns what it did.

- vLLM: ``EplbState.step`` (vLLM's own body, on an ``EplbState`` with no model, its EP group the
  world), then at each rebalance what vLLM's ``EplbState.rearrange`` calls: the policy table's
  policy, then ``eplb_state.rearrange_expert_weights_inplace`` (vLLM's, through its ``torch_gloo``
  communicator, with tests.helpers.engine_transfer_ranks's two stand-ins for a host without an
  accelerator). Two modules ``eplb_state`` imports for an ``isinstance`` check and a type hint
  (``stateless_coordinator``, ``models.interfaces``) pull vLLM's model stack and are stand-ins.
- SGLang: its own ``EPLBManager`` (tests.helpers.sglang_updater_ranks's config stand-ins; the
  recorder's dump returns the window), ``--eplb-algorithm scipy``, driven one
  ``on_forward_pass_end`` per pass: it plans through eplb's hook and moves the weights with
  SGLang's ``ExpertLocationUpdater`` (or, with ``updater``, eplb's hot-swap) on Gloo.

``python -m tests.helpers.engine_scrape ENGINE WORLD CASE.json OUT.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eplb.moe.spawn import RankContext


def scrape(url: str) -> dict[str, float]:
    """The exporter's samples, by name with sorted labels (``name{k=v,...}``)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("engine", "model_name")
            )
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


# ---- vLLM ---------------------------------------------------------------------------------------
INTERVAL = 10**9
"""vLLM's ``step_interval`` here: never reached (a rearrangement of the model-less state would fail);
its ``window_size`` is ``INTERVAL - case["unrecorded"]``, so vLLM records every step from then on."""


def _stub_vllm_model_stack() -> None:
    for name, cls in (
        ("vllm.distributed.stateless_coordinator", "StatelessGroupCoordinator"),
        ("vllm.model_executor.models.interfaces", "MixtureOfExperts"),
    ):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__dict__[cls] = type(cls, (), {})
            sys.modules[name] = module


def vllm_rank(ctx: RankContext, case: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from tests.helpers.engine_transfer_ranks import cpu_staging, cpu_stream, layer_tensors

    _stub_vllm_model_stack()
    import vllm.plugins

    vllm.plugins.load_general_plugins()  # eplb's plugin: EPLB_VLLM_POLICY=1, EPLB_METRICS_PORT=0
    from vllm.distributed.eplb import eplb_communicator, eplb_state, rebalance_execute
    from vllm.distributed.eplb.policy import EPLB_POLICIES

    hooked = {
        "step": eplb_state.EplbState.step.__wrapped__ is not None,
        "transfer": eplb_state.rearrange_expert_weights_inplace.__wrapped__
        is rebalance_execute.rearrange_expert_weights_inplace,
    }
    group = dist.group.WORLD
    coordinator = types.SimpleNamespace(cpu_group=group, device_group=group)
    eplb_state.get_ep_group = lambda: coordinator  # the EP group vLLM's step reads: the world
    state = eplb_state.EplbState.__new__(eplb_state.EplbState)  # vLLM's step over no model
    state.__dict__.update(
        model_states={}, expert_rearrangement_step=0, expert_rearrangement_step_interval=INTERVAL,
        expert_load_window_size=INTERVAL - case["unrecorded"], expert_load_window_step=0, is_async=False,
        should_record_tensor=None,
        parallel_config=types.SimpleNamespace(eplb_config=types.SimpleNamespace(log_balancedness_interval=1)),
    )  # fmt: skip
    L, E, P, G, kind = case["L"], case["E"], case["P"], ctx.world_size, "bf16"
    S = P // G
    policy = EPLB_POLICIES["default"]
    live_LP = np.concatenate([np.tile(np.arange(E), (L, 1)), np.tile(np.arange(P - E), (L, 1)) % E], axis=1)
    weights_L = [layer_tensors(live_LP, x, ctx.rank, S, kind) for x in range(L)]
    buffers = [torch.empty_like(t) for t in weights_L[0]]
    communicator = eplb_communicator.create_eplb_communicator(coordinator, "torch_gloo", weights_L, buffers)
    rng = np.random.default_rng(case["seed"])
    applied = 0
    with cpu_stream(), cpu_staging(eplb_communicator):
        for _ in range(case["rebalances"]):
            for _ in range(case["passes"]):
                state.step()
            load_LE = torch.from_numpy(rng.poisson(100 * np.exp(2 * rng.standard_normal((L, E)))))
            old = torch.from_numpy(live_LP).long()
            new = policy.rebalance_experts(load_LE, P, 1, 1, G, old)  # as vLLM's rearrange calls it
            if not torch.equal(new, old):  # vLLM moves whatever map the policy returns
                eplb_state.rearrange_expert_weights_inplace(old, new, weights_L, buffers, group, communicator,
                                                            False, None)  # fmt: skip
            applied += int(policy.last_plan.applied)
            live_LP = new.numpy()
    dist.barrier()
    exporter = policy.metrics.exporter
    return {
        "hooked": hooked,
        "applied": applied,
        "samples": None if exporter is None else scrape(exporter.url),
        "holds_plan": all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for x in range(L)
            for a, b in zip(weights_L[x], layer_tensors(live_LP, x, ctx.rank, S, kind), strict=True)
        ),
    }


# ---- SGLang -------------------------------------------------------------------------------------
def sglang_rank(ctx: RankContext, case: dict[str, Any]) -> dict[str, Any]:
    from tests.helpers import sglang_updater_ranks as ranks

    P, rank = case["P"], ctx.rank
    S = P // ctx.world_size
    ranks.sglang_config(ctx.world_size, P, 1)
    import sglang.srt.eplb.expert_location as el

    el.get_exec().moe.eplb_algorithm = "scipy"  # eplb's solver, through the plugin's hooks
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()  # eplb's plugin: EPLB_METRICS_PORT=0 (and EPLB_SGLANG_WEIGHT_UPDATER with updater)
    HookRegistry.apply_hooks()
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater

    from eplb.integrations import sglang as plugin

    rng = np.random.default_rng(case["seed"])
    manager, weights = ranks.serving_manager(ctx, rng, P, "bf16")
    passes = changed = 0
    for _ in range(case["rebalances"]):
        before_LP = ranks.live().physical_to_logical_map_cpu.numpy().copy()
        counts = torch.from_numpy(rng.gamma(0.05, 1000.0, size=(10, ranks.L, ranks.E))).round()
        ranks.recorder().dump_record = lambda output_mode, c=counts: {
            "logical_count": c, "average_utilization_rate_over_window": None,
        }  # fmt: skip
        for _ in range(ranks.PASSES):  # the interval, then one chunk of layers per pass
            manager.on_forward_pass_end()
            passes += 1
        changed += int((ranks.live().physical_to_logical_map_cpu.numpy() != before_LP).any())
    torch.distributed.barrier()
    metrics = plugin.metrics()
    live_LP = ranks.live().physical_to_logical_map_cpu.numpy().astype(np.int32)
    states = ranks.layer_states(weights, live_LP, live_LP, rank, S, "bf16")
    return {
        "hooked": {"update": ExpertLocationUpdater.update.__wrapped__ is not None},
        "passes": passes,
        "applied": changed,
        "samples": None if metrics.exporter is None else scrape(metrics.exporter.url),
        "holds_plan": all(s[1] for s in states),
    }


ENGINES = {"vllm": vllm_rank, "sglang": sglang_rank}


def main(argv: list[str]) -> int:
    from eplb.moe.spawn import run_ranks

    engine, world, case_path, out_path = argv[0], int(argv[1]), Path(argv[2]), Path(argv[3])
    case = json.loads(case_path.read_text())
    results = run_ranks(ENGINES[engine], world, args=(case,), timeout_s=300)
    out_path.write_text(json.dumps(results))
    return 0


def run(engine: str, world: int, case: dict[str, Any], env: dict[str, str]) -> list[dict[str, Any]]:
    """One engine's ranks in a subprocess with the engines importable and ``env`` set; per rank, its result."""
    import subprocess

    from tests.helpers.engines import ROOT, ensure_engines
    from tests.helpers.sglang_updater_ranks import ensure_extra

    site, extra = ensure_engines(), ensure_extra()
    full = {k: v for k, v in os.environ.items() if not k.startswith(("EPLB_", "VLLM_", "SGLANG_"))}
    full.update(env, PYTHONPATH=os.pathsep.join([str(site), str(extra), str(ROOT)]))
    with tempfile.TemporaryDirectory() as tmp:
        case_path, out = Path(tmp) / "case.json", Path(tmp) / "out.json"
        case_path.write_text(json.dumps(case))
        cmd = [
            sys.executable,
            "-m",
            "tests.helpers.engine_scrape",
            engine,
            str(world),
            str(case_path),
            str(out),
        ]
        done = subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not out.is_file():
            raise AssertionError(
                f"{engine} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-8000:]}"
            )
        results: list[dict[str, Any]] = json.loads(out.read_text())
    return results


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
