"""The decision core: SLOWeave's chunk choice, the baselines and Proposition 1."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.margins import ConstantMargin, RelativeMargin, ZeroMargin
from sloweave.core.costs.protocols import CostModelError, MonotoneRepair, check_monotone_in_chunk
from sloweave.core.policy import Decision, FixedChunk, FullPrefill, SLOWeave, TokenBudget, make_policy


def test_analytic_cost_matches_spec():
    cost = AnalyticCost()
    assert cost(40, 0) == pytest.approx(3.45)
    assert cost(0, 0) == pytest.approx(0.35)
    assert cost(0, 100) == pytest.approx(0.35 + 0.40 + 0.6)
    assert cost(4, 1024) == pytest.approx(0.35 + 0.90 + 0.22 + 0.40 + 6.144)


def test_worked_example_of_spec():
    """n = 4, B = 10 ms gives c* of about 1355; Fixed-1024 leaves slack, Fixed-2048 misses."""
    cost = AnalyticCost()
    policy = SLOWeave(cost=cost)
    decision = policy.decide(4, 4096, 10.0)
    assert abs(decision.chunk_tokens - 1355) <= 1
    assert not decision.infeasible
    assert cost(4, decision.chunk_tokens) <= 10.0 < cost(4, decision.chunk_tokens + 1)
    assert cost(4, 1024) < 10.0 < cost(4, 2048)


def test_no_decodes_takes_the_largest_chunk():
    policy = SLOWeave(max_chunk_tokens=4096)
    assert policy.decide(0, 10_000, math.inf).chunk_tokens == 4096
    assert policy.decide(0, 300, math.inf).chunk_tokens == 300


def test_decode_only_when_nothing_waits_or_nothing_fits():
    policy = SLOWeave()
    assert policy.decide(8, 0, 25.0) == (0, False)
    # T(8, 0) = 1.69 fits 2 ms but the smallest chunk (0.40 + 0.006) does not.
    assert policy.decide(8, 500, 2.0) == (0, False)
    # Overload: even decode-only misses the budget; record it as infeasible.
    assert policy.decide(1000, 500, 25.0) == (0, True)
    assert policy.decide(1000, 0, 25.0) == (0, True)
    assert policy.decide(8, 500, 0.0) == (0, True)


def test_margin_shrinks_the_chunk():
    cost = AnalyticCost()
    plain = SLOWeave(cost=cost).decide(4, 4096, 10.0).chunk_tokens
    guarded = SLOWeave(cost=cost, margin=ConstantMargin(1.0)).decide(4, 4096, 10.0).chunk_tokens
    assert guarded < plain
    assert cost(4, guarded) + 1.0 <= 10.0 < cost(4, guarded + 1) + 1.0


def test_static_baselines():
    assert FullPrefill().decide(100, 9000, 1.0).chunk_tokens == 9000
    assert FixedChunk(256).decide(100, 9000, 1.0).chunk_tokens == 256
    assert FixedChunk(256).decide(100, 100, 1.0).chunk_tokens == 100
    assert TokenBudget(512).decide(100, 9000, 1.0).chunk_tokens == 412
    assert TokenBudget(512).decide(600, 9000, 1.0).chunk_tokens == 0
    assert TokenBudget(512).decide(10, 50, 1.0).chunk_tokens == 50
    for size in (64, 256, 512, 1024, 2048):
        assert make_policy(f"fixed-{size}").name == f"fixed-{size}"
        assert make_policy(f"budget-{size}").name == f"budget-{size}"
    assert make_policy("full").name == "full"
    assert make_policy("orca").name == "orca" and make_policy("orca").max_prefills is None
    assert make_policy("sarathi-512").name == "sarathi-512" and make_policy("sarathi-512").max_prefills is None
    assert make_policy("sloweave-multi").name == "sloweave-multi"
    assert make_policy("sarathi-512").decide(100, 9000, 1.0).chunk_tokens == 412
    with pytest.raises(ValueError, match="max_prefills"):
        TokenBudget(512, max_prefills=2)
    assert make_policy("sloweave").uses_deadlines and not make_policy("fixed-64").uses_deadlines


@pytest.mark.parametrize(
    "bad", ["fixed-0", "fixed--5", "fixed-abc", "budget-0", "sarathi-0", "chunky", "", "fixed-1.5"]
)
def test_bad_policy_names_are_rejected(bad):
    with pytest.raises(ValueError, match="policy|tokens"):
        make_policy(bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_chunk_sizes_are_rejected(bad):
    with pytest.raises(ValueError, match="must be a whole number of tokens >= 1 and <= 2,147,483,648"):
        FixedChunk(bad)
    with pytest.raises(ValueError, match="must be a whole number of tokens >= 1 and <= 2,147,483,648"):
        SLOWeave(max_chunk_tokens=bad)


def test_non_monotone_cost_is_rejected_or_repaired_on_request():
    def bumpy(n, c):  # a kernel boundary making 2048 cheaper than 2000
        return 1.0 + 0.01 * c - (5.0 if c >= 2048 else 0.0)

    with pytest.raises(CostModelError, match="not monotone"):
        SLOWeave(cost=bumpy)
    repaired = SLOWeave(cost=bumpy, repair_non_monotone=True)
    values = [repaired.cost(4, c) for c in range(0, 4097, 7)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert all(repaired.cost(4, c) >= bumpy(4, c) for c in range(0, 4097, 13))
    # The repaired model is never cheaper than the real one, so the choice stays safe.
    decision = repaired.decide(4, 4096, 20.0)
    assert bumpy(4, decision.chunk_tokens) <= 20.0


def test_bad_cost_values_are_rejected():
    with pytest.raises(CostModelError, match="negative"):
        check_monotone_in_chunk(lambda n, c: -1.0, 100)
    with pytest.raises(CostModelError, match="non-finite"):
        check_monotone_in_chunk(lambda n, c: math.nan, 100)
    with pytest.raises(CostModelError, match="prefill_per_token_ms"):
        AnalyticCost(prefill_per_token_ms=-0.1)
    with pytest.raises(CostModelError, match="margin_ms"):
        ConstantMargin(-1.0)


# --- Proposition 1, by brute force over random monotone cost models -------------------

MAX_CHUNK = 200


@st.composite
def monotone_tables(draw):
    """A random cost table T[n][c], monotone non-decreasing in c (any shape in n).

    Increments are drawn by numpy from a hypothesis-chosen seed: a mix of flat plateaus
    (ties are where a binary search goes wrong), small slopes and occasional jumps.
    """
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    flat_share = draw(st.floats(0.0, 0.95))
    jump_share = draw(st.floats(0.0, 0.1))
    rows = []
    for _ in range(6):
        steps = rng.uniform(0.0, 0.5, MAX_CHUNK)
        steps[rng.random(MAX_CHUNK) < flat_share] = 0.0
        steps[rng.random(MAX_CHUNK) < jump_share] += rng.uniform(1.0, 20.0)
        base = rng.uniform(0.0, 20.0)
        rows.append(np.concatenate([[base], base + np.cumsum(steps)]))
    return np.array(rows)


def table_cost(table):
    return lambda n, c: float(table[n % len(table)][c])


def brute_force_best(cost, n, waiting, budget, max_chunk):
    safe = [c for c in range(0, min(max_chunk, waiting) + 1) if cost(n, c) <= budget]
    return max(safe) if safe else None


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    table=monotone_tables(),
    n=st.integers(1, 5),
    waiting=st.integers(0, 400),
    budget=st.floats(0.0, 200.0),
    max_chunk=st.integers(1, MAX_CHUNK),
)
def test_proposition_1_chunk_is_safe_and_maximal(table, n, waiting, budget, max_chunk):
    cost = table_cost(table)
    decision = SLOWeave(cost=cost, max_chunk_tokens=max_chunk, chunk_choice="largest").decide(n, waiting, budget)
    best = brute_force_best(cost, n, waiting, budget, max_chunk)
    if best is None:  # even decode-only misses: overload
        assert decision == (0, True)
    else:
        assert not decision.infeasible
        assert decision.chunk_tokens == best
        assert cost(n, decision.chunk_tokens) <= budget


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    table=monotone_tables(),
    n=st.integers(1, 5),
    waiting=st.integers(0, 400),
    budget=st.floats(0.0, 200.0),
    margin_ms=st.floats(0.0, 10.0),
    error_seed=st.integers(0, 2**32 - 1),
)
def test_proposition_1_with_margin_under_bounded_one_sided_error(table, n, waiting, budget, margin_ms, error_seed):
    """Actual time may exceed the prediction by at most delta: the chosen chunk still meets B."""
    predicted = table_cost(table)
    rng = np.random.default_rng(error_seed)
    # actual = predicted + an error in [-5, delta]: bounded above by delta, anything below.
    error = rng.uniform(-5.0, margin_ms, size=table.shape)

    def actual(n_, c_):
        return predicted(n_, c_) + float(error[n_ % len(table)][c_])

    for choice in ("largest", "fastest"):  # the fastest chunk is one of the safe ones, no larger
        policy = SLOWeave(
            cost=predicted, margin=ConstantMargin(margin_ms), max_chunk_tokens=MAX_CHUNK, chunk_choice=choice
        )
        decision = policy.decide(n, waiting, budget)
        if not decision.infeasible:
            assert actual(n, decision.chunk_tokens) <= budget + 1e-9
            # and it is the largest chunk the guarded prediction allows (the fastest: at most that)
            guarded = lambda n_, c_: predicted(n_, c_) + margin_ms  # noqa: E731
            largest = brute_force_best(guarded, n, waiting, budget, MAX_CHUNK)
            assert decision.chunk_tokens == largest if choice == "largest" else decision.chunk_tokens <= largest


def test_relative_margin_covers_a_bounded_multiplicative_error():
    cost = AnalyticCost()
    policy = SLOWeave(cost=cost, margin=RelativeMargin(cost, 0.2))
    for n in (1, 8, 64, 200):
        for budget in (5.0, 10.0, 25.0, 50.0):
            decision = policy.decide(n, 8192, budget)
            if not decision.infeasible:
                assert 1.2 * cost(n, decision.chunk_tokens) <= budget + 1e-9


def test_monotone_repair_is_exact_on_monotone_models():
    cost = AnalyticCost()
    repaired = MonotoneRepair(cost, 4096)
    for c in (0, 1, 15, 16, 17, 1000, 4096, 5000):
        assert repaired(8, c) == cost(8, c)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 600),
    waiting=st.integers(0, 9000),
    budget=st.floats(0.0, 80.0),
    margin_ms=st.sampled_from([0.0, 0.5, 3.0]),
    per_token=st.sampled_from([0.006, 0.0123, 0.0001]),
)
def test_closed_form_shortcut_equals_brute_force(n, waiting, budget, margin_ms, per_token):
    """The analytic model's inverted guess never changes the answer of the search."""
    cost = AnalyticCost(prefill_per_token_ms=per_token)
    margin = ConstantMargin(margin_ms) if margin_ms else None
    policy = SLOWeave(cost=cost, margin=margin) if margin else SLOWeave(cost=cost)
    decision = policy.decide(n, waiting, budget)
    guarded = (lambda n_, c_: cost(n_, c_) + margin_ms) if margin_ms else cost
    best = brute_force_best_fast(guarded, n, waiting, budget, 4096)
    assert decision.chunk_tokens == (0 if best is None else best)


