"""The machine's own step-time noise (issue 24): residuals of a step log by predicted step time,
replayed by the simulator as a seeded bootstrap (``sloweave.core.costs.empirical_noise``)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.core.budget import StepPlan
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.empirical_noise import (
    MIN_STEPS_PER_BUCKET,
    MIN_STEPS_PER_GROUP,
    EmpiricalNoiseCost,
    StepNoise,
    StepNoiseError,
    bucket_edges,
    read_step_samples,
    residual_buckets,
    step_noise_from_file,
)
from sloweave.core.policy import SLOWeave
from sloweave.core.step_log import StepLogWriter
from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions
from sloweave.sim.workloads import WORKLOADS
from sloweave.studies.capacity import capacity_frame
from sloweave.studies.parallel import Runner
from sloweave.studies.search import CapacityStudy, SearchLattice
from sloweave.studies.sources import SpecSource

COST = AnalyticCost()
SHAPES = [(n, c) for n in (0, 1, 2, 4, 8, 16, 32, 64) for c in (0, 64, 256, 512, 1024, 2048, 4096) if n or c]
SMALL_STEP_MS, SMALL_SPREAD_MS, LARGE_SPREAD_MS = 5.0, 0.25, 3.0


def additive_noise_ms(predicted_ms: float, rng: np.random.Generator) -> float:
    """The synthetic machine, additive: steps under 5 ms normal with sd 0.25 ms, longer ones slower by a
    skewed 3 x (Exp(1) - 1) ms (never below -3 ms, so no step time is negative)."""
    if predicted_ms < SMALL_STEP_MS:
        return float(rng.normal(0.0, SMALL_SPREAD_MS))
    return float(LARGE_SPREAD_MS * (rng.exponential() - 1.0))


def write_step_log(path, repeats: int = 12, seed: int = 0):
    """A served engine's step log whose steps take the analytic model's time plus ``additive_noise_ms``."""
    rng = np.random.default_rng(seed)
    writer = StepLogWriter(path, {"engine": "synthetic"}, clock_ms=lambda: 0.0)
    for i, (n, c) in enumerate(SHAPES * repeats):
        predicted = COST(n, c)
        step = StepPlan(n + c, c, 0.0, 0.0, 50.0, predicted, False, False, n, decode_kv_tokens=100 * n)
        writer.on_plan(step, 0, (n, c))
        writer.on_step_done(step, predicted + additive_noise_ms(predicted, rng), started_ms=float(i))
    writer.close()
    return path


@pytest.fixture(scope="module")
def step_log(tmp_path_factory):
    return write_step_log(tmp_path_factory.mktemp("noise") / "served.jsonl")


@pytest.fixture(scope="module")
def chat_300():
    return WORKLOADS["chat"].generate(300, seed=0)


def simulated(workload, options: EngineOptions, noise_seed: int = 0):
    return options.simulate(workload, SLOWeave(cost=COST), 25.0, 1000.0, COST, noise_seed)


# ---------------------------------------------------------------- the residual buckets


def test_the_buckets_hold_the_logs_residuals_by_step_kind_and_size(step_log):
    noise = step_noise_from_file(step_log, COST)
    steps = len(SHAPES) * 12
    decode_only = sum(1 for _, c in SHAPES if c == 0) * 12
    assert noise.steps == steps and noise.kinds_apart
    assert [sum(map(len, kind.residuals_ms)) for kind in noise.kinds] == [decode_only, steps - decode_only]
    spreads, seen = [], []
    for kind in noise.kinds:
        assert all(len(r) >= MIN_STEPS_PER_GROUP for r in kind.residuals_ms)
        assert len(kind.residuals_ms) == len(kind.upper_edges_ms) + 1
        spreads += [np.percentile(r, 99) - np.percentile(r, 1) for r in kind.residuals_ms]
        seen += kind.predicted_seen_ms
    assert len(spreads) > 4
    small = [s for s, (_, high) in zip(spreads, seen) if high < SMALL_STEP_MS]
    large = [s for s, (low, _) in zip(spreads, seen) if low >= SMALL_STEP_MS]
    # P1..P99: a normal's is 4.65 sd (1.2 ms for the small steps), 3 x Exp(1)'s 13.8 ms (the large ones)
    assert small and large and max(small) < 2.0 and min(large) > 9.0
    assert noise.floor_ms == pytest.approx(read_step_samples(step_log).measured_ms.min())
    described = json.loads(json.dumps(noise.describe(), allow_nan=False))
    assert described["source"] == str(step_log) and described["steps"] == steps and described["kinds_apart"]
    for name, kind in zip(("decode-only", "with-chunk"), noise.kinds):
        buckets = described["buckets_by_kind"][name]
        assert [b["steps"] for b in buckets] == list(map(len, kind.residuals_ms))
        assert buckets[0]["predicted_ms_from"] == 0 and buckets[-1]["predicted_ms_to"] is None


def test_a_step_with_a_chunk_draws_from_the_steps_with_one():
    """A served plug-in ran many decode-only steps of 2-3 ms and few small chunk steps: a chunk step
    the simulator predicts at 3-6 ms takes a chunk step's residual (here +3 ms), not a decode-only
    step's (0 ms) of the same predicted time, and a decode-only step never takes a chunk step's."""
    predicted = np.concatenate([np.linspace(2.0, 3.0, 300), np.linspace(4.0, 12.0, 60)])
    with_chunk = np.arange(360) >= 300
    noise = StepNoise.of_steps(predicted, predicted + np.where(with_chunk, 3.0, 0.0), with_chunk)
    assert noise.kinds_apart and noise.steps == 360
    for block in (0, 50):
        sampler = EmpiricalNoiseCost(lambda n, c: 3.0 if c == 0 else 3.0 + c / 100, noise, seed=1, block_steps=block)
        for chunk in (0, 100, 300, 0, 200):
            assert sampler(2, chunk) - sampler.cost(2, chunk) == (0.0 if chunk == 0 else 3.0)
    # too few of a kind to keep apart: one set of buckets for both, as a source without kinds
    few = StepNoise.of_steps(predicted[:340], predicted[:340], with_chunk[:340])
    assert not few.kinds_apart and few.kinds[0].steps == 340


def test_no_bucket_mixes_step_sizes_the_machine_never_ran_between():
    """300 steps of 12-14 ms (residuals 0-1 ms) and 40 prefills of 45-50 ms (+20 ms, a slow machine's
    large steps): no 12-14 ms step draws +20 ms, though the 40 are fewer than a bucket's 50, and a step
    between the two sizes draws from the nearer in log time (the edge at their geometric mean)."""
    rng = np.random.default_rng(0)
    predicted = np.concatenate([rng.uniform(12.0, 14.0, 300), rng.uniform(45.0, 50.0, 40)])
    measured = predicted + np.concatenate([rng.uniform(0.0, 1.0, 300), np.full(40, 20.0)])
    noise = residual_buckets(predicted, measured)
    top = noise.bucket_of(50.0)
    assert noise.residuals_ms[top] == pytest.approx([20.0] * 40)
    edge = (predicted[:300].max() * predicted[300:].min()) ** 0.5
    assert noise.upper_edges_ms[top - 1] == pytest.approx(edge)
    for predicted_ms in (12.0, 14.0, edge - 0.01):
        assert max(noise.residuals_ms[noise.bucket_of(predicted_ms)]) < 1.0
    # a size group under MIN_STEPS_PER_GROUP steps joins its neighbour (its top bucket, of 50 steps or more)
    fewer = 300 + MIN_STEPS_PER_GROUP - 1
    joined = residual_buckets(predicted[:fewer], measured[:fewer])
    low_seen, high_seen = joined.predicted_seen_ms[joined.bucket_of(50.0)]
    assert low_seen < 14.0 and high_seen > 45.0 and len(joined.residuals_ms[joined.bucket_of(50.0)]) >= 50


def test_a_chunk_over_several_prompts_leaves_the_residual_of_its_pieces(tmp_path):
    """A step that finished one prompt and started the next is priced piece by piece, as the
    policy priced it: a log whose steps took exactly that has no residual to draw."""
    from sloweave.core.costs.fitted import RegressionCost

    cost = RegressionCost([2.0, 0.5, 0.05, 1.0, 0.012, 0.01, 0.0, 14.0, 14.0, 0.0])
    writer = StepLogWriter(tmp_path / "served.jsonl", {}, clock_ms=lambda: 0.0)
    for i in range(3 * MIN_STEPS_PER_BUCKET):
        n, c, offer = i % 8, 256 * (1 + i % 8), ((64 * (1 + i % 3), 512), (4096, 0))
        cost.set_offer(offer)
        measured = cost.predict(n, c, 100 * n, 512)
        step = StepPlan(n + c, c, 0.0, 0.0, 50.0, measured, False, False, n, decode_kv_tokens=100 * n,
                        prefill_prefix_tokens=512, offer=offer)  # fmt: skip
        writer.on_plan(step, 0, (n, c))
        writer.on_step_done(step, measured, started_ms=float(i))
    writer.close()
    cost.set_offer(None)
    noise = step_noise_from_file(tmp_path / "served.jsonl", cost)
    assert np.abs(np.concatenate([r for kind in noise.kinds for r in kind.residuals_ms])).max() < 1e-9
    assert cost._offer is None  # the steps' offers are not left set on the cost


def test_ties_at_an_edge_merge_a_thin_bucket_into_its_smaller_neighbour():
    predicted = np.array([1.0] * 120 + [1.2] * 30 + [1.3] * 100)  # one size group (no gap of a factor sqrt 2)
    edges = bucket_edges(predicted)
    counts = np.bincount(np.searchsorted(edges, predicted, side="right"))
    # 250 steps: 5 buckets, edges at the quantiles 1, 1, 1.24, 1.3; the empty ones below 1 and in [1.24, 1.3) merge away
    assert counts.tolist() == [150, 100] and edges.tolist() == pytest.approx([1.24])
    assert bucket_edges(np.linspace(1, 2, 2 * MIN_STEPS_PER_BUCKET - 1)).size == 0  # 99 steps: one bucket


def test_the_simulators_drawn_residuals_reproduce_each_buckets_quantiles(step_log, chat_300):
    noise = step_noise_from_file(step_log, COST)
    result = simulated(chat_300, EngineOptions(step_noise_from=str(step_log)))
    predicted = np.array([COST(int(n), int(c)) for n, c in zip(result.iter_decodes, result.iter_chunk_tokens)])
    drawn = (result.iter_end_ms - result.iter_start_ms) - predicted
    floored = np.isclose(predicted + drawn, noise.floor_ms)
    compared = 0
    for with_chunk, kind in enumerate(noise.kinds):
        of_kind = (result.iter_chunk_tokens > 0) == bool(with_chunk)
        bucket = np.array([kind.bucket_of(p) for p in predicted])
        for b, residuals in enumerate(kind.residuals_ms):
            in_bucket = drawn[of_kind & (bucket == b) & ~floored]
            # every draw is one of its kind and bucket's residuals (a bootstrap, nothing invented)
            nearest = np.min(np.abs(in_bucket[:, None] - np.array(residuals)[None, :]), axis=1, initial=np.inf)
            assert np.all(nearest < 1e-6), (with_chunk, b)
            if in_bucket.size >= 400:
                spread = np.percentile(residuals, 99) - np.percentile(residuals, 1)
                for q in (10, 50, 90):
                    assert np.percentile(in_bucket, q) == pytest.approx(np.percentile(residuals, q), abs=0.15 * spread)
                compared += 1
    assert compared >= 1 and floored.mean() < 0.01


def test_the_same_seed_gives_the_same_times_bit_for_bit(step_log, chat_300):
    options = EngineOptions(step_noise_from=str(step_log))
    first, again = simulated(chat_300, options), simulated(chat_300, options)
    assert np.array_equal(first.iter_end_ms, again.iter_end_ms)
    other = simulated(chat_300, options, noise_seed=1)
    exact = simulated(chat_300, DEFAULT_OPTIONS)
    assert not np.array_equal(first.iter_end_ms, other.iter_end_ms)
    assert not np.array_equal(first.iter_end_ms[:50], exact.iter_end_ms[:50])  # the noise takes effect


def test_a_fresh_sampler_draws_the_same_stream(step_log):
    noise = step_noise_from_file(step_log, COST)
    samplers = [EmpiricalNoiseCost(COST, noise, seed=7) for _ in range(2)]
    times = [[sampler(4, c) for c in range(0, 10_000, 2)] for sampler in samplers]  # past one block of uniforms
    assert times[0] == times[1] and min(times[0]) >= noise.floor_ms
    assert times[0] != [EmpiricalNoiseCost(COST, noise, seed=8)(4, c) for c in range(0, 10_000, 2)]


def test_serial_and_parallel_capacity_are_the_same_with_the_machines_noise(step_log):
    def study(jobs: int) -> CapacityStudy:
        return CapacityStudy(
            SpecSource(WORKLOADS["mixed"], 200, (0, 1)),
            ["sloweave", "fixed-1024"],
            [25.0],
            2000.0,
            SearchLattice(steps_per_doubling=2, min_scale=1 / 4, max_scale=8.0),
            options=EngineOptions(step_noise_from=str(step_log)),
            runner=Runner(jobs=jobs),
        )

    serial, parallel = study(1), study(2)
    pd.testing.assert_frame_equal(
        capacity_frame(serial.capacities()), capacity_frame(parallel.capacities()), check_exact=True
    )


# ---------------------------------------------------------------- the option and bad input


def test_the_option_pickles_and_leaves_every_default_result_as_it_was(step_log):
    options = EngineOptions(step_noise_from=step_log)  # a Path is kept as its text
    assert options.step_noise_from == str(step_log) and pickle.loads(pickle.dumps(options)) == options
    assert "step_noise_from" not in DEFAULT_OPTIONS.describe() and DEFAULT_OPTIONS.actual_cost(COST, 0) is COST
    described = options.describe()
    assert described["step_noise_from"] == str(step_log) and described["step_noise"]["steps"] == len(SHAPES) * 12
    by_kind = options.describe(COST)["step_noise"]["buckets_by_kind"]
    assert [len(by_kind[name]) for name in ("decode-only", "with-chunk")] == [
        len(kind.residuals_ms) for kind in step_noise_from_file(step_log, COST).kinds
    ]
    assert options.label() == f"step_noise_from={step_log}"


@pytest.mark.parametrize("given", [{"noise_sigma": 0.1}, {"bias": 1.2}])
def test_the_measured_noise_replaces_the_lognormal_one_not_both(step_log, given):
    with pytest.raises(ValueError, match="step_noise_from replaces noise_sigma and bias"):
        EngineOptions(step_noise_from=str(step_log), **given)


def bad_sources(tmp_path):
    few = write_step_log(tmp_path / "few.jsonl", repeats=0)
    with open(few, "a") as log:  # 40 steps by hand, the log's own format
        for i in range(40):
            fields = dict(step=i, start_ms=float(i), measured_ms=3.0, decode_tokens=1, chunk_tokens=0, token_budget=1)
            fields.update(ran_decode_tokens=1, ran_prefill_tokens=0, decode_kv_tokens=10, prefill_prefix_tokens=0)
            fields.update(pending_prompt_tokens=0, prompts_on_offer=0, offer=[], budget_ms=None, predicted_ms=2.0)
            fields.update(margin_ms=0.0, base_predicted_ms=None, infeasible=False, aged=False, late_requests=0)
            log.write(json.dumps({"kind": "step", **fields}) + "\n")
    rows = "\n".join(f"1,{c},0,0" for c in range(60))
    (tmp_path / "unmeasured.csv").write_text("n_decodes,chunk_tokens,decode_kv_tokens,prefill_prefix_tokens\n" + rows)
    rows = "\n".join(f"1,{c},0,0,{'nan' if c == 7 else 2.5}" for c in range(60))
    (tmp_path / "nan.csv").write_text("n_decodes,chunk_tokens,decode_kv_tokens,prefill_prefix_tokens,step_ms\n" + rows)
    return [
        (tmp_path / "absent.jsonl", "cannot read it"),
        (tmp_path, "not a file"),
        (few, "40 measured step"),
        (tmp_path / "unmeasured.csv", "missing column.*step_ms"),
        (tmp_path / "nan.csv", "step_ms=nan"),
    ]


def test_a_bad_source_is_refused_naming_the_file_and_the_problem(tmp_path):
    for path, words in bad_sources(tmp_path):
        with pytest.raises(StepNoiseError, match=words) as caught:
            read_step_samples(path)
        assert str(path) in str(caught.value)
        with pytest.raises(ValueError, match=words):
            EngineOptions(step_noise_from=str(path))


def test_a_cost_that_predicts_no_finite_time_and_bad_residuals_are_refused(step_log):
    with pytest.raises(StepNoiseError, match=r"predicts nan ms for step 0 \(n_decodes=0, chunk_tokens=64\)"):
        step_noise_from_file(step_log, lambda n, c: float("nan"))
    with pytest.raises(StepNoiseError, match="at least 50"):
        residual_buckets([1.0] * 10, [1.0] * 10)
    with pytest.raises(StepNoiseError, match="step 3's measured time is inf"):
        residual_buckets([1.0] * 60, [1.0] * 3 + [float("inf")] * 57)


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize("command", ["simulate", "capacity", "replay", "tune"])
def test_every_study_command_takes_the_flag(command):
    text = " ".join(CliRunner().invoke(main, [command, "--help"], terminal_width=10_000).output.split())
    assert "--step-noise-from" in text and "the run's --cost model" in text


def test_simulate_with_a_step_log_as_cost_and_noise_runs_end_to_end(step_log):
    args = ["simulate", "--requests", "60", "--cost", str(step_log), "--step-noise-from", str(step_log)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["num_finished"] == 60 and printed["engine"]["step_noise"]["source"] == str(step_log)
    refused = CliRunner().invoke(main, [*args, "--noise-sigma", "0.2"])
    assert refused.exit_code == 2 and "replaces noise_sigma and bias" in refused.output
    absent = CliRunner().invoke(main, ["simulate", "--requests", "10", "--step-noise-from", "no-such.jsonl"])
    assert absent.exit_code == 2 and "step noise source no-such.jsonl: cannot read it" in absent.output


# ---------------------------------------------------------------- blocks of the source's timeline


def slow_minute_noise():
    """One bucket of 1,000 steps: residual 0 ms, but steps 400-599 (a slow minute) +10 ms."""
    measured = np.full(1000, 5.0)
    measured[400:600] += 10.0
    return residual_buckets(np.full(1000, 5.0), measured)


def slow_runs(times: list[float]) -> list[int]:
    """The lengths of the runs of consecutive slow steps."""
    runs, length = [], 0
    for slow in np.array(times) > 10.0:
        if slow:
            length += 1
        elif length:
            runs, length = [*runs, length], 0
    return runs + ([length] if length else [])


def test_blocks_of_the_timeline_keep_a_slow_minute_a_run_of_slow_steps():
    """Drawn independently, the slow fifth of the source's steps is scattered (runs of a step or
    two); in blocks of its timeline it comes back as runs of 200 steps and more, still about a fifth of
    all steps, every time one of the source's residuals, and the same seed gives the same times."""
    noise = slow_minute_noise()
    assert noise.positions == (tuple(range(1000)),)
    cost = lambda n, c: 5.0  # noqa: E731 - one predicted time: one bucket
    drawn = {block: EmpiricalNoiseCost(cost, noise, seed=3, block_steps=block) for block in (0, 500)}
    independent, blocked = ([sampler(1, 0) for _ in range(20_000)] for sampler in drawn.values())
    assert max(slow_runs(independent)) < 10 and max(slow_runs(blocked)) >= 200
    for times in (independent, blocked):
        assert set(times) == {5.0, 15.0} and np.mean(np.array(times) > 10.0) == pytest.approx(0.2, abs=0.03)
    again = EmpiricalNoiseCost(cost, noise, seed=3, block_steps=500)
    assert [again(1, 0) for _ in range(20_000)] == blocked


