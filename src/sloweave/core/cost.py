"""Iteration cost models T(n, c) and safety margins delta(n, c).

A cost model predicts how long one serving iteration takes, in milliseconds, when it
decodes ``n`` running requests (one token each) and prefills ``c`` prompt tokens of one
waiting request. The policy only needs T to be monotone non-decreasing in ``c``: that is
what makes binary search over the chunk size exact (Proposition 1 in SPEC.md).

Nothing here imports an engine or the simulator, so the same objects decide in every body.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from sloweave.core.validate import MARGIN_MS, non_negative_number


class CostModelError(ValueError):
    """A cost model or margin that the policy cannot use (e.g. not monotone in the chunk)."""


@runtime_checkable
class CostModel(Protocol):
    """T(n, c) in milliseconds; must be monotone non-decreasing in c."""

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float: ...


@runtime_checkable
class Margin(Protocol):
    """delta(n, c) in milliseconds, added to the prediction before comparing with the budget."""

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float: ...


@dataclass(frozen=True)
class AnalyticCost:
    """The paper's simulator default, in milliseconds:

    T(n, c) = base + 1[n>0] (decode_base + decode_per_req * n) + 1[c>0] (prefill_base + prefill_per_token * c)

    The indicator terms model kernels that are launched only when there is decode (or
    prefill) work in the iteration; the per-token terms are the memory- and compute-bound
    work that grows with the batch.
    """

    base_ms: float = 0.35
    decode_base_ms: float = 0.90
    decode_per_req_ms: float = 0.055
    prefill_base_ms: float = 0.40
    prefill_per_token_ms: float = 0.006

    def __post_init__(self) -> None:
        for name in ("base_ms", "decode_base_ms", "decode_per_req_ms", "prefill_base_ms", "prefill_per_token_ms"):
            try:  # the shared rule: a boolean is no number of ms (True read as 1 ms), nor a string
                non_negative_number(getattr(self, name), f"AnalyticCost.{name}")
            except ValueError as err:
                raise CostModelError(str(err)) from None

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        t = self.base_ms
        if n_decodes > 0:
            t += self.decode_base_ms + self.decode_per_req_ms * n_decodes
        if chunk_tokens > 0:
            t += self.prefill_base_ms + self.prefill_per_token_ms * chunk_tokens
        return t

    def chunk_estimate(self, n_decodes: int, budget_ms: float) -> int:
        """Closed-form guess of the largest c > 0 with T(n, c) <= budget (may be off by one).

        The policy checks the guess against T itself, so it only saves search steps.
        """
        if self.prefill_per_token_ms <= 0 or budget_ms == math.inf:
            return 1 << 62  # no finite deadline (e.g. decodes whose deadline is not tracked): any chunk fits
        room = budget_ms - self.base_ms - self.prefill_base_ms
        if n_decodes > 0:
            room -= self.decode_base_ms + self.decode_per_req_ms * n_decodes
        # The nudge turns 699.9999 (float for an exact 700) into 700; one too many is fine:
        # the policy checks the guess and its neighbour.
        return int(room / self.prefill_per_token_ms + 1e-6) if room > 0 else 0


@dataclass(frozen=True)
class ZeroMargin:
    """No safety margin: trust the cost model exactly (the paper's default)."""

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return 0.0


@dataclass(frozen=True)
class ConstantMargin:
    """A fixed margin in milliseconds, e.g. the P99 of observed one-sided residuals."""

    margin_ms: float

    def __post_init__(self) -> None:
        try:
            MARGIN_MS.check(self.margin_ms, "ConstantMargin.margin_ms")
        except ValueError as err:
            raise CostModelError(str(err)) from None

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return self.margin_ms


@dataclass(frozen=True)
class RelativeMargin:
    """A margin proportional to the prediction: delta = fraction * T(n, c).

    Matches a predictor whose error is a bounded multiplicative factor (real step
    times scale with the work), e.g. fraction=0.2 covers an actual cost up to 1.2 x T.
    """

    cost: CostModel
    fraction: float

    def __post_init__(self) -> None:
        try:
            non_negative_number(self.fraction, "RelativeMargin.fraction")
        except ValueError as err:
            raise CostModelError(str(err)) from None

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return self.fraction * self.cost(n_decodes, chunk_tokens)


def check_monotone_in_chunk(
    cost: CostModel,
    max_chunk_tokens: int,
    decode_counts: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    points: int = 257,
    allow_drops: bool = False,
) -> None:
    """Raise CostModelError if ``cost`` decreases in c anywhere on a sample grid, or gives a
    negative or non-finite time (``allow_drops``: only the latter, for a model to be repaired).

    Binary search silently returns a wrong chunk for a non-monotone model, so a model
    is checked once, when a policy is built, rather than trusted.
    """
    chunks = np.unique(np.linspace(0, max_chunk_tokens, points).round().astype(int))
    for n in decode_counts:
        values = np.array([cost(int(n), int(c)) for c in chunks], dtype=float)
        if not np.all(np.isfinite(values)):
            bad = int(chunks[~np.isfinite(values)][0])
            raise CostModelError(f"cost model returned a non-finite time at n={n}, c={bad}")
        if np.any(values < 0):
            bad = int(chunks[values < 0][0])
            raise CostModelError(f"cost model returned a negative time at n={n}, c={bad}")
        drops = np.flatnonzero(np.diff(values) < 0)
        if drops.size and not allow_drops:
            i = int(drops[0])
            raise CostModelError(
                "cost model is not monotone non-decreasing in the chunk size: "
                f"T(n={n}, c={int(chunks[i])}) = {values[i]:.6g} ms > "
                f"T(n={n}, c={int(chunks[i + 1])}) = {values[i + 1]:.6g} ms "
                "(SLOWeave(..., repair_non_monotone=True) uses its running maximum over c instead)"
            )


@dataclass(frozen=True)
class MonotoneRepair:
    """Wrap a cost model so it is monotone in c: T'(n, c) = max over c' <= c of T(n, c').

    Only used when the user asks for it. The running maximum never predicts a chunk
    cheaper than a smaller one, so it keeps deadline safety. It is tabulated over every
    chunk size 0..max_chunk_tokens the first time a decode count n is seen (cached per n).
    """

    cost: CostModel
    max_chunk_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cache", {})

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        cache: dict[int, np.ndarray] = self._cache  # type: ignore[attr-defined]
        envelope = cache.get(n_decodes)
        if envelope is None:
            values = np.array([self.cost(n_decodes, c) for c in range(self.max_chunk_tokens + 1)], dtype=float)
            # the running maximum repairs drops in c; it must not hide a negative or NaN time
            invalid = np.flatnonzero(~(values >= 0))
            if invalid.size:
                c = int(invalid[0])
                raise CostModelError(
                    f"cost model returned a negative or non-finite time ({values[c]:g} ms) at n={n_decodes}, c={c}; "
                    "repair_non_monotone only repairs drops in c"
                )
            envelope = cache[n_decodes] = np.maximum.accumulate(values)
        if chunk_tokens > self.max_chunk_tokens:
            return float(max(envelope[-1], self.cost(n_decodes, chunk_tokens)))
        return float(envelope[chunk_tokens])


@dataclass(frozen=True)
class NoisyCost:
    """The "actual" iteration time of the simulator: predicted time x seeded noise x bias.

    ``noise`` is a multiplicative factor drawn per iteration from a lognormal with the
    given sigma, optionally capped at ``max_factor`` so tests can bound the one-sided error.
    It is a stateful sampler (owns a numpy Generator), built fresh for every run.
    """

    cost: CostModel
    sigma: float
    seed: int
    max_factor: float | None = None
    # A systematic prediction error: the machine is this many times slower than the model.
    bias: float = 1.0

    def __post_init__(self) -> None:
        if not np.isfinite(self.sigma) or self.sigma < 0:
            raise CostModelError(f"NoisyCost.sigma must be a finite number >= 0, got {self.sigma!r}")
        if not (np.isfinite(self.bias) and self.bias > 0):
            raise CostModelError(f"NoisyCost.bias must be a finite number > 0, got {self.bias!r}")
        if self.max_factor is not None and self.max_factor < 1:
            raise CostModelError(f"NoisyCost.max_factor must be >= 1, got {self.max_factor!r}")
        object.__setattr__(self, "_rng", np.random.default_rng(self.seed))

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        factor = float(np.exp(self._rng.normal(0.0, self.sigma))) if self.sigma else 1.0  # type: ignore[attr-defined]
        if self.max_factor is not None:
            factor = min(factor, self.max_factor)
        return self.cost(n_decodes, chunk_tokens) * factor * self.bias
