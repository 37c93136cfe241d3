"""What a step size the engine has not run before costs: served step logs, by how often the size was run.

Each step of an engine's step log (``step_log``: every step vLLM ran, in order, the engine's
whole life) is priced by one cost (``--cost``: any ``--cost`` spec, for example a regression
fitted from a fixed budget's served log), and its residual (measured - priced) is grouped by
how many steps of the same size (decode + prefill tokens) the engine had run before it: the
first, the second, the third, the fourth or later. A size-specific warm-up (kernels or
primitives made per shape) shows as a residual that falls with the occurrence; a budget chosen
anew every step runs many sizes once.

    .venv/bin/python benchmarks/step_size_warmup.py --cost SERVED.jsonl --out results/warmup \\
        plugin-engine.jsonl tuned-engine.jsonl

Writes ``warmup.csv`` (a row per log and occurrence) and ``summary.json`` (strict JSON: the
settings, version and the table) under ``--out``, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.costs.resolve import resolve_cost
from sloweave.core.step_log import read_step_log
from sloweave.studies.outputs import write_result_json

OCCURRENCES = ("1st", "2nd", "3rd", "4th+")


def occurrence(sizes: np.ndarray) -> np.ndarray:
    """Per step, how many earlier steps had its size (0 for the first), capped at 3 ("4th+")."""
    seen: dict[int, int] = {}
    counts = np.empty(sizes.size, dtype=np.int64)
    for i, size in enumerate(sizes.tolist()):
        counts[i] = seen.get(size, 0)
        seen[size] = counts[i] + 1
    return np.minimum(counts, len(OCCURRENCES) - 1)


def warmup_table(log_path: Path, cost) -> pd.DataFrame:
    """One row per occurrence: steps, distinct sizes, the residual's median and mean, their sum."""
    steps = read_step_log(log_path).steps
    decodes, prefill = steps["ran_decode_tokens"].to_numpy(), steps["ran_prefill_tokens"].to_numpy()
    kv, prefix = steps["decode_kv_tokens"].to_numpy(), steps["prefill_prefix_tokens"].to_numpy()
    priced = np.array([cost.predict(*map(int, row)) for row in zip(decodes, prefill, kv, prefix)])
    residual = steps["measured_ms"].to_numpy() - priced
    which = occurrence(decodes + prefill)
    rows = []
    for k, name in enumerate(OCCURRENCES):
        picked = residual[which == k]
        rows.append(
            {
                "log": log_path.name,
                "occurrence": name,
                "steps": int(picked.size),
                "distinct_sizes": int(np.unique((decodes + prefill)[which == 0]).size) if k == 0 else None,
                "median_residual_ms": float(np.median(picked)) if picked.size else None,
                "mean_residual_ms": float(picked.mean()) if picked.size else None,
                "sum_residual_s": float(picked.sum() / 1e3),
                "all_steps_s": float(steps["measured_ms"].sum() / 1e3),
            }
        )
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="step logs (an engine's whole log)")
    parser.add_argument("--cost", required=True, help="the cost every step is priced by (a --cost spec)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cost = resolve_cost(args.cost).model
    if not hasattr(cost, "predict"):
        parser.error(f"--cost {args.cost}: needs a cost that reads the KV context (a profile or step log fit)")
    table = pd.concat([warmup_table(path, cost) for path in args.logs], ignore_index=True)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "warmup.csv", index=False)
    settings = {"logs": [str(p) for p in args.logs], "cost": args.cost}
    table_records = json.loads(table.to_json(orient="records"))
    write_result_json(
        args.out / "summary.json", {"settings": settings, "load_1min": os.getloadavg()[0], "table": table_records}
    )
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
