"""The per-step margin (``sloweave.core.costs.step_margin``): milliseconds learnt per step kind and
predicted time, against the relative margin it can replace, in the core and in every body."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sloweave.core.costs.calibrated import (
    DEFAULT_MARGIN_QUANTILE,
    MARGIN_FORMS,
    AdaptiveMargin,
    self_correcting,
)
from sloweave.core.costs import step_residuals
from sloweave.core.costs.fitted import ContextualCost
from sloweave.core.costs.step_margin import (
    DECODE_ONLY,
    PREDICTED_MS_EDGES,
    SPREAD_STEPS,
    TABLE_REFRESH_STEPS,
    WITH_CHUNK,
    StepMargin,
    StepResiduals,
    covering_value,
    margin_table,
    predicted_bucket,
    steps_for_quantile,
)
from sloweave.core.policy import SLOWeave
from sloweave.sim.options import EngineOptions
from sloweave.sim.workloads import get_workload_spec


class LinearCost(ContextualCost):
    """T(n, c) = base + per_decode n + per_token c, in ms (no context)."""

    def __init__(self, base_ms: float = 4.0, per_decode_ms: float = 0.1, per_token_ms: float = 0.02) -> None:
        self.base_ms, self.per_decode_ms, self.per_token_ms = base_ms, per_decode_ms, per_token_ms

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        return self.base_ms + self.per_decode_ms * n_decodes + self.per_token_ms * chunk_tokens


def additive_noise_run(margin_form: str, steps: int = 20_000, warmup_steps: int = 2_000, seed: int = 0) -> dict:
    """Steps of 4-6 ms (decode-only, a fifth of them) and 24-45 ms (a chunk of 1,000-2,048 tokens),
    each measured as the model plus the same seeded N(0, 1 ms) noise, replayed as a body does:
    the margin read before the step, the step observed after. Per (kind, predicted bucket):
    [covered, margin ms] of every step after the warm-up."""
    cost = LinearCost()
    correction = self_correcting(cost, margin_form=margin_form)
    rng = np.random.default_rng(seed)
    seen: dict[tuple, list] = {}
    for step in range(steps):
        n = int(rng.integers(1, 17))
        c = 0 if rng.random() < 0.2 else int(rng.integers(1000, 2049))
        margin_ms, predicted_ms = correction.margin(n, c), correction.cost(n, c)
        base_ms = cost.predict(n, c, 0, 0)
        measured_ms = base_ms + float(rng.normal(0.0, 1.0))
        if step >= warmup_steps:
            seen.setdefault((c > 0, predicted_bucket(predicted_ms)), []).append(
                (measured_ms <= predicted_ms + margin_ms, margin_ms)
            )
        correction.calibrator.observe(n, c, base_ms, measured_ms)
    return {key: np.array(rows) for key, rows in seen.items()}


@pytest.fixture(scope="module")
def additive_runs():
    return {form: additive_noise_run(form) for form in MARGIN_FORMS}


def test_per_step_margin_covers_the_target_in_every_bucket_of_additive_noise(additive_runs):
    """P99.7 per bucket (a binomial allowance: 0.994 over >= 1,000 steps), decode-only and with a chunk."""
    per_step = additive_runs["per-step"]
    buckets = [key for key, rows in per_step.items() if len(rows) >= 1000]
    assert {with_chunk for with_chunk, _ in buckets} == {False, True}
    for key in buckets:
        coverage = per_step[key][:, 0].mean()
        assert coverage >= 0.994, (key, coverage)


def test_relative_margin_under_covers_small_steps_and_over_covers_large_ones(additive_runs):
    """One relative quantile, pooled: the few small steps get less than the target, the large ones
    all of it with a margin several times the per-step one (what the per-step form gives back)."""
    relative, per_step = additive_runs["relative"], additive_runs["per-step"]
    small = np.concatenate([rows for (with_chunk, _), rows in relative.items() if not with_chunk])
    large = np.concatenate([rows for (with_chunk, _), rows in relative.items() if with_chunk])
    assert small[:, 0].mean() < 0.99
    assert large[:, 0].mean() == 1.0
    large_per_step = np.concatenate([rows for (with_chunk, _), rows in per_step.items() if with_chunk])
    assert large[:, 1].mean() > 3 * large_per_step[:, 1].mean()


def test_the_relative_form_stays_the_default_and_is_the_adaptive_margin():
    assert isinstance(self_correcting(LinearCost()).margin, AdaptiveMargin)
    per_step = self_correcting(LinearCost(), margin_form="per-step")
    assert isinstance(per_step.margin, StepMargin) and per_step.margin.quantile == DEFAULT_MARGIN_QUANTILE
    assert per_step.calibrator.step_residuals is per_step.margin.residuals


def test_the_covering_value_is_the_conformal_order_statistic():
    residuals = np.arange(1.0, 334.0)  # 333 residuals: the fewest for P99.7
    assert steps_for_quantile(99.7) == 333 and steps_for_quantile(99.0) == 99 and steps_for_quantile(50.0) == 1
    assert covering_value(residuals, 99.7) == 333.0
    assert covering_value(np.arange(1.0, 1001.0), 99.7) == 998.0  # ceil(1001 x 0.997) = 998
    assert predicted_bucket(0.0) == 0 and predicted_bucket(1.0) == PREDICTED_MS_EDGES.index(1.0)


def test_a_thin_bucket_pools_its_neighbours_and_no_margin_is_negative():
    correction = self_correcting(LinearCost(), margin_form="per-step", quantile=90.0, min_steps=5)
    for _ in range(30):  # steps of 24 ms, always 2 ms faster than the model
        correction.calibrator.observe(0, 1000, 24.0, 22.0)
    assert correction.margin(0, 1000) == 0.0  # the residuals are all negative: no margin, not a negative one
    for k in range(30):  # now 3 ms slower: a 24 ms step's bucket has 60 residuals
        correction.calibrator.observe(0, 1000, 24.0, 27.0)
    far = correction.margin(0, 2000)  # 44 ms: no step of its own, its nearest bucket's residuals
    assert far == pytest.approx(correction.margin(0, 1000), abs=1e-9) and far > 0


def test_one_slow_step_does_not_keep_chunks_from_running_behind_its_margin():
    """What the real engine did at a 20 ms target: one chunked step took 154 ms where 48 were
    predicted; its kind had a few hundred steps spread thin over the buckets, so every small
    chunk's bucket pooled its way out to that step and got a 106 ms margin, no chunk fitted the
    budget again, and with no new chunked steps the margin never left. A thin bucket pools the
    decode-only steps of its own predicted time first, and pools enough steps that one slow step
    is not the quantile, so small chunks keep the machine's noise."""
    residuals = StepResiduals()
    rng = np.random.default_rng(0)
    for _ in range(3000):  # decode-only steps of 2-8 ms, noise within +-1 ms
        predicted = float(rng.uniform(2.0, 8.0))
        residuals.add(False, predicted, predicted + float(rng.uniform(-1.0, 1.0)))
    for predicted in np.geomspace(2.0, 64.0, 340):  # chunked steps, ~30 per bucket
        residuals.add(True, float(predicted), float(predicted) + float(rng.uniform(-1.0, 1.0)))
    residuals.add(True, 48.0, 154.0)  # the slow step
    residuals.add(True, 2.5, 30.0)  # and one among small steps, whose bucket floors every larger one
    additive, _, floors = margin_table(residuals.windows(), WITH_CHUNK, 99.7, relative_fraction=lambda: 0.5)
    for predicted in (6.0, 12.0):  # the noise of steps this size, not a slow step
        bucket = predicted_bucket(predicted)
        assert additive[bucket] <= 1.0 and floors[bucket] <= predicted + 1.0
    decode_only, _, _ = margin_table(residuals.windows(), DECODE_ONLY, 99.7, relative_fraction=lambda: 0.5)
    assert decode_only[predicted_bucket(6.0)] <= 1.0


