"""Cost of one SLOWeave decision (deadline update + chunk search), in microseconds.

For 16, 64 and 256 active requests: one request emits a token (heap update), then the
policy reads the budget and searches the chunk, with each cost model kind: the analytic
model, and the lookup table and regression fitted (``sloweave.core.costs.fitted``) from a profile of
that analytic model with KV-context terms, and the operator-profile models of the two A100
presets (``sloweave.core.costs.profile``; each decodes at a budget 50 ms above its
decode-only step, so the search runs). Baselines measured in the same run: the same
step with a linear scan over every chunk size (what the binary search replaces) and a
fixed-chunk decision (what engines do today). Prints medians and P99 over several
repetitions. What one vLLM ``schedule()`` costs for the same number of running requests is
measured by ``benchmarks/vllm_schedule_cost.py`` (in the vLLM environment).

    .venv/bin/python benchmarks/decision_cost.py
"""

import itertools
import statistics
import time

import numpy as np
import pandas as pd

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.deadlines import DeadlineTracker
from sloweave.core.costs.fitted import fit_profile
from sloweave.core.policy import FixedChunk, SLOWeave
from sloweave.core.costs.profile import profile_cost

DECISIONS = 2000
REPEATS = 5


def linear_scan(cost, n, waiting, budget, max_chunk):
    best = 0
    for c in range(min(max_chunk, waiting) + 1):
        if cost(n, c) <= budget:
            best = c
    return best


def time_decisions(active: int, decide, tpot_ms: float = 25.0) -> np.ndarray:
    tracker = DeadlineTracker(tpot_ms)
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


def fitted_costs():
    """Table and regression fitted from a synthetic profile: analytic cost + KV-context read."""
    analytic = AnalyticCost()
    rows = []
    for n, c, context in itertools.product(
        [1, 4, 16, 64, 128, 256, 512], [0, 64, 256, 1024, 2048, 4096], [128, 1024, 4096]
    ):
        if n == c == 0:
            continue
        kv = n * (context + 1)
        rows.append(
            {
                "n_decodes": n,
                "chunk_tokens": c,
                "decode_kv_tokens": kv,
                "prefill_prefix_tokens": 0,
                "step_ms": analytic(n, c) + 2e-5 * kv,
                "context_tokens": context,
                "split": "fit",
            }
        )
    for n, c in ((8, 500), (100, 3000)):  # a few off-grid steps to score the fit on
        rows.append(
            {
                "n_decodes": n,
                "chunk_tokens": c,
                "decode_kv_tokens": n * 2000,
                "prefill_prefix_tokens": 0,
                "step_ms": analytic(n, c) + 2e-5 * n * 2000,
                "context_tokens": 2000,
                "split": "holdout",
            }
        )
    fitted = fit_profile(pd.DataFrame(rows))
    costs = {}
    for kind in ("table", "regression"):
        cost = fitted.cost(kind)
        cost.set_context(decode_kv_tokens=64 * 1025, prefill_prefix_tokens=0)
        costs[kind] = cost
    return costs


def main() -> None:
    analytic = AnalyticCost()
    costs = {"analytic": analytic, **fitted_costs()}
    kinds = {f"sloweave, {name}": SLOWeave(cost=cost).decide for name, cost in costs.items()}
    kinds["linear scan, analytic"] = lambda n, w, b: linear_scan(analytic, n, w, b, 4096)
    kinds["fixed-1024"] = FixedChunk(1024).decide
    profiles = {f"sloweave, {p}": profile_cost(p) for p in ("llama2-70b-tp2-a100", "llama3-8b-tp1-a100")}
    kinds.update({name: SLOWeave(cost=cost).decide for name, cost in profiles.items()})
    base = "sloweave, analytic"
    print(f"{'active':>6} {'decision':<32} {'median_us':>10} {'p99_us':>9} {'vs analytic':>12}")
    for active in (16, 64, 256):
        medians = {}
        for name, decide in kinds.items():
            tpot = 25.0
            if name in profiles:
                cost = profiles[name]
                cost.set_context(decode_kv_tokens=active * 1025, prefill_prefix_tokens=0)
                tpot = cost(active, 0) + 50.0
            reps = [time_decisions(active, decide, tpot) for _ in range(REPEATS if "linear" not in name else 1)]
            medians[name] = statistics.median(float(np.median(r)) for r in reps)
            p99 = statistics.median(float(np.percentile(r, 99)) for r in reps)
            ratio = medians[name] / medians[base]
            print(f"{active:>6} {name:<32} {medians[name]:>10.2f} {p99:>9.2f} {ratio:>11.2f}x", flush=True)


if __name__ == "__main__":
    main()
