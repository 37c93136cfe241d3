"""The rule every fitted cost meets before it is used (``accept_fit``): a fit of the data it claims.

Enough distinct steps along n and c, a fit that grows along both, monotone on the whole range a
policy queries, and a held-out error stated in the report and at most ``max_holdout_error``.
``sloweave.core.costs.profile_fit`` applies it to each kind it fits.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from sloweave.core.costs.fitted import REGRESSION_TERMS, ContextualCost, RegressionCost, regression_terms_fitted
from sloweave.core.costs.protocols import CostModelError, check_monotone_in_chunk
from sloweave.core.costs.step_profiles import ProfileError
from sloweave.core.validate import Range

# What a fit must meet before it is used (``accept_fit``): its median relative error on held-out
# steps at most this (the CPU profiles here score 9-23 %; a fit off by half on steps of its own
# profile does not describe them) ...
MAX_HOLDOUT_ERROR = 0.5
# the bound a user may set on it (a relative error: 100 = 10,000 %; inf would accept any fit, NaN none)
HOLDOUT_ERROR = Range(0, 100, low_open=True)
# ... and monotone on what a policy asks: chunks up to this many tokens (or twice the largest
# profiled one), at these decode counts, the profiled ones and twice the largest (a policy asks
# past the profile; ProfileCost is checked on the same range).
QUERY_CHUNK_TOKENS = 8192
QUERY_DECODES = (0, 1, 8, 64, 256)

STEP_COLUMNS = (
    "n_decodes",
    "chunk_tokens",
    "decode_kv_tokens",
    "prefill_prefix_tokens",
)  # what makes two rows one step


def distinct_steps(rows: pd.DataFrame) -> int:
    """How many different steps ``rows`` hold: a step measured ten times is one step."""
    return int(len(rows.drop_duplicates(list(STEP_COLUMNS)))) if len(rows) else 0


def enough_steps(kind: str, fit_rows: pd.DataFrame, where: str = "profile") -> int:
    """Rule 1 of ``accept_fit``: the distinct steps a kind needs; returns how many there are."""
    found = distinct_steps(fit_rows)
    # the table: a full grid, checked as it is built
    need = regression_terms_fitted(fit_rows) if kind == "regression" else 1
    if found < need:
        raise ProfileError(
            f"{where}: {found} distinct fit step(s) in {len(fit_rows)} row(s); the {kind} fit needs at least {need} "
            "(a step measured again is the same step: repeats fit it exactly and test nothing)"
        )
    for column in ("n_decodes", "chunk_tokens"):
        values = np.unique(fit_rows[column].to_numpy())
        if len(values) < 2:
            raise ProfileError(
                f"{where}: every fit step has {column}={int(values[0])}; the {kind} fit needs two values or more "
                f"(one says nothing of how step time grows with {column}, and the policy asks for others)"
            )
    return found


def _per_decode_contexts(rows: pd.DataFrame) -> np.ndarray:
    """The profile's KV contexts per decode (five quantiles at most): where a fit is checked."""
    busy = rows[rows["n_decodes"] > 0]
    if busy.empty:
        return np.array([0.0])
    per = busy["context_tokens"] if "context_tokens" in busy.columns else busy["decode_kv_tokens"] / busy["n_decodes"]
    values = np.unique(per.to_numpy(dtype=float))
    return values if len(values) <= 5 else np.unique(np.percentile(values, [0, 25, 50, 75, 100]))


