"""`sloweave tune --tier`: one fixed budget for an SLO tier mix. The targets the sweep is priced at,
the advice (the best budget for the mix, which is not the best for its loosest tier alone), the
per-tier columns, SLOWeave with per-request targets against it, the report when no budget makes
every tier, and the command's parsing, refusals and result files."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.sim.tiers import Tier, describe_tier_mix, tier_labels
from sloweave.sim.workloads import WORKLOADS, Workload
from sloweave.studies.search import SearchLattice
from sloweave.studies.sources import ScaledWorkloads, SpecSource
from sloweave.studies.tune import RESULT_COLUMNS, tune
from sloweave.studies.tune_grid import model_grid
from sloweave.studies.tune_report import recommendation, tune_table, write_outputs
from sloweave.studies.tune_tiers import grid_ends_plan, sweep_targets, tier_settings
from tier_mixes import BAD_TIER_MIXES, TIER_ARGS

# the mix: 30 % of requests at 10 ms TPOT, 70 % at 50 ms, both at mixed's 2 s TTFT
MIX = (Tier("interactive", 10.0, 2000.0, 0.3), Tier("batch", 50.0, 2000.0, 0.7))
COARSE = SearchLattice(steps_per_doubling=8, max_scale=32)
BUDGETS = (256, 512, 1024, 2048)


def mixed_source(requests: int = 600, seeds: int = 2) -> SpecSource:
    return SpecSource(WORKLOADS["mixed"], requests, tuple(range(seeds)))


# ---------------------------------------------------------------- targets and the default grid


def test_the_sweep_is_priced_at_the_tightest_tpot_and_the_loosest_ttft():
    assert sweep_targets((), None, None) == (25.0, 2000.0)  # tune's single targets, as before
    assert sweep_targets((), 10.0, 500.0) == (10.0, 500.0)
    tiers = (Tier("a", 25.0, 8000.0, 0.2), Tier("b", 10.0, 2000.0, 0.5), Tier("c", 50.0, 4000.0, 0.3))
    assert sweep_targets(tiers, None, None) == (10.0, 8000.0)
    for given in ({"tpot_ms": 25.0}, {"ttft_ms": 2000.0}):
        with pytest.raises(ValueError, match=f"{next(iter(given))} cannot go with SLO tiers"):
            sweep_targets(tiers, given.get("tpot_ms"), given.get("ttft_ms"))
    with pytest.raises(ValueError, match="add up to 1"):
        sweep_targets((Tier("a", 10.0, 2000.0, 0.5),), None, None)
    assert grid_ends_plan(tiers)["grid_targets"] == (
        "tier mix: low end at the tightest tier's TPOT (b, 10 ms), high end at the loosest tier's TTFT (a, 8000 ms)"
    )
    assert grid_ends_plan(()) == {}


def test_the_default_grid_with_tiers_spans_both_tiers_ends():
    """Analytic cost (tests/test_tune.py): 10 ms TPOT starts the sweep at 128 tokens, 25 ms at 384; a
    20 ms TTFT ends it at 3,072, 50 ms at 8,192. A mix of (10 ms, 20 ms) and (25 ms, 50 ms) sweeps
    128-8,192: each end from the tier that calls for it, wider than either tier's own grid."""
    workload = Workload("long", np.arange(8) * 1.0, np.full(8, 20000), np.full(8, 10))
    source = ScaledWorkloads("long", (workload,), (1.0,))
    tiers = (Tier("tight", 10.0, 20.0, 0.5), Tier("loose", 25.0, 50.0, 0.5))
    assert set(tier_labels(8, tiers, 0)) == {0, 1}  # both tiers draw requests
    result = tune(
        source,
        "sarathi",
        cost=AnalyticCost(),
        lattice=SearchLattice(steps_per_doubling=2, max_scale=4),
        refine=False,
        coarse_grid=True,
        max_extensions=0,
        tiers=tiers,
    )
    plan = result.sweep_plan
    assert (plan["grid"]["low_tokens"], plan["grid"]["high_tokens"]) == (128, 8192)
    for tier in tiers:
        own = model_grid(source, "sarathi", tier.tpot_ms, tier.ttft_ms, AnalyticCost(), coarse=True)
        assert (own.low.budget_tokens, own.high.budget_tokens) != (128, 8192)
    assert "low end at the tightest tier's TPOT (tight, 10 ms)" in plan["grid_targets"]
    assert "high end at the loosest tier's TTFT (loose, 50 ms)" in recommendation(result, "vllm")[0]
    assert result.tpot_ms is None and result.ttft_ms is None


