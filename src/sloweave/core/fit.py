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
    multilinearly and made monotone in c (running maximum along c). Small drops along c are
    timing noise and are repaired; a drop of the fastest repeat above ``monotone_tolerance``
    (relative) and ``monotone_tolerance_ms`` is an error.
(b) ``RegressionCost``: non-negative least squares on terms that each grow with c, so the
    model is monotone in c by construction. The context terms matter on engines whose
    attention reads the whole packed batch (transformers on CPU: cost ~ query x KV tokens).
(c) ``ResidualMargin``: delta(n, c) = r(n, c) x T(n, c), with r the P99 of out-of-fold relative
    residuals per (n, c) bucket, non-decreasing along c so T + delta stays monotone.

A fitted cost predicts ``predict(n, c, decode_kv_tokens, prefill_prefix_tokens)``; the policy
interface T(n, c) reads the context from ``set_context`` (the runtime sets it before each
decision), see ``ContextualCost``.
"""

from __future__ import annotations

import bisect
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.csv_shape import check_csv_shape, located
from sloweave.core.step_log import StepLogError, profile_rows, read_step_log
from sloweave.core.validate import RepeatedKeyError, one_value_per_key

PROFILE_FORMAT = "sloweave-profile"
STEP_LOG_SUFFIX = ".jsonl"  # a served engine's step log (sloweave.core.step_log), read as a profile
PROFILE_VERSION = 1
REQUIRED_COLUMNS = ("n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens", "step_ms")
INT_COLUMNS = ("n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens", "context_tokens")
# Bucket edges of the margin table (lower edges; the last bucket is open).
N_BUCKET_EDGES = (0, 1, 4, 16, 64)
C_BUCKET_EDGES = (0, 1, 64, 256, 1024)


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
            lines = check_csv_shape(path, lambda line, problem: ProfileError(f"profile {located(path, line)}: {problem}"))
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
    """Write a profile as CSV (with ``<name>.meta.json`` beside it when meta is given) or JSON."""
    path = Path(path)
    frame = validate_profile(frame, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        doc = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "meta": meta or {}, "rows": frame.to_dict("records")}
        path.write_text(json.dumps(doc, indent=1))
    else:
        frame.to_csv(path, index=False)
        if meta:
            path.with_suffix(".meta.json").write_text(json.dumps(meta, indent=2))
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
        values = _numbers(frame[column])
        # at 2**63 and beyond a count no longer fits the int64 it is stored in (it would wrap)
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0) | (values != np.round(values)) | (values >= 2.0**63))
        if bad.size:
            raise ProfileError(f"{at(bad[0])}{column}={_show(frame[column].iloc[bad[0]])}; expected a whole number >= 0")
        frame[column] = values.astype(np.int64)
    step = _numbers(frame["step_ms"])
    bad = np.flatnonzero(~np.isfinite(step) | (step <= 0))
    if bad.size:
        raise ProfileError(f"{at(bad[0])}step_ms={_show(frame['step_ms'].iloc[bad[0]])}; expected a time > 0 ms")
    frame["step_ms"] = step
    empty = np.flatnonzero((frame["n_decodes"].to_numpy() == 0) & (frame["chunk_tokens"].to_numpy() == 0))
    if empty.size:
        raise ProfileError(f"{at(empty[0])}an empty step (n_decodes=0 and chunk_tokens=0)")
    if "split" in frame.columns:
        # as objects first: an all-empty split column reads as floats, which a future pandas won't fill with text
        split = frame["split"].astype(object).fillna("fit").astype(str)
        unknown = np.flatnonzero(~split.isin(["fit", "holdout"]).to_numpy())
        if unknown.size:
            raise ProfileError(f"{at(unknown[0])}unknown split value {split.iloc[unknown[0]]!r}; use 'fit' or 'holdout'")
        frame["split"] = split
    else:
        frame["split"] = "fit"
    return frame


def _numbers(column: pd.Series) -> np.ndarray:
    """A column as floats, NaN where a cell is no number. A boolean is none: pandas reads a
    column of True/False (or JSON true/false) as booleans, which would count as 1 and 0. Nor
    is an integer past the largest float (10**400 in JSON), on which pandas raises OverflowError."""
    cells = column.map(lambda v: np.nan if isinstance(v, (bool, np.bool_)) or (isinstance(v, int) and abs(v) > sys.float_info.max) else v)
    return pd.to_numeric(cells, errors="coerce").to_numpy(dtype=float, copy=True)


def _show(value) -> str:
    """A cell as the user wrote it (numpy scalars print as plain numbers)."""
    return repr(value.item() if isinstance(value, np.generic) else value)


# ----------------------------------------------------------------------------- cost models


class ContextualCost:
    """Base of fitted costs: ``predict`` with explicit context, ``__call__(n, c)`` with the set one.

    The policy only speaks T(n, c); the runtime calls ``set_context`` before each decision
    with the KV context of the step being decided, so the same policy object stays valid.
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
                for n, c, d, p in frame[["n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens"]].itertuples(index=False)
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
    return np.stack([np.ones_like(n), (n > 0).astype(float), n, (c > 0).astype(float), c, kv / 1e3, (n + c) * kv / 1e6], axis=-1)


