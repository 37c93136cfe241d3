"""What makes a decision cheap without changing it. The fast chunk pricing of the operator-profile cost (``ProfileCost.chunk_pricer``, what a
SLOWeave decision searches with) against the cost's own T(n, c): the same floats, the same
queries counted past the profile, the same decisions.

Two copies of each model get the same contexts, offers and queries, one answered through the
pricer and one through ``__call__``; the tiny fixture's profiled range is small (256 tokens, a
128-token chunk, a 64-token prefix, 4 decodes), so most draws cross one of its edges.
"""

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sloweave.core.costs.calibrated import MARGIN_FORMS, CalibratedCost, self_correcting
from sloweave.core.costs.fitted import C_BUCKET_EDGES, N_BUCKET_EDGES, ContextualCost, ResidualMargin
from sloweave.core.costs.margins import ConstantMargin, RelativeMargin, ZeroMargin
from sloweave.core.costs.profile import profile_cost
from sloweave.core.largest_chunk import SECANT_ALLOWANCE, largest_fitting
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
        # Built at one context: whether the rate can peak is checked at the context a cost holds
        # (and more, for the fast copy alone), not at whatever an earlier example left.
        _feed(fast, (0, 0), None)
        _feed(reference, (0, 0), None)
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


class CountingConvexCost(ContextualCost):
    """T(n, c) = 3 + 0.05 n + 0.01 c + 4e-6 c^2 ms, counting its queries: convex in c, so the rate
    peaks and the fastest-chunk search probes below the largest safe chunk too."""

    def __init__(self) -> None:
        self.queries = 0

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        self.queries += 1
        return 3.0 + 0.05 * n_decodes + 0.01 * chunk_tokens + 4e-6 * chunk_tokens * chunk_tokens


class Opaque:
    """A margin seen only as delta(n, c): the policy must ask it, and it asks its cost again."""

    def __init__(self, margin) -> None:
        self.margin = margin

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return self.margin(n_decodes, chunk_tokens)


def _margins_reading_the_cost():
    """(name, policy cost, margin whose ``cost`` is that cost, the counted base) for each margin
    that reads the prediction; the online ones after a seeded run of noisy steps."""
    built = []
    plain = CountingConvexCost()
    built.append(("relative", plain, RelativeMargin(plain, 0.15), plain))
    fitted = CountingConvexCost()
    fractions = np.linspace(0.05, 0.3, len(N_BUCKET_EDGES) * len(C_BUCKET_EDGES)).reshape(len(N_BUCKET_EDGES), -1)
    built.append(("profile table", fitted, ResidualMargin(fitted, np.maximum.accumulate(fractions, axis=1)), fitted))
    rng = np.random.default_rng(3)
    for form in MARGIN_FORMS:
        base = CountingConvexCost()
        correction = self_correcting(base, margin_form=form)
        for _ in range(600):
            n, c = int(rng.integers(1, 64)), int(rng.choice([0, rng.integers(1, 4096)]))
            predicted_ms = base.predict(n, c, 0, 0)
            correction.calibrator.observe(n, c, predicted_ms, predicted_ms * float(rng.uniform(0.9, 1.3)) + 0.5)
        built.append((f"online {form}", correction.cost, correction.margin, base))
    return built


