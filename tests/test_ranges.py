"""Issue 25, class 2: every number that enters has a stated range that keeps the arithmetic exact.

One mechanism (``sloweave.core.validate.Range``) gives the range and the words; the command-line
options, the API's dataclasses, the plug-in's configuration and the file readers apply it where
the value enters. These tests walk every option of every command, generate values on both sides
of each range's edges, and check that the top of each range still computes exactly.
"""

from __future__ import annotations

from pathlib import Path

import json
import math
import re

import click
import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sloweave.cli import main
from sloweave.core.policy import SLOWeave, make_policy
from sloweave.core.validate import (
    MAX_NOISE_SIGMA,
    MAX_SECONDS,
    MAX_TOKENS,
    TOKENS,
    Range,
)
from sloweave.cli.options import CheckedNumber
from sloweave.sim.engine import simulate
from sloweave.sim.metrics import per_request_frame
from sloweave.sim.options import EngineOptions
from sloweave.sim.workloads import Workload, WorkloadError, get_workload_spec

SETTINGS = settings(derandomize=True, max_examples=200, deadline=None, database=None)


def _commands(group: click.Group, prefix: str = ""):
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def _numeric_options():
    """(command, option, its CheckedNumber) for every number an option takes."""
    found = []
    for name, command in _commands(main):
        for param in command.params:
            if isinstance(param.type, CheckedNumber):
                found.append((name, param.opts[0], param.type))
    return found


NUMERIC_OPTIONS = _numeric_options()


def test_every_number_on_the_command_line_has_a_stated_range():
    # click's INT, FLOAT, IntRange and FloatRange take 1e20 tokens, a sigma of 1000 and NaN
    # (FloatRange(min=0) passes NaN: every comparison with it is false)
    unranged = [
        f"{name} {param.opts[0]} ({param.type})"
        for name, command in _commands(main)
        for param in command.params
        if isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType))
        and not isinstance(param.type, CheckedNumber)
    ]
    assert unranged == []
    assert len(NUMERIC_OPTIONS) > 60  # every command's numbers were found, not none


def _beyond(limits: Range) -> st.SearchStrategy:
    """Numbers just past either edge of ``limits``, and the non-finite ones."""
    above = [limits.high + 1, limits.high * 2, 10**20, 1e300]
    below = [limits.low - 1, -(10**20)] + ([limits.low] if limits.low_open else [])
    if not limits.whole:
        above.append(math.nextafter(limits.high, math.inf))
        above += [math.inf, math.nan]
        below.append(math.nextafter(limits.low, -math.inf))
    return st.sampled_from(above + below)


@SETTINGS
@given(data=st.data())
def test_each_option_refuses_a_value_past_its_range_naming_the_option(data):
    command, option, kind = data.draw(st.sampled_from(NUMERIC_OPTIONS))
    value = data.draw(_beyond(kind.limits))
    text = str(int(value)) if kind.limits.whole and math.isfinite(value) else repr(value)
    if kind.infinity and value == math.inf:
        return  # "inf" means "no limit" for this option (decide --budget-ms)
    with pytest.raises(click.BadParameter, match=re.escape(f"must be {kind.limits.describe()}")):
        kind.convert(text, None, None)


@SETTINGS
@given(data=st.data())
def test_each_option_accepts_its_range_up_to_the_edges(data):
    command, option, kind = data.draw(st.sampled_from(NUMERIC_OPTIONS))
    limits = kind.limits
    if limits.whole:
        value = data.draw(
            st.sampled_from([int(limits.low), int(limits.high)]) | st.integers(int(limits.low), int(limits.high))
        )
        assert kind.convert(str(value), None, None) == value
    else:
        low = math.nextafter(limits.low, math.inf) if limits.low_open else limits.low
        value = data.draw(st.sampled_from([low, limits.high]) | st.floats(low, limits.high))
        assert kind.convert(repr(value), None, None) == value


