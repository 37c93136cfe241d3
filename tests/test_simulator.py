"""Simulator invariants: tokens, accounting, determinism, deadlines, and a hand-checked run."""

import numpy as np
import pytest

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.margins import ConstantMargin, RelativeMargin
from sloweave.core.costs.noisy import NoisyCost
from sloweave.sim.metrics import evaluate, per_request_frame
from sloweave.core.policy import FixedChunk, SLOWeave, make_policy
from sloweave.sim.engine import simulate
from sloweave.sim.workloads import WORKLOADS, Workload

POLICIES = [
    "sloweave",
    "sloweave-multi",
    "full",
    "orca",
    "fixed-64",
    "fixed-1024",
    "budget-256",
    "budget-2048",
    "sarathi-512",
]


@pytest.fixture(scope="module")
def mixed_workload():
    return WORKLOADS["mixed"].generate(300, seed=3)


@pytest.mark.parametrize("max_batch_size", [None, 32])
@pytest.mark.parametrize("policy_name", POLICIES)
def test_every_token_is_accounted_for(mixed_workload, policy_name, max_batch_size):
    wl = mixed_workload
    policy = make_policy(policy_name)
    result = simulate(wl, policy, tpot_ms=25.0, max_batch_size=max_batch_size)
    assert result.finished.all()
    # every prompt token is prefilled exactly once, by its own request's pieces
    prefilled = np.bincount(result.prefill_request, weights=result.prefill_tokens, minlength=len(wl))
    assert np.array_equal(prefilled.astype(np.int64), wl.prompt_tokens)
    per_iteration = np.bincount(result.prefill_iter, weights=result.prefill_tokens, minlength=result.num_iterations)
    assert np.array_equal(per_iteration.astype(np.int64), result.iter_chunk_tokens)
    prompts_per_iteration = np.bincount(result.prefill_iter, minlength=result.num_iterations)
    if policy.max_prefills == 1:
        assert prompts_per_iteration.max() == 1
    # the batch cap holds: decodes + prompts prefilled in an iteration
    if max_batch_size is not None:
        assert (result.iter_decodes + prompts_per_iteration).max() <= max_batch_size
    # every request emits exactly its output length, one token per iteration after its prefill
    for i in range(len(wl)):
        times = result.token_times_ms(i)
        assert len(times) == wl.output_tokens[i]
        assert np.all(np.diff(times) > 0)
        assert times[0] >= wl.arrival_s[i] * 1000.0
    # the decode batch of each iteration is exactly the requests between their first and last token
    first = result.first_token_iter
    last = first + wl.output_tokens - 1
    counts = np.zeros(result.num_iterations + 1, dtype=np.int64)
    np.add.at(counts, first + 1, 1)
    np.add.at(counts, last + 1, -1)
    assert np.array_equal(np.cumsum(counts)[: result.num_iterations], result.iter_decodes)
    # iterations are back to back or wait for an arrival, never overlap
    assert np.all(result.iter_start_ms[1:] >= result.iter_end_ms[:-1])
    frame = per_request_frame(result)
    assert (frame["status"] == "finished").all() and len(frame) == len(wl)