def accept_fit(
    kind: str,
    cost: ContextualCost,
    fit_rows: pd.DataFrame,
    holdout_rows: pd.DataFrame,
    where: str = "profile",
    max_holdout_error: float = MAX_HOLDOUT_ERROR,
) -> dict:
    """The rule every fitted kind meets before it is used: a fit of the data it claims.

    1. Evidence: at least as many distinct fit steps as the kind has terms, and two values or more
       of n_decodes and of chunk_tokens (``enough_steps``).
    2. Every dimension meaningful: the fit prices the largest profiled chunk above the smallest
       (at the fewest and the most decodes) and the most decodes above the fewest (at the largest
       chunk). A regression whose chunk terms are all 0 prices every chunk alike.
    3. Monotone where a policy asks, past the profile too: in c up to ``QUERY_CHUNK_TOKENS`` (or
       twice the largest profiled chunk) at ``QUERY_DECODES``, the profiled decode counts and
       twice the largest, for no context, the profiled ones and four times the largest; in n up
       to twice the largest profiled, at the profiled chunks and contexts (past the largest chunk
       a table extrapolates each decode count's own slope: monotone in c, not always in n).
    4. Its held-out error stated (median |relative error|, with how many distinct held-out steps
       the fit never saw) and at most ``max_holdout_error``.

    Returns ``{"distinct_fit_steps", "holdout"}`` (the error statistics, None without held-out
    steps); raises ProfileError naming ``where``, the kind and the rule broken.
    """
    bound = HOLDOUT_ERROR.check(max_holdout_error, "max_holdout_error")
    found = enough_steps(kind, fit_rows, where)
    contexts = _per_decode_contexts(fit_rows)
    _check_grows(kind, cost, fit_rows, contexts, where)
    _check_monotone_where_asked(kind, cost, fit_rows, contexts, where)
    holdout = _holdout_error(kind, cost, fit_rows, holdout_rows, where, bound)
    return {"distinct_fit_steps": found, "holdout": holdout}


def _at_context(cost: ContextualCost):
    """The fit as T(n, c, context): ``context`` KV tokens per decode, no prefix (how a fit is checked)."""

    def predict(n: int, c: int, context: float) -> float:
        return cost.predict(int(n), int(c), int(round(n * context)), 0)

    return predict


def _check_grows(kind: str, cost: ContextualCost, fit_rows: pd.DataFrame, contexts: np.ndarray, where: str) -> None:
    """Rule 2 of ``accept_fit``: the largest profiled chunk priced above the smallest (at the fewest
    and the most decodes), the most decodes above the fewest (at the largest chunk)."""
    predict = _at_context(cost)
    n_values, c_values = np.unique(fit_rows["n_decodes"].to_numpy()), np.unique(fit_rows["chunk_tokens"].to_numpy())
    n_lo, n_hi, c_hi = int(n_values[0]), int(n_values[-1]), int(c_values[-1])
    middle = float(np.median(contexts))

    def meaningful(axis: str, at: int, lo: int, hi: int, t_lo: float, t_hi: float) -> None:
        if t_hi > t_lo * (1 + 1e-6):  # more than rounding dust
            return
        median = fit_rows.groupby(axis)["step_ms"].median()
        other = "n_decodes" if axis == "chunk_tokens" else "chunk_tokens"
        terms = ""
        if isinstance(cost, RegressionCost):
            nonzero = [f"{name} {value:.4g}" for name, value in zip(REGRESSION_TERMS, cost.coefficients) if value > 0]
            terms = f"; its terms: {', '.join(nonzero) or 'none'} (the others 0)"
        raise ProfileError(
            f"{where}: the {kind} fit prices {axis}={hi} no higher than {axis}={lo} at {other}={at} "
            f"({t_hi:.4g} ms and {t_lo:.4g} ms){terms}, while the profile's median step takes {median.get(lo, float('nan')):.4g} ms "
            f"at {axis}={lo} and {median.get(hi, float('nan')):.4g} ms at {axis}={hi}: it does not say how step time grows with {axis}"
        )

    for n in sorted({n_lo, n_hi}):
        positive = c_values[c_values > 0]
        c_lo = int(c_values[0]) if n > 0 else int(positive[0])  # n = 0, c = 0 is no step
        if c_lo < c_hi:
            meaningful("chunk_tokens", n, c_lo, c_hi, predict(n, c_lo, middle), predict(n, c_hi, middle))
    meaningful("n_decodes", c_hi, n_lo, n_hi, predict(n_lo, c_hi, middle), predict(n_hi, c_hi, middle))


