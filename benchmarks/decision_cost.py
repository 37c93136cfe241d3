"""Cost of one SLOWeave decision (deadline update + chunk search), in microseconds.

For 16, 64 and 256 active requests: one request emits a token (heap update), then the
policy reads the budget and searches the chunk, with each cost model kind: the analytic
model, and the lookup table and regression fitted (``sloweave.core.costs.profile_fit``) from a profile of
that analytic model with KV-context terms, and the operator-profile models of the two A100
presets (``sloweave.core.costs.profile``; each decodes at a budget 50 ms above its
decode-only step, so the search runs). Baselines measured in the same run: the same
step with a linear scan over every chunk size (what the binary search replaces) and a
fixed-chunk decision (what engines do today). Prints medians and P99 over several
repetitions. What one vLLM ``schedule()`` costs for the same number of running requests is
measured by ``benchmarks/vllm_schedule_cost.py`` (in the vLLM environment).

``--before REV`` compares instead, between this tree and revision REV, the operator-profile
decisions and those of the regression fitted to vLLM's CPU build with online correction (each
margin form: the plug-in as the real-engine benchmark runs it), with the analytic and fixed-1024
ones as yardsticks: REV's ``src/`` is extracted with ``git archive`` and both trees are timed in
their own processes, interleaved (before, after, before, ...) so both see the same machine load;
medians of ``--runs`` runs, the load average, and whether the two trees took the same decisions
and counted the same queries past the profile. It also times, per margin form, a serving step of
the correction (one step observed, then one decision): its mean holds what the margin rebuilds
from the steps every few steps, which one decision's time does not.

    .venv/bin/python benchmarks/decision_cost.py [--before REV] [--runs 3]
"""

import argparse
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.deadlines import DeadlineTracker
from sloweave.core.policy import FixedChunk, SLOWeave
from sloweave.core.costs.profile import profile_cost

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simulator_speed import extract  # noqa: E402  (one way to take an older revision's src/)

DECISIONS = 2000
REPEATS = 5
REPO = Path(__file__).resolve().parent.parent
PRESETS = ("llama2-70b-tp2-a100", "llama3-8b-tp1-a100")
CPU_PROFILE = "benchmarks/results-vllm-cpu/at-load/profile.csv"  # vLLM's CPU build, as its benchmark fits it
ACTIVE = (16, 64, 256)


def linear_scan(cost, n, waiting, budget, max_chunk):
    best = 0
    for c in range(min(max_chunk, waiting) + 1):
        if cost(n, c) <= budget:
            best = c
    return best


def time_decisions(active: int, decide, tpot_ms: float = 25.0, decisions: list | None = None) -> np.ndarray:
    """Microseconds per decision; each decision appended to ``decisions`` when given."""
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
        decision = decide(active, 3000, budget)
        samples[k] = (clock() - start) / 1000.0
        if decisions is not None:
            decisions.append(tuple(decision))
    return samples


def time_steps(active: int, correction, fitted, tpot_ms: float, decisions: list) -> np.ndarray:
    """Microseconds per serving step of the plug-in's correction: one step observed (its base
    prediction and a seeded measured time), then one decision. Unlike ``time_decisions`` this
    includes what the margin rebuilds from the steps it has seen, every few steps: its mean is
    the figure (the median misses the rebuilds)."""
    rng = np.random.default_rng(active)
    decide = SLOWeave(cost=correction.cost, margin=correction.margin).decide
    samples = np.empty(DECISIONS)
    clock = time.perf_counter_ns
    for k in range(DECISIONS):
        chunk = int(rng.choice([0, rng.integers(1, 2048)]))
        measured_ms = float(rng.uniform(0.9, 1.4))
        start = clock()
        predicted_ms = fitted.predict(active, chunk, active * 1025, 0)
        correction.calibrator.observe(active, chunk, predicted_ms, predicted_ms * measured_ms + 0.3)
        decisions.append(tuple(decide(active, 3000, tpot_ms)))
        samples[k] = (clock() - start) / 1000.0
    return samples


def fitted_costs():
    """Table and regression fitted from a synthetic profile: analytic cost + KV-context read."""
    import pandas as pd  # only here: ``--before`` imports this file against another revision's src

    from sloweave.core.costs.profile_fit import fit_profile

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


def corrected_costs() -> dict:
    """The plug-in as the CPU engine's benchmark runs it: the regression fitted to that engine's
    profile, with online correction, per margin form, after 600 seeded steps (margin past its warm-up)."""
    from sloweave.core.costs.calibrated import MARGIN_FORMS, self_correcting
    from sloweave.core.costs.resolve import resolve_cost

    fitted = resolve_cost(str(REPO / CPU_PROFILE), cost_kind="regression").model
    rng = np.random.default_rng(0)
    corrections = {}
    for form in MARGIN_FORMS:
        correction = self_correcting(fitted, margin_form=form)
        for _ in range(600):
            n, c = int(rng.integers(1, 64)), int(rng.choice([0, rng.integers(1, 2048)]))
            predicted_ms = fitted.predict(n, c, n * 1025, 0)
            correction.calibrator.observe(n, c, predicted_ms, predicted_ms * float(rng.uniform(0.9, 1.4)) + 0.3)
        corrections[form] = correction
    return fitted, corrections


