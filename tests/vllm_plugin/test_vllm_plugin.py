"""The SLOWeave plug-in inside real vLLM V1 schedulers, offline on CPU, on a manual clock."""

import math

import numpy as np
import pytest
from vllm.config import SchedulerConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.policy import SLOWeave
from sloweave.sim.engine import simulate
from sloweave.vllm_plugin import SLOWeaveAsyncScheduler, SLOWeaveScheduler
from sloweave.vllm_plugin.config import PluginConfigError
from sloweave.vllm_plugin.offline import OfflineEngine, build_scheduler, make_request
from sloweave.sim.workloads import Workload

COST = AnalyticCost()


def engine(cls=SLOWeaveScheduler, overlap=False, max_num_batched_tokens=8192, **config):
    scheduler = build_scheduler(
        cls, max_num_batched_tokens=max_num_batched_tokens, additional_config={"sloweave": config}
    )
    return OfflineEngine(scheduler, step_ms=lambda d, p: COST(d, p), overlap=overlap)


def test_scheduler_cls_resolves_from_a_dotted_path():
    for cls in (SLOWeaveScheduler, SLOWeaveAsyncScheduler):
        config = SchedulerConfig(
            max_model_len=4096, is_encoder_decoder=False, scheduler_cls=f"sloweave.vllm_plugin.{cls.__name__}"
        )
        assert config.get_scheduler_cls() is cls


def test_budget_follows_the_deadline():
    eng = engine(tpot_ms=10.0, step_grid_tokens=1)  # the rule itself: the largest safe chunk, not on a grid
    # no decodes: the largest chunk (C_max = 4096)
    eng.add(make_request(6000, 20))
    first = eng.step()
    assert first.token_budget == 4096 and first.prefill_tokens == 4096 and first.decode_tokens == 0
    eng.step()  # the rest of the prompt; its first token comes out
    for _ in range(3):
        eng.add(make_request(40, 30))
    eng.step()  # prefills the three short prompts next to one decode
    eng.add(make_request(8000, 5))
    plan_steps = [eng.step() for _ in range(2)]
    # 4 decodes, 10 ms: the SPEC's worked example, about 1355 prompt tokens next to them
    assert all(s.decode_tokens == 4 for s in plan_steps)
    assert all(abs(s.prefill_tokens - 1355) <= 1 for s in plan_steps)
    assert all(s.end_ms - s.start_ms <= 10.0 + 1e-9 for s in plan_steps)
    # slack tightens: 6 ms have passed since the last tokens when the next step is scheduled
    eng.clock.now_ms += 6.0
    tight = eng.step()
    assert tight.decode_tokens == 4 and 0 < tight.prefill_tokens < 1355
    assert eng.scheduler.last_plan.budget_ms == pytest.approx(4.0)
    # nothing fits: decode-only, every decode still served
    eng.clock.now_ms += 9.5
    starved = eng.step()
    assert starved.prefill_tokens == 0 and starved.decode_tokens == 4 and starved.token_budget == 4
    assert eng.scheduler.last_plan.infeasible
    eng.run()
    assert len(eng.finished) == 5


@pytest.mark.parametrize(
    "cls, overlap", [(SLOWeaveScheduler, False), (SLOWeaveAsyncScheduler, True), (SLOWeaveAsyncScheduler, False)]
)
def test_every_request_completes_with_its_tokens(cls, overlap):
    rng = np.random.default_rng(0)
    eng = engine(cls, overlap=overlap, tpot_ms=15.0)
    prompts, outputs = rng.integers(10, 5000, 30), rng.integers(1, 60, 30)
    requests = [make_request(int(p), int(o)) for p, o in zip(prompts, outputs)]
    for i, request in enumerate(requests):
        if i % 5 == 0:
            eng.advance_to(eng.clock.now_ms + 20.0)  # arrivals spread over time
        eng.add(request)
        eng.step()
    eng.run()
    assert eng.finished == {r.request_id for r in requests}
    for request, out in zip(requests, outputs):
        assert len(eng.token_times_ms[request.request_id]) == out
    for step in eng.steps:  # decodes were never starved by the budget
        assert step.token_budget is None or step.token_budget >= step.decode_tokens
    if overlap:  # steps really overlapped: the next was scheduled before the previous finished
        assert any(s.start_ms > 0 for s in eng.steps[1:])


