"""The plug-in's step log and the settings it exports for dashboards, on real vLLM schedulers (CPU, offline)."""

import math

import pytest
from prometheus_client import CollectorRegistry

from sloweave.core.costs.calibrated import DEFAULT_MARGIN_QUANTILE
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.decision_metrics import PLUGIN_ERROR_PLACES, Recorders
from sloweave.core.step_log import STEP_FIELDS, read_step_log
from sloweave.vllm_plugin import SLOWeaveAsyncScheduler, SLOWeaveScheduler
from sloweave.vllm_plugin.config import PluginConfig, PluginConfigError
from sloweave.vllm_plugin.metrics import PrometheusRecorder
from sloweave.vllm_plugin.offline import OfflineEngine, build_scheduler, make_request

COST = AnalyticCost()
MARGIN_MS = 0.5
SLOW_PREFILL_MS = 2.0


def logged_engine(tmp_path, cls=SLOWeaveScheduler, overlap=False, **config):
    log = tmp_path / "steps.jsonl"
    settings = {"tpot_ms": 10.0, "margin_ms": MARGIN_MS, "aging_ms": 0, "step_log": str(log), **config}
    scheduler = build_scheduler(cls, max_num_batched_tokens=8192, additional_config={"sloweave": settings})
    registry = CollectorRegistry()
    metrics = PrometheusRecorder(registry)
    scheduler.sloweave.recorder = Recorders(metrics, scheduler.sloweave_step_log)  # a fresh registry, the same log
    step_ms = lambda d, p: COST(d, p) + (SLOW_PREFILL_MS if p else 0.0)  # noqa: E731 - prefill steps run late
    return OfflineEngine(scheduler, step_ms=step_ms, overlap=overlap), log, registry


def drive(eng):
    eng.add(make_request(6000, 20))  # alone: the whole C_max chunk, no deadline (+inf budget)
    eng.step()
    for _ in range(3):
        eng.add(make_request(40, 20))
    eng.step()
    eng.add(make_request(8000, 5))  # next to decodes at 10 ms: chunks the deadline cuts
    eng.run()
    eng.scheduler.shutdown()


@pytest.mark.parametrize("cls, overlap", [(SLOWeaveScheduler, False), (SLOWeaveAsyncScheduler, True)])
def test_the_step_log_holds_every_step_the_engine_ran_with_its_plan_and_measured_time(tmp_path, cls, overlap):
    eng, path, _ = logged_engine(tmp_path, cls, overlap)
    drive(eng)
    log = read_step_log(path)
    steps = log.steps
    assert log.stopped is None and log.header["engine"] == "0" and log.header["config"]["tpot_ms"] == 10.0
    assert list(steps.columns) == list(STEP_FIELDS) and list(steps["step"]) == list(range(len(eng.steps)))
    # what vLLM really scheduled, step by step
    assert list(steps["ran_prefill_tokens"]) == [s.prefill_tokens for s in eng.steps]
    assert list(steps["ran_decode_tokens"]) == [s.decode_tokens for s in eng.steps]
    assert list(steps["token_budget"]) == [s.token_budget for s in eng.steps]
    assert steps["ran_prefill_tokens"].sum() == 6000 + 3 * 40 + 8000
    # the prediction is the model's time plus the margin, the margin the configured one
    assert (steps["margin_ms"] == MARGIN_MS).all()
    model_ms = [COST(n, c) for n, c in zip(steps["decode_tokens"], steps["chunk_tokens"])]
    assert (steps["predicted_ms"] - steps["margin_ms"]).tolist() == pytest.approx(model_ms)
    no_deadline = steps["decode_tokens"] == 0  # nothing decoding: the budget is +inf
    assert no_deadline.iloc[0] and (steps["budget_ms"].map(math.isinf) == no_deadline).all() and not no_deadline.all()
    assert 0 < steps["chunk_tokens"].iloc[3] < 4096 and (steps["pending_prompt_tokens"] >= steps["chunk_tokens"]).all()
    # the prompts on offer one by one, in vLLM's order: the partial prompt (its computed tokens), then the waiting
    assert steps["offer"].iloc[0] == [[6000, 0]]
    assert steps["offer"].iloc[1] == [[6000 - 4096, 4096], [40, 0], [40, 0], [40, 0]]
    assert (
        steps["offer"].map(lambda offer: sum(tokens for tokens, _ in offer)) == steps["pending_prompt_tokens"]
    ).all()
    # measured: the step's own time (synchronous) or from its re-timed start (overlapped)
    with_prefill = steps["ran_prefill_tokens"] > 0
    late = steps["measured_ms"] > steps["predicted_ms"]
    assert late[with_prefill].all() and not late[~with_prefill].any()  # the slow prefills, beyond the 0.5 ms margin
    if not overlap:
        assert steps["measured_ms"].tolist() == pytest.approx([s.end_ms - s.start_ms for s in eng.steps])
        assert steps["start_ms"].tolist() == pytest.approx([s.start_ms for s in eng.steps])


