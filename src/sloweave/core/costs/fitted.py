"""Step-time profiles and the cost models fitted from them (no torch: the GPU plug-in reuses this).

A profile is a table of measured serving steps. Each row is one step of a real engine:

==========================  =====  =============================================================
column                      type   meaning
==========================  =====  =============================================================
``n_decodes``               int    running requests that decoded one token in the step (n >= 0)
``chunk_tokens``            int    prompt tokens of the one prefill chunk in the step (c >= 0)
``decode_kv_tokens``        int    KV tokens the decodes read: sum over them of (context + 1)
``prefill_prefix_tokens``   int    tokens of the chunk's prompt already in the KV cache (0 if c=0)
``step_ms``                 float  measured wall time of the step, schedule to tokens out (> 0)
``context_tokens``          int    optional: the grid's nominal per-decode context (lookup table)
``split``                   str    optional: ``fit`` (default) or ``holdout`` (scored, not fitted)
==========================  =====  =============================================================

Other columns (``repeat``, ...) are kept but ignored. Files are CSV (``.csv``) or JSON
(``.json``: ``{"format": "sloweave-profile", "version": 1, "meta": {...}, "rows": [{...}, ...]}``),
or a served engine's step log (``.jsonl``, ``sloweave.core.step_log``: the steps the engine ran,
``step_log.profile_rows``), so a profile can be taken while serving.

Three things are fitted from a profile:

(a) ``LookupTableCost``: median step time on the (n, c, context) grid, interpolated
    multilinearly and made monotone in c and n (running maximum along c, then n). Small drops
    along either are timing noise and are repaired; a drop of the fastest repeat above
    ``monotone_tolerance`` (relative) and ``monotone_tolerance_ms`` is an error, in any fitted
    step (``check_monotone_steps``, run before a random hold-out is drawn: neither it nor the
    hole it leaves in the grid hides a drop).
(b) ``RegressionCost``: non-negative least squares on terms that each grow with c, so the
    model is monotone in c by construction. The context terms matter on engines whose
    attention reads the whole packed batch (transformers on CPU: cost ~ query x KV tokens).
(c) ``ResidualMargin``: delta(n, c) = r(n, c) x T(n, c), with r the P99 of out-of-fold relative
    residuals per (n, c) bucket, non-decreasing along c so T + delta stays monotone.

A fitted cost predicts ``predict(n, c, decode_kv_tokens, prefill_prefix_tokens)``; the policy
interface T(n, c) reads the context from ``set_context`` (a ``ContextFeed`` sets it before each
decision), see ``ContextualCost``.

Every kind is used only after ``accept_fit``: enough distinct steps along n and c, a fit that
grows along both, monotone on the whole range a policy queries, and a held-out error stated in
the report and at most ``max_holdout_error``. A kind that fails is refused with the reason in
the report (``table_error``, ``notes``); the regression failing refuses the profile.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.atomic import atomic_path, write_text_atomic
from sloweave.core.cells import numbers, show
from sloweave.core.csv_shape import check_csv_shape, located
from sloweave.core.step_log import StepLogError, profile_rows, read_step_log
from sloweave.core.costs.protocols import CostModelError, check_monotone_in_chunk
from sloweave.core.validate import (
    DURATION_MS,
    MAX_MS,
    MAX_TOKENS,
    TOKEN_COUNT,
    RepeatedKeyError,
    Range,
    finite_number,
    non_negative_number,
    one_value_per_key,
)

PROFILE_FORMAT = "sloweave-profile"
STEP_LOG_SUFFIX = ".jsonl"  # a served engine's step log (sloweave.core.step_log), read as a profile
PROFILE_VERSION = 1
REQUIRED_COLUMNS = ("n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens", "step_ms")
INT_COLUMNS = ("n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens", "context_tokens")
# Bucket edges of the margin table (lower edges; the last bucket is open).
N_BUCKET_EDGES = (0, 1, 4, 16, 64)
C_BUCKET_EDGES = (0, 1, 64, 256, 1024)
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


class ProfileError(ValueError):
    """A profile that cannot be fitted: missing columns, bad values, a hole in the grid, non-monotone."""


# ----------------------------------------------------------------------------- profile I/O


def read_profile(path: str | Path) -> pd.DataFrame:
    """Load and validate a profile (CSV, JSON, or a served engine's ``.jsonl`` step log).
    Raises ProfileError with the reason."""
    path = Path(path)
    if not path.exists():
        raise ProfileError(f"profile {path} does not exist")
    if path.suffix.lower() == STEP_LOG_SUFFIX:
        try:
            return validate_profile(profile_rows(read_step_log(path)), str(path))
        except StepLogError as err:
            raise ProfileError(f"profile {err}") from None
    lines = None  # the file line of each row (CSV only)
    try:
        if path.suffix.lower() == ".json":
            doc = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=one_value_per_key)
            if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
                raise ProfileError(f"profile {path}: JSON must be an object with format={PROFILE_FORMAT!r}")
            version = doc.get("version")
            if isinstance(version, bool) or version != PROFILE_VERSION:  # true == 1 in Python, not a version
                raise ProfileError(f"profile {path}: unsupported version {version!r} (expected {PROFILE_VERSION})")
            frame = pd.DataFrame(_json_rows(path, doc.get("rows", [])))
        else:
            lines = check_csv_shape(
                path, lambda line, problem: ProfileError(f"profile {located(path, line)}: {problem}")
            )
            frame = pd.read_csv(path, index_col=False)
    except ProfileError:
        raise
    except RepeatedKeyError as err:
        raise ProfileError(f"profile {path}: {err}") from None
    except RecursionError:  # JSON nested a few thousand deep
        raise ProfileError(f"profile {path} cannot be parsed: JSON nested too deeply") from None
    except (ValueError, OSError, pd.errors.ParserError) as err:
        raise ProfileError(f"profile {path} cannot be parsed: {err}") from None
    return validate_profile(frame, str(path), lines)


def _json_rows(path: Path, rows) -> list[dict]:
    """A JSON profile's rows: a list of objects (pandas would read a dict as columns, or fail)."""
    if not isinstance(rows, list):
        raise ProfileError(f"{path}: rows must be a list of objects (one per step), got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ProfileError(f"{path}: rows[{i}] is {row!r}, not an object (one per step)")
    return rows


def write_profile(frame: pd.DataFrame, path: str | Path, meta: dict | None = None) -> Path:
    """Write a profile as CSV (with ``<name>.meta.json`` beside it when meta is given) or JSON.

    Each file is written beside its name and renamed into place: whole or not at all."""
    path = Path(path)
    frame = validate_profile(frame, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        doc = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "meta": meta or {},
            "rows": frame.to_dict("records"),
        }
        write_text_atomic(path, json.dumps(doc, indent=1))
    else:
        if meta:  # the meta file first: a profile is never there without the meta it was written with
            write_text_atomic(path.with_suffix(".meta.json"), json.dumps(meta, indent=2))
        with atomic_path(path) as temporary:
            frame.to_csv(temporary, index=False)
    return path


def validate_profile(frame: pd.DataFrame, where: str = "profile", lines: list[int] | None = None) -> pd.DataFrame:
    """Check columns and values; return a clean copy with integer columns as int64.

    ``lines``: the file line of each row (a CSV file's), so a bad row is named by its line;
    without it, by its position in the table ("row 3", from 0)."""

    def at(row: int) -> str:
        return f"{located(where, lines[row])}: " if lines is not None else f"{where}: row {row}: "

    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise ProfileError(f"{where}: missing column(s) {', '.join(missing)} (required: {', '.join(REQUIRED_COLUMNS)})")
    if len(frame) == 0:
        raise ProfileError(f"{where}: no rows")
    frame = frame.copy()
    for column in INT_COLUMNS:
        if column not in frame.columns:
            continue
        values = numbers(frame[column])
        # past MAX_TOKENS a count is no step a machine ran (1e13 tokens), and past 2**63 it would wrap
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0) | (values != np.round(values)) | (values > MAX_TOKENS))
        if bad.size:
            raise ProfileError(
                f"{at(bad[0])}{column}={show(frame[column].iloc[bad[0]])}; expected {TOKEN_COUNT.describe()}"
            )
        frame[column] = values.astype(np.int64)
    step = numbers(frame["step_ms"])
    bad = np.flatnonzero(~np.isfinite(step) | (step <= 0) | (step > MAX_MS))
    if bad.size:
        raise ProfileError(
            f"{at(bad[0])}step_ms={show(frame['step_ms'].iloc[bad[0]])}; expected {DURATION_MS.describe()}"
        )
    frame["step_ms"] = step
    empty = np.flatnonzero((frame["n_decodes"].to_numpy() == 0) & (frame["chunk_tokens"].to_numpy() == 0))
    if empty.size:
        raise ProfileError(f"{at(empty[0])}an empty step (n_decodes=0 and chunk_tokens=0)")
    if "split" in frame.columns:
        # as objects first: an all-empty split column reads as floats, which a future pandas won't fill with text
        split = frame["split"].astype(object).fillna("fit").astype(str)
        unknown = np.flatnonzero(~split.isin(["fit", "holdout"]).to_numpy())
        if unknown.size:
            raise ProfileError(
                f"{at(unknown[0])}unknown split value {split.iloc[unknown[0]]!r}; use 'fit' or 'holdout'"
            )
        frame["split"] = split
    else:
        frame["split"] = "fit"
    return frame


