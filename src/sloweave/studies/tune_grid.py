"""The default sweep of ``sloweave tune``: the budgets the cost model, the targets and the input
call for (``model_grid``), on a ladder of powers of two and the 1.5x points between, between two
soft ends (where the sweep starts) inside two hard limits (where edge extension stops).
``sloweave.studies.tune`` sweeps it."""

from __future__ import annotations

from dataclasses import dataclass

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.protocols import ContextAware, CostModel, uncounted
from sloweave.sim.workloads import mean_context_tokens
from sloweave.studies.sources import LoadSource

# The ladder a default sweep walks: powers of two and the 1.5x points between them (16, 24,
# 32, 48, ...; the old fixed sweep, 256 ... 8192, lies on it); --quick walks the powers of two.
LADDER_FLOOR_TOKENS = 16  # the low hard limit: a per-step budget below it is not a setting anyone runs
EXTENSION_STEPS = 2  # ladder values added past the edge per round: one doubling on the 1.5x ladder
MAX_DECODE_BATCH = 1 << 16  # where the search for the decode batch that fills a TPOT step stops


def ladder(up_to_tokens: int, coarse: bool = False) -> list[int]:
    """The ladder from ``LADDER_FLOOR_TOKENS`` up to its first value >= ``up_to_tokens``."""
    values, power = [], LADDER_FLOOR_TOKENS
    while not values or values[-1] < up_to_tokens:
        values.append(power)
        if not coarse and power < up_to_tokens:
            values.append(power * 3 // 2)
        power *= 2
    return values


@dataclass(frozen=True)
class SweepEnd:
    budget_tokens: int
    reason: str


@dataclass(frozen=True)
class BudgetGrid:
    """The default sweep, from the cost model, the targets and the input: the ladder between two
    soft ends (where the sweep starts) inside two hard limits (where extension stops)."""

    values_tokens: tuple[int, ...]  # the ladder from the low to the high hard limit
    low: SweepEnd
    high: SweepEnd
    low_limit: SweepEnd
    high_limit: SweepEnd
    context_tokens: float  # the KV context per decode the ends were priced at
    coarse: bool

    @property
    def budgets_tokens(self) -> list[int]:
        return [v for v in self.values_tokens if self.low.budget_tokens <= v <= self.high.budget_tokens]

    def beyond(self, edge_tokens: int, side: str, count: int = EXTENSION_STEPS) -> list[int]:
        """The next ``count`` ladder values past ``edge_tokens`` on ``side`` ("low" or "high")."""
        if side == "low":
            return [v for v in self.values_tokens if v < edge_tokens][-count:]
        return [v for v in self.values_tokens if v > edge_tokens][:count]

    def at_limit(self, budget_tokens: int, side: str) -> bool:
        if side == "low":
            return budget_tokens <= self.low_limit.budget_tokens
        return budget_tokens >= self.high_limit.budget_tokens

    def describe(self) -> dict:
        ends = {"low": self.low, "high": self.high, "low_limit": self.low_limit, "high_limit": self.high_limit}
        return {
            "ladder": "powers of two" if self.coarse else "powers of two and 1.5x between",
            **{f"{name}_tokens": end.budget_tokens for name, end in ends.items()},
            **{f"{name}_reason": end.reason for name, end in ends.items()},
            "context_per_decode_tokens": self.context_tokens,
        }


def model_grid(
    source: LoadSource, rule: str, tpot_ms: float, ttft_ms: float, cost: CostModel | None, coarse: bool = False
) -> BudgetGrid:
    """The default sweep's ends, by the cost model at the input's mean KV context per decode.

    Low end: the ladder value at or below the decode batch whose step alone fills the TPOT
    target (a smaller shared budget leaves a full batch's prompts nothing; the floor for the
    ``fixed`` rule, whose decodes do not count). High end: the largest ladder value whose prompt
    prefills in one step within the TTFT target. Hard limits: the ladder's floor, and the ladder
    value at or above the longest prompt (a larger budget prefills every prompt in one step).
    """
    workloads = [source.workload(seed, 1.0) for seed in range(source.num_seeds)]
    longest = int(max(w.prompt_tokens.max() for w in workloads))
    context = mean_context_tokens(*workloads)
    step_ms = _step_pricer(cost or AnalyticCost(), context)
    values = ladder(longest, coarse)
    low_limit = SweepEnd(values[0], "the ladder's floor")
    high_limit = SweepEnd(
        values[-1], f"the longest prompt is {longest:,} tokens: a larger budget prefills any in one step"
    )
    low = _low_end(values, rule, tpot_ms, step_ms, context)
    return BudgetGrid(
        tuple(values), low, _high_end(values, ttft_ms, step_ms, low), low_limit, high_limit, context, coarse
    )


def _step_pricer(cost: CostModel, context_tokens: float):
    """T(n, c) with each decode at ``context_tokens`` and the chunk at no prefix; not counted as
    queries past a profile's data (the simulation counts its own)."""
    reads_context = isinstance(cost, ContextAware)

    def step_ms(n_decodes: int, chunk_tokens: int) -> float:
        with uncounted(cost):
            if reads_context:
                return float(cost.predict(n_decodes, chunk_tokens, round(n_decodes * context_tokens), 0))
            return float(cost(n_decodes, chunk_tokens))

    return step_ms


def _low_end(values: list[int], rule: str, tpot_ms: float, step_ms, context: float) -> SweepEnd:
    if rule == "fixed":
        return SweepEnd(values[0], "decodes do not count against a fixed chunk: from the ladder's floor")
    if (one_ms := step_ms(1, 0)) > tpot_ms:
        over = f"over the {tpot_ms:g} ms TPOT target: from the ladder's floor"
        return SweepEnd(values[0], f"one decode alone takes {one_ms:.3g} ms by the cost model, {over}")
    lo, hi = 1, 2  # step_ms(lo, 0) fits; find the last n that does by doubling, then bisection
    while hi <= MAX_DECODE_BATCH and step_ms(hi, 0) <= tpot_ms:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if step_ms(mid, 0) <= tpot_ms else (lo, mid)
    fill = f"fill a {tpot_ms:g} ms step by the cost model; a smaller budget leaves their prompts nothing"
    low = max([v for v in values if v <= lo] or [values[0]])
    return SweepEnd(low, f"{lo:,} decodes at the mean context ({context:,.0f} tokens) {fill}")


def _high_end(values: list[int], ttft_ms: float, step_ms, low: SweepEnd) -> SweepEnd:
    high = low.budget_tokens
    for value in (v for v in values if v > low.budget_tokens):
        prefill_ms = step_ms(0, value)
        if prefill_ms > ttft_ms:
            return SweepEnd(
                high,
                f"a {high:,}-token prompt prefills in {step_ms(0, high):.3g} ms by the cost model, "
                f"{value:,} tokens in {prefill_ms:.3g} ms, over the {ttft_ms:g} ms TTFT target",
            )
        high = value
    return SweepEnd(high, "the high hard limit: every prompt prefills in one step within the TTFT target")
