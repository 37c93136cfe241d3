"""The engine-facing budget controller and the plug-in configuration (no engine needed)."""

import math

import numpy as np

import pytest

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.margins import ConstantMargin
from sloweave.core.budget import BudgetController, StepState, make_policy_for_engine
from sloweave.core.policy import make_policy
from sloweave.core.size_grid import SizeGrid, on_grid, size_grid
from sloweave.vllm_plugin.config import PluginConfig, PluginConfigError


def controller(**kwargs):
    policy = make_policy_for_engine(AnalyticCost(), None, kwargs.pop("max_chunk_tokens", 4096))
    return BudgetController(
        policy,
        default_tpot_ms=kwargs.pop("tpot_ms", 10.0),
        max_budget_tokens=kwargs.pop("max_budget_tokens", 8192),
        **kwargs,
    )


def test_budget_is_decodes_plus_the_deadline_safe_chunk():
    c = controller()
    # nothing decoding: the largest chunk
    plan = c.plan_step(StepState(now_ms=0.0, decode_tokens=0, pending_prompt_tokens=10_000))
    assert plan.token_budget == 4096 and math.isinf(plan.budget_ms)
    for i in range(4):
        c.on_token(f"r{i}", 100.0)
    plan = c.plan_step(StepState(now_ms=100.0, decode_tokens=4, pending_prompt_tokens=10_000))
    assert abs(plan.chunk_tokens - 1355) <= 1 and plan.token_budget == 4 + plan.chunk_tokens
    # slack shrinks as time passes since the last token: a smaller chunk
    later = c.plan_step(StepState(now_ms=104.0, decode_tokens=4, pending_prompt_tokens=10_000))
    assert later.budget_ms == pytest.approx(6.0) and later.chunk_tokens < plan.chunk_tokens
    # nothing fits: decode-only, never below the decodes' demand
    late = c.plan_step(StepState(now_ms=109.9, decode_tokens=4, pending_prompt_tokens=10_000))
    assert late.chunk_tokens == 0 and late.token_budget == 4 and late.infeasible
    assert c.stats.infeasible_steps == 1


def test_in_flight_step_moves_the_start_and_the_deadlines():
    c = controller()
    c.on_token("a", 0.0)
    first = c.plan_step(StepState(now_ms=0.0, decode_tokens=1, pending_prompt_tokens=500))
    c.on_scheduled(first, ["a"])
    # scheduled while the first is in flight: starts at its predicted end, and "a" will have
    # emitted a token by then, so its next deadline counts from there
    second = c.plan_step(StepState(now_ms=0.5, decode_tokens=1, pending_prompt_tokens=500))
    assert second.start_ms == pytest.approx(first.predicted_ms)
    assert second.budget_ms == pytest.approx(10.0)
    c.on_scheduled(second, ["a"])
    # the first step returns 0.2 ms late: the second (in flight) is re-timed from its real end,
    # and "a"'s last token before a third step is the second's end, not the first's real end
    late = first.predicted_ms + 0.2
    c.on_step_done(late, ["a"])
    assert c.stats.recent[-1][3] == pytest.approx(late)
    third = c.plan_step(StepState(now_ms=late + 0.1, decode_tokens=1, pending_prompt_tokens=500))
    assert third.start_ms == pytest.approx(late + second.predicted_ms)
    assert c.tracker.deadline_of("a") == pytest.approx(late + second.predicted_ms + 10.0)
    assert third.budget_ms == pytest.approx(10.0)


def test_a_request_gone_while_a_step_holding_it_is_in_flight_is_not_tracked_again():
    """Asynchronous scheduling: step 2 holds "a" when step 1's output says "a" stopped (or it is
    preempted); step 2's predicted token must not bring its deadline back, which would pass
    and pin every later budget at 0 ms (decode-only steps while prompts wait)."""
    c = controller()
    c.on_tokens(["a", "b"], 0.0)
    state = StepState(now_ms=0.0, decode_tokens=2, pending_prompt_tokens=5000)
    c.on_scheduled(c.plan_step(state), ["a", "b"])
    second = c.plan_step(StepState(now_ms=0.5, decode_tokens=2, pending_prompt_tokens=5000))
    c.on_scheduled(second, ["a", "b"])
    c.on_step_done(second.start_ms, ["a", "b"])  # step 1 back: "a" stopped
    c.on_finished("a")
    third = c.plan_step(StepState(now_ms=second.start_ms + 0.1, decode_tokens=1, pending_prompt_tokens=5000))
    c.on_scheduled(third, ["b"])
    assert "a" not in c.tracker
    for step_end in (third.start_ms, third.start_ms + third.predicted_ms):  # steps 2 and 3 back
        c.on_step_done(step_end, ["b"])
    assert "a" not in c.tracker and len(c.tracker) == 1
    # long after "a" would have been due, "b" alone sets the budget: a full chunk beside it
    later = c.plan_step(StepState(now_ms=step_end + 1.0, decode_tokens=1, pending_prompt_tokens=5000))
    assert later.budget_ms == pytest.approx(9.0) and later.chunk_tokens > 1000


