"""What the plug-in adds to a vLLM step: `Scheduler.schedule()` cost on CPU.

For 16, 64 and 256 running (decoding) requests plus one long waiting prompt, times one
`schedule()` call of vLLM's own `Scheduler` (fixed budget, the baseline measured in the
same run) and of `SLOWeaveScheduler` (same work plus the SLOWeave decision), each
followed by its `update_from_output()`, which is not timed. Medians and P99 in microseconds.

    .venv-vllm/bin/python benchmarks/vllm_schedule_cost.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from vllm.v1.core.sched.scheduler import Scheduler

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.vllm_plugin import SLOWeaveScheduler
from sloweave.vllm_plugin.offline import OfflineEngine, build_scheduler, make_request

STEPS = 300
REPEATS = 3


def time_schedule(cls, running: int) -> np.ndarray:
    cost = AnalyticCost()
    eng = OfflineEngine(
        build_scheduler(
            cls, max_num_batched_tokens=8192, max_num_seqs=512, additional_config={"sloweave": {"tpot_ms": 50.0}}
        ),
        step_ms=lambda d, p: cost(d, p),
    )
    for _ in range(running):
        eng.add(make_request(16, 10_000))
    while any(r.num_output_tokens == 0 for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.add(make_request(16_000, 2))  # a long prompt keeps a chunk in every step
    scheduler = eng.scheduler
    samples = np.empty(STEPS)
    original = scheduler.schedule
    for k in range(STEPS):

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            out = original(*args, **kwargs)
            samples[k] = (time.perf_counter_ns() - start) / 1000.0
            return out

        scheduler.schedule = timed
        eng.step()
    scheduler.schedule = original
    return samples


def main() -> None:
    print(f"{'running':>7} {'scheduler':<20} {'median_us':>10} {'p99_us':>9} {'vs vLLM':>8}")
    for running in (16, 64, 256):
        medians = {}
        for name, cls in (("vllm Scheduler", Scheduler), ("SLOWeaveScheduler", SLOWeaveScheduler)):
            reps = [time_schedule(cls, running) for _ in range(REPEATS)]
            medians[name] = statistics.median(float(np.median(r)) for r in reps)
            p99 = statistics.median(float(np.percentile(r, 99)) for r in reps)
            print(
                f"{running:>7} {name:<20} {medians[name]:>10.1f} {p99:>9.1f} {medians[name] / medians['vllm Scheduler']:>7.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
