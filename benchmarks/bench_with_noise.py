"""Simulate a finished ``vllm_cpu_bench.py`` run again with the machine's measured noise.

The bench's simulated columns are noiseless: on the EPYC at the tight target they put P99 TPOT
at half the measured one (docs/vllm-plugin.md, "The twin at the tight target"). This takes the
bench's own settings and runs (``summary.json``, ``runs.csv``) and a step log of another served
run (``--noise-from``: a plug-in ``step_log``, or one that ``twin_fidelity.py`` kept), and
predicts every run again as the bench's ``--noise-from`` would have:

    .venv-vllm-cpu/bin/python benchmarks/bench_with_noise.py --bench-out benchmarks/results-vllm-cpu/tight-epyc/run2 \\
        --noise-from served.jsonl --out results/run2_with_noise.csv

Writes one row per run (real, noiseless and noisy attainment and P99 TPOT) and prints the
medians per engine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

import vllm_cpu_bench as bench

SETTINGS = ("workload", "requests", "tpot_ms", "ttft_ms", "prompt_scale", "max_prompt", "output_scale",
            "max_output", "dtype", "profile_file")  # fmt: skip


def bench_args(summary: dict, noise_from: Path, bench_out: Path) -> argparse.Namespace:
    """The bench's settings as it ran; its profile is the one it was given, or the one it took."""
    args = bench.parse_args(["--noise-from", str(noise_from), *bench.settings_argv(summary["settings"], SETTINGS)])
    args.profile_file = args.profile_file or bench_out / "profile.csv"
    return args


def engine_of(name: str, summary: dict) -> tuple[int, dict | None]:
    """(vLLM's budget, the plug-in's configuration or None) of an engine the bench named."""
    variants = summary.get("plugin_variants") or {}
    if name in variants:
        return bench.VLLM_CPU_DEFAULT_BUDGET, variants[name]
    prefix, _, budget = name.rpartition("-")
    if prefix not in ("vllm-tuned", "vllm-default") or not budget.isdigit():
        raise ValueError(f"engine {name!r} is neither a plug-in variant of this run nor vllm-tuned-N / vllm-default-N")
    return int(budget), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench-out", type=Path, required=True, help="a finished vllm_cpu_bench.py --out folder")
    parser.add_argument("--noise-from", type=Path, required=True, help="a step log of another served run")
    parser.add_argument("--out", type=Path, required=True, help="the CSV to write")
    cli = parser.parse_args()
    from sloweave.core.costs.resolve import resolve_cost

    summary = json.loads((cli.bench_out / "summary.json").read_text())
    args = bench_args(summary, cli.noise_from, cli.bench_out)
    resolved = resolve_cost(str(args.profile_file))
    rows = []
    for run in pd.read_csv(cli.bench_out / "runs.csv").to_dict("records"):
        budget, config = engine_of(run["engine"], summary)
        workload = bench.workload_for(args, run["seed"], summary["rate_rps"])
        noisy = bench.predicted(args, workload, budget, config, resolved, run["seed"])
        rows.append({"pass": run.get("pass", 0), "engine": run["engine"], "seed": run["seed"],
                     "real_attainment": run["attainment"], "noiseless_attainment": run["simulated_attainment"],
                     "noisy_attainment": noisy["attainment"], "real_p99_tpot_ms": run["p99_tpot_ms"],
                     "noiseless_p99_tpot_ms": run["simulated_p99_tpot_ms"], "noisy_p99_tpot_ms": noisy["p99_tpot_ms"]})  # fmt: skip
    table = pd.DataFrame(rows)
    cli.out.parent.mkdir(parents=True, exist_ok=True)
    table.assign(noise_from=str(cli.noise_from), bench_out=str(cli.bench_out)).to_csv(cli.out, index=False)
    print(table.groupby("engine").median(numeric_only=True).drop(columns=["pass", "seed"]).round(3).to_string())


if __name__ == "__main__":
    main()
