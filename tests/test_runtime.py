"""The measured CPU runtime on the REAL transformers continuous batching (tiny random Llama)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING

from sloweave.cli import main
from sloweave.core.costs.fitted import RegressionCost
from sloweave.core.costs.profile_fit import fit_profile
from sloweave.core.costs.step_profiles import read_profile, write_profile
from sloweave.core.policy import make_policy
from sloweave.core.costs.calibrated import (
    DEFAULT_MARGIN_QUANTILE,
    AdaptiveMargin,
    CalibratedCost,
    OnlineCalibrator,
    ScaledCost,
    SelfCorrection,
)
from sloweave.core.costs.fitted import ResidualMargin
from sloweave.runtime.engine import TransformersEngine
from sloweave.runtime.experiment import build_policy_setup, measure_policy, scaled_workload
from sloweave.runtime.model import load_model
from sloweave.runtime.profiler import run_profile
from sloweave.runtime.runner import RequestSpec, run_requests
from sloweave.runtime.scheduler import KVCacheFullError, PerStepChunkScheduler

DECODES, CHUNKS, CONTEXTS = (0, 2, 4), (0, 16, 64, 128), (16, 96)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return TransformersEngine(model, max_batch_tokens=512, num_blocks=96, page_tokens=32)


@pytest.fixture(scope="module")
def profile_frame(engine):
    return run_profile(engine, DECODES, CHUNKS, CONTEXTS, repeats=2, holdout_per_state=2, seed=0, progress=False)


# The tiny model's steps take a few ms, the size of one time slice of a shared CPU, so a
# noise drop along c is only called a broken profile above 25 ms here.
TOLERANCE_MS = 25.0
LIVE_TOLERANCE_MS = 1000.0  # the live profile's fit (test_profile_fit_schedule_path)
LIVE_MAX_HOLDOUT_ERROR = 100.0  # the largest bound a user may set
# A model of the tiny engine's steps, in RegressionCost's terms (ms; per 1k KV tokens, per query x
# 1M KV tokens): the size of this engine's steps on a CPU, fixed.
STEADY_COEFFICIENTS = np.array([1.0, 0.1, 0.1, 0.4, 0.005, 0.5, 10.0, 0.0, 0.0, 0.0])


@pytest.fixture(scope="module")
def steady_profile(profile_frame):
    """The live profile's steps (the engine's grid, its KV reads, its held-out points), each timed
    by a fixed model with seeded noise of a few per cent: the same on every run. A fit of the
    live times would fail (non-monotone) after a CPU stall on the wrong steps; the tests that
    use ``fitted`` are about scheduling with a fit, not about this minute's timing."""
    steady = profile_frame.copy()
    noise = np.random.default_rng(0).lognormal(0.0, 0.05, len(steady))
    steady["step_ms"] = RegressionCost(STEADY_COEFFICIENTS).predict_frame(steady) * noise
    return steady


@pytest.fixture(scope="module")
def fitted(steady_profile):
    return fit_profile(steady_profile, monotone_tolerance_ms=TOLERANCE_MS)


def request_list() -> RequestSpec:
    # Staggered arrivals (ms) with prompts longer than the small fixed chunks, so that
    # prompts are split, and outputs of 1 (finishes at its prefill) to 12 tokens.
    return RequestSpec(
        arrival_ms=np.array([0.0, 0.0, 2.0, 5.0, 9.0, 30.0, 31.0]),
        prompt_tokens=np.array([150, 40, 300, 7, 90, 220, 33]),
        output_tokens=np.array([12, 5, 8, 1, 10, 6, 3]),
    )


def test_scheduler_is_registered_and_used(engine):
    assert SCHEDULER_MAPPING["sloweave"] is PerStepChunkScheduler
    assert isinstance(engine.processor.scheduler, PerStepChunkScheduler)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("policy_name", ["sloweave", "fixed-16", "fixed-64", "full", "budget-48"])
def test_every_policy_completes_requests_with_the_right_token_counts(engine, fitted, policy_name):
    spec = request_list()
    cost = fitted.regression if policy_name == "sloweave" else None
    policy = make_policy(policy_name, cost, fitted.margin(cost) if cost else None, 256)
    run = run_requests(engine, spec, policy, tpot_ms=40.0, cost=cost, progress=False)
    assert (run.requests["status"] == "finished").all()
    assert run.token_counts == {f"r{i}": int(k) for i, k in enumerate(spec.output_tokens)}
    assert np.all(run.requests["ttft_ms"] > 0)
    steps = run.steps
    # The chunk the policy asked for is the chunk the engine ran, and the model's input
    # tensors held exactly the decodes plus that chunk.
    assert (steps["ran_chunk_tokens"] == steps["chunk_tokens"]).all()
    assert (steps["engine_query_tokens"] == steps["n_decodes"] + steps["chunk_tokens"]).all()
    assert steps["chunk_tokens"].sum() == spec.prompt_tokens.sum()
    if policy_name.startswith("fixed-"):
        size = int(policy_name.split("-")[1])
        assert steps["chunk_tokens"].max() == size
        assert (steps["chunk_tokens"] == np.minimum(size, steps["waiting_tokens"])).all()
    if policy_name == "full":
        assert (
            steps.loc[steps["chunk_tokens"] > 0, "chunk_tokens"]
            == steps.loc[steps["chunk_tokens"] > 0, "waiting_tokens"]
        ).all()
    if policy_name == "budget-48":
        assert (
            steps["chunk_tokens"] == np.minimum(steps["waiting_tokens"], np.maximum(0, 48 - steps["n_decodes"]))
        ).all()
    metrics = run.metrics(ttft_ms=5000.0)
    assert metrics.num_finished == len(spec)