def test_the_step_log_stops_at_its_bound_and_says_so(tmp_path):
    eng, path, _ = logged_engine(tmp_path, step_log_max_steps=3)
    drive(eng)  # many more than 3 steps: the engine goes on, the log stops
    log = read_step_log(path)
    assert len(log.steps) == 3 and "max_steps (3)" in log.stopped
    assert len(eng.steps) > 3 and len(eng.finished) == 5


def test_margin_and_targets_are_exported_for_dashboards(tmp_path):
    eng, _, registry = logged_engine(tmp_path)
    eng.scheduler.sloweave.recorder.recorders[0].set_targets(10.0, 0.5)
    drive(eng)

    def value(name, **labels):
        return registry.get_sample_value(name, {"engine": "0", **labels})

    assert value("sloweave_margin_ms_count") == len(eng.steps)
    assert value("sloweave_margin_ms_sum") == pytest.approx(MARGIN_MS * len(eng.steps))
    assert value("sloweave_tpot_target_ms") == 10.0 and value("sloweave_margin_coverage") == 0.5
    for where in PLUGIN_ERROR_PLACES:  # every fallback place is a series from the start, at 0
        assert value("sloweave_plugin_errors_total", where=where) == 0.0


def test_the_scheduler_exports_its_target_and_the_coverage_its_margin_states():
    from prometheus_client import REGISTRY

    build_scheduler(SLOWeaveScheduler, additional_config={"sloweave": {"tpot_ms": 42.0, "online_correction": True}})
    sample = lambda name: REGISTRY.get_sample_value(name, {"engine": "0"})  # noqa: E731
    assert sample("sloweave_tpot_target_ms") == 42.0
    assert sample("sloweave_margin_coverage") == DEFAULT_MARGIN_QUANTILE / 100.0
    assert PluginConfig().build_decision().coverage == 0.5  # no margin: the model is held to the median
    assert PluginConfig(margin_ms=2.0).build_decision().coverage == 0.5  # a hand-set margin states no quantile


@pytest.mark.parametrize(
    "step_log, message",
    [
        ("/no/such/folder/steps.jsonl", "does not exist or is not writable"),
        (".", "is a folder"),
        (7, "must be a file path"),
    ],
)
def test_a_step_log_that_cannot_be_written_fails_at_start_up(step_log, message):
    with pytest.raises(PluginConfigError, match=f"step_log.*{message}|{message}"):
        PluginConfig(step_log=step_log)


def test_a_step_log_bound_below_one_fails_at_start_up():
    with pytest.raises(PluginConfigError, match="step_log_max_steps"):
        PluginConfig(step_log_max_steps=0)


def test_the_step_log_is_configured_from_the_environment(tmp_path):
    path = tmp_path / "env.jsonl"
    config = PluginConfig.from_sources(None, {"SLOWEAVE_STEP_LOG": str(path), "SLOWEAVE_STEP_LOG_MAX_STEPS": "10"})
    assert config.step_log == str(path) and config.step_log_max_steps == 10


def test_the_step_log_of_a_run_is_the_profile_of_the_next(tmp_path):
    """A profile taken while serving: the log of one run, as the cost of the next plug-in."""
    eng, path, _ = logged_engine(tmp_path)
    for prompt in (3000, 700, 40, 1500, 90, 5000, 300):
        eng.add(make_request(prompt, 12))
        eng.step()
    eng.run()
    eng.scheduler.shutdown()
    config = PluginConfig(cost=str(path), tpot_ms=10.0)
    fitted = config.build_decision().cost
    # the engine's steps: the analytic model, plus SLOW_PREFILL_MS on every step with a chunk
    for n, c in ((4, 512), (6, 1024)):
        assert fitted.predict(n, c, 0, 0) == pytest.approx(COST(n, c) + SLOW_PREFILL_MS, rel=0.1)
    built = build_scheduler(SLOWeaveScheduler, additional_config={"sloweave": {"cost": str(path)}})
    assert built.sloweave.policy.cost(4, 512) == pytest.approx(fitted.predict(4, 512, 0, 0))  # vLLM starts with it
