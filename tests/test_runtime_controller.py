"""The CPU runtime talks to the core through the vLLM plug-in's ``BudgetController`` (issue 22).

On the REAL transformers engine (tiny random Llama). Nothing here depends on how fast the
machine is: each test checks which plan came from which state, counts and exact equalities,
never a timing. The hand-offs the runtime makes are recorded by wrapping the controller's
methods (``handoffs``), so a run can be replayed into another controller.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import NamedTuple

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.core.budget import BudgetController, StepPlan
from sloweave.core.costs.calibrated import self_correcting
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.fitted import RegressionCost
from sloweave.core.costs.step_profiles import write_profile
from sloweave.core.policy import make_policy
from sloweave.runtime.engine import TransformersEngine
from sloweave.runtime.model import load_model
from sloweave.runtime.profiler import run_profile
from sloweave.runtime.runner import RequestSpec, run_requests
from sloweave.vllm_plugin.config import PluginConfig

# a model of the tiny engine's steps (RegressionCost's terms), as tests/test_runtime.py's steady profile
STEADY_COEFFICIENTS = np.array([1.0, 0.1, 0.1, 0.4, 0.005, 0.5, 10.0, 0.0, 0.0, 0.0])
HANDOFFS = ("plan_step", "on_scheduled", "on_step_done", "on_finished")


@pytest.fixture(scope="module")
def engine():
    return TransformersEngine(load_model("tiny", seed=0), max_batch_tokens=512, num_blocks=96, page_tokens=32)


@pytest.fixture(scope="module")
def profile_path(engine, tmp_path_factory):
    """A step-time profile of this engine's grid and KV reads, timed by a fixed model (the same on every run)."""
    frame = run_profile(
        engine, (0, 2, 4), (0, 16, 64, 128), (16, 96), repeats=1, holdout_per_state=2, seed=0, progress=False
    )
    frame["step_ms"] = RegressionCost(STEADY_COEFFICIENTS).predict_frame(frame) * np.random.default_rng(0).lognormal(
        0.0, 0.05, len(frame)
    )
    return write_profile(frame, tmp_path_factory.mktemp("profile") / "profile.csv")


class Call(NamedTuple):
    controller: BudgetController
    name: str
    args: tuple
    result: object


@pytest.fixture
def handoffs(monkeypatch):
    """Every call the runtime makes to a BudgetController, in order (the plans it got back)."""
    calls: list[Call] = []
    for name in HANDOFFS:
        original = getattr(BudgetController, name)

        def spy(self, *args, _original=original, _name=name):
            result = _original(self, *args)
            calls.append(Call(self, _name, args, result))
            return result

        monkeypatch.setattr(BudgetController, name, spy)
    return calls


def mixed_requests(tpot_ms=None) -> RequestSpec:
    # staggered arrivals, prompts longer than a chunk, outputs of 1 (done at prefill) to 12 tokens
    spec = dict(
        arrival_ms=np.array([0.0, 0.0, 2.0, 5.0, 9.0, 30.0]),
        prompt_tokens=np.array([150, 40, 300, 7, 90, 220]),
        output_tokens=np.array([12, 5, 8, 1, 10, 6]),
    )
    return RequestSpec(**spec) if tpot_ms is None else RequestSpec(**spec, tpot_ms=tpot_ms)


def plans_of(calls: list[Call]) -> list[StepPlan]:
    return [call.result for call in calls if call.name == "plan_step"]


def same_plan(a: StepPlan, b: StepPlan) -> bool:
    return all(
        x == y or (x != x and y != y) for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))
    )  # NaN: no base model