# ----------------------------------------------------------------------------- cost models


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
        return np.array(
            [
                self.predict(int(n), int(c), int(d), int(p))
                for n, c, d, p in frame[
                    ["n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens"]
                ].itertuples(index=False)
            ]
        )

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return self.predict(n_decodes, chunk_tokens, self.decode_kv_tokens, self.prefill_prefix_tokens)


def regression_features(n, c, d, p) -> np.ndarray:
    """Design matrix of ``RegressionCost``; every column is non-decreasing in c.

    Columns: 1, 1[n>0], n, 1[c>0], c, KV read / 1e3, (query tokens x KV read) / 1e6.
    The last is the attention over a packed batch with a dense mask: n + c query rows
    against every KV token of the step (decodes' contexts, the chunk's prefix and itself).
    """
    n = np.asarray(n, dtype=float)
    c = np.asarray(c, dtype=float)
    d = np.asarray(d, dtype=float)
    p = np.asarray(p, dtype=float)
    kv = d + np.where(c > 0, p + c, 0.0)
    return np.stack(
        [np.ones_like(n), (n > 0).astype(float), n, (c > 0).astype(float), c, kv / 1e3, (n + c) * kv / 1e6], axis=-1
    )


REGRESSION_TERMS = (
    "base_ms",
    "decode_base_ms",
    "per_decode_ms",
    "prefill_base_ms",
    "per_chunk_token_ms",
    "per_1k_kv_ms",
    "per_query_x_1m_kv_ms",
)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of columns, by trying every support.

    The optimum is the unconstrained solution on its own support, so the best feasible
    support over all 2^k subsets is the answer (k = 7 here: 127 small solves).
    """
    k = a.shape[1]
    best, best_err = np.zeros(k), float(np.sum(b * b))
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
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

    def __post_init__(self) -> None:
        coef = np.asarray(self.coefficients, dtype=float)
        if coef.shape != (len(REGRESSION_TERMS),) or not np.all(np.isfinite(coef)) or np.any(coef < 0):
            raise ProfileError(f"RegressionCost needs {len(REGRESSION_TERMS)} finite coefficients >= 0, got {coef!r}")
        self.coefficients = coef
        self._coef = tuple(float(v) for v in coef)

    @classmethod
    def fit(cls, frame: pd.DataFrame) -> RegressionCost:
        x = regression_features(
            frame["n_decodes"], frame["chunk_tokens"], frame["decode_kv_tokens"], frame["prefill_prefix_tokens"]
        )
        y = frame["step_ms"].to_numpy(dtype=float)
        # Weight rows by 1/y: minimise relative error, so short decode steps count as much as
        # long prefill steps (a 2 ms error is 40 % of a decode step but noise on a prefill).
        w = 1.0 / y
        return cls(nnls(x * w[:, None], y * w))

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        # Plain float arithmetic (the same terms as regression_features): the policy calls
        # this a dozen times per decision, and numpy's per-call overhead would dominate.
        base, decode_base, per_decode, prefill_base, per_chunk_token, per_1k_kv, per_query_kv = self._coef
        kv = decode_kv_tokens + (prefill_prefix_tokens + chunk_tokens if chunk_tokens > 0 else 0)
        t = base + per_decode * n_decodes + per_chunk_token * chunk_tokens + per_1k_kv * kv / 1e3
        t += per_query_kv * (n_decodes + chunk_tokens) * kv / 1e6
        if n_decodes > 0:
            t += decode_base
        if chunk_tokens > 0:
            t += prefill_base
        return t

    def as_dict(self) -> dict:
        return {"kind": "regression", "coefficients": dict(zip(REGRESSION_TERMS, map(float, self.coefficients)))}


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


def profile_grid(frame: pd.DataFrame, statistic: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The steps on the (n, c, context_tokens) grid: ``statistic`` ("median", "min") of each cell's
    step times, NaN where the profile has none; with the grid's n, c and context values.

    Without ``context_tokens`` every step is at context 0; the prefill prefix is no axis (the
    grid profiles fresh prompts).
    """
    if "context_tokens" not in frame.columns:
        frame = frame.assign(context_tokens=0)
    n_grid = np.array(sorted(frame["n_decodes"].unique()), dtype=float)
    c_grid = np.array(sorted(frame["chunk_tokens"].unique()), dtype=float)
    x_grid = np.array(sorted(frame["context_tokens"].unique()), dtype=float)
    grid = np.full((len(n_grid), len(c_grid), len(x_grid)), np.nan)
    cells = frame.groupby(["n_decodes", "chunk_tokens", "context_tokens"])["step_ms"].agg(statistic)
    for (n, c, x), v in cells.items():
        grid[np.searchsorted(n_grid, n), np.searchsorted(c_grid, c), np.searchsorted(x_grid, x)] = v
    # A step without decodes reads no context (and is predicted for none): its cells pool every
    # context, the same row at each.
    if n_grid[0] == 0:
        for c, v in frame[frame["n_decodes"] == 0].groupby("chunk_tokens")["step_ms"].agg(statistic).items():
            grid[0, np.searchsorted(c_grid, c), :] = v
    # n = 0, c = 0 is not a step, but steps near it (fewer decodes than the smallest profiled
    # count, a chunk smaller than the smallest) are interpolated from it: the smaller of its two
    # neighbours keeps both directions monotone.
    if n_grid[0] == 0 and c_grid[0] == 0 and len(c_grid) > 1:
        corner = grid[0, 1, :] if len(n_grid) == 1 else np.fmin(grid[0, 1, :], grid[1, 0, :])
        grid[0, 0, :] = np.where(np.isnan(grid[0, 0, :]), corner, grid[0, 0, :])
    return n_grid, c_grid, x_grid, grid


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
        r = self.fractions[_bucket(n_decodes, N_BUCKET_EDGES), _bucket(chunk_tokens, C_BUCKET_EDGES)]
        return float(r * self.cost(n_decodes, chunk_tokens))

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


