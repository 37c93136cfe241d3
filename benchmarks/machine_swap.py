"""Was a gap between two engines in a real pass their policies', or the machine's while each ran?

A real pass serves the engines one after the other, so each meets the machine at another time: on
a shared machine one engine's runs can fall in a slow minute and lose what its rule did not lose.
The twin takes each run's machine from that run's own step log (its fitted cost, noise, pace and,
for the plug-in, the warm start), so it can swap them: the plug-in's policy on the machine a fixed
budget's run met, and that budget's policy on the plug-in's. For each load and seed, four twins
(policy of P or X on the machine of P's run or X's) split the twin's gap between the two into

- the **policy effect**: P's policy against X's on the same machine, averaged over both machines;
- the **machine effect**: P's machine against X's under the same policy, averaged over both policies;

which add up to the twin's own gap exactly (P on P's machine - X on X's). A gap the machine
explains is no finding about the policies, whichever way it goes.

Reads a finished ``twin_fidelity.py`` folder (its ``runs.csv``, step logs and settings), pairs the
plug-in with every other engine served (``--engines``: some of them), and writes into ``--out``
(default ``<twin-out>/machine-swap``): ``swap.csv`` (one row per pair, load and seed), ``summary.json``
(per pair: mean real and twin gaps, mean effects, the cells the machine explains) and ``swap.png``.

    .venv/bin/python benchmarks/machine_swap.py --twin-out results/twin_fidelity    # seconds per run
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

import twin_fidelity as tf

SETTINGS = ("workload", "requests", "seeds", "loads", "rate_rps", "tuned_budgets", "profile_file",
            "twin_max_fit_error", "twin_step_time", "static_twin_cost", "plugin_twin_cost", "noise_block_steps",
            "warm_steps", "noise_pace_ms", "noise_draws", "tpot_ms", "ttft_ms", "prompt_scale", "max_prompt",
            "output_scale", "max_output", "dtype")  # fmt: skip
# A twin gap smaller than this is no gap to explain (a run of 1,000 requests moves by 0.001 a request).
MIN_GAP = 0.05


def twin_args(twin_out: Path, noise_draws: int | None) -> argparse.Namespace:
    """The twin run's own settings, as its summary recorded them (``noise_draws`` replacing its draws)."""
    settings = tf.recorded_settings(twin_out)
    known = [name for name in SETTINGS if name in settings]  # a folder from before a setting existed: its default
    if noise_draws is not None:
        settings = settings | {"noise_draws": noise_draws}
    return tf.args_of_settings(twin_out, settings, known)


class Twins:
    """The median attainment over the draws of one engine's policy on one run's machine, each simulated once:
    the plug-in's own twin is every pair's corner at its load and seed."""

    def __init__(self, args, costs: tf.Costs) -> None:
        self.args, self.costs = args, costs
        self._found: dict[tuple, float] = {}

    def attainment(self, policy_row: dict, machine_row: dict) -> float:
        key = (policy_row["engine"], machine_row["engine"], policy_row["load"], policy_row["seed"])
        if key not in self._found:
            args = self.args
            workload = tf.bench.workload_for(args, policy_row["seed"], policy_row["rate_rps"])
            draws = tf.twin_draws(policy_row, dict(machine_row), args, self.costs, args.log_dir, workload)
            self._found[key] = float(np.median([draw["attainment"] for draw in draws]))
        return self._found[key]


def swap_cell(p: dict, x: dict, twins: Twins) -> dict:
    """The four twins of one load and seed, the plug-in ``p`` against engine ``x``, and the split of their gap."""
    pp, xx = twins.attainment(p, p), twins.attainment(x, x)
    px, xp = twins.attainment(p, x), twins.attainment(x, p)
    policy = ((pp - xp) + (px - xx)) / 2
    machine = ((pp - px) + (xp - xx)) / 2
    twin_gap = pp - xx  # = policy + machine
    if abs(twin_gap) < MIN_GAP:
        explained_by = "no gap"
    else:
        explained_by = "machine" if abs(machine) > abs(policy) else "policy"
    return {"engine": x["engine"], "load": p["load"], "seed": p["seed"], "rate_rps": p["rate_rps"],
            "real_plugin": p["real_attainment"], "real_other": x["real_attainment"],
            "real_gap": p["real_attainment"] - x["real_attainment"], "twin_gap": twin_gap,
            "plugin_on_own_machine": pp, "plugin_on_other_machine": px,
            "other_on_own_machine": xx, "other_on_plugin_machine": xp,
            "policy_effect": policy, "machine_effect": machine, "explained_by": explained_by}  # fmt: skip


def swap_table(runs: pd.DataFrame, args, costs: tf.Costs, engines: list[str] | None) -> pd.DataFrame:
    """Every load and seed with a real run of the plug-in and of each other engine (``engines``: those only)."""
    runs = runs.dropna(subset=["real_attainment"])
    if "error" in runs:  # a run that failed has no machine to swap
        runs = runs[runs["error"].isna() | (runs["error"].astype(str) == "")]
    by_run = {(r["engine"], r["load"], r["seed"]): r for r in runs.to_dict("records")}
    others = [e for e in dict.fromkeys(runs["engine"]) if e != tf.PLUGIN_ENGINE and (not engines or e in engines)]
    if engines and set(engines) - set(others):
        raise SystemExit(f"--engines: no runs of {', '.join(sorted(set(engines) - set(others)))} in the twin folder")
    rows, twins = [], Twins(args, costs)
    for (engine, load, seed), p in by_run.items():
        if engine != tf.PLUGIN_ENGINE:
            continue
        for other in others:
            if (other, load, seed) in by_run:
                rows.append(swap_cell(p, by_run[(other, load, seed)], twins))
                print(_shown(rows[-1]), flush=True)
    if not rows:
        raise SystemExit("no load and seed has a real run of the plug-in and of another engine")
    return pd.DataFrame(rows)


