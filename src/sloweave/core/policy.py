"""Chunk-size policies: SLOWeave and the static baselines, behind one interface.

Every iteration the engine asks a policy how many prompt tokens of the oldest waiting
request to prefill next to the decode batch. The answer depends on three numbers only:
the decode batch size n, the remaining prompt length L of the oldest waiting request
(0 when none waits) and the time budget B until the earliest next-token deadline
(+inf when nothing is decoding). Keeping the interface this narrow is what lets the same
policy object decide in the simulator, the CPU runtime and the vLLM plug-in.
"""

from __future__ import annotations

import math
import re
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from sloweave.core.fastest_chunk import fastest_chunk, prefill_ms, rate_can_peak, rate_pricer
from sloweave.core.largest_chunk import SECANT_ALLOWANCE, largest_fitting
from sloweave.core.size_grid import SizeGrid
from sloweave.core.validate import positive_ms, positive_tokens
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.margins import ConstantMargin, ZeroMargin, chunk_pricer_plus_margin, plus_margin
from sloweave.core.costs.protocols import (
    CostModel,
    CountsQueries,
    HasTileEdges,
    Invertible,
    Margin,
    MonotoneRepair,
    ReadsPrediction,
    WeighsAddedRisk,
    check_monotone_in_chunk,
    uncounted,
)

DEFAULT_MAX_CHUNK_TOKENS = 4096
# Which deadline-safe chunk SLOWeave takes: the one that prefills the most tokens per ms of the
# step (``sloweave.core.fastest_chunk``), or the largest (``sloweave-largest``, for comparison).
CHUNK_CHOICES = ("fastest", "largest")


class Decision(NamedTuple):
    chunk_tokens: int
    # True when even a decode-only iteration is predicted to miss the earliest deadline
    # (T(n, 0) + delta(n, 0) > B): the overload case of SPEC.md.
    infeasible: bool = False


# The decisions every decode-only iteration returns, built once; any other is built with
# ``tuple.__new__``, which skips the Python-level ``Decision.__new__`` of a NamedTuple (every iteration).
_DECODE_ONLY = Decision(0)
_INFEASIBLE = Decision(0, True)
_decision = tuple.__new__


class Policy(Protocol):
    name: str
    # Static policies ignore the budget, so one simulation serves every TPOT target.
    uses_deadlines: bool
    # 1: one prompt per iteration (the paper's setting); None: the chunk is spread over the
    # waiting prompts in FCFS order, several per iteration (Sarathi-Serve, vLLM).
    max_prefills: int | None

    def decide(self, n_decodes: int, waiting_tokens: int, budget_ms: float) -> Decision: ...

    def max_prefill_tokens(self, n_decodes: int) -> float:
        """The most prompt tokens the policy could take with n decodes (bounds the queue scan)."""
        ...


def _check_max_prefills(value: int | None) -> None:
    if value not in (1, None):
        raise ValueError(f"max_prefills must be 1 (one prompt per iteration) or None (several), got {value!r}")