def test_per_request_target_tightens_the_budget():
    c = controller(tpot_ms=50.0, tpot_ms_of={"interactive": 10.0}.get)
    c.on_token("batch", 0.0)
    c.on_token("interactive", 0.0)
    plan = c.plan_step(StepState(now_ms=0.0, decode_tokens=2, pending_prompt_tokens=8000))
    assert plan.budget_ms == 10.0
    c.on_finished("interactive")
    assert c.plan_step(StepState(now_ms=0.0, decode_tokens=1, pending_prompt_tokens=8000)).budget_ms == 50.0


def test_aging_forces_a_chunk_and_records_the_exception():
    c = controller(tpot_ms=1.0, aging_ms=500.0, aging_chunk_tokens=128)
    c.on_token("d1", 0.0)
    young = c.plan_step(StepState(0.0, 1, 5000, "p", oldest_prompt_waiting_ms=100.0, decoding_ids=("d1",)))
    assert young.chunk_tokens == 0 and not young.aged
    old = c.plan_step(StepState(0.0, 1, 5000, "p", oldest_prompt_waiting_ms=600.0, decoding_ids=("d1",)))
    assert old.aged and old.chunk_tokens == 128 and old.token_budget == 129
    [exception] = c.stats.slo_exceptions
    assert exception.request_id == "p" and exception.affected_ids == ("d1",) and exception.chunk_tokens == 128


def test_margin_and_engine_cap():
    policy = make_policy_for_engine(AnalyticCost(), ConstantMargin(2.0), 4096)
    c = BudgetController(policy, default_tpot_ms=10.0, max_budget_tokens=512)
    c.on_token("a", 0.0)
    plan = c.plan_step(StepState(now_ms=0.0, decode_tokens=1, pending_prompt_tokens=9000))
    assert plan.token_budget == 512  # the engine's own max_num_batched_tokens stays the upper bound


def test_steps_are_rounded_down_to_the_size_grid_where_a_chunk_stays_and_prompt_tokens_wait():
    plain, grid = controller(), controller(step_grid_tokens=32)
    for c in (plain, grid):
        for i in range(4):
            c.on_token(f"r{i}", 100.0)
    state = StepState(now_ms=100.0, decode_tokens=4, pending_prompt_tokens=10_000)
    free, rounded = plain.plan_step(state), grid.plan_step(state)
    assert free.token_budget % 32 and rounded.token_budget == free.token_budget - free.token_budget % 32
    assert rounded.chunk_tokens == rounded.policy_chunk_tokens == rounded.token_budget - 4
    assert rounded.predicted_ms < free.predicted_ms  # priced as it will run: smaller, still safe
    # the whole offer fits: it is taken as it is, no prompt token left for a step of its own
    whole = grid.plan_step(StepState(now_ms=100.0, decode_tokens=4, pending_prompt_tokens=45))
    assert whole.token_budget == 49
    # the engine's own cap and C_max are left as they are: the deadline did not cut them
    capped = controller(step_grid_tokens=32, max_budget_tokens=100)
    capped.on_token("r0", 0.0)
    assert capped.plan_step(StepState(now_ms=0.0, decode_tokens=1, pending_prompt_tokens=10_000)).token_budget == 100
    at_c_max = controller(step_grid_tokens=32, max_chunk_tokens=50)
    at_c_max.on_token("r0", 0.0)
    assert at_c_max.plan_step(StepState(now_ms=0.0, decode_tokens=1, pending_prompt_tokens=10_000)).token_budget == 51
    # decode-only steps are left alone (a step below one grid step: ``test_on_grid``)
    late = grid.plan_step(StepState(now_ms=109.99, decode_tokens=4, pending_prompt_tokens=10_000))
    assert late.token_budget == 4


