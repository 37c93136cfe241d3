"""Cost of one SLOWeave decision (deadline update + chunk search), in microseconds.

For 16, 64 and 256 active requests: one request emits a token (heap update), then the
policy reads the budget and searches the chunk. Baselines measured in the same run:
the same step with a linear scan over every chunk size (what the binary search replaces)
and a fixed-chunk decision (what engines do today). Prints medians and P99 over
several repetitions.

    .venv/bin/python benchmarks/decision_cost.py
"""

import statistics
import time

import numpy as np

from sloweave.cost import AnalyticCost
from sloweave.deadlines import DeadlineTracker
from sloweave.policy import FixedChunk, SLOWeave

DECISIONS = 2000
REPEATS = 5


def linear_scan(cost, n, waiting, budget, max_chunk):
    best = 0
    for c in range(min(max_chunk, waiting) + 1):
        if cost(n, c) <= budget:
            best = c
    return best


def time_decisions(active: int, decide) -> np.ndarray:
    tracker = DeadlineTracker(25.0)
    for i in range(active):
        tracker.add(i, last_token_ms=float(i) * 0.01)
    samples = np.empty(DECISIONS)
    now = 0.0
    clock = time.perf_counter_ns
    for k in range(DECISIONS):
        now += 0.02
        start = clock()
        tracker.on_token(k % active, now)
        budget = tracker.budget_ms(now)
        decide(active, 3000, budget)
        samples[k] = (clock() - start) / 1000.0
    return samples


def main() -> None:
    cost = AnalyticCost()
    sloweave = SLOWeave(cost=cost)
    fixed = FixedChunk(1024)
    kinds = {
        "sloweave (binary search)": sloweave.decide,
        "linear scan baseline": lambda n, w, b: linear_scan(cost, n, w, b, 4096),
        "fixed-1024 baseline": fixed.decide,
    }
    print(f"{'active':>6} {'decision':<26} {'median_us':>10} {'p99_us':>9} {'vs sloweave':>12}")
    for active in (16, 64, 256):
        medians = {}
        for name, decide in kinds.items():
            reps = [time_decisions(active, decide) for _ in range(REPEATS if "linear" not in name else 1)]
            medians[name] = statistics.median(float(np.median(r)) for r in reps)
            p99 = statistics.median(float(np.percentile(r, 99)) for r in reps)
            ratio = medians[name] / medians["sloweave (binary search)"]
            print(f"{active:>6} {name:<26} {medians[name]:>10.2f} {p99:>9.2f} {ratio:>11.2f}x")


if __name__ == "__main__":
    main()