def test_async_scheduling_accounts_for_the_step_in_flight():
    eng = engine(SLOWeaveAsyncScheduler, overlap=True, tpot_ms=10.0)
    for _ in range(4):
        eng.add(make_request(50, 40))
    for _ in range(4):
        eng.step()
    eng.add(make_request(9000, 2))
    steps = [eng.step() for _ in range(4)]
    for step in steps:
        # scheduled while the previous step ran, it still ends within 10 ms of the previous tokens
        assert step.end_ms - step.start_ms <= 10.0 + 1e-9
    gaps = np.diff(eng.token_times_ms[next(iter(eng.token_times_ms))])
    assert gaps.max() <= 10.0 + 1e-9
    assert sum(s.prefill_tokens for s in steps) > 3000


@pytest.mark.parametrize("grid", [1, 32])
def test_decisions_match_the_simulator(grid):
    """Same requests, same cost: vLLM with the plug-in and the simulator take the same steps (with
    the size grid too: the simulator rounds a step as the plug-in does)."""
    prompts = [3000, 500, 2000, 100, 4000, 800, 6000, 300]
    outputs = [20, 40, 10, 30, 25, 5, 12, 50]
    eng = engine(tpot_ms=10.0, aging_ms=0, step_grid_tokens=grid)
    for p, o in zip(prompts, outputs):
        eng.add(make_request(p, o))
    eng.run()
    workload = Workload("same", np.zeros(len(prompts)), np.array(prompts), np.array(outputs))
    policy = SLOWeave(cost=COST, max_prefills=None)
    sim = simulate(workload, policy, tpot_ms=10.0, max_batch_size=128, step_grid_tokens=grid)
    cut = [s.decode_tokens + s.prefill_tokens for s in eng.steps if 0 < s.prefill_tokens < 4096]
    assert grid == 1 or np.mean(np.array(cut) % grid == 0) > 0.5
    assert len(eng.steps) == sim.num_iterations
    assert [s.decode_tokens for s in eng.steps] == sim.iter_decodes.tolist()
    assert [s.prefill_tokens for s in eng.steps] == sim.iter_chunk_tokens.tolist()
    for i, request_id in enumerate(sorted(eng.token_times_ms, key=lambda r: int(r.split("-")[1]))):
        assert eng.token_times_ms[request_id] == pytest.approx(sim.token_times_ms(i).tolist())


def test_per_request_target_from_extra_args():
    eng = engine(tpot_ms=50.0)
    eng.add(make_request(20, 30, tpot_ms=10.0))
    eng.add(make_request(20, 30))
    eng.step()
    eng.add(make_request(9000, 2))
    eng.step()
    assert eng.scheduler.last_plan.budget_ms == pytest.approx(10.0)


def test_decodes_stay_ahead_of_a_partial_prefill():
    eng = engine(tpot_ms=10.0)
    for _ in range(3):
        eng.add(make_request(30, 50))
    eng.step()
    eng.add(make_request(9000, 3))
    eng.step()  # the long prompt is now a partial prefill in `running`
    scheduler = eng.scheduler
    partial = [r for r in scheduler.running if r.num_computed_tokens < r.num_prompt_tokens]
    assert partial
    scheduler.running[:] = partial + [r for r in scheduler.running if r not in partial]  # put it first
    step = eng.step()
    assert step.decode_tokens == 3 and step.prefill_tokens > 0


def test_aging_gives_a_starving_prompt_a_chunk():
    eng = engine(tpot_ms=1.0, aging_ms=100.0, aging_chunk_tokens=64)  # 1 ms: nothing ever fits
    eng.add(make_request(10, 400))
    eng.step()
    eng.add(make_request(500, 2))
    prefill_steps = []
    while eng.scheduler.has_requests() and len(prefill_steps) < 2:
        step = eng.step()
        if step.prefill_tokens:
            prefill_steps.append(step)
    assert prefill_steps and all(s.prefill_tokens == 64 for s in prefill_steps)
    assert prefill_steps[0].start_ms >= 100.0
    exceptions = eng.scheduler.sloweave.stats.slo_exceptions
    assert len(exceptions) >= 1 and all(e.chunk_tokens == 64 for e in exceptions)


