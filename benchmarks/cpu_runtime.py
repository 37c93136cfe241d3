"""Measured comparison on the real CPU runtime: SLOWeave vs fixed chunks vs full prefill.

Every policy serves the same scaled workload through the same engine (transformers
continuous batching, the ``small`` random Llama, one torch thread); per seed, goodput is
also reported relative to the best fixed chunk measured in that same seed's runs, and the
table prints medians over seeds. A second part shows online recalibration against a
deliberately stale cost model (the profile's cost x ``--stale-factor``).

    python benchmarks/cpu_runtime.py --profile results/cpu/profile-small.csv --out results/cpu

Writes ``runs.csv`` (one row per policy and seed), ``medians.csv`` and ``medians.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from sloweave.core.costs.profile_fit import fit_profile_file
from sloweave.studies.outputs import write_result_json
from sloweave.runtime.engine import TransformersEngine, blocks_needed
from sloweave.runtime.experiment import add_ratios, measure_policy, scaled_workload
from sloweave.runtime.model import load_model

COLUMNS = [
    "measured_goodput_rps",
    "goodput_vs_best_fixed",
    "measured_attainment",
    "measured_p99_tpot_ms",
    "measured_p99_ttft_ms",
    "measured_num_finished",
    "overran_prediction_plus_margin_share",
    "p99_overrun_ms",
    "deadline_missed_share",
    "mean_chunk_tokens",
    "simulated_goodput_rps",
    "simulated_p99_tpot_ms",
    "simulated_p99_ttft_ms",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--model", default="small")
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--rate-scale", type=float, default=0.25)
    parser.add_argument("--prompt-scale", type=float, default=0.25)
    parser.add_argument("--output-scale", type=float, default=0.1)
    parser.add_argument("--max-prompt", type=int, default=1536)
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--tpot-ms", type=float, default=100.0)
    parser.add_argument("--ttft-ms", type=float, default=2000.0)
    parser.add_argument("--fixed", default="32,64,128,256,512")
    parser.add_argument("--max-chunk", type=int, default=1024)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument(
        "--stale-factor", type=float, default=0.5, help="drift part: cost model scaled by this (0 = skip)"
    )
    parser.add_argument("--out", type=Path, default=Path("results/cpu"))
    args = parser.parse_args()

    fit = fit_profile_file(args.profile)
    model = load_model(args.model)
    seeds = [int(s) for s in args.seeds.split(",")]
    # (policy name, margin, calibrate, stale factor)
    variants = [(f"fixed-{c}", True, False, 1.0) for c in args.fixed.split(",")]
    variants += [
        ("full", True, False, 1.0),
        ("sloweave", True, True, 1.0),
        ("sloweave", False, True, 1.0),
        ("sloweave", True, False, 1.0),
    ]
    if args.stale_factor:
        # Drift: a cost model that predicts stale_factor x the real time; first without the
        # margin, so that only online recalibration stands between it and the deadlines.
        variants += [
            ("sloweave", False, False, args.stale_factor),
            ("sloweave", False, True, args.stale_factor),
            ("sloweave", True, True, args.stale_factor),
        ]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    started = time.time()
    for seed in seeds:
        wl = scaled_workload(
            args.workload,
            args.requests,
            seed,
            args.rate_scale,
            args.prompt_scale,
            args.output_scale,
            args.max_prompt,
            args.max_output,
        )
        engine = TransformersEngine(
            model,
            max_batch_tokens=int(wl.prompt_tokens.max()) + 128,
            num_blocks=blocks_needed(int((wl.prompt_tokens + wl.output_tokens).sum()), len(wl)),
        )
        seed_rows = []
        for name, margin, calibrate, stale in variants:
            row, _ = measure_policy(
                engine,
                wl,
                name,
                fit,
                args.tpot_ms,
                args.ttft_ms,
                use_margin=margin,
                calibrate=calibrate,
                max_chunk_tokens=args.max_chunk,
                stale_factor=stale,
                seed=seed,
            )
            row["seed"] = seed
            seed_rows.append(row)
            print(
                f"seed {seed} {row['policy']:>30s}: goodput {row['measured_goodput_rps']:.3f} req/s "
                f"P99 TPOT {row['measured_p99_tpot_ms']:.0f} ms P99 TTFT {row['measured_p99_ttft_ms']:.0f} ms "
                f"attain {row['measured_attainment']:.2f} overran {row['overran_prediction_plus_margin_share']:.1%} "
                f"[{time.time() - started:.0f} s]",
                flush=True,
            )
        rows.append(add_ratios(pd.DataFrame(seed_rows)))
    runs = pd.concat(rows, ignore_index=True)
    runs.to_csv(args.out / "runs.csv", index=False)
    medians = runs.groupby("policy", sort=False)[COLUMNS].median()
    medians.to_csv(args.out / "medians.csv")
    (args.out / "medians.md").write_text(markdown_table(medians))
    write_result_json(
        args.out / "config.json",
        {
            "settings": {
                k: v if isinstance(v, (int, float, bool)) or v is None else str(v) for k, v in vars(args).items()
            }
        },
    )
    print(f"\nmedians over seeds {seeds} (TPOT target {args.tpot_ms} ms, TTFT target {args.ttft_ms} ms):")
    print(medians.round(3).to_string())


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub table of the medians (no tabulate dependency)."""
    header = ["policy", *frame.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for policy, row in frame.iterrows():
        lines.append("| " + " | ".join([str(policy), *(f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}" for v in row)]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