def test_sloweave_chunks_follow_the_real_deadline_budget(engine, fitted):
    """A tighter TPOT target must give smaller chunks, each predicted to fit its budget."""
    spec = RequestSpec(np.array([0.0, 0.0, 0.0, 1.0]), np.array([20, 20, 20, 400]), np.array([40, 40, 40, 2]))
    means = {}
    for tpot in (3.0, 200.0):
        setup = build_policy_setup("sloweave", fitted, use_margin=True, calibrate=False, max_chunk_tokens=400)
        run = run_requests(engine, spec, setup.policy, tpot, cost=setup.cost, progress=False)
        s = run.steps
        chunked = s[(s["n_decodes"] > 0) & (s["chunk_tokens"] > 0)]
        decided = s[(s["n_decodes"] > 0) & (s["waiting_tokens"] > 0)]
        assert len(decided) > 0
        feasible = decided[~decided["infeasible"]]
        assert np.all(feasible["predicted_ms"] + feasible["margin_ms"] <= feasible["budget_ms"] + 1e-9)
        means[tpot] = chunked["chunk_tokens"].mean() if len(chunked) else 0.0
        assert run.token_counts["r3"] == 2
    assert means[3.0] < means[200.0]


def test_profile_fit_schedule_path(engine, profile_frame, fitted, tmp_path):
    grid = profile_frame[profile_frame["split"] == "fit"]
    assert set(grid["n_decodes"]) == set(DECODES)
    assert set(grid["chunk_tokens"]) == set(CHUNKS)
    assert (profile_frame["step_ms"] > 0).all()
    assert (profile_frame[profile_frame["split"] == "holdout"]["chunk_tokens"] > 0).all()
    # decode KV read is recorded from the engine: about n x (context + 1) at each grid point
    row = grid[(grid["n_decodes"] == 4) & (grid["context_tokens"] == 96)].iloc[0]
    assert 4 * 97 <= row["decode_kv_tokens"] <= 4 * 97 + 4 * 60
    path = write_profile(profile_frame, tmp_path / "profile.csv")
    # the live times: a CPU stall over both repeats of a step can make them non-monotone, or
    # scatter them so the held-out error exceeds the default bound; both the fit rightly refuses
    # (tests/test_fit_trust.py). Here only a drop of over a second or a held-out error over
    # 10,000 % would be called broken, so this path does not fail with the machine's load
    tolerance = ["--monotone-tolerance-ms", str(LIVE_TOLERANCE_MS), "--max-holdout-error", str(LIVE_MAX_HOLDOUT_ERROR)]
    out = CliRunner().invoke(main, ["fit", str(path), "--out", str(tmp_path / "fit.json"), *tolerance])
    assert out.exit_code == 0, out.output
    assert "regression_holdout" in out.output
    result = fit_profile(
        read_profile(path), monotone_tolerance_ms=LIVE_TOLERANCE_MS, max_holdout_error=LIVE_MAX_HOLDOUT_ERROR
    )
    assert math.isfinite(result.report["regression_holdout"]["median_abs_rel_error"])
    wl = scaled_workload(
        "mixed",
        8,
        seed=1,
        rate_scale=0.5,
        prompt_scale=0.1,
        output_scale=0.05,
        max_prompt_tokens=300,
        max_output_tokens=8,
    )
    row, run = measure_policy(
        engine, wl, "sloweave", result, tpot_ms=30.0, ttft_ms=3000.0, max_chunk_tokens=256, progress=False
    )
    assert row["measured_num_finished"] == 8
    assert row["chunk_mismatch_steps"] == 0
    assert math.isfinite(row["simulated_goodput_rps"])
    # the row's overrun share is that of the run's steps
    steps = run.steps
    assert row["steps"] == len(steps) > 0
    assert row["overran_prediction_plus_margin_share"] == np.mean(
        steps["step_ms"] > steps["predicted_ms"] + steps["margin_ms"]
    )


