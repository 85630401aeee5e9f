"""vLLM 0.33's and SGLang 0.5.23's own expert weight movement, driven by eplb's continuous plans.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, S slots per GPU, W window (passes).

Runs in a subprocess where both engines (PyPI, ``--no-deps``) are importable (:func:`run`); that
process spawns real Gloo ranks (eplb.moe.spawn.run_ranks). Every rank plans the same sequence of
continuous rebalances with ``eplb.solver.solve`` (a move budget per plan) on a drifting window,
lays its slots out as the first plan says, then hands each applied plan to the engine's code:

- vLLM: ``rearrange_expert_weights_inplace`` with the communicator its own factory
  (``create_eplb_communicator``) builds for ``torch_gloo``;
- SGLang: ``update_expert_weights_single_layer``, per layer, as its updater calls it.

The bytes the engine sends and receives are counted by wrapping ``batch_isend_irecv`` where each
engine calls it (vLLM: the name its communicator module imported; SGLang: ``torch.distributed``'s),
the only P2P entry either uses. Expert bytes are a function of (layer, expert, tensor)
(tests.helpers.sglang_updater_ranks.expert_bytes), so what each slot must hold after a move is
known independently of the engine.

Two stand-ins, both outside the transfer path:

- vLLM's ``vllm.distributed.stateless_coordinator`` (imported by its communicator module for one
  ``isinstance`` check on elastic EP groups) imports vLLM's CUDA communicator, whose imports reach
  aiter, the attention backends, xgrammar, fastapi and opentelemetry: it is replaced by a module
  holding an empty ``StatelessGroupCoordinator`` class.
- vLLM's Gloo communicator, as the PyPI (CUDA) wheel ships it, cannot run on a host without an
  accelerator; :func:`vllm_cpu_errors` records both errors on every run. Its receive staging
  buffers are allocated with ``pin_memory=PIN_MEMORY``, and the wheel's platform on a CPU host
  (``UnspecifiedPlatform``) says True (:data:`NO_PINNED`); it then waits for its device-to-host
  copies with ``torch.accelerator.current_stream().synchronize()``, which raises with no
  accelerator (:data:`NO_ACCELERATOR`). The rank sets the communicator module's ``PIN_MEMORY``
  to False (what vLLM's own ``CpuPlatform.is_pin_memory_available`` returns) and makes
  ``torch.accelerator.current_stream`` a stream whose ``synchronize`` does nothing (CPU copies are
  synchronous); everything else, the sends and receives included, is vLLM's.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eplb.moe.spawn import RankContext
from tests.helpers.sglang_updater_ranks import expert_bytes, tensor_specs

NO_ACCELERATOR = "Cannot access accelerator device when none is available."
"""What vLLM's Gloo communicator raises on a CPU-only host before its sends (torch.accelerator.current_stream)."""
NO_PINNED = "pin_memory=True requires a CUDA or other accelerator backend"
"""What it raises there before its receives: the CUDA wheel's platform on a CPU host
(``UnspecifiedPlatform``) says pinned memory is available."""


# ---- eplb's continuous plans --------------------------------------------------------------------
def drifting_windows(case: dict[str, Any]) -> Iterator[np.ndarray]:
    """int64 [W, L, E] windows of a load whose per-layer expert popularity drifts (AR(1) logits,
    Poisson counts): the same sequence on every rank for the same seed."""
    rng = np.random.default_rng(case["seed"])
    L, E, W = case["L"], case["E"], case["W"]
    logits_LE = rng.normal(0.0, 1.0, (L, E))
    while True:
        passes = []
        for _ in range(W):
            logits_LE = 0.97 * logits_LE + case["drift"] * rng.normal(0.0, 1.0, (L, E))
            share_LE = np.exp(logits_LE) / np.exp(logits_LE).sum(axis=1, keepdims=True)
            passes.append(rng.poisson(50.0 * E * share_LE))
        yield np.stack(passes)


def continuous_plans(case: dict[str, Any], bytes_per_expert: int) -> list[dict[str, Any]]:
    """The first plan (no current placement: the layout the slots start in), then ``steps``
    budgeted continuous plans, each from the placement the previous applied plan left."""
    from eplb.solver import SolveOptions, Topology, solve

    topology = Topology(num_gpus=case["G"], num_nodes=case["nnodes"], num_physical=case["P"])
    windows = drifting_windows(case)
    first = solve(next(windows), topology, None, SolveOptions(bytes_per_expert=bytes_per_expert))
    current = first.placement
    plans: list[dict[str, Any]] = [{"new_LP": current.phy2log_LP.copy()}]
    options = SolveOptions(max_moved_experts=case["budget"], bytes_per_expert=bytes_per_expert)
    for _ in range(case["steps"]):
        plan = solve(next(windows), topology, current, options)
        assert plan.diff is not None
        old_LP = current.phy2log_LP.copy()
        if plan.apply:
            current = plan.placement
        plans.append(
            {
                "old_LP": old_LP,
                "new_LP": current.phy2log_LP.copy(),
                "applied": bool(plan.apply),
                "copies": plan.diff.experts_moved_across_gpus if plan.apply else 0,
                "arrivals_G": (plan.diff.arrivals_LGE.sum(axis=(0, 2)) if plan.apply else np.zeros(case["G"]))
                .astype(int)
                .tolist(),
                "local_copies": plan.diff.local_copies if plan.apply else 0,
                "changed_slots": plan.diff.num_changed_slots if plan.apply else 0,
            }
        )
    return plans


