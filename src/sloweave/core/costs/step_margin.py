"""A margin in milliseconds conditioned on the step it guards, learnt online (the ``per-step`` form).

The relative margin (``calibrated.AdaptiveMargin``) applies one quantile of measured /
corrected - 1, pooled over every step, to every step: delta = r x T'. A machine's step-time
noise is mostly additive (a 5 ms decode-only step and a 50 ms step with a chunk spread by a
few milliseconds each), so r is set by the small steps and multiplied onto the large ones,
and the small ones, a minority of the pool, are under-covered at the same time.

``StepResiduals`` (``step_residuals``) keeps the residuals in milliseconds per step kind and
predicted-time bucket, windowed and bounded in age, and says which of them the margin keeps.
``StepMargin`` reads, for a step of corrected prediction p, the ``quantile`` of its bucket's
residuals. A bucket with fewer than ``POOLED_STEPS`` steps
pools its nearest buckets (the larger side first: noise grows with the step), at each predicted
time its own kind's residuals before the other kind's; with too few steps in all, the margin is
the relative one, r x p. A pooled bucket that has steps of its own tests the pool's value on
them: where more exceed it than the quantile allows, beyond chance (a binomial tail under 5 %),
the other buckets' value is stretched by the bucket's own spread over theirs (interquartile
ranges), up to the worst of the bucket's own steps: the few large steps of a run spread wider than
the many small ones they pool with.
Quantiles are re-read every ``refresh_steps`` observed steps, not per call.

A stall (the machine busy elsewhere) past a decision's slack counts only as the risk the chunk
adds (``StepMargin.set_step``); one past every budget is left out of the pools, and a spell is
forgotten once the machine is quiet again (``step_residuals``).

The corrected model plus margin stays monotone in the chunk: within a kind (fixed for every
c >= 1) the total is g(p) = max(p + a_b + r_b p, F_b), a_b, r_b >= 0 the bucket's additive and
relative parts, F_b the largest total any lower bucket can reach (its upper edge plus its
margin), so g never drops at a bucket edge; T'(n, c) is monotone in c, hence so is g(T'(n, c)).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from sloweave.core.costs.step_residuals import (
    DECODE_ONLY,
    PREDICTED_MS_EDGES,
    STEP_KINDS,
    WITH_CHUNK,
    StepResiduals,
    predicted_bucket,
    without_stalls,
)

_UPPER_EDGES_MS = np.array(PREDICTED_MS_EDGES[1:])

# The fewest residuals a margin is read from (a thin bucket pools up to this many): with only the
# fewest the quantile needs (333 at P99.7) the covering value is the pool's largest, and one slow
# step (a 100 ms stall of the machine among 3 ms steps) would set the margin of every step near it.
POOLED_STEPS = 1000
# A pooled bucket with at least this many steps of its own is tested against its pool's value
# and, failing, reads its own spread: the other buckets (mostly smaller steps, whose noise is
# smaller) give the tail's shape, the bucket's own steps its width. Measured on vLLM's CPU engine's
# profile: its steps of 40-60 ms spread 2.2x as wide (interquartile) as the smaller steps with a
# chunk they pool with; the simulator fed that profile's noise had 7-9 % of drift's requests miss
# TPOT under the plug-in at 60 ms (none under a tuned budget), and none with this rule.
SPREAD_STEPS = 20
# The binomial tail below which a bucket's exceedances of its pool's value are not chance.
UNDER_COVERAGE_SIGNIFICANCE = 0.05
# The margin's tables are rebuilt from the windows every this many observed steps: a rebuild costs
# about 0.3-0.6 ms (a partition per pool), and at every 8 steps it was the largest part of the
# plug-in's scheduling inside vLLM (measured on its CPU build: 60 us of 400 us a step). 32 steps
# add 32 residuals to windows of up to 1,000 and are a fraction of a second of serving.
TABLE_REFRESH_STEPS = 32
# A decision whose decode-only step would itself miss its budget for a share p0 of like steps reads
# its margins at the quantile less p0, rounded up to this grid (%): each level read is one more
# table per refresh, and a burst of stalls moves p0 slowly.
ADDED_RISK_GRID = 0.1


def steps_for_quantile(quantile: float) -> int:
    """The fewest residuals whose order statistic covers ``quantile`` (%) of a next step, n >= q / (100 - q)."""
    return max(math.ceil(quantile / (100.0 - quantile) - 1e-9), 1)


def covering_value(residuals_ms: np.ndarray, quantile: float) -> float:
    """The ceil((n + 1) q)-th smallest of n residuals: a next exchangeable step lies at or below
    it with probability >= q (the conformal quantile; n >= ``steps_for_quantile`` needed)."""
    n = residuals_ms.size
    rank = min(math.ceil(round((n + 1) * quantile / 100.0, 9)), n)
    return float(np.partition(residuals_ms, rank - 1)[rank - 1])


def _nearest_first(bucket: int, kind: int, low: int, high: int):
    """(kind, bucket) pairs from ``low`` to ``high`` by distance to ``bucket``: at each distance the
    larger bucket first, and within a bucket ``kind`` before the other kind."""
    kinds = (kind, 1 - kind)
    for distance in range(high - low + 1):
        for side in (bucket + distance, bucket - distance) if distance else (bucket,):
            if low <= side <= high:
                yield from ((k, side) for k in kinds)


def _additive_parts(
    windows: list[list[np.ndarray]], kind: int, quantile: float, by_pool: dict[tuple, float] | None = None
) -> list[float | None]:
    """Each bucket's additive margin in ms for steps of ``kind`` (None: too few steps of either
    kind for ``quantile``). A bucket thin in its own kind pools, nearest predicted time first, its
    own kind's and the other kind's residuals until the pool holds ``POOLED_STEPS``: the noise is
    mostly additive in the predicted time, and a kind the margin keeps from running (chunks
    behind a margin one slow step set) must not keep that margin for want of new steps.
    Where the bucket's own steps show the pool's value under-covers them (``_under_covers``), the
    other buckets' tail is stretched by the bucket's own spread (``_stretched``), never past the worst
    of the bucket's own steps: a pool of steps far steadier than the bucket's stretches without bound
    (measured on vLLM's CPU engine after a warm-up of decode-only steps: a pool with an interquartile
    range of 0.17 ms stretched a chunk bucket's margin 12x, to 46 ms, where its own 43 steps had been
    at most 6.3 ms late, and the plug-in took chunks of 32-250 tokens with 2,000 waiting and 45 ms of
    its budget to spare).
    ``by_pool`` caches each pool's value (the two kinds share most pools)."""
    needed = steps_for_quantile(quantile)
    counts, span = _counts_and_span(windows, needed)
    if span is None:
        return [None] * len(counts[kind])
    low, high = span
    by_pool = {} if by_pool is None else by_pool
    parts: list[float | None] = [None] * len(counts[kind])
    for bucket in range(low, high + 1):
        key = _pool(counts, bucket, kind, low, high, needed)
        if key not in by_pool:
            by_pool[key] = max(covering_value(np.concatenate([windows[k][b] for k, b in key]), quantile), 0.0)
        covered_ms = by_pool[key]
        own = windows[kind][bucket]
        if len(key) > 1 and own.size >= SPREAD_STEPS and _under_covers(own, covered_ms, quantile):
            others = np.concatenate([windows[k][b] for k, b in key if (k, b) != (kind, bucket)])
            covered_ms = max(covered_ms, min(_stretched(own, others, quantile), float(own.max())))
        parts[bucket] = covered_ms
    # outside the range seen, the nearest bucket seen (its pool is theirs)
    parts[:low] = [parts[low]] * low
    parts[high + 1 :] = [parts[high]] * (len(parts) - high - 1)
    return parts