def test_aborted_and_preempted_requests_release_their_deadline():
    eng = engine(tpot_ms=10.0)
    a, b = make_request(20, 100), make_request(20, 100)
    eng.add(a)
    eng.add(b)
    eng.step()
    eng.scheduler.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED)
    assert a.request_id not in eng.scheduler.sloweave.tracker
    assert b.request_id in eng.scheduler.sloweave.tracker


@pytest.mark.parametrize("cls, overlap", [(SLOWeaveScheduler, False), (SLOWeaveAsyncScheduler, True)])
def test_requests_stopping_on_a_stop_token_leave_no_deadline_behind(cls, overlap):
    """vLLM's async scheduler has the next step scheduled, holding a request, when its stop token
    comes back: once gone, its deadline must not return and pin every budget at 0 ms."""
    eng = engine(cls, overlap=overlap, tpot_ms=10.0, step_grid_tokens=1)
    stopping = [make_request(50, 100, stop_on_sampled_token=True) for _ in range(4)]
    decoding = make_request(50, 200)
    for request in (*stopping, decoding):
        eng.add(request)
    for _ in range(6):
        eng.step()
    assert {r.request_id for r in stopping} <= eng.finished
    tracker = eng.scheduler.sloweave.tracker
    assert len(tracker) == 1 and decoding.request_id in tracker
    eng.advance_to(eng.clock.now_ms + 50.0)  # long past any deadline the stopped ones had
    eng.add(make_request(6000, 2))
    steps = [eng.step() for _ in range(4)]
    # the one decode's deadline sets the budget: the prompt gets its chunk (the first step is
    # late for the decode, 50 ms since its token: decode-only)
    assert [s.prefill_tokens for s in steps[1:]] == [1382] * 3


@pytest.mark.parametrize(
    "config, message",
    [
        ({"tpot_ms": 0}, "tpot_ms must be a finite number of milliseconds > 0"),
        ({"unknown": 1}, "unknown key"),
        ({"cost": "/nonexistent/profile.csv"}, "existing profile file"),
    ],
)
def test_bad_configuration_fails_at_start_up(config, message):
    with pytest.raises(PluginConfigError, match=message):
        build_scheduler(SLOWeaveScheduler, additional_config={"sloweave": config})


def test_profile_margin_with_online_correction_fails_at_start_up(tmp_path):
    """The adaptive margin replaces the profile's (it starts from it by itself): asking for both is refused."""
    profile = tmp_path / "profile.csv"
    profile.write_text("n_decodes,chunk_tokens,step_ms\n")
    with pytest.raises(
        PluginConfigError, match="sloweave vLLM plug-in: .*profile_margin and online_correction exclude each other"
    ):
        build_scheduler(
            SLOWeaveScheduler,
            additional_config={"sloweave": {"cost": str(profile), "profile_margin": True, "online_correction": True}},
        )


@pytest.mark.parametrize(
    "config, message",
    [
        ({"online_correction": True, "margin_form": "ms"}, "margin_form must be one of relative, per-step"),
        ({"margin_form": "per-step"}, "margin_form 'per-step' needs online_correction"),
        ({"margin_form": "relative"}, "margin_form 'relative' needs online_correction"),
    ],
)
def test_bad_margin_form_fails_at_start_up(config, message):
    with pytest.raises(PluginConfigError, match=message):
        build_scheduler(SLOWeaveScheduler, additional_config={"sloweave": config})


def test_margin_form_is_per_step_with_online_correction_unless_relative_is_asked_for():
    """The plug-in's default form is the per-step one, with online_correction only (without it
    there is no adaptive margin to shape); `relative` still gives the core's AdaptiveMargin."""
    from sloweave.core.costs.calibrated import AdaptiveMargin
    from sloweave.core.costs.step_margin import StepMargin
    from sloweave.vllm_plugin.config import PluginConfig

    assert PluginConfig(online_correction=True).margin_form == "per-step"
    assert PluginConfig().margin_form is None
    forms = {None: StepMargin, "per-step": StepMargin, "relative": AdaptiveMargin}
    for form, margin_type in forms.items():
        config = {"tpot_ms": 10.0, "online_correction": True} | ({"margin_form": form} if form else {})
        scheduler = build_scheduler(SLOWeaveScheduler, additional_config={"sloweave": config})
        assert type(scheduler.sloweave.policy.margin) is margin_type, form