def test_the_runtime_and_the_plugins_controller_make_the_same_plans(engine, profile_path, handoffs, monkeypatch):
    """One decision path: the runtime's hand-offs, replayed into a controller built as the vLLM
    plug-in builds its own (from the plug-in's configuration), give the same plan for every state."""
    config = PluginConfig(
        tpot_ms=40.0,
        cost=str(profile_path),
        profile_margin=True,
        max_chunk_tokens=256,
        aging_ms=50.0,
        aging_chunk_tokens=32,
    )
    runtime = config.build_decision()
    spec = mixed_requests(tpot_ms=np.array([40.0, 15.0, 40.0, 40.0, 25.0, 40.0]))
    policy = make_policy("sloweave", runtime.cost, runtime.margin, config.max_chunk_tokens)
    run = run_requests(
        engine,
        spec,
        policy,
        config.tpot_ms,
        aging_ms=config.aging_ms,
        aging_chunk_tokens=config.aging_chunk_tokens,
        progress=False,
    )
    monkeypatch.undo()
    [runtime_controller] = {call.controller for call in handoffs}
    assert [call.name for call in handoffs if call.name != "on_finished"] == [
        "plan_step",
        "on_scheduled",
        "on_step_done",
    ] * len(run.steps)

    # SLOWeaveSchedulerMixin.__init__'s controller (its per-request targets come from the requests' extra args)
    plugin = config.build_decision()
    controller = BudgetController(
        config.deadline_policy(plugin, min(config.max_chunk_tokens, engine.max_batch_tokens)),
        default_tpot_ms=config.tpot_ms,
        max_budget_tokens=engine.max_batch_tokens,
        aging_ms=config.aging_ms or None,
        aging_chunk_tokens=config.aging_chunk_tokens,
        tpot_ms_of=spec.target_of(),
    )
    for call in handoffs:
        replayed = getattr(controller, call.name)(*call.args)
        if call.name == "plan_step":
            assert same_plan(replayed, call.result), (call.args[0], replayed, call.result)
    assert controller.stats.slo_exceptions == runtime_controller.stats.slo_exceptions

    # the step rows are those plans, beside what the engine ran
    plans = pd.DataFrame([dataclasses.asdict(plan) for plan in plans_of(handoffs)])
    steps = run.steps
    for column in (
        "chunk_tokens",
        "policy_chunk_tokens",
        "budget_ms",
        "deadline_ms",
        "margin_ms",
        "infeasible",
        "aged",
    ):
        np.testing.assert_array_equal(steps[column].to_numpy(), plans[column].to_numpy(), err_msg=column)
    np.testing.assert_array_equal(steps["predicted_ms"], plans["predicted_ms"] - plans["margin_ms"])
    np.testing.assert_array_equal(steps["start_ms"], plans["start_ms"])
    assert (steps["ran_chunk_tokens"] == steps["chunk_tokens"]).all()


def starving_cost(n_decodes: int, chunk_tokens: int) -> float:
    """Decode-only steps cost 1 ms, any chunk a million: no chunk ever fits beside a decode."""
    return 1.0 + (1e6 if chunk_tokens > 0 else 0.0)


def test_aging_forces_a_chunk_on_the_real_runtime(engine, handoffs):
    """r1's prompt waits while r0 decodes: the deadline gives it nothing (every chunk is priced
    at 1000 s, the target is 10 s); after aging_ms it gets the aging chunk anyway, each such
    step an SLO exception naming r0, whose deadline that step is predicted to miss."""
    spec = RequestSpec(np.array([0.0, 0.0]), np.array([40, 100]), np.array([12, 2]))
    policy = make_policy("sloweave", starving_cost, None, 256)
    starved = run_requests(engine, spec, policy, 10_000.0, progress=False).steps
    beside_decodes = starved[starved["n_decodes"] > 0]
    assert (beside_decodes["chunk_tokens"] == 0).all() and not starved["aged"].any()

    run = run_requests(engine, spec, policy, 10_000.0, aging_ms=1e-3, aging_chunk_tokens=32, progress=False)
    steps = run.steps
    aged = steps[steps["aged"]]
    # every chunk next to a decode was forced by aging: 32, 32, 32, then the last 4 tokens
    assert list(aged["chunk_tokens"]) == [32, 32, 32, 4] and (aged["n_decodes"] == 1).all()
    assert (steps.loc[(steps["n_decodes"] > 0) & ~steps["aged"], "chunk_tokens"] == 0).all()
    assert (aged["policy_chunk_tokens"] == aged["chunk_tokens"]).all() and not aged["infeasible"].any()
    assert [(e.request_id, e.chunk_tokens, e.affected_ids) for e in run.slo_exceptions] == [
        ("r1", c, ("r0",)) for c in (32, 32, 32, 4)
    ]
    assert run.decision_metrics["sloweave_slo_exceptions_total"] == 4
    assert run.decision_metrics["sloweave_slo_exception_requests_total"] == 4
    assert run.token_counts == {"r0": 12, "r1": 2}
    # r1's first token now comes while r0 still decodes
    assert len(steps) < len(starved)