@pytest.mark.parametrize(
    "step, decodes, grid, expected",
    [(100, 4, 32, 96), (30, 4, 32, 30), (64, 64, 32, 64), (70, 64, 32, 70), (97, 90, 8, 96), (97, 96, 8, 97)],
)
def test_on_grid(step, decodes, grid, expected):
    assert on_grid(step, decodes, grid) == expected


def test_bad_controller_arguments():
    with pytest.raises(ValueError, match="step_grid_tokens"):
        controller(step_grid_tokens=0)
    with pytest.raises(ValueError, match="aging_ms"):
        controller(aging_ms=0)
    with pytest.raises(ValueError, match="max_budget_tokens"):
        controller(max_budget_tokens=0)


def test_plugin_config_sources_and_errors(tmp_path):
    assert PluginConfig.from_sources({}, environ={}) == PluginConfig()
    config = PluginConfig.from_sources(
        {"sloweave": {"tpot_ms": 50, "aging_ms": 0}}, environ={"SLOWEAVE_TPOT_MS": "10", "SLOWEAVE_MARGIN_MS": "1.5"}
    )
    assert config.tpot_ms == 50 and config.margin_ms == 1.5 and config.aging_ms == 0
    cost, margin = config.build_cost_and_margin()
    assert cost(4, 0) == AnalyticCost()(4, 0) and margin(4, 100) == 1.5
    bad = [
        ({"sloweave": {"tpot_ms": -1}}, {}, "tpot_ms must be a finite number of milliseconds > 0"),
        ({"sloweave": {"tpot_ms": "fast"}}, {}, "tpot_ms"),
        ({"sloweave": {"max_chunk_tokens": 0}}, {}, "max_chunk_tokens"),
        ({"sloweave": {"chunk": 5}}, {}, "unknown key"),
        ({"sloweave": {"cost": str(tmp_path / "missing.csv")}}, {}, "existing profile file"),
        ({"sloweave": {"profile_margin": True}}, {}, "profile_margin needs"),
        ({"sloweave": {"cost_kind": "magic"}}, {}, "cost_kind"),
        ({"sloweave": []}, {}, "must be an object"),
        ({}, {"SLOWEAVE_TPOT_MS": "abc"}, "SLOWEAVE_TPOT_MS"),
        ({}, {"SLOWEAVE_PROFILE_MARGIN": "maybe"}, "SLOWEAVE_PROFILE_MARGIN"),
    ]
    for additional, env, message in bad:
        with pytest.raises(PluginConfigError, match=message):
            PluginConfig.from_sources(additional, environ=env)
    with pytest.raises(PluginConfigError, match="analytic"):
        PluginConfig(analytic={"bogus_ms": 1.0}).build_cost_and_margin()
    corrupt = tmp_path / "profile.csv"
    corrupt.write_text("n_decodes,chunk_tokens\n1,2\n")
    with pytest.raises(PluginConfigError, match="cost profile"):
        PluginConfig(cost=str(corrupt)).build_cost_and_margin()


def test_a_step_ending_early_moves_the_next_one_earlier_but_not_before_it_was_scheduled():
    c = controller()
    c.on_token("a", 0.0)
    first = c.plan_step(StepState(now_ms=0.0, decode_tokens=1, pending_prompt_tokens=500))
    c.on_scheduled(first, ["a"])
    second = c.plan_step(StepState(now_ms=0.3, decode_tokens=1, pending_prompt_tokens=500))
    c.on_scheduled(second, ["a"])
    early = first.predicted_ms - 1.0
    c.on_step_done(early, ["a"])
    third = c.plan_step(StepState(now_ms=early, decode_tokens=1, pending_prompt_tokens=500))
    assert third.start_ms == pytest.approx(early + second.predicted_ms)
    # had it been scheduled only after the first step's real end, it would start then
    c2 = controller()
    c2.on_token("a", 0.0)
    p1 = c2.plan_step(StepState(now_ms=0.0, decode_tokens=1, pending_prompt_tokens=500))
    c2.on_scheduled(p1, ["a"])
    p2 = c2.plan_step(StepState(now_ms=p1.predicted_ms + 2.0, decode_tokens=1, pending_prompt_tokens=500))
    c2.on_scheduled(p2, ["a"])
    c2.on_step_done(p1.predicted_ms - 1.0, ["a"])
    p3 = c2.plan_step(StepState(now_ms=p1.predicted_ms + 2.5, decode_tokens=1, pending_prompt_tokens=500))
    assert p3.start_ms == pytest.approx(p1.predicted_ms + 2.0 + p2.predicted_ms)