@dataclass(frozen=True)
class SLOWeave:
    """The prefill chunk that meets the earliest deadline and prefills fastest.

    c* = max { c in [0, min(C_max, L)] : T(n, c) + delta(n, c) <= B }, found by a bracketing search because T
    is monotone in c (``largest_fitting``), is the largest safe chunk; every smaller one is safe too.
    ``chunk_choice="fastest"`` takes the safe chunk with the highest rate c / (T(n, c) - T(n, 0) + T(1, 0)),
    prompt tokens per ms the chunk costs (of several prompts, even when all of L fits; a fitted cost weighs each
    with its tokens where c*'s are): c* on a cost whose rate never peaks (``sloweave.core.fastest_chunk``).
    Decode-only when no prompt waits or nothing fits; the largest when nothing decodes (no deadline to protect).
    """

    cost: CostModel = field(default_factory=AnalyticCost)
    margin: Margin = field(default_factory=ZeroMargin)
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS
    repair_non_monotone: bool = False
    max_prefills: int | None = 1
    uses_deadlines: bool = True
    # Two-iteration view (off by default, see ``decide_lookahead``).
    lookahead: bool = False
    chunk_choice: str = "fastest"  # one of CHUNK_CHOICES

    @property
    def name(self) -> str:
        base = "sloweave" if self.max_prefills == 1 else "sloweave-multi"
        if self.chunk_choice == "largest":
            base += "-largest"
        return base + "+lookahead" if self.lookahead else base

    def max_prefill_tokens(self, n_decodes: int) -> float:
        return self.max_chunk_tokens

    def __post_init__(self) -> None:
        positive_tokens(self.max_chunk_tokens, "max_chunk_tokens")
        _check_max_prefills(self.max_prefills)
        if self.chunk_choice not in CHUNK_CHOICES:
            raise ValueError(f"chunk_choice must be one of {CHUNK_CHOICES}, got {self.chunk_choice!r}")
        if self.repair_non_monotone:
            # negative or non-finite times are refused, not repaired (the running maximum would hide them)
            with uncounted(self.cost):
                check_monotone_in_chunk(self.cost, self.max_chunk_tokens, allow_drops=True)
            object.__setattr__(self, "cost", MonotoneRepair(self.cost, self.max_chunk_tokens))
        # A cost that counts queries past its data (ProfileCost) does not count the check's.
        with uncounted(self.cost):
            check_monotone_in_chunk(self.cost, self.max_chunk_tokens)
            # delta is added to T, so T + delta must be monotone too or the search is wrong.
            check_monotone_in_chunk(lambda n, c: self.cost(n, c) + self.margin(n, c), self.max_chunk_tokens)
        # Hot-path helpers, fixed at construction: the decision is called every iteration, so
        # the cost's capabilities are asked here, once (isinstance of a Protocol is slow).
        cost, margin = self.cost, self.margin
        # a margin read from the policy's own prediction takes it rather than asking the cost again
        reads_price = isinstance(margin, ReadsPrediction) and margin.cost is cost
        object.__setattr__(self, "_reads_price", reads_price)
        predicted = plus_margin(cost, margin, reads_price)
        object.__setattr__(self, "_predicted", predicted)
        object.__setattr__(self, "_pricer", chunk_pricer_plus_margin(cost, margin, reads_price))
        object.__setattr__(self, "_set_step", margin.set_step if isinstance(margin, WeighsAddedRisk) else None)
        constant = isinstance(margin, (ZeroMargin, ConstantMargin))
        object.__setattr__(self, "_constant_margin_ms", margin(0, 0) if constant else 0.0)
        object.__setattr__(
            self, "_estimate", cost.chunk_estimate if constant and isinstance(cost, Invertible) else None
        )
        edges = cost.tile_edges if isinstance(cost, HasTileEdges) else None
        object.__setattr__(self, "_tile_edges", list(edges) if edges else None)
        # Tile edges are where the per-token time rises: the rate peaks there. Otherwise the rate is
        # checked on a grid, once: where it never peaks the largest chunk is the fastest, no search.
        seeks_fastest = self.chunk_choice == "fastest"
        if seeks_fastest and not edges:
            with uncounted(cost):
                seeks_fastest = rate_can_peak(cost, self.max_chunk_tokens)
        object.__setattr__(self, "_seeks_fastest", seeks_fastest)
        object.__setattr__(self, "_rate_price", rate_pricer(cost))
        object.__setattr__(self, "_uncounted", cost.uncounted if isinstance(cost, CountsQueries) else nullcontext)

    def predicted_ms(self, n_decodes: int, chunk_tokens: int) -> float:
        return self._predicted(n_decodes, chunk_tokens)

    def margin_and_predicted_ms(self, n_decodes: int, chunk_tokens: int) -> tuple[float, float]:
        """delta(n, c) and T(n, c) + delta(n, c), each computed once (a real engine records both)."""
        margin = self.margin
        if isinstance(margin, ZeroMargin):
            return 0.0, self.cost(n_decodes, chunk_tokens)
        predicted_ms = self.cost(n_decodes, chunk_tokens)
        if self._reads_price:
            margin_ms = margin.margin_for(n_decodes, chunk_tokens, predicted_ms)
        else:
            margin_ms = margin(n_decodes, chunk_tokens)
        return margin_ms, predicted_ms + margin_ms

    def decide(self, n_decodes: int, waiting_tokens: int, budget_ms: float) -> Decision:
        # Cheap comparisons, on the hot path on purpose: a NaN budget compares False with
        # everything and would otherwise pass as "fits", a negative count gives a negative chunk.
        try:
            if not (n_decodes >= 0 and waiting_tokens >= 0 and budget_ms == budget_ms):
                raise TypeError  # one error for every bad argument, raised below
        except TypeError:
            raise ValueError(
                f"decide needs n_decodes >= 0, waiting_tokens >= 0 and a budget_ms that is a number (+inf: no deadline); "
                f"got n_decodes={n_decodes!r}, waiting_tokens={waiting_tokens!r}, budget_ms={budget_ms!r}"
            ) from None
        max_chunk = self.max_chunk_tokens  # a conditional, not min(): a builtin call less per iteration
        upper = waiting_tokens if waiting_tokens < max_chunk else max_chunk
        if self._set_step is not None:  # the margin weighs this step's budget (WeighsAddedRisk)
            self._set_step(n_decodes, budget_ms)
        if n_decodes == 0:  # no deadline to protect: the largest chunk
            return _decision(Decision, (upper, False))
        # ``_predicted_at`` and ``_largest_fitting`` inlined up to the search: this runs every iteration
        pricer = self._pricer
        predicted = self._predicted if pricer is None else pricer(n_decodes)
        decode_only_ms = predicted(n_decodes, 0)
        if decode_only_ms > budget_ms:
            return _INFEASIBLE
        if upper <= 0:
            return _DECODE_ONLY
        chunk = self._fitting_chunk(n_decodes, upper, budget_ms, predicted, decode_only_ms)
        # several prompts' whole offer is weighed too; one prompt's last piece is finished (cut, its rest steps alone)
        if not self._seeks_fastest or not chunk or (chunk >= waiting_tokens and self.max_prefills == 1):
            return _decision(Decision, (chunk, False))
        return _decision(Decision, (self._fastest_safe(n_decodes, chunk), False))

    def _fastest_safe(self, n_decodes: int, largest: int) -> int:
        """The chunk up to ``largest`` (safe) that costs the prompts least per token beside
        ``n_decodes`` decodes (``prefill_ms``): priced without the margin, which is time kept, not
        spent. Its queries are not counted past a profile: only ``largest``'s safety rests on them,
        and its search counted those already."""
        with self._uncounted():
            price = self._rate_price(n_decodes, largest)
            return fastest_chunk(prefill_ms(price, n_decodes, self.cost(1, 0)), n_decodes, largest, self._tile_edges)

    def _predicted_at(self, n_decodes: int) -> CostModel:
        """T + delta as a function of (n, c), for a search that asks this n only."""
        pricer = self._pricer
        return self._predicted if pricer is None else pricer(n_decodes)

    def _largest_fitting(
        self, n_decodes: int, waiting_tokens: int, budget_ms: float, predicted: CostModel | None = None
    ) -> Decision:
        """The largest chunk whose T + delta (``predicted``, ``_predicted_at(n_decodes)`` if not
        given) fits the budget, before weighing tile edges."""
        upper = min(self.max_chunk_tokens, waiting_tokens)
        if n_decodes == 0:
            return Decision(upper)
        if predicted is None:
            predicted = self._predicted_at(n_decodes)
        decode_only_ms = predicted(n_decodes, 0)
        if decode_only_ms > budget_ms:
            return Decision(0, True)
        if upper <= 0:
            return Decision(0)
        return Decision(self._fitting_chunk(n_decodes, upper, budget_ms, predicted, decode_only_ms))

    def _fitting_chunk(
        self, n_decodes: int, upper: int, budget_ms: float, predicted: CostModel, decode_only_ms: float
    ) -> int:
        """The largest chunk in [0, upper] whose T + delta fits the budget, given that 0 fits
        (its T + delta: ``decode_only_ms``)."""
        lo, hi = 0, upper  # invariant: lo fits the budget; hi does not, once checked
        if self._estimate is not None:
            # A linear model can be inverted; the guess is checked against T + delta and
            # only narrows [lo, hi], so the answer is exactly the binary search's.
            # Float rounding can put it one token off either way, so its neighbour is checked.
            guess = self._estimate(n_decodes, budget_ms - self._constant_margin_ms)
            guess = 1 if guess < 1 else upper if upper < guess else guess  # in [1, upper]: min(max(guess, 1), upper)
            if predicted(n_decodes, guess) > budget_ms:
                if predicted(n_decodes, guess - 1) <= budget_ms:
                    return guess - 1
                hi = guess - 1
            elif guess == upper or predicted(n_decodes, guess + 1) > budget_ms:
                return guess
            else:
                lo = guess + 1
        hi_ms = math.nan
        if hi == upper:
            hi_ms = predicted(n_decodes, upper)
            if hi_ms <= budget_ms:
                return upper
        lo_ms = decode_only_ms if lo == 0 else math.nan
        # a tiled cost jumps at its edges, where a secant estimate would miss: it bisects
        allowance = 0 if self._tile_edges is not None else SECANT_ALLOWANCE
        return largest_fitting(predicted, n_decodes, budget_ms, lo, lo_ms, hi, hi_ms, allowance)

    def decide_lookahead(
        self,
        n_decodes: int,
        waiting_tokens: int,
        budget_ms: float,
        head_remaining_tokens: int,
        next_fresh_budget_ms: float,
        banked: bool,
    ) -> Decision:
        """The greedy chunk, shrunk so that the next iteration can still meet its deadline.

        Greedy SLOWeave spends the whole budget now. Two things it ignores reach into the
        next iteration: a chunk that completes the head prompt adds a decode to it (n + 1),
        and with cumulative deadlines (``banked``) time spent now is taken from the next
        iteration's budget, which is ``next_fresh_budget_ms + (B - T(n, c) - delta)``;
        with per-token deadlines it is ``next_fresh_budget_ms`` whatever c is. The answer is
        the largest c <= c_greedy whose next iteration can still run decode-only in time:
        T(n', 0) + delta(n', 0) <= next budget(c). The condition only gets harder as c
        grows, so it is one more binary search (still O(log C_max) cost queries). A subset
        of greedy's deadline-safe chunks: it never breaks this iteration's deadline.
        """
        greedy = self.decide(n_decodes, waiting_tokens, budget_ms)
        if n_decodes == 0 or greedy.infeasible or greedy.chunk_tokens == 0:
            return greedy

        def next_iteration_fits(chunk: int) -> bool:
            n_next = n_decodes + (0 < head_remaining_tokens <= chunk)
            next_budget = next_fresh_budget_ms
            if banked:
                next_budget += budget_ms - self.predicted_ms(n_decodes, chunk)
            return self.predicted_ms(n_next, 0) <= next_budget

        if next_iteration_fits(greedy.chunk_tokens) or not next_iteration_fits(0):
            # Nothing to protect, or the next iteration is late whatever we do now.
            return greedy
        lo, hi = 0, greedy.chunk_tokens  # lo keeps the next iteration feasible, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if next_iteration_fits(mid):
                lo = mid
            else:
                hi = mid
        return Decision(lo)


