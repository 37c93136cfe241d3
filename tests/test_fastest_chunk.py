"""SLOWeave's fastest deadline-safe chunk (``sloweave.core.fastest_chunk``).

Among the chunks whose T + delta fits the budget, the one with the most prompt tokens per ms the
chunk costs (what it adds to its step plus the step of one decode, the margin left out); on a
cost whose rate never peaks (affine, the analytic model) the largest, with no extra cost query.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.fitted import RegressionCost
from sloweave.core.costs.margins import ConstantMargin
from sloweave.core.costs.profile_fit import fit_profile_file
from sloweave.core.fastest_chunk import BRACKET_RATIO, MAX_REFINEMENTS, fastest_chunk, prefill_ms
from sloweave.core.policy import SLOWeave, make_policy

CPU_PROFILE = Path(__file__).resolve().parent.parent / "benchmarks" / "results-vllm-cpu" / "at-load" / "profile.csv"


class QuadraticCost:
    """T(n, c) = a + b n + p c + k c^2: per-token time rising with the chunk when k > 0."""

    def __init__(self, a, b, p, k):
        self.a, self.b, self.p, self.k = a, b, p, k
        self.queries = 0

    def __call__(self, n, c):
        self.queries += 1
        return self.a + self.b * n + self.p * c + self.k * c * c


def rate(cost, n, c):
    """Prompt tokens per ms the chunk costs: c / (T(n, c) - T(n, 0) + min(T(1, 0), T(n, 0)))."""
    return c / (cost(n, c) - cost(n, 0) + min(cost(1, 0), cost(n, 0)))


def largest_safe(cost, n, upper, budget):
    """The largest chunk in [0, upper] whose T fits the budget (T is monotone: scan down)."""
    for c in range(upper, -1, -1):
        if cost(n, c) <= budget:
            return c
    return None


quadratics = st.builds(
    QuadraticCost,
    a=st.floats(0.05, 20.0),
    b=st.floats(0.0, 0.5),
    p=st.floats(0.0, 0.05),
    k=st.one_of(st.just(0.0), st.floats(-8.0, -3.0).map(lambda e: 10.0**e)),  # log-uniform: peaks anywhere
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    cost=quadratics,
    n=st.integers(1, 300),
    waiting=st.integers(1, 8000),
    budget=st.floats(0.1, 300.0),
    max_chunk=st.integers(1, 4096),
)
def test_the_chosen_chunk_is_safe_no_larger_no_slower_and_within_1_percent_of_the_fastest(
    cost, n, waiting, budget, max_chunk
):
    policy = SLOWeave(cost=cost, max_chunk_tokens=max_chunk)
    largest_policy = SLOWeave(cost=cost, max_chunk_tokens=max_chunk, chunk_choice="largest")
    upper = min(waiting, max_chunk)
    chunk, infeasible = policy.decide(n, waiting, budget)
    largest = largest_safe(cost, n, upper, budget)
    assert largest_policy.decide(n, waiting, budget) == ((0, True) if largest is None else (largest, False))
    if largest is None:
        assert (chunk, infeasible) == (0, True)
        return
    assert not infeasible and cost(n, chunk) <= budget and chunk <= largest
    # several prompts on offer: the whole offer is weighed like any chunk
    multi = SLOWeave(cost=cost, max_chunk_tokens=max_chunk, max_prefills=None).decide(n, waiting, budget)
    assert multi.chunk_tokens <= largest and cost(n, multi.chunk_tokens) <= budget
    if largest == 0:  # nothing fits
        assert chunk == multi.chunk_tokens == 0
        return
    rates = [rate(cost, n, c) for c in range(1, largest + 1)]
    assert rate(cost, n, multi.chunk_tokens) >= max(rate(cost, n, largest), 0.99 * max(rates))
    if largest == waiting:  # one prompt's rest fits: it is finished
        assert chunk == largest
        return
    assert rate(cost, n, chunk) >= rate(cost, n, largest)
    assert rate(cost, n, chunk) >= 0.99 * max(rates)
    if cost.k == 0.0:  # affine: the rate only grows with the chunk
        assert chunk == largest


@settings(max_examples=100, deadline=None, derandomize=True)
@given(cost=quadratics, n=st.integers(1, 300), budget=st.floats(0.1, 300.0))
def test_a_search_asks_a_bounded_number_of_extra_queries(cost, n, budget):
    fastest = SLOWeave(cost=cost)
    largest = SLOWeave(cost=cost, chunk_choice="largest")
    cost.queries = 0
    largest.decide(n, 100_000, budget)
    plain = cost.queries
    cost.queries = 0
    fastest.decide(n, 100_000, budget)
    # the decode-only and one-decode steps, one for the largest chunk, at most 8 ladder probes
    # from 4,096 tokens, the refinements
    assert cost.queries - plain <= 2 + 1 + 8 + MAX_REFINEMENTS
    if not fastest._seeks_fastest:
        assert cost.queries == plain


@pytest.mark.parametrize(
    "cost", [AnalyticCost(), AnalyticCost(decode_per_req_ms=1.0), QuadraticCost(2.0, 0.05, 0.01, 0.0)]
)
def test_a_cost_whose_rate_never_peaks_keeps_the_largest_chunk_with_no_extra_query(cost):
    policy = SLOWeave(cost=cost, margin=ConstantMargin(0.5))
    assert not policy._seeks_fastest
    for n, budget in ((1, 5.0), (4, 10.0), (64, 25.0), (200, 40.0), (8, 300.0)):
        assert policy.decide(n, 100_000, budget) == policy._largest_fitting(n, 100_000, budget)


def test_a_convex_cost_takes_the_chunk_at_its_peak_rate():
    # T = 4 + 0.01 c + 1e-5 c^2 at n = 0 terms aside: the rate peaks at sqrt(4 / 1e-5) = 632 tokens
    cost = QuadraticCost(4.0, 0.0, 0.01, 1e-5)
    policy = SLOWeave(cost=cost)
    assert policy._seeks_fastest
    largest = policy._largest_fitting(1, 5000, 100.0).chunk_tokens
    chunk = policy.decide(1, 5000, 100.0).chunk_tokens
    assert largest > 2000 and abs(chunk - 632) < 632 * (BRACKET_RATIO - 1)
    assert policy.decide(1, 1500, 100.0).chunk_tokens == 1500  # one prompt's rest fits: finished
    # several prompts' whole offer past the peak is cut at it too (one large step would prefill
    # them slower; the rest joins the next step's prompts); one below the peak is taken whole
    multi = SLOWeave(cost=cost, max_prefills=None)
    assert abs(multi.decide(1, 1500, 100.0).chunk_tokens - 632) < 632 * (BRACKET_RATIO - 1)
    assert multi.decide(1, 400, 100.0).chunk_tokens == 400
    assert make_policy("sloweave-largest", cost=cost).decide(1, 5000, 100.0).chunk_tokens == largest


def test_the_decodes_and_the_margin_do_not_buy_a_larger_chunk():
    """The decodes are done whatever the chunk and the margin is time kept, not spent: neither is
    charged to the chunk. T = 4 + 0.5 n + 0.01 c + 1e-5 c^2: the rate per ms the chunk costs peaks
    at sqrt(4.5 / 1e-5) = 671 tokens at every batch size and margin (charging the step's 104 ms of
    200 decodes to it would put the peak at 3,225; a 20 ms margin at 2,100 with one decode)."""
    cost = QuadraticCost(4.0, 0.5, 0.01, 1e-5)
    for margin in (ConstantMargin(0.0), ConstantMargin(20.0)):
        policy = SLOWeave(cost=cost, margin=margin)
        for n in (1, 50, 200):
            chunk = policy.decide(n, 100_000, 1_000.0).chunk_tokens
            assert abs(chunk - 671) < 671 * (BRACKET_RATIO - 1), (margin, n, chunk)


class TiledCost:
    """1 + 0.01 n + 0.01 (n + c) + a 2 ms ramp over the 8 tokens past every 128 (a GPU's tile step)."""

    tile_edges = [128, 256, 384]

    def __call__(self, n, c):
        if not c:
            return 1.0 + 0.01 * n
        tokens = n + c
        steps = sum(min(1.0, max(0.0, (tokens - edge) / 8)) for edge in self.tile_edges)
        return 1.0 + 0.01 * n + 0.01 * tokens + 2.0 * steps


def tile_edge_rule(cost, n, largest):
    """The rule before the search: the largest chunk, or the one ending at the edge below if faster."""
    i = bisect.bisect_left(cost.tile_edges, n + largest)
    edge_chunk = cost.tile_edges[i - 1] - n if i else 0
    if edge_chunk > 0 and rate(cost, n, edge_chunk) > rate(cost, n, largest):
        return edge_chunk
    return largest


@settings(max_examples=200, deadline=None, derandomize=True)
@given(n=st.integers(1, 300), budget=st.floats(1.0, 12.0))
def test_with_tile_edges_the_tile_edge_rule_is_kept_or_improved(n, budget):
    cost = TiledCost()
    policy = SLOWeave(cost=cost)
    largest, infeasible = policy._largest_fitting(n, 100_000, budget)
    chunk = policy.decide(n, 100_000, budget).chunk_tokens
    if infeasible or not largest:
        assert chunk == 0
        return
    assert cost(n, chunk) <= budget and chunk <= largest
    assert rate(cost, n, chunk) >= rate(cost, n, tile_edge_rule(cost, n, largest))


def test_on_the_cpu_engines_profile_both_fitted_models_take_a_smaller_faster_chunk():
    """The CPU engine's fitted costs at a 39 ms budget with a few decodes. Its measured steps cost more
    per token in a large chunk: the table follows them, and the regression has a term for it, so
    for both the fastest chunk is smaller than the largest fitting one and prefills faster. (A regression without that term is affine in the chunk and
    would keep the largest.)"""
    fit = fit_profile_file(CPU_PROFILE)
    for kind in ("regression", "table"):
        cost = fit.cost(kind)
        policy = SLOWeave(cost=cost)
        assert policy._seeks_fastest, kind
        for n in (2, 4, 8):
            largest = policy._largest_fitting(n, 8000, 39.0).chunk_tokens
            chunk = policy.decide(n, 8000, 39.0).chunk_tokens
            assert cost(n, chunk) <= 39.0 and chunk < largest, kind
            assert rate(cost, n, chunk) > 1.1 * rate(cost, n, largest), kind
    assert fit.cost("regression").as_dict()["coefficients"]["per_1m_chunk_pairs_ms"] > 0


def attention_cost(chunk_pairs_ms: float, prefix_pairs_ms: float, base_ms: float = 3.0) -> RegressionCost:
    """A fitted CPU cost (the coefficients of vLLM's CPU build, rounded) with its two pair terms
    set: a chunk's own token pairs c^2 / 2 and its pairs with the prefix c p, in ms per million."""
    return RegressionCost([base_ms, 0.55, 0.033, 0.92, 0.0098, 0.0, 0.0, chunk_pairs_ms, prefix_pairs_ms, 0.0])


def held_rate(cost, n, c, largest):
    """``rate`` with the chunk's prefix moved to p + (largest - c) / 2 (its tokens where largest's are)."""
    kv, prefix = cost.decode_kv_tokens, cost.prefill_prefix_tokens
    return rate(lambda n_, c_: cost.predict(n_, c_, kv, prefix + (largest - c) / 2), n, c)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    chunk_pairs_ms=st.one_of(st.just(0.0), st.floats(0.5, 40.0)),
    prefix_pairs_ms=st.one_of(st.just(0.0), st.floats(0.5, 40.0)),
    base_ms=st.floats(0.1, 10.0),
    n=st.integers(1, 200),
    prefix=st.integers(0, 6000),
    budget=st.floats(1.0, 200.0),
    max_prefills=st.sampled_from([1, None]),
)
def test_a_cost_that_reads_the_prefix_is_weighed_with_the_tokens_where_the_largest_safe_chunks_are(
    chunk_pairs_ms, prefix_pairs_ms, base_ms, n, prefix, budget, max_prefills
):
    """Attention is paid by a token's position, however the prompt is cut: the rate weighs a
    candidate chunk with its prefix at p + (C - c) / 2. The chunk stays safe and no larger than
    the largest safe one C, is within 1 % of the fastest so weighed, and where the prefix pairs
    cost at least the chunk's own (causal attention: vLLM's CPU build fitted 14.0 against 13.0)
    nothing is saved by cutting, and C is taken."""
    cost = attention_cost(chunk_pairs_ms, prefix_pairs_ms, base_ms)
    cost.set_context(n * 300, prefix)
    policy = SLOWeave(cost=cost, max_prefills=max_prefills)
    chunk = policy.decide(n, 8000, budget).chunk_tokens
    largest = largest_safe(cost, n, 4096, budget)
    if not largest:
        assert chunk == 0
        return
    assert chunk <= largest and cost(n, chunk) <= budget
    rates = [held_rate(cost, n, c, largest) for c in range(1, largest + 1)]
    assert held_rate(cost, n, chunk, largest) >= 0.99 * max(rates)
    if prefix_pairs_ms >= chunk_pairs_ms:
        assert chunk == largest