def test_same_seed_same_results_bit_for_bit():
    spec = WORKLOADS["bursty"]
    a = simulate(
        spec.generate(400, seed=11), SLOWeave(), tpot_ms=25.0, actual_cost=NoisyCost(AnalyticCost(), 0.1, seed=5)
    )
    b = simulate(
        spec.generate(400, seed=11), SLOWeave(), tpot_ms=25.0, actual_cost=NoisyCost(AnalyticCost(), 0.1, seed=5)
    )
    for field in ("iter_start_ms", "iter_end_ms", "iter_chunk_tokens", "iter_decodes", "first_token_iter"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert evaluate(a, 2000.0) == evaluate(b, 2000.0)
    c = simulate(spec.generate(400, seed=12), SLOWeave(), tpot_ms=25.0)
    assert not np.array_equal(a.iter_end_ms[:50], c.iter_end_ms[:50])


def test_iteration_time_is_the_cost_model_and_sloweave_meets_every_deadline(mixed_workload):
    cost = AnalyticCost()
    result = simulate(mixed_workload, SLOWeave(cost=cost), tpot_ms=25.0)
    durations = result.iter_end_ms - result.iter_start_ms
    expected = [cost(int(n), int(c)) for n, c in zip(result.iter_decodes, result.iter_chunk_tokens)]
    assert np.allclose(durations, expected, rtol=0, atol=1e-9)
    decoding = result.iter_decodes > 0
    assert not result.iter_infeasible.any()
    assert np.all(durations[decoding] <= result.iter_budget_ms[decoding] + 1e-9)
    frame = per_request_frame(result)
    assert frame["max_tpot_ms"].max() <= 25.0 + 1e-6
    # full prefill breaks the TPOT target on the same workload: the comparison is meaningful
    full = per_request_frame(simulate(mixed_workload, make_policy("full"), tpot_ms=25.0))
    assert full["max_tpot_ms"].max() > 25.0


def test_deadline_tracker_agrees_with_the_simulator_budget():
    spec = WORKLOADS["mixed"]
    base = spec.generate(200, seed=1)
    rng = np.random.default_rng(0)
    tiers = Workload(
        "tiers", base.arrival_s, base.prompt_tokens, base.output_tokens, tpot_ms=rng.choice([10.0, 50.0], len(base))
    )
    for wl in (base, tiers):
        # check_deadlines runs the per-request DeadlineTracker beside the O(1) budget and asserts equality
        result = simulate(wl, SLOWeave(), tpot_ms=25.0, check_deadlines=True)
        assert result.finished.all()
    budgets = simulate(tiers, SLOWeave(), tpot_ms=25.0).iter_budget_ms
    assert set(np.unique(budgets[np.isfinite(budgets)])) <= {10.0, 50.0}


def test_margin_keeps_deadlines_under_bounded_noise(mixed_workload):
    cost = AnalyticCost()
    noisy = NoisyCost(cost, sigma=0.3, seed=7, max_factor=1.2)
    plain = simulate(
        mixed_workload, SLOWeave(cost=cost), tpot_ms=25.0, actual_cost=NoisyCost(cost, 0.3, seed=7, max_factor=1.2)
    )
    guarded = simulate(
        mixed_workload, SLOWeave(cost=cost, margin=RelativeMargin(cost, 0.2)), tpot_ms=25.0, actual_cost=noisy
    )
    for result, may_miss in ((plain, True), (guarded, False)):
        durations = result.iter_end_ms - result.iter_start_ms
        decoding = result.iter_decodes > 0
        overruns = int(np.sum(durations[decoding] > result.iter_budget_ms[decoding] + 1e-9))
        assert (overruns > 0) == may_miss


def test_hand_computed_run():
    """Two requests on a constant cost model; every number below is worked out by hand."""
    wl = Workload(
        "hand", arrival_s=np.array([0.0, 0.0]), prompt_tokens=np.array([300, 100]), output_tokens=np.array([3, 2])
    )
    cost = lambda n, c: 10.0  # noqa: E731  every iteration takes 10 ms
    result = simulate(wl, FixedChunk(200), tpot_ms=25.0, actual_cost=cost)
    # it0: chunk 200 of r0; it1: chunk 100 of r0 -> r0 first token at 20;
    # it2: r0 decodes, r1 prefills 100 -> r1 first token at 30, r0 second token at 30;
    # it3: r0 (3rd, last) and r1 (2nd, last) at 40.
    assert result.iter_chunk_tokens.tolist() == [200, 100, 100, 0]
    assert result.iter_decodes.tolist() == [0, 0, 1, 2]
    assert result.token_times_ms(0).tolist() == [20.0, 30.0, 40.0]
    assert result.token_times_ms(1).tolist() == [30.0, 40.0]
    frame = per_request_frame(result)
    assert frame["ttft_ms"].tolist() == [20.0, 30.0]
    metrics = evaluate(result, ttft_ms=25.0, tpot_ms=10.0)
    assert metrics.slo_met == 1 and metrics.attainment == 0.5  # r1's TTFT of 30 ms misses 25
    assert metrics.goodput_rps == pytest.approx(1 / 0.040)


def _three_prompts():
    return Workload(
        "three", arrival_s=np.zeros(3), prompt_tokens=np.array([300, 300, 100]), output_tokens=np.array([2, 2, 2])
    )


def test_sarathi_spreads_the_budget_over_several_prompts():
    """Worked by hand: budget 512, constant 10 ms iterations, no batch cap."""
    result = simulate(_three_prompts(), make_policy("sarathi-512"), actual_cost=lambda n, c: 10.0)
    # it0: r0 300 (done) + r1 212; it1: 1 decode, r1 88 (done) + r2 100 (done); it2: 2 decodes
    assert list(zip(result.prefill_iter, result.prefill_request, result.prefill_tokens)) == [
        (0, 0, 300),
        (0, 1, 212),
        (1, 1, 88),
        (1, 2, 100),
    ]
    assert result.iter_decodes.tolist() == [0, 1, 2]
    assert [result.token_times_ms(i).tolist() for i in range(3)] == [[10.0, 20.0], [20.0, 30.0], [20.0, 30.0]]
    # the one-prompt form of the same budget leaves the rest of the budget unused
    single = simulate(_three_prompts(), make_policy("budget-512"), actual_cost=lambda n, c: 10.0)
    assert np.bincount(single.prefill_iter).max() == 1 and single.num_iterations > result.num_iterations


def test_batch_cap_holds_new_prompts_back():
    """With a cap of 2 started requests, r2 waits until r0 has finished."""
    result = simulate(_three_prompts(), make_policy("sarathi-512"), actual_cost=lambda n, c: 10.0, max_batch_size=2)
    assert list(zip(result.prefill_iter, result.prefill_request, result.prefill_tokens)) == [
        (0, 0, 300),
        (0, 1, 212),
        (1, 1, 88),
        (2, 2, 100),
    ]
    assert [result.token_times_ms(i).tolist() for i in range(3)] == [[10.0, 20.0], [20.0, 30.0], [30.0, 40.0]]
    with pytest.raises(ValueError, match="max_batch_size"):
        simulate(_three_prompts(), make_policy("sarathi-512"), max_batch_size=0)


def test_orca_prefills_every_admitted_prompt_whole():
    result = simulate(_three_prompts(), make_policy("orca"), actual_cost=lambda n, c: 10.0)
    assert result.iter_chunk_tokens.tolist()[0] == 700
    assert result.first_token_iter.tolist() == [0, 0, 0]


def test_sloweave_multi_fills_the_budget_with_further_prompts(mixed_workload):
    single = simulate(mixed_workload, make_policy("sloweave"), tpot_ms=25.0)
    multi = simulate(mixed_workload, make_policy("sloweave-multi"), tpot_ms=25.0)
    assert np.bincount(multi.prefill_iter).max() > 1
    durations = multi.iter_end_ms - multi.iter_start_ms
    decoding = multi.iter_decodes > 0
    assert np.all(durations[decoding] <= multi.iter_budget_ms[decoding] + 1e-9)
    # filling the budget never leaves prompt tokens unprefilled that the single form took
    assert multi.iter_chunk_tokens.max() >= single.iter_chunk_tokens.max()


def test_horizon_leaves_requests_pending_and_counted():
    wl = WORKLOADS["long"].generate(200, seed=0, rate_scale=5.0)  # heavily overloaded
    result = simulate(wl, make_policy("fixed-64"), tpot_ms=25.0, horizon_s=5.0)
    frame = per_request_frame(result)
    pending = (frame["status"] == "pending").sum()
    assert pending > 0 and pending + (frame["status"] == "finished").sum() == len(wl)
    metrics = evaluate(result, 5000.0)
    assert metrics.num_pending == pending and metrics.num_requests == len(wl)
    assert metrics.slo_met <= metrics.num_finished


def test_idle_gaps_wait_for_the_next_arrival():
    wl = Workload(
        "idle", arrival_s=np.array([0.0, 10.0]), prompt_tokens=np.array([10, 10]), output_tokens=np.array([2, 2])
    )
    result = simulate(wl, SLOWeave(), tpot_ms=25.0)
    assert result.iter_start_ms[2] == 10_000.0
    assert evaluate(result, 1000.0).attainment == 1.0


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf")])
def test_bad_tpot_target(bad):
    wl = WORKLOADS["chat"].generate(10, seed=0)
    with pytest.raises(ValueError, match="tpot_ms"):
        simulate(wl, SLOWeave(), tpot_ms=bad)


def test_margin_constant_has_effect_in_simulation(mixed_workload):
    plain = simulate(mixed_workload, SLOWeave(), tpot_ms=25.0)
    guarded = simulate(mixed_workload, SLOWeave(margin=ConstantMargin(5.0)), tpot_ms=25.0)
    assert guarded.iter_chunk_tokens.max() < plain.iter_chunk_tokens.max()