@pytest.mark.parametrize(
    "args, option",
    [
        (["decide", "--decodes", "4", "--waiting-tokens", "100", "--max-chunk", str(10**20)], "--max-chunk"),
        (["simulate", "--requests", "20", "--max-chunk", str(10**20)], "--max-chunk"),
        (["simulate", "--requests", "20", "--noise-sigma", "1000"], "--noise-sigma"),
        (["simulate", "--requests", "20", "--bias", "1e308"], "--bias"),
        (["simulate", "--requests", "20", "--kv-capacity-tokens", str(10**20)], "--kv-capacity-tokens"),
        (["simulate", "--requests", "20", "--rate-scale", "1e300"], "--rate-scale"),
        (["tune", "--workload", "chat", "--budget", str(10**20)], "--budget"),
        (["capacity", "--workload", "chat", "--max-scale", "1e300"], "--max-scale"),
        (["capacity", "--workload", "chat", "--seeds", str(10**9)], "--seeds"),
        (["decide", "--decodes", str(10**20), "--waiting-tokens", "100"], "--decodes"),
    ],
)
def test_the_issues_examples_are_refused_before_any_work(tmp_path, args, option):
    # each ended in a numpy casting error, an overflow to inf with NaN durations, or a run
    # that would never finish
    result = CliRunner().invoke(main, args + (["--out", str(tmp_path / "out")] if args[0] != "decide" else []))
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the API


@SETTINGS
@given(value=_beyond(TOKENS) | st.sampled_from([True, "4", 1.5]))
@example(value=10**400)
def test_the_api_takes_the_same_range_with_the_same_words(value):
    with pytest.raises(ValueError, match=re.escape(f"max_chunk_tokens must be {TOKENS.describe()}")):
        SLOWeave(max_chunk_tokens=value)


@pytest.mark.parametrize(
    "options, problem",
    [
        (dict(noise_sigma=1000.0), "noise_sigma must be a finite number >= 0 and <= 3"),
        (dict(bias=1e308), "bias must be a finite number >= 1e-06 and <= 1e\\+06"),
        (
            dict(kv_capacity_tokens=10**20),
            "kv_capacity_tokens must be a whole number of tokens >= 1 and <= 2,147,483,648",
        ),
        (dict(aging_ms=1e300), "aging_ms must be a finite number of milliseconds > 0 and <= 1e\\+10"),
        (dict(max_batch_size=2**63), "max_batch_size must be a whole number of requests >= 1"),
    ],
)
def test_engine_options_refuse_numbers_past_their_range(options, problem):
    with pytest.raises(ValueError, match=problem):
        EngineOptions(**options)


@pytest.mark.parametrize(
    "arrival_s", [[0.0, 1e300], [0.0, float(2**63)], [MAX_SECONDS, math.nextafter(MAX_SECONDS, math.inf)]]
)
def test_a_workload_refuses_arrivals_a_float_clock_cannot_step_past(arrival_s):
    # at 1e300 s, adding a step of a few ms changed nothing: every request got TTFT 0, attainment 1.0
    with pytest.raises(WorkloadError, match="arrival_s must be finite, >= 0 and <= 1e\\+10 s"):
        Workload("late", np.array(arrival_s), np.array([10, 10]), np.array([5, 5]))


def test_a_rate_scale_past_its_range_is_refused_by_the_generator():
    with pytest.raises(WorkloadError, match="rate_scale must be a finite number >= 1e-06 and <= 1e\\+06"):
        get_workload_spec("chat").generate(10, seed=0, rate_scale=1e300)


# ------------------------------------------------------------ the top of each range still computes


def test_at_the_last_arrival_the_range_allows_a_clock_still_adds_every_step():
    workload = Workload("late", np.array([MAX_SECONDS - 1.0, MAX_SECONDS]), np.array([300, 300]), np.array([4, 4]))
    result = simulate(workload, make_policy("sloweave"), tpot_ms=25.0)
    frame = per_request_frame(result)
    steps_ms = np.diff(result.iter_end_ms)
    assert result.finished.all()
    assert np.all(frame["ttft_ms"] > 0) and np.all(np.isfinite(frame["ttft_ms"]))
    assert np.all(steps_ms > 0)  # each step moved the clock (at 1e300 s none did)


def test_the_largest_noise_and_chunk_still_give_finite_times():
    workload = get_workload_spec("chat").generate(30, seed=0)
    policy = SLOWeave(max_chunk_tokens=MAX_TOKENS)
    result = EngineOptions(noise_sigma=MAX_NOISE_SIGMA).simulate(
        workload, policy, tpot_ms=25.0, ttft_ms=1000.0, cost=policy.cost
    )
    assert result.finished.all()
    assert np.all(np.isfinite(result.iter_end_ms)) and np.all(np.diff(result.iter_end_ms) > 0)
    assert 0 < policy.decide(4, MAX_TOKENS, 1e9).chunk_tokens <= MAX_TOKENS