def thin_wide_bucket(large_steps: int, large_noise_ms: float, stall_ms: float | None = None, seed: int = 0):
    """2,000 steps with a chunk of 8-16 ms (noise within +-1 ms), then ``large_steps`` of 50 ms with
    noise within +-``large_noise_ms`` (and one ``stall_ms`` late): (the 50 ms bucket's margin, its
    own residuals, what its pool alone covers)."""
    residuals = StepResiduals()
    rng = np.random.default_rng(seed)
    for predicted in rng.uniform(8.0, 16.0, 2000):
        residuals.add(True, float(predicted), float(predicted + rng.uniform(-1.0, 1.0)))
    for _ in range(large_steps):
        residuals.add(True, 50.0, 50.0 + float(rng.uniform(-large_noise_ms, large_noise_ms)))
    if stall_ms is not None:
        residuals.add(True, 50.0, 50.0 + stall_ms)
    windows = residuals.windows()
    bucket = predicted_bucket(50.0)
    additive, _, _ = margin_table(windows, WITH_CHUNK, 99.7, relative_fraction=lambda: 0.5)
    own = windows[WITH_CHUNK][bucket]
    nearest = windows[WITH_CHUNK][predicted_bucket(15.0)]  # the bucket its pool reaches first
    pooled = covering_value(np.concatenate([own, nearest]), 99.7)
    return additive[bucket], own, pooled