def test_a_request_with_a_tighter_target_gets_a_smaller_budget(engine, handoffs):
    """r0 carries its own 5 ms target, r1 has the run's 10 s: while r0 decodes the deadline is
    r0's last token + 5 ms, after it finished r1's last token + 10 s. Every decoding request
    emitted in the step before (each step runs all decodes), so its last token is that step's end."""
    spec = RequestSpec(np.array([0.0, 0.0]), np.array([20, 20]), np.array([3, 8]), tpot_ms=np.array([5.0, 10_000.0]))
    run = run_requests(engine, spec, make_policy("sloweave", AnalyticCost(), None, 256), 10_000.0, progress=False)
    states = [call.args[0] for call in handoffs if call.name == "plan_step"]
    plans = plans_of(handoffs)
    ends = run.steps["end_ms"].to_numpy()
    tight = loose = 0
    for k, (state, plan) in enumerate(zip(states, plans)):
        if not state.decoding_ids:
            assert math.isinf(plan.deadline_ms) and math.isinf(plan.budget_ms)
            continue
        target = 5.0 if "r0" in state.decoding_ids else 10_000.0
        assert plan.deadline_ms == ends[k - 1] + target
        assert plan.budget_ms == max(0.0, round(plan.deadline_ms - plan.start_ms, 6))
        tight += target == 5.0
        loose += target == 10_000.0
        assert (plan.budget_ms <= 5.0) == (target == 5.0)
    assert tight == 2 and loose >= 1  # r0 decodes twice after its prefill; r1 alone after
    # without its own target r0 has the run's: no budget is that small
    handoffs.clear()
    default = run_requests(
        engine,
        dataclasses.replace(spec, tpot_ms=None),
        make_policy("sloweave", AnalyticCost(), None, 256),
        10_000.0,
        progress=False,
    )
    assert (default.steps.loc[default.steps["n_decodes"] > 0, "budget_ms"] > 5.0).all()
    # the metrics judge each request by its own target
    assert run.metrics(ttft_ms=1e6).num_finished == 2
    np.testing.assert_array_equal(run.request_tpot_ms, [5.0, 10_000.0])


def test_online_correction_observes_every_step_through_the_controller(engine, handoffs, monkeypatch):
    correction = self_correcting(AnalyticCost())
    observed = []
    observe = correction.calibrator.observe
    monkeypatch.setattr(correction.calibrator, "observe", lambda *args: (observed.append(args), observe(*args)))
    policy = make_policy("sloweave", correction.cost, correction.margin, 256)
    run = run_requests(
        engine, mixed_requests(), policy, 40.0, cost=correction.cost, calibrator=correction.calibrator, progress=False
    )
    [controller] = {call.controller for call in handoffs}
    assert controller.correction is correction.calibrator
    steps = run.steps
    # one observation per step, in order: the step that ran, the base model's price of it, its measured time
    expected = [
        (n, c, AnalyticCost()(n, c), ms)
        for n, c, ms in steps[["n_decodes", "ran_chunk_tokens", "step_ms"]].itertuples(index=False)
    ]
    assert observed == expected
    assert correction.calibrator.observations.sum() == len(steps) == sum(map(sum, run.calibration["observations"]))
    # the decision metrics saw the same steps
    metrics = run.decision_metrics
    assert metrics["sloweave_steps_total"] == len(steps)
    assert metrics["sloweave_measured_step_ms"]["count"] == metrics["sloweave_predicted_step_ms"]["count"] == len(steps)


@pytest.mark.parametrize("policy_name", ["sloweave", "fixed-64", "budget-48"])
def test_every_request_is_accounted_for(engine, handoffs, policy_name):
    spec = mixed_requests()
    policy = make_policy(policy_name, AnalyticCost(), None, 256)
    run = run_requests(engine, spec, policy, 40.0, aging_ms=100.0, progress=False)
    [controller] = {call.controller for call in handoffs}
    outputs = {f"r{i}": int(k) for i, k in enumerate(spec.output_tokens)}
    assert run.token_counts == outputs and (run.requests["status"] == "finished").all()
    # every token reported to the controller once, every request finished once, no deadline left
    emitted = pd.Series(
        [rid for call in handoffs if call.name == "on_step_done" for rid in call.args[1]]
    ).value_counts()
    assert emitted.to_dict() == outputs
    assert sorted(call.args[0] for call in handoffs if call.name == "on_finished") == sorted(outputs)
    assert len(controller.tracker) == 0 and controller.stats.steps == len(run.steps)
    assert run.steps["chunk_tokens"].sum() == spec.prompt_tokens.sum()
    # a static rule through the same controller: its chunks are its own, priced by the model it carries
    if policy_name == "fixed-64":
        assert (run.steps["chunk_tokens"] == np.minimum(64, run.steps["waiting_tokens"])).all()
    decided = run.steps[["n_decodes", "chunk_tokens", "predicted_ms"]].itertuples(index=False)
    assert all(predicted == AnalyticCost()(n, c) for n, c, predicted in decided)


