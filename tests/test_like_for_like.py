"""Like for like (issue 13): engine options for every policy, prediction error and online
correction in the simulator, tuned baselines, parallel = serial, scenarios, result files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from sloweave.core.costs.calibrated import DEFAULT_MARGIN_QUANTILE, AdaptiveMargin, self_correcting
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.policy import FixedChunk, SLOWeave
from sloweave.sim.metrics import evaluate
from sloweave.sim.options import EngineOptions
from sloweave.sim.workloads import SCENARIOS, WORKLOADS, Workload, WorkloadError, back_to_back_workloads
from sloweave.studies.capacity import capacity_frame
from sloweave.cli.capacity import capacity
from sloweave.studies.outputs import strict_json
from sloweave.studies.parallel import Runner
from sloweave.studies.search import TUNING_GRID_TOKENS, CapacityStudy, SearchLattice, refined_budgets
from sloweave.studies.sources import ScaledWorkloads, SpecSource, back_to_back

SMALL_TRACE = Path(__file__).parent / "fixtures" / "traces" / "azure_conv_first150.csv"
COST = AnalyticCost()


@pytest.fixture(scope="module")
def mixed_400():
    return WORKLOADS["mixed"].generate(400, seed=3)


# ---------------------------------------------------------------- engine options


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"noise_sigma": math.inf}, "noise_sigma must be a finite number"),
        ({"noise_sigma": math.nan}, "noise_sigma must be a finite number"),
        ({"bias": 0.0}, "bias must be a finite number >= 1e-06"),
        ({"admission": "maybe"}, "admission must be one of reject, defer"),
        ({"correction": "false"}, "correction must be true or false"),
        ({"aging_ms": -1.0}, "aging_ms"),
        ({"deadline_form": "sliding"}, "deadline_form must be one of"),
    ],
)
def test_bad_engine_options_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineOptions(**kwargs)


def test_admission_control_applies_to_a_fixed_chunk_too(mixed_400):
    overload = Workload("over", mixed_400.arrival_s / 4, mixed_400.prompt_tokens, mixed_400.output_tokens)
    plain = EngineOptions().simulate(overload, FixedChunk(512), 25.0, 2000.0, COST)
    gated = EngineOptions(admission="reject").simulate(overload, FixedChunk(512), 25.0, 2000.0, COST)
    assert plain.rejected_reason is None or not np.any(plain.rejected_reason != "")
    assert np.count_nonzero(gated.rejected_reason != "") > 0
    # every request is accounted for: finished or rejected with a reason
    assert np.all(gated.finished | (gated.rejected_reason != ""))


def test_bias_makes_every_iteration_that_many_times_the_model(mixed_400):
    result = EngineOptions(bias=1.25).simulate(mixed_400, FixedChunk(512), 25.0, 2000.0, COST)
    model = np.array([COST(int(n), int(c)) for n, c in zip(result.iter_decodes, result.iter_chunk_tokens)])
    assert np.allclose(result.iter_end_ms - result.iter_start_ms, 1.25 * model)


def test_noise_is_seeded_and_the_same_for_every_policy_run(mixed_400):
    opts = EngineOptions(noise_sigma=0.1)
    a = opts.simulate(mixed_400, FixedChunk(512), 25.0, 2000.0, COST, noise_seed=1)
    b = opts.simulate(mixed_400, FixedChunk(512), 25.0, 2000.0, COST, noise_seed=1)
    c = opts.simulate(mixed_400, FixedChunk(512), 25.0, 2000.0, COST, noise_seed=2)
    assert np.array_equal(a.iter_end_ms, b.iter_end_ms) and not np.array_equal(a.iter_end_ms, c.iter_end_ms)


def test_online_correction_in_the_simulator_learns_a_bias_and_keeps_tpot(mixed_400):
    """The machine is 1.25x slower than the model. Uncorrected, SLOWeave fills every budget
    with a chunk the model says fits and overruns; corrected, it learns the factor and its
    P99 TPOT holds the target."""
    load = Workload("load", mixed_400.arrival_s / 0.8, mixed_400.prompt_tokens, mixed_400.output_tokens)
    raw = evaluate(EngineOptions(bias=1.25).simulate(load, SLOWeave(cost=COST), 25.0, 2000.0, COST), 2000.0, 25.0)
    fixed = evaluate(
        EngineOptions(bias=1.25, correction=True).simulate(load, SLOWeave(cost=COST), 25.0, 2000.0, COST), 2000.0, 25.0
    )
    assert raw.p99_tpot_ms > 25.0 * 1.1
    assert fixed.p99_tpot_ms <= 25.0 + 1e-9
    assert fixed.attainment > raw.attainment


def test_self_correction_is_one_piece_with_the_p997_margin():
    parts = self_correcting(COST)
    assert isinstance(parts.margin, AdaptiveMargin) and parts.margin.quantile == DEFAULT_MARGIN_QUANTILE == 99.7
    assert parts.margin(4, 256) == 0.0  # no steps seen, no profile: no margin yet
    for _ in range(60):
        parts.calibrator.observe(4, 256, COST(4, 256), 1.25 * COST(4, 256) * (1 + 0.05 * (_ % 3)))
    assert parts.cost(4, 256) == pytest.approx(1.25 * COST(4, 256), rel=0.1)
    assert parts.margin(4, 256) > 0.0
    with pytest.raises(ValueError, match="quantile"):
        self_correcting(COST, quantile=100.0)


def test_correction_changes_nothing_for_a_static_rule(mixed_400):
    a = EngineOptions(noise_sigma=0.1).simulate(mixed_400, FixedChunk(512), 25.0, 2000.0, COST)
    b = EngineOptions(noise_sigma=0.1, correction=True).simulate(mixed_400, FixedChunk(512), 25.0, 2000.0, COST)
    assert np.array_equal(a.iter_end_ms, b.iter_end_ms)


# ---------------------------------------------------------------- tuned baselines, parallel


def test_refined_budgets_are_the_geometric_midpoints_around_the_best():
    assert refined_budgets(1024, [512, 1024, 2048]) == [704, 1472]
    assert refined_budgets(512, [512, 1024]) == [704]  # at the grid's edge: one side only


def small_study(**kw) -> CapacityStudy:
    source = SpecSource(WORKLOADS["mixed"], 300, (0, 1))
    return CapacityStudy(
        source,
        ["sloweave", "fixed-tuned"],
        [25.0],
        200.0,
        SearchLattice(steps_per_doubling=4, min_scale=1 / 4, max_scale=16.0),
        **kw,
    )


def test_a_tuned_rule_is_its_best_budget_per_target_after_refinement():
    study = small_study()
    caps = study.capacities()
    fixed = {c.policy: c for c in caps if c.policy.startswith("fixed-") and c.policy != "fixed-tuned"}
    assert {f"fixed-{b}" for b in TUNING_GRID_TOKENS} <= set(fixed)
    assert len(fixed) > len(TUNING_GRID_TOKENS)  # the refinement round added midpoints
    (tuned,) = [c for c in caps if c.policy == "fixed-tuned"]
    best = max(fixed.values(), key=lambda c: (c.capacity_rps, -int(c.policy.split("-")[1])))
    assert tuned.tuned_to == best.policy and tuned.seeds == best.seeds


def test_parallel_capacity_study_equals_serial_bit_for_bit():
    serial = small_study(runner=Runner(jobs=1), options=EngineOptions(noise_sigma=0.1, correction=True))
    parallel = small_study(runner=Runner(jobs=2), options=EngineOptions(noise_sigma=0.1, correction=True))
    a, b = capacity_frame(serial.capacities()), capacity_frame(parallel.capacities())
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert serial.simulations == parallel.simulations
    lattice = serial.curve_lattice(serial.capacities())
    pd.testing.assert_frame_equal(
        serial.curves(lattice, ["sloweave"]), parallel.curves(lattice, ["sloweave"]), check_exact=True
    )


# ---------------------------------------------------------------- scenarios


def test_drift_scenario_is_chat_then_long_documents_then_bursts():
    spec = SCENARIOS["drift"]
    wl = spec.generate(600, seed=1)
    sizes = spec.phase_sizes(600)
    assert sum(sizes) == 600 and len(wl) == 600 and np.all(np.diff(wl.arrival_s) >= 0)
    chat, docs, bursts = np.split(wl.prompt_tokens, np.cumsum(sizes)[:-1])
    assert np.median(docs) > 5 * np.median(chat) and np.median(docs) > 5 * np.median(bursts)
    # equal time per phase at each family's own rate
    ends = np.cumsum(sizes)
    spans = [wl.arrival_s[e - 1] - wl.arrival_s[s] for s, e in zip([0, *ends[:-1]], ends)]
    assert max(spans) / min(spans) < 1.6
    assert spec.generate(600, seed=1).arrival_s.tolist() == wl.arrival_s.tolist()  # seeded
    with pytest.raises(WorkloadError, match="one request per phase"):
        spec.generate(2, seed=1)


def test_back_to_back_workloads_and_sources():
    a = Workload("a", np.array([0.0, 1.0, 2.0]), np.array([10, 10, 10]), np.array([1, 1, 1]))
    b = Workload("b", np.array([5.0, 5.5]), np.array([20, 20]), np.array([2, 2]))
    joined = back_to_back_workloads([a, b], "a+b")
    assert joined.arrival_s.tolist() == [0.0, 1.0, 2.0, 3.0, 3.5]  # b starts one mean gap after a ends
    assert joined.prompt_tokens.tolist() == [10, 10, 10, 20, 20]
    src = back_to_back([ScaledWorkloads("a", (a,), (1.0,)), ScaledWorkloads("b", (b,), (2.0,))])
    assert src.name == "a+b" and src.num_seeds == 1 and src.base_rate_rps(0) == pytest.approx(5 / 3.5)
    with pytest.raises(WorkloadError, match="same number of seeds"):
        back_to_back([ScaledWorkloads("a", (a,), (1.0,)), ScaledWorkloads("b", (b, b), (2.0, 2.0))])


def test_a_target_change_serves_and_judges_the_second_half_to_the_new_target():
    source = SpecSource(WORKLOADS["mixed"], 200, (0,))
    study = CapacityStudy(
        source, ["sloweave"], [25.0], 2000.0, SearchLattice(steps_per_doubling=4), tpot_change_ms=10.0
    )
    targets = study._targets(200, 25.0)
    assert targets[:100].tolist() == [25.0] * 100 and targets[100:].tolist() == [10.0] * 100
    run = study.run("sloweave", 0, 0, 25.0).requests
    p99 = run["p99_tpot_ms"].to_numpy()
    late = run["request"].to_numpy() >= 100
    # the deadline policy was given the per-request targets: its late requests keep 10 ms
    assert np.nanpercentile(p99[late], 50) <= 10.0 + 1e-9 < np.nanpercentile(p99[~late], 50)


# ---------------------------------------------------------------- command and result files


def test_strict_json_writes_null_for_non_finite_numbers():
    text = strict_json({"a": math.nan, "b": [math.inf, 1.5], "c": np.float64(2.0), "d": np.int64(3)})
    assert json.loads(text) == {"a": None, "b": [None, 1.5], "c": 2.0, "d": 3}
    assert "NaN" not in text and "Infinity" not in text


def test_capacity_command_runs_every_policy_with_the_same_engine_options(tmp_path):
    out = tmp_path / "cap"
    args = [
        "--trace",
        str(SMALL_TRACE),
        "--seeds",
        "2",
        "--whole-trace",
        "--steps-per-doubling",
        "4",
        "--max-scale",
        "16",
        "--tpot-ms",
        "25",
        "--policy",
        "sloweave",
        "--policy",
        "sloweave-multi",
        "--policy",
        "fixed-512",
        "--policy",
        "sarathi-512",
        "--admission",
        "reject",
        "--noise-sigma",
        "0.1",
        "--correction",
        "--no-curves",
        "--jobs",
        "2",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(capacity, args)
    assert result.exit_code == 0, result.output
    text = (out / "capacity.json").read_text()
    payload = json.loads(text)
    assert "NaN" not in text and payload["sloweave_version"]
    assert payload["engine_options"]["admission"] == "reject" and payload["engine_options"]["correction"] is True
    relative = pd.read_csv(out / "relative.csv")
    assert dict(zip(relative["policy"], relative["best_baseline"])) == {
        "sloweave": "fixed-512",
        "sloweave-multi": "sarathi-512",
    }
    assert not (out / "curves.csv").exists()
    assert "like for like" in result.output


def test_capacity_command_refuses_bad_options_before_any_work(tmp_path):
    runner = CliRunner()
    base = ["--workload", "mixed", "--requests", "50", "--tpot-ms", "25"]
    bad = runner.invoke(capacity, [*base, "--noise-sigma", "inf", "--out", str(tmp_path / "a")])
    assert (
        bad.exit_code != 0
        and "Invalid value for '--noise-sigma': the value must be a finite number >= 0 and <= 3" in bad.output
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    unwritable = runner.invoke(capacity, [*base, "--out", str(blocker / "sub")])
    assert unwritable.exit_code != 0 and "cannot write results" in unwritable.output
    tuned = runner.invoke(capacity, [*base, "--policy", "chunky-tuned", "--out", str(tmp_path / "b")])
    assert tuned.exit_code != 0 and "unknown tuned policy 'chunky-tuned'" in tuned.output
