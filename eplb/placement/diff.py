"""What changes between two placements: slots rewritten and expert weights moved.

Shape legend: L layers, P physical slots, G GPUs, N nodes, E logical experts.

A slot whose expert changes needs that expert's weights. If the destination GPU already held the
expert before, the copy is local (no interconnect traffic); otherwise one expert's weights cross
GPUs, and cross nodes too when no GPU of the destination's node held it before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.placement.model import Placement


class PlacementMismatch(ValueError):
    """Two placements compared (:func:`diff_placements`) differ in shape or topology: a plan
    that does not fit the model it would be served on."""


BYTES_UNKNOWN = "bytes unknown"
"""What :meth:`PlacementDiff.summary` says for bytes moved when bytes per expert is not known."""


@dataclass(frozen=True)
class PlacementDiff:
    """Summary of the transfer from ``old`` to ``new``."""

    changed_slots_LP: np.ndarray
    """bool [L, P]: slots whose logical expert changes."""
    arrivals_LGE: np.ndarray
    """bool [L, G, E]: expert e must arrive at GPU g from another GPU."""
    cross_node_arrivals_LGE: np.ndarray
    """bool [L, G, E]: arrivals whose expert was on no GPU of g's node before."""
    local_copies: int
    """Changed slots filled from a replica the same GPU already held."""
    bytes_per_expert: int
    """Bytes of one expert's weights in one layer (0 when unknown: :meth:`summary` then says so)."""

    @property
    def num_changed_slots(self) -> int:
        return int(self.changed_slots_LP.sum())

    @property
    def experts_moved_across_gpus(self) -> int:
        return int(self.arrivals_LGE.sum())

    @property
    def experts_moved_across_nodes(self) -> int:
        return int(self.cross_node_arrivals_LGE.sum())

    @property
    def bytes_across_gpus(self) -> int:
        return self.experts_moved_across_gpus * self.bytes_per_expert

    @property
    def bytes_across_nodes(self) -> int:
        return self.experts_moved_across_nodes * self.bytes_per_expert

    def changed_layers(self) -> np.ndarray:
        """int64 [k]: layers with at least one changed slot."""
        return np.flatnonzero(self.changed_slots_LP.any(axis=1))

    @property
    def bytes_known(self) -> bool:
        """Whether byte counts mean anything: ``bytes_per_expert`` was given (> 0)."""
        return self.bytes_per_expert > 0

    def summary(self) -> dict[str, int | str]:
        """Slot and copy counts, and bytes moved; a byte figure reads ``BYTES_UNKNOWN`` where
        copies cross GPUs (or nodes) but ``bytes_per_expert`` was not given, never a false 0."""
        return {
            "changed_slots": self.num_changed_slots,
            "local_copies": self.local_copies,
            "experts_moved_across_gpus": self.experts_moved_across_gpus,
            "experts_moved_across_nodes": self.experts_moved_across_nodes,
            "bytes_across_gpus": self._bytes(self.experts_moved_across_gpus),
            "bytes_across_nodes": self._bytes(self.experts_moved_across_nodes),
        }

    def _bytes(self, copies: int) -> int | str:
        return copies * self.bytes_per_expert if self.bytes_known or not copies else BYTES_UNKNOWN


def diff_placements(old: Placement, new: Placement, bytes_per_expert: int = 0) -> PlacementDiff:
    """Compare two placements of the same shape and topology."""
    if old.phy2log_LP.shape != new.phy2log_LP.shape or old.num_logical != new.num_logical:
        raise PlacementMismatch(
            f"placements differ in shape: {old.phy2log_LP.shape} vs {new.phy2log_LP.shape}, "
            f"E {old.num_logical} vs {new.num_logical}"
        )
    if (old.num_gpus, old.num_nodes) != (new.num_gpus, new.num_nodes):
        raise PlacementMismatch(
            f"placements differ in topology: {old.num_gpus} GPUs/{old.num_nodes} nodes vs "
            f"{new.num_gpus} GPUs/{new.num_nodes} nodes"
        )
    if bytes_per_expert < 0:
        raise ValueError("bytes_per_expert must be >= 0")
    changed_LP = old.phy2log_LP != new.phy2log_LP
    old_gpu_LGE = old.gpu_has_expert()
    new_gpu_LGE = new.gpu_has_expert()
    arrivals_LGE = new_gpu_LGE & ~old_gpu_LGE
    node_of_gpu = np.arange(new.num_gpus) // new.gpus_per_node
    cross_node_LGE = arrivals_LGE & ~old.node_has_expert()[:, node_of_gpu, :]
    # A changed slot is a local copy when its GPU already held the expert under the old placement.
    layer_LP = np.broadcast_to(np.arange(new.num_layers)[:, None], changed_LP.shape)
    gpu_LP = np.broadcast_to(new.gpu_of_slot()[None, :], changed_LP.shape)
    held_before_LP = old_gpu_LGE[layer_LP, gpu_LP, new.phy2log_LP]
    return PlacementDiff(
        changed_slots_LP=changed_LP,
        arrivals_LGE=arrivals_LGE,
        cross_node_arrivals_LGE=cross_node_LGE,
        local_copies=int((changed_LP & held_before_LP).sum()),
        bytes_per_expert=int(bytes_per_expert),
    )