def test_margin_form_per_step_learns_from_the_steps_vllm_ran():
    """margin_form per-step: the controller decides with the core's StepMargin, whose residuals in
    ms are the steps vLLM ran (1.2x the model plus up to 1 ms); past 50 steps its margin is no
    longer the relative one, and every plan's margin is finite and >= 0."""
    from sloweave.core.costs.step_margin import StepMargin

    scheduler = build_scheduler(
        SLOWeaveScheduler,
        max_num_batched_tokens=8192,
        additional_config={"sloweave": {"tpot_ms": 10.0, "online_correction": True, "margin_form": "per-step"}},
    )
    rng = np.random.default_rng(0)
    eng = OfflineEngine(scheduler, step_ms=lambda d, p: 1.2 * COST(d, p) + float(rng.uniform(0.0, 1.0)))
    controller = scheduler.sloweave
    assert isinstance(controller.policy.margin, StepMargin)
    for _ in range(4):
        eng.add(make_request(300, 400))
    margins = []
    for _ in range(120):
        if not scheduler.waiting and not any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
            eng.add(make_request(8000, 2))
        eng.step()
        margins.append(scheduler.last_plan.margin_ms)
    residuals = controller.correction.step_residuals
    assert (
        residuals is controller.policy.margin.residuals
        and residuals.observed == len(controller.correction.recent_residuals) >= 100
    )
    assert all(math.isfinite(m) and m >= 0 for m in margins) and max(margins) > 0


def test_vllm_default_scheduler_runs_in_the_same_harness():
    """Baseline: vLLM's own scheduler with a fixed budget spends it all on one long prompt."""
    plain = OfflineEngine(build_scheduler(Scheduler, max_num_batched_tokens=2048), step_ms=lambda d, p: COST(d, p))
    for _ in range(4):
        plain.add(make_request(30, 20))
    plain.step()
    plain.add(make_request(9000, 2))
    step = plain.step()
    assert step.decode_tokens + step.prefill_tokens == 2048
    assert step.end_ms - step.start_ms > 10.0  # a 10 ms TPOT target is missed by the fixed budget


def write_grid_profile(path, step_ms) -> str:
    """A step-time profile (the format `sloweave profile` and the GPU profiler write) of
    ``step_ms(n, c, kv)`` with 3 % noise, on a grid of decodes, chunks and contexts."""
    import itertools

    import pandas as pd

    rows = []
    rng = np.random.default_rng(1)
    for n, c, context, repeat in itertools.product(
        [0, 2, 4, 8, 16, 32], [0, 128, 512, 1024, 2048, 4096], [64, 512], range(3)
    ):
        if n == c == 0:
            continue  # an empty step is not a step
        kv = n * (context + 1)
        rows.append(
            {
                "n_decodes": n,
                "chunk_tokens": c,
                "decode_kv_tokens": kv,
                "prefill_prefix_tokens": 0,
                "step_ms": step_ms(n, c, kv) * rng.uniform(0.97, 1.03),
                "context_tokens": context,
            }
        )
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


def test_profile_file_as_the_cost_model(tmp_path):
    """A step-time profile drives the plug-in."""
    from sloweave.core.costs.profile_fit import fit_profile_file

    path = write_grid_profile(tmp_path / "profile.csv", lambda n, c, kv: COST(n, c) + 0.0002 * kv)
    fitted = fit_profile_file(path).cost("regression")

    eng = engine(tpot_ms=10.0, cost=path, step_grid_tokens=1)
    for _ in range(4):
        eng.add(make_request(500, 30))
    eng.step()
    eng.add(make_request(9000, 2))
    step = eng.step()
    plan = eng.scheduler.last_plan
    assert step.decode_tokens == 4 and step.prefill_tokens == plan.chunk_tokens > 0
    # the fitted model, at this step's KV context, says the chunk fits and one more token would not
    kv = 4 * 502
    assert fitted.predict(4, plan.chunk_tokens, kv, 0) <= 10.0 < fitted.predict(4, plan.chunk_tokens + 1, kv, 0)
    # the profile's margin states the quantile its table was fitted at (P99): the dashboards' coverage
    from sloweave.vllm_plugin.config import PluginConfig

    assert PluginConfig(cost=path, profile_margin=True).build_decision().coverage == 0.99


