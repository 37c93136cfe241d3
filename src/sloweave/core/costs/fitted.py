"""The cost models fitted from step-time profiles, as evaluated at decision time (no torch: the GPU
plug-in reuses this).

Three things are fitted from a profile:

(a) ``LookupTableCost``: median step time on the (n, c, context) grid, interpolated
    multilinearly and made monotone in c and n (running maximum along c, then n). Small drops
    along either are timing noise and are repaired; a drop of the fastest repeat above
    ``monotone_tolerance`` (relative) and ``monotone_tolerance_ms`` is an error, in any fitted
    step (``check_monotone_steps``, run before a random hold-out is drawn: neither it nor the
    hole it leaves in the grid hides a drop).
(b) ``RegressionCost``: non-negative least squares on terms that each grow with c, so the
    model is monotone in c by construction. The context terms matter on engines whose
    attention reads the whole packed batch (transformers on CPU: cost ~ query x KV tokens);
    the chunk's square on vLLM's CPU build, where a token costs more in a large chunk (within a
    prompt, its attention; over several, its size).
(c) ``ResidualMargin``: delta(n, c) = r(n, c) x T(n, c), with r the P99 of out-of-fold relative
    residuals per (n, c) bucket, non-decreasing along c so T + delta stays monotone.

A fitted cost predicts ``predict(n, c, decode_kv_tokens, prefill_prefix_tokens)``; the policy
interface T(n, c) reads the context from ``set_context`` (a ``ContextFeed`` sets it before each
decision), see ``ContextualCost``.

A profile's format is in ``sloweave.core.costs.step_profiles``; ``sloweave.core.costs.profile_fit``
fits these models to one, and each kind is used only after ``accept_fit``
(``sloweave.core.costs.fit_acceptance``).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sloweave.core.costs.protocols import offer_pieces, predict_each
from sloweave.core.costs.step_grid import check_monotone_steps, check_tolerances, profile_grid
from sloweave.core.costs.step_profiles import ProfileError, offers_of

# Bucket edges of the margin table (lower edges; the last bucket is open).
N_BUCKET_EDGES = (0, 1, 4, 16, 64)
C_BUCKET_EDGES = (0, 1, 64, 256, 1024)


class ContextualCost:
    """Base of fitted costs: ``predict`` with explicit context, ``__call__(n, c)`` with the set one.

    The policy only speaks T(n, c); the body deciding (the simulator's clock, the
    ``BudgetController``) sets the KV context of the step being decided before each decision,
    through its ``sloweave.core.costs.protocols.ContextFeed``, so the same policy object stays
    valid. Every subclass is ``ContextAware``.
    """

    decode_kv_tokens: int = 0
    prefill_prefix_tokens: int = 0

    def set_context(self, decode_kv_tokens: int, prefill_prefix_tokens: int) -> None:
        self.decode_kv_tokens = int(decode_kv_tokens)
        self.prefill_prefix_tokens = int(prefill_prefix_tokens)

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        raise NotImplementedError

    def predict_frame(self, frame: pd.DataFrame) -> np.ndarray:
        """Each row's step (a profile's or a log's), a chunk over several prompts priced piece by
        piece where the row names them (its ``offer``) and the cost reads an offer."""
        rows = frame[["n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens"]]
        steps = [(int(n), int(c), int(d), int(p)) for n, c, d, p in rows.itertuples(index=False)]
        return np.array(predict_each(self, steps, offers_of(frame)))

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return self.predict(n_decodes, chunk_tokens, self.decode_kv_tokens, self.prefill_prefix_tokens)


def regression_features(n, c, d, p, pairs=None) -> np.ndarray:
    """Design matrix of ``RegressionCost``; every column is non-decreasing in c.

    Columns: 1, 1[n>0], n, 1[c>0], c, KV read / 1e3, (query tokens x KV read) / 1e6,
    (pairs of chunk tokens, c^2 / 2) / 1e6, (chunk tokens x prefix tokens) / 1e6, c^2 / 1e6. The seventh is
    the attention over a packed batch with a dense mask: n + c query rows against every KV token
    of the step (decodes' contexts, the chunk's prefix and itself). The eighth makes a token
    dearer in a large chunk than in a small one, as on vLLM's CPU build (about 18 us a token at
    512, 25 at 2,048), so the prefill rate c / T can peak below the largest chunk; the other
    columns are affine in c. The ninth is a later chunk's attention over its prompt's prefix, a
    column of its own so that only a profile with such chunks sets it (``profile_steps``'
    ``prefixes``): on vLLM's CPU build with AVX-512 the two pair terms came out alike (about
    14 ms per million pairs: the causal attention c x (p + c / 2)), while a pair term read from
    first chunks alone and applied to the prefix had priced later chunks far above what another
    machine's served engine ran (the simulator put tuned 512 at attainment 0.25-0.43 where the
    engine attained 0.67-1.00). With no prefix in the profile the column is all zero and left out
    of the fit (``nnls``): the other coefficients are those of the fit without it.

    The tenth, the step's chunk squared (c^2 / 1e6, however many prompts it spans), is the rise
    that is not attention: on vLLM's CPU build with AVX-512 a 2,048-token chunk of eight 256-token
    prompts cost 5.4 us a token against 4.6 at 1,024 (eight 128-token prompts), and served steps
    rose more. For a chunk of one piece it equals twice the eighth, so a fit tells them apart only
    from chunks over several prompts (``spans_prompts``); without such rows it is left out.

    ``pairs``: the eighth and ninth before scaling, (c_i^2 / 2 summed, c_i p_i summed), for chunks
    spread over several prompts (``chunk_pairs``); None: every chunk is one piece.
    """
    n = np.asarray(n, dtype=float)
    c = np.asarray(c, dtype=float)
    d = np.asarray(d, dtype=float)
    p = np.asarray(p, dtype=float)
    kv = d + np.where(c > 0, p + c, 0.0)
    columns = [np.ones_like(n), (n > 0).astype(float), n, (c > 0).astype(float), c, kv / 1e3, (n + c) * kv / 1e6]
    # c^2 / 2e6 and (c^2 / 2) / 1e6 are the same double (halving is exact): one piece prices as before
    own, with_prefix = (c * c / 2, c * p) if pairs is None else pairs
    return np.stack([*columns, own / 1e6, with_prefix / 1e6, c * c / 1e6], axis=-1)


def chunk_pairs(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the chunk's attention pairs within its pieces and with their prompts' prefixes
    (``regression_features``' ``pairs``): piece by piece where the row names the prompts (``offer``)."""
    c = frame["chunk_tokens"].to_numpy(dtype=float)
    p = frame["prefill_prefix_tokens"].to_numpy(dtype=float)
    own, with_prefix = c * c / 2, c * p
    for row, offer in enumerate(offers_of(frame)):
        if offer is not None:
            own[row], with_prefix[row] = _pairs_over_offer(int(c[row]), int(p[row]), offer)
    return own, with_prefix


