"""The largest deadline-safe chunk: a bracketing search over the chunk sizes.

SLOWeave asks, every iteration, for the largest c with T(n, c) + delta(n, c) <= B. T + delta is
monotone in c, so a search that keeps a bracket [lo, hi] with lo fitting and hi not finds it
exactly, whatever points it probes; bisection probes the middle, ``largest_fitting`` probes where
the cost is estimated to cross the budget.
"""

from __future__ import annotations

import math

from sloweave.core.costs.protocols import CostModel

# Secant probes that may fail to halve the bracket before ``largest_fitting`` only bisects: on a
# smooth cost the secant lands within a token in 3-5 probes; on a jagged one (plateaus, jumps)
# the search costs at most this many probes more than bisection's worst case, ceil(log2(hi)).
SECANT_ALLOWANCE = 4


def largest_fitting(
    predicted: CostModel,
    n_decodes: int,
    budget_ms: float,
    lo: int,
    lo_ms: float,
    hi: int,
    hi_ms: float,
    allowance: int = SECANT_ALLOWANCE,
) -> int:
    """The largest chunk c in [lo, hi) with predicted(n, c) <= budget_ms, given that ``lo`` fits
    (at ``lo_ms``) and ``hi`` does not (at ``hi_ms``; either time NaN where it was not asked);
    ``predicted`` monotone in c.

    A bracketing search: the bracket [lo, hi] keeps lo fitting and hi not, so the answer is the
    binary search's, exactly. Its probes are secant estimates of where T + delta crosses the
    budget, through the last two probes (a measured or fitted cost is smooth between its jumps,
    and the estimate lands within a token in a few probes, where bisection takes log2(hi));
    an estimate on the last probe tests its neighbour, and once ``allowance`` probes have
    failed to halve the bracket the rest is bisection (``allowance=0``: bisection throughout,
    for a cost that jumps, where the secant would only waste probes). Without two known times
    it bisects until it has them.
    """
    a, a_ms, b, b_ms = lo, lo_ms, hi, hi_ms  # the last two probes
    while hi - lo > 1:
        width = hi - lo
        estimate = math.nan
        if allowance > 0 and b_ms != a_ms:
            estimate = b + (budget_ms - b_ms) * (b - a) / (b_ms - a_ms)
        if lo - width < estimate < hi + width:  # False for NaN and inf (an infinite prediction)
            probe = math.floor(estimate)
            if probe == b:  # the estimate is the last probe: its neighbour settles it
                probe = b + 1 if b_ms <= budget_ms else b - 1
            probe = lo + 1 if probe <= lo else hi - 1 if probe >= hi else probe
        else:
            probe = (lo + hi) // 2
        probe_ms = predicted(n_decodes, probe)
        if probe_ms <= budget_ms:
            lo = probe
        else:
            hi = probe
        a, a_ms, b, b_ms = b, b_ms, probe, probe_ms
        if 2 * (hi - lo) > width:
            allowance -= 1
    return lo
