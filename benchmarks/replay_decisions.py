"""What the plug-in would have decided on a served step log: its measured times replayed, open loop.

Each step of a step log (``step_log`` of the vLLM plug-in) is replayed in order: the plug-in's
decision (built from ``--config``, by default the real-engine benchmark's: the profile's
regression, online correction, the relative margin) is asked for the step's decodes, prompt
tokens on offer and time budget, then its calibrator is fed the step's measured time against its
own base prediction, as the plug-in feeds it. The steps are the logged ones (what the engine
ran), so this says what the rule would allow under that run's real noise, not what the run
would then have become. Printed and written (``--out``, strict JSON): the share of steps with
decodes and prompts waiting that got no chunk, that were infeasible (even decode-only predicted
to miss), and the mean chunk.

    .venv/bin/python benchmarks/replay_decisions.py STEP_LOG.jsonl [--out replay.json]

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


def replay(log_path: Path, config: dict, max_chunk_tokens: int) -> dict:
    from sloweave.core.step_log import read_step_log
    from sloweave.vllm_plugin.config import PluginConfig

    plugin = PluginConfig.from_sources({"sloweave": config})
    parts = plugin.build_decision()
    if parts.correction is None:
        raise SystemExit("--config: the replay feeds online correction; set online_correction: true")
    cost, calibrator = parts.cost, parts.correction.calibrator
    policy = plugin.deadline_policy(parts, max_chunk_tokens)
    chunks, infeasible = [], 0
    for n, c, kv, prefix, measured_ms, decodes, pending, budget_ms in (
        read_step_log(log_path).steps[list(COLUMNS)].to_numpy()
    ):
        n, c, kv, prefix, decodes, pending = (int(x) for x in (n, c, kv, prefix, decodes, pending))
        if decodes and pending and math.isfinite(budget_ms):
            cost.set_context(kv, prefix)
            decision = policy.decide(decodes, pending, float(budget_ms))
            chunks.append(decision.chunk_tokens)
            infeasible += decision.infeasible
        calibrator.observe(n, c, cost.base.predict(n, c, kv, prefix), float(measured_ms))
    chunks = np.array(chunks)
    return {"steps_decided": int(chunks.size), "no_chunk_share": float(np.mean(chunks == 0)),
            "infeasible_share": infeasible / max(chunks.size, 1), "mean_chunk_tokens": float(chunks.mean())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step_log", type=Path)
    parser.add_argument("--config", type=json.loads, default=DEFAULT_CONFIG, help="the plug-in's configuration (JSON)")
    parser.add_argument("--max-chunk-tokens", type=int, default=2048, help="vLLM's --max-num-batched-tokens")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import sloweave
    from sloweave.studies.outputs import write_result_json

    result = replay(args.step_log, args.config, args.max_chunk_tokens)
    print(json.dumps(result))
    if args.out is not None:
        digest = hashlib.sha256(args.step_log.read_bytes()).hexdigest()
        write_result_json(args.out, {"step_log": str(args.step_log), "step_log_sha256": digest, "config": args.config,
                                     "sloweave_imported_from": str(Path(sloweave.__file__).parent), **result})  # fmt: skip


if __name__ == "__main__":
    main()
