"""The int32 placement model: which logical expert each physical slot holds.

Shape legend (used in every tensor name of this file):
    L = MoE layers, E = logical experts, P = physical slots (E + redundant),
    G = EP ranks (GPUs), S = P // G slots per GPU, R = max replicas of one expert,
    N = nodes.

GPU ``g`` owns physical slots ``[g*S, (g+1)*S)``; node ``n`` owns GPUs ``[n*G/N, (n+1)*G/N)``.
Every map is int32 by construction. Conversions to torch tensors name the dtype explicitly,
so no int64 ever leaks onto the device (indexing an int64 map with int32 ids yields int64).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from eplb.fileio import OutputSet, json_error_text, read_input, write_text

if TYPE_CHECKING:
    import torch

INT32 = np.int32
MAX_PLACEMENT_FILE_BYTES = 256 << 20
"""Most bytes a placement file (SGLang JSON or eplb safetensors) may hold: a DeepSeek-V3 map is
about 100 KB, so this only stops a runaway input before it is read."""


def _as_int32(name: str, array: Any) -> np.ndarray:
    """Copy an integer array-like (numpy, torch, list) to int32 numpy, refusing lossy input."""
    if hasattr(array, "detach"):  # torch tensor, without importing torch here
        array = array.detach().cpu().numpy()
    arr = np.asarray(array)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(INT32).min or arr.max() > np.iinfo(INT32).max):
        raise ValueError(f"{name} has values outside the int32 range")
    return np.ascontiguousarray(arr, dtype=INT32)


@dataclass(frozen=True, eq=False)
class Placement:
    """Physical placement of logical experts, for every MoE layer.

    Build one with :meth:`trivial`, :meth:`from_phy2log` or :meth:`from_deepseek`; each checks
    what it is given (:meth:`validate`; the phy2log-built ones derive log2phy and the counts and
    check phy2log and the geometry), so a Placement in hand is always consistent.
    """

    phy2log_LP: np.ndarray
    """int32 [L, P]: logical expert held by each physical slot."""
    log2phy_LER: np.ndarray
    """int32 [L, E, R]: physical slots of each logical expert, padded with -1."""
    logcnt_LE: np.ndarray
    """int32 [L, E]: number of replicas of each logical expert (>= 1)."""
    num_gpus: int
    """G, EP ranks. P must be divisible by G."""
    num_nodes: int = 1
    """N, nodes. G must be divisible by N."""

    # ---- shape accessors -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.phy2log_LP.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.phy2log_LP.shape[1])

    @property
    def num_logical(self) -> int:
        return int(self.logcnt_LE.shape[1])

    @property
    def max_replicas(self) -> int:
        return int(self.log2phy_LER.shape[2])

    @property
    def slots_per_gpu(self) -> int:
        return self.num_physical // self.num_gpus

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    def gpu_of_slot(self) -> np.ndarray:
        """int32 [P]: the GPU that owns each physical slot."""
        return (np.arange(self.num_physical, dtype=INT32) // self.slots_per_gpu).astype(INT32)

    # ---- validation ------------------------------------------------------------------------
    def validate(self) -> Placement:
        """Check every invariant; raise ``ValueError`` saying what is wrong. Returns ``self``."""
        p2l, l2p, cnt = self.phy2log_LP, self.log2phy_LER, self.logcnt_LE
        for name, arr, ndim in (("phy2log", p2l, 2), ("log2phy", l2p, 3), ("logcnt", cnt, 2)):
            if not isinstance(arr, np.ndarray):
                raise ValueError(f"{name} must be a numpy array, got {type(arr).__name__}")
            if arr.dtype != INT32:
                raise ValueError(f"{name} must be int32, got {arr.dtype}")
            if arr.ndim != ndim:
                raise ValueError(f"{name} must have {ndim} dimensions, got shape {arr.shape}")
        L, P = p2l.shape
        if l2p.shape[:2] != cnt.shape or cnt.shape[0] != L:
            raise ValueError(
                f"shapes disagree: phy2log {p2l.shape} is [L, P], log2phy {l2p.shape} must be [L, E, R] "
                f"and logcnt {cnt.shape} must be [L, E] with the same L and E"
            )
        E, R = l2p.shape[1], l2p.shape[2]
        counted_LE = self._check_slots()
        if not np.array_equal(counted_LE, cnt):
            layer, expert = np.argwhere(counted_LE != cnt)[0]
            raise ValueError(
                f"logcnt[{layer}, {expert}] = {cnt[layer, expert]} but phy2log holds "
                f"{counted_LE[layer, expert]} replicas of it"
            )
        if cnt.max() > R:
            raise ValueError(f"log2phy has room for {R} replicas but an expert has {cnt.max()}")
        rank_R = np.arange(R, dtype=INT32)
        used_LER = rank_R[None, None, :] < cnt[:, :, None]
        if (l2p[~used_LER] != -1).any():
            raise ValueError("log2phy must be padded with -1 past each expert's replica count")
        slots = l2p[used_LER]
        if slots.size and (slots.min() < 0 or slots.max() >= P):
            raise ValueError(f"log2phy holds slots outside [0, {P})")
        layer_of = np.broadcast_to(np.arange(L)[:, None, None], l2p.shape)[used_LER]
        expert_of = np.broadcast_to(np.arange(E)[None, :, None], l2p.shape)[used_LER]
        if not np.array_equal(p2l[layer_of, slots], expert_of):
            raise ValueError("log2phy and phy2log disagree: a listed slot holds another expert")
        # Counts match and every listed slot holds its expert, so duplicates would leave a slot unlisted.
        seen_LP = np.zeros((L, P), dtype=bool)
        seen_LP[layer_of, slots] = True
        if not seen_LP.all():
            raise ValueError("log2phy lists a slot twice for one expert (another slot is missing)")
        return self

    def _check_slots(self) -> np.ndarray:
        """The checks of :meth:`validate` on phy2log and the geometry alone (what a placement built
        from a phy2log map can get wrong: its log2phy and counts are derived); returns the
        replica counts int [L, E] phy2log holds."""
        p2l = self.phy2log_LP
        P, E = p2l.shape[1], self.logcnt_LE.shape[1]
        if E == 0 or P == 0:
            raise ValueError("a placement needs at least one logical expert and one physical slot")
        if P < E:
            raise ValueError(f"fewer physical slots ({P}) than logical experts ({E})")
        if self.num_gpus <= 0 or P % self.num_gpus:
            raise ValueError(f"physical slots ({P}) not divisible by GPUs ({self.num_gpus})")
        if self.num_nodes <= 0 or self.num_gpus % self.num_nodes:
            raise ValueError(f"GPUs ({self.num_gpus}) not divisible by nodes ({self.num_nodes})")
        if p2l.size and (p2l.min() < 0 or p2l.max() >= E):
            raise ValueError(f"phy2log holds ids outside [0, {E})")
        counted_LE = _bincount_rows(p2l, E)
        if (counted_LE == 0).any():
            layer, expert = np.argwhere(counted_LE == 0)[0]
            raise ValueError(f"logical expert {expert} of layer {layer} has no replica")
        return counted_LE

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def from_phy2log(
        cls, phy2log: Any, num_gpus: int, num_nodes: int = 1, max_replicas: int | None = None
    ) -> Placement:
        """Build from a phy2log [L, P] map; log2phy lists each expert's slots in ascending order.

        ``num_logical`` is inferred as ``max(phy2log) + 1``; R defaults to ``P - E + 1``
        (DeepSeek's layout), or ``max_replicas`` when given.
        """
        p2l = _as_int32("phy2log", phy2log)
        if p2l.ndim != 2 or p2l.shape[1] == 0:
            raise ValueError(f"phy2log must be [L, P] with P > 0, got shape {p2l.shape}")
        if p2l.min(initial=0) < 0:
            raise ValueError("phy2log holds negative expert ids")
        E = int(p2l.max(initial=-1)) + 1
        if p2l.shape[1] < E:  # checked before E sizes any array: one huge id must not cost gigabytes
            raise ValueError(f"phy2log names expert {E - 1} but has only {p2l.shape[1]} slots per layer")
        return cls._from_checked_phy2log(p2l, E, num_gpus, num_nodes, max_replicas)

    @classmethod
    def _from_checked_phy2log(
        cls, p2l: np.ndarray, num_logical: int, num_gpus: int, num_nodes: int, max_replicas: int | None
    ) -> Placement:
        L, P = p2l.shape
        E = num_logical
        cnt = _bincount_rows(p2l, E)
        R = max(P - E + 1, int(cnt.max(initial=1))) if max_replicas is None else max_replicas
        # Stable sort by expert keeps each expert's slots ascending; rank = position within the expert.
        order_LP = expert_order_LP(p2l, E).astype(INT32)
        sorted_experts = np.take_along_axis(p2l, order_LP, axis=1)
        first_slot_LE = np.cumsum(cnt, axis=1) - cnt
        rank_LP = np.arange(P)[None, :] - np.take_along_axis(first_slot_LE, sorted_experts, axis=1)
        l2p = np.full((L, E, max(R, 1)), -1, dtype=INT32)
        if (rank_LP >= R).any():
            raise ValueError(f"an expert has more than max_replicas={R} replicas")
        layer = np.broadcast_to(np.arange(L)[:, None], (L, P))
        l2p[layer, sorted_experts, rank_LP] = order_LP
        out = cls(p2l, l2p, cnt.astype(INT32), num_gpus, num_nodes)
        # log2phy and the counts are derived from phy2log above, consistent by construction: the
        # phy2log and geometry checks suffice (the full validate() took about 7 of a build's 9 ms at
        # DeepSeek-V3's shape, and a continuous solve builds two).
        out._check_slots()
        return out

    @classmethod
    def trivial(
        cls, num_layers: int, num_logical: int, num_gpus: int, num_redundant: int = 0, num_nodes: int = 1
    ) -> Placement:
        """Identity placement plus round-robin redundant slots (slot p holds expert p mod E), as SGLang's."""
        if num_layers < 0 or num_logical <= 0 or num_redundant < 0:
            raise ValueError("need num_layers >= 0, num_logical > 0 and num_redundant >= 0")
        P = num_logical + num_redundant
        p2l = np.broadcast_to(np.arange(P, dtype=INT32) % num_logical, (num_layers, P)).copy()
        return cls._from_checked_phy2log(p2l, num_logical, num_gpus, num_nodes, None)

    @classmethod
    def from_deepseek(
        cls, phy2log: Any, log2phy: Any, logcnt: Any, num_gpus: int, num_nodes: int = 1
    ) -> Placement:
        """Adopt DeepSeek's ``rebalance_experts`` triple as is (its replica order is kept)."""
        return cls(
            _as_int32("phy2log", phy2log),
            _as_int32("log2phy", log2phy),
            _as_int32("logcnt", logcnt),
            num_gpus,
            num_nodes,
        ).validate()

    @classmethod
    def from_sglang(cls, source: str | Path | dict[str, Any], num_gpus: int, num_nodes: int = 1) -> Placement:
        """Read an SGLang ``--init-expert-location`` JSON (path, JSON text or dict).

        Only ``physical_to_logical_map`` is accepted here: a ``logical_count`` file describes load,
        not a placement, and needs a solver (``eplb solve``) to become one.
        """
        where, data = _read_json_source(source)
        try:
            if "physical_to_logical_map" not in data:
                raise ValueError("SGLang expert-location JSON has no 'physical_to_logical_map'")
            return cls.from_phy2log(data["physical_to_logical_map"], num_gpus, num_nodes)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None

    # ---- conversions -----------------------------------------------------------------------
    def to_deepseek(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DeepSeek's triple ``(phy2log [L,P], log2phy [L,E,R], logcnt [L,E])`` as int32 CPU tensors."""
        import torch

        return (
            torch.from_numpy(self.phy2log_LP.copy()),
            torch.from_numpy(self.log2phy_LER.copy()),
            torch.from_numpy(self.logcnt_LE.copy()),
        )

    def to_sglang_dict(self) -> dict[str, list[list[int]]]:
        """SGLang ``--init-expert-location`` content: ``{"physical_to_logical_map": [L][P]}``."""
        return {"physical_to_logical_map": self.phy2log_LP.tolist()}

    def write_sglang_json(self, path: str | Path, *, outputs: OutputSet | None = None) -> Path:
        """Write the SGLang ``--init-expert-location`` JSON file atomically and return its path
        (with ``outputs``: staged there, it appears when that set commits)."""
        return write_text(path, json.dumps(self.to_sglang_dict(), separators=(",", ":")), outputs=outputs)

    def to_device(self, device: torch.device | str) -> DevicePlacement:
        """The maps as int32 tensors on ``device`` (dtype named explicitly, never inferred)."""
        import torch

        def put(arr: np.ndarray) -> torch.Tensor:
            return torch.as_tensor(arr, dtype=torch.int32).to(device=device, dtype=torch.int32)

        return DevicePlacement(put(self.phy2log_LP), put(self.log2phy_LER), put(self.logcnt_LE))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (
            self.num_gpus == other.num_gpus
            and self.num_nodes == other.num_nodes
            and np.array_equal(self.phy2log_LP, other.phy2log_LP)
            and np.array_equal(self.log2phy_LER, other.log2phy_LER)
            and np.array_equal(self.logcnt_LE, other.logcnt_LE)
        )

    __hash__ = None  # type: ignore[assignment]

    def same_slots(self, other: Placement) -> bool:
        """True when both hold the same expert in every slot (replica order in log2phy may differ)."""
        return (
            self.num_gpus == other.num_gpus
            and self.num_nodes == other.num_nodes
            and np.array_equal(self.phy2log_LP, other.phy2log_LP)
        )

    # ---- experts present per GPU / node ----------------------------------------------------
    def gpu_has_expert(self) -> np.ndarray:
        """bool [L, G, E]: whether GPU g holds at least one replica of expert e."""
        L, G, E = self.num_layers, self.num_gpus, self.num_logical
        has_LGE = np.zeros((L, G, E), dtype=bool)
        layer = np.broadcast_to(np.arange(L)[:, None], self.phy2log_LP.shape)
        gpu = np.broadcast_to(self.gpu_of_slot()[None, :], self.phy2log_LP.shape)
        has_LGE[layer, gpu, self.phy2log_LP] = True
        return has_LGE

    def node_has_expert(self) -> np.ndarray:
        """bool [L, N, E]: whether any GPU of node n holds expert e."""
        has_LGE = self.gpu_has_expert()
        L, E = self.num_layers, self.num_logical
        return np.asarray(has_LGE.reshape(L, self.num_nodes, self.gpus_per_node, E).any(axis=2), dtype=bool)


@dataclass(frozen=True)
class DevicePlacement:
    """A :class:`Placement`'s maps as int32 torch tensors on one device."""

    phy2log_LP: torch.Tensor
    log2phy_LER: torch.Tensor
    logcnt_LE: torch.Tensor


def expert_order_LP(phy2log_LP: np.ndarray, num_logical: int) -> np.ndarray:
    """int [L, P]: each row's slots ordered by the expert they hold, one expert's slots ascending
    (a stable argsort by expert id).

    Every stable sort by the same keys gives this one order, so ids below 2**16 are sorted as
    uint16, which numpy sorts stably by radix: about 7x faster than on int32 or int64 at
    DeepSeek-V3's shape, where a continuous solve builds several placements.
    """
    if num_logical <= 1 << 16:
        phy2log_LP = phy2log_LP.astype(np.uint16)
    return np.argsort(phy2log_LP, axis=1, kind="stable")


def _bincount_rows(ids_LP: np.ndarray, num_bins: int) -> np.ndarray:
    """int32 [L, num_bins]: per-row histogram of ids in [0, num_bins)."""
    L = ids_LP.shape[0]
    flat = (ids_LP.astype(np.int64) + np.arange(L, dtype=np.int64)[:, None] * num_bins).ravel()
    return np.bincount(flat, minlength=L * num_bins).reshape(L, num_bins).astype(INT32)


def _read_json_source(source: str | Path | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The JSON object ``source`` holds (a dict, JSON text, or a file read through
    eplb.fileio.read_input), and the prefix of its error messages: the file's name, if any."""
    if isinstance(source, dict):
        return "", source
    raw: str | bytes = str(source)
    where = "expert-location JSON: "
    if not str(raw).lstrip().startswith("{"):
        raw = read_input(source, limit=MAX_PLACEMENT_FILE_BYTES, what="expert-location JSON")
        where = f"{source}: "
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ValueError(f"{where}JSON nested too deeply to be a placement") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an integer past Python's digit limit
        raise ValueError(f"{where}not valid JSON ({json_error_text(exc)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}expert-location JSON must be an object")
    return where, data