def prompt_prefill(cost, choose, prompt_tokens: int, n: int, budget_ms: float) -> tuple[float, int]:
    """(ms, steps) one long prompt takes to prefill beside n decodes, step by step at ``budget_ms``:
    each step's chunk is ``choose(largest safe chunk)`` at the prefix reached."""
    spent_ms, prefix, steps = 0.0, 0, 0
    while prefix < prompt_tokens:
        cost.set_context(n * 300, prefix)
        largest = largest_safe(cost, n, min(4096, prompt_tokens - prefix), budget_ms)
        chunk = choose(largest)
        spent_ms += cost(n, chunk)
        prefix += chunk
        steps += 1
    return spent_ms, steps


def held_and_as_cut(cost: RegressionCost) -> tuple[tuple[float, int], tuple[float, int]]:
    """``prompt_prefill`` of a 2,048-token prompt (the longest the CPU bench serves) beside 16 decodes at a 60 ms budget, chunks chosen
    by the policy (held positions) and by the rate of each step as cut."""
    policy = SLOWeave(cost=cost, max_prefills=None)
    one_decode_ms = cost(1, 0)

    def held(largest: int) -> int:
        return policy.decide(16, largest, 60.0).chunk_tokens

    def as_cut(largest: int) -> int:
        return fastest_chunk(prefill_ms(cost, 16, one_decode_ms), 16, largest, None)

    return prompt_prefill(cost, held, 2048, 16, 60.0), prompt_prefill(cost, as_cut, 2048, 16, 60.0)


