"""The residuals a per-step margin reads (``step_margin``), and which of them it keeps.

``StepResiduals`` keeps the residuals in milliseconds (measured - corrected prediction) per
step kind (decode-only, with a chunk) and per predicted-time bucket (edges a factor sqrt(2)
apart), each in a bounded window, and only those of the last ``HORIZON_STEPS`` steps of any
kind: a burst of stalls (the machine busy elsewhere) gives the steps with a chunk a margin that
keeps chunks from running, so their buckets would hold the burst for as long as the margin
stands, and it would stand for ever (measured on vLLM's CPU engine: 2 % of steps with a chunk
minutes after the burst, prompts waiting).

Stalls delay a step whatever it holds. A residual past the largest budget a decision has had is
one no margin could have kept to a deadline, nor a step without the chunk: it is left out of
the pools once decode-only steps show such stalls too, at a like rate per millisecond of step
(``without_stalls``). And after a noisy spell, once more decode-only steps in a row have stayed
within the windows' tail than chance allows, the machine is quieter than the windows say and
the residuals before them are forgotten (``quieter_since``): left in, a spell held every chunk
back for the 2,000 steps of the horizon after it ended.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator

import numpy as np

# Lower edges of the predicted-time buckets, in ms: 2**(k/2) from 0.25 ms to 2**17 ms (131 s),
# and a first bucket from 0. A factor sqrt(2) keeps additive noise near constant within a bucket.
PREDICTED_MS_EDGES = (0.0, *(2.0 ** (k / 2) for k in range(-4, 35)))
DECODE_ONLY, WITH_CHUNK = 0, 1
_UPPER_EDGES_MS = np.array(PREDICTED_MS_EDGES[1:])
# a step's time in each bucket, for the time the steps of a window took (the geometric middle)
_BUCKET_MIDDLES_MS = np.array(
    [PREDICTED_MS_EDGES[1] / 2, *np.sqrt(_UPPER_EDGES_MS[:-1] * _UPPER_EDGES_MS[1:]), PREDICTED_MS_EDGES[-1]]
)
STEP_KINDS = ("decode-only", "with-chunk")
# A bucket's window: its quantile at P99.7 is then about its third largest residual.
BUCKET_WINDOW_STEPS = 1000
# A residual counts for this many steps of either kind, then it is dropped: twice the pool, so a
# full pool of fresh steps stays possible, and a burst of stalls is forgotten within seconds of
# decode-only steps.
HORIZON_STEPS = 2 * 1000
# A residual past the largest budget a decision has had is a stall no margin could have kept to
# its deadline, nor a step without the chunk: the machine's (busy elsewhere), not the chunk's. It
# is left out of the margin's pools while decode-only steps show such stalls too, and steps with a
# chunk show them at most this many times as often per millisecond of step (a stall comes in wall
# time: a longer step is caught by more of them; far more often than that, they are the chunk's).
STALL_RATE_RATIO = 4.0
# After a noisy spell the windows hold its residuals for HORIZON_STEPS steps, and while they hold
# every chunk back only decode-only steps run, a few milliseconds each: seconds of serving without a
# prefill (measured on vLLM's CPU engine after two processes spun on its cores for 6 s: 6 s of
# 300 decode-only steps a second while prompts waited). Where so many decode-only steps in a row
# since the last past the windows' decode-only tail (the value QUIET_TAIL_SHARE of them exceed)
# that such a run has a chance under QUIET_SIGNIFICANCE at the rate they came before (456 steps at
# 2 %, 180 at 5 %), and as many as a margin is read from (334 at P99.7), the machine is quieter
# than the windows say: the residuals before are forgotten.
QUIET_TAIL_SHARE = 0.02
QUIET_SIGNIFICANCE = 1e-4
# How often (in observed steps) the windows are asked whether the machine is quieter than they say
# (a check costs about 0.1 ms: every 64 steps, not on the margin's table rebuilds, every 32).
QUIET_CHECK_STEPS = 64
QUIET_CHECK_AT = 48


def predicted_bucket(predicted_ms: float) -> int:
    """The bucket of a corrected prediction (an index into ``PREDICTED_MS_EDGES``)."""
    return max(bisect.bisect_right(PREDICTED_MS_EDGES, predicted_ms) - 1, 0)


class StepResiduals:
    """Residuals in ms of the corrected prediction, per step kind and predicted-time bucket,
    windowed, and only those of the last ``horizon_steps`` steps.

    Each bucket's window is a ring of ``window_steps`` numbers, made on its first step, beside
    the step number of each: a quantile reads it as an array, with no copy out of a Python
    container."""

    def __init__(
        self, window_steps: int = BUCKET_WINDOW_STEPS, horizon_steps: int = HORIZON_STEPS, quiet_steps: int = 334
    ) -> None:
        for name, value in (
            ("window_steps", window_steps),
            ("horizon_steps", horizon_steps),
            ("quiet_steps", quiet_steps),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        self.window_steps = window_steps
        self.horizon_steps = horizon_steps
        self.rings: list[list[np.ndarray | None]] = [[None] * len(PREDICTED_MS_EDGES) for _ in STEP_KINDS]
        self.step_numbers: list[list[np.ndarray | None]] = [[None] * len(PREDICTED_MS_EDGES) for _ in STEP_KINDS]
        self.added = np.zeros((len(STEP_KINDS), len(PREDICTED_MS_EDGES)), dtype=np.int64)
        self.observed = 0
        # residuals of steps before this are forgotten: the fewest quiet decode-only steps in a row
        # that say so (``quieter_since``; a margin's fewest at its quantile), and the step they start at
        self.quiet_steps = quiet_steps
        self.since_step = 0

    def add(self, with_chunk: bool, predicted_ms: float, measured_ms: float) -> None:
        """One step: its corrected prediction and its measured time (finite, >= 0 ms)."""
        if not (0 <= predicted_ms < math.inf and 0 <= measured_ms < math.inf):
            raise ValueError(
                f"a step needs finite times >= 0 ms, got predicted_ms={predicted_ms!r}, measured_ms={measured_ms!r}"
            )
        kind, bucket = int(with_chunk), predicted_bucket(predicted_ms)
        ring = self.rings[kind][bucket]
        if ring is None:
            ring = self.rings[kind][bucket] = np.empty(self.window_steps)
            self.step_numbers[kind][bucket] = np.empty(self.window_steps, dtype=np.int64)
        added = int(self.added[kind, bucket])
        ring[added % self.window_steps] = measured_ms - predicted_ms
        self.step_numbers[kind][bucket][added % self.window_steps] = self.observed
        self.added[kind, bucket] = added + 1
        self.observed += 1
        if self.observed % QUIET_CHECK_STEPS == QUIET_CHECK_AT:
            # each forgetting ends at the last step past the tail: again, until the rest is like the steps since
            while (quiet_from := quieter_since(self, self.quiet_steps)) is not None:
                self.since_step = quiet_from

    def _held(self, kind: int) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """Per bucket of ``kind`` holding steps: (bucket, its ring's residuals, their step numbers,
        which of them count: from the last ``horizon_steps`` steps and since ``since_step``)."""
        oldest = max(self.observed - self.horizon_steps, self.since_step)
        held = np.minimum(self.added[kind], self.window_steps)
        for bucket in np.flatnonzero(held).tolist():
            n = int(held[bucket])
            numbers = self.step_numbers[kind][bucket][:n]
            yield bucket, self.rings[kind][bucket][:n], numbers, numbers >= oldest

    def windows(self) -> list[list[np.ndarray]]:
        """Per kind and bucket, the residuals in its window that count (``_held``; in no particular
        order; empty where none)."""
        empty = np.empty(0)
        windows = []
        for kind in range(len(STEP_KINDS)):
            per_bucket = [empty] * len(PREDICTED_MS_EDGES)
            for bucket, residuals, _, kept in self._held(kind):
                per_bucket[bucket] = residuals[kept]
            windows.append(per_bucket)
        return windows

    def of_kind(self, kind: int) -> tuple[np.ndarray, np.ndarray]:
        """The residuals of ``kind`` that count and their step numbers (in no particular order)."""
        residuals, numbers = [np.empty(0)], [np.empty(0, dtype=np.int64)]
        for _, ring, ring_numbers, kept in self._held(kind):
            residuals.append(ring[kept])
            numbers.append(ring_numbers[kept])
        return np.concatenate(residuals), np.concatenate(numbers)


def _tail_ms(values: np.ndarray) -> float:
    """The value ``QUIET_TAIL_SHARE`` of ``values`` exceed (a partition, not a sort: this runs every
    ``QUIET_CHECK_STEPS`` steps)."""
    at = int((1.0 - QUIET_TAIL_SHARE) * (values.size - 1))
    return float(np.partition(values, at)[at])


def quieter_since(residuals: StepResiduals, fewest_steps: int) -> int | None:
    """Where more decode-only steps in a row have stayed within the windows' decode-only tail (the
    value ``QUIET_TAIL_SHARE`` of them exceed) than chance allows at the rate steps left it before
    (``QUIET_SIGNIFICANCE``), and at least ``fewest_steps`` (as many as a margin is read from):
    the first of them within their own tail (the spell's last steps, below the windows' tail, go
    with it); None otherwise."""
    values, numbers = residuals.of_kind(DECODE_ONLY)
    if values.size <= fewest_steps:
        return None
    past = values > _tail_ms(values)
    if not past.any():
        return None
    later = numbers > numbers[past].max()
    quiet_steps = int(np.count_nonzero(later))
    if quiet_steps < fewest_steps:
        return None
    rate = np.count_nonzero(past) / (values.size - quiet_steps)
    # (1 - rate) ** quiet_steps, the chance of so many quiet steps in a row
    log_chance = quiet_steps * math.log1p(-rate) if rate < 1.0 else -math.inf
    if log_chance >= math.log(QUIET_SIGNIFICANCE):
        return None
    # the spell's last steps, within the windows' tail but past the quiet steps' own, go with it
    quiet = values[later]
    return int(numbers[later & (values <= _tail_ms(quiet))].min())


def without_stalls(windows: list[list[np.ndarray]], stall_ms: float) -> list[list[np.ndarray]]:
    """``windows`` (``StepResiduals.windows()``) less the residuals past ``stall_ms``, where they
    are the machine's (``STALL_RATE_RATIO``): decode-only steps have some, and steps with a chunk
    have them at most that many times as often per millisecond of step. Otherwise as they are."""
    if not np.any(np.concatenate(windows[DECODE_ONLY]) > stall_ms):  # the usual case, at every table rebuild
        return windows
    past = [[int(np.count_nonzero(window > stall_ms)) for window in of_kind] for of_kind in windows]
    decode_only_stalls, with_chunk_stalls = sum(past[DECODE_ONLY]), sum(past[WITH_CHUNK])
    decode_only_ms, with_chunk_ms = (
        float(np.dot([window.size for window in of_kind], _BUCKET_MIDDLES_MS)) for of_kind in windows
    )
    if with_chunk_stalls * decode_only_ms > STALL_RATE_RATIO * decode_only_stalls * with_chunk_ms:
        return windows
    return [
        [window[window <= stall_ms] if stalls else window for window, stalls in zip(of_kind, stalls_of_kind)]
        for of_kind, stalls_of_kind in zip(windows, past)
    ]