# ---- slots and their bytes ----------------------------------------------------------------------
def layer_tensors(phy2log_LP: np.ndarray, layer: int, rank: int, S: int, kind: str) -> list[torch.Tensor]:
    """This rank's slot tensors [S, ...] of one layer, each slot holding its expert's bytes."""
    experts = phy2log_LP[layer, rank * S : (rank + 1) * S]
    return [
        torch.stack([expert_bytes(layer, int(x), i, shape, dtype) for x in experts]).contiguous()
        for i, (shape, dtype) in enumerate(tensor_specs(kind))
    ]


def nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def bytes_per_expert(kind: str) -> int:
    return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in tensor_specs(kind))


def holds_plan(
    weights_L: list[list[torch.Tensor]], phy2log_LP: np.ndarray, rank: int, S: int, kind: str
) -> bool:
    """Whether every tensor of every slot of every layer holds what ``phy2log_LP`` places there."""
    return all(
        torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        for layer, tensors in enumerate(weights_L)
        for got, want in zip(tensors, layer_tensors(phy2log_LP, layer, rank, S, kind), strict=True)
    )


# ---- counting the engine's P2P ------------------------------------------------------------------
class P2PCounter:
    """Wraps a ``batch_isend_irecv``: the bytes of every isend and irecv it is handed, per peer."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}
        self.calls = 0

    def __call__(self, ops: list[Any]) -> Any:
        self.calls += 1
        for op in ops:
            name = getattr(op.op, "__name__", "")
            assert name in ("isend", "irecv"), name
            book = self.sent if name == "isend" else self.received
            book[int(op.peer)] = book.get(int(op.peer), 0) + nbytes(op.tensor)
        return self.inner(ops)

    def take(self) -> dict[str, Any]:
        out = {"sent": sum(self.sent.values()), "received": sum(self.received.values()),
               "sent_to": {str(k): v for k, v in sorted(self.sent.items())}, "calls": self.calls}  # fmt: skip
        self.sent, self.received, self.calls = {}, {}, 0
        return out


@contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[Any]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield value
    finally:
        setattr(owner, name, old)


# ---- vLLM ---------------------------------------------------------------------------------------
def import_vllm_transfer() -> tuple[Any, Any]:
    """vLLM's ``rearrange_expert_weights_inplace`` and its communicator module (see the module
    docstring for the one stand-in module)."""
    name = "vllm.distributed.stateless_coordinator"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.__dict__["StatelessGroupCoordinator"] = type("StatelessGroupCoordinator", (), {})
        sys.modules[name] = stub
    from vllm.distributed.eplb import eplb_communicator
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace

    return rearrange_expert_weights_inplace, eplb_communicator


class _CpuStream:
    """torch.accelerator's current stream on a host without one: CPU copies are already done."""

    def synchronize(self) -> None:
        return None


def vllm_cpu_errors(communicator: Any, peer: int) -> dict[str, str]:
    """What vLLM's Gloo communicator raises, as shipped, on a CPU-only host for a queued send and
    for a queued receive. Both raise before any P2P op is posted, so no peer is left waiting."""
    out = {}
    for op in ("send", "recv"):
        getattr(communicator, f"add_{op}")([torch.zeros(4)], peer, expert_id=0)
        try:
            communicator.execute()
            out[op] = ""
        except RuntimeError as exc:
            out[op] = str(exc)
        communicator._ops.clear()  # execute clears them only once it has built its ops
    return out


