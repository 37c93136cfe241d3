"""Cells of a table the user wrote (a profile CSV or JSON): read as numbers, and shown back as written."""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd


def numbers(column: pd.Series) -> np.ndarray:
    """A column as floats, NaN where a cell is no number. A boolean is none: pandas reads a
    column of True/False (or JSON true/false) as booleans, which would count as 1 and 0. Nor
    is an integer past the largest float (10**400 in JSON), on which pandas raises OverflowError."""
    cells = column.map(
        lambda v: (
            np.nan if isinstance(v, (bool, np.bool_)) or (isinstance(v, int) and abs(v) > sys.float_info.max) else v
        )
    )
    return pd.to_numeric(cells, errors="coerce").to_numpy(dtype=float, copy=True)


def show(value) -> str:
    """A cell as the user wrote it (numpy scalars print as plain numbers)."""
    return repr(value.item() if isinstance(value, np.generic) else value)
