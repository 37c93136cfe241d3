"""The vLLM plug-in's Prometheus metrics: what they cost per step, and what /metrics shows.

1. Cost: the recorder calls of one step (``on_plan`` + ``on_step_done``: 4 histogram
   observations and up to 4 counter updates, then 2 more observations) timed directly,
   median of per-step times over several repetitions, for the Prometheus recorder, the
   step log (one JSON line a step, to a file) and both together; and the plug-in's whole
   ``schedule()`` + ``update_from_output()`` step on the offline CPU engine with and without
   the recorder (medians of repeated runs of the same scripted workload).
2. Sample: the default registry rendered with ``prometheus_client.generate_latest`` after a
   scripted run (the text vLLM's /metrics serves), sloweave lines only.

    .venv-vllm/bin/python benchmarks/plugin_metrics.py
    PROMETHEUS_MULTIPROC_DIR=$(mktemp -d) .venv-vllm/bin/python benchmarks/plugin_metrics.py   # multiprocess (mmap) mode
"""

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.budget import StepPlan
from sloweave.core.decision_metrics import Recorders
from sloweave.core.step_log import StepLogWriter
from sloweave.vllm_plugin import SLOWeaveScheduler
from sloweave.vllm_plugin.metrics import PrometheusRecorder, default_recorder
from sloweave.vllm_plugin.offline import OfflineEngine, build_scheduler, make_request

COST = AnalyticCost()
REPEATS = 7


def recorder_cost_us(recorder, steps: int = 5000) -> list[float]:
    plans = [
        StepPlan(64 + i % 512, i % 512, 0.0, 0.0, 25.0, 12.0, i % 50 == 0, i % 200 == 0, 64, margin_ms=1.5)
        for i in range(steps)
    ]
    per_step = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for plan in plans:
            recorder.on_plan(plan, 1 if plan.aged else 0, (64, plan.chunk_tokens))
            recorder.on_step_done(plan, 12.5, 0.0)
        per_step.append((time.perf_counter() - start) / steps * 1e6)
    return per_step


def scripted_run(with_recorder: bool, registry=None) -> tuple[float, int]:
    """A mixed scripted run on the offline engine; returns (seconds, steps)."""
    rng = np.random.default_rng(0)
    scheduler = build_scheduler(
        SLOWeaveScheduler, max_num_batched_tokens=8192, additional_config={"sloweave": {"tpot_ms": 25}}
    )
    if not with_recorder:
        scheduler.sloweave.recorder = None
    elif registry is not None:
        scheduler.sloweave.recorder = PrometheusRecorder(registry)
    eng = OfflineEngine(scheduler, step_ms=lambda d, p: COST(d, p))
    prompts = np.where(rng.random(120) < 0.2, rng.integers(2000, 6000, 120), rng.integers(50, 600, 120))
    outputs = rng.integers(20, 150, 120)
    start = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        eng.add(make_request(int(p), int(o)))
        if i % 4 == 3:
            for _ in range(8):
                eng.step()
    eng.run()
    return time.perf_counter() - start, len(eng.steps)


def main() -> None:
    mode = "multiprocess (mmap files)" if "PROMETHEUS_MULTIPROC_DIR" in os.environ else "single process"
    print(f"prometheus_client mode: {mode}")
    # multiprocess mode: the default registry's recorder (the one the scheduler uses, files under the directory)
    metrics = PrometheusRecorder(CollectorRegistry()) if mode == "single process" else default_recorder()
    with tempfile.TemporaryDirectory() as folder:
        log = StepLogWriter(Path(folder) / "steps.jsonl", {}, max_steps=10**9)
        for what, recorder in (
            ("metrics", metrics),
            ("step log", log),
            ("metrics + step log", Recorders(metrics, log)),
        ):
            costs = recorder_cost_us(recorder)
            runs = ", ".join(f"{c:.1f}" for c in costs)
            print(
                f"recorder calls per step ({what}): median {statistics.median(costs):.1f} us over {REPEATS} runs of 5000 steps (runs: {runs})"
            )
        log.close()
    scripted_run(True, CollectorRegistry())  # warm-up
    with_rec, without = [], []
    for _ in range(REPEATS):
        seconds, steps = scripted_run(False)
        without.append(seconds / steps * 1e6)
        seconds, steps = scripted_run(True, CollectorRegistry())
        with_rec.append(seconds / steps * 1e6)
    print(
        f"offline engine step (schedule + update_from_output), {steps} steps: median {statistics.median(without):.0f} us without "
        f"metrics, {statistics.median(with_rec):.0f} us with (difference {statistics.median(with_rec) - statistics.median(without):+.0f} us)"
    )
    if mode == "single process":
        sample_run()  # the production path: the default registry
        text = generate_latest(REGISTRY).decode()
        # the *_created gauges (metric creation times) are left out for brevity
        print("\n".join(line for line in text.splitlines() if "sloweave_" in line and "_created" not in line))


def sample_run() -> None:
    """A tight 5 ms target with aging on, so every metric moves: 80 decodes (decode-only is
    predicted at 5.65 ms, infeasible), then long prompts that only aging lets in."""
    scheduler = build_scheduler(
        SLOWeaveScheduler,
        max_num_batched_tokens=8192,
        additional_config={"sloweave": {"tpot_ms": 5, "aging_ms": 100, "aging_chunk_tokens": 128}},
    )
    # measured step time: the model's prediction plus 5 % (a model that underestimates a little)
    eng = OfflineEngine(scheduler, step_ms=lambda d, p: 1.05 * COST(d, p))
    for _ in range(80):
        eng.add(make_request(50, 120))  # all 80 prompts fit the first step (no deadline yet)
    for _ in range(3):
        eng.step()
    for prompt in (6000, 3000, 1500):
        eng.add(make_request(prompt, 20))
    eng.run()


if __name__ == "__main__":
    main()
