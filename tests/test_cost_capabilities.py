"""Declared cost capabilities (issue 22): what a cost can do beyond T(n, c) is a Protocol, asked
with isinstance once where a policy, a controller or the clock is built; the cost models live in
sloweave.core.costs."""

import warnings

import pytest

from sloweave.core.budget import BudgetController, StepState
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.calibrated import self_correcting
from sloweave.core.costs.context_analytic import ContextAnalyticCost
from sloweave.core.costs.noisy import NoisyCost
from sloweave.core.costs.profile import profile_cost
from sloweave.core.costs.protocols import (
    Calibrated,
    ContextAware,
    ContextFeed,
    CostContext,
    CostModel,
    CountsQueries,
    Described,
    HasTileEdges,
    Invertible,
    OfferAware,
    Wrapper,
    uncounted,
)
from sloweave.core.costs.resolve import ContextBlindCost, describe_cost
from sloweave.core.policy import SLOWeave, make_policy
from sloweave.sim.clock import IterationClock

CAPABILITIES = (ContextAware, OfferAware, HasTileEdges, Invertible, CountsQueries, Calibrated, Wrapper, Described)


def capabilities(cost):
    return {p.__name__ for p in CAPABILITIES if isinstance(cost, p)}


@pytest.fixture(scope="module")
def profile():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return profile_cost("llama3-8b-tp1-a100")


def test_the_shipped_costs_declare_what_they_can_do(profile):
    assert capabilities(AnalyticCost()) == {"Invertible"}
    assert capabilities(ContextAnalyticCost()) == {"ContextAware"}
    assert capabilities(profile) == {"ContextAware", "OfferAware", "HasTileEdges", "CountsQueries", "Described"}
    # the online correction's wrapper passes the offer on only when its base takes one
    assert capabilities(self_correcting(profile).cost) == {"ContextAware", "OfferAware", "Calibrated"}
    assert capabilities(self_correcting(AnalyticCost()).cost) == {"ContextAware", "Calibrated"}
    assert capabilities(NoisyCost(AnalyticCost(), 0.1, 0)) == {"Wrapper"}
    assert all(isinstance(c, CostModel) for c in (AnalyticCost(), profile, ContextBlindCost(profile)))
    assert not isinstance(ContextBlindCost(profile), ContextAware)


def test_the_policy_asks_once_when_it_is_built(profile):
    analytic = SLOWeave(cost=AnalyticCost())
    assert analytic._estimate is not None and analytic._tile_edges is None
    tiled = SLOWeave(cost=profile)
    assert tiled._estimate is None and tiled._tile_edges == list(profile.tile_edges)
    before = dict(profile.out_of_range)
    with uncounted(profile):
        profile(1, 100_000)  # past the profiled tokens: not counted
    assert dict(profile.out_of_range) == before
    with uncounted(AnalyticCost()):  # a cost that counts nothing: a context that does nothing
        pass


def test_the_context_feed_sets_each_model_once_and_offers_only_to_those_that_take_it(profile):
    calls = []

    class Spy(ContextAnalyticCost):
        def set_context(self, decode_kv_tokens, prefill_prefix_tokens):
            calls.append((decode_kv_tokens, prefill_prefix_tokens))
            super().set_context(decode_kv_tokens, prefill_prefix_tokens)

    spy = Spy()
    feed = ContextFeed(spy, None, AnalyticCost(), spy)
    assert feed.reads_context and not feed.reads_offer and feed.context_models == [spy]
    feed.feed(CostContext(1000, 20, [(5, 20)]))
    assert calls == [(1000, 20)] and spy(4, 8) == spy.predict(4, 8, 1000, 20)
    offered = ContextFeed(profile)
    assert offered.reads_offer
    offered.feed(CostContext(0, 0, [(4, 0), (4, 0)]))
    assert profile._offer == [(4, 0), (4, 0)]
    offered.set_offer(None)
    assert not ContextFeed(AnalyticCost(), None).reads_context


def test_the_clock_and_the_controller_feed_the_context_they_found_at_construction():
    world = ContextAnalyticCost()
    clock = IterationClock(NoisyCost(world, 0.0, 0), make_policy("sloweave").cost)
    assert clock.reads_context and not clock.reads_offer  # found inside the noisy wrapper
    clock.set_context(2000, 10)
    assert (world.decode_kv_tokens, world.prefill_prefix_tokens) == (2000, 10)
    controller = BudgetController(SLOWeave(cost=world, max_prefills=None), 50.0, 8192)
    controller.plan_step(
        StepState(now_ms=0.0, decode_tokens=0, pending_prompt_tokens=0, decode_kv_tokens=7, prefill_prefix_tokens=3)
    )
    assert (world.decode_kv_tokens, world.prefill_prefix_tokens) == (7, 3)


def test_a_cost_that_describes_itself_is_recorded_by_its_description(profile):
    assert describe_cost(AnalyticCost())["cost_model"] == "analytic"
    assert describe_cost(profile)["cost_model"] == "operator-profile"
    assert describe_cost(ContextAnalyticCost()) == {"cost_model": "ContextAnalyticCost"}
