"""What limited a served run's chunks, from its step log (the plug-in's ``step_log``).

For each log: the chunks the engine ran, how many steps left prompt tokens waiting, and for
those the budget, the prediction with its margin, the margin itself and the measured time; a
step counts as deadline-bound when prediction + margin came within a quarter of its budget. The
seconds of the log's clock (from its first step) in which most steps with decodes ran no chunk
while prompts waited say how long prefill was starved (after a slow spell, for example), and the
steps *parked* below a small chunk with a queue waiting and the deadline far off say how often
something other than the queue or the deadline held the chunk back (a margin that stood far above
the steps it guards: the per-step margin's stretch after a warm-up, for example).
A least-squares fit of the measured step time (fixed + per decode + per prefill token) says
what the run's steps cost. Printed, and written as strict JSON with ``--out``::

    .venv/bin/python benchmarks/step_log_summary.py results/twin/step-logs/sloweave-load1-seed0.jsonl \\
        results/twin/step-logs/vllm-tuned-768-load1-seed0.jsonl --out results/twin/step-log-summary.json
"""

from __future__ import annotations

import argparse
import json
from importlib import metadata
from pathlib import Path

import numpy as np

from sloweave.core.step_log import read_step_log

DEADLINE_BOUND_SHARE = 0.25  # prediction + margin within this share of the budget
STARVED_SHARE = 0.5  # a second is starved when more than this share of its decoding steps ran no chunk, prompts waiting
# A step is parked when it ran decodes and a chunk under PARKED_CHUNK_TOKENS (or none) while at least
# QUEUED_TOKENS prompt tokens waited and its prediction with margin left more than PARKED_SLACK_SHARE of its
# budget unspent: neither the queue nor the deadline held the chunk back (a margin did, or the chunk's rate).
QUEUED_TOKENS = 1024
PARKED_CHUNK_TOKENS = 256
PARKED_SLACK_SHARE = 0.3


def percentiles(values, points=(10, 50, 90)) -> list[float] | None:
    return [round(float(v), 2) for v in np.percentile(values, points)] if len(values) else None


def share(mask) -> float | None:
    return round(float(mask.mean()), 4) if len(mask) else None


def starved_seconds(steps) -> list[int]:
    """The seconds of the log's clock in which most steps with decodes ran no chunk while prompts waited."""
    decoding = steps[steps["ran_decode_tokens"] > 0]
    second = ((decoding["start_ms"] - steps["start_ms"].min()) // 1000).astype(int)
    starved = (decoding["ran_prefill_tokens"] == 0) & (decoding["pending_prompt_tokens"] > 0)
    shares = starved.groupby(second).mean()
    return shares.index[shares > STARVED_SHARE].tolist()


def parked(steps) -> tuple[int, int, float | None]:
    """(steps with decodes and a queue, those of them parked, the P99 margin of the queued steps in ms)."""
    queued = steps[(steps["ran_decode_tokens"] > 0) & (steps["pending_prompt_tokens"] >= QUEUED_TOKENS)]
    queued = queued[queued["budget_ms"].notna()]
    slack_ms = queued["budget_ms"] - queued["predicted_ms"]
    held = (queued["ran_prefill_tokens"] < PARKED_CHUNK_TOKENS) & (slack_ms > PARKED_SLACK_SHARE * queued["budget_ms"])
    margin = percentiles(queued["margin_ms"], (99,))
    return len(queued), int(held.sum()), margin[0] if margin else None


def longest_run(seconds: list[int]) -> int:
    """The most consecutive seconds in ``seconds`` (sorted)."""
    longest = run = 0
    for i, second in enumerate(seconds):
        run = run + 1 if i and second == seconds[i - 1] + 1 else 1
        longest = max(longest, run)
    return longest


def summarise(path: Path) -> dict:
    steps = read_step_log(path).steps
    steps = steps[steps["measured_ms"].notna()]
    chunks = steps["ran_prefill_tokens"]
    with_chunk = steps[chunks > 0]
    cut = with_chunk[with_chunk["ran_prefill_tokens"] < with_chunk["pending_prompt_tokens"]]
    cut = cut[cut["budget_ms"].notna()]
    design = np.column_stack([np.ones(len(steps)), steps["ran_decode_tokens"], chunks])
    coef, *_ = np.linalg.lstsq(design, steps["measured_ms"].to_numpy(), rcond=None)
    slack_ms = cut["budget_ms"] - cut["predicted_ms"]
    return {
        "log": str(path),
        "steps": len(steps),
        "prefill_tokens": int(chunks.sum()),
        "step_time_s": round(float(steps["measured_ms"].sum()) / 1e3, 3),
        "steps_with_chunk": len(with_chunk),
        "chunk_tokens_p10_p50_p90": percentiles(with_chunk["ran_prefill_tokens"]),
        "decodes_in_chunk_steps_p10_p50_p90": percentiles(with_chunk["ran_decode_tokens"]),
        "decode_only_steps_with_prompts_waiting": int(((chunks == 0) & (steps["pending_prompt_tokens"] > 0)).sum()),
        "chunk_steps_leaving_prompts_waiting": len(cut),
        "their_chunk_tokens_p10_p50_p90": percentiles(cut["ran_prefill_tokens"]),
        "their_budget_ms_p50": percentiles(cut["budget_ms"], (50,)),
        "their_predicted_with_margin_ms_p50": percentiles(cut["predicted_ms"], (50,)),
        "their_margin_ms_p50_p90": percentiles(cut["margin_ms"], (50, 90)),
        "their_measured_ms_p50_p99": percentiles(cut["measured_ms"], (50, 99)),
        "their_share_over_budget": share(cut["measured_ms"] > cut["budget_ms"]),
        "their_share_deadline_bound": share(slack_ms < DEADLINE_BOUND_SHARE * cut["budget_ms"]),
        "fit_fixed_ms": round(float(coef[0]), 3),
        "fit_us_per_decode": round(float(coef[1]) * 1e3, 2),
        "fit_ms_per_1k_prefill_tokens": round(float(coef[2]) * 1e3, 3),
        "starved_seconds": len(starved := starved_seconds(steps)),
        "longest_starved_run_s": longest_run(starved),
        **dict(zip(("queued_steps", "parked_steps", "queued_margin_ms_p99"), parked(steps))),
        "aged_steps": int(steps["aged"].sum()),
        "infeasible_steps": int(steps["infeasible"].sum()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="step logs (.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="write the summaries here as JSON")
    args = parser.parse_args(argv)
    summaries = [summarise(path) for path in args.logs]
    for summary in summaries:
        print("\n".join(f"{key}: {value}" for key, value in summary.items()), end="\n\n")
    if args.out is not None:
        record = {"sloweave_version": metadata.version("sloweave"), "command": "benchmarks/step_log_summary.py"}
        args.out.write_text(json.dumps(record | {"logs": summaries}, indent=2, allow_nan=False) + "\n")


if __name__ == "__main__":
    main()