# ----------------------------------------------------------------------------- file cells


def _step_log(tmp_path, field: str, value) -> Path:
    from sloweave.core.budget import StepPlan
    from sloweave.core.step_log import StepLogWriter

    path = tmp_path / "steps.jsonl"
    writer = StepLogWriter(path, {"engine": "0"}, 10, clock_ms=lambda: 1000.0)
    for i in range(3):
        plan = StepPlan(4 + 64, 64, 0.0, 0.0, 20.0, 5.0, False, False, 4, margin_ms=1.0, pending_prompt_tokens=64)
        writer.on_plan(plan, 0, (4, 64))
        writer.on_step_done(plan, 6.0, started_ms=10.0 * i)
    writer.close()
    lines = path.read_text().splitlines()
    step = json.loads(lines[2])  # the second step, on line 3
    step[field] = value
    lines[2] = json.dumps(step)
    path.write_text("\n".join(lines) + "\n")
    return path


@SETTINGS
@given(data=st.data())
def test_a_step_log_refuses_a_field_past_its_range_naming_the_line(tmp_path_factory, data):
    from sloweave.core.step_log import FIELD_RANGES, FLAG_FIELDS, StepLogError, read_step_log

    field = data.draw(st.sampled_from(sorted(FIELD_RANGES) + list(FLAG_FIELDS)))
    if field in FLAG_FIELDS:
        value = data.draw(st.sampled_from([0, 1, "true", None]))
    else:
        limits, nullable = FIELD_RANGES[field]
        value = data.draw(
            _beyond(limits).filter(math.isfinite) | st.sampled_from([True, "7", [1]] + ([] if nullable else [None]))
        )
        if limits.whole and isinstance(value, float) and value == int(value):
            value = int(value)
    path = _step_log(tmp_path_factory.mktemp("log"), field, value)
    with pytest.raises(StepLogError, match=rf"steps.jsonl, line 3: {field} must be "):
        read_step_log(path)


def test_a_step_log_at_the_edges_of_its_ranges_reads(tmp_path):
    from sloweave.core.step_log import read_step_log

    log = read_step_log(_step_log(tmp_path, "decode_kv_tokens", MAX_TOKENS))
    assert log.steps["decode_kv_tokens"].iloc[1] == MAX_TOKENS


def test_an_operator_profile_row_of_1e13_tokens_is_refused_at_its_line(tmp_path):
    import shutil

    from sloweave.core.costs.step_profiles import ProfileError
    from sloweave.core.costs.operator_profiles import load_profiles, preset_folder

    folder = tmp_path / "profile"
    shutil.copytree(preset_folder("llama3-8b-tp1-a100"), folder)
    mlp = folder / "mlp.csv"
    lines = mlp.read_text().split("\n")
    lines[1] = lines[1].replace(",True,32768,", ",True,10000000000000,", 1)
    mlp.write_text("\n".join(lines))
    with pytest.raises(
        ProfileError,
        match=re.escape(f"{mlp}, line 2: num_tokens=10000000000000; expected a whole number >= 0 and <= 2,147,483,648"),
    ):
        load_profiles(folder)


@pytest.mark.parametrize("key, value", [("num_layers", 10**400), ("tensor_parallel", 2**63)])
def test_a_model_json_count_past_its_range_is_refused_naming_the_key(tmp_path, key, value):
    import shutil

    from sloweave.core.costs.step_profiles import ProfileError
    from sloweave.core.costs.operator_profiles import load_profiles, preset_folder

    folder = tmp_path / "profile"
    shutil.copytree(preset_folder("llama3-8b-tp1-a100"), folder)
    model = json.loads((folder / "model.json").read_text())
    (folder / "model.json").write_text(json.dumps(model | {key: value}))
    with pytest.raises(ProfileError, match=rf"model\.json: {key} must be a whole number >= 1 and <= 10,000, got"):
        load_profiles(folder)