@pytest.mark.parametrize("prefix_pairs_ms", [13.0, 14.0])
def test_held_positions_prefill_a_long_prompt_in_fewer_steps_than_the_rate_of_each_step_as_cut(prefix_pairs_ms):
    """On vLLM's CPU build's fit, weighing each step's rate as cut (the prefix where the step
    starts) takes chunks of about 700 tokens, and the tokens it leaves pay the same attention a
    step later: held positions take the largest safe chunk, and the prompt is prefilled in half
    the steps or fewer (its first token that much sooner when other work shares the steps) and
    in less time (a step's fixed part paid fewer times). Without prefix pairs (a cost that prices
    only a prompt's first chunks) the two rules agree."""
    (held_ms, held_steps), (as_cut_ms, as_cut_steps) = held_and_as_cut(attention_cost(13.0, prefix_pairs_ms))
    assert held_steps <= as_cut_steps / 2 and held_ms < as_cut_ms
    held, as_cut = held_and_as_cut(attention_cost(13.0, 0.0))
    assert held == as_cut


def test_the_choice_is_named_and_checked():
    assert make_policy("sloweave").chunk_choice == "fastest"
    for name in ("sloweave-largest", "sloweave-multi-largest", "sloweave-largest+lookahead"):
        policy = make_policy(name)
        assert policy.chunk_choice == "largest" and policy.name == name
    with pytest.raises(ValueError, match="chunk_choice must be one of"):
        SLOWeave(chunk_choice="smallest")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fixed-512-largest")


def test_the_plugins_configuration_builds_its_policy_with_its_choice():
    """The scheduler and the replay of its decisions build SLOWeave from the plug-in's configuration:
    its ``chunk_choice`` reaches the policy (default ``fastest``)."""
    from sloweave.vllm_plugin.config import PluginConfig

    for keys, expected in (({}, "fastest"), ({"chunk_choice": "largest"}, "largest")):
        config = PluginConfig.from_sources({"sloweave": keys}, {})
        policy = config.deadline_policy(config.build_decision(), 2048)
        assert policy.chunk_choice == expected and policy.max_chunk_tokens == 2048