def test_a_thin_bucket_its_pool_under_covers_takes_its_own_spread():
    """What the simulator fed the CPU engine's profile showed on drift at 60 ms: the few steps of
    40-60 ms spread twice as wide as the smaller ones their bucket pools with, the pool's P99.7 came
    from those, and 7-9 % of the requests missed TPOT. A thin bucket whose own steps exceed the
    pool's value more often than the quantile allows (beyond chance) gets the other buckets' tail
    stretched by its own spread."""
    margin, own, pooled = thin_wide_bucket(large_steps=60, large_noise_ms=5.0)
    assert own.size >= SPREAD_STEPS
    assert np.count_nonzero(own > pooled) >= 2  # the pool alone under-covers the large steps
    # now covered as the quantile allows (one exceedance in 60 is chance at P99.7), without blowing up
    assert margin > pooled and np.count_nonzero(own > margin) <= 1 and margin <= 1.5 * own.max()


def test_a_stretch_never_passes_the_worst_of_the_buckets_own_steps():
    """What vLLM's CPU engine did after a warm-up of decode-only steps (2,000 of them, 1.6 ms each,
    spread by 0.17 ms): the first 43 steps of a chunk bucket, late by up to 6.3 ms, were under-covered
    by that pool, and its value stretched by their spread over the pool's (12x) gave the bucket a margin
    of 46 ms: the plug-in parked its chunks below that bucket with 45 ms of its budget to spare."""
    residuals = StepResiduals()
    rng = np.random.default_rng(1)
    for _ in range(2000):  # the warm-up: small decode-only steps, very steady
        residuals.add(False, 1.6, 1.6 + float(rng.normal(0.0, 0.12)))
    for _ in range(43):  # the run's first steps with a chunk: late by a few ms, spread by about 2
        residuals.add(True, 9.0, 9.0 + float(rng.uniform(-1.0, 3.0)))
    windows = residuals.windows()
    own = windows[WITH_CHUNK][predicted_bucket(9.0)]
    additive, _, _ = margin_table(windows, WITH_CHUNK, 99.7, relative_fraction=lambda: 0.5)
    pooled = covering_value(np.concatenate([w for w in windows[DECODE_ONLY] if w.size]), 99.7)
    assert np.count_nonzero(own > pooled) >= 2  # the pool under-covers the bucket's own steps
    assert additive[predicted_bucket(9.0)] == pytest.approx(float(own.max()))  # covered, not stretched past them
    assert float(own.max()) < 4.0


def test_one_stall_or_a_covered_bucket_keeps_the_pools_margin():
    """One late step among a thin bucket's own is chance at P99.7 (a stall is not the bucket's
    spread), and a bucket whose steps stay within the pool's value keeps that value."""
    margin, own, pooled = thin_wide_bucket(large_steps=60, large_noise_ms=1.0, stall_ms=100.0)
    assert np.count_nonzero(own > pooled) == 1 and margin == pytest.approx(pooled) and margin <= 1.5
    margin, own, pooled = thin_wide_bucket(large_steps=60, large_noise_ms=0.5)
    assert margin == pytest.approx(pooled)
    few, own, _ = thin_wide_bucket(large_steps=SPREAD_STEPS - 1, large_noise_ms=5.0)
    assert own.size < SPREAD_STEPS and few < own.max()  # too few steps to read a spread from