# ----------------------------------------------------------------------------- acceptance

STEP_COLUMNS = (
    "n_decodes",
    "chunk_tokens",
    "decode_kv_tokens",
    "prefill_prefix_tokens",
)  # what makes two rows one step


def check_tolerances(monotone_tolerance, monotone_tolerance_ms) -> tuple[float, float]:
    """Both finite and >= 0, the relative one below 1: a NaN tolerance compares false with every
    drop, and no drop exceeds 100 %, so either switched the check off."""
    relative = non_negative_number(monotone_tolerance, "monotone_tolerance")
    if relative >= 1:
        raise ValueError(
            f"monotone_tolerance must be below 1 (a share of the step time; no drop is larger), got {monotone_tolerance!r}"
        )
    return relative, non_negative_number(monotone_tolerance_ms, "monotone_tolerance_ms")


def check_monotone_steps(
    frame: pd.DataFrame, where: str = "profile", monotone_tolerance: float = 0.25, monotone_tolerance_ms: float = 5.0
) -> bool:
    """Refuse a grid profile whose step time drops, beyond both tolerances, where the chunk or the
    decode count grows; False (nothing compared) when the steps are not a full grid.

    The steps are compared on the grid the lookup table is built on (``profile_grid``): each cell
    differs from its neighbour in one count only. Steps that are no full grid (a served engine's
    log) differ in several at once (contexts, prefixes), and are left to ``accept_fit``.

    Each cell is judged on its fastest repeat: contention only ever adds time, so a spike cannot
    fake a drop there, while an engine that is really faster at a larger count (or a corrupted
    file) still shows one; and only a drop large both relatively and in ms is an error: on a
    shared CPU one time slice (a few ms) can land on every repeat of a 2 ms step.
    """
    tolerance, tolerance_ms = check_tolerances(monotone_tolerance, monotone_tolerance_ms)
    if frame.empty:
        return False
    n_grid, c_grid, x_grid, fastest = profile_grid(frame, "min")
    if np.isnan(fastest).any():
        return False
    for axis, what, fewer, name, values in (
        (1, "chunk size", "smaller", "chunk_tokens", c_grid),
        (0, "decode count", "fewer", "n_decodes", n_grid),
    ):
        peak = np.maximum.accumulate(fastest, axis=axis)
        broken = (peak - fastest > tolerance * peak) & (peak - fastest > tolerance_ms)
        if not broken.any():
            continue
        # the first row (along the other count, then the context) with a drop, and there its largest one
        rows = np.moveaxis(broken, axis, -1)
        i, k = (int(v) for v in np.argwhere(rows.any(axis=-1))[0])
        best = np.moveaxis(fastest, axis, -1)[i, k]
        top = np.maximum.accumulate(best)
        j = int(np.argmax(np.where(rows[i, k], (top - best) / top, -1.0)))
        j_peak = int(np.argmax(best[: j + 1]))
        other = f"chunk_tokens={int(c_grid[i])}" if axis == 0 else f"n_decodes={int(n_grid[i])}"
        raise ProfileError(
            f"{where} is not monotone in the {what}: at {other}, context_tokens={int(x_grid[k])}: {name}={int(values[j])} takes "
            f"{best[j]:.3f} ms (fastest repeat) but the {fewer} {name}={int(values[j_peak])} takes at least {top[j]:.3f} ms "
            f"({100 * (top[j] - best[j]) / top[j]:.0f} % drop > tolerance {100 * tolerance:.0f} %, and {top[j] - best[j]:.3f} ms > "
            f"{tolerance_ms:g} ms); the profile is corrupt, or the engine is not monotone there: profile again"
        )
    return True