# ----------------------------------------------------------------------------- one place per rule


def test_the_controller_and_the_simulator_decide_a_starving_step_the_same_way():
    """Same state, same rule: the controller's plan and the simulator's decision agree,
    and both record the core's SLOException."""
    import numpy as np

    from sloweave.core.policy import Aging, decide_step
    from sloweave.core.slo import SLOException
    from sloweave.sim.engine import simulate
    from sloweave.sim.workloads import Workload

    # Request 0 decodes; request 1's prompt starves at a 1.5 ms TPOT until aging forces 64 tokens.
    policy = make_policy_for_engine(AnalyticCost(), None, 4096)
    wl = Workload("hand", np.array([0.0, 0.001]), np.array([10, 200]), np.array([1000, 5]))
    result = simulate(wl, policy, tpot_ms=1.5, aging=Aging(100.0, 64))
    sim_exception = result.slo_exceptions[0]
    c = controller(tpot_ms=1.5, aging_ms=100.0, aging_chunk_tokens=64)
    c.on_token(0, sim_exception.start_ms - 1.5 + 0.0)  # its last token left one budget before the step
    waited = sim_exception.start_ms - 1.0  # request 1 arrived at 1 ms and never progressed
    plan = c.plan_step(
        StepState(
            now_ms=sim_exception.start_ms,
            decode_tokens=1,
            pending_prompt_tokens=200,
            oldest_prompt_id=1,
            oldest_prompt_waiting_ms=waited,
            decoding_ids=(0,),
        )
    )
    assert plan.aged and plan.chunk_tokens == sim_exception.chunk_tokens == 64
    assert decide_step(policy, 1, 200, 1.5, Aging(100.0, 64), waited) == (64, False, True)
    [engine_exception] = c.stats.slo_exceptions
    assert type(engine_exception) is type(sim_exception) is SLOException
    assert engine_exception.affected_ids == sim_exception.affected_ids == (0,)
    assert engine_exception.predicted_ms == pytest.approx(sim_exception.predicted_ms)


def test_the_controller_corrects_its_cost_from_measured_step_times():
    from sloweave.core.costs.calibrated import CalibratedCost, ContextFreeCost, OnlineCalibrator

    calibrator = OnlineCalibrator(alpha=1.0)
    policy = make_policy_for_engine(CalibratedCost(ContextFreeCost(AnalyticCost()), calibrator), None, 4096)
    c = BudgetController(policy, default_tpot_ms=10.0, max_budget_tokens=8192, correction=calibrator)
    c.on_token("a", 0.0)
    first = c.plan_step(StepState(now_ms=0.0, decode_tokens=1, pending_prompt_tokens=5000))
    c.on_scheduled(first, ["a"])
    c.on_step_done(2.0 * first.predicted_ms, ["a"])  # the step took twice the prediction
    second = c.plan_step(StepState(now_ms=2.0 * first.predicted_ms, decode_tokens=1, pending_prompt_tokens=5000))
    assert calibrator.factor(1, True) == pytest.approx(2.0)
    assert second.predicted_ms <= 10.0 and second.chunk_tokens < first.chunk_tokens  # the chunk halves, roughly
    with pytest.raises(ValueError, match="CalibratedCost"):
        BudgetController(make_policy_for_engine(AnalyticCost(), None, 4096), 10.0, 8192, correction=calibrator)


def test_plugin_online_correction_builds_a_corrected_cost_and_rejects_a_non_boolean():
    from sloweave.core.costs.calibrated import CalibratedCost

    cost, _ = PluginConfig.from_sources({"sloweave": {"online_correction": True}}, environ={}).build_cost_and_margin()
    assert isinstance(cost, CalibratedCost) and cost(4, 100) == AnalyticCost()(4, 100)
    assert PluginConfig.from_sources({}, environ={"SLOWEAVE_ONLINE_CORRECTION": "yes"}).online_correction is True
    with pytest.raises(PluginConfigError, match="online_correction must be true or false"):
        PluginConfig.from_sources({"sloweave": {"online_correction": "false"}}, environ={})


# ---- the plug-in's cost: the same specs as the commands' --cost (sloweave.core.costs.resolve) ----------