@dataclass(frozen=True)
class Aging:
    """Starvation control: after ``aging_ms`` without progress the oldest prompt gets a chunk.

    SLOWeave chooses decode-only whenever no chunk fits, so under sustained load the oldest
    prompt can wait forever. After it has waited ``aging_ms`` (since arrival or since it last
    got prompt tokens) it gets ``min(chunk_tokens, waiting)`` tokens even though that breaks
    a deadline; the caller records every such iteration as an SLO exception. The same rule
    as ``BudgetController`` in the vLLM plug-in (engine_budget.py).
    """

    aging_ms: float
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        positive_ms(self.aging_ms, "aging_ms")
        positive_tokens(self.chunk_tokens, "aging chunk_tokens")

    def apply(self, chunk_tokens: int, waiting_tokens: int, waited_ms: float) -> tuple[int, bool]:
        """(chunk, forced): the policy's chunk, or the aging chunk when the head starves."""
        if chunk_tokens == 0 and waiting_tokens > 0 and waited_ms >= self.aging_ms:
            return min(self.chunk_tokens, waiting_tokens), True
        return chunk_tokens, False


class StepDecision(NamedTuple):
    chunk_tokens: int
    infeasible: bool  # even decode-only is predicted to miss the earliest deadline
    aged: bool  # the chunk was forced by aging (an SLO exception)


