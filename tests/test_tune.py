"""`sloweave tune` on a case whose best budget is worked out by hand, its outputs and its CLI."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sloweave.studies.sources import ScaledWorkloads
from sloweave.cli import main
from sloweave.studies.search import SearchLattice
from sloweave.studies.tune import RuleOfThumb, nearest_power_of_two, tune
from sloweave.studies.tune_report import flag_for
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
    cmp = result.comparisons()
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
