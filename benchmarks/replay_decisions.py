"""What the plug-in would have decided on a served step log: its measured times replayed, open loop.

Each step of a step log (``step_log`` of the vLLM plug-in) is replayed in order: the plug-in's
decision (built from ``--config``, by default the real-engine benchmark's: the profile's
regression, online correction, the relative margin) is asked for the step's decodes, prompt
tokens on offer and time budget, then its calibrator is fed the step's measured time against its
own base prediction, as the plug-in feeds it. The steps are the logged ones (what the engine
ran), so this says what the rule would allow under that run's real noise, not what the run
would then have become. Printed and written (``--out``, strict JSON): the share of steps with
decodes and prompts waiting that got no chunk, that were infeasible (even decode-only predicted
to miss), and the mean chunk; with ``--window-s``, the same per window of the log's clock (from its
first step), to follow a slow spell and what came after it.

    .venv/bin/python benchmarks/replay_decisions.py STEP_LOG.jsonl [--window-s 4] [--out replay.json]

An earlier tree is replayed the same way with its ``src/`` first on the path (``git archive REV
src | tar -x -C /tmp/rev``, then ``PYTHONPATH=/tmp/rev/src``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import numpy as np

PROFILE = Path(__file__).resolve().parent / "results-vllm-cpu" / "at-load" / "profile.csv"
DEFAULT_CONFIG = {"tpot_ms": 40.0, "cost": str(PROFILE), "online_correction": True}
COLUMNS = ("ran_decode_tokens", "ran_prefill_tokens", "decode_kv_tokens", "prefill_prefix_tokens", "measured_ms",
           "decode_tokens", "pending_prompt_tokens", "budget_ms")  # fmt: skip


def replay(log_path: Path, config: dict, max_chunk_tokens: int, window_s: float = 0.0) -> dict:
    """The shares over every decided step and, with ``window_s`` > 0, per window of the log's clock."""
    decided = decisions(log_path, config, max_chunk_tokens)
    result = shares(decided)
    if window_s > 0:
        window = (decided["since_first_step_s"] // window_s).astype(int)
        result["windows"] = [{"from_s": float(w * window_s), **shares(decided[window == w])} for w in np.unique(window)]
    return result


def shares(decided) -> dict:
    chunks = decided["chunk_tokens"].to_numpy()
    return {"steps_decided": int(chunks.size), "no_chunk_share": float(np.mean(chunks == 0)) if chunks.size else 0.0,
            "infeasible_share": float(decided["infeasible"].mean()) if chunks.size else 0.0,
            "mean_chunk_tokens": float(chunks.mean()) if chunks.size else 0.0}  # fmt: skip


def decisions(log_path: Path, config: dict, max_chunk_tokens: int):
    """Per step with decodes and prompts waiting: its time from the log's first step, and the chunk
    and infeasibility the configuration decides (a DataFrame)."""
    import pandas as pd
    from sloweave.core.step_log import read_step_log
    from sloweave.vllm_plugin.config import PluginConfig

    plugin = PluginConfig.from_sources({"sloweave": config})
    parts = plugin.build_decision()
    if parts.correction is None:
        raise SystemExit("--config: the replay feeds online correction; set online_correction: true")
    cost, calibrator = parts.cost, parts.correction.calibrator
    policy = plugin.deadline_policy(parts, max_chunk_tokens)
    steps = read_step_log(log_path).steps
    first_ms, rows = float(steps["start_ms"].iloc[0]) if len(steps) else 0.0, []
    for start_ms, n, c, kv, prefix, measured_ms, decodes, pending, budget_ms in steps[
        ["start_ms", *COLUMNS]
    ].to_numpy():
        n, c, kv, prefix, decodes, pending = (int(x) for x in (n, c, kv, prefix, decodes, pending))
        if decodes and pending and math.isfinite(budget_ms):
            cost.set_context(kv, prefix)
            decision = policy.decide(decodes, pending, float(budget_ms))
            rows.append(((start_ms - first_ms) / 1000.0, decision.chunk_tokens, decision.infeasible))
        calibrator.observe(n, c, cost.base.predict(n, c, kv, prefix), float(measured_ms))
    return pd.DataFrame(rows, columns=["since_first_step_s", "chunk_tokens", "infeasible"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_log", type=Path)
    parser.add_argument("--config", type=json.loads, default=DEFAULT_CONFIG, help="the plug-in's configuration (JSON)")
    parser.add_argument("--max-chunk-tokens", type=int, default=2048, help="vLLM's --max-num-batched-tokens")
    parser.add_argument("--window-s", type=float, default=0.0, help="also the shares per window of this many seconds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not args.window_s >= 0:
        parser.error(f"--window-s must be 0 (no windows) or more seconds, got {args.window_s}")
    from sloweave.studies.outputs import write_result_json

    result = replay(args.step_log, args.config, args.max_chunk_tokens, args.window_s)
    print(json.dumps({k: v for k, v in result.items() if k != "windows"}))
    for window in result.get("windows", []):
        print(json.dumps(window))
    if args.out is not None:
        digest = hashlib.sha256(args.step_log.read_bytes()).hexdigest()
        write_result_json(args.out, {"step_log": str(args.step_log), "step_log_sha256": digest, "config": args.config,
                                     "window_s": args.window_s, **result})  # fmt: skip


if __name__ == "__main__":
    main()
