"""Safety margins delta(n, c), in milliseconds, added to the prediction before it is compared
with the budget (T + delta must stay monotone in c; the policy checks it)."""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Callable

from sloweave.core.costs.protocols import CostModel, CostModelError, Margin, PricesChunks, ProportionalPerStep
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
        return self.margin_for(n_decodes, chunk_tokens, self.cost(n_decodes, chunk_tokens))

    def margin_for(self, n_decodes: int, chunk_tokens: int, predicted_ms: float) -> float:
        return self.fraction * predicted_ms


def plus_margin(price: CostModel, margin: Margin, reads_price: bool) -> CostModel:
    """T + delta as a function of (n, c), ``price`` giving T. With ``reads_price`` the margin is
    computed from that T (``ReadsPrediction``), so a chunk search asks for T once per chunk, not
    twice (once more inside the margin): the same floats at half the cost queries."""
    if isinstance(margin, ZeroMargin):
        return price
    if not reads_price:
        return lambda n, c: price(n, c) + margin(n, c)
    margin_for = margin.margin_for

    def predicted(n_decodes: int, chunk_tokens: int) -> float:
        predicted_ms = price(n_decodes, chunk_tokens)
        return predicted_ms + margin_for(n_decodes, chunk_tokens, predicted_ms)

    return predicted


def chunk_pricer_plus_margin(cost: CostModel, margin: Margin, reads_price: bool) -> Callable[[int], CostModel] | None:
    """n -> T + delta as a function of (n, c), faster for one n (a chunk search), where the cost
    offers it; None where it does not."""
    if not isinstance(cost, PricesChunks):
        return None
    chunk_pricer = cost.chunk_pricer
    if isinstance(margin, ZeroMargin):
        return chunk_pricer
    if not (reads_price and isinstance(margin, ProportionalPerStep)):
        return lambda n_decodes: plus_margin(chunk_pricer(n_decodes), margin, reads_price)
    step_fraction = margin.step_fraction

    def pricer(n_decodes: int) -> CostModel:
        fraction = step_fraction()  # after the margin was told the step (the policy's order)
        if fraction is None:
            return plus_margin(chunk_pricer(n_decodes), margin, reads_price)
        return _plus_fraction(chunk_pricer(n_decodes), fraction)

    return pricer


def _plus_fraction(price: CostModel, fraction: float) -> CostModel:
    """T + r T, the same float as ``plus_margin`` with a margin r x T."""

    def predicted(n_decodes: int, chunk_tokens: int) -> float:
        predicted_ms = price(n_decodes, chunk_tokens)
        return predicted_ms + fraction * predicted_ms

    return predicted
