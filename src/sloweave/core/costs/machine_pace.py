"""The machine's pace: how much slower or faster than its cost model a real engine ran, moment by moment.

A shared machine drifts: another process takes a share of the cores for seconds, and every step
in those seconds runs slower. A step log holds that drift in its residuals (measured - predicted
against one cost fitted to the whole run). Drawn step by step into a simulation, the drift
becomes noise on every step, which a policy with online correction cannot follow and must cover
with its margin, where on the real machine its correction followed the drift. Measured on vLLM's
CPU build with a competing process: the fitted cost's per-second median measured / predicted
moved between 0.86 and 1.34 over a 17-s run, and the chunk steps' P99 residual was 7.0 ms against
4.9 ms once that pace was divided out; the plug-in's twin took chunks half the real run's size.

``MachinePace`` keeps the drift apart: the median of measured / predicted over the steps within
``window_ms`` of each point of a grid (every quarter window) along the source's timeline, where
at least ``MIN_PACE_STEPS`` steps fall. A simulated step at time t on its own clock takes the pace
at the same time from the source's first step (``at``: linear between grid points, wrapping past
the source's span), so a twin of a run is slow when the run was; the residuals the twin draws are
taken against the paced prediction (``residuals_ms``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from sloweave.core.validate import DURATION_MS

MIN_PACE_STEPS = 20  # a grid point's median is taken over at least this many steps
GRID_PER_WINDOW = 4  # grid points per window
PACE_RULE = (
    f"the median of measured / predicted over the steps starting within half a window of each grid point "
    f"(every 1/{GRID_PER_WINDOW} window, where at least {MIN_PACE_STEPS} steps fall), linear between them; "
    f"a simulated step at t ms from its run's start reads the pace at t ms from the source's first step, "
    f"wrapping past the source's span"
)


class PaceError(ValueError):
    """A pace that cannot be read from these steps (names the source and the problem)."""


@dataclass(frozen=True)
class MachinePace:
    source: str
    window_ms: float
    start_ms: float  # the source's first step: its timeline's zero
    span_ms: float  # from its first step's start to its last step's
    grid_ms: tuple[float, ...]  # from start_ms, increasing
    pace: tuple[float, ...]  # at each grid point

    @classmethod
    def of_steps(
        cls, start_ms, predicted_ms, measured_ms, window_ms: float, source: str = "given steps"
    ) -> MachinePace:
        DURATION_MS.check(window_ms, "the pace's window_ms")
        start_ms = np.asarray(start_ms, dtype=np.float64)
        predicted_ms, measured_ms = np.asarray(predicted_ms, np.float64), np.asarray(measured_ms, np.float64)
        if not np.isfinite(start_ms).all():
            raise PaceError(f"step noise source {source}: a step's start_ms is not a finite time")
        known = predicted_ms > 0  # a zero prediction has no ratio
        if known.sum() < MIN_PACE_STEPS:
            raise PaceError(f"step noise source {source}: {int(known.sum())} steps, a pace needs {MIN_PACE_STEPS}")
        order = np.argsort(start_ms[known], kind="stable")
        times = start_ms[known][order]
        ratios = (measured_ms[known] / predicted_ms[known])[order]
        first, last = float(times[0]), float(times[-1])
        grid = np.arange(first, last + window_ms / GRID_PER_WINDOW, window_ms / GRID_PER_WINDOW)
        low = np.searchsorted(times, grid - window_ms / 2, side="left")
        high = np.searchsorted(times, grid + window_ms / 2, side="right")
        enough = high - low >= MIN_PACE_STEPS
        if not enough.any():  # the whole source is one window's worth: one pace for it all
            grid, low, high, enough = np.array([first]), np.array([0]), np.array([times.size]), np.array([True])
        pace = np.array([np.median(ratios[a:b]) for a, b in zip(low[enough], high[enough])])
        return cls(
            source, float(window_ms), first, last - first, tuple((grid[enough] - first).tolist()), tuple(pace.tolist())
        )

    def at(self, t_ms: float) -> float:
        """The pace ``t_ms`` after the timeline's start (wrapped past the span)."""
        if self.span_ms > 0:
            t_ms %= self.span_ms
        grid, pace = self.grid_ms, self.pace
        i = bisect.bisect_right(grid, t_ms)  # once per simulated step: no numpy call
        if i == 0:
            return pace[0]
        if i == len(grid):
            return pace[-1]
        share = (t_ms - grid[i - 1]) / (grid[i] - grid[i - 1])
        return pace[i - 1] + share * (pace[i] - pace[i - 1])

    def of_source_steps(self, start_ms) -> np.ndarray:
        """The pace at each of the source's own steps (by its start)."""
        return np.interp(np.asarray(start_ms, np.float64) - self.start_ms, self.grid_ms, self.pace)

    def describe(self) -> dict:
        p5, p50, p95 = np.percentile(self.pace, [5, 50, 95])
        return {
            "window_ms": self.window_ms,
            "span_ms": self.span_ms,
            "grid_points": len(self.pace),
            "pace_p5": float(p5),
            "pace_p50": float(p50),
            "pace_p95": float(p95),
            "rule": PACE_RULE,
        }
