"""Direct launches of the remap kernel (eplb.kernels.remap_record_direct) against the kernel[grid] path.

Under the interpreter there is no compiled kernel, so :class:`_FakeCompiled` stands in for one: the
kernel[grid] path returns it, and its ``run`` (what a direct launch calls) asserts that the call's
specialisation (pointer alignment, numel class, constexprs) equals the one it was "compiled" for,
maps the integer pointers back to tensors and runs the interpreted kernel. A key too coarse
would reuse an entry for another specialisation and fail that assertion. Those tests take CPU
tensors, so they are ``interpreter`` tests (skipped where kernels are compiled); the gpu test uses
the real compiled kernels and checks that Triton's own cache maps each call to the kernel that was
kept. The key and launch-shape tests launch nothing and run everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from eplb.remap.api import remap_and_record
from eplb.remap.call import RemapCall
from eplb.remap.tables import DispatchTables
from tests.helpers.remap_reference import LOCAL_MODES, random_ids, random_tables, run_remap

kernel = pytest.importorskip("eplb.kernels.remap_record")
from eplb.kernels.direct_launch import DirectLaunchCache  # noqa: E402
from eplb.kernels.remap_record_direct import RemapDirectLauncher  # noqa: E402

NUM_POINTERS = 11  # ids, out, 4 tables, counts, logical counts, num_valid_tokens, record, seed
NUMEL_POS = 11
NUM_RUNTIME = 17


def _spec(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What Triton specialises on, from tensor or integer pointers: alignment, numel, constexprs."""
    ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args[:NUM_POINTERS]]
    numel = args[NUMEL_POS]
    return (tuple(p % 16 == 0 for p in ptrs), numel == 1, numel % 16 == 0, tuple(args[NUM_RUNTIME:]))


class _FakeCompiled:
    """A CompiledKernel stand-in: ``run`` takes integer pointers, checks the specialisation, runs."""

    launch_metadata = None
    packed_metadata = "packed"
    function = "function"

    def __init__(self, jit: Any, spec: tuple[Any, ...], owner: _Harness) -> None:
        self._jit, self._spec, self._owner = jit, spec, owner

    def run(self, gx: int, gy: int, gz: int, stream: int, function: Any, metadata: Any, *rest: Any) -> None:
        launch_metadata, enter, leave, *args = rest
        assert (gy, gz, function, metadata) == (1, 1, "function", "packed")
        assert launch_metadata is None and enter is None and leave is None
        assert all(isinstance(a, int) for a in args[:NUM_POINTERS]), "pointers go as integers"
        assert _spec(tuple(args)) == self._spec, "a kept kernel was launched for another specialisation"
        self._owner.direct_launches += 1
        if self._owner.refuse:
            raise TypeError("launcher refuses these arguments")
        tensors = [self._owner.tensors[a] if i < NUM_POINTERS else a for i, a in enumerate(args)]
        self._jit[(gx,)](*tensors)


