"""benchmarks/replay_decisions.py: a served step log replayed through the plug-in's decision, open
loop, in all and per window of the log's clock. No real engine runs here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from sloweave.core.step_log import FORMAT, STEP_FIELDS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import replay_decisions  # noqa: E402


def write_spell_log(path: Path) -> None:
    """Steps every 10 ms, one decode and a prompt waiting: 6 s at the profile's speed, then 6 s
    with every step 150 ms late (a machine busy elsewhere)."""
    lines = [{"kind": "header", "format": FORMAT}]
    for i in range(1200):
        values = dict.fromkeys(STEP_FIELDS, 0)
        values.update(step=i, start_ms=10.0 * i, measured_ms=3.0 + (150.0 if i >= 600 else 0.0), decode_tokens=1,
                      ran_decode_tokens=1, pending_prompt_tokens=4096, token_budget=2048, budget_ms=40.0, offer=[],
                      predicted_ms=3.0, margin_ms=1.0, base_predicted_ms=3.0, infeasible=False, aged=False)  # fmt: skip
        lines.append({"kind": "step", **values})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def test_a_replay_is_split_into_windows_of_the_logs_clock(tmp_path):
    log = tmp_path / "steps.jsonl"
    write_spell_log(log)
    result = replay_decisions.replay(log, replay_decisions.DEFAULT_CONFIG, 2048, window_s=3.0)
    windows = result["windows"]
    assert [w["from_s"] for w in windows] == [0.0, 3.0, 6.0, 9.0]
    assert sum(w["steps_decided"] for w in windows) == result["steps_decided"] == 1200
    assert windows[1]["no_chunk_share"] == 0.0 and windows[1]["mean_chunk_tokens"] > 0
    # once every step runs 150 ms late the correction learns a slower machine: smaller chunks
    assert windows[3]["mean_chunk_tokens"] < 0.5 * windows[1]["mean_chunk_tokens"]
    assert "windows" not in replay_decisions.replay(log, replay_decisions.DEFAULT_CONFIG, 2048)
    assert np.isclose(result["mean_chunk_tokens"], np.mean([w["mean_chunk_tokens"] for w in windows]))
