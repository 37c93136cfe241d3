"""Capacity search on cases whose answer is known by hand, its outputs, and the replay command."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from sloweave.studies.capacity import CAPACITY_COLUMNS, pairwise_ratios
from sloweave.cli.capacity import capacity
from sloweave.cli.replay import replay
from sloweave.studies.search import Capacity, CapacityStudy, SearchLattice, SeedCapacity
from sloweave.studies.sources import ScaledWorkloads, SpecSource, trace_source
from sloweave.sim.traces import TraceError, load_trace
from sloweave.sim.workloads import WORKLOADS, Workload

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
SMALL_TRACE = FIXTURES / "azure_conv_first150.csv"  # the first 150 requests of the shared Azure conversation trace


@dataclass(frozen=True)
class ConstantCost:
    """Every iteration takes 10 ms, whatever it holds."""

    ms: float = 10.0

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        return self.ms


def periodic(gap_s: float, n: int = 10) -> Workload:
    # One-token outputs: each request is one prefill iteration, judged on TTFT alone.
    return Workload("periodic", np.arange(n) * gap_s, np.full(n, 100), np.ones(n, dtype=int))


def periodic_source(*gaps_s: float, n: int = 10) -> ScaledWorkloads:
    return ScaledWorkloads("periodic", tuple(periodic(g, n) for g in gaps_s), tuple(1.0 / g for g in gaps_s))


def study(source, ttft_ms, policies=("full", "sloweave"), tpots=(25.0,), **kw) -> CapacityStudy:
    return CapacityStudy(source, list(policies), list(tpots), ttft_ms, cost=ConstantCost(), **kw)


# By hand: requests arrive every g ms and each needs one 10 ms iteration. For g >= 10 every
# TTFT is 10 ms. For g < 10 the queue grows: request i waits i * (10 - g) ms, TTFT_i = 10 + i (10 - g).


def test_capacity_flips_exactly_where_the_server_saturates():
    """TTFT target 10 ms: only g >= 10 ms passes, i.e. 100 req/s = scale 2 of the 50 req/s base."""
    s = study(periodic_source(0.020), ttft_ms=10.0)
    assert s.metrics("full", 0, 16, 25.0).attainment == 1.0  # 2 ** (16/16) = 2: g = 10 ms exactly
    assert s.metrics("full", 0, 17, 25.0).attainment == pytest.approx(0.1)  # g = 9.78 ms: only request 0
    for cap in s.capacities():
        assert cap.capacity_scale == 2.0
        assert cap.capacity_rps == pytest.approx(100.0)
        assert cap.seeds[0].censored == ""


def test_capacity_with_queueing_allowance_matches_hand_computation():
    """TTFT 50 ms, 100 requests, 90 % target: request 89 must pass, 10 + 89 (10 - g) <= 50
    => g >= 10 - 40/89 ms => scale <= 2.094, whose lattice point below is 2 ** (17/16) = 2.089."""
    s = study(periodic_source(0.020, n=100), ttft_ms=50.0, policies=("full",))
    # at 2 ** (17/16), g = 9.576 ms: TTFT_i = 10 + 0.424 i <= 50 for i <= 94
    assert s.metrics("full", 0, 17, 25.0).attainment == pytest.approx(0.95)
    # at 2 ** (18/16), g = 9.170 ms: for i <= 48 only
    assert s.metrics("full", 0, 18, 25.0).attainment == pytest.approx(0.49)
    (cap,) = s.capacities()
    assert cap.capacity_scale == 2 ** (17 / 16) and cap.seeds[0].censored == ""
    assert cap.capacity_rps == pytest.approx(50.0 * 2 ** (17 / 16))


def test_a_run_that_fits_inside_one_ttft_target_has_no_capacity():
    """10 requests, TTFT 50 ms: at scale 4 (g = 5 ms) all arrive within 45 ms and request 8's
    TTFT is 10 + 8 x 5 = 50 ms, so 90 % pass at 200 req/s although the server does 100:
    the answer measures the run's length. It is flagged and reported as no capacity."""
    s = study(periodic_source(0.020), ttft_ms=50.0, policies=("full",))
    assert s.metrics("full", 0, 32, 25.0).attainment == pytest.approx(0.9)
    (cap,) = s.capacities()
    assert cap.seeds[0].k == 32 and cap.seeds[0].censored == "too-short"
    assert not cap.measurable and np.isnan(cap.capacity_rps) and cap.row()["censored"] == "too-short"