class _Harness:
    """Patches eplb.kernels.remap_record so the direct path runs under the interpreter."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, device_index: int = -1) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.direct_launches = 0
        self.jit_launches = 0
        self.refuse = False
        jit = kernel._remap_record_kernel
        harness = self

        class _RecordingJit:
            def __getitem__(self, grid: tuple[int]) -> Callable[..., _FakeCompiled]:
                def launch(*args: Any, num_warps: int) -> _FakeCompiled:
                    harness.jit_launches += 1
                    for a in args[:NUM_POINTERS]:
                        harness.tensors[a.data_ptr()] = a
                    jit[grid](*args, num_warps=num_warps)
                    return _FakeCompiled(jit, _spec(args), harness)

                return launch

        self.direct = RemapDirectLauncher(
            lambda numel, _device, rows: kernel.launch_shape(
                numel, 4, rows
            ),  # 4 units: the CPU's, as default_config
            DirectLaunchCache(True, lambda: (device_index, 0)),
        )
        monkeypatch.setattr(kernel, "_remap_record_kernel", _RecordingJit())
        monkeypatch.setattr(kernel, "DIRECT", self.direct)

    def register(self, *tensors: torch.Tensor | None) -> None:
        for t in tensors:
            if t is not None:
                self.tensors[t.data_ptr()] = t


def _call(
    ids,
    tables,
    layer,
    mode,
    counts,
    logical,
    nvalid,
    record,
    *,
    jit: bool,
    harness: _Harness | None = None,
    map_padded: bool = False,
) -> torch.Tensor:
    out = torch.full_like(ids, -7)
    bufs = {"counts": counts, "logical": logical, "nvalid": nvalid, "record": record}
    if harness is not None:
        harness.register(ids, out, *bufs.values())
    # An explicit config always launches through kernel[grid]; without one, the public function.
    config = kernel.default_config(ids.numel(), ids.device) if jit else None
    return run_remap(ids, tables, layer, mode, out=out, config=config, map_padded=map_padded, **bufs)


def _random_case(rng: np.random.Generator, tables_pool: list[DispatchTables]) -> dict[str, Any]:
    tables = tables_pool[int(rng.integers(0, len(tables_pool)))]
    E, P, L = tables.num_logical, tables.num_physical, tables.num_layers
    T = int(rng.choice([1, 2, 5, 8, 64, 129, 300]))
    K = int(rng.choice([1, 3, 8]))
    base = random_ids(rng, T + 1, K, E, str(rng.choice(["uniform", "nasty", "one_expert", "skewed"])))
    ids = base[1:] if rng.random() < 0.4 else base[:T].clone()  # a view at 4*K bytes: misaligned for K=3
    counts_LP = torch.zeros((L, P), dtype=torch.int32)  # a row of it: misaligned where P % 4 != 0
    logical = (
        torch.zeros(E + 1, dtype=torch.int32)[1:] if rng.random() < 0.5 else torch.zeros(E, dtype=torch.int32)
    )
    return {
        "tables": tables,
        "layer": int(rng.integers(0, L)),
        "mode": str(rng.choice(LOCAL_MODES)),
        "ids": ids,
        "counts": counts_LP[int(rng.integers(0, L))] if rng.random() < 0.8 else None,
        "logical": logical if rng.random() < 0.5 else None,
        "nvalid": torch.tensor([int(rng.integers(-2, T + 3))], dtype=torch.int32)
        if rng.random() < 0.6
        else None,
        "record": torch.tensor([int(rng.choice([0, 1, 5]))], dtype=torch.int32)
        if rng.random() < 0.5
        else None,
        "map_padded": bool(rng.random() < 0.5),
    }


@pytest.mark.interpreter
def test_direct_launches_equal_the_jit_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random and nasty calls, each twice through the public function (the second one direct when its
    specialisation was seen) and once through kernel[grid]: identical ids and counts."""
    harness = _Harness(monkeypatch)
    rng = np.random.default_rng(21)
    pool = [
        random_tables(rng, 13, 17, 1, rank=0, num_layers=3)[1],
        random_tables(rng, 13, 17, 1, rank=0, num_layers=3)[1],  # same shapes: same keys, own pointers
        random_tables(rng, 30, 36, 4, rank=2)[1],
        random_tables(rng, 5, 5, 5, rank=4)[1],
    ]
    for tables in pool:
        harness.register(
            tables.static_LE, tables.log2phy_LER, tables.logcnt_LE, tables.cumweights_LER, tables.seed_1
        )
    for _ in range(30):
        case = _random_case(rng, pool)
        args = [case[k] for k in ("ids", "tables", "layer", "mode")]
        bufs = [case[k] for k in ("counts", "logical", "nvalid", "record")]
        results = []
        for jit in (False, False, True):
            for buf in bufs[:2]:
                if buf is not None:
                    buf.zero_()
            out = _call(*args, *bufs, jit=jit, harness=harness, map_padded=case["map_padded"])
            results.append((out, *(None if b is None else b.clone() for b in bufs[:2])))
        for got in results[:2]:
            for a, b in zip(got, results[2], strict=True):
                assert (a is None and b is None) or torch.equal(a, b)
    assert harness.direct_launches >= 25, harness.direct_launches
    assert len(harness.direct.cache) <= harness.jit_launches


def test_key_changes_exactly_with_the_specialisation(monkeypatch: pytest.MonkeyPatch) -> None:
    harness = _Harness(monkeypatch)
    rng = np.random.default_rng(22)
    _, tables = random_tables(rng, 13, 17, 1, rank=0)
    _, same_shape = random_tables(rng, 13, 17, 1, rank=0)
    _, other_shape = random_tables(rng, 13, 18, 1, rank=0)
    out_buf = torch.empty(160400, dtype=torch.int32)

    def key(
        T=64,
        K=8,
        tables=tables,
        layer=0,
        mode="static",
        counts=True,
        shift=0,
        ids_shift=0,
        rows=0,
        map_padded=False,
    ):
        ids = torch.zeros(T * K + 8, dtype=torch.int32)[ids_shift : ids_shift + T * K].view(T, K)
        out = out_buf[shift : shift + T * K].view(T, K)
        shape = (rows, tables.num_physical) if rows else (tables.num_physical,)
        c = torch.zeros(shape, dtype=torch.int32) if counts else None
        launched, k = harness.direct.launch(
            RemapCall(
                topk_ids_TK=ids,
                tables=tables,
                layer=layer,
                mode=mode,
                out_TK=out,
                counts_P=c,
                map_padded_rows=map_padded,
            )
        )
        assert not launched  # nothing kept here: every call misses
        return k

    base = key()
    same = [key(T=66), key(layer=1), key(tables=same_shape), key(shift=4), key(ids_shift=4), key(rows=1)]
    differ = [
        key(T=1, K=1),  # numel == 1 (the next one differs from it only there)
        key(T=2, K=1),
        key(T=65),  # numel not a multiple of 16, the same block as the base
        key(T=20000),  # another block size
        key(rows=16),  # count rows are a constexpr (and pick the launch shape)
        key(K=4, T=128),  # K is a constexpr
        key(mode="weighted"),
        key(counts=False),
        key(map_padded=True),  # padded rows mapped: a constexpr
        key(tables=other_shape),
        key(shift=1),  # out 4 bytes off 16-byte alignment
        key(ids_shift=2),
    ]
    assert all(k == base for k in same), same
    assert len({base, *differ}) == len(differ) + 1