def test_a_burst_of_stalls_is_forgotten_once_it_is_past_the_horizon():
    """What the real CPU engine did while another process kept its cores busy: stalls of 100-270
    ms gave steps with a chunk a margin larger than the budget, so no chunk ran, and only steps
    with a chunk refresh their buckets: minutes after the burst the margin still held it
    (attainment 0.45). A residual counts for the last ``horizon_steps`` steps of any kind."""
    rng = np.random.default_rng(0)

    def chunk_margins_after_a_burst(horizon_steps: int) -> list[float]:
        residuals = StepResiduals(horizon_steps=horizon_steps)
        for _ in range(1500):  # quiet: decode-only steps of 2-4 ms, steps with a chunk of 10-40 ms
            residuals.add(False, 3.0, 3.0 + float(rng.uniform(-1.0, 1.0)))
            residuals.add(True, 20.0, 20.0 + float(rng.uniform(-1.0, 1.0)))
        for _ in range(40):  # the burst: every step 150 ms late
            residuals.add(False, 3.0, 153.0)
            residuals.add(True, 20.0, 170.0)
        margins = []
        for quiet in range(3000):  # after it only decode-only steps run (the margin holds chunks back)
            residuals.add(False, 3.0, 3.0 + float(rng.uniform(-1.0, 1.0)))
            if quiet % 1000 == 999:
                additive, _, _ = margin_table(residuals.windows(), WITH_CHUNK, 99.7, relative_fraction=lambda: 0.5)
                margins.append(additive[predicted_bucket(20.0)])
        return margins

    held = chunk_margins_after_a_burst(horizon_steps=10**9)  # no horizon: the window alone
    assert all(margin >= 149.0 for margin in held)
    forgotten = chunk_margins_after_a_burst(horizon_steps=2000)
    assert forgotten[0] >= 149.0  # within the horizon the burst still counts
    assert all(margin <= 1.0 for margin in forgotten[2:])  # 2,000 steps past it: the machine's noise


def stalled_correction(
    stall_share: float, seed: int = 0, stall_ms: float = 150.0, with_chunk_share: float | None = None
):
    """A per-step margin after 3,000 steps of each kind, a share of each delayed by a ``stall_ms``
    stall (as a machine busy elsewhere delays any step; steps with a chunk by ``with_chunk_share``
    if given), the rest within +-1 ms: (correction, policy). The residuals are fed to the margin
    alone: the correction's factors stay at 1, so a step's residual is its noise and its stall."""
    correction = self_correcting(LinearCost(base_ms=2.0, per_decode_ms=0.0, per_token_ms=0.02), margin_form="per-step")
    rng = np.random.default_rng(seed)
    shares = {0: stall_share, 400: stall_share if with_chunk_share is None else with_chunk_share}
    for _ in range(1500):
        for chunk in (0, 400):  # decode-only steps of 2 ms, steps with a chunk of 10 ms
            predicted = correction.cost(1, chunk)
            stall = stall_ms if rng.random() < shares[chunk] else 0.0
            correction.margin.residuals.add(chunk > 0, predicted, predicted + float(rng.uniform(-1.0, 1.0)) + stall)
    return correction, SLOWeave(cost=correction.cost, margin=correction.margin, max_chunk_tokens=2048)


def largest_chunk_priced_within(correction, budget_ms: float) -> int:
    """The largest chunk (in steps of 8 tokens) whose corrected cost plus margin fits the budget."""
    fitting = [c for c in range(0, 2049, 8) if correction.cost(1, c) + correction.margin(1, c) <= budget_ms]
    return max(fitting, default=-1)


def test_a_stall_past_every_budget_is_left_out_once_decode_only_steps_show_it_too():
    """What vLLM's CPU engine did at a 20 ms target after a spell of 35-160 ms stalls: the spell's
    residuals stood in the margin's pools for 2,000 steps, the margins of a chunk at 90-130 ms,
    and 90 % of steps ran without a chunk for 5 s while prompts waited (attainment 0.04 where the
    tuned budget had 0.92). A residual past the largest budget a decision has had (rounded up to
    the buckets' edge) is a stall no margin could have met a deadline through, nor a step without
    the chunk: once decode-only steps show such stalls too, at a like rate per millisecond of step
    (a longer step is caught by more of them), they are left out of the pools."""
    # stalls at one rate per ms of step: 1 % of the 2 ms steps, 5 % of the 10 ms ones
    correction, policy = stalled_correction(stall_share=0.01, with_chunk_share=0.05)
    margin = correction.margin
    assert margin(1, 0) >= 140.0 and margin(1, 400) >= 140.0  # before any budget is told, they count
    decision = policy.decide(1, 10_000, 20.0)
    assert margin.stall_ms == PREDICTED_MS_EDGES[predicted_bucket(20.0) + 1]  # 22.6 ms
    assert not decision.infeasible and decision.chunk_tokens >= 700  # 2 + 0.02 c + ~1 ms <= 20 ms
    assert margin(1, 0) <= 2.0 and margin(1, 400) <= 2.0  # the machine's noise again
    assert margin.as_dict()["stalls_past_ms"] == margin.stall_ms
    assert correction.cost(1, decision.chunk_tokens) + margin(1, decision.chunk_tokens) <= 20.0


