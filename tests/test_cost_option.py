"""One `--cost` choice everywhere: `sloweave.core.costs.resolve.resolve_cost` and the commands' `--cost`."""

import json
import warnings

import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.resolve import ContextBlindCost, ResolvedCost, context_models, resolve_cost
from sloweave.core.costs.fitted import FixedContextCost, RegressionCost
from sloweave.core.costs.step_profiles import ProfileError
from sloweave.core.costs.operator_profiles import PRESETS, preset_folder
from sloweave.core.costs.profile import ProfileCost, profile_cost

DERIVED = "llama3-8b-tp1-a100"  # attention derived from the 70B profile, not measured
MEASURED = "llama2-70b-tp2-a100"
TRACE = "tests/fixtures/traces/azure_conv_first150.csv"


@pytest.fixture(autouse=True)
def _quiet_extrapolation():
    # ProfileCost warns once per model when a query leaves the profiled range (counted in describe()).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


# ----------------------------------------------------------------------------- resolve_cost


def test_analytic_is_the_papers_model_and_says_so():
    resolved = resolve_cost("analytic")
    assert isinstance(resolved, ResolvedCost) and resolved.is_analytic and resolved.label == "analytic"
    assert resolved.model == AnalyticCost() and resolved.model(4, 100) == AnalyticCost()(4, 100)
    description = resolved.description
    assert description["cost_model"] == "analytic" and description["coefficients_ms"]["prefill_per_token_ms"] == 0.006
    json.dumps(description)
    with pytest.raises(ValueError, match="kv_tokens_in|no model shape"):
        resolved.kv_tokens_in(10)


def test_a_preset_is_a_profile_cost_and_a_derived_attention_is_said_everywhere():
    derived = resolve_cost(DERIVED)
    assert isinstance(derived.model, ProfileCost) and derived.kind == "preset" and derived.label == DERIVED
    assert derived.model(8, 512) == pytest.approx(profile_cost(DERIVED)(8, 512))
    assert derived.attention_note and derived.attention_note.startswith("derived from")
    assert "not measured" in derived.summary_lines()[0] and derived.summary_lines()[0].startswith(
        f"cost: {DERIVED} (attention derived"
    )
    description = derived.description
    assert (
        description["cost_model"] == "operator-profile"
        and description["spec"] == DERIVED
        and description["preset"] is True
    )
    assert "not measured" in description["attention"] and "out_of_range_queries" in description
    json.dumps(description)
    measured = resolve_cost(MEASURED)
    assert measured.attention_note is None and "attention measured" in measured.summary_lines()[0]
    # the description is read when asked: extrapolated queries made since resolving are counted
    before = sum(measured.description["out_of_range_queries"].values())
    measured.model(4, 200_000)
    assert sum(measured.description["out_of_range_queries"].values()) > before
    assert any("extrapolated" in line for line in measured.summary_lines())