def test_seeds_are_searched_separately_and_rounded_down_to_the_lattice():
    # Seed 1 has 25 ms gaps (40 req/s): it saturates at scale 2.5, between lattice points
    # 2 ** (21/16) = 2.48 and 2 ** (22/16) = 2.59, so its capacity is the lower one.
    s = study(periodic_source(0.020, 0.025), ttft_ms=10.0, policies=("full",))
    (cap,) = s.capacities()
    assert [seed.scale for seed in cap.seeds] == [2.0, 2 ** (21 / 16)]
    assert [seed.rps for seed in cap.seeds] == pytest.approx([100.0, 40.0 * 2 ** (21 / 16)])
    row = cap.row()
    assert row["capacity_scale"] == pytest.approx((2.0 + 2 ** (21 / 16)) / 2)
    assert row["capacity_scale_std"] == pytest.approx(np.std([2.0, 2 ** (21 / 16)], ddof=1))
    assert row["capacity_scale_min"] == 2.0 and row["seeds"] == 2
    assert row["step_pct"] == pytest.approx(100 * (2 ** (1 / 16) - 1))


def test_censored_answers_are_flagged():
    below = study(periodic_source(0.020), ttft_ms=5.0, policies=("full",)).capacities()[0]
    assert below.seeds[0].censored == "below-min" and below.capacity_scale == 0.0 and below.capacity_rps == 0.0
    # every gap >= 13 ms > the 10 ms service time: no load searched fails
    above = study(
        periodic_source(0.020, n=100), ttft_ms=200.0, policies=("full",), lattice=SearchLattice(max_scale=1.5)
    ).capacities()[0]
    assert above.seeds[0].censored == "above-max" and above.capacity_scale == 2 ** (10 / 16)
    assert above.row()["censored"] == "above-max"


class ThresholdStudy(CapacityStudy):
    """A study whose attainment passes exactly up to lattice index ``answer``."""

    def __init__(self, answer: int, **kw):
        # a TTFT target shorter than any run, so no answer is too short to count
        super().__init__(periodic_source(0.02), ["full"], [25.0], 0.1, cost=ConstantCost(), **kw)
        self.answer = answer
        self.calls = 0

    def passes(self, policy, seed, k, tpot_ms):
        self.calls += 1
        return k <= self.answer


@settings(max_examples=60, deadline=None, derandomize=True)
@given(answer=st.integers(-64, 127), start=st.one_of(st.none(), st.integers(-64, 128)))
def test_search_finds_the_flip_from_any_start(answer, start):
    s = ThresholdStudy(answer)  # lattice -64 .. 128 (1/16 .. 256 at 16 steps per doubling)
    result = s.search_seed("full", 25.0, 0, start)
    if answer < s.min_k:
        assert result.censored == "below-min"
    else:
        assert result.k == answer and result.scale == 2.0 ** (answer / 16)
        assert result.censored == ("above-max" if answer >= s.max_k else "")
    # Galloping + bisection: logarithmic in the lattice size, not linear.
    assert s.calls <= 2 * int(np.ceil(np.log2(s.max_k - s.min_k + 1))) + 3


def test_static_policy_runs_are_shared_across_tpot_targets():
    s = study(periodic_source(0.020), ttft_ms=50.0, tpots=(10.0, 25.0, 50.0))
    caps = s.capacities()
    assert len(caps) == 6
    keys = list(s._runs)
    assert all(tpot is None for policy, _, _, tpot in keys if policy == "full")
    assert {tpot for policy, _, _, tpot in keys if policy == "sloweave"} == {10.0, 25.0, 50.0}


def test_pairwise_ratios_compare_each_sloweave_with_the_best_of_its_own_rule():
    def cap(policy, *scales):
        seeds = tuple(SeedCapacity(i, 0, s, 10.0 * s, "") for i, s in enumerate(scales))
        return Capacity("src", policy, 25.0, 1000.0, 0.9, seeds, 2 ** (1 / 16))

    table = pairwise_ratios(
        [
            cap("sloweave", 2.0, 3.0),
            cap("fixed-256", 1.0, 1.5),
            cap("fixed-1024", 1.5, 2.0),
            cap("full", 2.5, 2.5),
            cap("sloweave-multi", 3.0, 3.0),
            cap("sarathi-512", 2.0, 4.0),
            cap("sarathi-2048", 1.0, 1.0),
        ]
    )
    rows = {r["policy"]: r for r in table.to_dict(orient="records")}
    one = rows["sloweave"]
    # the best fixed chunk, never another rule (full prefill is not a fixed budget)
    assert one["baseline_rule"] == "fixed" and one["best_baseline"] == "fixed-1024" and one["budgets_swept"] == 2
    assert one["ratio"] == pytest.approx(2.5 / 1.75)
    assert one["ratio_seed_min"] == pytest.approx(4 / 3) and one["ratio_seed_max"] == pytest.approx(1.5)
    assert one["capacity_rps"] == pytest.approx(25.0)
    multi = rows["sloweave-multi"]
    # sloweave-multi against vLLM's rule only, even where a fixed chunk is worse
    assert multi["baseline_rule"] == "sarathi" and multi["best_baseline"] == "sarathi-512"
    assert multi["ratio"] == pytest.approx(1.0) and multi["ratio_seed_min"] == pytest.approx(0.75)
    assert len(table) == 2  # no budget-B policies: no sloweave-vs-budget row


