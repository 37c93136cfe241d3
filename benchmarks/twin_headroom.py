"""What a budget chosen per phase could gain on vLLM's CPU engine, by its twin.

The simulator is fed the real-engine benchmark's profile (``vllm_cpu_bench.py``'s step 1): its
fitted regression is the machine, and its residuals against that fit the machine's noise (by step
size, ``EngineOptions.step_noise_from``). For each TPOT target and each workload (``drift`` and
its three phases served alone: ``chat``, ``long``, ``bursty``, each at drift's load scale), the
capacity of vLLM's rule at every candidate ``--max-num-batched-tokens`` and of the plug-in (its
default options, deciding with the same fit, online correction) is searched per seed.

The headroom: in each phase, the best budget for that phase against the budget that is best for
``drift`` as a whole. A rule that picks the right budget for every phase gains at most the largest
of these in any phase; where they are near 1 no budget rule, SLOWeave's included, can gain much
on this engine, whatever it does per step.

    .venv/bin/python benchmarks/twin_headroom.py --out results/twin_headroom \\
        --profile benchmarks/results-vllm-cpu/tight-epyc/prefix/profile-prefixes.csv

Writes ``capacity.csv`` (per target, workload and engine: median, min and max over seeds),
``headroom.csv``, ``headroom.png`` and ``summary.json`` (strict JSON: settings, version) under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_cpu_bench as bench  # noqa: E402  (the benchmark's workloads and plug-in options)

PHASES = ("chat", "long", "bursty")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/twin_headroom"))
    parser.add_argument("--profile", type=Path, required=True, help="a profile vllm_cpu_bench.py wrote")
    parser.add_argument("--tpot-ms", default="60,40,30", help="comma-separated TPOT targets")
    parser.add_argument("--ttft-ms", type=float, default=1500.0)
    parser.add_argument("--rate-rps", type=float, default=45.254833995939045, help="drift's load point (scale 1)")
    parser.add_argument("--budgets", default="256,512,768,1024,1536,2048")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--target", type=float, default=0.9, help="attainment a capacity keeps")
    args = parser.parse_args(argv)
    if not args.profile.is_file():
        parser.error(f"--profile {args.profile}: no such file")
    try:
        args.tpot_list = [float(t) for t in args.tpot_ms.split(",")]
        args.budget_list = [int(b) for b in args.budgets.split(",")]
        args.seed_list = [int(s) for s in args.seeds.split(",")]
    except ValueError as err:
        parser.error(f"--tpot-ms, --budgets and --seeds are comma-separated numbers: {err}")
    return args


def capacity(args, workload: str, tpot_ms: float, budget: int | None, machine) -> tuple[list[float], str]:
    """Per seed, the capacity (req/s) of vLLM's rule at ``budget`` (None: the plug-in) on the twin,
    and the search's censoring flags (``above-max``: at least that; ``below-min``: 0, fails at the lowest)."""
    from sloweave.sim.options import EngineOptions
    from sloweave.sim.workloads import get_workload_spec
    from sloweave.studies.search import CapacityStudy
    from sloweave.studies.search_records import SearchLattice
    from sloweave.studies.sources import ScaledWorkloads

    # each phase alone at drift's load scale: its own family's rate times drift's scale
    rate = args.rate_rps * get_workload_spec(workload).rate_rps / get_workload_spec("drift").rate_rps
    served = argparse.Namespace(**{**vars(bench.parse_args([])), "workload": workload})
    base = tuple(bench.workload_for(served, seed, rate) for seed in args.seed_list)
    source = ScaledWorkloads(workload, base, (rate,) * len(base), tuple(map(str, args.seed_list)))
    plugin = bench.default_plugin_config(tpot_ms, args.profile)
    policy = "sloweave-multi" if budget is None else f"sarathi-{budget}"
    options = EngineOptions(
        max_batch_size=bench.VLLM_CPU_DEFAULT_SEQS,
        correction=budget is None,
        step_noise_from=str(args.profile),
        **(bench.plugin_sim_options(plugin) if budget is None else {}),
    )
    lattice = SearchLattice(attainment_target=args.target, steps_per_doubling=16, min_scale=0.125, max_scale=4.0)
    max_chunk = bench.VLLM_CPU_DEFAULT_BUDGET if budget is None else budget
    # the study builds the policy on ``machine``: the plug-in decides with the fit it is timed by
    study = CapacityStudy(source, [policy], (tpot_ms,), args.ttft_ms, lattice, machine, max_chunk, options)
    (found,) = study.capacities()
    return [seed.rps for seed in found.seeds], found.row()["censored"]


