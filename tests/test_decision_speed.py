"""The fast chunk pricing of the operator-profile cost (``ProfileCost.chunk_pricer``, what a
SLOWeave decision searches with) against the cost's own T(n, c): the same floats, the same
queries counted past the profile, the same decisions.

Two copies of each model get the same contexts, offers and queries, one answered through the
pricer and one through ``__call__``; the tiny fixture's profiled range is small (256 tokens, a
128-token chunk, a 64-token prefix, 4 decodes), so most draws cross one of its edges.
"""

import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sloweave.core.costs.margins import ConstantMargin, ZeroMargin
from sloweave.core.costs.profile import profile_cost
from sloweave.core.policy import SLOWeave

TINY = str(Path(__file__).parent / "fixtures" / "profiles" / "tiny")
MODELS = (TINY, "llama2-70b-tp2-a100", "llama3-8b-tp1-a100")


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    """(fast, reference): two copies of one profile model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return profile_cost(request.param), profile_cost(request.param)


@pytest.fixture(scope="module")
def policies(pair):
    """margin (ms) -> (SLOWeave on the fast copy, SLOWeave on the reference's T itself)."""
    fast, reference = pair
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for margin_ms in (0.0, 0.5):
            margin = ConstantMargin(margin_ms) if margin_ms else ZeroMargin()
            found[margin_ms] = SLOWeave(cost=fast, margin=margin), SLOWeave(cost=Plain(reference), margin=margin)
    return found


class Plain:
    """The reference's T(n, c) and tile edges, without the fast pricer: the policy searches with T itself."""

    def __init__(self, cost) -> None:
        self.cost = cost
        self.tile_edges = cost.tile_edges

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return self.cost(n_decodes, chunk_tokens)

    def uncounted(self):
        return self.cost.uncounted()


offers = st.one_of(
    st.none(),
    st.lists(st.tuples(st.integers(1, 6000), st.integers(0, 9000)), min_size=1, max_size=4),
)
contexts = st.tuples(
    st.one_of(st.integers(0, 5000), st.integers(0, 3_000_000)),  # KV tokens the decodes read
    st.one_of(st.sampled_from([0, 32, 64, 4032]), st.integers(0, 8000)),  # the head prompt's prefix
)


def _feed(cost, context, offer) -> None:
    cost.out_of_range.clear()  # counted per example
    cost.set_context(*context)
    cost.set_offer(offer)


@settings(max_examples=150, deadline=None)
@given(
    context=contexts,
    offer=offers,
    n_decodes=st.one_of(st.integers(0, 8), st.integers(0, 300)),
    chunks=st.lists(st.one_of(st.integers(0, 300), st.integers(0, 9000)), min_size=1, max_size=20),
)
def test_the_pricer_gives_the_costs_floats_and_counts(pair, context, offer, n_decodes, chunks):
    fast, reference = pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _feed(fast, context, offer)
        _feed(reference, context, offer)
        price = fast.chunk_pricer(n_decodes)
        for chunk in [0, *chunks]:  # a search asks decode-only first
            got, want = price(n_decodes, chunk), reference(n_decodes, chunk)
            assert got.hex() == want.hex(), (n_decodes, chunk)
        # another n is answered too (by the cost itself)
        assert price(n_decodes + 1, chunks[0]).hex() == reference(n_decodes + 1, chunks[0]).hex()
    assert fast.out_of_range == reference.out_of_range


@settings(max_examples=150, deadline=None)
@given(
    context=contexts,
    offer=offers,
    n_decodes=st.one_of(st.integers(0, 8), st.integers(0, 300)),
    waiting_tokens=st.integers(0, 9000),
    slack_ms=st.one_of(st.floats(-5.0, 200.0), st.just(float("inf"))),
    margin_ms=st.sampled_from([0.0, 0.5]),
)
def test_a_decision_is_the_one_searched_on_the_cost_itself(
    pair, policies, context, offer, n_decodes, waiting_tokens, slack_ms, margin_ms
):
    fast, reference = pair
    quick, plain = policies[margin_ms]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _feed(fast, context, offer)
        _feed(reference, context, offer)
        with fast.uncounted(), reference.uncounted():  # asked of both: it caches the decode term
            budget_ms = reference(n_decodes, 0) + slack_ms  # near decode-only, so the search runs
            assert fast(n_decodes, 0) + slack_ms == budget_ms
        assert quick.decide(n_decodes, waiting_tokens, budget_ms) == plain.decide(n_decodes, waiting_tokens, budget_ms)
    assert fast.out_of_range == reference.out_of_range


def test_a_profile_decision_searches_with_the_pricer():
    cost = profile_cost("llama3-8b-tp1-a100")
    cost.set_context(64 * 1025, 0)
    assert SLOWeave(cost=cost)._predicted_at(64) is not cost  # the fast pricer, not T itself
    analytic = SLOWeave()
    assert analytic._predicted_at(64) is analytic.cost  # the analytic model has none: T itself