def vllm_rank(ctx: RankContext, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case, per applied plan: vLLM's rearrangement through its ``torch_gloo`` communicator."""
    import torch.distributed as dist

    rearrange, comm_mod = import_vllm_transfer()
    group = dist.group.WORLD
    coordinator = types.SimpleNamespace(cpu_group=group, device_group=group)  # what the factory reads
    results = []
    for case in cases:
        kind, rank, S = case["kind"], ctx.rank, case["P"] // ctx.world_size
        plans = continuous_plans(case, bytes_per_expert(kind))
        weights_L = [layer_tensors(plans[0]["new_LP"], x, rank, S, kind) for x in range(case["L"])]
        buffers = [torch.empty_like(t) for t in weights_L[0]]
        communicator = comm_mod.create_eplb_communicator(coordinator, "torch_gloo", weights_L, buffers)
        out: dict[str, Any] = {"name": case["name"], "communicator": type(communicator).__name__}
        if accelerator_missing():
            out["cpu_errors"] = vllm_cpu_errors(communicator, (rank + 1) % ctx.world_size)
        counter = P2PCounter(comm_mod.batch_isend_irecv)
        steps = []
        with patched(comm_mod, "batch_isend_irecv", counter), cpu_stream(), cpu_staging(comm_mod):
            for plan in plans[1:]:
                if plan["applied"]:
                    rearrange(
                        torch.from_numpy(plan["old_LP"]).long(), torch.from_numpy(plan["new_LP"]).long(),
                        weights_L, buffers, group, communicator,
                    )  # fmt: skip
                steps.append(step_result(plan, counter, weights_L, rank, S, kind))
        out["steps"] = steps
        results.append(out)
    return results


def accelerator_missing() -> bool:
    return not torch.accelerator.is_available()


@contextmanager
def cpu_stream() -> Iterator[None]:
    """torch.accelerator.current_stream, on a host without an accelerator, as a no-op stream."""
    if not accelerator_missing():
        yield
        return
    with patched(torch.accelerator, "current_stream", lambda *_a, **_k: _CpuStream()):
        yield


@contextmanager
def cpu_staging(comm_mod: Any) -> Iterator[None]:
    """vLLM's staging buffers unpinned where there is no accelerator (as its CpuPlatform says)."""
    if not accelerator_missing():
        yield
        return
    with patched(comm_mod, "PIN_MEMORY", False):
        yield


def step_result(
    plan: dict[str, Any],
    counter: P2PCounter,
    weights_L: list[list[torch.Tensor]],
    rank: int,
    S: int,
    kind: str,
) -> dict[str, Any]:
    counted = counter.take()
    return {
        **counted,
        "applied": plan["applied"],
        "copies": plan["copies"],
        "arrivals_G": plan["arrivals_G"],
        "local_copies": plan["local_copies"],
        "changed_slots": plan["changed_slots"],
        "map": hashlib.sha256(plan["new_LP"].astype(np.int32).tobytes()).hexdigest()[:16],
        "holds_plan": holds_plan(weights_L, plan["new_LP"], rank, S, kind),
    }


# ---- SGLang -------------------------------------------------------------------------------------
def sglang_rank(ctx: RankContext, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case, per applied plan: SGLang's ``update_expert_weights_single_layer`` on every layer,
    with the arguments its ``_update_expert_weights_raw`` passes."""
    import torch.distributed as dist
    from sglang.srt.eplb.expert_location_updater import (
        create_temp_buffers,
        update_expert_weights_single_layer,
    )

    results = []
    for case in cases:
        kind, rank, S = case["kind"], ctx.rank, case["P"] // ctx.world_size
        plans = continuous_plans(case, bytes_per_expert(kind))
        weights_L = [layer_tensors(plans[0]["new_LP"], x, rank, S, kind) for x in range(case["L"])]
        temp = create_temp_buffers(weights_L[0])
        counter = P2PCounter(dist.batch_isend_irecv)
        steps = []
        with patched(dist, "batch_isend_irecv", counter):
            for plan in plans[1:]:
                for layer in range(case["L"]) if plan["applied"] else ():
                    missing: list[int] = []
                    update_expert_weights_single_layer(
                        routed_experts_weights=weights_L[layer], temp_buffers=temp,
                        old_physical_to_logical_map=plan["old_LP"][layer].tolist(),
                        new_physical_to_logical_map=plan["new_LP"][layer].tolist(),
                        num_local_physical_experts=S, num_gpu_per_node=ctx.world_size // case["nnodes"],
                        rank=rank, world_size=ctx.world_size, missing_logical_experts_info=missing,
                    )  # fmt: skip
                    assert not missing, missing
                steps.append(step_result(plan, counter, weights_L, rank, S, kind))
        results.append({"name": case["name"], "steps": steps})
    return results


# ---- the subprocess -----------------------------------------------------------------------------
ENGINES: dict[str, Callable[..., Any]] = {"vllm": vllm_rank, "sglang": sglang_rank}


def main(argv: list[str]) -> int:
    """``python -m tests.helpers.engine_transfer_ranks ENGINE WORLD CASES.json OUT.json``."""
    from eplb.moe.spawn import run_ranks

    engine, world, cases_path, out_path = argv[0], int(argv[1]), Path(argv[2]), Path(argv[3])
    cases = json.loads(cases_path.read_text())
    results = run_ranks(ENGINES[engine], world, args=(cases,), timeout_s=400)
    out_path.write_text(json.dumps({"results": results}))
    return 0


def run(engine: str, world: int, cases: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Run one engine's transfers on ``world`` ranks in a subprocess with the engines importable;
    per rank, per case, its result."""
    from tests.helpers.engines import ROOT, ensure_engines
    from tests.helpers.sglang_updater_ranks import ensure_extra

    site, extra = ensure_engines(), ensure_extra()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPLB_", "VLLM_", "SGLANG_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(extra), str(ROOT)])
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out = Path(tmp) / "cases.json", Path(tmp) / "out.json"
        cases_path.write_text(json.dumps([dict(c, G=world) for c in cases]))
        cmd = [sys.executable, "-m", "tests.helpers.engine_transfer_ranks", engine, str(world), str(cases_path),
               str(out)]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not out.is_file():
            raise AssertionError(
                f"{engine} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-8000:]}"
            )
        results: list[list[dict[str, Any]]] = json.loads(out.read_text())["results"]
    return results


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
