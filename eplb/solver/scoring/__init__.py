"""How the solver scores placements: as the server dispatches on them, and over the passes they serve.

- ``dispatch``: ``Dispatch``, the name ``solve`` builds the share model of its dispatch mode by
  (eplb.placement.share.ShareModel: slot shares, a pass's GPU loads);
- ``served``: a placement with its slot shares, its model balancedness on a load, and each
  layer's expected balancedness over the forecast's scenarios;
- ``horizon``: pass-by-pass scores on a window, domain shifts, and the calibrated prediction of
  what a plan and the current placement get until the next rebalance.

Numpy only; nothing here searches or changes a placement.
"""
