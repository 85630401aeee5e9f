"""The dispatch mode as the solver scores it: the share model of eplb.placement.share.

``Dispatch`` is the name ``solve`` builds it by (``Dispatch(options.dispatch, num_nodes)``); the
search, the scorer and the simulator take the same object, :class:`~eplb.placement.share.ShareModel`.
"""

from __future__ import annotations

from eplb.placement.share import ShareModel

Dispatch = ShareModel
"""The share model of a dispatch mode (eplb.placement.share.ShareModel)."""