REGRESSION_TERMS = (
    "base_ms",
    "decode_base_ms",
    "per_decode_ms",
    "prefill_base_ms",
    "per_chunk_token_ms",
    "per_1k_kv_ms",
    "per_query_x_1m_kv_ms",
    "per_1m_chunk_pairs_ms",
    "per_1m_prefix_pairs_ms",
    "per_1m_chunk_squared_ms",
)
CHUNK_SQUARED = REGRESSION_TERMS.index("per_1m_chunk_squared_ms")


def spans_prompts(chunk_tokens, own_pairs: np.ndarray) -> bool:
    """Whether a chunk spans several prompts (an ``offer``), given the rows' chunk tokens and their
    pairs within pieces (``chunk_pairs``' first): only then can a fit tell the chunk's square from the
    attention within its pieces."""
    c = np.asarray(chunk_tokens, dtype=float)
    return bool(np.any(own_pairs < c * c / 2))


def regression_terms_fitted(rows: pd.DataFrame) -> int:
    """How many of ``REGRESSION_TERMS`` a fit to ``rows`` has to set: all, less the prefix pairs when
    no chunk in them starts past its prompt's first token (that column is all zero), less the chunk's
    square when no chunk spans several prompts (``spans_prompts``)."""
    own, with_prefix = chunk_pairs(rows)
    spans = spans_prompts(rows["chunk_tokens"], own)
    return len(REGRESSION_TERMS) - (0 if with_prefix.any() else 1) - (0 if spans else 1)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of columns, by trying every support.

    The optimum is the unconstrained solution on its own support, so the best feasible
    support over all 2^k subsets is the answer (k = 10 here: 1,023 small solves). A column that is
    all zero (a term the data never exercises) gets 0 and is left out of every support.
    """
    k = a.shape[1]
    best, best_err = np.zeros(k), float(np.sum(b * b))
    exercised = [j for j in range(k) if np.any(a[:, j])]
    for size in range(1, len(exercised) + 1):
        for support in itertools.combinations(exercised, size):
            cols = list(support)
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.all(x >= 0):
                err = float(np.sum((a[:, cols] @ x - b) ** 2))
                if err < best_err - 1e-12:
                    best_err = err
                    best = np.zeros(k)
                    best[cols] = x
    return best


@dataclass
class RegressionCost(ContextualCost):
    """T = coefficients . regression_features(n, c, d, p), all coefficients >= 0 (monotone in c)."""

    coefficients: np.ndarray
    _offer = None  # the prompts on offer, when several (``set_offer``)
    prices_any_prefix = True  # plain arithmetic at any prefix (``fastest_chunk.at_held_positions``)

    def __post_init__(self) -> None:
        coef = np.asarray(self.coefficients, dtype=float)
        if coef.shape != (len(REGRESSION_TERMS),) or not np.all(np.isfinite(coef)) or np.any(coef < 0):
            raise ProfileError(f"RegressionCost needs {len(REGRESSION_TERMS)} finite coefficients >= 0, got {coef!r}")
        self.coefficients = coef
        self._coef = tuple(float(v) for v in coef)

    @classmethod
    def fit(cls, frame: pd.DataFrame) -> RegressionCost:
        pairs = chunk_pairs(frame)
        x = regression_features(
            frame["n_decodes"],
            frame["chunk_tokens"],
            frame["decode_kv_tokens"],
            frame["prefill_prefix_tokens"],
            pairs,
        )
        if not spans_prompts(
            frame["chunk_tokens"], pairs[0]
        ):  # one piece each: the square is the pairs' twice, left out
            x[:, CHUNK_SQUARED] = 0.0
        y = frame["step_ms"].to_numpy(dtype=float)
        # Weight rows by 1/y: minimise relative error, so short decode steps count as much as
        # long prefill steps (a 2 ms error is 40 % of a decode step but noise on a prefill).
        w = 1.0 / y
        return cls(nnls(x * w[:, None], y * w))

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        # Plain float arithmetic (the same terms as regression_features): the policy calls
        # this a dozen times per decision, and numpy's per-call overhead would dominate.
        (
            base,
            decode_base,
            per_decode,
            prefill_base,
            per_chunk_token,
            per_1k_kv,
            per_query_kv,
            per_pair,
            per_prefix_pair,
            per_chunk_squared,
        ) = self._coef
        kv = decode_kv_tokens + (prefill_prefix_tokens + chunk_tokens if chunk_tokens > 0 else 0)
        t = base + per_decode * n_decodes + per_chunk_token * chunk_tokens + per_1k_kv * kv / 1e3
        t += per_query_kv * (n_decodes + chunk_tokens) * kv / 1e6
        offer = self._offer
        if not offer or chunk_tokens <= offer[0][0] or len(offer) == 1:  # one piece
            t += (
                per_pair * chunk_tokens * chunk_tokens / 2e6
                + per_prefix_pair * chunk_tokens * prefill_prefix_tokens / 1e6
            )
        else:
            own_pairs, prefix_pairs = _pairs_over_offer(chunk_tokens, prefill_prefix_tokens, offer)
            t += per_pair * own_pairs / 1e6 + per_prefix_pair * prefix_pairs / 1e6
        if n_decodes > 0:
            t += decode_base
        if chunk_tokens > 0:
            t += prefill_base
        if per_chunk_squared:  # zero unless fitted from chunks over several prompts: the sum stays as it was
            t += per_chunk_squared * chunk_tokens * chunk_tokens / 1e6
        return t

    def set_offer(self, offered: list[tuple[int, int]] | None) -> None:
        """The prompts a chunk is taken from, FCFS, as (remaining tokens, prefix), the first being the
        one the context's prefix belongs to (``OfferAware``; None: one piece). A chunk past the first
        prompt's rest pays the pair terms piece by piece: each piece attends to its own prompt only,
        and a new prompt's piece starts at its own prefix, not the first's (priced as one piece at
        the first's prefix, a 1,536-token chunk that finishes one document and starts the next cost
        2.5 times the attention it has)."""
        self._offer = offered

    def as_dict(self) -> dict:
        return {"kind": "regression", "coefficients": dict(zip(REGRESSION_TERMS, map(float, self.coefficients)))}


def _pairs_over_offer(chunk_tokens: int, first_prefix: int, offer: list[tuple[int, int]]) -> tuple[float, float]:
    """(pairs within each piece, c_i^2 / 2 summed; pairs of each piece with its prompt's prefix, c_i p_i
    summed) of a chunk spread over ``offer`` (``offer_pieces``)."""
    own, with_prefix = 0.0, 0.0
    for piece, prefix in offer_pieces(chunk_tokens, first_prefix, offer):
        own += piece * piece / 2
        with_prefix += piece * prefix
    return own, with_prefix


def _along_axis(grid: np.ndarray, x: float, row) -> np.ndarray:
    """Interpolate rows (functions of c) along one axis; ``row(i)`` is the row at grid[i].

    Inside the grid: a convex combination of two rows. Below it: the first row. Above it:
    the last row plus (x - last) times the last segment's slope, with the slope made >= 0
    and non-decreasing in c. Every branch keeps rows that are monotone in c monotone, which
    plain linear extrapolation (a negative weight on a row) would not.
    """
    if len(grid) == 1 or x <= grid[0]:
        return row(0)
    if x >= grid[-1]:
        last, before = row(len(grid) - 1), row(len(grid) - 2)
        slope = np.maximum.accumulate(np.maximum((last - before) / (grid[-1] - grid[-2]), 0.0))
        return last + (x - grid[-1]) * slope
    i = int(np.searchsorted(grid, x, side="right") - 1)
    w = (x - grid[i]) / (grid[i + 1] - grid[i])
    return (1 - w) * row(i) + w * row(i + 1)


@dataclass
class LookupTableCost(ContextualCost):
    """Median step times on an (n, c, context) grid, multilinear in between, monotone in c and n.

    ``values[i, j, k]`` is the time at n = n_grid[i], c = c_grid[j], per-decode context
    context_grid[k]. Above the grid it extrapolates from the last segment (never clamps:
    clamping would under-predict a chunk larger than any profiled one), below it it holds
    the first value, and every case stays monotone in c (see ``_along_axis``). The
    prefill prefix is not an axis (the grid profiles fresh prompts); use the regression
    when chunks of long, partly prefilled prompts matter.
    """

    n_grid: np.ndarray
    c_grid: np.ndarray
    context_grid: np.ndarray
    values: np.ndarray
    repaired_cells: int = 0

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        context = decode_kv_tokens / n_decodes if n_decodes > 0 else 0.0
        # A decision asks for many chunk sizes at one (n, context): interpolate that row once,
        # and keep it as Python floats (numpy's per-call overhead would dominate a decision).
        cache = self.__dict__.setdefault("_rows", {})
        row = cache.get((n_decodes, context))
        if row is None:
            values = self.values
            by_n = _along_axis(
                self.n_grid,
                float(n_decodes),
                lambda i: _along_axis(self.context_grid, context, lambda k: values[i, :, k]),
            )
            if len(cache) > 4096:
                cache.clear()
            row = cache[(n_decodes, context)] = ([float(c) for c in self.c_grid], [float(v) for v in by_n])
        c_grid, by_c = row
        if len(c_grid) == 1:
            return by_c[0]
        # Along c: linear in between, and beyond the largest chunk the last (>= 0) slope.
        if chunk_tokens >= c_grid[-1]:
            slope = max((by_c[-1] - by_c[-2]) / (c_grid[-1] - c_grid[-2]), 0.0)
            return by_c[-1] + (chunk_tokens - c_grid[-1]) * slope
        if chunk_tokens <= c_grid[0]:
            return by_c[0]
        i = bisect.bisect_right(c_grid, chunk_tokens) - 1
        w = (chunk_tokens - c_grid[i]) / (c_grid[i + 1] - c_grid[i])
        return by_c[i] + w * (by_c[i + 1] - by_c[i])

    def as_dict(self) -> dict:
        return {
            "kind": "table",
            "n_grid": self.n_grid.tolist(),
            "c_grid": self.c_grid.tolist(),
            "context_grid": self.context_grid.tolist(),
            "values_ms": self.values.tolist(),
            "repaired_cells": self.repaired_cells,
        }

    @classmethod
    def fit(
        cls,
        frame: pd.DataFrame,
        monotone_tolerance: float = 0.25,
        monotone_tolerance_ms: float = 5.0,
        where: str = "profile",
    ) -> LookupTableCost:
        check_tolerances(monotone_tolerance, monotone_tolerance_ms)
        n_grid, c_grid, x_grid, values = profile_grid(frame, "median")
        holes = np.argwhere(np.isnan(values))
        if holes.size:
            i, j, k = holes[0]
            raise ProfileError(
                f"profile grid has no step at n_decodes={int(n_grid[i])}, chunk_tokens={int(c_grid[j])}, "
                f"context_tokens={int(x_grid[k])} ({len(holes)} hole(s)); the lookup table needs every grid cell "
                "(profile again, or use the regression cost)"
            )
        check_monotone_steps(frame, where, monotone_tolerance, monotone_tolerance_ms)
        # Medians are the model; noise between them (within the tolerances just checked) is
        # repaired by a running maximum along c, then along n.
        envelope = np.maximum.accumulate(np.maximum.accumulate(values, axis=1), axis=0)
        repaired = int(np.sum(envelope > values))
        return cls(n_grid, c_grid, x_grid, envelope, repaired)


def _bucket(value: int, edges: tuple[int, ...]) -> int:
    return bisect.bisect_right(edges, value) - 1  # one scalar: bisect is far cheaper than numpy


@dataclass
class ResidualMargin:
    """delta(n, c) = r[bucket(n), bucket(c)] x T(n, c), r = P99 of relative residuals y / T - 1.

    r is non-decreasing along the c buckets and >= 0, so T + delta = (1 + r) T stays
    monotone in c whenever T is. It reads T through ``cost`` (the same object the policy
    uses, context included), so a recalibrated cost carries its margin along.
    """

    cost: object
    fractions: np.ndarray  # shape (len(N_BUCKET_EDGES), len(C_BUCKET_EDGES))

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return self.margin_for(n_decodes, chunk_tokens, self.cost(n_decodes, chunk_tokens))

    def margin_for(self, n_decodes: int, chunk_tokens: int, predicted_ms: float) -> float:
        r = self.fractions[_bucket(n_decodes, N_BUCKET_EDGES), _bucket(chunk_tokens, C_BUCKET_EDGES)]
        return float(r * predicted_ms)

    def fraction(self, n_decodes: int, chunk_tokens: int) -> float:
        return float(self.fractions[_bucket(n_decodes, N_BUCKET_EDGES), _bucket(chunk_tokens, C_BUCKET_EDGES)])

    @staticmethod
    def table_from_residuals(
        n: np.ndarray, c: np.ndarray, relative: np.ndarray, quantile: float = 99.0, min_samples: int = 8
    ) -> np.ndarray:
        """P99 relative residual per bucket; thin buckets fall back to the global quantile."""
        overall = max(0.0, float(np.percentile(relative, quantile))) if relative.size else 0.0
        table = np.full((len(N_BUCKET_EDGES), len(C_BUCKET_EDGES)), overall)
        nb = np.searchsorted(N_BUCKET_EDGES, n, side="right") - 1
        cb = np.searchsorted(C_BUCKET_EDGES, c, side="right") - 1
        for i in range(len(N_BUCKET_EDGES)):
            for j in range(len(C_BUCKET_EDGES)):
                sel = relative[(nb == i) & (cb == j)]
                if sel.size >= min_samples:
                    table[i, j] = max(0.0, float(np.percentile(sel, quantile)))
        return np.maximum.accumulate(table, axis=1)


# ----------------------------------------------------------------------------- adapters


@dataclass
class FixedContextCost:
    """A fitted cost as a plain T(n, c) for the simulator, which does not track KV context.

    Each decode is assumed to hold ``context_per_decode_tokens`` of KV and chunks start
    from an empty prefix; pick the workload's mean context (prompt + half the output).
    """

    cost: ContextualCost
    context_per_decode_tokens: float

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        d = int(round(n_decodes * (self.context_per_decode_tokens + 1)))
        return self.cost.predict(n_decodes, chunk_tokens, d, 0)
