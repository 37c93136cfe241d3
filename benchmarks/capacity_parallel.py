"""Wall time of one capacity study, serial against the local process pool, in one run.

The same study (mixed workload, 3 seeds, SLOWeave and SLOWeave-multi against the tuned
fixed chunk and vLLM's rule, two TPOT targets) runs serially and with ``--jobs`` workers,
interleaved, ``--repeats`` times; prints the medians, their ratio and the machine's load,
and checks that both give the same capacities bit for bit.

    python benchmarks/capacity_parallel.py [--jobs N] [--repeats 3] [--requests 600]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import pandas as pd

from sloweave.sim.workloads import WORKLOADS
from sloweave.studies.capacity import CapacityStudy, SpecSource, capacity_frame, default_jobs


def one(jobs: int, requests: int) -> tuple[float, pd.DataFrame, int]:
    source = SpecSource(WORKLOADS["mixed"], requests, (0, 1, 2))
    study = CapacityStudy(source, ["sloweave", "sloweave-multi", "fixed-tuned", "sarathi-tuned"], [10.0, 25.0], 2000.0,
                          steps_per_doubling=8, jobs=jobs)
    started = time.perf_counter()
    frame = capacity_frame(study.capacities())
    return time.perf_counter() - started, frame, study.simulations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=default_jobs())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=600)
    args = parser.parse_args()
    times: dict[int, list[float]] = {1: [], args.jobs: []}
    frames, loads = {}, []
    for _ in range(args.repeats):
        for jobs in (1, args.jobs):
            seconds, frames[jobs], sims = one(jobs, args.requests)
            times[jobs].append(seconds)
            loads.append(os.getloadavg()[0])
            print(f"jobs {jobs}: {seconds:.1f} s ({sims} simulations)", flush=True)
    pd.testing.assert_frame_equal(frames[1], frames[args.jobs], check_exact=True)
    serial, pooled = statistics.median(times[1]), statistics.median(times[args.jobs])
    print(f"median serial {serial:.1f} s, {args.jobs} workers {pooled:.1f} s: speed-up {serial / pooled:.2f}x "
          f"on {os.cpu_count()} cores; results identical; 1-min load during the runs {min(loads):.1f}-{max(loads):.1f}")


if __name__ == "__main__":
    main()
