"""The twin's machine as it drifts and its plug-in as it was (issue 24): a step log's pace replayed
along the simulated clock (``core.costs.machine_pace``), and an online correction warmed with the
steps the engine served before the run (``core.costs.warm_start``)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.calibrated import OnlineCalibrator
from sloweave.core.costs.empirical_noise import EmpiricalNoiseCost, StepNoiseError, step_noise_from_file
from sloweave.core.costs.machine_pace import MIN_PACE_STEPS, MachinePace, PaceError
from sloweave.core.costs.step_profiles import ProfileError, read_profile
from sloweave.core.costs.warm_start import warm_correction
from sloweave.core.policy import SLOWeave
from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions
from sloweave.sim.workloads import WORKLOADS

COST = AnalyticCost()
SHAPES = [(8, 0), (8, 256), (16, 0), (16, 512), (4, 1024), (32, 128)]
SLOW_FROM_MS, SLOW_TO_MS, SLOW_PACE = 4_000.0, 6_000.0, 1.5
JITTER_MS = 0.2


def drifting_steps(seconds: float = 10.0, every_ms: float = 5.0, seed: int = 0) -> pd.DataFrame:
    """A step every ``every_ms``, cycling through ``SHAPES``: the analytic model's time plus a small
    jitter, and 1.5 times it while another process held the machine (4-6 s)."""
    rng = np.random.default_rng(seed)
    start = np.arange(0.0, seconds * 1000.0, every_ms)
    n, c = (np.array([SHAPES[i % len(SHAPES)][k] for i in range(start.size)]) for k in (0, 1))
    predicted = np.array([COST(int(a), int(b)) for a, b in zip(n, c)])
    pace = np.where((start >= SLOW_FROM_MS) & (start < SLOW_TO_MS), SLOW_PACE, 1.0)
    measured = predicted * pace + np.abs(rng.normal(0.0, JITTER_MS, start.size))
    return pd.DataFrame({"n_decodes": n, "chunk_tokens": c, "decode_kv_tokens": 100 * n, "prefill_prefix_tokens": 0,
                         "step_ms": measured, "start_ms": 50_000.0 + start})  # fmt: skip


@pytest.fixture(scope="module")
def drifting_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("pace") / "drifting.csv"
    drifting_steps().to_csv(path, index=False)
    return path


# ---------------------------------------------------------------- the pace


def test_the_pace_follows_a_slow_stretch_and_wraps_past_the_sources_span():
    steps = drifting_steps()
    predicted = [COST(int(n), int(c)) for n, c in zip(steps.n_decodes, steps.chunk_tokens)]
    pace = MachinePace.of_steps(steps.start_ms, predicted, steps.step_ms, window_ms=1000.0)
    assert pace.start_ms == 50_000.0 and pace.span_ms == pytest.approx(9_995.0)
    assert pace.at(5_000.0) == pytest.approx(SLOW_PACE, abs=0.05)
    assert pace.at(1_000.0) == pytest.approx(1.0, abs=0.05) and pace.at(8_500.0) == pytest.approx(1.0, abs=0.05)
    assert pace.at(5_000.0 + pace.span_ms) == pace.at(5_000.0)  # a twin longer than its source wraps
    assert pace.describe()["pace_p95"] == pytest.approx(SLOW_PACE, abs=0.05)
    with pytest.raises(PaceError, match=f"a pace needs {MIN_PACE_STEPS}"):
        MachinePace.of_steps(steps.start_ms[:5], predicted[:5], steps.step_ms[:5], window_ms=1000.0)
    with pytest.raises(ValueError, match="window_ms"):
        MachinePace.of_steps(steps.start_ms, predicted, steps.step_ms, window_ms=0.0)


def test_paced_residuals_are_the_jitter_without_the_drift(drifting_profile):
    """Against one cost for the whole run, the slow stretch is noise on every step (a fifth of the
    steps half their time late); with the pace kept apart the residuals are the jitter (and the
    pace's blur at the stretch's edges, a few steps)."""
    plain, paced = (step_noise_from_file(drifting_profile, COST, window) for window in (0.0, 1000.0))
    assert plain.pace is None and paced.pace is not None
    p95 = {name: max(np.percentile(bucket, 95) for kind in noise.kinds for bucket in kind.residuals_ms)
           for name, noise in (("plain", plain), ("paced", paced))}  # fmt: skip
    assert p95["plain"] > 3.0 and p95["paced"] < 1.0
    assert paced.describe()["pace"]["window_ms"] == 1000.0 and "pace" not in plain.describe()


def test_a_paced_machine_is_slow_when_its_source_was(drifting_profile):
    noise = step_noise_from_file(drifting_profile, COST, 1000.0)
    machine = EmpiricalNoiseCost(COST, noise, seed=1)
    assert (
        machine.reads_clock
        and not EmpiricalNoiseCost(COST, step_noise_from_file(drifting_profile, COST), 1).reads_clock
    )

    def mean_ratio(at_ms: float) -> float:
        machine.set_time_ms(at_ms)
        return float(np.mean([machine(n, c) / COST(n, c) for n, c in SHAPES * 50]))

    assert mean_ratio(5_000.0) == pytest.approx(SLOW_PACE, abs=0.05)
    assert mean_ratio(2_000.0) == pytest.approx(1.0, abs=0.05)
    with pytest.raises(StepNoiseError, match="blocks of the timeline"):
        EmpiricalNoiseCost(COST, noise, seed=1, block_steps=100)


def iteration_pace(result) -> tuple[np.ndarray, np.ndarray]:
    """Each simulated iteration's start (ms) and its time over the machine's model."""
    steps = zip(result.iter_decodes.tolist(), result.iter_chunk_tokens.tolist())
    model = np.array([COST(n, c) for n, c in steps])
    return result.iter_start_ms, (result.iter_end_ms - result.iter_start_ms) / model


def test_a_simulation_meets_the_slow_stretch_at_the_same_time_as_its_source(drifting_profile):
    """Paced, the simulated iterations in 4-6 s run 1.5x the model and the others 1x; drawn without
    the pace, the stretch is spread over the whole run. The same seed gives the same run."""
    workload = WORKLOADS["chat"].generate(400, seed=0)
    share = {}
    for window in (0.0, 1000.0):
        options = EngineOptions(step_noise_from=str(drifting_profile), step_noise_pace_ms=window)
        result = options.simulate(workload, SLOWeave(cost=COST), 25.0, 1000.0, COST, 3)
        start, ratio = iteration_pace(result)
        inside = (start >= SLOW_FROM_MS + 200) & (start < SLOW_TO_MS - 200)
        assert inside.sum() > 100 and (start > 7_000).sum() > 100  # the workload spans the stretch
        share[window] = (np.median(ratio[inside]), np.median(ratio[start < SLOW_FROM_MS]))
        again = options.simulate(workload, SLOWeave(cost=COST), 25.0, 1000.0, COST, 3)
        assert np.array_equal(again.iter_end_ms, result.iter_end_ms)
    assert share[1000.0][0] == pytest.approx(SLOW_PACE, abs=0.1) and share[1000.0][1] == pytest.approx(1.0, abs=0.1)
    assert abs(share[0.0][0] - share[0.0][1]) < 0.15


def test_the_pace_option_needs_a_timed_source_and_is_one_way_of_keeping_the_drift(drifting_profile, tmp_path):
    options = EngineOptions(step_noise_from=str(drifting_profile), step_noise_pace_ms=1000.0)
    assert options.describe(COST)["step_noise"]["pace"]["window_ms"] == 1000.0
    assert "step_noise_pace_ms" not in DEFAULT_OPTIONS.describe()
    untimed = tmp_path / "untimed.csv"
    drifting_steps().drop(columns="start_ms").to_csv(untimed, index=False)
    with pytest.raises(StepNoiseError, match=r"no step start times \(start_ms\)"):
        EngineOptions(step_noise_from=str(untimed), step_noise_pace_ms=1000.0)
    with pytest.raises(ValueError, match="step_noise_pace_ms paces the machine of step_noise_from"):
        EngineOptions(step_noise_pace_ms=1000.0)
    with pytest.raises(ValueError, match="two ways to keep the machine's drift"):
        EngineOptions(step_noise_from=str(drifting_profile), step_noise_pace_ms=1000.0, step_noise_block_steps=500)
    for bad in (-1.0, float("nan"), True):
        with pytest.raises(ValueError, match="step_noise_pace_ms"):
            EngineOptions(step_noise_from=str(drifting_profile), step_noise_pace_ms=bad)
    clockless = tmp_path / "clockless.csv"
    drifting_steps().assign(start_ms=lambda f: np.where(f.index == 3, np.nan, f.start_ms)).to_csv(
        clockless, index=False
    )
    with pytest.raises(ProfileError, match="start_ms=nan"):
        read_profile(clockless)


# ---------------------------------------------------------------- the warm start


def steps_on_a_slower_machine(path, steps: int = 2000, slower: float = 1.5):
    rows = [SHAPES[i % len(SHAPES)] for i in range(steps)]
    pd.DataFrame({"n_decodes": [n for n, _ in rows], "chunk_tokens": [c for _, c in rows],
                  "decode_kv_tokens": [100 * n for n, _ in rows], "prefill_prefix_tokens": 0,
                  "step_ms": [slower * COST(n, c) for n, c in rows]}).to_csv(path, index=False)  # fmt: skip
    return path


def test_a_warmed_calibrator_has_learnt_the_machine_its_steps_ran_on(tmp_path):
    calibrator = OnlineCalibrator()
    assert warm_correction(calibrator, COST, steps_on_a_slower_machine(tmp_path / "served.csv")) == 2000
    assert calibrator.factor(16, True) == pytest.approx(1.5, rel=0.01)
    assert calibrator.factor(8, False) == pytest.approx(1.5, rel=0.01)


def first_chunks_and_late(result, iterations: int = 200) -> tuple[float, int]:
    """The mean chunk of the first ``iterations`` and how many of their steps with decodes ran late."""
    steps = result.iter_end_ms - result.iter_start_ms
    first = slice(0, iterations)
    late = (result.iter_decodes[first] > 0) & (steps[first] > result.iter_budget_ms[first] + 1e-6)
    return float(np.mean(result.iter_chunk_tokens[first])), int(late.sum())


def test_a_warm_start_begins_where_the_served_engine_left_off(tmp_path):
    """On a machine 1.5x slower than the policy's cost, a cold correction holds its first chunks
    back while it learns (its margin the relative form, its factors one); warmed with 2,000 steps
    of that machine it takes a third more from the first step, and no step runs late either way.
    Warming needs the correction, and is recorded."""
    served = steps_on_a_slower_machine(tmp_path / "served.csv")
    workload = WORKLOADS["long"].generate(200, seed=1)
    first = {}
    for warm in (None, str(served)):
        options = EngineOptions(correction=True, bias=1.5, warm_from=warm, margin_form="per-step")
        first[warm is not None] = first_chunks_and_late(
            options.simulate(workload, SLOWeave(cost=COST), 10.0, 1000.0, COST)
        )
    assert first[True][0] > 1.2 * first[False][0] and first[True][1] == first[False][1] == 0
    described = EngineOptions(correction=True, warm_from=str(served)).describe()
    assert described["warm_from"]["steps"] == 2000 and "warm_from" not in DEFAULT_OPTIONS.describe()
    with pytest.raises(ValueError, match="warm_from warms the online correction: give correction too"):
        EngineOptions(warm_from=str(served))
    with pytest.raises(StepNoiseError, match="cannot read it"):
        EngineOptions(correction=True, warm_from=str(tmp_path / "absent.csv"))


def test_the_command_line_takes_the_pace_and_the_warm_start(drifting_profile, tmp_path):
    from click.testing import CliRunner

    from sloweave.cli import main

    args = ["simulate", "--requests", "60", "--step-noise-from", str(drifting_profile), "--noise-pace-ms", "1000"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["engine"]["step_noise_pace_ms"] == 1000.0
    warm = ["simulate", "--requests", "60", "--correction", "--warm-from", str(drifting_profile)]
    result = CliRunner().invoke(main, warm)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["engine"]["warm_from"]["steps"] == len(drifting_steps())
    refused = CliRunner().invoke(main, ["simulate", "--requests", "10", "--warm-from", str(drifting_profile)])
    assert refused.exit_code == 2 and "give correction too" in refused.output
    untimed = tmp_path / "untimed.csv"
    drifting_steps().drop(columns="start_ms").to_csv(untimed, index=False)
    refused = CliRunner().invoke(main, [*args[:3], "--step-noise-from", str(untimed), "--noise-pace-ms", "1000"])
    assert refused.exit_code == 2 and "no step start times (start_ms)" in refused.output