def decide_step(
    policy: Policy,
    n_decodes: int,
    waiting_tokens: int,
    budget_ms: float,
    aging: Aging | None = None,
    waited_ms: float = 0.0,
    decision: Decision | None = None,
    grid: SizeGrid | None = None,
) -> StepDecision:
    """One step's chunk: the policy's decision, then the aging rule, then the size grid.

    Every body decides through here (the simulator, the vLLM plug-in's ``BudgetController``), so a
    prompt starves, or is rescued, and a step is rounded the same way everywhere. ``decision``: one
    taken another way (the simulator's lookahead); ``waited_ms``: how long the oldest prompt has
    gone without progress. An aged chunk is the size asked for, never rounded.
    """
    chunk, infeasible = policy.decide(n_decodes, waiting_tokens, budget_ms) if decision is None else decision
    aged = False
    if aging is not None:
        chunk, aged = aging.apply(chunk, waiting_tokens, waited_ms)
    if grid is not None and not aged:
        chunk = grid.chunk(chunk, n_decodes, waiting_tokens)
    return StepDecision(chunk, infeasible, aged)


@dataclass(frozen=True)
class FullPrefill:
    """No chunking: the whole remaining prompt goes into one iteration.

    With ``max_prefills=None`` every waiting prompt the batch cap admits is prefilled whole
    in the same iteration, as Orca (and Vidur's ``orca`` scheduler) does.
    """

    max_prefills: int | None = 1
    uses_deadlines: bool = False
    # the machine's model the rule is simulated on (it predicts nothing itself); see make_policy
    cost: CostModel | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_max_prefills(self.max_prefills)

    @property
    def name(self) -> str:
        return "full" if self.max_prefills == 1 else "orca"

    def max_prefill_tokens(self, n_decodes: int) -> float:
        return math.inf

    def decide(self, n_decodes: int, waiting_tokens: int, budget_ms: float) -> Decision:
        return _decision(Decision, (waiting_tokens, False))


