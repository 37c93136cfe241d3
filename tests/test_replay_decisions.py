"""benchmarks/replay_decisions.py: a served step log replayed through the plug-in's decision, open
loop, in all and per window of the log's clock. No real engine runs here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from sloweave.core.costs import step_residuals
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


def write_spell_then_quiet_log(path: Path, seed: int = 0) -> None:
    """Steps every 10 ms, one decode and a prompt waiting, each 3 ms within +-0.5 ms: 6 s of them,
    a spell of 1 s with every step 5-18 ms late (within its 20 ms budget), then 11 s quiet again."""
    rng = np.random.default_rng(seed)
    lines = [{"kind": "header", "format": FORMAT}]
    for i in range(1800):
        late_ms = float(rng.uniform(5.0, 18.0)) if 600 <= i < 700 else 0.0
        values = dict.fromkeys(STEP_FIELDS, 0)
        values.update(step=i, start_ms=10.0 * i, measured_ms=3.0 + float(rng.uniform(-0.5, 0.5)) + late_ms,
                      decode_tokens=1, ran_decode_tokens=1, pending_prompt_tokens=4096, token_budget=2048,
                      budget_ms=20.0, offer=[], predicted_ms=3.0, margin_ms=1.0, base_predicted_ms=3.0,
                      infeasible=False, aged=False)  # fmt: skip
        lines.append({"kind": "step", **values})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def test_after_a_spell_the_decision_prefills_again_once_the_machine_is_quiet(tmp_path, monkeypatch):
    """The spell's residuals stood in the per-step margin's windows for 2,000 steps, and its chunks
    stayed small (on vLLM's CPU engine none ran for 5-6 s after a spell or a burst, only
    decode-only steps). Once enough quiet decode-only steps in a row say the machine is quiet
    again, the margin forgets the spell: the chunks come back to their size before it."""
    log = tmp_path / "steps.jsonl"
    write_spell_then_quiet_log(log)
    config = replay_decisions.DEFAULT_CONFIG | {"margin_form": "per-step"}
    after = replay_decisions.replay(log, config, 2048, window_s=2.0)["windows"]
    with monkeypatch.context() as patched:
        patched.setattr(step_residuals, "quieter_since", lambda residuals, fewest_steps: None)
        held = replay_decisions.replay(log, config, 2048, window_s=2.0)["windows"]
    before_spell = after[2]["mean_chunk_tokens"]
    assert after[:5] == held[:5] and before_spell > 0  # nothing forgotten before the spell, nor in it
    assert all(w["mean_chunk_tokens"] <= 0.8 * before_spell for w in held[5:])  # small for the rest of the log
    assert all(w["mean_chunk_tokens"] >= 0.95 * before_spell for w in after[6:])  # 1-3 s after it