@pytest.mark.parametrize(
    "cost, margin, counted", [pytest.param(*built[1:], id=built[0]) for built in _margins_reading_the_cost()]
)
@settings(max_examples=60, deadline=None)
@given(
    n_decodes=st.integers(0, 300),
    waiting_tokens=st.integers(0, 9000),
    budget_ms=st.one_of(st.floats(0.0, 120.0), st.just(float("inf"))),
)
def test_a_margin_read_from_the_prediction_halves_the_cost_queries_with_the_same_floats(
    cost, margin, counted, n_decodes, waiting_tokens, budget_ms
):
    quick, plain = SLOWeave(cost=cost, margin=margin), SLOWeave(cost=cost, margin=Opaque(margin))
    assert quick._reads_price and not plain._reads_price
    decided = quick.decide(n_decodes, waiting_tokens, budget_ms)
    assert plain.decide(n_decodes, waiting_tokens, budget_ms) == decided
    # the queries of the safety search and the pricing: the fastest chunk's search prices
    # without the margin, the same queries for both
    quick, plain = (SLOWeave(cost=cost, margin=m, chunk_choice="largest") for m in (margin, Opaque(margin)))
    counted.queries = 0
    assert quick.decide(n_decodes, waiting_tokens, budget_ms).chunk_tokens >= decided.chunk_tokens
    priced = quick.margin_and_predicted_ms(n_decodes, decided.chunk_tokens)
    quick_queries, counted.queries = counted.queries, 0
    plain.decide(n_decodes, waiting_tokens, budget_ms)
    plain_priced = plain.margin_and_predicted_ms(n_decodes, decided.chunk_tokens)
    assert [v.hex() for v in plain_priced] == [v.hex() for v in priced]
    if isinstance(cost, CalibratedCost):  # its pricer takes T(n, 0) once per search, for both policies
        assert 2 * quick_queries <= counted.queries + 4 and quick_queries < counted.queries
    else:
        assert counted.queries == 2 * quick_queries


@settings(max_examples=100, deadline=None)
@given(
    n_decodes=st.integers(0, 300),
    chunks=st.lists(st.integers(0, 9000), min_size=1, max_size=20),
    context=st.tuples(st.integers(0, 100_000), st.integers(0, 8000)),
)
def test_the_corrected_costs_pricer_gives_its_floats_asking_the_base_once_per_chunk(n_decodes, chunks, context):
    base = CountingConvexCost()
    correction = self_correcting(base)
    rng = np.random.default_rng(5)
    for n in range(0, 300, 7):  # factors that differ by decode bucket and step kind
        correction.calibrator.observe(n, n % 2 * 500, 10.0, 10.0 * float(rng.uniform(0.7, 1.6)))
    cost = correction.cost
    cost.set_context(*context)
    price = cost.chunk_pricer(n_decodes)
    base.queries = 0
    got = [price(n_decodes, chunk).hex() for chunk in chunks]
    assert base.queries == sum(chunk > 0 for chunk in chunks)
    assert got == [cost(n_decodes, chunk).hex() for chunk in chunks]
    assert price(n_decodes + 1, chunks[0]).hex() == cost(n_decodes + 1, chunks[0]).hex()


def _bisection(predicted, n_decodes: int, budget_ms: float, hi: int, lo: int = 0) -> tuple[int, int]:
    """The plain binary search ``largest_fitting`` replaces: (answer, probes)."""
    probes = 0
    while hi - lo > 1:
        mid, probes = (lo + hi) // 2, probes + 1
        lo, hi = (mid, hi) if predicted(n_decodes, mid) <= budget_ms else (lo, mid)
    return lo, probes


