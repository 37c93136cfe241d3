"""Find each workload's arrival rate at which Fixed-1024 attains the paper's figure at 25 ms.

This is how the rates in `sloweave.sim.workloads.WORKLOADS` were chosen (then rounded): only
the strongest static baseline is calibrated, never SLOWeave. Run from the repository root:

    .venv/bin/python scripts/calibrate_rates.py            # mixed 0.60, long 0.50, bursty 0.83
"""

import dataclasses

import numpy as np

from sloweave.sim.metrics import evaluate
from sloweave.core.policy import make_policy
from sloweave.sim.engine import simulate
from sloweave.sim.workloads import WORKLOADS

TARGETS = {"mixed": 0.60, "long": 0.50, "bursty": 0.83}  # SPEC.md, Fixed-1024 at 25 ms
SEEDS, REQUESTS, TPOT_MS = 5, 2000, 25.0


def attainment(spec, rate_rps: float, policy: str) -> float:
    spec = dataclasses.replace(spec, rate_rps=rate_rps)
    return float(
        np.mean(
            [
                evaluate(
                    simulate(spec.generate(REQUESTS, seed), make_policy(policy), TPOT_MS), spec.ttft_ms, TPOT_MS
                ).attainment
                for seed in range(SEEDS)
            ]
        )
    )


def main() -> None:
    for name, target in TARGETS.items():
        spec = WORKLOADS[name]
        low, high = 1.0, 200.0  # geometric bisection on the rate: attainment falls with load
        for _ in range(14):
            mid = (low * high) ** 0.5
            low, high = (mid, high) if attainment(spec, mid, "fixed-1024") > target else (low, mid)
        rate = (low * high) ** 0.5
        print(f"{name}: {rate:.1f} req/s gives Fixed-1024 {attainment(spec, rate, 'fixed-1024'):.3f} (target {target})")


if __name__ == "__main__":
    main()