def test_plugin_cost_takes_a_preset_or_an_operator_profile_folder(tmp_path):
    import warnings

    from sloweave.core.costs.operator_profiles import preset_folder
    from sloweave.core.costs.profile import ProfileCost, profile_cost

    reference = profile_cost("llama2-70b-tp2-a100")
    for spec in ("llama2-70b-tp2-a100", str(preset_folder("llama2-70b-tp2-a100"))):
        cost, margin = PluginConfig(cost=spec, margin_fraction=0.1).build_cost_and_margin()
        assert isinstance(cost, ProfileCost) and cost(8, 512) == pytest.approx(reference(8, 512))
        assert margin(8, 512) == pytest.approx(0.1 * reference(8, 512))
    env = PluginConfig.from_sources({}, environ={"SLOWEAVE_COST": "llama3-8b-tp1-a100"})
    resolved = env.resolved_cost()
    assert resolved.label == "llama3-8b-tp1-a100" and "not measured" in resolved.description["attention"]
    # the controller gives it the step's KV context
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # extrapolation past the profiles is counted, and warned about
        cost, _ = env.build_cost_and_margin()
        c = BudgetController(make_policy_for_engine(cost, None, 4096), default_tpot_ms=50.0, max_budget_tokens=8192)
        for i in range(8):
            c.on_token(f"r{i}", 0.0)
        short = c.plan_step(
            StepState(now_ms=0.0, decode_tokens=8, pending_prompt_tokens=8192, decode_kv_tokens=8 * 100)
        )
        long = c.plan_step(
            StepState(now_ms=0.0, decode_tokens=8, pending_prompt_tokens=8192, decode_kv_tokens=8 * 4000)
        )
    assert 0 < long.chunk_tokens <= short.chunk_tokens and short.predicted_ms <= 50.0


def test_plugin_online_correction_wraps_a_profile_cost_as_its_prior():
    from sloweave.core.costs.calibrated import CalibratedCost
    from sloweave.core.costs.profile import ProfileCost

    cost, _ = PluginConfig(cost="llama3-8b-tp1-a100", online_correction=True).build_cost_and_margin()
    assert isinstance(cost, CalibratedCost) and isinstance(cost.base, ProfileCost)  # as_contextual keeps it as is
    cost.set_context(16 * 2000, 500)
    assert cost(16, 256) == pytest.approx(cost.base.predict(16, 256, 16 * 2000, 500))  # no step measured yet: the prior
    for _ in range(20):
        cost.calibrator.observe(
            16, 256, cost.base.predict(16, 256, 16 * 2000, 500), 1.5 * cost.base.predict(16, 256, 16 * 2000, 500)
        )
    assert cost(16, 256) == pytest.approx(1.5 * cost.base.predict(16, 256, 16 * 2000, 500), rel=0.01)


def test_plugin_cost_errors_name_the_spec(tmp_path):
    with pytest.raises(PluginConfigError, match="a preset .*llama3-8b-tp1-a100.*'nope'"):
        PluginConfig(cost="nope")
    with pytest.raises(PluginConfigError, match="profile_margin needs cost set to a step-time profile file"):
        PluginConfig(cost="llama3-8b-tp1-a100", profile_margin=True)
    empty = tmp_path / "profiles"
    empty.mkdir()
    with pytest.raises(PluginConfigError, match=f"sloweave config: cost {empty}.*model.json"):
        PluginConfig(cost=str(empty)).build_cost_and_margin()


def test_the_controller_hands_a_piece_aware_cost_the_prompts_on_offer():
    import warnings
    from pathlib import Path

    from sloweave.core.costs.profile import profile_cost

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cost = profile_cost(str(Path(__file__).parent / "fixtures" / "profiles" / "tiny"))
    policy = make_policy_for_engine(cost, None, 4096)
    c = BudgetController(policy, default_tpot_ms=6.0, max_budget_tokens=8192)
    c.on_token("a", 0.0)
    offer = ((40, 10), (30, 0), (50, 0))
    plan = c.plan_step(
        StepState(
            now_ms=0.0,
            decode_tokens=1,
            pending_prompt_tokens=120,
            decode_kv_tokens=65,
            prefill_prefix_tokens=10,
            prompts_on_offer=offer,
        )
    )
    # the plan's prediction prices the chunk piece by piece over the offer (each its own request)
    pieces, left = [], plan.chunk_tokens
    for remaining, prefix in offer:
        if left <= 0:
            break
        pieces.append((min(left, remaining), prefix))
        left -= remaining
    assert len(pieces) > 1 and plan.predicted_ms == pytest.approx(cost.predict_pieces(1, 65, pieces), rel=1e-12)


