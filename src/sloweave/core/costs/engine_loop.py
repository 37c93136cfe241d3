"""The engine loop between two steps: time that passes, but that no step's measurement holds.

Between one step's end and the next one's start a real engine does work of its own: on vLLM's
CPU build, in-process, it hands every request its new token and adds the requests that arrived,
about 0.1-0.2 ms plus 13-16 us a decode. A step log times each step from the plug-in's
``schedule()`` to its ``update_from_output()``, so that work is in no step's ``measured_ms``; it
is in the gap to the next step's start (``step_log.cycle_ms``).

A simulator's iteration has no loop of its own. Priced with each step's whole cycle, the loop is
in the step, and a twin of the plug-in then learns it into its online correction and margin, where
the served plug-in never saw it: warmed with 2,000 small decode-only steps before a run (their
cycles 10 % over their steps), the twin's chunks came out a third of the real run's and it
attained 0.52 against 1.00. ``EngineLoop`` keeps the loop apart: the step is priced and observed
as measured, and the clock then moves on by the loop, after the step's tokens are out and before
the next decision, as the real engine's does. A loop's time varies (an arrival to add, a longer
hand-out): ``drawn`` adds to the fitted time one of the log's own residuals against it, seeded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sloweave.core.validate import MARGIN_MS

MIN_LOOP_STEPS = 20  # steps with a known cycle a loop is fitted from
LOOP_RULE = (
    "least squares of each step's cycle less its measured time (the next step's start less its own end) "
    "on the decodes it ran, over the steps followed straight on by the next (step_log.cycle_ms); "
    "a slope below zero refitted as a constant, a constant below zero as none; drawn: plus one of the steps' "
    "residuals against that fit, each loop independently (seeded), and never below zero"
)


class EngineLoopError(ValueError):
    """A loop that cannot be read from these steps (names the source and the problem)."""


@dataclass(frozen=True)
class EngineLoop:
    base_ms: float  # per loop
    per_decode_ms: float  # per decode of the step before it
    source: str = "given"
    steps: int = 0  # the steps it was fitted from
    residuals_ms: tuple[float, ...] = ()  # each step's loop less the fit's: what ``drawn`` adds

    def __post_init__(self) -> None:
        MARGIN_MS.check(self.base_ms, "the engine loop's base_ms")
        MARGIN_MS.check(self.per_decode_ms, "the engine loop's per_decode_ms")

    def after_step(self, n_decodes: int) -> float:
        """The loop's time after a step that ran ``n_decodes`` decodes (the fit alone)."""
        return self.base_ms + self.per_decode_ms * n_decodes

    def drawn(self, seed: int) -> DrawnLoop:
        """The loop with its measured spread: the fit plus a residual drawn per loop (``seed``)."""
        return DrawnLoop(self, seed)

    @classmethod
    def of_steps(cls, n_decodes, loop_ms, source: str = "given steps") -> EngineLoop:
        """Fitted (mean-preserving least squares, so a run's total loop time is kept) to each step's decodes
        and the loop after it; NaN loops (not known) are left out."""
        n_decodes, loop_ms = np.asarray(n_decodes, np.float64), np.asarray(loop_ms, np.float64)
        known = np.isfinite(loop_ms)
        if known.sum() < MIN_LOOP_STEPS:
            raise EngineLoopError(
                f"engine loop source {source}: {int(known.sum())} steps with a known cycle, a loop needs {MIN_LOOP_STEPS}"
            )
        n, loop = n_decodes[known], loop_ms[known]
        if np.ptp(n) > 0:
            slope, base = np.polyfit(n, loop, 1)
        else:
            slope, base = 0.0, float(loop.mean())
        if slope < 0:  # more decodes, less loop: no such engine; the mean alone
            slope, base = 0.0, float(loop.mean())
        base = max(0.0, float(base))
        residuals = loop - (base + slope * n)
        return cls(base, float(slope), source, int(known.sum()), tuple(residuals.tolist()))

    @classmethod
    def of_step_log(cls, path: str | Path) -> EngineLoop:
        """The loop of a served run's step log (``sloweave.core.step_log``)."""
        from sloweave.core.step_log import cycle_ms, read_step_log

        steps = read_step_log(path).steps
        loop = cycle_ms(steps) - steps["measured_ms"].to_numpy(dtype=np.float64)
        return cls.of_steps(steps["ran_decode_tokens"].to_numpy(), loop, str(path))

    def describe(self) -> dict:
        spread = np.percentile(self.residuals_ms, [50, 99]).tolist() if self.residuals_ms else [0.0, 0.0]
        return {"base_ms": self.base_ms, "per_decode_ms": self.per_decode_ms, "steps": self.steps,
                "residual_p50_ms": spread[0], "residual_p99_ms": spread[1], "source": self.source,
                "rule": LOOP_RULE}  # fmt: skip


class DrawnLoop:
    """``EngineLoop``'s fit plus one of its residuals per loop, drawn with ``seed`` (never below zero)."""

    def __init__(self, loop: EngineLoop, seed: int) -> None:
        self.loop = loop
        self._residuals = np.asarray(loop.residuals_ms or (0.0,), dtype=np.float64)
        self._rng = np.random.default_rng(seed)

    def after_step(self, n_decodes: int) -> float:
        residual = self._residuals[self._rng.integers(self._residuals.size)]
        return max(0.0, self.loop.after_step(n_decodes) + residual)