REGRESSION_TERMS = ("base_ms", "decode_base_ms", "per_decode_ms", "prefill_base_ms", "per_chunk_token_ms", "per_1k_kv_ms", "per_query_x_1m_kv_ms")


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
        x = regression_features(frame["n_decodes"], frame["chunk_tokens"], frame["decode_kv_tokens"], frame["prefill_prefix_tokens"])
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
    """Median step times on an (n, c, context) grid, multilinear in between, monotone in c.

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
                self.n_grid, float(n_decodes), lambda i: _along_axis(self.context_grid, context, lambda k: values[i, :, k])
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
    def fit(cls, frame: pd.DataFrame, monotone_tolerance: float = 0.25, monotone_tolerance_ms: float = 5.0) -> LookupTableCost:
        if "context_tokens" not in frame.columns:
            frame = frame.assign(context_tokens=0)
        groups = frame.groupby(["n_decodes", "chunk_tokens", "context_tokens"])["step_ms"]
        n_grid = np.array(sorted(frame["n_decodes"].unique()), dtype=float)
        c_grid = np.array(sorted(frame["chunk_tokens"].unique()), dtype=float)
        x_grid = np.array(sorted(frame["context_tokens"].unique()), dtype=float)

        def to_grid(cells: pd.Series) -> np.ndarray:
            grid = np.full((len(n_grid), len(c_grid), len(x_grid)), np.nan)
            for (n, c, x), v in cells.items():
                grid[np.searchsorted(n_grid, n), np.searchsorted(c_grid, c), np.searchsorted(x_grid, x)] = v
            # n = 0, c = 0 is not a step; give it the n = 0 row's value at the smallest chunk
            # so the grid is full (never queried: the policy never asks for an empty step).
            if n_grid[0] == 0 and c_grid[0] == 0 and len(c_grid) > 1:
                grid[0, 0, :] = np.where(np.isnan(grid[0, 0, :]), grid[0, 1, :], grid[0, 0, :])
            return grid

        values, fastest = to_grid(groups.median()), to_grid(groups.min())
        holes = np.argwhere(np.isnan(values))
        if holes.size:
            i, j, k = holes[0]
            raise ProfileError(
                f"profile grid has no step at n_decodes={int(n_grid[i])}, chunk_tokens={int(c_grid[j])}, "
                f"context_tokens={int(x_grid[k])} ({len(holes)} hole(s)); the lookup table needs every grid cell "
                "(profile again, or use the regression cost)"
            )
        repaired = 0
        for i in range(len(n_grid)):
            for k in range(len(x_grid)):
                # Monotonicity is judged on each cell's fastest repeat: contention only ever
                # adds time, so a spike cannot fake a drop there, while an engine that is
                # really faster at a larger chunk (or a corrupted file) still shows one.
                best = fastest[i, :, k]
                peak = np.maximum.accumulate(best)
                drop = (peak - best) / peak
                # ... and only when it is large both relatively and absolutely: on a shared
                # CPU one time slice (a few ms) can land on every repeat of a 2 ms step.
                broken = (drop > monotone_tolerance) & (peak - best > monotone_tolerance_ms)
                if np.any(broken):
                    j = int(np.argmax(np.where(broken, drop, 0.0)))
                    j_peak = int(np.argmax(best[: j + 1]))
                    raise ProfileError(
                        "profile is not monotone in the chunk size: at "
                        f"n_decodes={int(n_grid[i])}, context_tokens={int(x_grid[k])}: chunk_tokens={int(c_grid[j])} takes "
                        f"{best[j]:.3f} ms (fastest repeat) but the smaller chunk_tokens={int(c_grid[j_peak])} takes at least "
                        f"{best[j_peak]:.3f} ms ({100 * drop[j]:.0f} % drop > tolerance {100 * monotone_tolerance:.0f} %); "
                        "the profile is corrupt, or the engine is not monotone there: profile again"
                    )
                # Medians are the model; noise between them is repaired by a running maximum.
                row = values[i, :, k]
                envelope = np.maximum.accumulate(row)
                repaired += int(np.sum(envelope > row))
                values[i, :, k] = envelope
        return cls(n_grid, c_grid, x_grid, values, repaired)


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
    def table_from_residuals(n: np.ndarray, c: np.ndarray, relative: np.ndarray, quantile: float = 99.0, min_samples: int = 8) -> np.ndarray:
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
                raise ProfileError(f"no lookup table could be built from this profile: {self.report.get('table_error')}")
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
) -> FitResult:
    """Fit the regression, the lookup table and the residual margin; score them on held-out steps.

    Held-out steps are the rows marked ``split=holdout`` (the profiler measures off-grid
    points there), or else a seeded random ``holdout_share`` of the rows. The margin comes
    from out-of-fold residuals of the fit rows (in-sample residuals would understate it).
    """
    frame = validate_profile(frame)
    rng = np.random.default_rng(seed)
    if (frame["split"] == "holdout").any():
        fit_rows, holdout_rows = frame[frame["split"] == "fit"], frame[frame["split"] == "holdout"]
    else:
        mask = rng.random(len(frame)) < holdout_share
        fit_rows, holdout_rows = frame[~mask], frame[mask]
    if len(fit_rows) < len(REGRESSION_TERMS):
        raise ProfileError(f"profile has {len(fit_rows)} fit steps; at least {len(REGRESSION_TERMS)} are needed")

    regression = RegressionCost.fit(fit_rows)
    table, table_error = None, None
    try:
        table = LookupTableCost.fit(fit_rows, monotone_tolerance, monotone_tolerance_ms)
    except ProfileError as err:
        # A non-monotone grid is a broken profile whatever model is used: fail loudly.
        if "not monotone" in str(err):
            raise
        table_error = str(err)

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
    }
    if len(holdout_rows):
        y = holdout_rows["step_ms"].to_numpy()
        pred = regression.predict_frame(holdout_rows)
        report["regression_holdout"] = _error_stats(y, pred)
        margin = ResidualMargin(regression, fractions)
        delta = np.array(
            [margin.fraction(int(n), int(c)) for n, c in holdout_rows[["n_decodes", "chunk_tokens"]].itertuples(index=False)]
        ) * pred
        report["regression_holdout"]["covered_by_margin_share"] = float(np.mean(y <= pred + delta))
        # The same model without its context terms, to show what they buy.
        no_ctx = RegressionCost.fit(fit_rows.assign(decode_kv_tokens=0, prefill_prefix_tokens=0))
        pred_no_ctx = no_ctx.predict_frame(holdout_rows.assign(decode_kv_tokens=0, prefill_prefix_tokens=0))
        report["regression_without_context_holdout"] = _error_stats(y, pred_no_ctx)
        if table is not None:
            report["table_holdout"] = _error_stats(y, table.predict_frame(holdout_rows))
    return FitResult(regression, table, fractions, report)


def fit_profile_file(path: str | Path, **kwargs) -> FitResult:
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


