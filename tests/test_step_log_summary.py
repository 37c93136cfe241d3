"""benchmarks/step_log_summary.py: what limited a served run's chunks, from its step log. No real
engine runs here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sloweave.core.step_log import FORMAT, STEP_FIELDS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import step_log_summary  # noqa: E402


def test_the_seconds_a_run_starved_its_prompts_are_counted(tmp_path):
    """Steps every 10 ms for 10 s, prompts always waiting: with a chunk, but without one in seconds
    3-5 and 8 (a margin holding chunks back), and in second 7 without one only every third step."""
    lines = [{"kind": "header", "format": FORMAT}]
    for i in range(1000):
        second = i // 100
        starved = second in (3, 4, 5, 8) or (second == 7 and i % 3 == 0)
        values = dict.fromkeys(STEP_FIELDS, 0)
        values.update(step=i, start_ms=10.0 * i, measured_ms=5.0, decode_tokens=4, ran_decode_tokens=4,
                      chunk_tokens=0 if starved else 256, ran_prefill_tokens=0 if starved else 256,
                      pending_prompt_tokens=2048, token_budget=2048, budget_ms=20.0, offer=[], predicted_ms=5.0,
                      margin_ms=1.0, base_predicted_ms=5.0, infeasible=False, aged=False)  # fmt: skip
        lines.append({"kind": "step", **values})
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    summary = step_log_summary.summarise(log)
    assert summary["starved_seconds"] == 4
    assert summary["longest_starved_run_s"] == 3
    assert summary["decode_only_steps_with_prompts_waiting"] == 400 + 33


def test_steps_parked_below_a_small_chunk_with_a_queue_and_the_deadline_far_off_are_counted(tmp_path):
    """What the plug-in did on vLLM's CPU engine after a warm-up, while a margin stood far above its
    steps: chunks of 32-250 tokens with 2,000 waiting and most of the budget to spare. A small chunk
    the deadline cut, a short queue, or a large chunk is not parked."""
    cases = [  # (chunk, waiting, predicted with margin, margin): 20 ms budget
        (64, 2048, 9.0, 5.0),  # parked: small, a queue, 11 ms of 20 spare
        (0, 2048, 4.0, 1.0),  # parked: no chunk at all
        (64, 2048, 19.0, 15.0),  # the deadline held it
        (64, 512, 5.0, 1.0),  # the queue was short
        (1024, 2048, 12.0, 2.0),  # not small
    ]
    lines = [{"kind": "header", "format": FORMAT}]
    for i, (chunk, waiting, predicted, margin) in enumerate(cases * 10):
        values = dict.fromkeys(STEP_FIELDS, 0)
        values.update(step=i, start_ms=25.0 * i, measured_ms=predicted - margin, decode_tokens=8, ran_decode_tokens=8,
                      chunk_tokens=chunk, ran_prefill_tokens=chunk, pending_prompt_tokens=waiting, token_budget=2048,
                      budget_ms=20.0, offer=[], predicted_ms=predicted, margin_ms=margin,
                      base_predicted_ms=predicted - margin, infeasible=False, aged=False)  # fmt: skip
        lines.append({"kind": "step", **values})
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    summary = step_log_summary.summarise(log)
    assert summary["queued_steps"] == 40 and summary["parked_steps"] == 20
    assert summary["queued_margin_ms_p99"] == 15.0