def distinct_steps(rows: pd.DataFrame) -> int:
    """How many different steps ``rows`` hold: a step measured ten times is one step."""
    return int(len(rows.drop_duplicates(list(STEP_COLUMNS)))) if len(rows) else 0


def enough_steps(kind: str, fit_rows: pd.DataFrame, where: str = "profile") -> int:
    """Rule 1 of ``accept_fit``: the distinct steps a kind needs; returns how many there are."""
    found = distinct_steps(fit_rows)
    need = len(REGRESSION_TERMS) if kind == "regression" else 1  # the table: a full grid, checked as it is built
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

    def predict(n: int, c: int, context: float) -> float:
        return cost.predict(int(n), int(c), int(round(n * context)), 0)

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

    holdout = None
    if len(holdout_rows):
        y = holdout_rows["step_ms"].to_numpy(dtype=float)
        holdout = _error_stats(y, cost.predict_frame(holdout_rows))
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
    return {"distinct_fit_steps": found, "holdout": holdout}


# ----------------------------------------------------------------------------- fitting


@dataclass
class FitResult:
    """What ``fit_profile`` produced: both costs, the margin table and held-out scores."""

    regression: RegressionCost
    table: LookupTableCost | None
    margin_fractions: np.ndarray
    report: dict = field(default_factory=dict)

    def cost(self, kind: str = "regression") -> ContextualCost:
        if kind == "regression":
            return self.regression
        if kind == "table":
            if self.table is None:
                raise ProfileError(
                    f"no lookup table could be built from this profile: {self.report.get('table_error')}"
                )
            return self.table
        raise ValueError(f"unknown cost model {kind!r}: choose 'regression' or 'table'")

    def margin(self, cost) -> ResidualMargin:
        return ResidualMargin(cost, self.margin_fractions.copy())

    def as_dict(self) -> dict:
        return {
            "regression": self.regression.as_dict(),
            "table": None if self.table is None else self.table.as_dict(),
            "margin": {
                "kind": "relative P99 residual per bucket",
                "n_bucket_lower_edges": list(N_BUCKET_EDGES),
                "c_bucket_lower_edges": list(C_BUCKET_EDGES),
                "fractions": self.margin_fractions.tolist(),
            },
            "report": self.report,
        }