def test_profile_command_runs_the_model_in_the_dtype_asked_and_records_where(tmp_path):
    # the GPU check profiles an 8B model in bfloat16 on a GPU (benchmarks/gpu_device_check.sh);
    # here the same command on the CPU, whose dtype and device the profile's meta must name
    assert next(load_model("tiny", dtype="bfloat16").parameters()).dtype == torch.bfloat16
    assert next(load_model("tiny").parameters()).dtype == torch.float32
    out = tmp_path / "p.csv"
    grid = ["--decodes", "0,2", "--chunks", "0,16,32,64", "--contexts", "16,48", "--repeats", "2"]
    done = CliRunner().invoke(main, ["profile", "--model", "tiny", "--dtype", "bfloat16", "--out", str(out), *grid])
    assert out.exists(), done.output
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert meta["dtype"] == "bfloat16" and meta["device"] == "cpu"
    written = read_profile(out)
    assert set(written.loc[written["split"] == "fit", "chunk_tokens"]) == {0, 16, 32, 64}


def test_profile_on_a_gpu_that_is_not_there_is_refused_naming_the_option(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    done = CliRunner().invoke(
        main, ["profile", "--model", "tiny", "--device", "cuda", "--out", str(tmp_path / "p.csv")]
    )
    assert done.exit_code == 2
    assert "--device" in done.output and "no GPU is visible" in done.output
    assert not (tmp_path / "p.csv").exists()
    with pytest.raises(ValueError, match="dtype 'float16' is not one of float32, bfloat16"):
        load_model("tiny", dtype="float16")


def test_online_calibration_learns_a_stale_cost_model(engine, fitted):
    """A cost model far too optimistic is corrected from measured steps as the run goes.

    The stale model is a hundredth of a model of this engine's step size (10-30 us a step): no
    CPU runs these steps within 10x of that, so it is stale on every machine, however fast; the
    calibrator may learn up to 1000x, so what it learns is the machine's, not its bound."""
    stale = ScaledCost(fitted.regression, 0.01)
    calibrator = OnlineCalibrator(max_factor=1000.0)
    cost = CalibratedCost(stale, calibrator)
    policy = make_policy("sloweave", cost, None, 256)
    spec = RequestSpec(np.zeros(4), np.array([60, 60, 200, 120]), np.array([20, 20, 10, 10]))
    run = run_requests(engine, spec, policy, 30.0, cost=cost, calibrator=calibrator, progress=False)
    assert (run.requests["status"] == "finished").all()
    learned = np.exp(calibrator.log_factor[calibrator.observations > 0])
    assert np.median(learned) > 10.0
    s = run.steps
    late = s.iloc[len(s) // 2 :]
    stale_ms = [
        stale.predict(n, c, d, p)
        for n, c, d, p in late[["n_decodes", "chunk_tokens", "decode_kv_tokens", "prefill_prefix_tokens"]].itertuples(
            index=False
        )
    ]
    stale_error = np.median(np.abs(stale_ms / late["step_ms"] - 1))  # about 0.99
    calibrated_error = np.median(np.abs(late["predicted_ms"] / late["step_ms"] - 1))
    assert calibrated_error < stale_error


def test_kv_pool_too_small_is_a_clear_error(model):
    small = TransformersEngine(model, max_batch_tokens=256, num_blocks=3, page_tokens=32)
    spec = RequestSpec(np.zeros(3), np.array([60, 60, 60]), np.array([50, 50, 50]))
    with pytest.raises((KVCacheFullError, RuntimeError)) as err:
        run_requests(small, spec, make_policy("fixed-64"), 50.0, progress=False)
    assert "KV" in str(err.value) or "block" in str(err.value) or "offload" in str(err.value)


def test_run_command_end_to_end(steady_profile, tmp_path):
    path = write_profile(steady_profile, tmp_path / "profile.csv")
    out_dir = tmp_path / "run"
    args = [
        "run",
        "--model",
        "tiny",
        "--profile",
        str(path),
        "--workload",
        "mixed",
        "--requests",
        "6",
        "--rate-scale",
        "0.5",
        "--prompt-scale",
        "0.1",
        "--output-scale",
        "0.05",
        "--max-prompt",
        "256",
        "--max-output",
        "6",
        "--policies",
        "sloweave,fixed-32,fixed-128,full",
        "--tpot-ms",
        "30",
        "--max-chunk",
        "256",
        "--out",
        str(out_dir),
        "--monotone-tolerance-ms",
        "25",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(out_dir / "summary.csv")
    assert list(summary["policy"]) == ["sloweave+margin+calib", "fixed-32", "fixed-128", "full"]
    assert (summary["measured_num_finished"] == 6).all()
    # every policy's goodput over the better of the two fixed chunks measured in this run
    goodput = summary["measured_goodput_rps"]
    best_fixed = goodput[summary["policy"].str.startswith("fixed-")].max()
    expected = goodput / best_fixed if best_fixed > 0 else goodput * math.nan
    np.testing.assert_allclose(summary["goodput_vs_best_fixed"], expected, rtol=1e-12)
    assert (out_dir / "summary.png").stat().st_size > 0
    summary_json = json.loads((out_dir / "summary.json").read_text())
    assert summary_json["sloweave_version"] and summary_json["settings"]["max_prompt"] == 256
    assert [r["policy"] for r in summary_json["runs"]] == list(summary["policy"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--max-prompt", "4090", "--max-output", "48"],
            "--max-prompt 4090 + --max-output 48 tokens exceed the model's context of 4096",
        ),
        (["--model", "no-such-model"], "neither a packaged model"),
    ],
)
def test_run_command_refuses_requests_beyond_the_models_context(steady_profile, tmp_path, extra, message):
    path = write_profile(steady_profile, tmp_path / "profile.csv")
    args = [
        "run",
        "--model",
        "tiny",
        "--profile",
        str(path),
        "--out",
        str(tmp_path / "run"),
        "--monotone-tolerance-ms",
        "25",
        *extra,
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "run").exists()


def test_runtime_policy_setup_uses_the_cores_self_correction(fitted):
    """``build_policy_setup`` takes the core's ``self_correcting`` piece (the simulator's and the
    plug-in's): its calibrated cost, calibrator and adaptive margin at DEFAULT_MARGIN_QUANTILE,
    with the profile's residual table (read through the corrected cost) as the fallback."""
    setup = build_policy_setup(
        "sloweave", fitted, use_margin=True, calibrate=True, max_chunk_tokens=256, stale_factor=0.5
    )
    correction = setup.correction
    assert isinstance(correction, SelfCorrection)
    assert setup.cost is correction.cost is setup.policy.cost and setup.calibrator is correction.calibrator
    assert setup.margin is correction.margin is setup.policy.margin
    assert isinstance(setup.margin, AdaptiveMargin) and setup.margin.quantile == DEFAULT_MARGIN_QUANTILE
    assert isinstance(setup.margin.fallback, ResidualMargin) and setup.margin.fallback.cost is setup.cost
    np.testing.assert_array_equal(setup.margin.fallback.fractions, fitted.margin_fractions)
    assert isinstance(correction.cost.base, ScaledCost) and correction.cost.base.factor == 0.5
    setup.cost.set_context(400, 0)
    assert setup.margin.fraction(4, 64) == fitted.margin(setup.cost).fraction(4, 64)  # the fallback, before min_steps
    for _ in range(setup.margin.min_steps):  # the machine is 3x slower than the stale model, and noiseless
        predicted = setup.cost.base.predict(4, 64, 400, 0)
        setup.calibrator.observe(4, 64, predicted, 3.0 * predicted)
    assert setup.cost(4, 64) == pytest.approx(3.0 * setup.cost.base.predict(4, 64, 400, 0))
    assert setup.margin.fraction(4, 64) == pytest.approx(setup.calibrator.residual_quantile(DEFAULT_MARGIN_QUANTILE))
    # without a margin: the same correction, no margin; without calibration: the profile's table
    bare = build_policy_setup("sloweave", fitted, use_margin=False, calibrate=True)
    assert (
        isinstance(bare.correction, SelfCorrection)
        and bare.margin is None
        and bare.calibrator is bare.correction.calibrator
    )
    static = build_policy_setup("sloweave", fitted, use_margin=True, calibrate=False)
    assert static.correction is None and static.calibrator is None and isinstance(static.margin, ResidualMargin)
    assert build_policy_setup("fixed-32", fitted).correction is None


def test_adaptive_margin_follows_the_recent_residuals(fitted):
    calibrator = OnlineCalibrator(window_steps=100)
    cost = CalibratedCost(fitted.regression, calibrator)
    margin = AdaptiveMargin(cost, fitted.margin(cost), quantile=99.0, min_steps=20)
    cost.set_context(400, 0)
    assert margin.fraction(4, 64) == fitted.margin(cost).fraction(4, 64)  # profile's table at first
    rng = np.random.default_rng(0)
    for _ in range(100):
        predicted = fitted.regression.predict(4, 64, 400, 0)
        calibrator.observe(4, 64, predicted, predicted * float(rng.uniform(1.0, 1.1)))
    # A quiet machine: residuals of the corrected model stay within a few per cent.
    assert 0.0 <= margin.fraction(4, 64) < 0.1
    assert margin(4, 64) == pytest.approx(margin.fraction(4, 64) * cost(4, 64))
    policy = make_policy("sloweave", cost, margin, 256)  # still monotone: the policy accepts it
    assert policy.decide(4, 1000, 1e9).chunk_tokens == 256
