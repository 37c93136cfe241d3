"""The plug-in's decisions as Prometheus metrics, on vLLM's ``/metrics`` endpoint.

Names and buckets come from ``sloweave.core.decision_metrics`` (shared with the simulator and
the CPU runtime). The client is ``prometheus_client``, which vLLM already depends on.

Where the numbers live. vLLM runs the scheduler in the engine-core process, separate from
the API server that serves ``/metrics``. vLLM's own scheduler numbers cross that boundary
as ``SchedulerStats`` inside the engine-core outputs and are turned into Prometheus metrics
in the front-end; a plug-in cannot add fields there without patching vLLM. The other path
vLLM uses, for several API servers, is ``prometheus_client``'s multiprocess mode: with
``PROMETHEUS_MULTIPROC_DIR`` set, every process writes its metrics to files in that
directory and ``/metrics`` (``vllm.v1.metrics.prometheus.get_prometheus_registry``) merges
them with a ``MultiProcessCollector``. The plug-in follows that path: export
``PROMETHEUS_MULTIPROC_DIR`` (an empty directory) before ``vllm serve`` and the metrics
registered here, in the engine core, appear on ``/metrics``. Without it they stay in the
engine-core process, and the scheduler says so once in the log.

Cost per step: one append. Steps are folded into the metrics in batches (every
``FLUSH_EVERY_STEPS`` steps, when the engine runs out of requests, at shutdown, and before this
process's registry is read): inside a real engine each step's forward pass leaves the CPU's
caches cold, and a handful of observations made cold every step cost more than vLLM's own
``schedule()`` at small batches (``benchmarks/vllm_engine_overhead.py``); made in a batch they
run warm. A scrape in another process (multiprocess mode) can so lag the engine by up to that
many steps.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, values

from sloweave.core import decision_metrics as names

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# steps folded into the metrics at once (at a few ms a step: well under a scrape interval)
FLUSH_EVERY_STEPS = 32


class PrometheusRecorder:
    """A ``DecisionRecorder`` that updates Prometheus metrics; one per registry.

    Every metric carries an ``engine`` label: the data-parallel rank of the scheduler that
    records it (vLLM's own metrics use the same label), so each replica's decisions stay
    apart on ``/metrics`` instead of being summed."""

    def __init__(self, registry: CollectorRegistry | None = None, engine: str = "0") -> None:
        registry = REGISTRY if registry is None else registry

        def histogram(spec: names.MetricSpec) -> Histogram:
            return Histogram(spec.name, spec.help, ["engine"], buckets=spec.buckets, registry=registry).labels(
                engine=engine
            )

        def counter(spec: names.MetricSpec) -> Counter:
            return Counter(spec.name, spec.help, ["engine"], registry=registry).labels(engine=engine)

        def gauge(spec: names.MetricSpec) -> Gauge:
            # one value per engine, not per process, when several processes write (multiprocess mode)
            return Gauge(spec.name, spec.help, ["engine"], registry=registry, multiprocess_mode="max").labels(
                engine=engine
            )

        self.registry = registry
        self.engine = engine
        # (plan, late requests) planned and (predicted, measured ms) back, not in the metrics yet
        self._planned: list[tuple] = []
        self._back: list[tuple[float, float]] = []
        self._lock = threading.Lock()  # a scrape thread of this process may flush while the engine records
        # registered before the metrics: a read of this registry folds pending steps in first
        registry.register(_FlushFirst(self))
        self.chunk_tokens = histogram(names.CHUNK)
        self.token_budget_tokens = histogram(names.TOKEN_BUDGET)
        self.time_budget_ms = histogram(names.TIME_BUDGET)
        self.steps = counter(names.STEPS)
        self.infeasible_steps = counter(names.INFEASIBLE)
        self.slo_exceptions = counter(names.SLO_EXCEPTIONS)
        self.slo_exception_requests = counter(names.SLO_EXCEPTION_REQUESTS)
        self.predicted_step_ms = histogram(names.PREDICTED_STEP)
        self.measured_step_ms = histogram(names.MEASURED_STEP)
        self.underpredicted_steps = counter(names.UNDERPREDICTED)
        self.margin_ms = histogram(names.MARGIN)
        # The plug-in's settings, for panels and alerts that compare against them.
        self.margin_coverage = gauge(names.MARGIN_COVERAGE)
        self.tpot_target_ms = gauge(names.TPOT_TARGET)
        # The plug-in's own health (no simulator counterpart): bad per-request targets served
        # with the default, and failures of its bookkeeping that fell back to vLLM's budget.
        self.request_target_errors = counter(names.REQUEST_TARGET_ERRORS)
        self._plugin_errors = Counter(
            names.PLUGIN_ERRORS.name, names.PLUGIN_ERRORS.help, ["engine", "where"], registry=registry
        )
        for where in names.PLUGIN_ERROR_PLACES:  # present at 0 from the start: a rate and an alert see every place
            self._plugin_errors.labels(engine=engine, where=where)

    def set_targets(self, tpot_ms: float, margin_coverage: float) -> None:
        self.tpot_target_ms.set(tpot_ms)
        self.margin_coverage.set(margin_coverage)

    def plugin_error(self, where: str) -> None:
        self._plugin_errors.labels(engine=self.engine, where=where).inc()

    def on_plan(self, plan, late_requests: int, ran_tokens: tuple[int, int] | None = None) -> None:
        with self._lock:
            self._planned.append((plan, late_requests))
            if len(self._planned) >= FLUSH_EVERY_STEPS:
                self._flush()

    def on_step_done(self, plan, measured_ms: float, started_ms: float = math.nan) -> None:
        with self._lock:
            self._back.append((plan.predicted_ms, measured_ms))
            if len(self._back) >= FLUSH_EVERY_STEPS:
                self._flush()

    def flush(self) -> None:
        """Fold every pending step into the metrics."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        planned, self._planned = self._planned, []
        back, self._back = self._back, []
        for plan, late_requests in planned:
            self._record_plan(plan, late_requests)
        # Predicted and measured are observed together, so their counts always match.
        for predicted_ms, measured_ms in back:
            self.predicted_step_ms.observe(predicted_ms)
            self.measured_step_ms.observe(measured_ms)
            if measured_ms > predicted_ms + names.UNDERPREDICTION_TOLERANCE_MS:
                self.underpredicted_steps.inc()

    def _record_plan(self, plan, late_requests: int) -> None:
        self.steps.inc()
        self.chunk_tokens.observe(plan.chunk_tokens)
        self.token_budget_tokens.observe(plan.token_budget)
        self.margin_ms.observe(plan.margin_ms)
        if math.isfinite(plan.budget_ms):  # no decodes: no deadline, nothing to observe
            self.time_budget_ms.observe(plan.budget_ms)
        if plan.infeasible:
            self.infeasible_steps.inc()
        if plan.aged:
            self.slo_exceptions.inc()
            self.slo_exception_requests.inc(late_requests)


class _FlushFirst:
    """A collector with no metrics of its own: collecting it flushes the recorder's pending steps."""

    def __init__(self, recorder: PrometheusRecorder) -> None:
        self.recorder = recorder

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        self.recorder.flush()
        return []


_default_recorder: PrometheusRecorder | None = None


def default_recorder(engine: str = "0") -> PrometheusRecorder:
    """The recorder on the default registry, created once per process.

    Every scheduler of a process shares it (Prometheus refuses a name registered twice).
    With data parallelism each replica's engine core is its own process and labels its
    metrics with its rank (``engine``), so multiprocess mode shows each replica apart.
    """
    global _default_recorder
    if _default_recorder is None:
        _warn_if_invisible()
        _default_recorder = PrometheusRecorder(REGISTRY, engine)
    return _default_recorder


def _warn_if_invisible() -> None:
    in_child = multiprocessing.parent_process() is not None
    multiproc = MULTIPROC_ENV in os.environ
    if multiproc and values.ValueClass is values.MutexValue:
        # prometheus_client picks its value store when first imported; the variable came later.
        logger.warning(
            "sloweave metrics: %s was set after prometheus_client was imported; they will not reach /metrics",
            MULTIPROC_ENV,
        )
    elif in_child and not multiproc:
        logger.warning(
            "sloweave metrics are registered in the engine-core process; set %s (an empty directory) before "
            "`vllm serve` to see them on /metrics (docs/operator-tools.md)",
            MULTIPROC_ENV,
        )