def headroom(capacities: pd.DataFrame) -> pd.DataFrame:
    """Per target and workload: the best budget, drift's best budget, and what each gives there."""
    rows = []
    for tpot_ms, at_target in capacities.groupby("tpot_ms"):
        budgets = at_target[at_target.engine != "sloweave"]
        drift = budgets[budgets.workload == "drift"]
        drift_best = int(drift.loc[drift.capacity_rps.idxmax(), "budget"])
        for workload, rows_of in at_target.groupby("workload", sort=False):
            fixed = rows_of[rows_of.engine != "sloweave"].set_index("budget").capacity_rps
            plugin = float(rows_of[rows_of.engine == "sloweave"].capacity_rps.iloc[0])
            best = int(fixed.idxmax())  # the smallest of tied budgets (all at the ceiling: the phase never binds)
            censored = ";".join(
                sorted({flag for flags in rows_of.censored.fillna("") for flag in flags.split(";") if flag})
            )
            rows.append({"tpot_ms": tpot_ms, "workload": workload, "best_budget": best, "best_rps": fixed[best],
                         "drift_best_budget": drift_best, "drift_best_rps": fixed[drift_best],
                         "headroom": fixed[best] / fixed[drift_best], "plugin_rps": plugin,
                         "plugin_vs_drift_best": plugin / fixed[drift_best], "censored": censored})  # fmt: skip
    return pd.DataFrame(rows)


def plot(capacities: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = sorted(capacities.tpot_ms.unique(), reverse=True)
    fig, axes = plt.subplots(1, len(targets), figsize=(4.5 * len(targets), 3.6), squeeze=False)
    for ax, tpot_ms in zip(axes[0], targets):
        for workload, rows in capacities[capacities.tpot_ms == tpot_ms].groupby("workload", sort=False):
            fixed = rows[rows.engine != "sloweave"]
            line = ax.plot(fixed.budget, fixed.capacity_rps, marker="o", label=workload)[0]
            plugin = rows[rows.engine == "sloweave"].capacity_rps.iloc[0]
            ax.axhline(plugin, color=line.get_color(), linestyle=":", linewidth=1)
        ax.set(title=f"TPOT {tpot_ms:g} ms (dotted: the plug-in)", xlabel="--max-num-batched-tokens",
               ylabel="twin capacity (req/s)", xscale="log")  # fmt: skip
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    from sloweave.core.costs.resolve import resolve_cost
    from sloweave.studies.outputs import check_writable, write_result_json

    check_writable(args.out, "--out")
    started = time.time()
    machine = resolve_cost(str(args.profile)).model
    rows = []
    for tpot_ms in args.tpot_list:
        for workload in ("drift", *PHASES):
            for budget in [*args.budget_list, None]:
                rps, censored = capacity(args, workload, tpot_ms, budget, machine)
                rows.append({"tpot_ms": tpot_ms, "workload": workload, "engine": "sloweave" if budget is None else f"vllm-{budget}",
                             "budget": budget or 0, "capacity_rps": float(np.median(rps)), "capacity_rps_min": min(rps),
                             "capacity_rps_max": max(rps), "per_seed": ";".join(f"{r:.2f}" for r in rps), "censored": censored})  # fmt: skip
                print(f"TPOT {tpot_ms:g} ms {workload} {rows[-1]['engine']}: {rows[-1]['per_seed']} req/s", flush=True)
    capacities = pd.DataFrame(rows)
    table = headroom(capacities)
    args.out.mkdir(parents=True, exist_ok=True)
    capacities.to_csv(args.out / "capacity.csv", index=False)
    table.to_csv(args.out / "headroom.csv", index=False)
    plot(capacities, args.out / "headroom.png")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    write_result_json(args.out / "summary.json", {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "capacity": "median over seeds of the per-seed capacity (lattice 16 steps per doubling, 4.4 %, 0.125-4x the "
        "load point); censored: above-max (every load tried attained: at least that), below-min (0: fails at the lowest)",
        "headroom": table.to_dict("records"), "wall_s": time.time() - started,
    })  # fmt: skip


if __name__ == "__main__":
    main()