# ---------------------------------------------------------------- the advice


def test_the_advice_is_the_best_budget_for_the_mix_not_for_its_loosest_tier():
    """mixed, 2 seeds of 600 requests, analytic cost, 9 % lattice, sarathi rule. Measured: with
    every request held to the loose tier alone (50 ms TPOT) the best budget is 2,048 tokens
    (179 req/s); with 30 % of them at 10 ms it is 256 (57.5 req/s), where 2,048 keeps 12.7: a
    large budget's steps break the interactive tier's 10 ms."""
    source = mixed_source()
    loose = tune(source, "sarathi", BUDGETS, 50.0, 2000.0, AnalyticCost(), refine=False, lattice=COARSE)
    mixed = tune(source, "sarathi", BUDGETS, cost=AnalyticCost(), refine=False, lattice=COARSE, tiers=MIX)
    assert loose.best_capacity_tokens == 2048 and mixed.best_capacity_tokens == 256
    table = mixed.table.set_index("budget_tokens")
    # the advice is the argmax of the mix's capacity (the highest load every tier keeps 90 % at)
    assert mixed.best_capacity_tokens == table["capacity_rps"].idxmax()
    assert table.loc[2048, "capacity_rps"] < 0.3 * table.loc[256, "capacity_rps"]
    assert table.loc[2048, "binding_tier"] == "interactive"
    # every tier keeps the target at every budget's capacity; one binds just above it
    tier_columns = ["attainment_interactive", "attainment_batch"]
    assert list(mixed.table.columns) == RESULT_COLUMNS + ["tier_mix", *tier_columns, "binding_tier"]
    assert (mixed.table[tier_columns] >= 0.9).all().all() and mixed.table["binding_tier"].str.len().gt(0).all()
    assert (mixed.table["tier_mix"] == describe_tier_mix(MIX)).all()
    # SLOWeave with per-request targets, against the best single budget for the mix
    ours = mixed.sloweave
    assert ours["policy"] == "sloweave-multi" and ours["capacity_rps"] > table.loc[256, "capacity_rps"]
    assert set(tier_columns) <= set(ours)


def test_the_report_and_files_name_the_mix_each_tier_and_sloweaves_ratio(tmp_path):
    result = tune(mixed_source(), "sarathi", (256, 1024), cost=AnalyticCost(), refine=False, lattice=COARSE, tiers=MIX)
    table = tune_table(result)
    assert "| interactive at capacity | batch at capacity | binding tier |" in table.splitlines()[0]
    assert len(table.splitlines()) == 2 + len(result.table) + 1  # header, rule, budgets, SLOWeave
    payload = write_outputs(result, "vllm", tmp_path)
    best, ours = payload["best_budget_for_mix"], payload["sloweave_per_request_targets"]
    assert payload["tier_mix"] == describe_tier_mix(MIX) and payload["tiers"][1]["tpot_ms"] == 50.0
    assert payload["tpot_ms"] is None and payload["ttft_ms"] is None
    assert best["budget_tokens"] == result.best_capacity_tokens == 256
    assert ours["capacity_over_best_budget"] == pytest.approx(ours["capacity_rps"] / best["capacity_rps"])
    assert payload["comparisons"]["sloweave_capacity_over_best"] == pytest.approx(ours["capacity_over_best_budget"])
    advice = payload["advice"]
    assert any(line.startswith("best single budget for the tier mix: 256 tokens") for line in advice)
    assert any(line.startswith("at that capacity: interactive ") for line in advice)
    ratio = f"{ours['capacity_over_best_budget']:.2f}x the best single budget for the mix"
    assert any(
        line.startswith("SLOWeave (sloweave-multi) with per-request targets") and ratio in line for line in advice
    )
    csv = pd.read_csv(tmp_path / "tune.csv")
    assert {"attainment_interactive", "attainment_batch", "binding_tier"} <= set(csv.columns)
    untiered = tune(mixed_source(200, 1), "sarathi", (256,), 25.0, 2000.0, refine=False, lattice=COARSE)
    assert tier_settings(untiered, 256) == {} and "binding" not in tune_table(untiered)