def test_a_step_time_profile_cell_past_its_range_is_refused_at_its_line(tmp_path):
    from sloweave.core.costs.step_profiles import ProfileError, read_profile

    path = tmp_path / "profile.csv"
    path.write_text(
        "n_decodes,chunk_tokens,decode_kv_tokens,prefill_prefix_tokens,step_ms\n4,64,256,0,5.0\n4,10000000000000,256,0,5.0\n"
    )
    with pytest.raises(
        ProfileError,
        match=re.escape(f"{path}, line 3: chunk_tokens=10000000000000; expected a whole number of tokens >= 0"),
    ):
        read_profile(path)


# ------------------------------------------- class 3: one typed check for every API argument


def _api_arguments():
    """(the name its message must carry, a call taking the value, whether None means "off")."""
    from sloweave.core.costs.calibrated import OnlineCalibrator
    from sloweave.core.costs.analytic import AnalyticCost
    from sloweave.core.costs.margins import ConstantMargin, RelativeMargin
    from sloweave.core.deadlines import DeadlineTracker
    from sloweave.core.policy import Aging, FixedChunk, TokenBudget
    from sloweave.sim.trace_replay import ReplayOptions
    from sloweave.vllm_plugin.config import PluginConfig

    workload = get_workload_spec("chat").generate(5, seed=0)
    return [
        ("max_chunk_tokens", lambda v: SLOWeave(max_chunk_tokens=v), False),
        ("Fixed-C chunk size", FixedChunk, False),
        ("token budget", TokenBudget, False),
        ("aging_ms", lambda v: Aging(v, 256), False),
        ("aging chunk_tokens", lambda v: Aging(1000.0, v), False),
        ("AnalyticCost.base_ms", lambda v: AnalyticCost(base_ms=v), False),
        ("ConstantMargin.margin_ms", ConstantMargin, False),
        ("RelativeMargin.fraction", lambda v: RelativeMargin(AnalyticCost(), v), False),
        ("alpha", lambda v: OnlineCalibrator(alpha=v), False),
        ("min_factor", lambda v: OnlineCalibrator(min_factor=v), False),
        ("max_factor", lambda v: OnlineCalibrator(max_factor=v), False),
        ("window_steps", lambda v: OnlineCalibrator(window_steps=v), False),
        ("default_tpot_ms", DeadlineTracker, False),
        ("noise_sigma", lambda v: EngineOptions(noise_sigma=v), False),
        ("bias", lambda v: EngineOptions(bias=v), False),
        ("kv_capacity_tokens", lambda v: EngineOptions(kv_capacity_tokens=v), True),
        ("max_batch_size", lambda v: EngineOptions(max_batch_size=v), True),
        ("aging_ms", lambda v: EngineOptions(aging_ms=v), True),
        ("tpot_ms", lambda v: simulate(workload, make_policy("sloweave"), tpot_ms=v), False),
        ("rate_scale", lambda v: get_workload_spec("chat").generate(5, 0, rate_scale=v), False),
        ("rate scale", lambda v: ReplayOptions(rate_scale=v), False),
        ("window start", lambda v: ReplayOptions(start_s=v), False),
        ("tpot_ms", lambda v: PluginConfig(tpot_ms=v), False),
        ("margin_ms", lambda v: PluginConfig(margin_ms=v), False),
        ("max_chunk_tokens", lambda v: PluginConfig(max_chunk_tokens=v), False),
        ("aging_ms", lambda v: PluginConfig(aging_ms=v), False),
    ]


API_ARGUMENTS = _api_arguments()
NOT_NUMBERS = st.sampled_from(
    [True, False, "1", "25", b"1", [1], {"ms": 1}, None, math.nan, math.inf, -math.inf, -1, 10**400]
)


@SETTINGS
@given(argument=st.sampled_from(API_ARGUMENTS), value=NOT_NUMBERS)
def test_an_api_argument_that_is_no_number_in_range_is_refused_naming_it(argument, value):
    # True was read as 1 ms, a string failed inside numpy ("ufunc 'isfinite' not supported"),
    # 10**400 overflowed later with a traceback that named nothing
    name, call, none_is_off = argument
    if value is None and none_is_off:
        call(value)  # None: the option is off
        return
    with pytest.raises(ValueError, match=re.escape(name)):
        call(value)