def test_where_a_token_costs_more_in_a_large_chunk_the_plugin_takes_the_fastest_chunk(tmp_path):
    """A profile whose steps cost more per token in a large chunk (the chunk's own attention, as on
    vLLM's CPU build): by default the chunk vLLM schedules beside the decodes is the one the fitted
    cost prefills fastest within the deadline, smaller than the largest that fits; with
    ``chunk_choice: largest`` it is the largest."""
    from sloweave.core.costs.profile_fit import fit_profile_file

    path = write_grid_profile(tmp_path / "profile.csv", lambda n, c, kv: 2.0 + 0.05 * n + 0.01 * c + 1e-5 * c * c / 2)
    fitted = fit_profile_file(path).cost("regression")
    chunks = {}
    for choice in ("fastest", "largest"):
        eng = engine(tpot_ms=60.0, cost=path, chunk_choice=choice, step_grid_tokens=1)
        for _ in range(4):
            eng.add(make_request(500, 30))
        eng.step()
        eng.add(make_request(9000, 2))
        step = eng.step()
        chunks[choice] = step.prefill_tokens
        assert step.decode_tokens == 4 and step.prefill_tokens == eng.scheduler.last_plan.chunk_tokens > 0
    kv = 4 * 502
    assert fitted.predict(4, chunks["largest"], kv, 0) <= 60.0 < fitted.predict(4, chunks["largest"] + 1, kv, 0)
    rate = {choice: chunk / fitted.predict(4, chunk, kv, 0) for choice, chunk in chunks.items()}
    assert chunks["fastest"] < chunks["largest"] and rate["fastest"] > 1.05 * rate["largest"]


@pytest.mark.parametrize("overlap", [False, True])
def test_online_correction_learns_real_step_times_inside_vllms_scheduler(overlap):
    """online_correction: the steps vLLM runs take 1.5x the model; the core calibrator learns it
    and the plug-in's chunks shrink so the predicted step fits the deadline again."""
    cls = SLOWeaveAsyncScheduler if overlap else SLOWeaveScheduler
    scheduler = build_scheduler(
        cls, max_num_batched_tokens=8192, additional_config={"sloweave": {"tpot_ms": 10.0, "online_correction": True}}
    )
    eng = OfflineEngine(scheduler, step_ms=lambda d, p: 1.5 * COST(d, p), overlap=overlap)
    for _ in range(4):
        eng.add(make_request(300, 60))
    for _ in range(3):
        eng.step()
    eng.add(make_request(20000, 2))
    for _ in range(12):
        eng.step()
    calibrator = scheduler.sloweave.correction
    assert calibrator is not None and calibrator.factor(4, True) == pytest.approx(1.5, rel=0.02)
    plan = scheduler.last_plan
    assert plan.chunk_tokens > 0 and plan.predicted_ms <= plan.budget_ms + 1e-9
    assert 1.5 * COST(4, plan.chunk_tokens) <= 10.0 + 1e-6  # the chunk now fits the real step time


def _biased_run(cls, overlap, online_correction, steps=90, bias=1.25, **scheduler_args):
    """Four long decodes and long prompts, one after the other; every step vLLM runs takes
    ``bias`` x the analytic model x seeded noise of up to 5 %. Returns the scheduler, the steps
    run and, per plan, (steps measured so far, the margin and cost it was decided with, plan)."""
    scheduler = build_scheduler(
        cls,
        max_num_batched_tokens=8192,
        additional_config={"sloweave": {"tpot_ms": 10.0, "online_correction": online_correction}},
        **scheduler_args,
    )
    rng = np.random.default_rng(0)
    eng = OfflineEngine(
        scheduler, step_ms=lambda d, p: bias * COST(d, p) * float(rng.uniform(1.0, 1.05)), overlap=overlap
    )
    controller, planned = scheduler.sloweave, []
    plan_step = controller.plan_step

    def recording_plan_step(state):  # what the decision saw, at the time it was taken
        plan = plan_step(state)
        seen = len(controller.correction.recent_residuals) if controller.correction is not None else 0
        policy = controller.policy
        planned.append(
            (
                seen,
                policy.margin(plan.decode_tokens, plan.chunk_tokens),
                policy.cost(plan.decode_tokens, plan.chunk_tokens),
                plan,
            )
        )
        return plan

    controller.plan_step = recording_plan_step
    for _ in range(4):
        eng.add(make_request(300, 400))
    steps_run = []
    for _ in range(steps):
        if not scheduler.waiting and not any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
            eng.add(make_request(8000, 2))
        steps_run.append(eng.step())
    return scheduler, steps_run, planned