def test_pairwise_ratio_is_empty_where_the_run_was_too_short():
    short = tuple(SeedCapacity(i, 0, 4.0, 40.0, "too-short") for i in range(2))
    fine = tuple(SeedCapacity(i, 0, 2.0, 20.0, "") for i in range(2))
    caps = [
        Capacity("src", "sloweave", 25.0, 1000.0, 0.9, short, 1.05),
        Capacity("src", "fixed-512", 25.0, 1000.0, 0.9, fine, 1.05),
    ]
    (row,) = pairwise_ratios(caps).to_dict(orient="records")
    assert np.isnan(row["ratio"]) and np.isnan(row["capacity_rps"]) and "too short" in row["note"]
    assert caps[0].row()["capacity_rps"] != caps[0].row()["capacity_rps"]  # NaN, not 40 req/s


def test_spec_source_scales_the_generator_rate():
    source = SpecSource(WORKLOADS["chat"], 50, (0, 1))
    assert source.num_seeds == 2 and source.base_rate_rps(1) == WORKLOADS["chat"].rate_rps
    np.testing.assert_array_equal(source.workload(1, 2.0).arrival_s, WORKLOADS["chat"].generate(50, 1, 2.0).arrival_s)


def test_trace_source_windows_and_generated_arrivals():
    trace = load_trace(SMALL_TRACE)
    source = trace_source(trace, 3)
    assert sum(len(w) for w in source.base) == 150
    assert source.base_rate_rps(0) == pytest.approx(len(source.base[0]) / (trace.span_s / 3))
    fast = source.workload(0, 4.0)
    np.testing.assert_allclose(fast.arrival_s * 4.0, source.base[0].arrival_s)
    lengths = load_trace(FIXTURES / "lengths_only.csv")
    generated = trace_source(lengths, 2, arrivals="poisson", rate_rps=2.0, requests_per_seed=3)
    assert "GENERATED" in generated.describe()["kind"]
    assert all(len(w) == 3 for w in generated.base) and generated.base_rate_rps(0) == 2.0
    with pytest.raises(TraceError, match="no arrival times"):
        trace_source(lengths, 2)


# ---------------------------------------------------------------- commands

SMALL_CAPACITY_ARGS = [
    "--trace", str(SMALL_TRACE), "--seeds", "2", "--policy", "sloweave", "--policy", "full", "--policy", "fixed-256",
    "--tpot-ms", "10", "--tpot-ms", "50", "--steps-per-doubling", "4", "--whole-trace", "--max-scale", "16",
]  # fmt: skip


def test_capacity_command_writes_the_table_plots_and_json(tmp_path):
    out = tmp_path / "cap"
    result = CliRunner().invoke(capacity, [*SMALL_CAPACITY_ARGS, "--out", str(out)])
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "capacity.csv")
    assert list(table.columns) == CAPACITY_COLUMNS
    assert len(table) == 6 and set(table["tpot_ms"]) == {10.0, 50.0}
    assert (table["ttft_ms"] == 1000.0).all() and (table["attainment_target"] == 0.9).all()
    assert (table["capacity_scale"] > 0).all() and (table["capacity_rps"] > 0).all()
    # A static policy can only gain from a looser TPOT target.
    full = table[table["policy"] == "full"].set_index("tpot_ms")["capacity_scale"]
    assert full[50.0] >= full[10.0]
    relative = pd.read_csv(out / "relative.csv")
    assert list(relative["best_baseline"]) == ["fixed-256", "fixed-256"] and set(relative["policy"]) == {"sloweave"}
    curves = pd.read_csv(out / "curves.csv")
    assert {"attainment", "goodput_rps", "rate_rps"} <= set(curves.columns)
    assert set(curves["policy"]) == {"sloweave", "full", "fixed-256"}
    for png in ["attainment_vs_load.png", "goodput_vs_load.png", "cdf_ttft_tpot10.png", "cdf_p99_tpot_tpot50.png"]:
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    payload = json.loads((out / "capacity.json").read_text())
    assert payload["source"]["kind"].startswith("trace") and len(payload["source"]["seeds"]) == 2
    # Same inputs, same bytes.
    again = tmp_path / "again"
    assert CliRunner().invoke(capacity, [*SMALL_CAPACITY_ARGS, "--out", str(again)]).exit_code == 0
    assert (again / "capacity.csv").read_bytes() == (out / "capacity.csv").read_bytes()
    assert (again / "curves.csv").read_bytes() == (out / "curves.csv").read_bytes()


