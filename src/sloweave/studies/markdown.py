"""Markdown tables of results, for the reports the studies write."""

from __future__ import annotations

import numpy as np
import pandas as pd


def significant(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant figures, never in exponent form: a capacity of 0.0312
    req/s must not print as 0.0, nor 1,234.5 as 1.23e+03 (whole numbers keep every digit)."""
    if value == 0 or not np.isfinite(value):
        return f"{value:g}"
    decimals = max(digits - 1 - int(np.floor(np.log10(abs(value)))), 0)
    return f"{value:,.{decimals}f}"


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub table without the optional `tabulate` dependency."""

    def fmt(value) -> str:
        if isinstance(value, (float, np.floating)):
            if np.isnan(value):
                return "-"
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
        return str(value)

    header = "| " + " | ".join(frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    body = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *body])
