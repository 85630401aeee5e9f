"""Host (CPU) time per call of the remap's Python path: what an eager prefill pays before the GPU works.

Shape legend: T tokens, K top-k, E logical experts, P physical slots.

Measured with the calling thread's CPU clock (``time.thread_time``), so other processes on a busy
machine do not count; the minimum over ``--rounds`` rounds of ``--calls`` calls. Rows:

- ``checks (stub backend)``: :func:`eplb.remap.api.remap_and_record` with a backend that does nothing
  (argument checks, backend lookup), with ``out_TK`` given and with the output allocated;
- ``prepared (stub backend)``: a prepared call (eplb.remap.prepared: the layer's fixed arguments
  checked once) with that backend;
- ``direct path (no-op launcher)``: ``remap_record_triton``'s direct path (eplb.kernels.
  remap_record_direct: launch shape, key, arguments) ending in a launcher that does nothing, alone,
  behind the public function and behind a prepared call (its own direct path). On CPU this stands
  in for the compiled kernel;
- ``recorder`` (``--layers`` layers, T = ``--recorder-tokens``): the per-pass host cost of every
  documented recorder path, as the difference to plain prepared remaps measured in the same run
  (``--passes`` rounds of one pass per path in a shuffled order; the median over rounds of each
  path minus the baseline of its round):
  ``rec.prepare()`` (the recording path: README, manager docs, eplb.moe's model); the public
  function given the recorder's rows as a ``**`` dict per layer (the removed ``layer_kwargs``),
  with the two tensors named, with every keyword named, without a recorder, and with two argument
  sets taking turns on each layer (SGLang's adapter with padding); ``begin_pass``/``end_pass``
  alone; the recorder and ``begin_pass``/``end_pass`` with the end of pass in two torch ops (the stat window's sum and fill, as before the one-launch push of
  eplb.kernels.window_push; on CPU both use torch); and, for scale, each call form into a function
  that does nothing (what Python's argument passing costs: ``**`` unpacks a dict per call). On CPU
  every remap ends in the no-op launcher behind the direct path; on CUDA in the real kernel;
- on CUDA also the real calls: the public function, the launcher alone, the launcher through
  ``kernel[grid]`` (an explicit config), SGLang 0.5.23's fused kernel and ``Tensor.copy_`` of
  the same bytes, and the prepared call. The GPU work is queued, not waited for (one sync per round).

    python -m benchmarks.bench_remap_host            # CPU: the Python parts
    python -m benchmarks.bench_remap_host --only-recorder --passes 400   # the recorder rows alone
    python -m benchmarks.bench_remap_host --json out.json   # on a CUDA machine: also real launches
    python -m benchmarks.bench_remap_host --only-recorder --passes 2000 --json rec.json   # CUDA: recorder rows
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import host_us, write_result
from benchmarks.peers import load_sglang_fused_kernel
from benchmarks.remap_inputs import SGLangDispatchInfo, router_ids
from eplb.kernels import remap_record as kernel
from eplb.kernels.direct_launch import DirectLaunch, DirectLaunchCache
from eplb.kernels.remap_record_direct import RemapDirectLauncher
from eplb.placement.model import Placement
from eplb.recorder.recorder import ExpertDistributionRecorder, RecorderConfig
from eplb.remap import api as remap
from eplb.remap import backends
from eplb.remap.call import RemapCall
from eplb.remap.prepared import prepare_remap
from eplb.remap.tables import DispatchTables


class _NoOpCompiled:
    """Stands in for a CompiledKernel whose launcher returns at once."""

    launch_metadata = None
    packed_metadata = None
    function = None

    def run(self, *args: Any) -> None:
        return None


def variants(T: int, device: torch.device, sglang: Any) -> dict[str, Callable[[], Any]]:
    K, E, P = 8, 256, 288
    tables = DispatchTables.from_placement(
        Placement.trivial(4, E, num_gpus=8, num_redundant=P - E), 3, device
    )
    ids = router_ids(T, K, E, device, seed=T)
    out = torch.empty_like(ids)
    counts_LP = torch.zeros((4, P), dtype=torch.int32, device=device)
    nvalid = torch.tensor([T], dtype=torch.int32, device=device)
    record = torch.ones(1, dtype=torch.int32, device=device)
    backends._RESOLVED[("noop", device.type)] = lambda *args: None
    kw: dict[str, Any] = {"counts_P": counts_LP[2], "num_valid_tokens": nvalid, "record": record}
    call = RemapCall(topk_ids_TK=ids, tables=tables, layer=2, mode="static", out_TK=out, **kw)
    rows: dict[str, Callable[[], Any]] = {
        "checks (stub backend), out given": lambda: remap.remap_and_record(
            ids, tables, 2, out_TK=out, backend="noop", **kw
        ),
        "checks (stub backend), out allocated": lambda: remap.remap_and_record(
            ids, tables, 2, backend="noop", **kw
        ),
    }
    stub_prepared = prepare_remap(tables, 2, backend="noop", **kw)
    rows["prepared (stub backend), out given"] = lambda: stub_prepared(ids, out)
    if device.type == "cpu":
        # The direct path with a launcher that does nothing (the compiled kernel's place on a GPU).
        direct = RemapDirectLauncher(
            lambda n, _d, rows: kernel.launch_shape(n, 132, rows), DirectLaunchCache(True, lambda: (-1, 0))
        )
        _, key = direct.launch(call)
        direct.cache.keep(key, _NoOpCompiled(), ())
        rows["direct path (no-op launcher)"] = lambda: direct.launch(call)
        real_direct = kernel.DIRECT
        kernel.DIRECT = direct
        backends._RESOLVED[("direct-noop", "cpu")] = kernel.remap_record_triton
        rows["public + direct path (no-op launcher)"] = lambda: remap.remap_and_record(
            ids, tables, 2, out_TK=out, backend="direct-noop", **kw
        )
        prepared = prepare_remap(tables, 2, backend="triton", **kw)
        rows["prepared + direct path (no-op launcher)"] = lambda: prepared(ids, out)
        rows["_restore"] = lambda: setattr(kernel, "DIRECT", real_direct)
        return rows
    cfg = kernel.default_config(ids.numel(), device)
    rows["eplb public, out given"] = lambda: remap.remap_and_record(
        ids, tables, 2, out_TK=out, backend="triton", **kw
    )
    rows["eplb public, out allocated"] = lambda: remap.remap_and_record(
        ids, tables, 2, backend="triton", **kw
    )
    rows["eplb launcher (direct)"] = lambda: kernel.remap_record_triton(call)
    prepared = prepare_remap(tables, 2, backend="triton", **kw)
    rows["eplb prepared (direct)"] = lambda: prepared(ids, out)
    rows["eplb launcher (kernel[grid])"] = lambda: kernel.remap_record_triton(call, config=cfg)
    if sglang is not None:
        info = SGLangDispatchInfo(tables.static_LE[2].contiguous())
        rows["sglang fused"] = lambda: sglang.eplb_map_and_record_fused(ids, info, counts_LP[2], nvalid)
    rows["copy_ (same bytes)"] = lambda: out.copy_(ids)
    return rows


class _NoOpCache(DirectLaunchCache):
    """A direct-launch cache whose every key holds the no-op launcher (CPU: the kernel's stand-in)."""

    def __init__(self) -> None:
        super().__init__(True, lambda: (-1, 0))
        self._noop = DirectLaunch(_NoOpCompiled(), ())

    def get(self, key: Any) -> DirectLaunch | None:
        return self._noop


BASELINE = "prepared, plain (the baseline)"
"""The recorder rows' reference: one prepared remap per layer, no recorder."""


def _empty_remap(
    topk_ids_TK: Any,
    tables: Any,
    layer: int,
    *,
    mode: str = "static",
    counts_P: Any = None,
    logical_counts_E: Any = None,
    num_valid_tokens: Any = None,
    record: Any = None,
    out_TK: Any = None,
    backend: str = "auto",
    lp: Any = None,
) -> Any:
    """remap_and_record's signature doing nothing: what Python's argument passing costs alone."""
    return out_TK


class _EmptyPrepared:
    """A prepared call doing nothing: what calling one costs alone."""

    __slots__ = ()

    def __call__(self, topk_ids_TK: Any, out_TK: Any = None) -> Any:
        return out_TK


def recorder_rows(T: int, layers: int, device: torch.device) -> dict[str, Callable[[], Any]]:
    """One forward pass of ``layers`` remaps per documented path (module docstring, ``recorder``).

    The public function keeps one prepared call per tables and layer (eplb.remap.api), so the rows
    that pass different argument sets use their own tables, as a serving process has one argument
    set per layer; ``two argument sets taking turns`` shows what sharing costs.
    """
    K, E, P = 8, 256, 288
    placement = Placement.trivial(layers, E, num_gpus=8, num_redundant=P - E)

    def new_tables() -> DispatchTables:
        return DispatchTables.from_placement(placement, 3, device)

    tables, plain_tables, turns_tables = new_tables(), new_tables(), new_tables()
    ids = router_ids(T, K, E, device, seed=T)
    out = torch.empty_like(ids)
    rec = ExpertDistributionRecorder(RecorderConfig(mode="stat", window=100), placement, device=device)
    rec.start()
    # The same recorder ending each pass with two torch ops (a sum and a fill), as before the
    # one-launch push (eplb.kernels.window_push); on CPU both recorders use torch.
    rec_torch = ExpertDistributionRecorder(RecorderConfig(mode="stat", window=100), placement, device=device)
    rec_torch._stat.push_kernel = None  # type: ignore[union-attr]  # mode "stat" has a window
    rec_torch.start()
    backend = "triton"
    plain = [prepare_remap(tables, layer, backend=backend) for layer in range(layers)]
    recorded = rec.prepare(tables, backend=backend)
    recorded_torch = rec_torch.prepare(tables, backend=backend)
    # The recorder's rows as keywords of the public function, built once (what layer_kwargs gave).
    kwargs: list[dict[str, Any]] = [
        {"counts_P": row, "record": rec.record_flag_1} for row in rec.pass_counts_LCP.unbind(0)
    ]
    turn = [0]

    def prepared_plain() -> None:
        for remap_layer in plain:
            remap_layer(ids, out)

    def prepared_recorder() -> None:
        rec.begin_pass(has_prefill=True, num_tokens=T)
        for remap_layer in recorded:
            remap_layer(ids, out)
        rec.end_pass()

    def prepared_recorder_torch() -> None:
        rec_torch.begin_pass(has_prefill=True, num_tokens=T)
        for remap_layer in recorded_torch:
            remap_layer(ids, out)
        rec_torch.end_pass()

    def public_plain() -> None:
        for layer in range(layers):
            remap.remap_and_record(ids, plain_tables, layer, out_TK=out, backend=backend)

    def public_layer_kwargs() -> None:
        rec.begin_pass(has_prefill=True, num_tokens=T)
        for layer in range(layers):
            kw: dict[str, Any] = kwargs[layer]
            remap.remap_and_record(ids, tables, layer, out_TK=out, backend=backend, **kw)
        rec.end_pass()

    def public_named() -> None:
        rec.begin_pass(has_prefill=True, num_tokens=T)
        flag = rec.record_flag_1
        for layer in range(layers):
            counts = kwargs[layer]["counts_P"]
            remap.remap_and_record(
                ids, tables, layer, out_TK=out, backend=backend, counts_P=counts, record=flag
            )
        rec.end_pass()

    def public_moe() -> None:  # every keyword named (and here out_TK)
        rec.begin_pass(has_prefill=True, num_tokens=T)
        for layer in range(layers):
            kw = kwargs[layer]
            remap.remap_and_record(
                ids,
                tables,
                layer,
                mode="static",
                counts_P=kw["counts_P"],
                logical_counts_E=None,
                num_valid_tokens=None,
                record=kw["record"],
                out_TK=out,
                backend=backend,
            )
        rec.end_pass()

    def public_turns() -> None:  # a recorded and an unrecorded argument set alternating per pass
        turn[0] ^= 1
        rec.begin_pass(has_prefill=True, num_tokens=T)
        for layer in range(layers):
            kw: dict[str, Any] = kwargs[layer] if turn[0] else {}
            remap.remap_and_record(ids, turns_tables, layer, out_TK=out, backend=backend, **kw)
        rec.end_pass()

    def passes_only() -> None:
        rec.begin_pass(has_prefill=True, num_tokens=T)
        rec.end_pass()

    def passes_only_torch() -> None:
        rec_torch.begin_pass(has_prefill=True, num_tokens=T)
        rec_torch.end_pass()

    empties = [_EmptyPrepared() for _ in range(layers)]

    def prepared_call_only() -> None:
        for empty in empties:
            empty(ids, out)

    def unpacking_only() -> None:
        for layer in range(layers):
            kw: dict[str, Any] = kwargs[layer]
            _empty_remap(ids, tables, layer, out_TK=out, backend=backend, **kw)

    def named_only() -> None:
        flag = rec.record_flag_1
        for layer in range(layers):
            counts = kwargs[layer]["counts_P"]
            _empty_remap(ids, tables, layer, out_TK=out, backend=backend, counts_P=counts, record=flag)

    return {
        BASELINE: prepared_plain,
        "prepared, recorder (rec.prepare)": prepared_recorder,
        "prepared, recorder, end of pass in torch ops": prepared_recorder_torch,
        "public, plain": public_plain,
        "public, recorder rows (**kwargs)": public_layer_kwargs,
        "public, recorder (counts_P=, record=)": public_named,
        "public, recorder rows (every keyword named)": public_moe,
        "public, two argument sets taking turns": public_turns,
        "begin_pass + end_pass alone": passes_only,
        "begin_pass + end_pass alone, torch ops": passes_only_torch,
        "empty callee, remaps[layer](ids, out)": prepared_call_only,
        "empty callee, **kwargs": unpacking_only,
        "empty callee, counts_P=, record=": named_only,
    }


def recorder_pass_us(T: int, layers: int, passes: int, device: torch.device) -> dict[str, Any]:
    """Median thread-CPU µs per pass of each recorder path, and the median over pass rounds of each
    minus the baseline of the same round (one run)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    real_direct = kernel.DIRECT
    if device.type == "cpu":
        kernel.DIRECT = RemapDirectLauncher(
            lambda n, _d, rows: kernel.launch_shape(n, 132, rows), _NoOpCache()
        )
    try:
        rows = recorder_rows(T, layers, device)
        for fn in rows.values():
            for _ in range(3):  # compile, prepare (the public function's cache), warm
                fn()
        samples: dict[str, list[float]] = {name: [] for name in rows}
        order = list(rows)
        for p in range(passes):
            random.Random(p).shuffle(order)
            for name in order:
                sync()
                start = time.thread_time()
                rows[name]()
                samples[name].append((time.thread_time() - start) * 1e6)
        sync()
    finally:
        kernel.DIRECT = real_direct
    median = {name: statistics.median(v) for name, v in samples.items()}
    base = samples[BASELINE]
    # Each pass round runs every row once, so a row minus the baseline of the same round cancels
    # most of what another process's load adds to both; the median of those differences.
    above = {
        name: statistics.median(a - b for a, b in zip(v, base, strict=True)) for name, v in samples.items()
    }
    return {"T": T, "layers": layers, "passes": passes, "pass_us": median, "above_prepared_plain_us": above}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 4096])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=58, help="recorder rows: MoE layers per pass")
    ap.add_argument("--recorder-tokens", type=int, default=4096, help="recorder rows: T")
    ap.add_argument("--passes", type=int, default=300, help="recorder rows: passes per path (median)")
    ap.add_argument("--only-recorder", action="store_true", help="skip the per-call rows")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sglang = load_sglang_fused_kernel() if device.type == "cuda" and not args.only_recorder else None
    results: dict[str, dict[str, float]] = {}
    for T in [] if args.only_recorder else args.tokens:
        rows = variants(T, device, sglang)
        restore = rows.pop("_restore", None)
        for fn in rows.values():
            fn()  # compile / keep the specialisation
        results[str(T)] = {name: host_us(fn, args.calls, args.rounds, sync) for name, fn in rows.items()}
        if restore is not None:
            restore()
    if results:
        print(
            f"host µs per call (thread CPU time, min of {args.rounds} rounds of {args.calls}); device {device}"
        )
        for name in results[str(args.tokens[0])]:
            print(f"{name:42s}" + "".join(f"{results[str(T)][name]:9.2f}" for T in args.tokens))
    recorder = recorder_pass_us(args.recorder_tokens, args.layers, args.passes, device)
    print(
        f"\nrecorder: host µs per pass of {args.layers} layers, T = {args.recorder_tokens} "
        f"(thread CPU time, median of {args.passes} passes); device {device}"
    )
    print(f"{'path':42s}{'per pass':>10s}{'above baseline':>16s}")
    for name, us in recorder["pass_us"].items():
        print(f"{name:42s}{us:10.1f}{recorder['above_prepared_plain_us'][name]:+16.1f}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "device": str(device), "torch": torch.__version__}
        write_result(args.json, {"meta": meta, "host_us": results, "recorder": recorder})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