def _counts_and_span(windows: list[list[np.ndarray]], needed: int) -> tuple[list[list[int]], tuple[int, int] | None]:
    """Each window's size, per kind and bucket, and the first and last bucket holding a step of
    either kind (None: fewer than ``needed`` steps in all, too few for any margin)."""
    counts = [[window.size for window in of_kind] for of_kind in windows]
    if sum(map(sum, counts)) < needed:
        return counts, None
    filled = [b for b in range(len(counts[0])) if counts[0][b] or counts[1][b]]
    return counts, (filled[0], filled[-1])


def _pool(counts: list[list[int]], bucket: int, kind: int, low: int, high: int, needed: int) -> tuple:
    """The (kind, bucket) windows a bucket's margin is read from, in order: its own, then the
    nearest (``_nearest_first``) until they hold ``POOLED_STEPS`` (or ``needed``, if more)."""
    pool, pooled = [], 0
    for k, neighbour in _nearest_first(bucket, kind, low, high):
        if counts[k][neighbour]:
            pool.append((k, neighbour))
            pooled += counts[k][neighbour]
        if pooled >= max(needed, POOLED_STEPS):
            break
    return tuple(sorted(pool))


def _stretched(own_ms: np.ndarray, others_ms: np.ndarray, quantile: float) -> float:
    """The other buckets' covering value scaled by the bucket's spread over theirs: their many steps
    give the tail's shape, the bucket's few its width (0 where theirs has no spread). Read only for
    a bucket its pool under-covers: a spread is a sort, and a rebuild reads every pool."""
    others_spread_ms = _spread(others_ms)
    if others_spread_ms <= 0.0:
        return 0.0
    return max(covering_value(others_ms, quantile), 0.0) * _spread(own_ms) / others_spread_ms