# ---- self-correction: the core's one piece (core.calibration.self_correcting) -----------------


def _self_correcting_run(correct: bool, steps: int = 80, bias: float = 1.25):
    """Four decodes and a long prompt; every step really takes ``bias`` x the analytic model x
    seeded noise of up to 5 %. Returns the controller, its self-correction and per step
    (plan, margin at planning, measured ms)."""
    import numpy as np

    from sloweave.core.costs.calibrated import self_correcting

    cost = AnalyticCost()
    correction = self_correcting(cost) if correct else None
    policy = (
        make_policy_for_engine(correction.cost, correction.margin, 4096)
        if correct
        else make_policy_for_engine(cost, None, 4096)
    )
    c = BudgetController(
        policy, default_tpot_ms=10.0, max_budget_tokens=8192, correction=correction.calibrator if correct else None
    )
    ids = ("a", "b", "c", "d")
    for request_id in ids:
        c.on_token(request_id, 0.0)
    rng = np.random.default_rng(0)
    now, record = 0.0, []
    for _ in range(steps):
        plan = c.plan_step(StepState(now_ms=now, decode_tokens=4, pending_prompt_tokens=5000, decoding_ids=ids))
        margin = policy.margin(4, plan.chunk_tokens)
        assert plan.predicted_ms == pytest.approx(policy.cost(4, plan.chunk_tokens) + margin)  # T' + delta decided
        c.on_scheduled(plan, list(ids))
        measured = bias * cost(4, plan.chunk_tokens) * float(rng.uniform(1.0, 1.05))
        now += measured
        c.on_step_done(now, list(ids))
        record.append((plan, margin, measured))
    return c, correction, record


def test_the_controller_self_corrects_a_biased_model_and_its_margin_turns_positive():
    """The steps take 1.25x the model: with the core's self-correction the controller learns the
    bias (from the BASE model's predictions), its adaptive margin is zero until 50 steps were
    measured (no profile, no fallback) and positive after, and its chunks shrink until the real
    step fits the deadline again; the uncorrected controller overruns every step."""
    from sloweave.core.costs.calibrated import DEFAULT_MARGIN_QUANTILE, AdaptiveMargin

    c, correction, record = _self_correcting_run(correct=True)
    assert isinstance(correction.margin, AdaptiveMargin) and correction.margin.quantile == DEFAULT_MARGIN_QUANTILE
    assert (
        c.policy.cost is correction.cost
        and c.policy.margin is correction.margin
        and c.correction is correction.calibrator
    )
    # fed the base prediction, the factor is the bias (times the noise's mean); fed the corrected
    # one it would chase its own tail
    assert correction.calibrator.factor(4, True) == pytest.approx(1.25 * 1.025, rel=0.03)
    min_steps = correction.margin.min_steps
    assert all(margin == 0.0 for _, margin, _ in record[:min_steps])
    assert all(margin > 0.0 for _, margin, _ in record[min_steps:])
    _, _, plain = _self_correcting_run(correct=False)
    plain_chunk = plain[-1][0].chunk_tokens
    assert abs(plain_chunk - 1355) <= 1 and all(measured > 10.0 for _, _, measured in plain[-20:])
    late = record[-20:]
    assert all(p.chunk_tokens < plain_chunk for p, _, _ in late)
    assert all(measured <= 10.0 for _, _, measured in late)  # the real steps fit again
    # with its margin on, the chunk is smaller than the corrected cost alone would allow
    assert all(p.chunk_tokens < record[min_steps - 1][0].chunk_tokens for p, _, _ in late)


def test_the_controller_learns_from_the_step_the_engine_ran_not_the_plan():
    """An engine may schedule less than the budget (a cap on running requests, KV blocks): the
    correction must compare the step that ran with its own prediction."""
    from sloweave.core.costs.calibrated import self_correcting

    correction = self_correcting(AnalyticCost())
    c = BudgetController(
        make_policy_for_engine(correction.cost, correction.margin, 4096), 10.0, 8192, correction=correction.calibrator
    )
    c.on_token("a", 0.0)
    now = 0.0
    for _ in range(10):
        plan = c.plan_step(StepState(now_ms=now, decode_tokens=1, pending_prompt_tokens=5000, decoding_ids=("a",)))
        assert plan.chunk_tokens > 200
        c.on_scheduled(plan, ["a"], ran_tokens=(1, 200))  # the engine ran only 200 prompt tokens
        now += 1.25 * AnalyticCost()(1, 200)
        c.on_step_done(now, ["a"])
    assert correction.calibrator.factor(1, True) == pytest.approx(1.25)  # against the plan: far below 1


