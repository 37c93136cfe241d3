"""The deadline-safe chunk that prefills fastest: the most prompt tokens per millisecond it costs.

SLOWeave's binary search gives the largest chunk whose T + delta fits the budget. Every smaller
chunk fits too (T is monotone in c), so any of them is deadline-safe; the question is which one
prefills fastest. Served at a steady rate, every request's decodes and prompt tokens are done
whatever the chunk: what a chunk size changes is how many steps the prompts take, and each step
pays a fixed part (the engine's step, one decode) again. So the time a chunk costs the prompts is
what it adds to its step, T(n, c) - T(n, 0), plus that fixed part, F = T(1, 0); the rate is
c / (T(n, c) - T(n, 0) + F) (``prefill_ms``). Not c / T(n, c): that would charge the decodes,
done anyway, to the chunk and favour large chunks in a full batch. Not with delta: the margin is
time kept, not spent (an additive margin would favour them too).

On a cost whose per-token time does not rise with the chunk (T = a + b c, the analytic model)
the rate only grows with c and the largest chunk is the answer. On a measured cost it need not
be: a CPU's matrix products slow down per token past a cache-sized chunk, a GPU's kernels run in
tiles, so T jumps just past each tile edge.

Not every rise is one a smaller chunk saves. A token's attention reads every token before it in
its prompt, however the prompt is cut: a chunk of c tokens at prefix p pays k c (p + c / 2), and
the tokens a smaller chunk leaves pay theirs in the next step, at a larger prefix (measured on
vLLM's CPU build: a 512-token chunk 8.1 ms as a prompt's first, 18.4 ms after 1,536 of it). So a
cost that reads the prefix (``at_held_positions``) is asked for every candidate with its tokens
centred where the largest safe chunk's are, at prefix p + (C - c) / 2: the rate then weighs only
what cutting changes (the step's fixed part, a rise in the matrix products), not where in the
prompt the tokens sit.

``rate_can_peak`` decides once, when a policy is built, whether the search is worth running;
``fastest_chunk`` is the search, a bounded number of extra cost queries per decision.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from functools import partial

import numpy as np

from sloweave.core.costs.protocols import ContextAware, CostModel, PricesChunks

# Probes below the largest safe chunk C at C * LADDER_RATIO ** (1, 2, 4, 8, ...): the first
# probe is close (a peak just below C costs little), later ones reach a peak far below in a few.
LADDER_RATIO = 0.9
# The refinement stops once the peak is bracketed within this factor: on the worst rate shape of
# a convex cost, c / (a + k c^2), a chunk within a factor x of the peak keeps 2 / (x + 1/x) of its
# rate, over 99.3 % at 1.12.
BRACKET_RATIO = 1.12
GOLDEN = 0.3819660112501051  # (3 - sqrt(5)) / 2: the golden section of a bracket, in log c
MAX_REFINEMENTS = 12
# The rate check's grid: decode counts (no decodes: no deadline, no search), chunk points, and
# KV contexts a context-aware cost is checked at (decodes' KV tokens, the chunked prompt's prefix).
_CHECK_DECODES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_CHECK_POINTS = 129
_CHECK_CONTEXTS = ((0, 8192), (131_072, 0))


def prefill_ms(price: CostModel, n_decodes: int, one_decode_ms: float) -> CostModel:
    """(n, c) -> T(n, c) - T(n, 0) + F for n = ``n_decodes``: the time a chunk costs the prompts.
    ``price`` gives T; F, the part of a step a larger chunk spreads over more prompt tokens, is
    the step of one decode, ``one_decode_ms`` = T(1, 0) (no more than the decode-only step)."""
    decode_only_ms = price(n_decodes, 0)
    fixed_ms = one_decode_ms if one_decode_ms < decode_only_ms else decode_only_ms
    offset_ms = fixed_ms - decode_only_ms
    return lambda n, c: price(n, c) + offset_ms


def reads_positions(cost: CostModel) -> bool:
    """Whether ``at_held_positions`` applies: a cost that prices a chunk at any prefix it is given,
    in plain arithmetic, with the prompts on offer (``prices_any_prefix``: the fitted regression and
    its corrected form). An operator profile re-reads its rows per prefix and prices the offer only
    at the context set: it keeps the rate as cut."""
    return getattr(cost, "prices_any_prefix", False)


def at_held_positions(cost, largest: int) -> CostModel:
    """(n, c) -> T(n, c) at the context set, with the chunk's prefix moved to p + (``largest`` - c) / 2:
    every candidate chunk up to ``largest`` priced with its tokens centred where ``largest``'s are."""
    kv, prefix, predict = cost.decode_kv_tokens, cost.prefill_prefix_tokens, cost.predict
    return lambda n, c: predict(n, c, kv, prefix + (largest - c) / 2)


def rate_pricer(cost: CostModel) -> Callable[[int, int], CostModel]:
    """(n, largest) -> the T(n, c) a decision's rate is weighed with: ``at_held_positions`` for a cost
    that ``reads_positions``, else the cost's pricer for this n (``PricesChunks``) or the cost itself.
    Module-level functions, partially applied: a policy is pickled to the worker processes of a study."""
    if reads_positions(cost):
        return partial(_at_held_positions_for, cost)
    return partial(_chunk_pricer_for if isinstance(cost, PricesChunks) else _cost_itself, cost)


