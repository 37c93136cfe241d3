"""Simulator speed: simulated iterations per second, this tree against an earlier revision.

The simulator does O(1) Python work per iteration (counters, no per-request loop) and
recovers per-token times afterwards with numpy. Two baselines, measured in the same run:

- ``--before REV`` (default: the last revision before the simulator was split into parts):
  that revision's ``src/`` is extracted with ``git archive`` and timed in its own process on
  the same workloads, interleaved with this tree's runs (before, after, before, ...), so both
  see the same machine load;
- ``check_deadlines=True`` in this tree: the same simulation updating a per-request deadline
  heap for every running request every iteration (the O(|A|) bookkeeping the design avoids).

Medians of ``--runs`` runs; the load average during the run is printed with the table.

    .venv/bin/python benchmarks/simulator_speed.py [--before REV] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEFORE_SPLIT = "20bb60d"  # main before issue 11: simulate() was one 380-line loop
CASES = [(w, p) for w in ("mixed", "long") for p in ("sloweave", "fixed-256")]

# Runs in a fresh interpreter against whichever sloweave is first on sys.path.
TIMER = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore", DeprecationWarning)
try:
    from sloweave.sim.engine import simulate
    from sloweave.sim.workloads import WORKLOADS
    from sloweave.core.policy import make_policy
except ImportError:
    from sloweave.simulator import simulate
    from sloweave.workloads import WORKLOADS
    from sloweave.policy import make_policy
workload_name, policy_name, check = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
workload = WORKLOADS[workload_name].generate(2000, seed=0)
policy = make_policy(policy_name)
simulate(workload, policy, tpot_ms=25.0)  # warm-up
start = time.perf_counter()
result = simulate(workload, policy, tpot_ms=25.0, check_deadlines=check)
print(json.dumps({"seconds": time.perf_counter() - start, "iterations": result.num_iterations}))
"""


def extract(rev: str, into: Path) -> Path:
    archive = into / "src.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), rev, "src"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def time_once(src: Path, workload: str, policy: str, check: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run(
        [sys.executable, "-c", TIMER, workload, policy, "1" if check else "0"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--before", default=BEFORE_SPLIT, help="git revision to compare with (default: before the split)"
    )
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        before_src, after_src = extract(args.before, Path(tmp)), REPO / "src"
        print(
            f"{'workload':<8} {'policy':<10} {'iterations':>10} {'before it/s':>12} {'after it/s':>11} {'after/before':>12} {'tracker it/s':>12}"
        )
        for workload, policy in CASES:
            before, after, tracked = [], [], []
            for _ in range(args.runs):
                before.append(time_once(before_src, workload, policy))
                after.append(time_once(after_src, workload, policy))
                tracked.append(time_once(after_src, workload, policy, check=True))
            iterations = after[0]["iterations"]
            assert before[0]["iterations"] == iterations, "the two revisions simulated different runs"
            b, a, t = (statistics.median(r["seconds"] for r in runs) for runs in (before, after, tracked))
            print(
                f"{workload:<8} {policy:<10} {iterations:>10} {iterations / b:>12.0f} {iterations / a:>11.0f} {b / a:>11.2f}x {iterations / t:>12.0f}"
            )
    print(
        f"medians of {args.runs} runs each, interleaved; before = {args.before}; load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end"
    )


if __name__ == "__main__":
    main()