def test_a_step_takes_the_residual_of_its_buckets_step_nearest_in_time():
    """Two buckets whose steps alternate in the source: a step of either size reads its own
    bucket's step nearest to its place on the timeline."""
    predicted = np.array([2.0, 8.0] * 100)
    measured = predicted + np.arange(200) / 100.0  # each residual says where in the source it was
    noise = residual_buckets(predicted, measured)
    sampler = EmpiricalNoiseCost(lambda n, c: 2.0 if c == 0 else 8.0, noise, seed=0, block_steps=200)
    start = None
    for k in range(50):
        chunk = k % 3  # sizes in another order than the source's
        actual = sampler(1, chunk)
        place = round((actual - (2.0 if chunk == 0 else 8.0)) * 100)
        assert place % 2 == (0 if chunk == 0 else 1)  # its own bucket's step
        start = place - k if start is None else start
        assert abs(place - (start + k) % 200) <= 1 or abs(place - (start + k) % 200) == 199  # the nearest, wrapping


def test_the_block_option_needs_the_source_and_a_whole_count(step_log):
    options = EngineOptions(step_noise_from=str(step_log), step_noise_block_steps=300)
    assert options.describe()["step_noise_block_steps"] == 300
    assert "step_noise_block_steps" not in DEFAULT_OPTIONS.describe()
    assert (
        isinstance(options.actual_cost(COST, 0), EmpiricalNoiseCost) and options.actual_cost(COST, 0).block_steps == 300
    )
    with pytest.raises(ValueError, match="step_noise_block_steps draws the residuals of step_noise_from"):
        EngineOptions(step_noise_block_steps=300)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="step_noise_block_steps"):
            EngineOptions(step_noise_from=str(step_log), step_noise_block_steps=bad)