def test_no_budget_makes_every_tier_reach_the_target():
    """One decode alone takes 1.31 ms by the analytic cost: a 1 ms tier holds at no load, for any budget
    (256 and 1,024 swept, and the rule of thumb's 512)."""
    tiers = (Tier("instant", 1.0, 2000.0, 0.5), Tier("batch", 50.0, 2000.0, 0.5))
    result = tune(mixed_source(200, 1), "sarathi", (256, 1024), cost=AnalyticCost(), lattice=COARSE, tiers=tiers)
    assert result.no_budget_meets_targets
    advice = recommendation(result, "vllm")
    assert any(
        line.startswith("NO BUDGET MEETS THE TARGETS: none of the 3 budgets swept")
        and "reaches attainment >= 90% in every tier of instant:1:2000:0.5,batch:50:2000:0.5" in line
        for line in advice
    )
    assert not any(line.startswith(("set:", "best single budget")) for line in advice)
    assert tier_settings(result, None)["best_budget_for_mix"] is None
    assert tier_settings(result, None)["sloweave_per_request_targets"]["capacity_over_best_budget"] is None


# ---------------------------------------------------------------- the command


def _tune(tmp_path, *extra):
    args = ["tune", "--workload", "mixed", "--requests", "600", "--seeds", "2", "--quick", "--no-refine"]
    args += ["--budget", "256", "--budget", "1024", "--jobs", "1", *extra, "--out", str(tmp_path / "out")]
    return CliRunner().invoke(main, args)


@pytest.mark.parametrize(
    "extra, problem",
    [
        *BAD_TIER_MIXES,
        ((*TIER_ARGS, "--tpot-ms", "25"), "--tpot-ms cannot go with --tier: each tier names its own TPOT target"),
        ((*TIER_ARGS, "--ttft-ms", "1000"), "--ttft-ms cannot go with --tier: each tier names its own TTFT target"),
        (("--tier", "rare:10:2000:0.0001", "--tier", "common:50:2000:0.9999"), "tier(s) rare drew none of the 600"),
    ],
)
def test_the_command_refuses_a_bad_mix_and_single_targets_beside_it(tmp_path, extra, problem):
    result = _tune(tmp_path, *extra)
    assert result.exit_code == 2 and problem in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_the_command_reports_each_tier_and_records_the_mix(tmp_path):
    result = _tune(tmp_path, *TIER_ARGS)
    assert result.exit_code == 0, result.output
    assert "tier mix interactive:10:2000:0.3,batch:50:2000:0.7: a budget's capacity" in result.output
    assert "| interactive at capacity | batch at capacity | binding tier |" in result.output
    assert "best single budget for the tier mix: 256 tokens" in result.output
    assert "set: --max-num-batched-tokens 256" in result.output
    payload = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert payload["options"]["tiers"] == ["interactive:10:2000:0.3", "batch:50:2000:0.7"]
    assert payload["options"]["tpot_ms"] is None and payload["tier_mix"] == describe_tier_mix(MIX)
    assert payload["sloweave_per_request_targets"]["policy"] == "sloweave-multi"
    assert "tier mix interactive" in (tmp_path / "out" / "tune.md").read_text()
    sweep = pd.read_csv(tmp_path / "out" / "tune.csv")
    assert (sweep["tier_mix"] == describe_tier_mix(MIX)).all() and "binding_tier" in sweep.columns
