"""Fitting a step-time profile into cost models (``fit_profile``): the regression, the lookup table
and the residual margin of ``sloweave.core.costs.fitted``, each used only once ``accept_fit``
(``sloweave.core.costs.fit_acceptance``) takes it; the regression failing refuses the profile,
the table failing is said in the report (``table_error``, ``notes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.costs.fit_acceptance import (
    HOLDOUT_ERROR,
    MAX_HOLDOUT_ERROR,
    accept_fit,
    enough_steps,
    error_stats,
)
from sloweave.core.costs.fitted import (
    C_BUCKET_EDGES,
    N_BUCKET_EDGES,
    ContextualCost,
    LookupTableCost,
    RegressionCost,
    ResidualMargin,
    regression_terms_fitted,
)
from sloweave.core.costs.step_grid import check_monotone_steps, check_tolerances
from sloweave.core.costs.step_profiles import ProfileError, read_profile, validate_profile
from sloweave.core.validate import finite_number


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
    compared = _check_steps_on_grid(frame, where, monotone_tolerance, monotone_tolerance_ms)
    rng = np.random.default_rng(seed)
    fit_rows, holdout_rows = _split_holdout(frame, holdout_share, rng)
    enough_steps("regression", fit_rows, where)

    regression = RegressionCost.fit(fit_rows)
    accepted = {"regression": accept_fit("regression", regression, fit_rows, holdout_rows, where, max_holdout_error)}
    table, table_error, table_accepted = _fit_table(
        fit_rows, holdout_rows, monotone_tolerance, monotone_tolerance_ms, where, max_holdout_error
    )
    if table is not None:
        accepted["table"] = table_accepted
    fractions = _margin_fractions(regression, fit_rows, rng, folds, margin_quantile)
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
        "notes": _fit_notes(compared, table_error, accepted["regression"]["holdout"]),
    }
    if len(holdout_rows):
        _report_holdout(report, regression, fractions, fit_rows, holdout_rows, accepted)
    return FitResult(regression, table, fractions, report)


def _check_steps_on_grid(
    frame: pd.DataFrame, where: str, monotone_tolerance: float, monotone_tolerance_ms: float
) -> bool:
    """``check_monotone_steps`` on every step on the grid of the fitted ones, held out or not, before
    the random split: a drop in a step held out, or in a cell a hold-out leaves empty, is a drop.
    The profiler's held-out steps are off the grid (other chunks, a prefix): scored, not compared."""
    fitted = frame[frame["split"] != "holdout"]
    grid_columns = [
        c for c in ("n_decodes", "chunk_tokens", "context_tokens", "prefill_prefix_tokens") if c in frame.columns
    ]
    on_grid = np.logical_and.reduce([frame[c].isin(fitted[c].unique()).to_numpy() for c in grid_columns])
    return check_monotone_steps(frame[on_grid], where, monotone_tolerance, monotone_tolerance_ms)


def _split_holdout(
    frame: pd.DataFrame, holdout_share: float, rng: np.random.Generator
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The fit rows and the held-out rows: those marked ``split=holdout``, or else a seeded random
    ``holdout_share`` of the rows (one at least)."""
    if (frame["split"] == "holdout").any():
        fit_rows, holdout_rows = frame[frame["split"] == "fit"], frame[frame["split"] == "holdout"]
    else:
        mask = rng.random(len(frame)) < holdout_share
        if holdout_share > 0 and not mask.any() and len(frame) > 1:
            mask[rng.integers(len(frame))] = True  # a share asked for is never silently none
        fit_rows, holdout_rows = frame[~mask], frame[mask]
    return fit_rows, holdout_rows


def _fit_table(
    fit_rows: pd.DataFrame,
    holdout_rows: pd.DataFrame,
    monotone_tolerance: float,
    monotone_tolerance_ms: float,
    where: str,
    max_holdout_error: float,
) -> tuple[LookupTableCost | None, str | None, dict | None]:
    """The lookup table, why there is none (``table_error``), and what ``accept_fit`` found of it."""
    table, table_error, accepted = None, None, None
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
            accepted = accept_fit("table", table, fit_rows, holdout_rows, "profile", max_holdout_error)
        except ProfileError as err:
            table, table_error = None, str(err)
    return table, table_error, accepted


def _margin_fractions(
    regression: RegressionCost, fit_rows: pd.DataFrame, rng: np.random.Generator, folds: int, margin_quantile: float
) -> np.ndarray:
    """The residual margin's table, from out-of-fold residuals of the regression (in-sample
    residuals would understate it)."""
    fold = rng.integers(0, folds, len(fit_rows))
    oof = np.empty(len(fit_rows))
    for f in range(folds):
        train, test = fit_rows[fold != f], fit_rows[fold == f]
        if len(test) == 0:
            continue
        model = RegressionCost.fit(train) if len(train) >= regression_terms_fitted(train) else regression
        oof[fold == f] = model.predict_frame(test)
    y_fit = fit_rows["step_ms"].to_numpy()
    relative = y_fit / oof - 1.0
    return ResidualMargin.table_from_residuals(
        fit_rows["n_decodes"].to_numpy(), fit_rows["chunk_tokens"].to_numpy(), relative, margin_quantile
    )


def _fit_notes(compared: bool, table_error: str | None, holdout: dict | None) -> list[str]:
    """What the report says of a fit besides its numbers; ``table_error``: why there is no table (None: there is one)."""
    notes = []
    if not compared:
        notes.append(
            "the fitted steps are no full (n, c, context) grid: they are not compared with each other for monotonicity, "
            "the fit is (accept_fit)"
        )
    if table_error is not None:
        notes.append(f"no lookup table ({table_error}); only the regression can be used")
    if holdout is None:
        notes.append("no held-out steps: the fit's error on steps it did not see is not measured")
    elif holdout["unseen_steps"] == 0:
        notes.append(
            "every held-out step repeats a fitted step: the held-out error measures timing noise, not steps the fit has not seen"
        )
    return notes


def _report_holdout(
    report: dict,
    regression: RegressionCost,
    fractions: np.ndarray,
    fit_rows: pd.DataFrame,
    holdout_rows: pd.DataFrame,
    accepted: dict,
) -> None:
    """The held-out scores in ``report``: the regression's (and the share its margin covers), the
    same model's without its context terms (what they buy), the table's."""
    y = holdout_rows["step_ms"].to_numpy()
    pred = regression.predict_frame(holdout_rows)
    report["regression_holdout"] = accepted["regression"]["holdout"]
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
    report["regression_without_context_holdout"] = error_stats(y, pred_no_ctx)
    if "table" in accepted:
        report["table_holdout"] = accepted["table"]["holdout"]


def fit_profile_file(path: str | Path, **kwargs) -> FitResult:
    """``fit_profile`` of the profile file at ``path`` (``read_profile``), named by it in messages."""
    kwargs.setdefault("where", f"profile {path}")
    return fit_profile(read_profile(path), **kwargs)
