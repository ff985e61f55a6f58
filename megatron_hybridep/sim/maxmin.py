"""Max-min fair rates by progressive filling, vectorised over flow classes and link classes.

Every unfrozen flow class rises at the same rate until some link is full; the classes on full links
freeze; repeat. With per-link counts (orbit-mates of a class on one link, see flows.py) the
constraint of link k is  sum_f count[f, k] * rate[f] <= cap[k].  Each round costs O(K) (K =
incidence entries) and freezes at least one class, so a fill is O(K x distinct bottlenecks): in
practice a handful of rounds (one per saturated level / override pair).
"""

from __future__ import annotations

import numpy as np

REL_TOL = 1e-9


def max_min_rates(alive: np.ndarray, inc_flow: np.ndarray, inc_link: np.ndarray, inc_count: np.ndarray,
                  cap: np.ndarray) -> np.ndarray:
    """Per-flow rate (bytes/s) of every flow class; 0 for classes that are not ``alive``.

    alive: (F,) bool; inc_*: (K,) incidence (flow class, link class, flows of the class per link);
    cap: (n_links,) capacity per link of the class (finite, > 0).
    """
    F, n_links = len(alive), len(cap)
    rate = np.zeros(F)
    frozen = ~alive
    if not alive.any():
        return rate
    remaining = cap.astype(np.float64).copy()
    # entries of alive classes only; drop the rest once
    keep = alive[inc_flow]
    fl, lk, cnt = inc_flow[keep], inc_link[keep], inc_count[keep]
    if not len(fl):
        raise ValueError("max_min_rates: an alive flow class crosses no link; every flow needs a sibling link")
    while True:
        live = ~frozen[fl]
        if not live.any():
            break
        weight = np.bincount(lk[live], weights=cnt[live], minlength=n_links)
        used = weight > 0
        delta = float(np.min(remaining[used] / weight[used]))
        rate[~frozen] += delta
        remaining[used] -= delta * weight[used]
        full = used & (remaining <= REL_TOL * cap)
        remaining[full] = 0.0
        hit = np.zeros(F, bool)
        hit[fl[full[lk] & live]] = True
        if not hit.any():  # numerical safety: freeze the classes on the tightest link
            tight = used & (remaining <= remaining[used].min() * (1 + 1e-12))
            hit[fl[tight[lk] & live]] = True
        frozen |= hit
    return rate