def test_capacity_command_rejects_bad_sources(tmp_path):
    runner = CliRunner()
    both = runner.invoke(capacity, ["--trace", str(SMALL_TRACE), "--workload", "chat", "--out", str(tmp_path)])
    assert both.exit_code != 0 and "not both" in both.output
    lengths = runner.invoke(capacity, ["--trace", str(FIXTURES / "lengths_only.csv"), "--out", str(tmp_path)])
    assert lengths.exit_code != 0 and "no arrival times" in lengths.output
    bad = runner.invoke(capacity, ["--trace", str(FIXTURES / "bad_unsorted.csv"), "--out", str(tmp_path)])
    assert bad.exit_code != 0 and "bad_unsorted.csv, line 5" in bad.output


def test_replay_command_runs_policies_and_writes_outputs(tmp_path):
    out = tmp_path / "replay"
    args = [
        str(SMALL_TRACE),
        "--rate-scale",
        "4",
        "--max-prompt-tokens",
        "2048",
        "--policy",
        "sloweave",
        "--policy",
        "full",
    ]
    result = CliRunner().invoke(replay, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    requests = pd.read_csv(out / "requests.csv")
    assert len(requests) == 300 and set(requests["policy"]) == {"sloweave", "full"}
    payload = json.loads((out / "replay.json").read_text())
    assert payload["replay"]["rate_scale"] == 4.0 and not payload["replay"]["arrivals_generated"]
    assert payload["replay"]["num_prompts_capped"] == int((load_trace(SMALL_TRACE).prompt_tokens > 2048).sum()) > 0
    assert "prompt(s) capped" in result.output
    metrics = pd.read_csv(out / "metrics.csv")
    assert set(metrics["policy"]) == {"sloweave", "full"}
    # each policy's attainment is the share of its requests that met both targets, in requests.csv
    met = requests.groupby("policy")["slo_met"].mean()
    assert all(metrics.set_index("policy")["attainment"][p] == met[p] for p in ("sloweave", "full"))
    assert (out / "cdf_ttft.png").exists() and (out / "cdf_p99_tpot.png").exists()


def test_replay_command_refuses_length_only_files_unless_arrivals_are_generated(tmp_path):
    lengths = str(FIXTURES / "lengths_only.csv")
    refused = CliRunner().invoke(replay, [lengths, "--out", str(tmp_path / "a")])
    assert refused.exit_code != 0 and "no arrival times" in refused.output
    ok = CliRunner().invoke(
        replay, [lengths, "--arrivals", "poisson", "--rate-rps", "2", "--policy", "full", "--out", str(tmp_path / "b")]
    )
    assert ok.exit_code == 0, ok.output
    assert "ARRIVALS generated: Poisson" in ok.output
    payload = json.loads((tmp_path / "b" / "replay.json").read_text())
    assert payload["replay"]["arrivals_generated"] and "no arrival times" in payload["replay"]["arrivals"]


def test_capacity_fits_a_step_time_profile_to_the_kind_asked_and_refuses_the_option_otherwise(tmp_path):
    """--cost-kind picks the table or the regression fitted from a step-time profile file (the CPU
    engine's table is the fit whose prefill rate peaks below the largest chunk); for any other
    cost it is refused, not ignored."""
    profile = Path(__file__).parents[1] / "benchmarks" / "results-vllm-cpu" / "at-load" / "profile.csv"
    args = ["--trace", str(SMALL_TRACE), "--seeds", "1", "--policy", "sloweave", "--tpot-ms", "40"]
    args += ["--steps-per-doubling", "2", "--whole-trace", "--no-curves", "--cost", str(profile)]
    runs = {}
    for kind in ("table", "regression"):
        out = tmp_path / kind
        result = CliRunner().invoke(capacity, [*args, "--cost-kind", kind, "--out", str(out)])
        assert result.exit_code == 0, result.output
        runs[kind] = json.loads((out / "capacity.json").read_text())
    assert runs["table"]["cost"]["kind"] == "table" and runs["regression"]["cost"]["kind"] == "regression"
    refused = CliRunner().invoke(capacity, [*SMALL_CAPACITY_ARGS, "--cost-kind", "table", "--out", str(tmp_path / "x")])
    assert refused.exit_code == 2 and "--cost-kind" in refused.output and "step-time profile" in refused.output
