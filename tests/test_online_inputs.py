"""The core's online pieces refuse inputs they cannot use (issue 25, class 4): a bad step never
turns the margin off, lands in a wrong bucket, or shifts which step a measurement belongs to."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sloweave.core.budget import BudgetController, StepState, make_policy_for_engine
from sloweave.core.costs.calibrated import CalibratedCost, ContextFreeCost, OnlineCalibrator, self_correcting
from sloweave.core.costs.analytic import AnalyticCost

COUNTS = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True))
TIMES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70))


def valid(n, c, predicted_ms, measured_ms) -> bool:
    return n >= 0 and c >= 0 and all(0 <= t < math.inf for t in (predicted_ms, measured_ms))


@settings(derandomize=True, max_examples=400, deadline=None)
@given(st.lists(st.tuples(COUNTS, COUNTS, TIMES, TIMES), min_size=1, max_size=30))
def test_observe_takes_only_what_it_can_use_and_the_margin_stays_a_number(steps):
    correction = self_correcting(AnalyticCost())
    calibrator = correction.calibrator
    for n, c, predicted_ms, measured_ms in steps:
        if valid(n, c, predicted_ms, measured_ms):
            calibrator.observe(n, c, predicted_ms, measured_ms)
        else:
            with pytest.raises(ValueError, match="observe needs"):
                calibrator.observe(n, c, predicted_ms, measured_ms)
    assert all(math.isfinite(r) for r in calibrator.recent_residuals)
    assert all(math.isfinite(calibrator.factor(n, has_chunk)) for n in (0, 1, 64, 4096) for has_chunk in (False, True))
    if calibrator.recent_residuals:
        assert math.isfinite(calibrator.residual_quantile(99.7)) and calibrator.residual_quantile(99.7) >= 0


def test_an_infinite_step_no_longer_switches_the_margin_off():
    """The defect: inf made the residual quantile NaN, max(0, NaN) gave 0, the plan had no margin."""
    correction = self_correcting(AnalyticCost(), min_steps=1)
    calibrator = correction.calibrator
    for _ in range(20):
        calibrator.observe(4, 100, 2.0, 3.0)  # steps 50 % over the model
    with pytest.raises(ValueError, match="measured_ms=inf"):
        calibrator.observe(4, 100, 2.0, math.inf)
    with pytest.raises(ValueError, match="n_decodes=-1"):
        calibrator.observe(-1, 100, 2.0, 3.0)  # would have landed in the top bucket
    assert correction.margin(4, 100) > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_factor": 0}, "min_factor must be a finite number > 0 and <= 1e\\+10, got 0"),
        ({"min_factor": 2.0, "max_factor": 1.5}, "min_factor <= 1 <= max_factor"),
        ({"max_factor": math.inf}, "max_factor must be a finite number"),
        ({"alpha": True}, r"alpha must be in \(0, 1\]"),
        ({"alpha": math.nan}, "alpha must be a finite number"),
        ({"window_steps": 0}, "window_steps must be a whole number >= 1"),
    ],
)
def test_a_calibrator_that_cannot_work_is_refused_naming_its_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OnlineCalibrator(**kwargs)


def corrected_controller():
    calibrator = OnlineCalibrator(alpha=1.0)
    policy = make_policy_for_engine(CalibratedCost(ContextFreeCost(AnalyticCost()), calibrator), None, 4096)
    return BudgetController(policy, default_tpot_ms=10.0, max_budget_tokens=8192, correction=calibrator), calibrator


@pytest.mark.parametrize("glitch", [math.nan, math.inf, -math.inf])
def test_a_clock_glitch_is_refused_before_a_plan_is_made(glitch):
    c, _ = corrected_controller()
    c.on_token("a", 0.0)
    with pytest.raises(ValueError, match="clock read"):
        c.plan_step(StepState(now_ms=glitch, decode_tokens=1, pending_prompt_tokens=500))
    assert c.stats.steps == 0  # nothing changed


def test_a_step_that_returns_at_a_glitched_time_is_dropped_and_the_next_pairs_with_its_own_step():
    c, calibrator = corrected_controller()
    c.on_token("a", 0.0)
    first = c.plan_step(StepState(now_ms=0.0, decode_tokens=1, pending_prompt_tokens=500))
    c.on_scheduled(first, ["a"])
    with pytest.raises(ValueError, match="clock read nan"):
        c.on_step_done(math.nan, ["a"])
    assert calibrator.observations.sum() == 0 and not c._in_flight  # nothing learnt, the step gone
    second = c.plan_step(StepState(now_ms=20.0, decode_tokens=1, pending_prompt_tokens=500))
    c.on_scheduled(second, ["a"])
    c.on_step_done(20.0 + 2 * second.predicted_ms, ["a"])
    assert calibrator.factor(1, True) == pytest.approx(2.0)  # measured against its own plan


def test_a_factor_its_steps_stopped_feeding_is_forgotten_past_the_horizon():
    """What vLLM's CPU engine did after a slow spell at a 20 ms target: steps with a chunk had learnt
    a factor of 2.0, the margin then kept chunks from running, and the factor stood 20 s later while
    the decode-only steps had come back to 0.8. A bucket's factor stands for ``FACTOR_HORIZON_STEPS``
    steps of any kind after its last one; then it borrows the machine-wide correction, and its next
    step sets it anew."""
    from sloweave.core.costs.calibrated import FACTOR_HORIZON_STEPS

    calibrator = OnlineCalibrator()
    for _ in range(20):  # the slow spell: every step twice its prediction
        calibrator.observe(1, 0, 2.0, 4.0)
        calibrator.observe(1, 256, 10.0, 20.0)
    for _ in range(FACTOR_HORIZON_STEPS):  # then the machine is fast again, and only decode-only steps run
        calibrator.observe(1, 0, 2.0, 1.6)
    assert calibrator.factor(1, False) == pytest.approx(0.8)
    assert calibrator.factor(1, True) == pytest.approx(2.0)  # within the horizon it still stands
    calibrator.observe(1, 0, 2.0, 1.6)
    assert calibrator.factor(1, True) == pytest.approx(0.8)  # past it: the machine-wide correction
    calibrator.observe(1, 256, 10.0, 9.0)
    assert calibrator.factor(1, True) == pytest.approx(0.9)  # set anew by its next step, not averaged with 2.0
