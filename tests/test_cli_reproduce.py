"""The command line: `decide`, `simulate` and a small `reproduce` end to end."""

import json
import re

import pandas as pd
import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.studies.reproduce import StudyConfig, mean_over_seeds, run_study, table4


def test_decide_reproduces_the_worked_example():
    result = CliRunner().invoke(main, ["decide", "--decodes", "4", "--waiting-tokens", "4096", "--budget-ms", "10"])
    assert result.exit_code == 0, result.output
    decision = json.loads(result.output)
    assert abs(decision["chunk_tokens"] - 1355) <= 1 and decision["predicted_ms"] <= 10.0


def test_simulate_writes_its_files(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(
        main, ["simulate", "--workload", "mixed", "--requests", "150", "--policy", "fixed-512", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    requests = pd.read_csv(out / "requests.csv")
    assert len(requests) == 150 and set(requests["status"]) == {"finished"}
    assert json.loads((out / "metrics.json").read_text())["num_requests"] == 150
    assert len(pd.read_csv(out / "iterations.csv")) > 0


@pytest.mark.parametrize(
    "args, option, detail",
    [
        (["simulate", "--policy", "fixed-0"], "--policy", r"Fixed-C chunk size .*, got 0$"),
        (["simulate", "--policy", "banana"], "--policy", r"unknown policy 'banana'"),
        (["simulate", "--tpot-ms", "0"], "--tpot-ms", r"finite number .*, got 0\.0$"),
        (["simulate", "--tpot-ms", "-10"], "--tpot-ms", r"finite number .*, got -10\.0$"),
        (["simulate", "--requests", "0"], "--requests", r"(got 0|0 is not in the range .*)$"),
        (["simulate", "--workload", "nope"], "--workload", r"'nope' is not one of 'chat'"),
        (
            ["decide", "--decodes", "4", "--waiting-tokens", "10", "--budget-ms", "-1"],
            "--budget-ms",
            r">= 0.*, got -1\.0$",
        ),
        (["reproduce", "--seeds", "0"], "--seeds", r"(got 0|0 is not in the range .*)$"),
    ],
)
def test_bad_input_gets_a_clear_error(args, option, detail):
    result = CliRunner().invoke(main, args)
    # a usage error (2), not a crash (1), on one line naming the option and what was wrong with it
    assert result.exit_code == 2, result.output
    assert re.search(rf"^Error: Invalid value for '?{option}'?: .*{detail}", result.output, re.MULTILINE), result.output


def test_reproduce_writes_the_tables(tmp_path):
    out = tmp_path / "repro"
    result = CliRunner().invoke(main, ["reproduce", "--out", str(out), "--seeds", "1", "--requests", "150"])
    assert result.exit_code == 0, result.output
    t3 = pd.read_csv(out / "table3.csv")
    assert list(t3.columns) == [
        "workload",
        "policy",
        "tpot_ms",
        "p99_ttft_ms",
        "p99_tpot_ms",
        "goodput_rps",
        "attainment",
    ]
    assert set(t3["policy"]) == {"full", "fixed-64", "fixed-256", "fixed-1024", "sloweave"}
    assert set(t3["workload"]) == {"chat", "mixed", "long", "bursty"}
    # each cell is its run at the 25 ms target (one seed: the mean is the run), and attainment is
    # the share of requests that met both targets
    runs = pd.read_csv(out / "runs.csv")
    cells = t3.merge(runs, on=["workload", "policy", "tpot_ms"], suffixes=("", "_run"), validate="one_to_one")
    assert len(cells) == len(t3) == 20 and (cells["tpot_ms"] == 25.0).all()
    for column in ("p99_ttft_ms", "p99_tpot_ms", "goodput_rps", "attainment"):
        assert cells[column].tolist() == pytest.approx(cells[f"{column}_run"].tolist()), column
    assert cells["attainment"].tolist() == pytest.approx((cells["slo_met"] / cells["num_requests"]).tolist())
    for name in ("table4.csv", "table4_extended.csv"):
        t4 = pd.read_csv(out / name)
        assert list(t4.columns) == [
            "workload",
            "tpot_ms",
            "best_static_policy",
            "best_static_goodput_rps",
            "sloweave_goodput_rps",
            "ratio",
        ]
        assert len(t4) == 12
    extended = pd.read_csv(out / "table4_extended.csv")
    paper = pd.read_csv(out / "table4.csv")
    # a larger static set can only find an equal or stronger baseline
    assert (extended["best_static_goodput_rps"] >= paper["best_static_goodput_rps"] - 1e-12).all()
    for name in ("goodput_vs_tpot.png", "chunk_timeline.png", "report.md", "runs.csv", "summary.json"):
        assert (out / name).stat().st_size > 0


def test_table4_picks_the_strongest_static_per_cell():
    config = StudyConfig(
        workloads=("mixed",), seeds=2, num_requests=200, static_policies=("full", "fixed-256", "fixed-1024")
    )
    runs, _ = run_study(config, progress=False)
    means = mean_over_seeds(runs)
    t4 = table4(means, config.static_policies)
    for row in t4.itertuples():
        cell = means[(means["workload"] == row.workload) & (means["tpot_ms"] == row.tpot_ms)]
        statics = cell[cell["policy"] != "sloweave"]
        assert row.best_static_goodput_rps == statics["goodput_rps"].max()
        assert row.ratio == pytest.approx(row.sloweave_goodput_rps / row.best_static_goodput_rps)
    # static policies are simulated once and judged at each target: their TTFT does not depend on it
    fixed = means[means["policy"] == "fixed-1024"].set_index("tpot_ms")
    assert fixed["p99_ttft_ms"].nunique() == 1


def test_study_config_rejects_bad_input():
    with pytest.raises(ValueError, match="seeds"):
        StudyConfig(seeds=0)
    with pytest.raises(ValueError, match="unknown workload"):
        StudyConfig(workloads=("nope",))
    with pytest.raises(ValueError, match="not a static policy"):
        StudyConfig(static_policies=("sloweave",))
    with pytest.raises(ValueError, match="must include 25"):
        StudyConfig(tpot_targets_ms=(10.0,))


def test_decide_with_no_deadline_prints_strict_json():
    result = CliRunner().invoke(main, ["decide", "--decodes", "4", "--waiting-tokens", "4096"])
    assert result.exit_code == 0, result.output
    decision = json.loads(result.output, parse_constant=lambda name: pytest.fail(f"non-strict JSON: {name}"))
    assert decision["chunk_tokens"] == 4096 and decision["budget_ms"] is None