def brute_force_best_fast(cost, n, waiting, budget, max_chunk):
    """Largest safe chunk by scanning down from the top (T is monotone, so the first hit wins)."""
    for c in range(min(max_chunk, waiting), -1, -1):
        if cost(n, c) <= budget:
            return c
    return None


class TiledCost:
    """T(n, c) = 1 + 0.01 n + 0.01 (n + c) + a 2 ms ramp over the 8 tokens past every 128 (a GPU's tile
    step, interpolated between profiled points as the profile cost does)."""

    tile_edges = [128, 256, 384]

    def __call__(self, n, c):
        if not c:
            return 1.0 + 0.01 * n
        tokens = n + c
        steps = sum(min(1.0, max(0.0, (tokens - edge) / 8)) for edge in self.tile_edges)
        return 1.0 + 0.01 * n + 0.01 * tokens + 2.0 * steps


def test_on_a_tiled_cost_the_chunk_that_prefills_fastest_is_taken_not_the_largest():
    cost = TiledCost()
    policy = SLOWeave(cost=cost)
    # n = 8, budget 3.41 ms: the largest fitting chunk is 124 (132 tokens, 3.40 ms: half a tile step
    # for 4 tokens); 120 (128 tokens, 2.36 ms) prefills faster: 50.8 against 36.5 tokens per ms
    assert policy._largest_fitting(8, 5000, 3.41).chunk_tokens == 124
    assert policy.decide(8, 5000, 3.41) == (120, False)
    # far from an edge the largest chunk is the fastest too
    assert policy.decide(8, 5000, 2.2) == policy._largest_fitting(8, 5000, 2.2)
    # one prompt's whole rest fits: it is finished, whatever the rate
    assert policy.decide(8, 124, 3.41) == (124, False)
    # several prompts' whole offer just past an edge is cut there (its last 4 tokens join the
    # next step's prompts); one that ends below the edge is taken whole
    multi = SLOWeave(cost=cost, max_prefills=None)
    assert multi.decide(8, 124, 3.41) == (120, False)
    assert multi.decide(8, 100, 3.41) == (100, False)
    # never past the deadline, never larger than the largest fitting chunk, never slower than it
    for n in (1, 8, 60, 120, 200):
        for budget in (3.5, 5.0, 6.5, 8.0, 9.9):
            largest = policy._largest_fitting(n, 10_000, budget)
            chunk, infeasible = policy.decide(n, 10_000, budget)
            assert chunk <= largest.chunk_tokens and infeasible == largest.infeasible
            if chunk:
                assert cost(n, chunk) <= budget and chunk / cost(n, chunk) >= largest.chunk_tokens / cost(
                    n, largest.chunk_tokens
                )


