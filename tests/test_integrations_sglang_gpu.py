"""SGLang's fused map+record kernel against eplb's replacement, both compiled on CUDA.

The CPU suite checks the adapter inside a real SGLang install (torch backend against SGLang's
kernel under the interpreter); here the same contract is checked with both Triton kernels compiled
on the GPU. SGLang's kernel file comes from benchmarks.peers (its one SGLang import stubbed), so no
SGLang install is needed: the device machine has no network, only the carried ``.peers`` folder.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


class _DispatchInfo:
    """The two fields of SGLang's ExpertLocationDispatchInfo that the fused path reads."""

    def __init__(self, map_E: torch.Tensor) -> None:
        self.ep_dispatch_algorithm = "static"
        self.partial_logical_to_rank_dispatch_physical_map = map_E


@pytest.fixture(scope="module")
def sglang_fused() -> Any:
    from benchmarks.peers import load_sglang_fused_kernel

    return load_sglang_fused_kernel().eplb_map_and_record_fused


@pytest.mark.parametrize("rows", [1, 37, 300, 4096, 65536])
@pytest.mark.parametrize("padded", [False, True])
def test_eplb_kernel_returns_what_sglangs_returns_on_cuda(sglang_fused: Any, rows: int, padded: bool) -> None:
    from eplb.integrations import sglang_remap

    E, P, K = 256, 288, 8
    rng = np.random.default_rng(rows + padded)
    ids = torch.from_numpy(rng.integers(0, E, size=(rows, K)).astype(np.int32)).cuda()
    ids[rng.random((rows, K)) < 0.05] = -1  # padding ids inside rows
    map_E = torch.from_numpy(rng.integers(0, P, size=E).astype(np.int32)).cuda()
    info = _DispatchInfo(map_E)
    valid = torch.tensor([max(rows // 2, 1)], dtype=torch.int32, device="cuda") if padded else None
    load_ours = torch.zeros(P, dtype=torch.int32, device="cuda")
    load_sglang = torch.zeros(P, dtype=torch.int32, device="cuda")
    sglang_remap.placement_changed()
    ours = sglang_remap.eplb_map_and_record_fused(ids, info, load_ours, valid)
    theirs = sglang_fused(ids, info, load_sglang, valid)
    assert ours is not None and theirs is not None
    assert ours.dtype == torch.int32
    assert torch.equal(ours.long(), theirs.long())
    assert torch.equal(load_ours, load_sglang)
