"""A step-time profile's steps on their (n, c, context) grid, and the check that step time does not
drop along it.

The lookup table (``sloweave.core.costs.fitted.LookupTableCost``) is built on this grid; every
grid profile is checked on it before anything is fitted (``check_monotone_steps``): a drop of the
fastest repeat above ``monotone_tolerance`` (relative) and ``monotone_tolerance_ms`` is an error.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from sloweave.core.costs.step_profiles import ProfileError
from sloweave.core.validate import non_negative_number


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
