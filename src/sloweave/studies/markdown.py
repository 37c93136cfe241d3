"""Markdown tables of results, for the reports the studies write."""

from __future__ import annotations

import numpy as np
import pandas as pd


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