@pytest.mark.parametrize("cls, overlap", [(SLOWeaveScheduler, False), (SLOWeaveAsyncScheduler, True)])
def test_online_correction_self_corrects_with_the_adaptive_margin_inside_vllms_scheduler(cls, overlap):
    """online_correction: the controller decides with the core's SelfCorrection. The steps vLLM
    runs take 1.25x the model (and up to 5 % noise); the calibrator learns the bias from the
    measured step times, the adaptive margin (the per-step form, the plug-in's default) is zero
    until 50 steps were measured (analytic prior: no fallback) and positive after, and the
    chunks shrink below the uncorrected plug-in's until the real step fits the deadline again."""
    from sloweave.core.costs.calibrated import DEFAULT_MARGIN_QUANTILE, SelfCorrection
    from sloweave.core.costs.step_margin import StepMargin

    scheduler, steps, planned = _biased_run(cls, overlap, online_correction=True)
    correction = scheduler.sloweave_correction
    assert isinstance(correction, SelfCorrection)
    controller = scheduler.sloweave
    assert controller.policy.cost is correction.cost and controller.policy.margin is correction.margin
    assert controller.correction is correction.calibrator
    assert isinstance(correction.margin, StepMargin) and correction.margin.quantile == DEFAULT_MARGIN_QUANTILE
    assert correction.calibrator.factor(4, True) == pytest.approx(1.25 * 1.025, rel=0.03)
    # the margin: none before min_steps measured steps, positive after; the plan is T' + delta
    min_steps = correction.margin.min_steps
    early = [margin for seen, margin, _, _ in planned if seen < min_steps]
    later = [margin for seen, margin, _, plan in planned if seen >= min_steps and plan.decode_tokens]
    assert early and all(margin == 0.0 for margin in early)
    assert len(later) > 20 and all(margin > 0.0 for margin in later)
    for _, margin, cost, plan in planned:
        assert plan.predicted_ms == pytest.approx(cost + margin)
    late = [s for s in steps[-20:] if s.decode_tokens == 4 and s.prefill_tokens]
    assert late and all(s.end_ms - s.start_ms <= 10.0 for s in late)  # the real steps fit again

    plain_scheduler, plain_steps, _ = _biased_run(cls, overlap, online_correction=False)
    assert plain_scheduler.sloweave_correction is None and plain_scheduler.sloweave.correction is None
    plain_late = [s for s in plain_steps[-20:] if s.decode_tokens == 4 and s.prefill_tokens]
    assert plain_late and all(s.end_ms - s.start_ms > 10.0 for s in plain_late)  # overruns, every one
    assert max(s.prefill_tokens for s in late) < min(s.prefill_tokens for s in plain_late)


def test_online_correction_learns_from_what_vllm_scheduled_not_from_the_budget():
    """vLLM may schedule less than the plug-in's budget (here max_num_seqs keeps prompts
    waiting): the calibrator compares the step vLLM ran with the model's prediction of that
    step. Against the plan's (larger) chunk it would learn the model is 3x too slow."""
    scheduler = build_scheduler(
        SLOWeaveScheduler,
        max_num_batched_tokens=8192,
        max_num_seqs=5,
        additional_config={"sloweave": {"tpot_ms": 10.0, "online_correction": True}},
    )
    eng = OfflineEngine(scheduler, step_ms=lambda d, p: 1.25 * COST(d, p))
    for _ in range(4):
        eng.add(make_request(300, 400))
    for _ in range(3):
        eng.step()
    short_steps = 0
    for _ in range(30):
        if len(scheduler.waiting) < 5:
            for _ in range(5):
                eng.add(make_request(200, 2))
        step = eng.step()
        short_steps += step.prefill_tokens < scheduler.last_plan.chunk_tokens
    assert short_steps > 20  # vLLM really took less than the budget
    calibrator = scheduler.sloweave.correction
    assert calibrator.factor(4, True) == pytest.approx(1.25) and calibrator.factor(4, False) == pytest.approx(1.25)
