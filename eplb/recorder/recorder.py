"""The expert distribution recorder: per-pass expert load, recorded on the device, for the manager.

Shape legend: W window (passes), F steps (the passes kept), L layers, E logical experts, P physical
slots, C count rows, G GPUs, T tokens, K top-k.

The remap kernel counts each pass's slot loads into fixed device buffers, so a captured CUDA graph
records by a flag alone; the recorder keeps a bounded window of those counts (eplb.recorder.buffers)
and turns them into expert counts through the placement live at each pass, for the manager to
rebalance from and for dumps (eplb.recorder.dump). :class:`ExpertDistributionRecorder` documents
the per-pass protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from eplb.config import RECORDER_MODES, EplbConfig
from eplb.placement.model import Placement
from eplb.recorder.buffers import PassInfo, PerPassStaging, StatWindow, TokenBuffer
from eplb.recorder.collectives import all_reduce_sum, any_rank, rank_and_world, reduce_pass_facts
from eplb.recorder.dump import WindowDump, check_dump_format, save_per_token, save_window
from eplb.remap.prepared import PreparedRemap, prepare_remap

if TYPE_CHECKING:
    from eplb.remap.exchange import LpExchange
    from eplb.remap.tables import DispatchTables

CUDA_COUNT_ROWS = 16
"""Count rows per layer on CUDA: the remap kernel runs up to two programs per SM, and with 16 rows
at most about 17 of its flushes add into one address (docs/benchmarks.md, "Remap +
record")."""


@dataclass(frozen=True, kw_only=True)
class RecorderConfig:
    """What and how much the recorder keeps."""

    mode: str = "stat"
    """stat | per_pass | per_token."""
    window: int = 1000
    """W: passes kept (stat window; per_pass records)."""
    prefill_only: bool = False
    """Record only prefill passes; count only passes where some rank had prefill."""
    token_budget: int = 65536
    """per_token: most tokens kept (later tokens are dropped and counted)."""
    top_k: int = 8
    """K, ids per token (per_token)."""

    def __post_init__(self) -> None:
        if self.mode not in RECORDER_MODES:
            raise ValueError(f"unknown recorder mode {self.mode!r}; choose from {RECORDER_MODES}")
        if self.window < 1 or self.token_budget < 1 or self.top_k < 1:
            raise ValueError("window, token_budget and top_k must be >= 1")

    @classmethod
    def from_eplb_config(
        cls, config: EplbConfig, *, top_k: int = 8, token_budget: int = 65536
    ) -> RecorderConfig:
        """The recorder SGLang's flags ask for (stat with the rebalance interval when EPLB is on)."""
        return cls(
            mode=config.recorder_mode or "stat",
            window=config.recorder_buffer_size,
            prefill_only=config.eplb_record_prefill_only,
            token_budget=token_budget,
            top_k=top_k,
        )


class ExpertDistributionRecorder:
    """Records expert load per forward pass.

    One per rank. Per forward pass::

        remaps = rec.prepare(tables, mode="static")               # once: one prepared call per layer
        rec.begin_pass(has_prefill=..., num_tokens=T)            # sets the device record flag
        for layer in layers:                                      # inside the (captured) forward
            phys = remaps[layer](ids, out)                        # remap + record in one launch
            rec.record_topk(layer, ids)                           # per_token mode only
        counted = rec.end_pass()                                  # commits the pass, advances the step

    ``prepare`` hands each layer's kernel a fixed int32 [C, P] block of count rows of
    ``pass_counts_LCP`` (C = :data:`CUDA_COUNT_ROWS` on CUDA, 1 elsewhere; eplb.remap.api) and the
    int32 ``record_flag_1``; both keep their address for the recorder's life, so a captured CUDA
    graph records or not by the flag alone. The prepared calls are built once (checked
    arguments), so a pass costs the kernel launches plus two device ops at its end (the window
    push and the reset of the pass counts) and the flag's fill when it changes. It is the one
    recording path: passing the recorder's rows to the public ``remap_and_record`` as keywords
    cost 2-4x more host time per pass (Python's keyword passing; docs/benchmarks.md, "Recorder
    host cost per documented path"), so that path was removed. After a hot-swap call
    :meth:`set_placement` before the next pass: every stored pass remembers which placement was
    live, and its slot counts become expert counts through that placement's map.

    Modes: ``stat`` (circular window of W passes on the device, int32 [W, L, P]), ``per_pass``
    (each pass copied to pinned host memory without a stream stall; the last W kept), ``per_token``
    (logical top-k ids per token, up to a token budget). With ``prefill_only`` a rank records only
    passes that carry prefill locally, and the step counter advances only on passes where SOME rank
    had prefill: ``end_pass`` all-reduces the flag, so every rank must call it on every pass (an
    idle rank with T = 0 too) and all ranks count, rebalance and fill window rows in lockstep.
    An engine that already knows whether any rank has prefill (its scheduler agreed on the batch)
    passes ``any_rank_prefill`` to ``begin_pass``: then no collective runs and nothing waits.
    Counts are int32 per pass and int64 once summed, so nothing overflows on long runs.
    :meth:`dump` sums the window over ranks and hands it to eplb.recorder.dump as plain arrays.
    """

    def __init__(
        self,
        config: RecorderConfig,
        placement: Placement,
        *,
        device: torch.device | str = "cpu",
        group: Any = None,
        flag_group: Any = None,
    ) -> None:
        """``group``: process group for dump/window sums (None: the default group when
        torch.distributed is initialised). ``flag_group``: group for the per-pass prefill flag
        (e.g. a Gloo group, so NCCL ranks avoid a device sync per pass); defaults to ``group``."""
        self.config = config
        self.device = torch.device(device)
        self.group = group
        self.flag_group = flag_group if flag_group is not None else group
        L, P = placement.num_layers, placement.num_physical
        C = CUDA_COUNT_ROWS if self.device.type == "cuda" else 1
        self.pass_counts_LCP = torch.zeros((L, C, P), dtype=torch.int32, device=self.device)
        """int32 [L, C, P]: this pass's slot counts as count rows (their sum over C is the count);
        ``pass_counts_LCP[layer]`` is the kernel's ``counts_P``."""
        self.pass_counts_LP = self.pass_counts_LCP[:, 0]
        """int32 [L, P] view: the first count row of each layer (adding to it adds to the pass)."""
        self.record_flag_1 = torch.zeros(1, dtype=torch.int32, device=self.device)
        """int32 [1]: 1 while this pass is recorded (the kernel's ``record`` flag)."""
        self._rows_LCP = list(self.pass_counts_LCP.unbind(0))  # the per-layer [C, P] views, made once
        self._flag_value = 0
        self.any_rank_prefill: bool | None = None
        self._placement = placement
        self._maps: dict[int, np.ndarray] = {0: placement.phy2log_LP.copy()}
        self._map_version = 0
        self._recording = False
        self._num_counted = 0
        self._pass_open = False
        self._local_prefill = False
        self._local_flag = False
        self._num_tokens = 0
        self._stat = StatWindow(config.window, L, P, self.device) if config.mode == "stat" else None
        self._per_pass = (
            PerPassStaging(config.window, L, P, self.device) if config.mode == "per_pass" else None
        )
        self._tokens = (
            TokenBuffer(config.token_budget, L, config.top_k, self.device)
            if config.mode == "per_token"
            else None
        )

    # ---- shape and state -----------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        """The placement live now (the one :meth:`set_placement` last gave)."""
        return self._placement

    @property
    def is_recording(self) -> bool:
        return self._recording

    @property
    def num_counted_passes(self) -> int:
        """The step counter: passes counted since creation (prefill_only: passes with prefill on some rank)."""
        return self._num_counted

    @property
    def num_window_passes(self) -> int:
        """Passes held in the window (stat) or in the kept records (per_pass)."""
        if self._stat is not None:
            return self._stat.filled
        if self._per_pass is not None:
            self._per_pass.collect(wait=True)
            return len(self._per_pass.records)
        return 0

    @property
    def window_full(self) -> bool:
        return self.num_window_passes >= self.config.window

    # ---- control -------------------------------------------------------------------------------
    def start(self) -> None:
        """Record from the next pass on (call on every rank at the same pass)."""
        self._recording = True

    def stop(self) -> None:
        """Stop recording; the step counter keeps advancing."""
        self._recording = False
        self.record_flag_1.zero_()
        self._flag_value = 0

    def reset(self) -> None:
        """Drop everything recorded (not the step counter, not the recording state)."""
        for store in (self._stat, self._per_pass, self._tokens):
            if store is not None:
                store.clear()
        self._maps = {self._map_version: self._placement.phy2log_LP.copy()}

    def set_placement(self, placement: Placement) -> None:
        """The placement changed (hot-swap): passes from now on convert through its map."""
        if (placement.num_layers, placement.num_physical, placement.num_logical) != (
            self._placement.num_layers,
            self._placement.num_physical,
            self._placement.num_logical,
        ):
            raise ValueError("a new placement must keep L, E and P")
        self._placement = placement
        self._map_version += 1
        # Keep only the maps a stored pass still converts through (a paced continuous run calls
        # this every few passes: without pruning the maps would grow for the server's life).
        live = self._stored_versions()
        self._maps = {v: m for v, m in self._maps.items() if v in live}
        self._maps[self._map_version] = placement.phy2log_LP.copy()

    def _stored_versions(self) -> set[int]:
        """Map versions of the passes the stat window and the per_pass records still hold."""
        infos: list[PassInfo | None] = []
        if self._stat is not None:
            infos += self._stat.info
        if self._per_pass is not None:
            infos += [info for info, _ in self._per_pass.records]
            infos += [info for _, info, _ in self._per_pass.in_flight]
        return {info.map_version for info in infos if info is not None}

    # ---- per pass ------------------------------------------------------------------------------
    def begin_pass(
        self, *, has_prefill: bool, num_tokens: int = 0, any_rank_prefill: bool | None = None
    ) -> None:
        """Start a pass: set the device record flag (an enqueued fill, only when it changes; no host sync).

        ``any_rank_prefill``: whether some rank's pass carries prefill, when the engine knows it on
        every rank; ``end_pass`` then agrees without a collective (prefill_only; None: all-reduce).
        """
        if self._pass_open:
            raise RuntimeError("begin_pass called twice without end_pass")
        for name, given in (("has_prefill", has_prefill), ("any_rank_prefill", any_rank_prefill)):
            # 'no', 0.5 or a tensor would pass bool() as True: a flag is a bool, nothing else.
            if not isinstance(given, (bool, np.bool_)) and not (name == "any_rank_prefill" and given is None):
                raise TypeError(f"{name} must be a bool, got {type(given).__name__} {given!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise ValueError(f"num_tokens must be a whole number of tokens, got {num_tokens!r}")
        if not 0 <= int(num_tokens) < 2**31:
            # a slot's count of one pass is at most the pass's tokens, held in int32 on the device
            raise ValueError(f"num_tokens must lie in [0, 2**31), got {num_tokens}: int32 counts would wrap")
        self._pass_open = True
        self._local_prefill = bool(has_prefill)
        self._num_tokens = int(num_tokens)
        if any_rank_prefill is not None and has_prefill and not any_rank_prefill:
            raise ValueError("any_rank_prefill=False on a rank whose pass carries prefill")
        self.any_rank_prefill = any_rank_prefill
        self._local_flag = self._recording and (self._local_prefill or not self.config.prefill_only)
        flag = 1 if self._local_flag else 0
        if flag != self._flag_value:
            self.record_flag_1.fill_(flag)
            self._flag_value = flag

    def prepare(
        self,
        tables: DispatchTables,
        *,
        mode: str = "static",
        backend: str = "auto",
        num_valid_tokens: torch.Tensor | None = None,
        lp: LpExchange | None = None,
    ) -> list[PreparedRemap]:
        """One prepared remap per layer that records into this recorder (eplb.remap.prepared).

        ``num_valid_tokens``: the engine's device scalar, fixed like the rest; ``lp``: the rank's
        counts exchange in mode ``lp``.
        """
        return [
            prepare_remap(
                tables,
                layer,
                mode=mode,
                counts_P=row,
                num_valid_tokens=num_valid_tokens,
                record=self.record_flag_1,
                backend=backend,
                lp=lp,
            )
            for layer, row in enumerate(self._rows_LCP)
        ]

    def record_topk(self, layer: int, topk_ids_TK: torch.Tensor) -> None:
        """per_token mode: keep this layer's logical ids (int32 [T, K]) of this pass."""
        if self._tokens is not None and self._local_flag:
            self._tokens.write(layer, topk_ids_TK)

    def end_pass(self) -> bool:
        """Finish the pass on every rank; returns whether it was counted (the step advanced)."""
        if not self._pass_open:
            raise RuntimeError("end_pass called without begin_pass")
        self._pass_open = False
        counted = True
        if self.config.prefill_only:
            known = self.any_rank_prefill
            counted = any_rank(self._local_prefill, self.flag_group, self.device) if known is None else known
        reset = self._local_flag  # this pass's kernels counted into the rows: zero them for the next
        if counted:
            info = PassInfo(self._num_counted, self._map_version, self._local_prefill, self._num_tokens)
            self._num_counted += 1
            if self._recording:
                if self._stat is not None:
                    self._stat.push(self.pass_counts_LCP, info, zero=reset)  # one launch on CUDA
                    reset = False
                if self._per_pass is not None:
                    self._per_pass.push(self.pass_counts_LCP, info)
        if self._tokens is not None:
            self._tokens.commit(self._num_counted - 1, keep=counted and self._local_flag)
        if reset:
            self.pass_counts_LCP.zero_()
        return counted

    # ---- what the manager reads ----------------------------------------------------------------
    def window_passes(self, *, reduce: bool = False) -> tuple[list[PassInfo], np.ndarray]:
        """Kept passes oldest first, and their slot counts int64 [F, L, P] (summed over ranks if ``reduce``)."""
        if self._stat is not None:
            rows = self._stat.chronological_rows()
            infos = [info for r in rows if (info := self._stat.info[r]) is not None]
            phys = self._stat.counts_WLP[rows].to(torch.int64)
        elif self._per_pass is not None:
            self._per_pass.collect(wait=True)
            infos = [info for info, _ in self._per_pass.records]
            arrays = [a for _, a in self._per_pass.records]
            L, P = self.pass_counts_LP.shape
            stacked = np.stack(arrays) if arrays else np.zeros((0, L, P), dtype=np.int32)
            phys = torch.from_numpy(stacked.astype(np.int64)).to(self.device)
        else:
            raise ValueError("per_token mode keeps token ids, not a window of counts")
        if reduce:
            phys = all_reduce_sum(phys, self.group)
        return infos, phys.cpu().numpy()

    def window_logical_counts(self, *, reduce: bool = False) -> np.ndarray:
        """int64 [F, L, E]: kept passes' expert counts, oldest first (each through its own map)."""
        infos, phys_FLP = self.window_passes(reduce=reduce)
        return self.to_logical(phys_FLP, [info.map_version for info in infos])

    def window_logical_total(self, *, reduce: bool = False) -> np.ndarray:
        """int64 [L, E]: expert counts summed over the kept passes (device-side sum, small copy)."""
        L, E = self._placement.num_layers, self._placement.num_logical
        if self._stat is None:
            return self.window_logical_counts(reduce=reduce).sum(axis=0, dtype=np.int64).reshape(L, E)
        total_LE = torch.zeros((L, E), dtype=torch.int64, device=self.device)
        rows = self._stat.chronological_rows()
        for version in sorted({info.map_version for r in rows if (info := self._stat.info[r]) is not None}):
            picked = [
                r for r in rows if (info := self._stat.info[r]) is not None and info.map_version == version
            ]
            phys_LP = self._stat.counts_WLP[picked].to(torch.int64).sum(dim=0)
            map_LP = torch.from_numpy(self._maps[version].astype(np.int64)).to(self.device)
            total_LE.scatter_add_(1, map_LP, phys_LP)
        if reduce:
            total_LE = all_reduce_sum(total_LE, self.group)
        return total_LE.cpu().numpy()

    def recorded_tokens(self) -> tuple[np.ndarray, np.ndarray, int]:
        """per_token mode: (ids int32 [T, L, K], forward pass id int64 [T], tokens dropped past the budget)."""
        if self._tokens is None:
            raise ValueError("recorded_tokens needs per_token mode")
        t = self._tokens
        return t.ids_TLK[: t.used].cpu().numpy(), np.asarray(t.pass_of_token, dtype=np.int64), t.dropped

    def to_logical(self, phys_FLP: np.ndarray, versions: list[int]) -> np.ndarray:
        """int64 [F, L, E]: slot counts -> expert counts, row f through placement ``versions[f]``."""
        F, L, P = phys_FLP.shape
        E = self._placement.num_logical
        out = np.zeros((F, L, E), dtype=np.int64)
        layer_LP = np.broadcast_to(np.arange(L)[:, None], (L, P))
        for version in sorted(set(versions)):
            rows = [f for f in range(F) if versions[f] == version]
            flat = (layer_LP * E + self._maps[version]).ravel()
            order = np.argsort(flat, kind="stable")
            starts = np.searchsorted(flat[order], np.arange(L * E))
            sums = np.add.reduceat(phys_FLP[rows].reshape(len(rows), L * P)[:, order], starts, axis=1)
            out[rows] = sums.reshape(len(rows), L, E)
        return out

    def dump(self, path: str | Path, *, fmt: str = "eplb", reduce: bool = True) -> Path | None:
        """Write what was recorded (formats: eplb.recorder.dump); collective when ``reduce`` and distributed.

        With ``reduce`` under torch.distributed, counts and token numbers are summed over the ranks
        (every rank must call), a pass counts as prefill if it was on any rank, and rank 0 writes the
        file (other ranks return None). per_token dumps are per rank: with several ranks, the rank is
        added to the file name.
        """
        path = Path(path)
        check_dump_format(fmt, self.config.mode)
        rank, world = rank_and_world(self.group)
        if self.config.mode == "per_token":
            ids_TLK, pass_T, dropped = self.recorded_tokens()
            return save_per_token(
                path if world == 1 else path.with_suffix(f".rank{rank}.npz"), ids_TLK, pass_T, dropped
            )
        reduce = reduce and world > 1
        infos, phys_FLP = self.window_passes(reduce=reduce)
        logical_FLE = self.to_logical(phys_FLP, [info.map_version for info in infos])
        prefill_F = np.array([info.had_prefill for info in infos], dtype=np.int64)
        tokens_F = np.array([info.num_tokens for info in infos], dtype=np.int64)
        if reduce:
            prefill_F, tokens_F = reduce_pass_facts(prefill_F, tokens_F, self.group, self.device)
            if rank != 0:
                return None
        window = WindowDump(
            mode=self.config.mode,
            pass_ids=[info.pass_id for info in infos],
            phys_FLP=phys_FLP,
            logical_FLE=logical_FLE,
            prefill_F=prefill_F,
            tokens_F=tokens_F,
            phy2log_LP=self._placement.phy2log_LP,
            num_gpus=self._placement.num_gpus,
            rank=rank,
            ranks_summed=world if reduce else 1,
            prefill_only=self.config.prefill_only,
            top_k=self.config.top_k,
        )
        return save_window(window, path, fmt=fmt)


__all__ = ["CUDA_COUNT_ROWS", "ExpertDistributionRecorder", "PassInfo", "RecorderConfig"]
