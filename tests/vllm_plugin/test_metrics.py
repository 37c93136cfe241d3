"""The plug-in's Prometheus metrics after scripted runs of real vLLM schedulers on CPU."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.vllm_plugin import SLOWeaveAsyncScheduler, SLOWeaveScheduler
from sloweave.vllm_plugin.metrics import PrometheusRecorder, default_recorder
from sloweave.vllm_plugin.offline import OfflineEngine, build_scheduler, make_request

COST = AnalyticCost()
SLOW_PREFILL_MS = 2.0  # steps with a prefill take this much longer than the model predicts


def engine_with_registry(cls=SLOWeaveScheduler, overlap=False, step_ms=None, **config):
    scheduler = build_scheduler(cls, max_num_batched_tokens=8192, additional_config={"sloweave": config})
    registry = CollectorRegistry()  # a fresh registry: the default one is shared by every scheduler
    scheduler.sloweave.recorder = PrometheusRecorder(registry)
    return OfflineEngine(scheduler, step_ms=step_ms or (lambda d, p: COST(d, p)), overlap=overlap), registry


def value(registry, name, **labels):
    return registry.get_sample_value(name, {"engine": "0", **labels})  # the data-parallel rank


@pytest.mark.parametrize("cls, overlap", [(SLOWeaveScheduler, False), (SLOWeaveAsyncScheduler, True)])
def test_decisions_and_step_times_are_exported(cls, overlap):
    eng, registry = engine_with_registry(
        cls,
        overlap,
        step_ms=lambda d, p: COST(d, p) + (SLOW_PREFILL_MS if p else 0.0),
        tpot_ms=10.0,
        aging_ms=0,
        step_grid_tokens=1,
    )
    eng.add(make_request(6000, 30))  # alone: the whole C_max = 4096 chunk, no deadline
    eng.step()
    for _ in range(3):
        eng.add(make_request(40, 30))
    eng.step()
    eng.add(make_request(8000, 5))  # next to 4 decodes at 10 ms: chunks of about 1355
    eng.step()
    eng.advance_to(eng.clock.now_ms + 30.0)  # idle past the earliest deadline: decode-only, infeasible
    eng.run()
    # every step the engine scheduled is in the metrics, with the plug-in's own numbers
    steps = len(eng.steps)
    chunks = [s.prefill_tokens for s in eng.steps]
    assert chunks[0] == 4096 and 1354 <= chunks[2] <= 1356
    assert value(registry, "sloweave_steps_total") == steps
    assert value(registry, "sloweave_chunk_tokens_count") == steps
    assert value(registry, "sloweave_chunk_tokens_sum") == sum(chunks) == 6000 + 3 * 40 + 8000
    assert value(registry, "sloweave_token_budget_tokens_sum") == sum(s.token_budget for s in eng.steps)
    for edge in (0, 256, 1024, 2048, 4096):
        assert value(registry, "sloweave_chunk_tokens_bucket", le=f"{edge:.1f}") == sum(c <= edge for c in chunks)
    assert value(registry, "sloweave_chunk_tokens_bucket", le="0.0") > 0  # decode-only steps
    with_decodes = [s for s in eng.steps if s.decode_tokens]
    assert value(registry, "sloweave_time_budget_ms_count") == len(with_decodes)  # +inf budgets are skipped
    infeasible = value(registry, "sloweave_infeasible_steps_total")
    assert infeasible >= 1 and infeasible == eng.scheduler.sloweave.stats.infeasible_steps
    assert value(registry, "sloweave_slo_exceptions_total") == 0
    # predicted against measured: every finished step, and the slow prefill steps are flagged
    assert value(registry, "sloweave_measured_step_ms_count") == steps
    assert value(registry, "sloweave_predicted_step_ms_count") == steps
    with_prefill = sum(1 for s in eng.steps if s.prefill_tokens)
    assert value(registry, "sloweave_underpredicted_steps_total") == with_prefill
    measured = value(registry, "sloweave_measured_step_ms_sum")
    predicted = value(registry, "sloweave_predicted_step_ms_sum")
    recent = eng.scheduler.sloweave.stats.recent  # the controller's own (chunk, budget, predicted, measured)
    assert predicted == pytest.approx(sum(r[2] for r in recent))
    assert measured == pytest.approx(sum(r[3] for r in recent))
    if not overlap:
        # Synchronous steps start when the previous output is back, so the measured time is
        # exactly the step's. (Overlapped, the controller never moves a planned start
        # earlier, so a step that ends early leaves the next ones' starts late by that much.)
        assert measured == pytest.approx(sum(s.end_ms - s.start_ms for s in eng.steps))
        assert measured == pytest.approx(predicted + SLOW_PREFILL_MS * with_prefill)


def test_slo_exceptions_from_aging_are_counted():
    eng, registry = engine_with_registry(tpot_ms=1.0, aging_ms=50.0, aging_chunk_tokens=64)  # nothing ever fits 1 ms
    for _ in range(2):
        eng.add(make_request(10, 300))
    eng.step()
    eng.add(make_request(300, 2))
    eng.run()
    exceptions = eng.scheduler.sloweave.stats.slo_exceptions
    assert len(exceptions) >= 2  # 300 tokens in 64-token forced chunks
    assert value(registry, "sloweave_slo_exceptions_total") == len(exceptions)
    # each forced chunk runs next to the two decodes, which both miss their 1 ms deadline
    assert value(registry, "sloweave_slo_exception_requests_total") == sum(len(e.affected_ids) for e in exceptions)
    assert value(registry, "sloweave_slo_exception_requests_total") == 2 * len(exceptions)
    assert value(registry, "sloweave_infeasible_steps_total") == eng.scheduler.sloweave.stats.infeasible_steps > 0


def test_production_path_registers_once_on_the_default_registry():
    first = build_scheduler(SLOWeaveScheduler)
    second = build_scheduler(SLOWeaveAsyncScheduler)  # no duplicate-registration error
    assert first.sloweave.recorder is second.sloweave.recorder is default_recorder()
    before = value(REGISTRY, "sloweave_steps_total") or 0.0
    eng = OfflineEngine(first, step_ms=lambda d, p: COST(d, p))
    eng.add(make_request(100, 3))
    eng.run()
    assert value(REGISTRY, "sloweave_steps_total") - before == len(eng.steps)
    assert b"# TYPE sloweave_chunk_tokens histogram" in generate_latest(REGISTRY)


ENGINE_CORE = textwrap.dedent(
    """
    import json
    from sloweave.core.costs.analytic import AnalyticCost
    from sloweave.vllm_plugin import SLOWeaveScheduler
    from sloweave.vllm_plugin.offline import OfflineEngine, build_scheduler, make_request
    eng = OfflineEngine(build_scheduler(SLOWeaveScheduler), step_ms=lambda d, p: AnalyticCost()(d, p))
    for prompt in (3000, 200, 50):
        eng.add(make_request(prompt, 4))
    eng.run()
    print(json.dumps({"steps": len(eng.steps), "chunk_sum": sum(s.prefill_tokens for s in eng.steps)}))
    """
)


def test_metrics_of_an_engine_core_process_reach_vllms_metrics_registry(tmp_path, monkeypatch):
    """Multiprocess mode: the scheduler runs in another process, /metrics' registry merges its files."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_CORE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    ran = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(tmp_path.glob("*.db")), "the engine-core process wrote no metric files"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    registry = get_prometheus_registry()  # what vLLM's /metrics endpoint serves
    assert registry is not REGISTRY
    assert value(registry, "sloweave_steps_total") == ran["steps"]
    assert value(registry, "sloweave_chunk_tokens_sum") == ran["chunk_sum"] == 3250
    assert b"sloweave_infeasible_steps_total" in generate_latest(registry)