def test_a_profile_folder_and_the_kv_capacity_of_its_model():
    folder = str(preset_folder(MEASURED))
    resolved = resolve_cost(folder)
    assert resolved.kind == "operator-profiles" and resolved.spec == folder and resolved.label == MEASURED
    assert resolved.model(16, 1024) == pytest.approx(resolve_cost(MEASURED).model(16, 1024))
    shape = resolved.profile_cost.shape
    assert resolved.kv_tokens_in(40) == shape.kv_tokens_in(40) == int(40 * 2**30 // shape.kv_bytes_per_token)
    with pytest.raises(ValueError, match="GiB"):
        resolved.kv_tokens_in(0)


def test_a_step_time_profile_file_is_fitted_as_tune_always_did(tmp_path, analytic_step_profile):
    path = analytic_step_profile
    resolved = resolve_cost(str(path))
    assert resolved.kind == "step-time-profile" and isinstance(resolved.model, RegressionCost)
    assert resolved.description["profile"] == str(path) and resolved.description["kind"] == "regression"
    assert resolved.description["context_per_decode_tokens"] is None  # the simulator's KV context
    fixed = resolved.step_profile("regression", context_tokens=300.0)
    assert isinstance(fixed.model, FixedContextCost) and fixed.model.context_per_decode_tokens == 300.0
    assert fixed.description["kind"] == "regression" and fixed.description["context_per_decode_tokens"] == 300.0
    assert resolve_cost(str(path), context_tokens=300.0).model(4, 256) == pytest.approx(fixed.model(4, 256))
    json.dumps(fixed.description)
    # this grid has holes: no lookup table, and the error names the file
    with pytest.raises(ProfileError, match="profile.csv.*no lookup table"):
        resolved.step_profile("table")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty cost spec"),
        ("nope", "unknown cost 'nope'"),
        ("nope", ", ".join(PRESETS)),
        ("llama3", "did you mean llama3-8b-tp1-a100"),
    ],
)
def test_a_bad_spec_names_itself_and_the_choices(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        resolve_cost(spec)


def test_bad_folders_and_files_say_what_is_wrong(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ProfileError, match=f"{empty}.*model.json"):
        resolve_cost(str(empty))
    bad = tmp_path / "steps.csv"
    bad.write_text("n_decodes,chunk_tokens\n1,2\n")
    with pytest.raises(ProfileError, match="steps.csv.*not a usable step-time profile.*missing column"):
        resolve_cost(str(bad))
    with pytest.raises(ValueError, match="step-time profile files only"):
        resolve_cost(DERIVED, context_tokens=100.0)
    with pytest.raises(ValueError, match="not a step-time profile"):
        resolve_cost(DERIVED).step_profile("regression", 10.0)


def test_context_models_for_the_ablation():
    world, blind = context_models(resolve_cost("analytic"))
    assert type(blind) is AnalyticCost and world(4, 0) >= blind(4, 0)
    resolved = resolve_cost(DERIVED)
    world, blind = context_models(resolved)
    assert world is resolved.model and isinstance(blind, ContextBlindCost) and not hasattr(blind, "set_context")
    world.set_context(400_000, 2000)
    assert blind(64, 512) == pytest.approx(world.predict(64, 512, 0, 0))
    assert blind(64, 512) < world(64, 512)  # the KV read the blind model does not see
    world.set_context(0, 0)


# ----------------------------------------------------------------------------- the commands


def invoke(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result


def assert_derived(description, output):
    assert description["cost_model"] == "operator-profile" and description["spec"] == DERIVED
    assert "not measured" in description["attention"]
    assert f"cost: {DERIVED} (attention derived" in output


def test_simulate_with_a_preset_and_its_kv_memory(tmp_path):
    out = tmp_path / "sim"
    result = invoke(
        [
            "simulate",
            "--workload",
            "chat",
            "--requests",
            "60",
            "--cost",
            DERIVED,
            "--kv-memory-gib",
            "0.25",
            "--out",
            str(out),
        ]
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert_derived(metrics["cost"], result.output)
    shape = profile_cost(DERIVED).shape
    assert metrics["kv_capacity_tokens"] == shape.kv_tokens_in(0.25) == 2048 and metrics["kv_memory_gib"] == 0.25
    assert metrics["kv_bytes_per_token"] == shape.kv_bytes_per_token and metrics["num_requests"] == 60


def test_kv_memory_needs_a_profile_cost_and_a_bad_cost_is_a_bad_parameter(tmp_path):
    result = CliRunner().invoke(main, ["simulate", "--requests", "10", "--kv-memory-gib", "8"])
    assert result.exit_code == 2 and "--kv-memory-gib" in result.output and "preset" in result.output
    for command in (
        ["simulate"],
        ["replay", TRACE],
        ["capacity", "--workload", "chat"],
        ["tune", "--workload", "chat"],
        ["ablate"],
        ["reproduce"],
    ):
        result = CliRunner().invoke(main, [*command, "--cost", "nope", "--out", str(tmp_path / "x")])
        assert result.exit_code == 2, (command, result.output)
        assert "Invalid value for --cost" in result.output and "unknown cost 'nope'" in result.output


def test_cost_analytic_is_the_default_bit_for_bit(tmp_path):
    args = ["simulate", "--workload", "mixed", "--requests", "120", "--noise-sigma", "0.1"]
    invoke([*args, "--out", str(tmp_path / "default")])
    invoke([*args, "--cost", "analytic", "--out", str(tmp_path / "analytic")])
    for name in ("requests.csv", "iterations.csv", "prefills.csv", "metrics.json", "decision_metrics.json"):
        assert (tmp_path / "default" / name).read_bytes() == (tmp_path / "analytic" / name).read_bytes(), name
    assert json.loads((tmp_path / "default" / "metrics.json").read_text())["cost"]["cost_model"] == "analytic"


def test_replay_with_a_preset(tmp_path):
    out = tmp_path / "replay"
    result = invoke(
        [
            "replay",
            TRACE,
            "--max-requests",
            "40",
            "--policy",
            "sloweave",
            "--policy",
            "fixed-512",
            "--cost",
            DERIVED,
            "--out",
            str(out),
        ]
    )
    assert_derived(json.loads((out / "replay.json").read_text())["cost"], result.output)


def test_capacity_with_a_preset(tmp_path):
    out = tmp_path / "capacity"
    args = [
        "capacity",
        "--workload",
        "chat",
        "--quick",
        "--seeds",
        "1",
        "--requests",
        "60",
        "--policy",
        "sloweave",
        "--policy",
        "fixed-512",
    ]
    result = invoke([*args, "--tpot-ms", "50", "--cost", DERIVED, "--out", str(out)])
    payload = json.loads((out / "capacity.json").read_text())
    assert_derived(payload["cost"], result.output)
    assert payload["options"]["cost"] == DERIVED


def test_tune_with_a_preset_and_its_options_for_files_only(tmp_path):
    out = tmp_path / "tune"
    args = [
        "tune",
        "--workload",
        "chat",
        "--quick",
        "--seeds",
        "1",
        "--requests",
        "60",
        "--no-refine",
        "--budget",
        "256",
        "--budget",
        "1024",
    ]
    result = invoke([*args, "--cost", DERIVED, "--out", str(out)])
    assert_derived(json.loads((out / "tune.json").read_text())["cost"], result.output)
    assert "not measured" in (out / "tune.md").read_text()
    bad = CliRunner().invoke(main, [*args, "--cost", DERIVED, "--context-tokens", "100", "--out", str(out)])
    assert bad.exit_code == 2 and "--context-tokens" in bad.output and "step-time profile file only" in bad.output


def test_tune_keeps_a_step_time_profile_at_a_fixed_context(tmp_path, analytic_step_profile):
    path = analytic_step_profile
    out = tmp_path / "tune"
    args = [
        "tune",
        "--workload",
        "chat",
        "--quick",
        "--seeds",
        "1",
        "--requests",
        "60",
        "--no-refine",
        "--budget",
        "512",
    ]
    invoke([*args, "--cost", str(path), "--context-tokens", "250", "--out", str(out)])
    cost = json.loads((out / "tune.json").read_text())["cost"]
    assert cost["profile"] == str(path) and cost["kind"] == "regression" and cost["context_per_decode_tokens"] == 250.0
    bad = CliRunner().invoke(main, [*args, "--cost", str(path), "--cost-kind", "table", "--out", str(out)])
    assert bad.exit_code == 2 and "no lookup table" in bad.output


def test_ablate_with_a_preset(tmp_path):
    out = tmp_path / "ablate"
    args = [
        "ablate",
        "--quick",
        "--seeds",
        "1",
        "--requests",
        "40",
        "--workload",
        "chat",
        "--config",
        "ctx-aware",
        "--no-trace",
    ]
    result = invoke([*args, "--cost", DERIVED, "--out", str(out)])
    assert_derived(json.loads((out / "ablation.json").read_text())["cost"], result.output)
    assert "not measured" in (out / "ablation.md").read_text()


def test_reproduce_with_a_preset(tmp_path):
    out = tmp_path / "reproduce"
    result = invoke(
        [
            "reproduce",
            "--quick",
            "--seeds",
            "1",
            "--requests",
            "40",
            "--workload",
            "chat",
            "--cost",
            DERIVED,
            "--out",
            str(out),
        ]
    )
    assert_derived(json.loads((out / "summary.json").read_text())["cost"], result.output)
    assert "not measured" in (out / "report.md").read_text()


def test_simulate_with_a_step_time_profile_reads_the_simulators_kv_context(tmp_path, analytic_step_profile):
    path = analytic_step_profile
    out = tmp_path / "sim"
    result = invoke(["simulate", "--workload", "chat", "--requests", "60", "--cost", str(path), "--out", str(out)])
    cost = json.loads((out / "metrics.json").read_text())["cost"]
    assert (
        cost["cost_model"] == "step-time-profile"
        and cost["profile"] == str(path)
        and cost["context_per_decode_tokens"] is None
    )
    assert "the simulator's KV context" in result.output