def profile_decisions() -> dict:
    """Median / P99 microseconds of the profile-model decisions (and the analytic and
    fixed-1024 yardsticks) at each size, and a digest of every decision taken and query counted."""
    warnings.simplefilter("ignore")  # the counted extrapolations warn; the digest holds their counts
    kinds = {
        "sloweave, analytic": (SLOWeave(cost=AnalyticCost()).decide, None),
        "fixed-1024": (FixedChunk(1024).decide, None),
    }
    for preset in PRESETS:
        cost = profile_cost(preset)
        kinds[f"sloweave, {preset}"] = (SLOWeave(cost=cost).decide, cost)
    fitted, corrections = corrected_costs()
    for form, correction in corrections.items():
        kinds[f"sloweave, CPU fit, corrected, {form}"] = (
            SLOWeave(cost=correction.cost, margin=correction.margin).decide,
            correction.cost,
        )
    digest, timings = hashlib.sha256(), {}
    for active in ACTIVE:
        for name, (decide, cost) in kinds.items():
            tpot = 25.0
            if cost is not None:
                cost.set_context(decode_kv_tokens=active * 1025, prefill_prefix_tokens=0)
                tpot = cost(active, 0) + 50.0
            decisions = []
            reps = [time_decisions(active, decide, tpot, decisions) for _ in range(REPEATS)]
            digest.update(repr(decisions).encode())
            timings[f"{active} {name}"] = summary(reps)
        for form, correction in corrections.items():
            decisions = []
            tpot = correction.cost(active, 0) + 50.0
            reps = [time_steps(active, correction, fitted, tpot, decisions) for _ in range(REPEATS)]
            digest.update(repr(decisions).encode())
            timings[f"{active} step: observe + decide, {form}"] = summary(reps)
    for name, (_, cost) in kinds.items():
        if hasattr(cost, "out_of_range"):
            digest.update(repr(sorted(cost.out_of_range.items())).encode())
    return {"timings": timings, "digest": digest.hexdigest()}


def summary(reps: list[np.ndarray]) -> tuple[float, float, float]:
    """Median, P99 and mean microseconds, each the median over the repetitions."""
    return tuple(
        statistics.median(float(f(r)) for r in reps) for f in (np.median, lambda r: np.percentile(r, 99), np.mean)
    )


def time_tree(src: Path) -> dict:
    """``profile_decisions`` in a fresh interpreter on the sloweave in ``src``."""
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run(
        [sys.executable, __file__, "--profile-json"], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def compare(before_rev: str, runs: int) -> None:
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": extract(before_rev, Path(tmp)), "after": REPO / "src"}
        results = {tree: [] for tree in trees}
        for _ in range(runs):
            for tree, src in trees.items():
                results[tree].append(time_tree(src))
    digests = {r["digest"] for rs in results.values() for r in rs}
    print(
        f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; {runs} runs each, interleaved"
    )
    print(f"same decisions and out-of-range counts in both trees: {'yes' if len(digests) == 1 else 'NO'}")
    print(
        f"{'active':>6} {'decision':<38} {'before_us':>10} {'after_us':>9} {'before_p99':>10} {'after_p99':>9}"
        f" {'speed-up':>9} {'before_mean':>11} {'after_mean':>10} {'mean speed-up':>13}"
    )
    for key in results["after"][0]["timings"]:
        (b, bp, bm), (a, ap, am) = (
            [statistics.median(r["timings"][key][i] for r in results[tree]) for i in (0, 1, 2)] for tree in trees
        )
        active, name = key.split(" ", 1)
        print(
            f"{active:>6} {name:<38} {b:>10.2f} {a:>9.2f} {bp:>10.2f} {ap:>9.2f} {b / a:>8.2f}x"
            f" {bm:>11.2f} {am:>10.2f} {bm / am:>12.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="git revision to compare the profile-model decisions with")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile-json", action="store_true", help=argparse.SUPPRESS)  # one tree's timings
    args = parser.parse_args()
    if args.profile_json:
        print(json.dumps(profile_decisions()))
    elif args.before:
        compare(args.before, args.runs)
    else:
        table()


def table() -> None:
    analytic = AnalyticCost()
    costs = {"analytic": analytic, **fitted_costs()}
    kinds = {f"sloweave, {name}": SLOWeave(cost=cost).decide for name, cost in costs.items()}
    kinds["linear scan, analytic"] = lambda n, w, b: linear_scan(analytic, n, w, b, 4096)
    kinds["fixed-1024"] = FixedChunk(1024).decide
    profiles = {f"sloweave, {p}": profile_cost(p) for p in PRESETS}
    kinds.update({name: SLOWeave(cost=cost).decide for name, cost in profiles.items()})
    base = "sloweave, analytic"
    print(f"{'active':>6} {'decision':<32} {'median_us':>10} {'p99_us':>9} {'vs analytic':>12}")
    for active in ACTIVE:
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