@pytest.mark.parametrize(
    ("decode_only_share", "with_chunk_share"),
    [(0.0, 0.05), (0.002, 0.10)],  # no decode-only stall; chunk steps caught 10x as often per ms
)
def test_stalls_steps_with_a_chunk_show_far_more_often_stay_theirs(decode_only_share, with_chunk_share):
    """Only the machine's stalls are left out: where steps with a chunk stall and decode-only
    steps do not, or far more often per millisecond of step, the chunk itself is slow and its
    margin covers it."""
    correction, policy = stalled_correction(stall_share=decode_only_share, with_chunk_share=with_chunk_share)
    policy.decide(1, 10_000, 20.0)
    assert correction.margin(1, 400) >= 140.0
    assert largest_chunk_priced_within(correction, 20.0) < 400


def test_a_stall_within_the_budget_counts_only_as_the_risk_the_chunk_adds():
    """Stalls shorter than the budget but past a decode-only step's slack (42 ms here: 2 ms steps,
    a 40 ms budget) make that step late too. A decision reads its margins at the quantile less the
    share p of like steps a stall makes late, p the largest among the pools its steps read: the
    decode-only step's and those of the steps with a chunk it could plan, these counting up to the
    decode-only share times how much longer their steps are (a stall comes in wall time). Read at
    P(99.7 - 1 %) (the decode-only share alone), the chunk's pool, 5 % of it stalled, kept every
    chunk of 200 tokens or more from running."""
    correction, policy = stalled_correction(stall_share=0.01, stall_ms=42.0, with_chunk_share=0.05)
    margin = correction.margin
    decision = policy.decide(1, 10_000, 40.0)
    assert margin.stall_ms > 45.0  # within the budget, rounded up: kept in the pools
    assert not decision.infeasible and decision.chunk_tokens >= 1500  # 2 + 0.02 c + ~1 ms <= 40 ms
    assert margin.quantile - 5.0 - 1.0 <= margin.level <= margin.quantile - 3.0
    assert correction.cost(1, decision.chunk_tokens) + margin(1, decision.chunk_tokens) <= 40.0
    # a decode-only share of 1 % and steps 20 times as long at most: a pool counts up to 20 %, not 40 %
    correction, policy = stalled_correction(stall_share=0.01, stall_ms=42.0, with_chunk_share=0.40)
    policy.decide(1, 10_000, 40.0)
    assert correction.margin.level >= correction.margin.quantile - 100 * 0.01 * 40.0 / 2.0 - 1.0


def test_on_a_quiet_machine_a_decision_reads_the_quantile_itself():
    quiet, policy = stalled_correction(stall_share=0.0)
    before = [quiet.margin(1, c) for c in (0, 100, 400, 1000)]
    decision = policy.decide(1, 10_000, 20.0)
    assert quiet.margin.level == quiet.margin.quantile and decision.chunk_tokens > 0
    assert [quiet.margin(1, c) for c in (0, 100, 400, 1000)] == before
    # past the median a decode-only step is itself likely late: the quantile as it is, no chunk
    stalled, policy = stalled_correction(stall_share=0.6, stall_ms=19.0)
    assert policy.decide(1, 10_000, 20.0).infeasible and stalled.margin.level == stalled.margin.quantile


