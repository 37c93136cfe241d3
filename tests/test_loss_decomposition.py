"""The pure parts of benchmarks/loss_decomposition.py: the split of a run's time and its misses.
No real engine runs here (the benchmark itself serves vLLM's CPU build)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import loss_decomposition  # noqa: E402


def steps_frame(rng) -> pd.DataFrame:
    """Steps whose model time is 2 ms + 0.05 ms a decode + 15 ms per 1,000 prefill tokens (+1 ms with a chunk),
    each after 0.3 ms of scheduling; 1 ms of the engine loop before a step that decodes, 5 ms of idle
    (waiting for work) before one that does not."""
    n = 400
    decodes = rng.integers(0, 64, n)
    prefill = np.where(rng.random(n) < 0.5, rng.integers(1, 1024, n), 0)
    waiting = rng.integers(0, 3, n)
    model = 2.0 + 0.05 * decodes + 0.015 * prefill + (prefill > 0)
    schedule, update = np.full(n, 0.2), np.full(n, 0.1)
    wall = model + schedule + update
    gap_after = np.where(np.append(decodes[1:], 1) > 0, 1.0, 5.0)
    start = np.concatenate([[0.0], np.cumsum(wall + gap_after)[:-1]])
    return pd.DataFrame({"start_ms": start, "end_ms": start + wall, "schedule_ms": schedule, "update_ms": update,
                         "decode_tokens": decodes, "prefill_tokens": prefill, "prompts_waiting": waiting})  # fmt: skip


def test_a_runs_time_splits_into_model_scheduler_loop_and_idle_and_the_model_is_recovered():
    steps = steps_frame(np.random.default_rng(0))
    span = float(steps["end_ms"].iloc[-1])
    out = loss_decomposition.decompose(steps, span)
    assert out["model_ms"] + out["scheduler_ms"] + out["loop_ms"] + out["idle_ms"] == pytest.approx(span)
    waits = int((steps["decode_tokens"].iloc[1:] == 0).sum())
    assert waits > 0  # the engine waited for work before some steps: idle, not the loop's work
    assert out["loop_ms"] == pytest.approx(len(steps) - 1.0 - waits)
    assert out["idle_ms"] == pytest.approx(5.0 * waits)
    assert out["loop_us_per_step"] == pytest.approx(1000.0)
    assert out["scheduler_us_per_step"] == pytest.approx(300.0)
    assert out["model_ms_per_1k_prefill"] == pytest.approx(15.0)
    assert out["model_ms_per_decode"] == pytest.approx(0.05)
    without = (steps["prefill_tokens"] == 0) & (steps["prompts_waiting"] > 0)
    assert out["steps_without_prefill_while_waiting"] == int(without.sum()) > 0
    assert out["mean_chunk_tokens"] == pytest.approx(steps.loc[steps["prefill_tokens"] > 0, "prefill_tokens"].mean())


def test_each_request_is_counted_once_by_the_target_it_missed():
    requests = pd.DataFrame({
        "status": ["finished", "finished", "finished", "finished", "pending"],
        "ttft_ms": [100.0, 2000.0, 100.0, 2000.0, np.nan],
        "p99_tpot_ms": [10.0, 10.0, 90.0, 90.0, np.nan],
    })  # fmt: skip
    out = loss_decomposition.misses(requests, argparse.Namespace(ttft_ms=1000.0, tpot_ms=40.0))
    assert out == {"missed_ttft_only": 0.2, "missed_tpot_only": 0.2, "missed_both": 0.4}  # the pending one: both


def test_bad_options_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        loss_decomposition.parse_args(["--rate-rps", "0"])
    assert "--rate-rps must be positive" in capsys.readouterr().err


@pytest.mark.parametrize(
    "limit_rps, at_floor, at_ceiling", [(1e9, False, True), (0.0, True, False), (95.0, False, False)]
)
def test_the_real_engine_benchmark_flags_a_capacity_its_search_never_saw_fail(
    monkeypatch, limit_rps, at_floor, at_ceiling
):
    """The capacity search never tries its bounds: an engine that attains at every try reports the
    last step below 1.6x the load point, which is a lower bound, and says so (two engines there tie)."""
    bench = loss_decomposition.bench
    monkeypatch.setattr(bench, "workload_for", lambda args, seed, rate: rate)
    monkeypatch.setattr(
        bench, "measure", lambda engine, rate, args, vocab, seed: {"attainment": float(rate <= limit_rps)}
    )
    args = argparse.Namespace(target=0.9, capacity_steps=4)
    found = bench.capacity(None, args, 1024, 0, 100.0)
    assert (found["at_floor"], found["at_ceiling"]) == (at_floor, at_ceiling)
    # within the search's range, and at or below the limit unless the floor is all it can say
    assert 50.0 <= found["capacity_rps"] <= max(min(limit_rps, 160.0), 50.0)
    cells = pd.DataFrame([{"pass": 0, "seed": 0, "engine": name, **found} for name in ("vllm-tuned-512", "sloweave")])
    summary = bench.summarize_capacity(cells)
    assert summary["cells_at_ceiling"].tolist() == [int(at_ceiling)] * 2
