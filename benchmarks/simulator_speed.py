"""Simulator speed: simulated iterations per second of wall time.

The simulator does O(1) Python work per iteration (counters, no per-request loop) and
recovers per-token times afterwards with numpy. Baseline measured in the same run: the
same simulation with `check_deadlines=True`, which also updates a per-request deadline
heap for every running request every iteration (the O(|A|) bookkeeping the design
avoids). Median of several runs.

    .venv/bin/python benchmarks/simulator_speed.py
"""

import statistics
import time

from sloweave.metrics import per_request_frame
from sloweave.policy import make_policy
from sloweave.simulator import simulate
from sloweave.workloads import WORKLOADS

RUNS = 5


def main() -> None:
    print(f"{'workload':<8} {'policy':<10} {'iterations':>10} {'fast_s':>8} {'per_req_s':>9} {'speedup':>8} {'iter/s':>10} {'metrics_s':>9}")
    for workload_name in ("mixed", "long"):
        workload = WORKLOADS[workload_name].generate(2000, seed=0)
        for policy_name in ("sloweave", "fixed-256"):
            policy = make_policy(policy_name)
            fast, slow, metrics = [], [], []
            for _ in range(RUNS):
                start = time.perf_counter()
                result = simulate(workload, policy, tpot_ms=25.0)
                fast.append(time.perf_counter() - start)
                start = time.perf_counter()
                per_request_frame(result)
                metrics.append(time.perf_counter() - start)
                start = time.perf_counter()
                simulate(workload, policy, tpot_ms=25.0, check_deadlines=True)
                slow.append(time.perf_counter() - start)
            f, s = statistics.median(fast), statistics.median(slow)
            print(
                f"{workload_name:<8} {policy_name:<10} {result.num_iterations:>10} {f:>8.3f} {s:>9.3f} {s / f:>7.1f}x "
                f"{result.num_iterations / f:>10.0f} {statistics.median(metrics):>9.3f}"
            )


if __name__ == "__main__":
    main()
