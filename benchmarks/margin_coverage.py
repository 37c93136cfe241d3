"""Coverage of the adaptive margin, relative against per-step, replayed on measured step times.

Each step (decodes, chunk, KV context, predicted base time, measured time) goes through both
margin forms of the core's online correction (``sloweave.core.costs.calibrated.self_correcting``)
as a body runs it: the margin is read before the step (at the step's corrected prediction),
then the step is observed. Per predicted-time bucket of the corrected prediction (the per-step
margin's own buckets, ``sloweave.core.costs.step_margin``) and step kind, it reports the steps,
the coverage (the share with measured <= corrected prediction + margin) and the mean margin.
The first ``--warmup-steps`` are learnt from but not counted. Both forms see the same steps, so
their corrected predictions are the same; only the margins differ.

Input (``--input``):

- a step-time profile (CSV/JSON, e.g. the real CPU engine's
  ``benchmarks/results-vllm-cpu/at-load/profile.csv``: repeated measurements of grid points):
  the prediction is the cost fitted to it (``fit_profile_file``, ``--cost-kind``), and
  ``--steps`` rows are drawn with replacement in a seeded random order (a profile has too few
  rows to measure a P99.7 per bucket; the draws reuse its measurements);
- a served plug-in step log (``.jsonl``, ``sloweave.core.step_log``): its steps in the order
  they ran, the prediction the logged ``base_predicted_ms`` (steps without one are skipped).

    .venv/bin/python benchmarks/margin_coverage.py            # the CPU profile, 30,000 draws
    .venv/bin/python benchmarks/margin_coverage.py --input run.jsonl --out /tmp/cov

Writes ``coverage.csv`` and ``summary.json`` (strict JSON: settings, the table, totals) under ``--out``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.costs.calibrated import DEFAULT_MARGIN_QUANTILE, MARGIN_FORMS, self_correcting
from sloweave.core.costs.fitted import ContextualCost
from sloweave.core.costs.step_residuals import PREDICTED_MS_EDGES, STEP_KINDS, predicted_bucket
from sloweave.studies.outputs import write_result_json

REPO = Path(__file__).resolve().parent.parent
DEFAULT_INPUT = REPO / "benchmarks/results-vllm-cpu/at-load/profile.csv"
DEFAULT_OUT = REPO / "benchmarks/results-vllm-cpu/margin-coverage"
STEP_COLUMNS = ["n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens", "base_ms", "measured_ms"]


class LoggedCost(ContextualCost):
    """The base prediction a step log recorded for the step being replayed (``current``).

    Asked for the step's own chunk it answers the logged time; asked for its decode-only part
    (the corrected cost's floor for a step with a chunk) 0 ms, which the log does not hold."""

    def __init__(self) -> None:
        self.current = (0, 0.0)

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        chunk, base_ms = self.current
        return base_ms if chunk_tokens == chunk else 0.0


def profile_steps(path: Path, cost_kind: str, draws: int, seed: int) -> tuple[pd.DataFrame, ContextualCost, dict]:
    from sloweave.core.costs.profile_fit import fit_profile_file
    from sloweave.core.costs.step_profiles import read_profile

    fit = fit_profile_file(path)
    cost = fit.cost(cost_kind)
    frame = read_profile(path)
    rows = frame.iloc[np.random.default_rng(seed).integers(0, len(frame), draws)].reset_index(drop=True)
    steps = rows[STEP_COLUMNS[:4]].copy()
    steps["base_ms"] = cost.predict_frame(rows)
    steps["measured_ms"] = rows["step_ms"].to_numpy(dtype=float)
    return steps, cost, {"kind": "profile", "rows": len(frame), "cost_kind": cost_kind, "draws": draws}


def step_log_steps(path: Path) -> tuple[pd.DataFrame, ContextualCost, dict]:
    from sloweave.core.step_log import read_step_log

    log = read_step_log(path).steps
    logged = log[log["base_predicted_ms"].notna() & ((log["ran_decode_tokens"] + log["ran_prefill_tokens"]) > 0)]
    steps = pd.DataFrame(
        {
            "n_decodes": logged["ran_decode_tokens"].to_numpy(),
            "chunk_tokens": logged["ran_prefill_tokens"].to_numpy(),
            "decode_kv_tokens": logged["decode_kv_tokens"].to_numpy(),
            "prefill_prefix_tokens": logged["prefill_prefix_tokens"].to_numpy(),
            "base_ms": logged["base_predicted_ms"].to_numpy(dtype=float),
            "measured_ms": logged["measured_ms"].to_numpy(dtype=float),
        }
    )
    return steps, LoggedCost(), {"kind": "step log", "rows": len(log), "replayed": len(steps)}


def check_steps(steps: pd.DataFrame) -> None:
    """Times finite and >= 0 ms, counts >= 0 (ValueError naming the first bad row otherwise)."""
    times = steps[["base_ms", "measured_ms"]].to_numpy(dtype=float)
    counts = steps[STEP_COLUMNS[:4]].to_numpy()
    bad = ~np.isfinite(times).all(axis=1) | (times < 0).any(axis=1) | (counts < 0).any(axis=1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(f"step {row}: times must be finite and >= 0 ms, counts >= 0, got {steps.iloc[row].to_dict()}")


def replay(steps: pd.DataFrame, base: ContextualCost, margin_form: str, quantile: float) -> pd.DataFrame:
    """Per step: the corrected prediction and the margin read before it, as a body decides."""
    correction = self_correcting(base, quantile=quantile, margin_form=margin_form)
    cost, margin, calibrator = correction.cost, correction.margin, correction.calibrator
    predicted, margins = np.empty(len(steps)), np.empty(len(steps))
    for i, (n, c, kv, prefix, base_ms, measured_ms) in enumerate(steps[STEP_COLUMNS].itertuples(index=False)):
        n, c = int(n), int(c)
        if isinstance(base, LoggedCost):
            base.current = (c, float(base_ms))
        cost.set_context(int(kv), int(prefix))
        margins[i], predicted[i] = margin(n, c), cost(n, c)
        calibrator.observe(n, c, float(base_ms), float(measured_ms))
    return pd.DataFrame({"predicted_ms": predicted, "margin_ms": margins})


def coverage_table(steps: pd.DataFrame, runs: dict[str, pd.DataFrame], warmup_steps: int) -> pd.DataFrame:
    """Per step kind and predicted-time bucket: steps, and per form coverage and mean margin."""
    predicted = runs[MARGIN_FORMS[0]]["predicted_ms"].to_numpy()
    frame = pd.DataFrame(
        {
            "kind": np.where(steps["chunk_tokens"].to_numpy() > 0, STEP_KINDS[1], STEP_KINDS[0]),
            "bucket": [predicted_bucket(p) for p in predicted],
        }
    )
    for form, run in runs.items():
        if not np.array_equal(run["predicted_ms"].to_numpy(), predicted):
            raise AssertionError("both forms must see the same corrected predictions")
        frame[f"covered_{form}"] = steps["measured_ms"].to_numpy() <= predicted + run["margin_ms"].to_numpy()
        frame[f"margin_ms_{form}"] = run["margin_ms"].to_numpy()
    counted = frame.iloc[warmup_steps:]
    rows = [_row(kind, bucket, group) for (kind, bucket), group in counted.groupby(["kind", "bucket"])]
    rows += [_row(kind, None, group) for kind, group in counted.groupby("kind")]
    rows.append(_row("all", None, counted))
    return pd.DataFrame(rows)


def _row(kind: str, bucket: int | None, group: pd.DataFrame) -> dict:
    low, high = (None, None) if bucket is None else (PREDICTED_MS_EDGES[bucket], _upper_edge(bucket))
    row = {"kind": kind, "predicted_from_ms": low, "predicted_to_ms": high, "steps": len(group)}
    for form in MARGIN_FORMS:
        row[f"coverage_{form}"] = float(group[f"covered_{form}"].mean())
        row[f"mean_margin_ms_{form}"] = float(group[f"margin_ms_{form}"].mean())
    return row


def _upper_edge(bucket: int) -> float:
    return PREDICTED_MS_EDGES[bucket + 1] if bucket + 1 < len(PREDICTED_MS_EDGES) else math.inf


def print_table(table: pd.DataFrame, quantile: float) -> None:
    print(f"target coverage {quantile / 100:.3f}; per form: coverage, mean margin")
    print(f"{'kind':12s} {'predicted ms':>12s} {'steps':>7s}  {'relative':>17s}  {'per-step':>17s}")
    for row in table.to_dict(orient="records"):
        low, high = row["predicted_from_ms"], row["predicted_to_ms"]
        where = "all" if low is None or pd.isna(low) else f"{low:.1f}-{high:.1f}"
        forms = "  ".join(f"{row[f'coverage_{f}']:7.4f} {row[f'mean_margin_ms_{f}']:6.2f} ms" for f in MARGIN_FORMS)
        print(f"{row['kind']:12s} {where:>12s} {row['steps']:7d}  {forms}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", type=Path, default=DEFAULT_INPUT, help="a step-time profile or a step log (.jsonl)")
    parser.add_argument("--steps", type=int, default=30_000, help="draws from a profile (a step log replays its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantile", type=float, default=DEFAULT_MARGIN_QUANTILE)
    parser.add_argument("--warmup-steps", type=int, default=1_000, help="learnt from, not counted")
    parser.add_argument("--cost-kind", choices=("regression", "table"), default="regression")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not 50.0 <= args.quantile < 100.0 or args.steps < 1 or args.warmup_steps < 0:
        parser.error("--quantile must be in [50, 100), --steps >= 1, --warmup-steps >= 0")
    if args.input.suffix == ".jsonl":
        steps, base, source = step_log_steps(args.input)
    else:
        steps, base, source = profile_steps(args.input, args.cost_kind, args.steps, args.seed)
    check_steps(steps)
    runs = {form: replay(steps, base, form, args.quantile) for form in MARGIN_FORMS}
    table = coverage_table(steps, runs, args.warmup_steps)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "coverage.csv", index=False)
    settings = {
        k: (str(v.relative_to(REPO)) if isinstance(v, Path) and v.is_relative_to(REPO) else v)
        for k, v in vars(args).items()
    }
    write_result_json(
        args.out / "summary.json",
        {
            "command": "benchmarks/margin_coverage.py",
            "settings": settings,
            "source": source,
            "table": table.to_dict(orient="records"),
        },
    )
    print_table(table, args.quantile)
    print(f"wrote {args.out}/coverage.csv, summary.json")


if __name__ == "__main__":
    main()
