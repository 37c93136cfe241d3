"""Wall time of one capacity study serial, on the local process pool and on a local Ray
instance, in one run; and how its work splits into tasks.

The same study (mixed workload, 3 seeds, SLOWeave and SLOWeave-multi against the tuned
fixed chunk and vLLM's rule, two TPOT targets) runs serially, with ``--jobs`` forked
workers and as Ray tasks on a private Ray instance with ``--jobs`` CPUs on loopback,
interleaved, ``--repeats`` times. Prints the medians, their ratios against serial and the
machine's load, checks that all three give the same capacities bit for bit, and reports
what a cluster would be sent: the number of tasks per phase, their times, and the bytes of
the context shipped to every worker and of the results shipped back. Ray's start-up (once
per study when ``--ray local`` is given on the command line) is timed apart.

    python benchmarks/capacity_parallel.py [--jobs N] [--repeats 3] [--requests 600] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import pandas as pd

from sloweave.sim.workloads import WORKLOADS
import sloweave.studies.search as search_module
from sloweave.studies import parallel
from sloweave.studies.capacity import capacity_frame
from sloweave.studies.search import CapacityStudy, SearchLattice
from sloweave.studies.sources import SpecSource
from sloweave.studies.outputs import write_result_json

POLICIES = ["sloweave", "sloweave-multi", "fixed-tuned", "sarathi-tuned"]


def study_of(requests: int, jobs: int, ray: str | None) -> CapacityStudy:
    source = SpecSource(WORKLOADS["mixed"], requests, (0, 1, 2))
    return CapacityStudy(
        source, POLICIES, [10.0, 25.0], 2000.0, SearchLattice(steps_per_doubling=8), runner=parallel.Runner(jobs, ray)
    )


def one(requests: int, jobs: int, ray: str | None) -> tuple[float, pd.DataFrame, int]:
    study = study_of(requests, jobs, ray)
    started = time.perf_counter()
    frame = capacity_frame(study.capacities())
    return time.perf_counter() - started, frame, study.simulations


def task_split(requests: int) -> list[dict]:
    """Every batch of tasks the study hands the runner (serially, timed per task), with the
    bytes a cluster would ship: the context once per worker, each task's result back."""
    import pickle

    batches = []
    real = search_module.run_tasks

    def recording(fn, tasks, context=None, runner=parallel.SERIAL, desc="tasks", progress=False, store=None):
        if not tasks:
            return []
        shipped = len(pickle.dumps(context))
        times, sizes, results = [], [], []
        for task in tasks:
            started = time.perf_counter()
            result = fn(context, *task)
            times.append(time.perf_counter() - started)
            sizes.append(len(pickle.dumps(result)))
            results.append(result)
        batches.append(
            {
                "phase": desc,
                "tasks": len(tasks),
                "context_bytes": shipped,
                "task_s_min": min(times),
                "task_s_median": statistics.median(times),
                "task_s_max": max(times),
                "result_bytes_median": statistics.median(sizes),
            }
        )
        return results

    # the study calls its module's run_tasks: record through it for one serial study
    search_module.run_tasks = recording
    try:
        study_of(requests, 1, None).capacities()
    finally:
        search_module.run_tasks = real
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=parallel.local_cores())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results-parallel"))
    args = parser.parse_args()
    import ray

    modes = {"serial": (1, None), f"pool x{args.jobs}": (args.jobs, None), f"ray x{args.jobs}": (args.jobs, "auto")}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    ray_start_s, frames, loads = [], {}, []
    for _ in range(args.repeats):
        for mode, (jobs, address) in modes.items():
            if address is not None:  # a private instance, as `--ray local` starts one
                started = time.perf_counter()
                ray.init(num_cpus=args.jobs, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
                ray_start_s.append(time.perf_counter() - started)
            try:
                seconds, frames[mode], sims = one(args.requests, jobs, address)
            finally:
                if address is not None:
                    ray.shutdown()
            times[mode].append(seconds)
            loads.append(os.getloadavg()[0])
            print(f"{mode}: {seconds:.1f} s ({sims} simulations)", flush=True)
    for mode in modes:
        pd.testing.assert_frame_equal(frames["serial"], frames[mode], check_exact=True)
    serial = statistics.median(times["serial"])
    rows = [
        {"mode": m, "median_s": statistics.median(t), "runs_s": t, "vs_serial": serial / statistics.median(t)}
        for m, t in times.items()
    ]
    for row in rows:
        print(f"{row['mode']:>10}: median {row['median_s']:.1f} s, {row['vs_serial']:.2f}x serial")
    print(
        f"Ray start-up {statistics.median(ray_start_s):.1f} s (median; not in the times above); results identical; "
        f"{os.cpu_count()} cores, 1-min load during the runs {min(loads):.1f}-{max(loads):.1f}"
    )
    split = task_split(args.requests)
    print(pd.DataFrame(split).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "capacity_parallel.csv", index=False)
    write_result_json(
        args.out / "capacity_parallel.json",
        {
            "command": "benchmarks/capacity_parallel.py",
            "settings": {**vars(args), "out": str(args.out), "policies": POLICIES},
            "cores": os.cpu_count(),
            "load_1min": [min(loads), max(loads)],
            "ray_start_s": ray_start_s,
            "modes": rows,
            "task_split": split,
        },
    )
    print(f"wrote {args.out}/capacity_parallel.csv, capacity_parallel.json")


if __name__ == "__main__":
    main()