@dataclass(frozen=True)
class FixedChunk:
    """Sarathi-style chunked prefill: one chunk of at most C prompt tokens next to all decodes."""

    chunk_tokens: int
    cost: CostModel | None = field(default=None, compare=False)  # the machine's model (see make_policy)

    def __post_init__(self) -> None:
        positive_tokens(self.chunk_tokens, "Fixed-C chunk size")
        object.__setattr__(self, "_full_chunk", Decision(self.chunk_tokens))  # built once: most decisions

    @property
    def name(self) -> str:
        return f"fixed-{self.chunk_tokens}"

    uses_deadlines: bool = False
    max_prefills: int | None = 1

    def max_prefill_tokens(self, n_decodes: int) -> float:
        return self.chunk_tokens

    def decide(self, n_decodes: int, waiting_tokens: int, budget_ms: float) -> Decision:
        # min(C, waiting) without a builtin call, and without a new Decision for a full chunk or none
        if waiting_tokens >= self.chunk_tokens:
            return self._full_chunk
        return _decision(Decision, (waiting_tokens, False)) if waiting_tokens else _DECODE_ONLY


@dataclass(frozen=True)
class TokenBudget:
    """vLLM's ``max_num_batched_tokens`` form: B tokens shared by the decodes and the prefill.

    Decodes are served first (one token each), the prefill gets what is left:
    c = max(0, B - n). With n >= B no prefill runs that iteration. ``budget-B`` gives the
    rest to one prompt (the paper's setting); ``sarathi-B`` (``max_prefills=None``) is
    Sarathi-Serve as its authors schedule: the in-progress prefill first, then new prompts,
    each taking what is left of the budget, so several prompts can share an iteration.
    """

    budget_tokens: int
    max_prefills: int | None = 1
    cost: CostModel | None = field(default=None, compare=False)  # the machine's model (see make_policy)

    def __post_init__(self) -> None:
        positive_tokens(self.budget_tokens, "token budget")
        _check_max_prefills(self.max_prefills)

    @property
    def name(self) -> str:
        return f"{'budget' if self.max_prefills == 1 else 'sarathi'}-{self.budget_tokens}"

    uses_deadlines: bool = False

    def max_prefill_tokens(self, n_decodes: int) -> float:
        return max(0, self.budget_tokens - n_decodes)

    def decide(self, n_decodes: int, waiting_tokens: int, budget_ms: float) -> Decision:
        return _decision(Decision, (min(waiting_tokens, max(0, self.budget_tokens - n_decodes)), False))