def test_a_cost_without_tile_edges_keeps_the_largest_fitting_chunk():
    policy = SLOWeave(cost=AnalyticCost())
    for n, budget in ((4, 10.0), (64, 25.0), (200, 40.0)):
        assert policy.decide(n, 4096, budget) == policy._largest_fitting(n, 4096, budget)


@pytest.mark.parametrize("margin", [ZeroMargin(), ConstantMargin(0.5)])
def test_an_infinite_budget_with_decodes_gives_the_largest_chunk(margin):
    policy = SLOWeave(margin=margin, max_chunk_tokens=2048)
    assert policy.decide(4, 4096, math.inf) == Decision(2048)
    assert policy.decide(4, 100, math.inf) == Decision(100)
    assert policy.decide(4, 4096, 1e300).chunk_tokens == 2048  # huge but finite


@pytest.mark.parametrize(
    "args",
    [(4, 4096, math.nan), (4, -1, 10.0), (-1, 100, 10.0)],
)
def test_decide_refuses_what_it_cannot_answer(args):
    with pytest.raises(ValueError, match="decide needs n_decodes >= 0, waiting_tokens >= 0 and a budget_ms"):
        SLOWeave().decide(*args)


def test_every_policy_made_with_a_cost_is_timed_with_it():
    """The defect: a static rule silently dropped the cost and ran on the analytic model, so
    simulate(w, make_policy("sarathi-1024", cost=slow)) against sloweave-multi was unfair."""
    from sloweave.core.costs.analytic import AnalyticCost
    from sloweave.sim.engine import simulate
    from sloweave.sim.workloads import get_workload_spec

    slow = AnalyticCost(base_ms=2.0, prefill_per_token_ms=0.02)  # not the paper's model
    workload = get_workload_spec("mixed").generate(40, seed=3)
    for name in ("sarathi-1024", "fixed-512", "full", "orca", "sloweave-multi"):
        result = simulate(workload, make_policy(name, cost=slow), tpot_ms=50.0)
        durations = result.iter_end_ms - result.iter_start_ms
        expected = [slow(int(n), int(c)) for n, c in zip(result.iter_decodes, result.iter_chunk_tokens)]
        assert durations.tolist() == pytest.approx(expected), name


def test_a_margin_for_a_static_rule_is_refused_not_dropped():
    from sloweave.core.costs.margins import ConstantMargin, ZeroMargin

    with pytest.raises(ValueError, match="sarathi-512 is a static rule: it predicts nothing, so it has no margin"):
        make_policy("sarathi-512", margin=ConstantMargin(1.0))
    assert make_policy("fixed-64", margin=ZeroMargin()).name == "fixed-64"  # no margin is no margin
