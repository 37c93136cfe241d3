"""`sloweave tune` on a case whose best budget is worked out by hand, its outputs and its CLI; its default
sweep (a grid that follows the cost model and the targets, extended past an edge that holds the best budget)
and the report when no budget meets the targets."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.sim.options import DEFAULT_OPTIONS
from sloweave.studies.parallel import SERIAL
from sloweave.studies.sources import ScaledWorkloads
from sloweave.cli import main
from sloweave.studies.search import SearchLattice
from sloweave.studies.tune import (
    LADDER_FLOOR_TOKENS,
    BudgetGrid,
    BudgetSweep,
    RuleOfThumb,
    SweepEnd,
    ladder,
    model_grid,
    nearest_power_of_two,
    refined_budgets_tokens,
    tune,
)
from sloweave.studies.tune_report import (
    comparisons,
    flag_for,
    no_budget_lines,
    recommendation,
    tune_table,
    write_outputs,
)
from sloweave.sim.workloads import Workload

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
STEPS = 16
STEP = 2.0 ** (1.0 / STEPS)


@dataclass(frozen=True)
class OverheadPlusLinear:
    """T(n, c) = 5 ms + 0.01 ms per prompt token, whatever n: chunk overhead is what small chunks pay."""

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return 5.0 + 0.01 * chunk_tokens


# Identical requests (3000-token prompt, 20 output tokens) every 97 ms; TPOT target 15 ms.
PROMPT, OUTPUT, GAP_MS, TPOT_MS, TTFT_MS = 3000, 20, 97.0, 15.0, 200.0


def periodic_source(num_requests: int = 200) -> ScaledWorkloads:
    arrivals = np.arange(num_requests) * GAP_MS / 1000.0
    wl = Workload("periodic", arrivals, np.full(num_requests, PROMPT), np.full(num_requests, OUTPUT))
    return ScaledWorkloads("periodic", (wl,), (1000.0 / GAP_MS,))


def prefill_service_ms(chunk_tokens: int) -> float:
    """Busy time of one prompt under fixed-C: one 5 ms overhead per chunk plus 0.01 ms per token."""
    return math.ceil(PROMPT / chunk_tokens) * 5.0 + 0.01 * PROMPT


def test_best_budget_is_the_largest_chunk_that_keeps_tpot():
    """Worked by hand.

    A chunk of C tokens makes an iteration of 5 + 0.01 C ms, within the 15 ms TPOT target
    iff C <= 1000. Up to that, TPOT always holds and a larger chunk pays fewer 5 ms
    overheads, so the server keeps up while the arrival gap is at least the prompt's busy
    time S(C) = 5 ceil(3000 / C) + 30 ms: 90 ms (256), 60 ms (512), 50 ms (768). Arrivals
    are periodic, so below that rate nothing queues (TTFT < S + 5 ms, within 200 ms) and
    above it the queue grows without bound (TTFT fails for most requests): capacity is
    1000 / S(C) req/s, to one lattice step. Chunks of 1024 and 2048 make 15.24 and 25.48 ms
    iterations: any request decoding beside another's prefill sees two such gaps among its
    19, so its P99 gap misses 15 ms, and capacity collapses to the load where requests stop
    overlapping (a 140 ms lifetime: about 7 req/s). The best budget is therefore 768, not
    the rule of thumb (a quarter to a half of 3000: 1024 and 2048 as powers of two).
    Refinement adds the midpoints 640 (S = 55 ms) and 896 (S = 50 ms, the same 4 chunks as
    768, so the same capacity: the tie goes to the smaller budget).
    """
    result = tune(
        periodic_source(),
        rule="fixed",
        budgets_tokens=(256, 512, 768, 1024, 2048),
        tpot_ms=TPOT_MS,
        ttft_ms=TTFT_MS,
        cost=OverheadPlusLinear(),
        lattice=SearchLattice(steps_per_doubling=STEPS),
    )
    table = result.table.set_index("budget_tokens")
    assert list(table.index) == [256, 512, 640, 768, 896, 1024, 2048]
    for chunk in (256, 512, 640, 768, 896):
        limit_rps = 1000.0 / prefill_service_ms(chunk)
        assert limit_rps / STEP < table.loc[chunk, "capacity_rps"] <= limit_rps + 1e-9, chunk
    for chunk in (1024, 2048):
        assert table.loc[chunk, "capacity_rps"] < 1000.0 / 130.0
    assert result.best_capacity_tokens == 768
    # the rule of thumb lands on the two budgets that break TPOT
    assert result.rule_of_thumb.budgets_tokens == (1024, 2048)
    assert table.loc[[1024, 2048], "rule_of_thumb"].all() and not table.loc[768, "rule_of_thumb"]
    # SLOWeave (one prompt per iteration for the fixed rule) sizes each chunk to the deadline: never worse
    assert result.sloweave["policy"] == "sloweave"
    assert result.sloweave["capacity_rps"] >= table.loc[768, "capacity_rps"]
    # At the load picked (768's capacity) the larger chunks miss TPOT, and 256 cannot keep up.
    assert result.best_goodput_tokens in (768, 896)
    assert table.loc[768, "p99_tpot_ms"] == pytest.approx(5.0 + 0.01 * 768)
    assert table.loc[2048, "p99_tpot_ms"] > TPOT_MS
    assert table.loc[256, "p99_ttft_ms"] > TTFT_MS
    cmp = comparisons(result)
    assert cmp["best_capacity"]["budget_tokens"] == 768
    assert cmp["sloweave_capacity_over_best"] >= 1.0
    assert all(b["capacity_vs_best"] < 0.5 for b in cmp["rule_of_thumb"]["budgets"])


def test_given_load_and_the_token_budget_rule():
    """At the base load (10.3 req/s) every budget that keeps TPOT serves everyone.

    With the vLLM rule (decodes share the budget) a budget of B leaves B - n prompt tokens:
    with at most 2 requests decoding at once here, budget 770 still keeps every iteration
    within 15 ms, 1024 does not.
    """
    result = tune(
        periodic_source(60),
        rule="budget",
        budgets_tokens=(512, 770, 1024),
        tpot_ms=TPOT_MS,
        ttft_ms=TTFT_MS,
        cost=OverheadPlusLinear(),
        load_scale=1.0,
        lattice=SearchLattice(steps_per_doubling=4),
        refine=False,
    )
    table = result.table.set_index("budget_tokens")
    assert result.load_scale == 1.0 and result.load_source == "given"
    assert table.loc[512, "attainment"] == table.loc[770, "attainment"] == 1.0
    assert table.loc[1024, "attainment"] < 0.5
    assert list(table["policy"]) == ["budget-512", "budget-770", "budget-1024", "budget-2048"]  # + rule of thumb 2048


def test_rule_of_thumb_rounding_and_flags():
    assert nearest_power_of_two(750) == 1024 and nearest_power_of_two(700) == 512 and nearest_power_of_two(10) == 64
    thumb = RuleOfThumb.of(1600)
    assert (thumb.quarter_tokens, thumb.half_tokens) == (512, 1024)
    assert flag_for("vllm", 768) == "--max-num-batched-tokens 768"
    assert flag_for("sglang", 768) == "--chunked-prefill-size 768"
    assert "max_num_tokens: 768" in flag_for("trtllm", 768)


def test_cli_on_a_trace_writes_every_output(tmp_path):
    out = tmp_path / "tune"
    args = ["tune", "--trace", str(FIXTURES / "azure_conv_first150.csv"), "--seeds", "1", "--window-s", "30"]
    args += ["--budget", "512", "--budget", "2048", "--tpot-ms", "25", "--quick", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "set: --max-num-batched-tokens" in result.output
    assert "rule of thumb" in result.output and "SLOWeave (sloweave-multi)" in result.output
    for name in ("tune.csv", "tune.md", "tune.json", "tune.png"):
        assert (out / name).stat().st_size > 0
    payload = json.loads((out / "tune.json").read_text())
    best = payload["comparisons"]["best_capacity"]["budget_tokens"]
    assert payload["flag"] == f"--max-num-batched-tokens {best}"
    assert {row["budget_tokens"] for row in payload["sweep"]} >= {512, 2048}
    assert payload["comparisons"]["rule_of_thumb"]["rounding"].startswith("nearest power of two")


def test_cli_refuses_bad_input():
    runner = CliRunner()
    assert runner.invoke(main, ["tune"]).exit_code == 2  # neither workload nor trace
    bad = runner.invoke(main, ["tune", "--workload", "mixed", "--tpot-ms", "0"])
    assert bad.exit_code == 2 and "--tpot-ms" in bad.output


def test_cli_with_a_step_time_profile_as_the_cost_model(tmp_path, analytic_step_profile):
    """A profile (the format `sloweave profile` writes) is fitted and wrapped as a plain T(n, c)."""
    profile = analytic_step_profile
    out = tmp_path / "tune"
    args = ["tune", "--workload", "chat", "--requests", "200", "--seeds", "1", "--quick", "--no-refine"]
    args += ["--budget", "256", "--budget", "1024", "--cost", str(profile), "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    payload = json.loads((out / "tune.json").read_text())
    assert payload["cost"]["profile"] == str(profile) and payload["cost"]["kind"] == "regression"
    assert payload["cost"]["context_per_decode_tokens"] > 0  # mean prompt + half the mean output
    assert payload["flag"].startswith("--max-num-batched-tokens ")


def test_tables_print_capacities_in_significant_figures():
    """A 70B capacity of 0.03 req/s printed with one decimal read 0.0; whole numbers keep every digit."""
    from sloweave.studies.markdown import significant
    from sloweave.studies.tune_report import _fmt

    assert [significant(v) for v in (0.0312, 0.03, 12.345, 1234.5, 0.0)] == ["0.0312", "0.0300", "12.3", "1,234", "0"]
    assert _fmt(0.03) == "0.0300" and _fmt(float("nan")) == "-" and _fmt(2048) == "2,048"


# --------------------------------------------------------------------------- the default sweep

LATTICE = SearchLattice(steps_per_doubling=4)


def long_prompt_source(prompt_tokens: int = 20000) -> ScaledWorkloads:
    wl = Workload("long", np.arange(4) * 1.0, np.full(4, prompt_tokens), np.full(4, 10))
    return ScaledWorkloads("long", (wl,), (1.0,))


def test_ladder_is_powers_of_two_and_the_1_5x_points_between():
    assert ladder(100) == [16, 24, 32, 48, 64, 96, 128]
    assert ladder(8192)[-4:] == [3072, 4096, 6144, 8192]
    assert ladder(5000, coarse=True) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert ladder(1) == [LADDER_FLOOR_TOKENS]


def test_grid_ends_move_with_the_tpot_and_ttft_targets():
    """Analytic cost: T(n, 0) = 1.25 + 0.055 n ms, T(0, c) = 0.75 + 0.006 c ms.

    Low end: the decode batch that fills a TPOT step alone is 159 at 10 ms, 431 at 25 ms, so
    the sweep starts at 128 and 384 (the ladder values at or below). High end: a prompt of
    c tokens prefills in one step within 20 ms up to 3,208 tokens, within 50 ms up to 8,208,
    so the sweep ends at 3,072 and 8,192. The hard limits stay put: the ladder's floor and
    the ladder value at or above the longest prompt (20,000 tokens: 24,576).
    """
    source, cost = long_prompt_source(), AnalyticCost()
    ends = {
        (tpot, ttft): model_grid(source, "sarathi", tpot, ttft, cost)
        for tpot, ttft in ((10.0, 20.0), (25.0, 20.0), (25.0, 50.0))
    }
    assert [(g.low.budget_tokens, g.high.budget_tokens) for g in ends.values()] == [
        (128, 3072),
        (384, 3072),
        (384, 8192),
    ]
    grid = ends[(25.0, 50.0)]
    assert grid.budgets_tokens == [384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert (grid.low_limit.budget_tokens, grid.high_limit.budget_tokens) == (16, 24576)
    assert "431 decodes" in grid.low.reason and "8,192-token prompt" in grid.high.reason
    described = grid.describe()
    assert described["low_tokens"] == 384 and "TTFT" in described["high_reason"]
    # decodes do not count against a fixed chunk; a decode that alone misses TPOT starts at the floor
    assert model_grid(source, "fixed", 25.0, 50.0, cost).low.budget_tokens == LADDER_FLOOR_TOKENS
    alone = model_grid(source, "sarathi", 1.0, 50.0, cost).low
    assert alone.budget_tokens == LADDER_FLOOR_TOKENS and "one decode alone takes 1.31 ms" in alone.reason
    # a loose TTFT reaches the hard limit; --quick's ladder is powers of two
    assert model_grid(source, "sarathi", 25.0, 1e6, cost).high.budget_tokens == 24576
    assert model_grid(source, "sarathi", 25.0, 50.0, cost, coarse=True).budgets_tokens == [
        256,
        512,
        1024,
        2048,
        4096,
        8192,
    ]


def test_default_sweep_extends_past_the_edge_that_holds_the_best():
    """The worked case of test_tune (best budget 768) under the budget rule, whose decodes cost
    nothing here: the decode batch that fills a TPOT step is unbounded, so the grid starts and
    ends at the hard limit, 3,072 (the longest prompt is 3,000 tokens), beside the rule of
    thumb's 1,024 and 2,048, all of which break TPOT. The best of those (1,024) is the low
    edge: one extension sweeps 768 and 512 and finds 768 inside."""
    result = tune(
        periodic_source(120),
        rule="budget",
        tpot_ms=TPOT_MS,
        ttft_ms=TTFT_MS,
        cost=OverheadPlusLinear(),
        lattice=LATTICE,
        refine=False,
    )
    plan = result.sweep_plan
    assert plan["budgets_from"].startswith("the cost model")
    assert (plan["grid"]["low_tokens"], plan["grid"]["high_tokens"]) == (3072, 3072)
    assert plan["extensions"] == [
        {"side": "low", "best_before_tokens": 1024, "added_tokens": [512, 768], "best_after_tokens": 768}
    ]
    assert "inside the sweep" in plan["extension_stop"]
    assert list(result.table["budget_tokens"]) == [512, 768, 1024, 2048, 3072]
    assert result.best_capacity_tokens == 768 and not result.no_budget_meets_targets
    lines = recommendation(result, "vllm")
    assert any(line.startswith("edge extension: the best budget (1,024 tokens) was the low edge") for line in lines)
    assert not any(line.startswith("NOTE") for line in lines)


def hand_grid(low: int, high: int, high_limit: int) -> BudgetGrid:
    values = tuple(ladder(high_limit))
    return BudgetGrid(
        values,
        SweepEnd(low, "given"),
        SweepEnd(high, "given"),
        SweepEnd(values[0], "floor"),
        SweepEnd(values[-1], "the test's limit"),
        0.0,
        False,
    )


def periodic_sweep() -> BudgetSweep:
    source = periodic_source(120)
    return BudgetSweep(
        source, "fixed", TPOT_MS, TTFT_MS, LATTICE, OverheadPlusLinear(), 4096, DEFAULT_OPTIONS, SERIAL, False, None
    )


def test_extension_stops_at_a_hard_limit_and_after_the_most_rounds():
    """Fixed rule, best 768 (test_tune): a sweep of 256-384 climbs; with the limit at 512 it stops
    there, and with one round allowed it stops at 768, still the top edge."""
    sweep = periodic_sweep()
    sweep.add(["fixed-256", "fixed-384"])
    budgets, extensions, stop = sweep.extended([256, 384], hand_grid(256, 384, 512), max_extensions=3)
    assert budgets == [256, 384, 512] and [e["added_tokens"] for e in extensions] == [[512]]
    assert "at the hard limit (512 tokens: the test's limit)" in stop
    budgets, extensions, stop = sweep.extended([256, 384], hand_grid(256, 384, 4096), max_extensions=1)
    assert budgets == [256, 384, 512, 768] and len(extensions) == 1
    assert "(768 tokens) is the largest swept after 1 extensions" in stop
    budgets, extensions, stop = sweep.extended(budgets, hand_grid(256, 384, 4096), max_extensions=3)
    assert budgets == [256, 384, 512, 768, 1024, 1536] and "inside the sweep" in stop


def test_refinement_between_small_budgets_keeps_its_step():
    # below 96 tokens the midpoints round to multiples of 8 (64 would swallow the step): 32 and 48 give 40
    assert refined_budgets_tokens(32, [24, 32, 48]) == [40]
    # 64-token multiples from 96 up, as before: 768 between 512 and 1024 refines to 640 and 896
    assert refined_budgets_tokens(768, [512, 768, 1024]) == [640, 896]


def test_no_budget_meets_the_targets_is_reported_not_advised(tmp_path):
    """Every step costs at least 5 ms: a 4 ms TPOT target holds at no load, for any budget."""
    result = tune(
        periodic_source(40),
        rule="fixed",
        budgets_tokens=(256, 1024),
        tpot_ms=4.0,
        ttft_ms=TTFT_MS,
        cost=OverheadPlusLinear(),
        lattice=LATTICE,
    )
    assert result.no_budget_meets_targets
    assert result.sweep_plan["refinement_tokens"] == []  # nothing to refine around a budget that meets nothing
    assert "best capacity" not in tune_table(result)
    assert result.loads_searched["min_scale"] == LATTICE.scale(LATTICE.min_k)
    assert result.loads_searched["min_rps"] == LATTICE.scale(LATTICE.min_k) * 1000.0 / GAP_MS
    payload = write_outputs(result, "sglang", tmp_path)
    assert payload["no_budget_meets_targets"] is True and payload["flag"] is None
    assert payload["loads_searched"]["max_scale"] == LATTICE.scale(LATTICE.max_k)
    assert payload["sloweave_capacity_rps"] == 0.0
    advice = payload["advice"]
    assert any(line.startswith("NO BUDGET MEETS THE TARGETS: none of the 3 budgets swept") for line in advice)
    assert any("does not either" in line for line in advice)
    assert not any(line.startswith(("set:", "best fixed budget")) for line in advice)
    assert json.loads((tmp_path / "tune.json").read_text())["no_budget_meets_targets"] is True
    # where SLOWeave does meet them, its capacity is stated beside the statement
    ours = dataclasses.replace(result, sloweave={**result.sloweave, "capacity_rps": 1.25})
    assert no_budget_lines(ours, "sglang")[1].startswith(
        "SLOWeave (sloweave) does, on the same input: capacity 1.25 req/s"
    )


def test_explicit_budgets_are_swept_exactly_and_say_so(tmp_path):
    out = tmp_path / "tune"
    args = ["tune", "--trace", str(FIXTURES / "azure_conv_first150.csv"), "--seeds", "1", "--window-s", "30"]
    args += ["--budget", "512", "--budget", "2048", "--quick", "--no-refine", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    payload = json.loads((out / "tune.json").read_text())
    assert payload["sweep_plan"]["budgets_from"] == "given (--budget)"
    assert "grid" not in payload["sweep_plan"] and "extensions" not in payload["sweep_plan"]
    swept = {row["budget_tokens"] for row in payload["sweep"]}
    assert swept == {512, 2048} | set(payload["sweep_plan"]["rule_of_thumb_tokens"])
    assert "engine options: " in result.output


def test_cli_default_sweep_follows_the_model(tmp_path):
    """Analytic cost at 25 ms: 431 decodes fill a step, so the sweep starts at 256 on the powers of two."""
    out = tmp_path / "tune"
    args = ["tune", "--trace", str(FIXTURES / "azure_conv_first150.csv"), "--seeds", "1", "--window-s", "30"]
    args += ["--quick", "--no-refine", "--ttft-ms", "20", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    grid = json.loads((out / "tune.json").read_text())["sweep_plan"]["grid"]
    assert grid["ladder"] == "powers of two" and grid["low_tokens"] == 256 and grid["high_tokens"] == 2048
    assert "sweep: 256-2,048 tokens (powers of two), from the cost model" in result.output