def _step_time_profile(tmp_path):
    import itertools

    import numpy as np
    import pandas as pd

    rows, rng, cost = [], np.random.default_rng(1), AnalyticCost()
    for n, c, context, _ in itertools.product(
        [0, 2, 4, 8, 16, 32], [0, 128, 512, 1024, 2048, 4096], [64, 512], range(3)
    ):
        if n or c:
            kv = n * (context + 1)
            step = (cost(n, c) + 0.0002 * kv) * rng.uniform(0.97, 1.06)
            rows.append(
                {
                    "n_decodes": n,
                    "chunk_tokens": c,
                    "decode_kv_tokens": kv,
                    "prefill_prefix_tokens": 0,
                    "step_ms": step,
                    "context_tokens": context,
                }
            )
    path = tmp_path / "profile.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_plugin_online_correction_decides_with_the_cores_self_correction(tmp_path):
    import numpy as np

    from sloweave.core.costs.calibrated import DEFAULT_MARGIN_QUANTILE, AdaptiveMargin, SelfCorrection
    from sloweave.core.costs.fitted import ResidualMargin
    from sloweave.core.costs.profile_fit import fit_profile_file
    from sloweave.core.costs.step_margin import StepMargin

    # analytic prior: no fallback until the window fills; margin_ms / margin_fraction add on top
    decision = PluginConfig(online_correction=True).build_decision()
    correction = decision.correction
    assert (
        isinstance(correction, SelfCorrection)
        and decision.cost is correction.cost
        and decision.margin is correction.margin
    )
    # the per-step form by default, which stands on the relative one until it has seen enough steps
    assert isinstance(decision.margin, StepMargin) and decision.margin.quantile == DEFAULT_MARGIN_QUANTILE
    assert isinstance(decision.margin.relative, AdaptiveMargin)
    assert decision.margin(4, 512) == 0.0
    stacked = PluginConfig(online_correction=True, margin_ms=0.5, margin_fraction=0.1).build_decision()
    for _ in range(60):  # 1.25x slower, with a 2 % spread
        for k in (1.0, 1.02):
            base = stacked.correction.cost.base.predict(4, 512, 0, 0)
            stacked.correction.calibrator.observe(4, 512, base, 1.25 * k * base)
    adaptive = stacked.correction.margin(4, 512)
    assert adaptive > 0.0
    assert stacked.margin(4, 512) == pytest.approx(adaptive + 0.5 + 0.1 * stacked.cost(4, 512))
    # a step-time profile file: the profile's residual margin is the fallback, read through the corrected cost
    path = _step_time_profile(tmp_path)
    decision = PluginConfig(cost=str(path), online_correction=True).build_decision()
    fallback = decision.correction.margin.relative.fallback
    assert isinstance(fallback, ResidualMargin) and fallback.cost is decision.cost
    np.testing.assert_array_equal(fallback.fractions, fit_profile_file(path).margin_fractions)
    assert (
        decision.margin(4, 512) == pytest.approx(fallback.fraction(4, 512) * decision.cost(4, 512))
        and decision.margin(4, 512) > 0
    )
    # no correction: no SelfCorrection, the plain margins as before
    assert PluginConfig(cost=str(path), profile_margin=True).build_decision().correction is None


def test_plugin_refuses_profile_margin_with_online_correction(tmp_path):
    path = _step_time_profile(tmp_path)
    with pytest.raises(PluginConfigError, match="profile_margin and online_correction exclude each other"):
        PluginConfig(cost=str(path), profile_margin=True, online_correction=True)
    with pytest.raises(PluginConfigError, match="exclude each other"):
        PluginConfig.from_sources(
            {"sloweave": {"cost": str(path), "online_correction": True}}, environ={"SLOWEAVE_PROFILE_MARGIN": "1"}
        )