def test_the_tables_are_rebuilt_once_per_refresh_and_the_relative_window_read_only_when_needed(monkeypatch):
    """Rebuilding the tables was the largest part of the plug-in's scheduling inside vLLM: they are
    rebuilt once every ``TABLE_REFRESH_STEPS`` observed steps however many chunks a decision
    prices, and the relative margin's window (a sort of its own) is read only for a bucket
    with too few steps."""
    import sloweave.core.costs.step_margin as step_margin

    correction = self_correcting(LinearCost(), margin_form="per-step")
    rng = np.random.default_rng(0)

    def observe(steps: int) -> None:
        for _ in range(steps):
            n, c = int(rng.integers(1, 17)), int(rng.choice([0, 1500]))
            predicted = correction.cost(n, c)
            correction.calibrator.observe(n, c, predicted, predicted + float(rng.normal(0.0, 1.0)))
            for chunk in (0, 10, 500, 1500, 2000):  # a decision prices several chunks between steps
                correction.margin(n, chunk)

    observe(200)  # fewer steps than P99.7 needs: every bucket takes the relative fraction
    rebuilt, relative_reads = [], []
    monkeypatch.setattr(step_margin, "margin_table", lambda *a, **k: rebuilt.append(1) or margin_table(*a, **k))
    window_fraction = correction.margin.relative.window_fraction
    monkeypatch.setattr(
        correction.margin.relative, "window_fraction", lambda: relative_reads.append(1) or window_fraction()
    )
    observe(TABLE_REFRESH_STEPS)
    assert len(rebuilt) == 2 and len(relative_reads) == 2  # one table per step kind, each with thin buckets
    observe(2000)
    rebuilt.clear(), relative_reads.clear()
    observe(10 * TABLE_REFRESH_STEPS)
    assert len(rebuilt) == 2 * 10 and not relative_reads


LINEAR_COSTS = st.builds(
    LinearCost,
    st.floats(0.1, 20.0),
    st.floats(0.0, 0.5),
    st.floats(0.0005, 0.1),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cost=LINEAR_COSTS,
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(0, 1500),
    quantile=st.sampled_from([60.0, 90.0, 99.0, 99.7]),
    small_noise_ms=st.floats(0.0, 30.0),
    large_noise_ms=st.floats(0.0, 30.0),
    relative_noise=st.floats(0.0, 0.5),
)
def test_corrected_cost_plus_per_step_margin_is_monotone_in_the_chunk(
    cost, seed, steps, quantile, small_noise_ms, large_noise_ms, relative_noise
):
    """T'(n, c) + delta(n, c) never drops along c >= 1 (what the policy's binary search needs),
    whatever residuals were seen: noise that grows or shrinks with the step (so a lower bucket
    can need more margin than a higher one), biased steps, thin buckets."""
    correction = self_correcting(cost, margin_form="per-step", quantile=quantile, min_steps=5)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        n = int(rng.integers(0, 65))
        c = int(rng.integers(0, 2049)) if rng.random() < 0.7 else 0
        c = c if n or c else 1
        base_ms = cost.predict(n, c, 0, 0)
        noise_ms = small_noise_ms if base_ms < 20.0 else large_noise_ms
        measured_ms = base_ms * (1.0 + relative_noise * rng.standard_normal()) + noise_ms * rng.exponential()
        correction.calibrator.observe(n, c, base_ms, max(measured_ms, 0.0))
    chunks = range(1, 2049)
    for n in (0, 3, 40):
        # a decision's budget first: where its decode-only step would be late it reads another level
        correction.margin.set_step(n, float(cost.predict(n, 0, 0, 0) + rng.uniform(0.0, 60.0)))
        totals = [correction.cost(n, c) + correction.margin(n, c) for c in chunks]
        drops = [c for c, (a, b) in zip(chunks, zip(totals, totals[1:])) if b < a]
        assert not drops, (n, drops[:3])
        assert all(correction.margin(n, c) >= 0 for c in (0, 1, 512, 2048))


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: self_correcting(LinearCost(), margin_form="additive"),
            "margin form must be one of relative, per-step",
        ),
        (lambda: self_correcting(LinearCost(), margin_form="per-step", quantile=100.0), "quantile must be in"),
        (lambda: self_correcting(LinearCost(), margin_form="per-step", quantile=40.0), "quantile must be in"),
        (
            lambda: StepMargin(LinearCost(), StepResiduals(), None, math.nan, 50, 8),
            "quantile must be in",
        ),
        (lambda: StepResiduals(window_steps=0), "window_steps must be a whole number"),
        (lambda: StepResiduals(horizon_steps=True), "horizon_steps must be a whole number"),
        (lambda: StepResiduals().add(True, math.nan, 5.0), "finite times >= 0 ms"),
        (lambda: StepResiduals().add(False, 5.0, -1.0), "finite times >= 0 ms"),
        (lambda: StepResiduals().add(False, 5.0, math.inf), "finite times >= 0 ms"),
    ],
)
def test_bad_input_is_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("predicted_ms, measured_ms", [(math.nan, 5.0), (5.0, math.nan), (-1.0, 5.0), (5.0, -2.0)])
def test_a_bad_step_time_is_refused_before_it_reaches_the_residuals(predicted_ms, measured_ms):
    correction = self_correcting(LinearCost(), margin_form="per-step")
    with pytest.raises(ValueError, match="finite times >= 0 ms"):
        correction.calibrator.observe(2, 64, predicted_ms, measured_ms)
    assert correction.calibrator.step_residuals.observed == 0