def _spread(residuals_ms: np.ndarray) -> float:
    """The interquartile range: a spread a few dozen steps estimate and one stall does not move."""
    low, high = np.percentile(residuals_ms, (25.0, 75.0))
    return float(high - low)


def _share_past(sorted_ms: np.ndarray, limit_ms: float) -> float:
    """The share of sorted residuals above ``limit_ms``."""
    return (sorted_ms.size - int(np.searchsorted(sorted_ms, limit_ms, side="right"))) / sorted_ms.size


def _under_covers(residuals_ms: np.ndarray, margin_ms: float, quantile: float) -> bool:
    """Whether more of these steps exceed ``margin_ms`` than ``quantile`` allows, beyond chance: the
    binomial tail of that many exceedances (or more) under the quantile's rate is below
    ``UNDER_COVERAGE_SIGNIFICANCE``."""
    exceeded = int(np.count_nonzero(residuals_ms > margin_ms))
    steps, rate = residuals_ms.size, 1.0 - quantile / 100.0
    # P(fewer than ``exceeded``) summed term by term, stopping once the tail is known to be small
    term = below = (1.0 - rate) ** steps
    for k in range(exceeded):
        if below > 1.0 - UNDER_COVERAGE_SIGNIFICANCE:
            return True
        term *= (steps - k) / (k + 1) * rate / (1.0 - rate)
        below += term
    return False


def margin_table(
    windows: list[list[np.ndarray]],
    kind: int,
    quantile: float,
    relative_fraction: Callable[[], float],
    by_pool: dict[tuple, float] | None = None,
) -> tuple:
    """Per bucket of ``kind``: additive ms a_b, relative fraction r_b, and the floor F_b (the
    largest total p + a + r p any lower bucket reaches, at its upper edge); ``windows`` are
    ``StepResiduals.windows()``, ``relative_fraction`` gives r for buckets with too few steps
    (asked only when there are such: it sorts a window of its own)."""
    parts = _additive_parts(windows, kind, quantile, by_pool)
    fraction = relative_fraction() if None in parts else 0.0
    additive = np.array([0.0 if part is None else part for part in parts])
    relative = np.array([fraction if part is None else 0.0 for part in parts])
    # each bucket's total at its upper edge, in the float expression the policy adds (cost + margin),
    # so that no rounding breaks the order at an edge
    totals = _UPPER_EDGES_MS + (additive[:-1] + relative[:-1] * _UPPER_EDGES_MS)
    floors = np.concatenate(([0.0], np.maximum.accumulate(totals)))
    # A floor with an odd last bit can be out of reach of p + m: when p's bits below the floor's
    # last are exactly half of it, the sum rounds to even whatever m is. Even floors are always reached.
    odd = (floors.view(np.int64) & 1).astype(bool)
    floors[odd] = np.nextafter(floors[odd], np.inf)
    return additive.tolist(), relative.tolist(), floors.tolist()


def _margin_reaching(predicted_ms: float, total_ms: float) -> float:
    """The margin m with predicted_ms + m == total_ms in floating point (an even floor is always
    reached within an ulp or two of total - predicted); never one that falls short of it."""
    margin = total_ms - predicted_ms
    for _ in range(4):
        reached = predicted_ms + margin
        if reached == total_ms:
            return margin
        margin = math.nextafter(margin, math.inf if reached < total_ms else -math.inf)
    while predicted_ms + margin < total_ms:
        margin = math.nextafter(margin, math.inf)
    return margin


