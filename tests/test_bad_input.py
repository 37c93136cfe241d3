"""Bad input at every boundary gets a clear error before any work (issue 15).

Token-length limits, option values, output destinations, the Python API's arguments, and
result files that are strict JSON recording the settings and version that made them.
The generated (property-based) cases of the file readers are in test_fuzz_inputs.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.protocols import CostModelError
from sloweave.core.deadlines import DeadlineTracker
from sloweave.core.policy import SLOWeave
from sloweave.core.validate import DEFAULT_MAX_MODEL_LEN_TOKENS
from sloweave.sim.traces import TraceError, load_trace
from sloweave.sim.workloads import Workload, WorkloadError
from sloweave.studies.search import CapacityStudy
from sloweave.studies.sources import SpecSource
from sloweave.sim.workloads import get_workload_spec


def _trace(tmp_path: Path, rows: list[str], name: str = "t.csv") -> Path:
    path = tmp_path / name
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "\n".join(rows) + "\n")
    return path


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args))


# --------------------------------------------------------------------------- token lengths


@pytest.mark.parametrize("prompt", ["1000000000000", "100000000000000000000", "1e20"])
def test_a_trace_request_beyond_the_models_context_is_refused_with_its_line(tmp_path, prompt):
    path = _trace(tmp_path, ["0.0,100,20", f"0.5,{prompt},20"])
    with pytest.raises(
        TraceError,
        match=rf"t\.csv, line 3: prompt \S+ \+ output 20 tokens exceed the model's context of {DEFAULT_MAX_MODEL_LEN_TOKENS}",
    ):
        load_trace(path)


def test_the_limit_counts_prompt_plus_output_and_is_configurable(tmp_path):
    path = _trace(tmp_path, ["0.0,3000,1200", "0.5,100,20"])
    assert len(load_trace(path)) == 2
    with pytest.raises(
        TraceError, match=r"line 2: prompt 3000 \+ output 1200 tokens exceed the model's context of 4096"
    ):
        load_trace(path, max_model_len_tokens=4096)
    # at the limit exactly is allowed
    assert load_trace(path, max_model_len_tokens=4200).max_model_len_tokens == 4200
    with pytest.raises(TraceError, match="max_model_len_tokens must be a whole number of tokens >= 1"):
        load_trace(path, max_model_len_tokens=0)


def test_the_mooncake_lines_are_checked_too(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5}\n{"timestamp": 5, "input_length": 2000000, "output_length": 5}\n'
    )
    with pytest.raises(TraceError, match=r"m\.jsonl, line 2: prompt 2000000 \+ output 5"):
        load_trace(path)


def test_a_raised_limit_travels_with_the_replayed_workload(tmp_path):
    from sloweave.sim.trace_replay import replay_workload

    path = _trace(tmp_path, ["0.0,2000000,20", "0.5,100,20"])
    workload, _ = replay_workload(load_trace(path, max_model_len_tokens=4_000_000))
    assert workload.max_model_len_tokens == 4_000_000
    assert int(workload.prompt_tokens[0]) == 2_000_000


@pytest.mark.parametrize("prompt", [10**12, 1e20])
def test_the_workload_api_refuses_requests_beyond_the_context(prompt):
    with pytest.raises(WorkloadError, match=r"request 0: prompt .* exceed the model's context"):
        Workload("w", np.array([0.0]), np.array([prompt]), np.array([5]))
    assert len(Workload("w", np.array([0.0]), np.array([100]), np.array([5]), max_model_len_tokens=105)) == 1
    with pytest.raises(WorkloadError, match="max_model_len_tokens must be a whole number"):
        Workload("w", np.array([0.0]), np.array([100]), np.array([5]), max_model_len_tokens=-3)


def test_replay_and_capacity_take_max_model_len(tmp_path):
    path = _trace(tmp_path, ["0.0,3000,1200", "0.5,100,20", "1.0,100,20"])
    result = _invoke("replay", str(path), "--max-model-len", "4096", "--out", str(tmp_path / "r"))
    assert result.exit_code == 2 and "line 2: prompt 3000 + output 1200 tokens exceed" in result.output
    assert not (tmp_path / "r").exists()
    result = _invoke(
        "capacity",
        "--trace",
        str(path),
        "--whole-trace",
        "--seeds",
        "1",
        "--max-model-len",
        "4096",
        "--out",
        str(tmp_path / "c"),
    )
    assert result.exit_code == 2 and "exceed the model's context of 4096" in result.output
    result = _invoke("capacity", "--workload", "mixed", "--max-model-len", "4096", "--out", str(tmp_path / "c"))
    assert result.exit_code == 2 and "apply to --trace only" in result.output


# --------------------------------------------------------------------------- capacity on degenerate traces


@pytest.mark.parametrize("rows", [["0.0,100,20"], ["0.0,100,20", "0.0,200,20", "0.0,50,5"]])
def test_capacity_on_one_instant_is_refused_with_the_reason(tmp_path, rows):
    path = _trace(tmp_path, rows)
    result = _invoke(
        "capacity", "--trace", str(path), "--whole-trace", "--seeds", "1", "--no-curves", "--out", str(tmp_path / "c")
    )
    assert result.exit_code == 2, result.output
    assert "arrive at the same instant" in result.output and "capacity is undefined" in result.output
    assert not isinstance(result.exception, (ValueError, ZeroDivisionError))
    result = _invoke("tune", "--trace", str(path), "--seeds", "1", "--window-s", "1", "--out", str(tmp_path / "t"))
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_the_capacity_api_refuses_a_source_that_scaling_cannot_load():
    source = SpecSource(get_workload_spec("mixed"), 1, (0,))
    with pytest.raises(ValueError, match="seed 0: all 1 request"):
        CapacityStudy(source, ["sloweave"], [25.0], 1000.0)


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "args, option",
    [
        (["simulate", "--seed", "-1"], "--seed"),
        (["replay", "TRACE", "--seed", "-1"], "--seed"),
        (["simulate", "--tpot-ms", "nan"], "--tpot-ms"),
        (["simulate", "--rate-scale", "inf"], "--rate-scale"),
        (["replay", "TRACE", "--ttft-ms", "-5"], "--ttft-ms"),
        (["capacity", "--workload", "mixed", "--window-s", "nan"], "--window-s"),
        (["capacity", "--workload", "mixed", "--tpot-ms", "inf"], "--tpot-ms"),
        (["tune", "--workload", "mixed", "--load-scale", "0"], "--load-scale"),
        (["ablate", "--trace-rate-scale", "inf"], "--trace-rate-scale"),
        (["simulate", "--noise-sigma", "nan"], "--noise-sigma"),
        (["simulate", "--requests", "100000000000"], "--requests"),
        (["capacity", "--workload", "mixed", "--requests", "20000000"], "--requests"),
        (["simulate", "--margin", "constant", "--margin-value", "inf"], "--margin-value"),
    ],
)
def test_bad_option_values_name_the_option(tmp_path, args, option):
    path = _trace(tmp_path, ["0.0,100,20", "0.5,100,20"])
    args = [str(path) if a == "TRACE" else a for a in args]
    result = _invoke(*args, "--out", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- output destinations before work


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "--requests", "50", "--out", "{blocked}/sim"],
        ["reproduce", "--quick", "--out", "{blocked}/rep"],
        ["ablate", "--quick", "--out", "{blocked}/abl"],
        ["tune", "--workload", "mixed", "--quick", "--out", "{blocked}/tune"],
        ["capacity", "--workload", "mixed", "--quick", "--out", "{blocked}/cap"],
        ["fit", "PROFILE", "--out", "{blocked}/fit.json"],
        ["profile", "--out", "{blocked}/p.csv"],
        ["run", "--profile", "PROFILE", "--out", "{blocked}/run"],
    ],
)
def test_an_unwritable_output_is_refused_before_the_work(tmp_path, args):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    profile = tmp_path / "p.csv"
    profile.write_text("x\n")  # never read: the output check comes first
    args = [a.format(blocked=blocked) if "{" in a else (str(profile) if a == "PROFILE" else a) for a in args]
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    assert "not a writable folder" in result.output and "--out" in result.output


def test_an_output_file_that_is_a_folder_is_refused(tmp_path):
    profile = tmp_path / "p.csv"
    profile.write_text("x\n")
    result = _invoke("fit", str(profile), "--out", str(tmp_path))
    assert result.exit_code == 2 and "is a directory" in result.output  # click's own check of a file option


@pytest.mark.parametrize("command", ["profile", "run"])
def test_profile_and_run_without_the_runtime_say_how_to_install_it(tmp_path, command):
    # torch made unimportable, as on an install without the runtime extra
    profile = tmp_path / "p.csv"
    profile.write_text("x\n")  # never read: the runtime check comes first
    args = (
        ["profile", "--out", str(tmp_path / "new.csv")]
        if command == "profile"
        else ["run", "--profile", str(profile), "--out", str(tmp_path / "run")]
    )
    code = "import sys; sys.modules['torch'] = None; from sloweave.cli import main; main(%r)" % (args,)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"}
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert (
        f"`sloweave {command}` drives a real model and needs the CPU runtime (torch cannot be imported" in done.stderr
    )
    assert "pip install 'sloweave[runtime]'" in done.stderr


# --------------------------------------------------------------------------- the Python API


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "12"])
def test_deadline_tracker_refuses_times_that_are_not_finite(bad):
    tracker = DeadlineTracker(10.0)
    with pytest.raises(ValueError, match="last_token_ms of request 'a' must be a finite time in milliseconds"):
        tracker.add("a", bad)
    assert len(tracker) == 0  # nothing half-added
    tracker.add("a", 0.0)
    with pytest.raises(ValueError, match="emitted_ms of request 'a' must be a finite time"):
        tracker.on_token("a", bad)
    with pytest.raises(ValueError, match="now_ms must be a finite time"):
        tracker.budget_ms(bad)
    assert tracker.deadline_of("a") == 10.0


def test_deadline_answers_do_not_depend_on_insertion_order():
    orders = [["a", "b", "c"], ["c", "b", "a"], ["b", "a", "c"]]
    starts = {"a": 3.0, "b": 1.0, "c": 2.0}
    answers = set()
    for order in orders:
        tracker = DeadlineTracker(10.0)
        for rid in order:
            tracker.add(rid, starts[rid])
        answers.add(tracker.earliest_deadline_ms())
    assert answers == {11.0}


def test_repair_non_monotone_refuses_negative_and_nan_costs():
    drops_below_zero = lambda n, c: 1.0 if c < 10 else (-1.0 if c < 20 else 1.0 + 0.01 * c)  # noqa: E731
    with pytest.raises(CostModelError, match="negative time at n=0, c=1[0-9]"):
        SLOWeave(cost=drops_below_zero, repair_non_monotone=True)
    nan_inside = lambda n, c: math.nan if 100 < c < 105 else 1.0 + 0.01 * c  # noqa: E731
    with pytest.raises(CostModelError, match=r"non-finite time \(nan ms\) at n=0, c=101"):
        SLOWeave(cost=nan_inside, repair_non_monotone=True).decide(0, 4000, 1e9)
    # a drop (the case repair exists for) is still repaired
    dips = lambda n, c: 5.0 if c < 10 else 1.0 + 0.001 * c  # noqa: E731
    assert SLOWeave(cost=dips, repair_non_monotone=True).decide(0, 100, 5.5).chunk_tokens == 100


def test_repair_refuses_a_negative_time_off_the_checked_grid():
    from sloweave.core.costs.protocols import MonotoneRepair

    def cost(n, c):  # negative only at a decode count the construction check does not sample
        return -1.0 if n == 3 and c == 7 else 1.0 + c * 0.01

    repaired = SLOWeave(cost=cost, repair_non_monotone=True, max_chunk_tokens=64).cost
    assert isinstance(repaired, MonotoneRepair)
    with pytest.raises(
        CostModelError,
        match=r"negative or non-finite time \(-1 ms\) at n=3, c=7; repair_non_monotone only repairs drops",
    ):
        repaired(3, 20)
    assert repaired(2, 20) == pytest.approx(1.2)


def test_decide_still_refuses_bad_arguments():
    policy = SLOWeave(cost=AnalyticCost())
    for args in [(4, 100, math.nan), (-1, 100, 5.0), (4, -5, 5.0)]:
        with pytest.raises(ValueError, match="decide needs"):
            policy.decide(*args)


# --------------------------------------------------------------------------- result files


def _strict(path: Path) -> dict:
    text = path.read_text()
    for token in ("NaN", "Infinity"):
        assert token not in text, f"{path.name} holds {token}"
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{path.name}: {c}"))


def test_simulate_result_files_carry_settings_and_version(tmp_path):
    out = tmp_path / "sim"
    result = _invoke(
        "simulate", "--requests", "60", "--seed", "3", "--tpot-ms", "20", "--policy", "fixed-512", "--out", str(out)
    )
    assert result.exit_code == 0, result.output
    stdout = result.stdout if hasattr(result, "stdout") else result.output
    json.loads(stdout)  # stdout is the JSON alone (the "wrote ..." line goes to stderr)
    metrics = _strict(out / "metrics.json")
    assert metrics["sloweave_version"]
    settings = metrics["settings"]
    assert (settings["workload"], settings["policy_name"], settings["tpot_ms"], settings["seed"]) == (
        "mixed",
        "fixed-512",
        20.0,
        3,
    )
    assert metrics["command"] == "simulate"
    decisions = _strict(out / "decision_metrics.json")
    assert decisions["sloweave_version"] and decisions["policy"] == "fixed-512"


def test_fit_output_is_strict_json_with_settings(tmp_path):
    from test_fit import synthetic_profile

    from sloweave.core.costs.step_profiles import write_profile

    profile = write_profile(synthetic_profile(repeats=1), tmp_path / "good.csv")
    out = tmp_path / "fit.json"
    result = _invoke("fit", str(profile), "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = _strict(out)
    assert doc["sloweave_version"] and doc["settings"]["command"] == "fit" and "regression" in doc


def test_the_simulators_api_names_a_misplaced_or_wrong_argument():
    from sloweave.core.policy import make_policy
    from sloweave.sim.engine import simulate

    workload = get_workload_spec("mixed").generate(20, 0)
    policy = make_policy("sloweave")
    with pytest.raises(TypeError, match="actual_cost must be a cost model"):
        simulate(workload, policy, 25.0, 1000.0)  # a TTFT target where the machine's cost goes
    with pytest.raises(TypeError, match="workload must be a sloweave.sim.workloads.Workload"):
        simulate(workload.to_frame(), policy, 25.0)
    with pytest.raises(ValueError, match="a policy is named by a string"):
        make_policy(None)
    with pytest.raises(ValueError, match="decide needs .* got n_decodes='4'"):
        policy.decide("4", 10, 5.0)


@pytest.mark.parametrize("lengths, message", [([True, False], "dtype bool"), (["5", "6"], "dtype <U1")])
def test_workload_lengths_must_be_numbers(lengths, message):
    with pytest.raises(WorkloadError, match=f"prompt_tokens must be numbers of tokens, got {message}"):
        Workload("w", np.array([0.0, 1.0]), np.array(lengths), np.array([1, 1]))


@pytest.mark.parametrize("name", ["mixed", "drift"])
@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_generated_workloads_refuse_bad_seeds(name, seed):
    with pytest.raises(WorkloadError, match="seed must be a whole number >= 0"):
        get_workload_spec(name).generate(30, seed)


def test_plugin_configuration_refuses_what_it_would_ignore():
    from sloweave.vllm_plugin.config import PluginConfig, PluginConfigError

    with pytest.raises(PluginConfigError, match="budget_rule must be one of deadline, fixed, got 'static'"):
        PluginConfig.from_sources({"sloweave": {"budget_rule": "static"}}, {})
    assert PluginConfig.from_sources({}, {"SLOWEAVE_BUDGET_RULE": "fixed"}).budget_rule == "fixed"
    with pytest.raises(PluginConfigError, match="chunk_choice must be one of fastest, largest, got 'smallest'"):
        PluginConfig.from_sources({"sloweave": {"chunk_choice": "smallest"}}, {})
    assert PluginConfig.from_sources({}, {"SLOWEAVE_CHUNK_CHOICE": "largest"}).chunk_choice == "largest"

    with pytest.raises(PluginConfigError, match="unknown environment variable.*SLOWEAVE_TPOT;"):
        PluginConfig.from_sources({}, {"SLOWEAVE_TPOT": "10"})
    with pytest.raises(PluginConfigError, match="SLOWEAVE_ANALYTIC.*additional_config only"):
        PluginConfig.from_sources({}, {"SLOWEAVE_ANALYTIC": "{}"})
    with pytest.raises(PluginConfigError, match="additional_config must be an object"):
        PluginConfig.from_sources('{"sloweave": {"tpot_ms": 10}}', {})
    with pytest.raises(
        PluginConfigError,
        match="tpot_ms must be a finite number of milliseconds > 0 and <= 3.6e\\+06, got an integer of 401 digits",
    ):
        PluginConfig.from_sources({"sloweave": {"tpot_ms": 10**400}}, {})
    assert (
        PluginConfig.from_sources({"sloweave": {"tpot_ms": 10}}, {"SLOWEAVE_MARGIN_MS": "1", "OTHER": "x"}).margin_ms
        == 1.0
    )


def test_a_mooncake_line_with_a_repeated_key_is_refused(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5}\n{"timestamp": 5, "input_length": 10, "input_length": 900, "output_length": 5}\n'
    )
    with pytest.raises(TraceError, match=r"m\.jsonl, line 2: key 'input_length' is given twice"):
        load_trace(path)


def test_replay_of_several_traces_writes_a_folder_each_and_refuses_clashing_names(tmp_path):
    first = _trace(tmp_path, ["0.0,100,20", "0.5,300,20", "1.0,50,5"], "first.csv")
    second = _trace(tmp_path, ["0.0,900,10", "0.2,100,20"], "second.csv")
    result = _invoke(
        "replay",
        str(first),
        str(second),
        "--policy",
        "sloweave",
        "--policy",
        "full",
        "--jobs",
        "1",
        "--out",
        str(tmp_path / "r"),
    )
    assert result.exit_code == 0, result.output
    alone = _invoke(
        "replay",
        str(second),
        "--policy",
        "sloweave",
        "--policy",
        "full",
        "--jobs",
        "1",
        "--out",
        str(tmp_path / "alone"),
    )
    assert alone.exit_code == 0, alone.output
    assert (tmp_path / "r" / "second" / "requests.csv").read_bytes() == (
        tmp_path / "alone" / "requests.csv"
    ).read_bytes()
    assert len(json.loads((tmp_path / "r" / "first" / "replay.json").read_text())["metrics"]) == 2
    (tmp_path / "other").mkdir()
    clash = _trace(tmp_path / "other", ["0.0,100,20", "0.5,100,20"], "first.csv")
    result = _invoke("replay", str(first), str(clash), "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "two traces would write the same folder first" in result.output


def _repeated_key_and_negative_time_cases():
    from sloweave.core.costs.step_profiles import ProfileError, read_profile
    from sloweave.core.step_log import StepLogError, read_step_log
    from sloweave.sim.traces import TraceError, load_trace

    return [
        (
            "p.json",
            '{"format": "sloweave-profile", "version": 1, "version": 1, "rows": []}',
            read_profile,
            ProfileError,
            "key 'version' is given twice",
        ),
        (
            "s.jsonl",
            '{"kind": "header", "format": 1, "format": 1}\n',
            read_step_log,
            StepLogError,
            "line 1: key 'format' is given twice",
        ),
        (
            "t.csv",
            "arrival_s,prompt_tokens,output_tokens\n-2.0,10,5\n1.0,20,5\n",
            load_trace,
            TraceError,
            "line 2: arrival_s is -2.0; arrival times must be >= 0",
        ),
        (
            "m.jsonl",
            '{"timestamp": -5, "input_length": 10, "output_length": 3}\n',
            lambda p: load_trace(p, fmt="mooncake"),
            TraceError,
            "line 1: timestamp is -5; arrival times must be >= 0",
        ),
    ]


def test_one_rule_for_repeated_keys_and_negative_times_in_every_reader(tmp_path):
    """Issue 25, class 6: a repeated JSON key and a negative arrival time are refused by every
    reader, naming the file (they used to keep the last value, and to shift the times)."""
    import shutil

    from sloweave.core.costs.step_profiles import ProfileError
    from sloweave.core.costs.operator_profiles import load_profiles

    for name, text, reader, error, message in _repeated_key_and_negative_time_cases():
        (tmp_path / name).write_text(text)
        with pytest.raises(error, match=message):
            reader(tmp_path / name)
    folder = tmp_path / "profile"
    shutil.copytree(Path(__file__).parent / "fixtures" / "profiles" / "tiny", folder)
    model = (folder / "model.json").read_text()
    (folder / "model.json").write_text(model.replace("{", '{"num_layers": 1, ', 1))
    with pytest.raises(ProfileError, match="model.json: key 'num_layers' is given twice"):
        load_profiles(folder)


def test_a_table_for_a_cost_that_has_none_is_refused_by_the_plug_in_as_by_tune():
    from sloweave.vllm_plugin.config import PluginConfig, PluginConfigError

    with pytest.raises(PluginConfigError, match="cost_kind 'table' needs cost set to a step-time profile file"):
        PluginConfig(cost="analytic", cost_kind="table")


@pytest.mark.parametrize(
    "args, option",
    [
        (["capacity", "--workload", "mixed", "--tpot-ms", "25", "--tpot-ms", "25.0"], "--tpot-ms"),
        (["capacity", "--workload", "mixed", "--policy", "sloweave", "--policy", " SLOWeave"], "--policy"),
        (["replay", "t.csv", "--policy", "fixed-256", "--policy", "fixed-256"], "--policy"),
        (["tune", "--workload", "mixed", "--budget", "512", "--budget", "512"], "--budget"),
        (["reproduce", "--workload", "mixed", "--workload", "mixed"], "--workload"),
        (["ablate", "--config", "greedy", "--config", "greedy"], "--config"),
    ],
)
def test_a_value_given_twice_is_refused_by_every_command(args, option, tmp_path):
    """Issue 25, class 6: a repeated --tpot-ms doubled capacity's seed rows ("seeds": 2), a
    repeated --policy was dropped by capacity and refused by replay; now one rule for all."""
    from click.testing import CliRunner

    from sloweave.cli import main

    (tmp_path / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,20,5\n")
    args = [str(tmp_path / a) if a == "t.csv" else a for a in args]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and "is given more than once" in result.output
    assert not (tmp_path / "out").exists()  # refused before any work


@pytest.mark.parametrize("value", [True, False, "1.0", None, [1.0]])
def test_a_cost_coefficient_that_is_no_number_is_refused_by_name(value):
    """Issue 25, class 3: True was read as 1 ms; a string failed with numpy's "ufunc 'isfinite' not supported"."""
    from sloweave.core.costs.analytic import AnalyticCost
    from sloweave.core.costs.protocols import CostModelError

    with pytest.raises(
        CostModelError,
        match=f"AnalyticCost.prefill_base_ms must be a finite number >= 0 and <= 1e\\+10, got {re.escape(repr(value))}",
    ):
        AnalyticCost(prefill_base_ms=value)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"margin_fraction": 1e308}, "margin_fraction must be a finite number >= 0 and <= 100, got 1e\\+308"),
        ({"margin_ms": 4e6}, "margin_ms must be a finite number of milliseconds >= 0 and <= 3.6e\\+06"),
        (
            {"analytic": {"base_ms": True}},
            "analytic: AnalyticCost.base_ms must be a finite number >= 0 and <= 1e\\+10, got True",
        ),
    ],
)
def test_the_plug_in_refuses_a_margin_or_coefficient_it_cannot_use_at_start_up_naming_the_key(config, message):
    from sloweave.vllm_plugin.config import PluginConfig, PluginConfigError

    with pytest.raises(PluginConfigError, match=f"sloweave config: {message}"):
        PluginConfig(**config).build_decision()
