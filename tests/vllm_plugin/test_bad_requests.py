"""One request's bad data never takes the scheduler (and with it the engine and server) down."""

import math

import numpy as np
import pytest
from prometheus_client import REGISTRY

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.decision_metrics import PLUGIN_ERROR_PLACES
from sloweave.vllm_plugin import SLOWeaveAsyncScheduler, SLOWeaveScheduler
from sloweave.vllm_plugin.config import MAX_TPOT_MS, PluginConfigError, request_tpot_ms
from sloweave.vllm_plugin.offline import OfflineEngine, block_hasher, build_scheduler, make_request
from sloweave.vllm_plugin.request_check import REQUEST_TARGET_CHECK, RequestTargetCheck

COST = AnalyticCost()
BAD_TARGETS = [-1, 0, math.nan, math.inf, -math.inf, "fast", True, None, [10], MAX_TPOT_MS * 2, 1e300]


def engine(cls=SLOWeaveScheduler, overlap=False, **config):
    scheduler = build_scheduler(cls, max_num_batched_tokens=8192, additional_config={"sloweave": config})
    return OfflineEngine(scheduler, step_ms=lambda d, p: COST(d, p), overlap=overlap)


def counter(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(f"{name}_total", {"engine": "0", **labels}) or 0.0


@pytest.mark.parametrize("value", BAD_TARGETS)
def test_the_shared_rule_refuses_a_bad_target_naming_request_and_key(value):
    with pytest.raises(ValueError, match=r"request r7: sloweave_tpot_ms must be"):
        request_tpot_ms({"sloweave_tpot_ms": value}, "r7")


def test_extra_arguments_that_are_not_an_object_are_refused_by_name():
    with pytest.raises(ValueError, match=r"request r2: extra arguments must be an object"):
        request_tpot_ms([("sloweave_tpot_ms", 5)], "r2")


def test_the_shared_rule_accepts_good_targets_and_absence():
    assert request_tpot_ms(None, "r") is None and request_tpot_ms({"other": 1}, "r") is None
    assert request_tpot_ms({"sloweave_tpot_ms": 12}, "r") == 12.0
    assert request_tpot_ms({"sloweave_tpot_ms": MAX_TPOT_MS}, "r") == MAX_TPOT_MS


@pytest.mark.parametrize("tpot_ms", [1e300, math.inf, -3])
def test_the_configured_default_target_follows_the_same_rule(tpot_ms):
    with pytest.raises(PluginConfigError, match="tpot_ms must be"):
        build_scheduler(SLOWeaveScheduler, additional_config={"sloweave": {"tpot_ms": tpot_ms}})


@pytest.mark.parametrize("cls, overlap", [(SLOWeaveScheduler, False), (SLOWeaveAsyncScheduler, True)])
def test_a_bad_per_request_target_is_served_with_the_default_and_counted(cls, overlap, caplog):
    eng = engine(cls, overlap=overlap, tpot_ms=20.0)
    before = counter("sloweave_request_target_errors")
    good = [make_request(300, 12) for _ in range(3)]
    bad = [make_request(200, 8, extra_args={"sloweave_tpot_ms": v}) for v in BAD_TARGETS]
    for request in [good[0], *bad, *good[1:]]:
        eng.add(request)  # no exception: the scheduler (and the engine core) lives on
    eng.run()
    assert eng.finished == {r.request_id for r in good + bad}
    assert all(len(eng.token_times_ms[r.request_id]) == r.max_tokens for r in good + bad)
    assert counter("sloweave_request_target_errors") - before == len(BAD_TARGETS)
    assert not eng.scheduler._request_tpot_ms  # every bad one fell back to the default
    assert (
        f"request {bad[0].request_id}: sloweave_tpot_ms must be" in caplog.text
        and "default target 20 ms" in caplog.text
    )


def test_the_front_end_check_refuses_what_the_scheduler_would_not_use():
    class Params:  # what validate_params reads of a SamplingParams
        def __init__(self, extra):
            self.extra_args = extra

    for value in BAD_TARGETS:
        with pytest.raises(ValueError, match="sloweave_tpot_ms must be"):
            RequestTargetCheck.validate_params(Params({"sloweave_tpot_ms": value}))
    assert RequestTargetCheck.validate_params(Params({"sloweave_tpot_ms": 15})) is None
    assert RequestTargetCheck.validate_params(Params(None)) is None
    module, name = REQUEST_TARGET_CHECK.split(":")
    assert getattr(__import__(module, fromlist=[name]), name) is RequestTargetCheck


@pytest.mark.parametrize("cls, overlap", [(SLOWeaveScheduler, False), (SLOWeaveAsyncScheduler, True)])
def test_a_failing_plan_falls_back_to_vllms_budget_for_that_step(cls, overlap):
    eng = engine(cls, overlap=overlap, tpot_ms=10.0)
    controller = eng.scheduler.sloweave
    plan_step, calls = controller.plan_step, {"n": 0}

    def flaky(state):
        calls["n"] += 1
        if calls["n"] in (3, 4, 9):  # e.g. a defect triggered by one request's numbers
            raise OverflowError("cannot convert float infinity to integer")
        return plan_step(state)

    controller.plan_step = flaky
    before = counter("sloweave_plugin_errors", where="schedule")
    requests = [make_request(int(p), 15) for p in np.random.default_rng(1).integers(50, 6000, 12)]
    for i, request in enumerate(requests):
        eng.add(request)
        if i % 3 == 0:
            eng.step()
    eng.run()
    assert eng.finished == {r.request_id for r in requests}
    assert counter("sloweave_plugin_errors", where="schedule") - before == 3
    unplanned = [s for s in eng.steps if s.token_budget is None]
    assert len(unplanned) == 3  # those steps ran on vLLM's configured budget
    assert all(s.prefill_tokens + s.decode_tokens <= 8192 for s in unplanned)
    # deadlines kept being tracked through the unplanned steps: later plans see decodes' deadlines
    assert any(s.token_budget is not None and s.decode_tokens and s.prefill_tokens for s in eng.steps[6:])


def test_a_failing_output_bookkeeping_step_does_not_lose_the_outputs():
    eng = engine(tpot_ms=10.0)
    controller = eng.scheduler.sloweave
    on_step_done, calls = controller.on_step_done, {"n": 0}

    def flaky(now_ms, emitted):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("gone")
        return on_step_done(now_ms, emitted)

    controller.on_step_done = flaky
    before = counter("sloweave_plugin_errors", where="update_from_output")
    requests = [make_request(100, 10) for _ in range(4)]
    for request in requests:
        eng.add(request)
    eng.run()
    assert eng.finished == {r.request_id for r in requests}
    assert all(len(eng.token_times_ms[r.request_id]) == 10 for r in requests)
    assert counter("sloweave_plugin_errors", where="update_from_output") - before == 1


def test_prefix_caching_on_as_vllm_defaults():
    """vLLM 0.32 turns prefix caching on by default; requests then carry block hashes."""
    scheduler = build_scheduler(
        SLOWeaveScheduler, additional_config={"sloweave": {"tpot_ms": 15.0}}, prefix_caching=True
    )
    eng = OfflineEngine(scheduler, step_ms=lambda d, p: COST(d, p))
    rng = np.random.default_rng(3)
    hasher = block_hasher()
    shared = rng.integers(10, 1000, 640).tolist()  # a system prompt every request starts with
    requests = [
        make_request(0, 8, prompt_token_ids=shared + rng.integers(10, 1000, int(n)).tolist(), hasher=hasher)
        for n in rng.integers(10, 900, 10)
    ]
    eng.add(requests[0])
    eng.run()
    for request in requests[1:]:
        eng.add(request)
    eng.run()
    assert eng.finished == {r.request_id for r in requests}
    later_prefill = sum(s.prefill_tokens for s in eng.steps[1:])
    assert (
        later_prefill < sum(len(r.prompt_token_ids) for r in requests[1:]) - 8 * 640
    )  # the shared blocks came from the cache


@pytest.mark.parametrize("cls, overlap", [(SLOWeaveScheduler, False), (SLOWeaveAsyncScheduler, True)])
def test_a_clock_glitch_is_refused_and_counted_and_serving_goes_on(cls, overlap):
    """A clock that reads NaN once in a while: each reading is refused and counted where it
    happened (that step runs on vLLM's budget), and no NaN reaches a deadline, a prompt's
    aging or the online correction, so the margin stays a margin."""
    eng = engine(cls, overlap=overlap, tpot_ms=10.0, online_correction=True)
    clock, calls = eng.scheduler.sloweave_clock_ms, {"n": 0}

    def glitching() -> float:
        calls["n"] += 1
        return math.nan if calls["n"] in (2, 9, 17, 30) else clock()

    eng.scheduler.sloweave_clock_ms = glitching
    before = sum(counter("sloweave_plugin_errors", where=where) for where in PLUGIN_ERROR_PLACES)
    requests = [make_request(int(p), 12) for p in np.random.default_rng(2).integers(50, 3000, 6)]
    for i, request in enumerate(requests):
        eng.add(request)
        if i % 2:
            eng.step()
    eng.run()
    assert eng.finished == {r.request_id for r in requests}
    assert all(len(eng.token_times_ms[r.request_id]) == 12 for r in requests)
    assert sum(counter("sloweave_plugin_errors", where=where) for where in PLUGIN_ERROR_PLACES) - before == 4
    controller = eng.scheduler.sloweave
    assert all(math.isfinite(r) for r in controller.correction.recent_residuals)
    assert all(math.isfinite(t) for t in eng.scheduler._prompt_progress_ms.values())
    assert len(controller.tracker) == 0  # every finished request's deadline dropped, glitch or not


def test_health_counters_work_with_the_step_log_on(tmp_path):
    """With the step log on, the controller's recorder is a fan-out; a bad target and a fault
    are still counted on the Prometheus recorder (and do not take the engine down)."""
    eng = engine(tpot_ms=10.0, step_log=str(tmp_path / "steps.jsonl"))
    before = counter("sloweave_request_target_errors")
    eng.add(make_request(100, 4, extra_args={"sloweave_tpot_ms": -1}))
    eng.scheduler.sloweave_fault("schedule", RuntimeError("test"))
    eng.run()
    assert counter("sloweave_request_target_errors") - before == 1
    assert len(eng.finished) == 1