def test_engine_options_refuse_a_bad_form_and_a_form_without_correction():
    with pytest.raises(ValueError, match="margin_form must be one of relative, per-step"):
        EngineOptions(correction=True, margin_form="ms")
    with pytest.raises(ValueError, match="margin_form per-step needs correction"):
        EngineOptions(margin_form="per-step")
    assert EngineOptions().margin_form == "relative"


def test_engine_options_margin_form_reaches_the_simulator(monkeypatch):
    """A simulated run with noise and correction: the two forms decide with different margins."""
    import sloweave.sim.options as options

    built = []

    def recording(*args, **kwargs):
        built.append(self_correcting(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(options, "self_correcting", recording)
    spec = get_workload_spec("mixed")
    workload = spec.generate(300, 0, 1.0)
    cost = LinearCost(8.0, 0.05, 0.02)
    results = {}
    for form in MARGIN_FORMS:
        engine = EngineOptions(noise_sigma=0.1, correction=True, margin_form=form)
        results[form] = engine.simulate(workload, SLOWeave(cost=cost), 50.0, spec.ttft_ms, cost, noise_seed=1)
    relative, per_step = built
    assert isinstance(relative.margin, AdaptiveMargin) and isinstance(per_step.margin, StepMargin)
    assert min(per_step.calibrator.step_residuals.added.sum(axis=1)) >= 333  # P99.7 per kind
    assert relative.margin(4, 0) != per_step.margin(4, 0) and relative.margin(4, 1024) != per_step.margin(4, 1024)
    chunks = [results[form].iter_chunk_tokens for form in MARGIN_FORMS]
    assert not np.array_equal(*chunks)


def test_plugin_config_takes_the_margin_form_only_with_online_correction():
    from sloweave.vllm_plugin.config import PluginConfig, PluginConfigError

    decision = PluginConfig(online_correction=True, margin_form="per-step").build_decision()
    assert isinstance(decision.margin, StepMargin) and decision.coverage == pytest.approx(0.997)
    assert isinstance(PluginConfig(online_correction=True).build_decision().margin, StepMargin)  # the default
    relative = PluginConfig(online_correction=True, margin_form="relative").build_decision()
    assert isinstance(relative.margin, AdaptiveMargin)
    assert (
        PluginConfig.from_sources(
            {}, environ={"SLOWEAVE_MARGIN_FORM": "per-step", "SLOWEAVE_ONLINE_CORRECTION": "1"}
        ).margin_form
        == "per-step"
    )
    with pytest.raises(PluginConfigError, match="margin_form must be one of relative, per-step, got 'ms'"):
        PluginConfig(online_correction=True, margin_form="ms")
    with pytest.raises(PluginConfigError, match="margin_form must be one of relative, per-step, got 1"):
        PluginConfig.from_sources({"sloweave": {"margin_form": 1, "online_correction": True}}, environ={})
    for form in ("per-step", "relative"):
        with pytest.raises(PluginConfigError, match=f"margin_form '{form}' needs online_correction"):
            PluginConfig(margin_form=form)
    assert PluginConfig().margin_form is None  # no online correction: no adaptive margin to shape


def test_after_a_noisy_spell_a_quiet_machine_brings_the_margin_back(monkeypatch):
    """What vLLM's CPU engine did after two processes spun on its cores for 6 s: the spell's
    residuals (up to the budget) stood in the windows for 2,000 steps and held every chunk back,
    and only decode-only steps ran, 300 a second, while prompts waited. Once more decode-only steps
    in a row stay within the windows' decode-only tail than chance allows at the rate they left it
    before, the residuals before them are forgotten."""
    rng = np.random.default_rng(0)

    def chunk_margin_after_a_spell() -> tuple[float, int]:
        correction = self_correcting(
            LinearCost(base_ms=2.0, per_decode_ms=0.0, per_token_ms=0.02), margin_form="per-step"
        )
        margin, residuals = correction.margin, correction.margin.residuals
        for _ in range(1500):
            residuals.add(False, 2.0, 2.0 + float(rng.uniform(-1.0, 1.0)))
            residuals.add(True, 10.0, 10.0 + float(rng.uniform(-1.0, 1.0)))
        for _ in range(100):  # the spell: every step 5-20 ms late
            residuals.add(False, 2.0, 2.0 + float(rng.uniform(5.0, 20.0)))
            residuals.add(True, 10.0, 10.0 + float(rng.uniform(5.0, 20.0)))
        for _ in range(600):  # after it only decode-only steps run (the margin holds chunks back)
            residuals.add(False, 2.0, 2.0 + float(rng.uniform(-1.0, 1.0)))
        return margin(1, 400), residuals.since_step

    with monkeypatch.context() as patched:  # the rule off: the spell holds
        patched.setattr(step_residuals, "quieter_since", lambda residuals, fewest_steps: None)
        held, _ = chunk_margin_after_a_spell()
    assert held >= 15.0
    back, since = chunk_margin_after_a_spell()
    assert back <= 2.0 and 3200 <= since <= 3800  # forgotten from the spell's end, not before


def test_a_machine_whose_noise_holds_forgets_nothing():
    """Over 30,000 steps of steady noise (a heavy tail: 2 % of steps 3-6 ms late, as this CPU's
    once-a-second interruption), the quiet test never fires."""
    rng = np.random.default_rng(1)
    correction = self_correcting(LinearCost(base_ms=2.0, per_decode_ms=0.0, per_token_ms=0.02), margin_form="per-step")
    margin, residuals = correction.margin, correction.margin.residuals
    for step in range(15_000):
        for chunk in (0, 400) if step % 3 else (0,):
            late = float(rng.uniform(3.0, 6.0)) if rng.random() < 0.02 else 0.0
            predicted = 2.0 + 0.02 * chunk
            residuals.add(chunk > 0, predicted, predicted + float(rng.normal(0.0, 0.3)) + late)
        if step % 32 == 0 and step >= 500:  # (past the fewest steps a table is read from alone)
            margin.tables()
    assert residuals.since_step == 0


def test_a_factor_the_spell_taught_goes_with_it():
    """After two processes spun on vLLM's CPU engine's cores for 6 s, its steps with a chunk and 4-7
    decodes kept the correction factor the spell taught (about 4x) and ran no chunk for 6 s after
    it, the margin back to the machine's noise: no such step ran to correct the factor. Once the
    machine-wide correction has moved by more than 3x since a factor was set, it borrows that."""
    correction = self_correcting(LinearCost(base_ms=2.0, per_decode_ms=0.0, per_token_ms=0.02), margin_form="per-step")
    calibrator, rng = correction.calibrator, np.random.default_rng(0)
    for _ in range(600):
        calibrator.observe(1, 0, 2.0, 2.0 * float(rng.uniform(0.95, 1.05)))
        calibrator.observe(5, 400, 10.0, 10.0 * float(rng.uniform(0.95, 1.05)))
    chunk_before = calibrator.factor(5, True)
    for _ in range(60):  # the spell: every step 4x as long; a chunk's factor learns it
        calibrator.observe(1, 0, 2.0, 8.0)
        calibrator.observe(5, 400, 10.0, 40.0)
    assert calibrator.factor(5, True) >= 3.5 and calibrator.factor(1, False) >= 3.5
    for _ in range(100):  # quiet again, decode-only steps only (chunks held back)
        calibrator.observe(1, 0, 2.0, 2.0 * float(rng.uniform(0.95, 1.05)))
    assert calibrator.factor(1, False) <= 1.1
    assert abs(calibrator.factor(5, True) - calibrator.factor(1, False)) <= 0.2  # borrowed: not 4x
    # a steady machine keeps every factor it learnt, stalls and all
    steady = self_correcting(LinearCost(base_ms=2.0, per_decode_ms=0.0, per_token_ms=0.02), margin_form="per-step")
    for step in range(3000):
        stall = 50.0 if step % 97 == 0 else 0.0
        steady.calibrator.observe(1, 0, 2.0, 2.0 * float(rng.uniform(0.95, 1.05)) + stall)
        if step % 5 == 0:
            steady.calibrator.observe(5, 400, 10.0, 13.0 * float(rng.uniform(0.95, 1.05)))
    assert steady.calibrator.factor(5, True) >= 1.2 and chunk_before <= 1.05