class StepMargin:
    """delta(n, c) in ms: the ``quantile`` of the residuals of steps like this one (kind, predicted time).

    ``cost`` is the corrected cost the policy decides with (T'), ``residuals`` what its
    calibrator feeds, ``relative`` the relative form (``AdaptiveMargin``): used until
    ``min_steps`` steps are seen (its own fallback: the profile's margin), and, past that, its
    fraction while fewer steps than the quantile needs have been seen.

    Told each decision's budget first (``set_step``, ``WeighsAddedRisk``), it holds a chunk back
    only for the risk the chunk adds, as the relative form does: a stall delays a decode-only
    step as much as one with a chunk, so a margin set by stalls would stop every prefill and
    protect no token (measured on vLLM's CPU engine: a machine 3x slower for 20 s gave
    decode-only steps a margin of 90-110 ms against a 20 ms budget, and 97 % of steps ran
    without a chunk while prompts waited).
    """

    def __init__(
        self,
        cost: Callable[[int, int], float],
        residuals: StepResiduals,
        relative,
        quantile: float,
        min_steps: int,
        refresh_steps: int,
    ) -> None:
        if isinstance(quantile, bool) or not (isinstance(quantile, (int, float)) and 50.0 <= quantile < 100.0):
            raise ValueError(f"margin quantile must be in [50, 100) %, got {quantile!r}")
        self.cost = cost
        self.residuals = residuals
        self.relative = relative
        self.quantile = quantile
        self.min_steps = min_steps
        self.refresh_steps = refresh_steps
        self._read_at = -1
        self._windows: list[list[np.ndarray]] = []
        self._tables: dict[float, tuple] = {}  # per quantile read, this refresh's tables
        self._sorted_pools: dict[tuple, np.ndarray] = {}  # per pool (``_pool``'s key), sorted
        self._pool_of: dict[tuple[int, int], np.ndarray | None] = {}  # per kind and bucket, one of those
        self.level = quantile  # the quantile the decision ``set_step`` announced reads
        # residuals past this are stalls (``without_stalls``): the largest budget told, on the buckets' grid
        self.stall_ms = math.inf

    def _refresh(self) -> None:
        """Every ``refresh_steps`` observed steps, the windows are read again and the tables made anew."""
        epoch = self.residuals.observed // self.refresh_steps
        if epoch != self._read_at:
            windows = self.residuals.windows()
            self._windows = windows if self.stall_ms == math.inf else without_stalls(windows, self.stall_ms)
            self._tables.clear()
            self._sorted_pools.clear()
            self._pool_of.clear()
            self._read_at = epoch

    def tables(self, level: float | None = None) -> tuple:
        """Per step kind: (additive ms, relative fraction, floor ms) per bucket at ``level`` (%, the
        quantile if None), re-read every ``refresh_steps``."""
        self._refresh()
        level = self.quantile if level is None else level
        tables = self._tables.get(level)
        if tables is None:
            by_pool: dict[tuple, float] = {}
            tables = self._tables[level] = tuple(
                margin_table(self._windows, kind, level, self.relative.window_fraction, by_pool)
                for kind in range(len(STEP_KINDS))
            )
        return tables

    def set_step(self, n_decodes: int, budget_ms: float) -> None:
        """The decision about to be taken: its decode batch and budget. Where a decode-only step of
        that batch would itself miss the budget for a share p of like steps (``_stalled_share``),
        every margin of the decision is read at the quantile less p: a step with a chunk is late
        for its chunk (a residual past its margin that would not have made the decode-only step
        late) at most 1 - quantile of the time. Past the median (the decode-only step itself
        likely late) the quantile as it is; p = 0 on a quiet machine."""
        self.level = self.quantile
        if not n_decodes or not budget_ms < math.inf or self.residuals.observed < self.min_steps:
            return
        if not budget_ms <= self.stall_ms < math.inf:
            self._stalls_past(budget_ms)
        decode_only_ms = self.cost(n_decodes, 0)
        pool = self._sorted_pool(DECODE_ONLY, predicted_bucket(decode_only_ms))
        if pool is None or pool[-1] <= budget_ms - decode_only_ms:
            return
        level = self.quantile - 100.0 * self._stalled_share(pool, decode_only_ms, budget_ms)
        if level >= 50.0:
            self.level = min(math.ceil(round(level / ADDED_RISK_GRID, 9)) * ADDED_RISK_GRID, self.quantile)

    def _stalled_share(self, decode_only_pool: np.ndarray, decode_only_ms: float, budget_ms: float) -> float:
        """The largest share of steps a stall makes late whatever they hold, among the pools this
        decision's steps read: the decode-only step's (p0: residuals past its slack, the budget less
        its time) and those of the steps with a chunk it could plan, predicted between the
        decode-only step and the budget (residuals past the same slack: that late, the decode-only
        step would have been late too). A stall comes in wall time: a step with a chunk, up to r
        times as long as the decode-only step, is caught by up to r times as many, so a pool of
        steps with a chunk counts up to r p0, and nothing where decode-only steps show no stall (a
        chunk that is itself slow is not the machine's)."""
        slack_ms = budget_ms - decode_only_ms
        p0 = _share_past(decode_only_pool, slack_ms)
        stalled = p0
        if decode_only_ms <= 0:
            return stalled
        for bucket in range(predicted_bucket(decode_only_ms), predicted_bucket(budget_ms) + 1):
            pool = self._sorted_pool(WITH_CHUNK, bucket)
            if pool is not None:
                longest = min(PREDICTED_MS_EDGES[bucket + 1], budget_ms) / decode_only_ms
                stalled = max(stalled, min(_share_past(pool, slack_ms), p0 * longest))
        return stalled

    def _stalls_past(self, budget_ms: float) -> None:
        """A budget larger than any before: residuals past it (rounded up to the buckets' next
        edge, so that the tables are rebuilt only a few times) are stalls from the next refresh."""
        stall_ms = PREDICTED_MS_EDGES[min(predicted_bucket(budget_ms) + 1, len(PREDICTED_MS_EDGES) - 1)]
        if stall_ms != self.stall_ms:
            self.stall_ms = stall_ms
            self._read_at = -1

    def _sorted_pool(self, kind: int, bucket: int) -> np.ndarray | None:
        """The residuals a step's margin of ``kind`` at ``bucket`` is read from, sorted (None: too
        few), once per refresh: looked up per bucket (every decision asks), sorted once per pool (the
        buckets past the ones seen, and thin neighbours, share one)."""
        self._refresh()
        if (kind, bucket) not in self._pool_of:
            needed = steps_for_quantile(self.quantile)
            counts, span = _counts_and_span(self._windows, needed)
            pool = None
            if span is not None:
                low, high = span
                key = _pool(counts, min(max(bucket, low), high), kind, low, high, needed)
                if key not in self._sorted_pools:
                    self._sorted_pools[key] = np.sort(np.concatenate([self._windows[k][b] for k, b in key]))
                pool = self._sorted_pools[key]
            self._pool_of[kind, bucket] = pool
        return self._pool_of[kind, bucket]

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return self.margin_for(n_decodes, chunk_tokens, self.cost(n_decodes, chunk_tokens))

    def margin_for(self, n_decodes: int, chunk_tokens: int, predicted: float) -> float:
        """delta given T'(n, c) = ``predicted`` (the relative form reads the same cost)."""
        if self.residuals.observed < self.min_steps:
            return self.relative.margin_for(n_decodes, chunk_tokens, predicted)
        additive, relative, floors = self.tables(self.level)[WITH_CHUNK if chunk_tokens > 0 else DECODE_ONLY]
        bucket = predicted_bucket(predicted)
        margin = additive[bucket] + relative[bucket] * predicted
        if predicted + margin >= floors[bucket]:
            return margin
        return _margin_reaching(predicted, floors[bucket])

    def as_dict(self) -> dict:
        """The margin per bucket that has one of its own or pooled (for a run's record)."""
        tables = self.tables() if self.residuals.observed >= self.min_steps else None
        described = {"quantile": self.quantile, "bucket_lower_edges_ms": list(PREDICTED_MS_EDGES)}
        described["stalls_past_ms"] = self.stall_ms if self.stall_ms < math.inf else None
        windows = self.residuals.windows()
        for kind, name in enumerate(STEP_KINDS):
            described[f"steps_{name}"] = [window.size for window in windows[kind]]
            if tables is not None:
                described[f"additive_ms_{name}"] = [round(a, 4) for a in tables[kind][0]]
        return described