def _error_stats(y: np.ndarray, pred: np.ndarray) -> dict:
    rel = pred / y - 1.0
    return {
        "steps": int(y.size),
        "median_abs_rel_error": float(np.median(np.abs(rel))),
        "p90_abs_rel_error": float(np.percentile(np.abs(rel), 90)),
        "mean_rel_error": float(np.mean(rel)),
        "underpredicted_share": float(np.mean(pred < y)),
    }


def fit_profile(
    frame: pd.DataFrame,
    seed: int = 0,
    holdout_share: float = 0.2,
    folds: int = 5,
    margin_quantile: float = 99.0,
    monotone_tolerance: float = 0.25,
    monotone_tolerance_ms: float = 5.0,
    max_holdout_error: float = MAX_HOLDOUT_ERROR,
    where: str = "profile",
) -> FitResult:
    """Fit the regression, the lookup table and the residual margin; score them on held-out steps.

    Held-out steps are the rows marked ``split=holdout`` (the profiler measures off-grid
    points there), or else a seeded random ``holdout_share`` of the rows (one at least). The
    margin comes from out-of-fold residuals of the fit rows (in-sample residuals would
    understate it). The steps on the grid of the fitted ones, held out or not, are checked
    monotone first (``check_monotone_steps``), and each kind passes ``accept_fit``: the regression failing
    refuses the profile, the table failing is said in ``table_error`` and ``notes``.
    ``where`` names the profile in messages (``fit_profile_file``: the file).
    """
    monotone_tolerance, monotone_tolerance_ms = check_tolerances(monotone_tolerance, monotone_tolerance_ms)
    max_holdout_error = HOLDOUT_ERROR.check(max_holdout_error, "max_holdout_error")
    if not 0 <= finite_number(holdout_share, "holdout_share", positive=False) < 1:
        raise ValueError(f"holdout_share must be in [0, 1), got {holdout_share!r}")
    frame = validate_profile(frame, where)
    # Every step on the grid of the fitted ones, held out or not, before the random split: a drop
    # in a step held out, or in a cell a hold-out leaves empty, is a drop. The profiler's held-out
    # steps are off the grid (other chunks, a prefix): scored, not compared.
    fitted = frame[frame["split"] != "holdout"]
    grid_columns = [
        c for c in ("n_decodes", "chunk_tokens", "context_tokens", "prefill_prefix_tokens") if c in frame.columns
    ]
    on_grid = np.logical_and.reduce([frame[c].isin(fitted[c].unique()).to_numpy() for c in grid_columns])
    compared = check_monotone_steps(frame[on_grid], where, monotone_tolerance, monotone_tolerance_ms)
    rng = np.random.default_rng(seed)
    if (frame["split"] == "holdout").any():
        fit_rows, holdout_rows = frame[frame["split"] == "fit"], frame[frame["split"] == "holdout"]
    else:
        mask = rng.random(len(frame)) < holdout_share
        if holdout_share > 0 and not mask.any() and len(frame) > 1:
            mask[rng.integers(len(frame))] = True  # a share asked for is never silently none
        fit_rows, holdout_rows = frame[~mask], frame[mask]
    enough_steps("regression", fit_rows, where)

    regression = RegressionCost.fit(fit_rows)
    accepted = {"regression": accept_fit("regression", regression, fit_rows, holdout_rows, where, max_holdout_error)}
    table, table_error = None, None
    try:
        table = LookupTableCost.fit(fit_rows, monotone_tolerance, monotone_tolerance_ms, where)
    except ProfileError as err:
        # A non-monotone grid is a broken profile whatever model is used: fail loudly.
        if "not monotone" in str(err):
            raise
        table_error = str(err)
    if table is not None:
        try:
            # "profile", not the file: table_error is read beside the file's name (FitResult.cost
            # through resolve_cost, the commands' notes)
            accepted["table"] = accept_fit("table", table, fit_rows, holdout_rows, "profile", max_holdout_error)
        except ProfileError as err:
            table, table_error = None, str(err)

    # Out-of-fold residuals of the regression for the margin.
    fold = rng.integers(0, folds, len(fit_rows))
    oof = np.empty(len(fit_rows))
    for f in range(folds):
        train, test = fit_rows[fold != f], fit_rows[fold == f]
        if len(test) == 0:
            continue
        model = RegressionCost.fit(train) if len(train) >= len(REGRESSION_TERMS) else regression
        oof[fold == f] = model.predict_frame(test)
    y_fit = fit_rows["step_ms"].to_numpy()
    relative = y_fit / oof - 1.0
    fractions = ResidualMargin.table_from_residuals(
        fit_rows["n_decodes"].to_numpy(), fit_rows["chunk_tokens"].to_numpy(), relative, margin_quantile
    )

    report: dict = {
        "fit_steps": int(len(fit_rows)),
        "holdout_steps": int(len(holdout_rows)),
        "holdout_source": "split column" if (frame["split"] == "holdout").any() else f"random {holdout_share:.0%}",
        "margin_quantile": margin_quantile,
        "table_error": table_error,
        # what accept_fit found: the kinds that may be used, on how many distinct steps, and the bound
        "accepted_kinds": list(accepted),
        "fit_distinct_steps": accepted["regression"]["distinct_fit_steps"],
        "max_holdout_error": max_holdout_error,
        "holdout_error_measure": "median |predicted / measured - 1| over the held-out steps",
        "notes": [],
    }
    if not compared:
        report["notes"].append(
            "the fitted steps are no full (n, c, context) grid: they are not compared with each other for monotonicity, "
            "the fit is (accept_fit)"
        )
    if table is None:
        report["notes"].append(f"no lookup table ({table_error}); only the regression can be used")
    holdout = accepted["regression"]["holdout"]
    if holdout is None:
        report["notes"].append("no held-out steps: the fit's error on steps it did not see is not measured")
    elif holdout["unseen_steps"] == 0:
        report["notes"].append(
            "every held-out step repeats a fitted step: the held-out error measures timing noise, not steps the fit has not seen"
        )
    if len(holdout_rows):
        y = holdout_rows["step_ms"].to_numpy()
        pred = regression.predict_frame(holdout_rows)
        report["regression_holdout"] = holdout
        margin = ResidualMargin(regression, fractions)
        delta = (
            np.array(
                [
                    margin.fraction(int(n), int(c))
                    for n, c in holdout_rows[["n_decodes", "chunk_tokens"]].itertuples(index=False)
                ]
            )
            * pred
        )
        report["regression_holdout"]["covered_by_margin_share"] = float(np.mean(y <= pred + delta))
        # The same model without its context terms, to show what they buy.
        no_ctx = RegressionCost.fit(fit_rows.assign(decode_kv_tokens=0, prefill_prefix_tokens=0))
        pred_no_ctx = no_ctx.predict_frame(holdout_rows.assign(decode_kv_tokens=0, prefill_prefix_tokens=0))
        report["regression_without_context_holdout"] = _error_stats(y, pred_no_ctx)
        if table is not None:
            report["table_holdout"] = accepted["table"]["holdout"]
    return FitResult(regression, table, fractions, report)


def fit_profile_file(path: str | Path, **kwargs) -> FitResult:
    kwargs.setdefault("where", f"profile {path}")
    return fit_profile(read_profile(path), **kwargs)


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