def _jagged_cost(seed: int, hi: int, infinite_from: int | None) -> np.ndarray:
    """A monotone cost per chunk 0..hi with plateaus, jumps and, past ``infinite_from``, an
    infinite prediction (a cost past its data)."""
    rng = np.random.default_rng(seed)
    steps = rng.uniform(0.0, 0.2, hi + 1)
    steps[rng.random(hi + 1) < rng.uniform(0.0, 0.9)] = 0.0
    steps[rng.random(hi + 1) < 0.02] += rng.uniform(1.0, 30.0)
    table = np.cumsum(steps)
    if infinite_from is not None:
        table[min(infinite_from, hi) :] = np.inf
    return table


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    hi=st.integers(1, 4096),
    budget_ms=st.floats(0.0, 400.0),
    infinite_from=st.one_of(st.none(), st.integers(1, 4096)),
)
def test_the_secant_search_answers_as_bisection_on_any_monotone_cost(seed, hi, budget_ms, infinite_from):
    """Plateaus, jumps and an infinite prediction past some chunk: the bracketing search keeps
    its invariant, so its answer is bisection's, with at most ``SECANT_ALLOWANCE`` probes more
    than bisection's worst case."""
    table = _jagged_cost(seed, hi, infinite_from)
    probes = []
    predicted = lambda n, c: probes.append(c) or float(table[c])  # noqa: E731
    if table[0] > budget_ms or table[hi] <= budget_ms:
        return  # the search is asked only when 0 fits and hi does not
    expected, _ = _bisection(predicted, 1, budget_ms, hi)
    probes.clear()
    assert largest_fitting(predicted, 1, budget_ms, 0, float(table[0]), hi, float(table[hi])) == expected
    assert len(probes) <= math.ceil(math.log2(hi)) + SECANT_ALLOWANCE
    assert all(0 < c < hi for c in probes)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    hi=st.integers(2, 4096),
    lo_share=st.floats(0.0, 1.0),
    budget_ms=st.floats(0.0, 400.0),
    times_known=st.tuples(st.booleans(), st.booleans()),
    allowance=st.sampled_from([0, SECANT_ALLOWANCE]),
)
def test_the_search_from_any_bracket_answers_as_bisection_and_bisects_with_no_allowance(
    seed, hi, lo_share, budget_ms, times_known, allowance
):
    """The bracket an inverted linear model leaves ([guess + 1, hi], an end's time not asked:
    NaN), and a tiled cost's search (no allowance): still bisection's answer, and with no
    allowance bisection's very probes."""
    table = _jagged_cost(seed, hi, None)
    lo = min(int(lo_share * hi), hi - 1)
    if table[lo] > budget_ms or table[hi] <= budget_ms:
        return
    probes = []
    predicted = lambda n, c: probes.append(c) or float(table[c])  # noqa: E731
    expected, bisection_probes = _bisection(predicted, 1, budget_ms, hi, lo)
    bisected = list(probes)
    probes.clear()
    lo_ms, hi_ms = (float(table[c]) if known else math.nan for c, known in zip((lo, hi), times_known))
    assert largest_fitting(predicted, 1, budget_ms, lo, lo_ms, hi, hi_ms, allowance) == expected
    assert all(lo < c < hi for c in probes)
    if allowance == 0:
        assert probes == bisected and len(probes) == bisection_probes


def test_the_secant_search_lands_in_a_few_probes_on_a_smooth_cost():
    """The CPU engine's corrected fit is smooth in c: bisection over 4,096 tokens takes 12 probes."""
    cost = CountingConvexCost()
    price = lambda n, c: cost.predict(n, c, 0, 0) * 1.3 + 0.5  # noqa: E731
    most = 0
    for budget_ms in np.linspace(price(16, 0) + 0.01, price(16, 4096) - 0.01, 200):
        probes = []
        counted = lambda n, c: probes.append(c) or price(n, c)  # noqa: E731
        chunk = largest_fitting(counted, 16, budget_ms, 0, price(16, 0), 4096, price(16, 4096))
        assert chunk == _bisection(price, 16, budget_ms, 4096)[0]
        most = max(most, len(probes))
    assert most <= 6


def test_the_online_relative_margin_prices_a_search_with_one_fraction_and_the_same_floats():
    """After its warm-up the adaptive margin's r is one number per decision: the search's pricer
    takes T + r T without asking the margin per chunk, float for float what the margin gives."""
    built = {name: (cost, margin) for name, cost, margin, _ in _margins_reading_the_cost()}
    cost, margin = built["online relative"]
    policy = SLOWeave(cost=cost, margin=margin)
    cost.set_context(16 * 1025, 0)
    for budget_ms in (8.0, 20.0, 60.0):
        margin.set_step(16, budget_ms)
        assert margin.step_fraction() is not None
        price = policy._predicted_at(16)
        for chunk in (0, 1, 77, 900, 4096):
            expected = cost(16, chunk) + margin(16, chunk)
            assert price(16, chunk).hex() == expected.hex()
    warming = self_correcting(CountingConvexCost())  # too few steps seen: the margin varies with c
    assert warming.margin.step_fraction() is None