@pytest.mark.interpreter
def test_falls_back_to_the_jit_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launch hooks (profilers), a launcher that refuses its arguments, ids off the current device."""
    from triton import knobs

    rng = np.random.default_rng(23)
    _, tables = random_tables(rng, 9, 12, 3, rank=1)
    ids = random_ids(rng, 50, 4, 9, "nasty")
    want = remap_and_record(ids, tables, 1, mode="dynamic", backend="torch")

    def run(h: _Harness) -> None:
        got = _call(ids, tables, 1, "dynamic", None, None, None, None, jit=False, harness=h)
        assert torch.equal(got, want)

    harness = _Harness(monkeypatch)
    run(harness)  # a miss, kept
    hook = knobs.runtime.launch_enter_hook
    hook.add(print)
    try:
        run(harness)
    finally:
        hook.remove(print)
    assert harness.direct_launches == 0 and harness.jit_launches == 2
    run(harness)
    assert harness.direct_launches == 1
    harness.refuse = True
    run(harness)  # refused, then launched through kernel[grid]; direct launches stay off
    run(harness)
    assert harness.direct_launches == 2 and harness.jit_launches == 4 and not harness.direct.cache.usable()

    elsewhere = _Harness(monkeypatch, device_index=0)
    for _ in range(2):
        run(elsewhere)
    assert elsewhere.direct_launches == 0 and elsewhere.jit_launches == 2 and len(elsewhere.direct.cache) == 0


@pytest.mark.parametrize("rows", [1, 7, 8, 16])
def test_launch_shape_is_the_default_config(rows: int) -> None:
    cpu = torch.device("cpu")
    spread = rows >= 8
    for numel in [1, 2, 15, 16, 127, 128, 129, 511, 512, 513, 2048, 4097, 65536, 524288, 10**7 + 3]:
        cfg = kernel.default_config(numel, cpu, rows)
        assert kernel.launch_shape(numel, 4, rows) == (
            cfg.block,
            cfg.num_warps,
            kernel.grid_size(numel, cfg, cpu),
        )
        assert cfg.programs_per_sm == (2 if spread else 1)
        for units in (4, 132, 304):
            # The rule restated through Triton's helpers; every thread of a block gets an id.
            per_block = kernel.triton.cdiv(numel, units if spread else 32)
            block = min(2048 if spread else 4096, max(512, kernel.triton.next_power_of_2(per_block)))
            block = min(block, max(128, kernel.triton.next_power_of_2(numel)))
            warps = 8 if block >= 256 else 4
            assert kernel.default_block(numel, units, rows) == (block, warps) and block >= 32 * warps


@pytest.mark.gpu
@pytest.mark.parametrize("mode", LOCAL_MODES)
def test_compiled_direct_launches_equal_the_jit_path(mode: str) -> None:
    """Real compiled kernels: direct == kernel[grid], and Triton's own cache picks the kernel we kept."""
    rng = np.random.default_rng(24)
    _, tables = random_tables(rng, 256, 288, 8, rank=5, device="cuda")
    counts_LP = torch.zeros((3, 291), dtype=torch.int32, device="cuda")[:, :288]  # rows 1164 bytes apart
    for T, K, shift in [(1, 1, 0), (3, 3, 1), (64, 8, 0), (4097, 8, 1), (65536, 8, 0)]:
        ids = random_ids(rng, T + 1, K, 256, "nasty").cuda()[shift : shift + T]
        nvalid = torch.tensor([T - 1], dtype=torch.int32, device="cuda")
        counts = counts_LP[1] if shift else counts_LP[0].contiguous()
        for map_padded in (True, False):  # the second one's call stays for the checks below
            outs = []
            for jit in (False, False, True):
                counts.zero_()
                out = _call(ids, tables, 1, mode, counts, None, nvalid, None, jit=jit, map_padded=map_padded)
                outs.append((out, counts.clone()))
            for got in outs[:2]:
                assert torch.equal(got[0], outs[2][0]) and torch.equal(got[1], outs[2][1])
        call = RemapCall(
            topk_ids_TK=ids,
            tables=tables,
            layer=1,
            mode=mode,
            out_TK=outs[0][0],
            counts_P=counts,
            num_valid_tokens=nvalid,
        )
        launched, key = kernel.DIRECT.launch(call)
        assert launched
        entry = kernel.DIRECT.cache.get(key)
        block, num_warps, grid = kernel.default_launch(ids.numel(), ids.get_device())
        runtime, constexprs = kernel.kernel_args(call, block)
        compiled = kernel._remap_record_kernel[(grid,)](*runtime, *constexprs, num_warps=num_warps)
        assert entry is not None and entry.function == compiled.function
