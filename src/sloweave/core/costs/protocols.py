"""What a cost model is, and what one can do beyond T(n, c).

A cost model predicts how long one serving iteration takes, in milliseconds, when it
decodes ``n`` running requests (one token each) and prefills ``c`` prompt tokens of one
waiting request. The policy only needs T to be monotone non-decreasing in ``c``: that is
what makes binary search over the chunk size exact (Proposition 1 in SPEC.md); it is
checked here (``check_monotone_in_chunk``) and, on request, repaired (``MonotoneRepair``).

A cost may do more (read the KV context, price a chunk over the prompts on offer, know its
tile edges, ...): each such capability is a runtime-checkable Protocol below, asked with
``isinstance`` once where a policy, a controller or the simulator's clock is built.

Nothing here imports an engine or the simulator, so the same objects decide in every body.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np


class CostModelError(ValueError):
    """A cost model or margin that the policy cannot use (e.g. not monotone in the chunk)."""


@runtime_checkable
class CostModel(Protocol):
    """T(n, c) in milliseconds; must be monotone non-decreasing in c."""

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float: ...


# ---- what a cost can do beyond T(n, c): declared capabilities --------------------------
#
# A cost model is any T(n, c) (``CostModel``). Some can do more, and say so by having the
# members of one of these protocols; the core asks with ``isinstance(cost, Capability)``
# once, where a policy, a controller or the simulator's clock is built (a runtime_checkable
# isinstance is slow: never per step), and keeps the answer.


@runtime_checkable
class ContextAware(Protocol):
    """A cost that reads the KV context: ``predict`` takes it as arguments; ``__call__(n, c)``
    reads the one last given to ``set_context`` (see ``ContextFeed``: the only caller that sets it
    for a step). ``sloweave.core.costs.fitted.ContextualCost`` and its subclasses are the ones shipped."""

    def set_context(self, decode_kv_tokens: int, prefill_prefix_tokens: int) -> None: ...

    def predict(
        self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int
    ) -> float: ...


@runtime_checkable
class OfferAware(Protocol):
    """A cost that prices a chunk piece by piece over the prompts on offer (``ProfileCost``):
    ``offered`` is FCFS (remaining tokens, prefix) per prompt, None for one piece."""

    def set_offer(self, offered: list[tuple[int, int]] | None) -> None: ...


def predict_each(cost, steps, offers) -> list[float]:
    """``cost.predict(n, c, decode KV, prefix)`` of each step, a chunk over several prompts priced at
    its offer (None: one piece) where the cost reads one; the offer set before is set again after."""
    if not isinstance(cost, OfferAware):
        return [cost.predict(*step) for step in steps]
    # a wrapper hands set_offer to its base, which holds the offer
    kept = getattr(getattr(cost.set_offer, "__self__", cost), "_offer", None)
    predicted = []
    try:
        for step, offer in zip(steps, offers):
            cost.set_offer(offer)
            predicted.append(cost.predict(*step))
    finally:
        cost.set_offer(kept)
    return predicted


def offer_pieces(chunk_tokens: int, first_prefix: int, offer: list[tuple[int, int]]):
    """The pieces (tokens, prefix) of a chunk longer than the first prompt's rest, spread FCFS over
    ``offer`` (``OfferAware``): the first prompt's rest at ``first_prefix`` (the context's), then each
    next prompt's share at its own prefix; past the offer, the rest as one piece on an empty prefix."""
    first = offer[0][0]
    yield first, first_prefix
    left = chunk_tokens - first
    for remaining, prefix in offer[1:]:
        if left <= 0:
            return
        take = left if left < remaining else remaining
        yield take, prefix
        left -= take
    if left > 0:
        yield left, 0


@runtime_checkable
class HasTileEdges(Protocol):
    """A cost whose per-token time rises past these token counts (a GPU's kernel tiles): the
    policy weighs the chunks ending at the edges below the largest safe one (``sloweave.core.fastest_chunk``)."""

    tile_edges: list[int]


@runtime_checkable
class Invertible(Protocol):
    """A cost with a closed-form guess of the largest chunk within a budget (may be off by one;
    the policy checks it against T): it only saves binary-search steps."""

    def chunk_estimate(self, n_decodes: int, budget_ms: float) -> int: ...


@runtime_checkable
class CountsQueries(Protocol):
    """A cost that counts its queries past its data (``ProfileCost.out_of_range``); queries
    inside ``with cost.uncounted():`` (a policy's own checks) are not counted."""

    def uncounted(self) -> AbstractContextManager: ...


@runtime_checkable
class Calibrated(Protocol):
    """A cost corrected online (``CalibratedCost``): ``base`` is the uncorrected model the
    calibrator learns against, asked with an explicit context."""

    base: ContextAware
    calibrator: object