@pytest.mark.parametrize("margin", [None, ConstantMargin(1.0)])
def test_decodes_without_a_tracked_deadline_get_the_largest_chunk(margin):
    """Decodes running while no deadline is tracked yet (the budget is +inf) used to overflow
    (int(inf)) in the analytic model's closed-form guess; the whole chunk fits."""
    policy = make_policy_for_engine(AnalyticCost(), margin, 4096)
    c = BudgetController(policy, default_tpot_ms=10.0, max_budget_tokens=8192)
    plan = c.plan_step(StepState(now_ms=0.0, decode_tokens=3, pending_prompt_tokens=10_000))
    assert math.isinf(plan.budget_ms) and plan.chunk_tokens == 4096 and plan.token_budget == 4099


def test_the_largest_configured_target_plans_without_overflow():
    c = controller(tpot_ms=3_600_000.0)
    c.on_token("a", 0.0)
    plan = c.plan_step(StepState(now_ms=1.0, decode_tokens=1, pending_prompt_tokens=10_000))
    assert plan.chunk_tokens == 4096 and not plan.infeasible


def test_the_adaptive_margin_holds_a_chunk_back_only_for_the_risk_it_adds():
    """A burst of stalls (every 20th step 10x its prediction) sets the P99.7 of the residuals at a
    stall: read at q the margin would hold back every chunk, though a decode-only step stalls
    as much. The step with the chunk may miss the budget for at most 0.3 % of the residuals
    more than the decode-only step; on a quiet machine the margin is the quantile itself."""
    from sloweave.core.costs.calibrated import self_correcting
    from sloweave.core.policy import SLOWeave

    cost = AnalyticCost()
    correction = self_correcting(cost)
    calibrator, corrected = correction.calibrator, correction.cost
    policy = SLOWeave(cost=corrected, margin=correction.margin, max_prefills=None)
    rng = np.random.default_rng(0)

    def run(steps: int, stall_every: int | None) -> None:
        for i in range(steps):
            n, c = int(rng.integers(1, 16)), int(rng.integers(0, 2048))
            ratio = 10.0 if stall_every and i % stall_every == 0 else 1.0 + float(rng.uniform(-0.02, 0.02))
            calibrator.observe(n, c, cost(n, c), cost(n, c) * ratio)

    def largest_at(fraction: float) -> int:  # brute force: T' (1 + r) <= B
        return max(c for c in range(0, 4097) if corrected(8, c) * (1.0 + fraction) <= 12.0)

    run(1000, None)
    quiet = policy.decide(8, 10_000, 12.0)
    assert quiet.chunk_tokens == largest_at(calibrator.residual_quantile(99.7)) > 1000
    run(1000, 20)
    at_q = calibrator.residual_quantile(99.7)
    assert corrected(8, 0) * (1.0 + at_q) > 12.0  # read at q: not even decode-only fits
    stalled = policy.decide(8, 10_000, 12.0)
    assert not stalled.infeasible and stalled.chunk_tokens > 0.5 * quiet.chunk_tokens
    decode_only_misses = calibrator.residual_share_above(12.0 / corrected(8, 0) - 1.0)
    with_chunk_misses = calibrator.residual_share_above(12.0 / corrected(8, stalled.chunk_tokens) - 1.0)
    assert 0.04 <= decode_only_misses and with_chunk_misses <= decode_only_misses + 0.003 + 1e-12


@pytest.mark.parametrize(
    "chunk, decodes, waiting, expected",
    [
        (100, 4, 5000, 92),  # cut by the deadline: the step (104) to 96
        (0, 4, 5000, 0),  # decode-only
        (20, 4, 20, 20),  # the whole offer
        (1000, 4, 5000, 1000),  # C_max
        (1500, 600, 5000, 1500),  # the engine's cap (2,100 tokens)
        (10, 64, 5000, 10),  # rounding would leave no chunk
        (10, 30, 5000, 2),  # a smaller one it leaves
    ],
)
def test_a_size_grid_rounds_only_a_chunk_the_deadline_cut_short(chunk, decodes, waiting, expected):
    assert SizeGrid(32, max_chunk_tokens=1000, max_step_tokens=2100).chunk(chunk, decodes, waiting) == expected


def test_the_size_grid_is_for_deadline_aware_policies_only():
    deadline_aware = make_policy_for_engine(AnalyticCost(), ConstantMargin(0.0), 700)
    assert size_grid(32, deadline_aware) == SizeGrid(32, 700) and size_grid(1, deadline_aware) is None
    assert size_grid(32, make_policy("sarathi-256")) is None
    with pytest.raises(ValueError, match="step_grid_tokens"):
        size_grid(0, deadline_aware)
