"""Whether the manager may still rebalance: never again once a hot-swap lost its process group.

A swap given up without every rank's vote (a peer lost, late or interrupted:
:class:`eplb.hotswap.HotSwapError`) leaves every layer of this rank on the old or the new
placement, weights and maps, but the group's ranks may be out of step or gone, so any further
collective could block the forward path. :class:`SwapHealth` turns such a swap into a failed
result and remembers the loss: the manager then keeps serving on the placement it holds, runs no
collective and no rebalance again, logs it and reports the failed rebalance to the metrics sink
(its reason names the cause: ``peer lost`` or ``timeout``, and the rank).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from eplb.hotswap.swap import HotSwapError, HotSwapResult

log = logging.getLogger("eplb.manager.health")


class SwapHealth:
    """This rank's view of its group: usable until a hot-swap loses it, then never again."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.lost: BaseException | None = None
        """What lost the group (a HotSwapError, or what interrupted a swap); None while usable."""

    @property
    def usable(self) -> bool:
        return self.lost is None

    def execute(self, layers: tuple[int, ...], swap: Callable[[], HotSwapResult]) -> HotSwapResult:
        """Run ``swap``. HotSwapError: the group is lost, and a failed result says why. Anything
        else it raises (KeyboardInterrupt) also loses the group, then propagates."""
        try:
            return swap()
        except HotSwapError as exc:
            self._lose(exc)
            return replace(HotSwapResult.not_started(layers, str(exc)), cause=exc.cause, rank=exc.rank)
        except BaseException as exc:
            self._lose(exc)
            raise

    def note(self, kept: list[int]) -> str:
        """What a failure's reason adds once the group is lost."""
        return (
            f"; the process group is unusable: serving on the placement held (layers {kept} of this "
            "rebalance stay applied), rebalancing stopped"
        )

    def _lose(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
            log.error(
                "rank %d: a hot-swap lost its process group (%s: %s); serving on the placement held, "
                "rebalancing stopped",
                self.rank,
                type(exc).__name__,
                exc,
            )
