"""The decision metrics summary of a simulated run: the names the vLLM plug-in exports."""

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.core.decision_metrics import ALL_METRICS, summarize_decisions


def test_summary_counts_buckets_and_skips_unbounded_budgets():
    out = summarize_decisions(
        chunk_tokens=[0, 100, 1000, 5000],
        token_budget_tokens=[3, 104, 1004, 5000],
        time_budget_ms=[25.0, 25.0, 10.0, float("inf")],
        infeasible=[True, False, False, False],
        predicted_step_ms=[2.0, 3.0, 10.0, 30.0],
        measured_step_ms=[2.0, 3.5, 9.0, 30.0 + 1e-9],  # the last is float noise, not a miss
    )
    chunk = out["sloweave_chunk_tokens"]
    assert chunk["count"] == 4 and chunk["sum"] == 6100
    assert (
        chunk["buckets"]["0"] == 1
        and chunk["buckets"]["1024"] == 3
        and chunk["buckets"]["4096"] == 3
        and chunk["buckets"]["8192"] == 4
    )
    assert out["sloweave_time_budget_ms"]["count"] == 3  # +inf: nothing decoding, no deadline
    assert out["sloweave_time_budget_ms"]["buckets"]["10"] == 1
    assert out["sloweave_steps_total"] == 4 and out["sloweave_infeasible_steps_total"] == 1
    assert out["sloweave_underpredicted_steps_total"] == 1
    assert out["sloweave_measured_step_ms"]["sum"] == pytest.approx(44.5)


def test_simulate_out_writes_the_summary_under_the_exported_names(tmp_path):
    args = [
        "simulate",
        "--workload",
        "mixed",
        "--requests",
        "150",
        "--tpot-ms",
        "10",
        "--noise-sigma",
        "0.2",
        "--out",
        str(tmp_path),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "decision_metrics.json").read_text())
    iterations = pd.read_csv(tmp_path / "iterations.csv")
    metrics = summary["metrics"]
    assert summary["policy"] == "sloweave" and summary["tpot_ms"] == 10.0
    assert metrics["sloweave_steps_total"] == len(iterations)
    assert metrics["sloweave_chunk_tokens"]["sum"] == iterations["chunk_tokens"].sum()
    assert metrics["sloweave_token_budget_tokens"]["sum"] == (iterations["chunk_tokens"] + iterations["decodes"]).sum()
    assert metrics["sloweave_infeasible_steps_total"] == iterations["infeasible"].sum()
    # noise makes some iterations longer than the policy predicted (no margin here)
    measured = iterations["end_ms"] - iterations["start_ms"]
    assert metrics["sloweave_measured_step_ms"]["sum"] == pytest.approx(measured.sum())
    assert 0 < metrics["sloweave_underpredicted_steps_total"] < len(iterations)
    every_name = {m.name for m in ALL_METRICS}
    assert {name.removesuffix("_total") for name in metrics} == every_name
