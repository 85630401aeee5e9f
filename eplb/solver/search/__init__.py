"""How the solver finds placements: the searches and packings the policies compose.

- ``copies``: what each GPU holds and what an expert copy arriving there costs (one ledger);
- ``swap``: the swap step every search takes (the hot GPU, its partners, the candidate swaps);
- ``moves`` and ``budget``: the budgeted search from the live placement (swaps and replica
  changes that buy the most balance per copy, within a move budget);
- ``local_search`` and ``milp``: the swap polish and the exact MILP repacking of a fresh plan;
- ``recount``: a fresh plan's replica counts chosen with its placement, on the layers whose
  counts left them unbalanced (a hot expert stacked on one GPU), spread over nodes;
- ``static_pack``: fresh plans packed for static dispatch's replica shares;
- ``migration``: a fresh plan's GPUs relabelled to keep replicas where they are;
- ``split``: the LP split of each expert's load over its replicas (weighted dispatch).

Placements are scored with eplb.solver.scoring; which of these run is a policy's choice
(eplb.solver.policies).
"""
