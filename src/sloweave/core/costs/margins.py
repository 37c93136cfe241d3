"""Safety margins delta(n, c), in milliseconds, added to the prediction before it is compared
with the budget (T + delta must stay monotone in c; the policy checks it)."""

from __future__ import annotations

from dataclasses import dataclass

from sloweave.core.costs.protocols import CostModel, CostModelError
from sloweave.core.validate import MARGIN_MS, non_negative_number


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