def _check_monotone_where_asked(
    kind: str, cost: ContextualCost, fit_rows: pd.DataFrame, contexts: np.ndarray, where: str
) -> None:
    """Rule 3 of ``accept_fit``: monotone in c and in n on the range a policy queries, past the profile too."""
    predict = _at_context(cost)
    n_values, c_values = np.unique(fit_rows["n_decodes"].to_numpy()), np.unique(fit_rows["chunk_tokens"].to_numpy())
    n_hi, c_hi = int(n_values[-1]), int(c_values[-1])
    top = max(QUERY_CHUNK_TOKENS, 2 * c_hi)
    profiled = np.unique(
        np.percentile(n_values, np.linspace(0, 100, 9)).round().astype(int)
    )  # a served log has hundreds
    decodes = tuple(sorted({*QUERY_DECODES, *profiled.tolist(), 2 * n_hi}))
    for context in sorted({0.0, *contexts, 4 * float(contexts.max())}):
        try:
            check_monotone_in_chunk(lambda n, c: predict(n, c, context), top, decodes)
        except CostModelError as err:
            raise ProfileError(
                f"{where}: the {kind} fit cannot be used where a policy asks ({context:g} KV tokens per decode): {err}"
            ) from None
    ns = np.unique(np.linspace(0, 2 * n_hi, 65).round().astype(int))
    chunks = np.unique(np.percentile(c_values, [0, 25, 50, 75, 100]).round().astype(int))
    for context in contexts:
        for c in chunks:
            counts = ns[ns > 0] if c == 0 else ns
            values = np.array([predict(n, c, context) for n in counts])
            drops = np.flatnonzero(np.diff(values) < -1e-9 * values[1:])  # not the last bit of interpolating equal rows
            if drops.size:
                i = int(drops[0])
                raise ProfileError(
                    f"{where}: the {kind} fit is not monotone in the decode count where a policy asks: at chunk_tokens={c}, "
                    f"{context:g} KV tokens per decode, n_decodes={int(counts[i + 1])} takes {values[i + 1]:.4g} ms but "
                    f"n_decodes={int(counts[i])} takes {values[i]:.4g} ms"
                )


def _holdout_error(
    kind: str, cost: ContextualCost, fit_rows: pd.DataFrame, holdout_rows: pd.DataFrame, where: str, bound: float
) -> dict | None:
    """Rule 4 of ``accept_fit``: the error on the held-out steps (None without any), at most ``bound``."""
    if not len(holdout_rows):
        return None
    y = holdout_rows["step_ms"].to_numpy(dtype=float)
    holdout = error_stats(y, cost.predict_frame(holdout_rows))
    seen = set(fit_rows[list(STEP_COLUMNS)].itertuples(index=False, name=None))
    held = set(holdout_rows[list(STEP_COLUMNS)].itertuples(index=False, name=None))
    holdout["distinct_steps"] = len(held)
    holdout["unseen_steps"] = len(held - seen)  # the steps that test the fit; the others repeat fitted ones
    error = holdout["median_abs_rel_error"]
    if not error <= bound:
        raise ProfileError(
            f"{where}: the {kind} fit is off by {100 * error:.0f} % (median over {len(y)} held-out steps), above the bound "
            f"of {100 * bound:.0f} % (max_holdout_error): it does not describe the steps of its own profile"
        )
    return holdout


def error_stats(y: np.ndarray, pred: np.ndarray) -> dict:
    """How far predictions ``pred`` are from the measured step times ``y`` (relative errors)."""
    rel = pred / y - 1.0
    return {
        "steps": int(y.size),
        "median_abs_rel_error": float(np.median(np.abs(rel))),
        "p90_abs_rel_error": float(np.percentile(np.abs(rel), 90)),
        "mean_rel_error": float(np.mean(rel)),
        "underpredicted_share": float(np.mean(pred < y)),
    }
