"""The pure parts of benchmarks/twin_headroom.py: the headroom table and its options."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import twin_headroom  # noqa: E402

PROFILE = Path(__file__).resolve().parents[1] / "benchmarks/results-vllm-cpu/tight-epyc/prefix/profile-prefixes.csv"


def capacities() -> pd.DataFrame:
    """One target: drift best at 1,536; bursty best at 2,048 (1.1x 1,536 there); chat at the ceiling."""
    by_workload = {
        "drift": ({512: 50.0, 1536: 64.0, 2048: 54.0}, 60.0, ""),
        "chat": ({512: 236.0, 1536: 236.0, 2048: 236.0}, 236.0, "above-max"),
        "bursty": ({512: 105.0, 1536: 130.0, 2048: 143.0}, 120.0, ""),
    }
    rows = []
    for workload, (fixed, plugin, censored) in by_workload.items():
        for budget, rps in fixed.items():
            rows.append({"tpot_ms": 60.0, "workload": workload, "engine": f"vllm-{budget}", "budget": budget,
                         "capacity_rps": rps, "censored": censored})  # fmt: skip
        rows.append({"tpot_ms": 60.0, "workload": workload, "engine": "sloweave", "budget": 0,
                     "capacity_rps": plugin, "censored": censored})  # fmt: skip
    return pd.DataFrame(rows)


def test_headroom_is_each_phases_best_budget_against_drifts_best():
    table = twin_headroom.headroom(capacities()).set_index("workload")
    assert (table.drift_best_budget == 1536).all()
    assert table.loc["drift", "headroom"] == 1.0 and table.loc["drift", "plugin_vs_drift_best"] == 60.0 / 64.0
    assert table.loc["bursty", "best_budget"] == 2048 and table.loc["bursty", "headroom"] == pytest.approx(1.1)
    # every budget at the search's ceiling: a phase that never binds, a tie (the smallest budget), flagged
    assert table.loc["chat", "headroom"] == 1.0 and table.loc["chat", "censored"] == "above-max"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--profile", "no-such-profile.csv"], "no such file"),
        (["--profile", str(PROFILE), "--budgets", "512,a"], "comma-separated numbers"),
        (["--profile", str(PROFILE), "--tpot-ms", "60,"], "comma-separated numbers"),
    ],
)
def test_bad_options_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit):
        twin_headroom.parse_args(argv)
    assert message in capsys.readouterr().err