def _at_held_positions_for(cost, n_decodes: int, largest: int) -> CostModel:
    return at_held_positions(cost, largest)


def _chunk_pricer_for(cost, n_decodes: int, largest: int) -> CostModel:
    return cost.chunk_pricer(n_decodes)


def _cost_itself(cost: CostModel, n_decodes: int, largest: int) -> CostModel:
    return cost


def rate_can_peak(cost: CostModel, max_chunk_tokens: int) -> bool:
    """Whether c / ``prefill_ms`` decreases anywhere on a grid of n and c in [1, C_max].

    Asked once, when a policy is built (the caller makes the queries uncounted). Where it never
    decreases, the largest safe chunk prefills fastest and the search is skipped: no extra query
    per decision. A cost that reads the KV context is checked at the context it holds and at a
    few more through ``predict`` (the context is not set on a model an engine may be feeding); a
    peak only at another context goes unseen, and that cost keeps the largest chunk.
    """
    chunks = np.unique(np.linspace(1, max_chunk_tokens, _CHECK_POINTS).round().astype(int))
    if _rate_drops(cost, chunks):
        return True
    if isinstance(cost, ContextAware):
        for kv_tokens, prefix_tokens in _CHECK_CONTEXTS:
            if _rate_drops(lambda n, c: cost.predict(n, c, kv_tokens, prefix_tokens), chunks):
                return True
    return False


def _rate_drops(price: CostModel, chunks: np.ndarray) -> bool:
    for n in _CHECK_DECODES:
        spent = prefill_ms(price, n, price(1, 0))
        rates = chunks / np.array([spent(n, int(c)) for c in chunks], dtype=float)
        # a relative tolerance: a rate that is flat (T proportional to c) must not read as a peak
        if np.any(np.diff(rates) < -1e-9 * rates[1:]):
            return True
    return False


def fastest_chunk(
    predicted: Callable[[int, int], float], n_decodes: int, largest: int, tile_edges: list[int] | None
) -> int:
    """The chunk in [1, largest] that prefills fastest, ``largest`` being the largest safe one
    and ``predicted`` the time a chunk costs (``prefill_ms``; any cost monotone in c).

    A ladder of probes at ``largest * LADDER_RATIO ** (1, 2, 4, ...)`` walks down while each
    prefills faster than the best so far, which brackets the peak of a rate with one peak; a golden-section search in log c
    narrows the bracket to ``BRACKET_RATIO``; the chunks ending at the tile edges just below
    ``largest`` and below the best (``tile_edges``, token counts) are weighed last. A chunk
    replaces the best only when it prefills strictly faster, so the answer never prefills slower
    than ``largest`` nor than the edge below it. Every candidate is smaller than ``largest``,
    hence deadline-safe. Cost queries: 1 for ``largest``, at most 8 on the ladder from 4,096
    tokens, at most ``MAX_REFINEMENTS``, and at most 2 tile edges.
    """
    best, best_ms, low, high = _ladder(predicted, n_decodes, largest)
    if high > low * BRACKET_RATIO:
        best, best_ms = _refine(predicted, n_decodes, best, best_ms, low, high)
    if tile_edges:
        for top in (largest, best):
            i = bisect.bisect_left(tile_edges, n_decodes + top)
            edge_chunk = tile_edges[i - 1] - n_decodes if i else 0
            if 0 < edge_chunk < largest and edge_chunk != best:
                edge_ms = predicted(n_decodes, edge_chunk)
                if edge_chunk * best_ms > best * edge_ms:
                    best, best_ms = edge_chunk, edge_ms
    return best


def _ladder(predicted: Callable[[int, int], float], n_decodes: int, largest: int) -> tuple[int, float, int, int]:
    """(best, its T + delta, low, high): probes walk down from ``largest`` while they prefill
    faster; the first slower one (or 1) is ``low``, the probe above the best is ``high``."""
    best, best_ms = largest, predicted(n_decodes, largest)
    high, exponent = largest, 1
    while best > 1:
        probe = int(largest * LADDER_RATIO**exponent)
        probe = 1 if probe < 1 else best - 1 if probe >= best else probe
        probe_ms = predicted(n_decodes, probe)
        if probe * best_ms <= best * probe_ms:  # not faster: the peak lies above the probe
            return best, best_ms, probe, high
        high, best, best_ms = best, probe, probe_ms
        exponent *= 2
    return best, best_ms, 1, high


def _refine(
    predicted: Callable[[int, int], float], n_decodes: int, best: int, best_ms: float, low: int, high: int
) -> tuple[int, float]:
    """Golden-section search in log c for the fastest chunk in [low, high], ``best`` inside it:
    each probe splits the wider side of the best, and the side past a slower probe is dropped."""
    for _ in range(MAX_REFINEMENTS):
        if high <= low * BRACKET_RATIO:
            break
        upper_side = high * low > best * best  # high / best > best / low: the wider side is above
        probe = round(best * (high / best) ** GOLDEN) if upper_side else round(best / (best / low) ** GOLDEN)
        if probe == best:
            probe += 1 if upper_side else -1
        if not low < probe < high:
            break  # the bracket is down to whole tokens
        probe_ms = predicted(n_decodes, probe)
        if probe * best_ms > best * probe_ms:  # faster: the bracket closes on the probe
            low, high = (best, high) if probe > best else (low, best)
            best, best_ms = probe, probe_ms
        elif probe > best:
            high = probe
        else:
            low = probe
    return best, best_ms