@runtime_checkable
class Wrapper(Protocol):
    """A cost built on another (``NoisyCost``, ``MonotoneRepair``, ``FixedContextCost``, ...)."""

    cost: CostModel


@runtime_checkable
class PricesChunks(Protocol):
    """A cost that prices one decode batch's chunks faster than T(n, c) itself (``ProfileCost``):
    ``chunk_pricer(n)`` is a function of (n, c) giving the same floats as the cost, meant for a
    search that asks that n only."""

    def chunk_pricer(self, n_decodes: int) -> CostModel: ...


@runtime_checkable
class Described(Protocol):
    """A cost that says what a result file records about it (``ProfileCost.describe``)."""

    def describe(self) -> dict: ...


def uncounted(cost: CostModel) -> AbstractContextManager:
    """``cost.uncounted()`` for a cost that counts its queries, else a context that does nothing."""
    return cost.uncounted() if isinstance(cost, CountsQueries) else nullcontext()


class CostContext(NamedTuple):
    """The KV context of one step, as the costs that read it are told it (immutable).

    ``decode_kv_tokens``: the KV the decodes read; ``prefill_prefix_tokens``: the head prompt's
    prefix; ``offer``: the prompts a chunk is taken from, FCFS, as (remaining tokens, prefix),
    or None (one piece)."""

    decode_kv_tokens: int = 0
    prefill_prefix_tokens: int = 0
    offer: list[tuple[int, int]] | None = None


class ContextFeed:
    """The one place a step's KV context reaches the cost models that read it.

    The policy's binary search asks T(n, c) a dozen times per decision, so the context is not
    passed along each query (one more argument through every cost and margin, on the hot path,
    and a signature no plain T(n, c) has); it is set on the models once per step, here, before
    the decision. The models are sorted by capability once, when the feed is built:
    ``ContextAware`` ones get the context, those that are also ``OfferAware`` the offer. Each
    model once, however often it is given. Costs asked outside a step (a result's metrics, the
    online correction's base prediction) take the context as arguments: ``predict``.
    """

    __slots__ = ("context_models", "offer_models", "reads_context", "reads_offer")

    def __init__(self, *models: CostModel | None) -> None:
        self.context_models: list[ContextAware] = []
        for model in models:
            if isinstance(model, ContextAware) and not any(model is seen for seen in self.context_models):
                self.context_models.append(model)
        self.offer_models: list[OfferAware] = [m for m in self.context_models if isinstance(m, OfferAware)]
        self.reads_context = bool(self.context_models)
        self.reads_offer = bool(self.offer_models)

    def set_context(self, decode_kv_tokens: int, prefill_prefix_tokens: int) -> None:
        for model in self.context_models:
            model.set_context(decode_kv_tokens, prefill_prefix_tokens)

    def set_offer(self, offered: list[tuple[int, int]] | None) -> None:
        for model in self.offer_models:
            model.set_offer(offered)

    def feed(self, context: CostContext) -> None:
        """Both at once, from one ``CostContext``."""
        self.set_context(context.decode_kv_tokens, context.prefill_prefix_tokens)
        self.set_offer(context.offer)


@runtime_checkable
class Margin(Protocol):
    """delta(n, c) in milliseconds, added to the prediction before comparing with the budget."""

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float: ...


@runtime_checkable
class ReadsPrediction(Protocol):
    """A margin computed from its ``cost``'s prediction T(n, c) (a fraction of it, a quantile of
    steps predicted near it): given T, ``margin_for`` is delta(n, c) without asking ``cost``
    again, the same float. When ``cost`` is the policy's own, a chunk search prices each chunk
    once, not twice."""

    cost: CostModel

    def margin_for(self, n_decodes: int, chunk_tokens: int, predicted_ms: float) -> float: ...


@runtime_checkable
class ProportionalPerStep(Protocol):
    """A margin delta = r x T(n, c) whose r is one number for a whole decision
    (``calibrated.AdaptiveMargin``): ``step_fraction()`` is that r, or None when it depends on the
    chunk. A chunk search then prices T + r T without asking the margin for every chunk."""

    def step_fraction(self) -> float | None: ...


@runtime_checkable
class WeighsAddedRisk(Protocol):
    """A margin told each decision's decode batch and time budget first (``set_step``), so that it
    holds a chunk back only for the risk the chunk adds to what a decode-only step already runs
    (``calibrated.AdaptiveMargin``): a stall that delays any step is no reason to prefill nothing."""

    def set_step(self, n_decodes: int, budget_ms: float) -> None: ...


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