_SPEC_RE = re.compile(r"^(fixed|budget|sarathi)-(\d+)$")


def make_policy(
    spec: str,
    cost: CostModel | None = None,
    margin: Margin | None = None,
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
) -> Policy:
    """Build a policy from its name.

    ``sloweave`` / ``sloweave-multi`` (either may end in ``-largest``: the largest deadline-safe chunk
    rather than the fastest, and either with ``+lookahead``), ``full`` / ``orca``, ``fixed-C``, ``budget-B`` (one
    prompt per iteration) or ``sarathi-B`` (several prompts per iteration).

    ``cost`` is the model every policy is simulated on: SLOWeave also decides with it; a static
    rule predicts nothing but keeps it as its machine, so ``simulate(workload, make_policy(name,
    cost=fitted))`` times every policy with ``fitted``, static ones included. A static rule has no margin: one given is refused, not dropped.
    """
    if not isinstance(spec, str):
        raise ValueError(f"a policy is named by a string (e.g. 'sloweave', 'fixed-1024'), got {spec!r}")
    spec = spec.strip().lower()
    base, plus, option = spec.partition("+")
    largest = base.endswith("-largest")
    if largest:
        base = base.removesuffix("-largest")
    if base in ("sloweave", "sloweave-multi") and (not plus or option == "lookahead"):
        return SLOWeave(
            cost=cost or AnalyticCost(),
            margin=margin or ZeroMargin(),
            max_chunk_tokens=max_chunk_tokens,
            max_prefills=1 if base == "sloweave" else None,
            lookahead=bool(plus),
            chunk_choice="largest" if largest else "fastest",
        )
    static = spec in ("full", "orca") or _SPEC_RE.match(spec)
    if static and margin is not None and not isinstance(margin, ZeroMargin):
        raise ValueError(
            f"{spec} is a static rule: it predicts nothing, so it has no margin (give one to sloweave only)"
        )
    if spec in ("full", "orca"):
        return FullPrefill(max_prefills=1 if spec == "full" else None, cost=cost)
    match = _SPEC_RE.match(spec)
    if match:
        kind, size = match.group(1), int(match.group(2))
        if kind == "fixed":
            return FixedChunk(size, cost=cost)
        return TokenBudget(size, max_prefills=1 if kind == "budget" else None, cost=cost)
    raise ValueError(
        f"unknown policy {spec!r}: expected 'sloweave', 'sloweave-multi' (either may end in '-largest', then '+lookahead'), 'full', 'orca', 'fixed-<tokens>', "
        "'budget-<tokens>' or 'sarathi-<tokens>' (e.g. fixed-1024, budget-2048) with a positive whole number of tokens"
    )