def test_the_runtime_rounds_a_step_the_deadline_cut_short_to_the_size_grid(engine, handoffs):
    """``step_grid_tokens`` reaches the runtime's controller: a prompt token priced at 10 ms against a
    1 s target cuts every chunk beside decodes to about 99 tokens, however fast the machine is,
    and each such step (decodes + chunk) is rounded down to a multiple of 8."""
    policy = make_policy("sloweave", AnalyticCost(prefill_per_token_ms=10.0), None, 256)
    run = run_requests(engine, mixed_requests(), policy, 1000.0, progress=False, step_grid_tokens=8)
    [controller] = {call.controller for call in handoffs}
    states = [call.args[0] for call in handoffs if call.name == "plan_step"]
    cut = [
        (state, plan)
        for state, plan in zip(states, plans_of(handoffs))
        if state.decode_tokens and 0 < plan.chunk_tokens < min(state.pending_prompt_tokens, 256) and not plan.aged
    ]
    assert controller.grid.grid_tokens == 8 and len(cut) >= 2
    assert all((state.decode_tokens + plan.chunk_tokens) % 8 == 0 for state, plan in cut)
    assert all(plan.chunk_tokens > 85 for _, plan in cut) and (run.requests["status"] == "finished").all()


def test_a_static_rule_without_a_model_predicts_nothing(engine):
    run = run_requests(engine, mixed_requests(), make_policy("fixed-64"), 40.0, progress=False)
    assert run.steps["predicted_ms"].isna().all() and (run.steps["margin_ms"] == 0).all()
    assert "sloweave_predicted_step_ms" not in run.decision_metrics
    assert run.decision_metrics["sloweave_measured_step_ms"]["count"] == len(run.steps)


def test_request_spec_refuses_bad_targets():
    with pytest.raises(ValueError, match="one finite target"):
        mixed_requests(tpot_ms=np.array([40.0, -1.0, 40.0, 40.0, 40.0, 40.0]))
    with pytest.raises(ValueError, match="one finite target"):
        mixed_requests(tpot_ms=np.array([40.0]))


def test_run_command_ages_and_writes_the_decision_metrics(profile_path, tmp_path):
    out_dir = tmp_path / "run"
    args = [
        "run",
        "--model",
        "tiny",
        "--profile",
        str(profile_path),
        "--workload",
        "mixed",
        "--requests",
        "4",
        "--rate-scale",
        "0.5",
        "--prompt-scale",
        "0.1",
        "--output-scale",
        "0.05",
        "--max-prompt",
        "256",
        "--max-output",
        "6",
        "--policies",
        "sloweave,fixed-32",
        "--tpot-ms",
        "30",
        "--max-chunk",
        "256",
        "--aging-ms",
        "500",
        "--aging-chunk-tokens",
        "64",
        "--step-grid",
        "8",
        "--out",
        str(out_dir),
        "--monotone-tolerance-ms",
        "25",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(out_dir / "summary.csv")
    assert (summary["measured_num_finished"] == 4).all() and "aged_steps" in summary
    for tag in ("sloweave_margin_calib-seed0", "fixed-32-seed0"):
        steps = pd.read_csv(out_dir / f"steps-{tag}.csv")
        decisions = json.loads((out_dir / f"decision_metrics-{tag}.json").read_text())
        assert decisions["source"] == "cpu-runtime" and decisions["metrics"]["sloweave_steps_total"] == len(steps)
        assert decisions["metrics"]["sloweave_slo_exceptions_total"] == int(steps["aged"].sum())
    # --step-grid reaches SLOWeave's controller: a step the deadline cut short is on the grid
    steps = pd.read_csv(out_dir / "steps-sloweave_margin_calib-seed0.csv")
    cut = (steps.n_decodes > 0) & (steps.chunk_tokens > 0) & ~steps.aged
    cut &= steps.chunk_tokens < np.minimum(steps.waiting_tokens, 256)
    assert ((steps.n_decodes + steps.chunk_tokens)[cut] % 8 == 0).all()
