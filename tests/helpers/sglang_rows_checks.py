"""SGLang 0.5.23's recorder reading eplb's count rows: what the engines' subprocess records.

Shape legend: L layers, E logical experts, P physical slots, T tokens, K top-k.

:func:`run` (in the subprocess, ``TRITON_INTERPRET=1``, ``EPLB_SGLANG_FUSED_REMAP=1``,
``EPLB_SGLANG_REMAP_BACKEND=triton``) loads the plugin through SGLang's own ``load_plugins``,
builds SGLang's real ``_ExpertDistributionRecorderReal`` (stat mode: its select-experts gatherer
and its circular window), and drives passes as SGLang's ``select_experts`` does on its MegaMoE
path: ``get_current_pass_count_buffer(layer)``, then ``eplb_map_and_record_fused`` with it. Each
call is repeated into a plain [P] buffer no recorder owns: the single-row path, as the adapter
ran before count rows. :func:`pass_inputs` (numpy only) makes every pass's ids, so the test
process rebuilds them for its own reference.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import numpy as np

L, E, P, K = 3, 32, 40, 8
G = 8
PASSES = 6
STALE_PASS = 4
"""Recording stops inside this pass (SGLang's ``stop_record``), so it is never collected; it
restarts before the next one."""


@dataclass(frozen=True)
class LayerCall:
    """One layer's call in one pass."""

    ids_TK: np.ndarray
    """int32 [T, K] router ids (logical; physical for ``identity``)."""
    kind: str
    """``static`` (the fused call with a static dispatch info), ``identity`` (no dispatch info),
    ``unfused`` (SGLang's own map and ``on_select_experts``: the path where the fused call declines)."""
    nvalid: int | None
    """``num_token_non_padded`` (None: no padding)."""
    nvalid_form: str = "int32[1]"
    """How SGLang hands the valid count over: ``int32[1]`` or ``int64[]``."""


def dispatch_maps() -> np.ndarray:
    """int64 [L, E]: each layer's static dispatch slot per expert (this rank's)."""
    return np.random.default_rng(99).integers(0, P, size=(L, E)).astype(np.int64)


def pass_inputs(n: int) -> list[LayerCall]:
    """Pass ``n``'s calls, one per layer: seeded random and nasty ids (padding ids, ids out of
    range, one hot expert, T = 1, T = 0, padded rows, SGLang's own unfused path in the same pass)."""
    rng = np.random.default_rng(1000 + n)

    def ids(T: int, low: int = 0, high: int = E) -> np.ndarray:
        return rng.integers(low, high, size=(T, K)).astype(np.int32)

    if n == 0:
        return [LayerCall(ids(2048), "static", None) for _ in range(L)]
    if n == 1:
        return [LayerCall(ids(2000, -5, E + 3), "static", 2000 - 37 * (layer + 1)) for layer in range(L)]
    if n == 2:
        return [
            LayerCall(np.full((1536, K), 7, dtype=np.int32), "static", None),  # every count into one slot
            LayerCall(ids(1, -1, E), "static", 1),
            LayerCall(ids(900, -1, P + 2), "identity", 850),
        ]
    if n == 3:
        return [
            LayerCall(ids(1800, -1, E), "static", None),
            LayerCall(ids(700), "unfused", None),
            LayerCall(ids(0), "static", None),
        ]
    return [LayerCall(ids(1024 + 512 * layer, -1, E + 1), "static", 1000, "int64[]") for layer in range(L)]


def reference_counts(n: int) -> np.ndarray:
    """int64 [L, P]: pass ``n``'s slot counts by plain numpy (valid ids of rows below nvalid)."""
    maps_LE = dispatch_maps()
    out = np.zeros((L, P), dtype=np.int64)
    for layer, call in enumerate(pass_inputs(n)):
        ids = call.ids_TK.astype(np.int64)
        rows = np.arange(ids.shape[0])[:, None] < (ids.shape[0] if call.nvalid is None else call.nvalid)
        high = P if call.kind == "identity" else E
        valid = (ids >= 0) & (ids < high) & (rows if call.kind != "unfused" else True)
        phys = ids if call.kind == "identity" else maps_LE[layer][np.clip(ids, 0, E - 1)]
        np.add.at(out[layer], phys[valid], 1)
    return out


def run() -> dict[str, Any]:
    """Drive SGLang's recorder through the plugin; return what SGLang read and what was counted."""
    import torch

    from tests.helpers.sglang_stubs import configure_dispatch, configure_recorder, moe_settings

    moe = moe_settings(moe_a2a_backend="none", expert_distribution_recorder_buffer_size=PASSES)
    ed = configure_recorder(moe)
    configure_dispatch(moe)
    import sglang.srt.eplb.eplb_map_record_fused as fused_module
    import sglang.srt.plugins as plugins
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata, set_global_expert_location_metadata
    from sglang.srt.eplb.expert_location_dispatch import (
        ExpertLocationDispatchInfo,
        topk_ids_logical_to_physical,
    )

    from eplb.integrations import sglang_remap

    original_fused = fused_module.eplb_map_and_record_fused
    plugins.load_plugins()
    fused = fused_module.eplb_map_and_record_fused
    gatherer_cls = ed._SelectExpertsSinglePassGatherer
    out: dict[str, Any] = {
        "fused_replaced": fused is not original_fused,
        "reset_wrapped": hasattr(gatherer_cls.reset, "__wrapped__"),
        "collect_wrapped": hasattr(gatherer_cls.collect, "__wrapped__"),
    }
    phy2log = torch.arange(P, dtype=torch.int64).remainder(E).expand(L, P).contiguous()
    log2phy = torch.full((L, E, P), -1, dtype=torch.int64)
    metadata = ExpertLocationMetadata(
        physical_to_logical_map=phy2log, physical_to_logical_map_cpu=phy2log, logical_to_all_physical_map=log2phy,
        logical_to_all_physical_map_cpu=log2phy, logical_to_all_physical_map_num_valid=torch.ones(L, E, dtype=torch.int64),
        ep_size=G, logical_to_rank_dispatch_physical_map=torch.from_numpy(dispatch_maps()),
    )  # fmt: skip
    set_global_expert_location_metadata(metadata)
    recorder = ed._ExpertDistributionRecorderReal(metadata, rank=0)
    gatherer = recorder._single_pass_gatherers["primary"]
    out["gatherer"] = type(gatherer).__name__
    recorder.start_record()
    window = recorder._accumulator._global_physical_count_of_buffered_step  # SGLang's circular window
    single_row, spread, direct, read = [], [], [], {}
    for n in range(PASSES):
        slot = window._curr_index
        plain_LP = torch.zeros(L, P, dtype=torch.int32)  # the single-row path's: no recorder owns it
        single = types.SimpleNamespace(_data=plain_LP, _expert_location_metadata=metadata)
        rows_used = 0
        with recorder.with_forward_pass(n, types.SimpleNamespace(forward_mode=None)):
            for layer, call in enumerate(pass_inputs(n)):
                ids = torch.from_numpy(call.ids_TK)
                if call.kind == "unfused":  # SGLang's own path: its map, then its recorder hook
                    info = ExpertLocationDispatchInfo.init_new(layer)
                    phys = topk_ids_logical_to_physical(ids, info)
                    with recorder.with_current_layer(layer):
                        recorder.on_select_experts(topk_ids=phys)
                    gatherer_cls.on_select_experts(single, layer, phys)  # SGLang's count, single row
                    continue
                info = ExpertLocationDispatchInfo.init_new(layer) if call.kind == "static" else None
                nvalid = _nvalid(call)
                load_buffer = recorder.get_current_pass_count_buffer(layer)
                got = fused(ids, info, load_buffer, nvalid)
                want = fused(ids, info, plain_LP[layer], nvalid)
                assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
                rows = sglang_remap._ROW_OF.get(load_buffer.data_ptr())
                if rows is not None:
                    rows_used = max(rows_used, int((rows.sum(dim=1) > 0).sum()))
            direct.append(int(gatherer._data.sum()))  # counted into SGLang's buffer before its read
            if n == STALE_PASS:
                recorder.stop_record()
        if window._curr_index != slot:  # the accumulator appended this pass: what SGLang read
            read[n] = window.get_all()[slot].tolist()
        if n == STALE_PASS:
            recorder.start_record()
        single_row.append(plain_LP.tolist())
        spread.append(rows_used)
    out["sglang_read"] = read
    out["single_row"] = single_row
    out["rows_used"] = spread
    out["direct_before_read"] = direct
    out["count_rows"] = sglang_remap.COUNT_ROWS
    return out


def _nvalid(call: LayerCall) -> Any:
    import torch

    if call.nvalid is None:
        return None
    if call.nvalid_form == "int64[]":
        return torch.tensor(call.nvalid, dtype=torch.int64)
    return torch.tensor([call.nvalid], dtype=torch.int32)


__all__ = ["PASSES", "STALE_PASS", "LayerCall", "pass_inputs", "reference_counts", "run"]