def _shown(row: dict) -> str:
    return (
        f"plug-in vs {row['engine']} load {row['load']:g} seed {row['seed']}: real gap {row['real_gap']:+.3f}, "
        f"twin gap {row['twin_gap']:+.3f} = policy {row['policy_effect']:+.3f} + machine {row['machine_effect']:+.3f}"
    )


def pair_summary(table: pd.DataFrame) -> list[dict]:
    """Per engine set against the plug-in: mean gaps and effects, and how many cells each explains."""
    out = []
    for engine, group in table.groupby("engine", sort=False):
        counts = group["explained_by"].value_counts()
        out.append({"engine": engine, "cells": len(group),
                    "mean_real_gap": group["real_gap"].mean(), "mean_twin_gap": group["twin_gap"].mean(),
                    "mean_policy_effect": group["policy_effect"].mean(),
                    "mean_machine_effect": group["machine_effect"].mean(),
                    **{f"explained_by_{k.replace(' ', '_')}": int(counts.get(k, 0)) for k in ("policy", "machine", "no gap")}})  # fmt: skip
    return out


def plot(table: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(dict.fromkeys(table["engine"]))
    fig, axes = plt.subplots(len(engines), 1, figsize=(9, 2.6 * len(engines)), squeeze=False)
    for ax, engine in zip(axes[:, 0], engines):
        group = table[table["engine"] == engine]
        x = np.arange(len(group))
        ax.bar(x - 0.2, group["policy_effect"], 0.2, label="policy effect")
        ax.bar(x, group["machine_effect"], 0.2, label="machine effect")
        ax.bar(x + 0.2, group["real_gap"], 0.2, label="real gap", color="0.6")
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(x, [f"{load:g}x s{seed}" for load, seed in zip(group["load"], group["seed"])], fontsize=8)
        ax.set_ylabel("attainment")
        ax.set_title(f"plug-in minus {engine}", fontsize=9)
    axes[0, 0].legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from sloweave.core.validate import OptionError

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--twin-out", type=Path, required=True, help="a finished twin_fidelity.py --out folder")
    parser.add_argument("--out", type=Path, default=None, help="default: <twin-out>/machine-swap")
    parser.add_argument("--engines", default=None, help="comma-separated engines to set against the plug-in")
    parser.add_argument("--noise-draws", type=int, default=None, help="default: the twin folder's")
    parser.add_argument("--force", action="store_true", help="replace an earlier --out")
    given = parser.parse_args(argv)
    if given.noise_draws is not None and given.noise_draws < 1:
        parser.error(f"--noise-draws must be 1 or more, got {given.noise_draws}")
    if not (given.twin_out / "summary.json").is_file() or not (given.twin_out / "runs.csv").is_file():
        parser.error(
            f"--twin-out {given.twin_out}: not a finished twin_fidelity.py folder (no summary.json or runs.csv)"
        )
    args = twin_args(given.twin_out, given.noise_draws)
    costs = tf.Costs(args.profile_file, args.twin_max_fit_error)
    engines = given.engines.split(",") if given.engines else None
    out = given.out or given.twin_out / "machine-swap"
    try:
        summary = write_swap(out, given, args, costs, engines)
    except OptionError as err:  # an earlier result there, a folder that cannot be written: one line, no traceback
        parser.error(str(err))
    pd.set_option("display.width", 200)
    print(pd.DataFrame(summary).round(3).to_string(index=False))


def write_swap(out: Path, given: argparse.Namespace, args, costs: tf.Costs, engines: list[str] | None) -> list[dict]:
    """The swap of every cell, into ``out`` (complete or absent); returns the per-pair summary."""
    from sloweave.studies.outputs import write_result_json
    from sloweave.studies.result_folders import result_folder

    with result_folder(out, force=given.force, inputs={"--twin-out": given.twin_out}) as folder:
        table = swap_table(pd.read_csv(args.out / "runs.csv"), args, costs, engines)
        table.to_csv(folder.path / "swap.csv", index=False)
        plot(table, folder.path / "swap.png")
        summary = pair_summary(table)
        write_result_json(folder.path / "summary.json", {
            "settings": {"twin_out": str(given.twin_out), "engines": engines, "noise_draws": args.noise_draws,
                         "min_gap": MIN_GAP},
            "twin_settings": tf.recorded_settings(given.twin_out),
            "split": "policy = ((P|P - X|P) + (P|X - X|X)) / 2, machine = ((P|P - P|X) + (X|P - X|X)) / 2 "
                     "(policy|machine, twin median attainment); policy + machine = P|P - X|X, the twin's gap",
            "pairs": summary,
        })  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
