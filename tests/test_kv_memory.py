"""KV memory from the model and the GPU (`sloweave.core.costs.kv_memory`): the presets' figures by
hand, the default every study command applies with a measured cost, its overrides, and bad input."""

import json
import math
import shutil
import warnings

import pytest
from click.testing import CliRunner

from sloweave.cli import main
from sloweave.cli.ablate import _chosen_configs
from sloweave.core.costs.kv_memory import KVMemory
from sloweave.core.costs.operator_profiles import load_profiles, preset_folder
from sloweave.core.costs.resolve import resolve_cost
from sloweave.core.costs.step_profiles import ProfileError
from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions
from sloweave.studies.ablate import KV_CAPACITY_TOKENS, kv_rows

LLAMA2_70B = "llama2-70b-tp2-a100"
LLAMA3_8B = "llama3-8b-tp1-a100"
A100_GIB, RESERVE_GIB = 79.15, 2.0
MEMORY_KEYS = ("parameters", "gpu_memory_gib", "activation_reserve_gib", "memory_notes")


@pytest.fixture(autouse=True)
def _quiet_extrapolation():
    with warnings.catch_warnings():  # ProfileCost warns once per model past its profiled range
        warnings.simplefilter("ignore", UserWarning)
        yield


def llama_parameters(vocab, hidden, intermediate, layers, kv_heads, head_dim=128):
    """A Llama's parameter count from its Hugging Face config (untied LM head, RMSNorm weights)."""
    attention = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def kv_tokens_by_hand(parameters, gpus, layers, kv_heads, utilisation=0.9, head_dim=128):
    weights_gib = parameters * 2 / gpus / 2**30
    bytes_per_token_per_gpu = 2 * layers * kv_heads * head_dim * 2 / gpus
    return math.floor((A100_GIB * utilisation - weights_gib - RESERVE_GIB) * 2**30 / bytes_per_token_per_gpu)


PARAMS_70B = llama_parameters(32000, 8192, 28672, 80, 8)
PARAMS_8B = llama_parameters(128256, 4096, 14336, 32, 8)
TOKENS_70B = kv_tokens_by_hand(PARAMS_70B, 2, 80, 8)
TOKENS_8B = kv_tokens_by_hand(PARAMS_8B, 1, 32, 8)


def invoke(args, code=0):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, result.output
    return result


def test_the_presets_parameter_counts_are_their_configs():
    assert PARAMS_70B == 68_976_648_192 and PARAMS_8B == 8_030_261_248
    for preset, params in ((LLAMA2_70B, PARAMS_70B), (LLAMA3_8B, PARAMS_8B)):
        model = json.loads((preset_folder(preset) / "model.json").read_text())
        assert model["parameters"] == params and model["gpu_memory_gib"] == A100_GIB
        assert model["activation_reserve_gib"] == RESERVE_GIB and "CUDA" in model["memory_notes"]


def test_the_presets_kv_capacity_by_hand():
    # 70B TP2: 79.15 x 0.9 - 64.24 GiB weights - 2 GiB = 5.0 GiB per GPU at 160 KiB per token per GPU
    assert 32_000 < TOKENS_70B < 33_000 and 440_000 < TOKENS_8B < 450_000
    kv = resolve_cost(LLAMA2_70B).model_kv_memory()
    assert isinstance(kv, KVMemory) and kv.tokens == TOKENS_70B and kv.source == "model"
    assert kv.gpus == 2 and kv.kv_bytes_per_token == 320 * 1024 and kv.gpu_memory_utilization == 0.9
    assert kv.weights_gib_per_gpu == pytest.approx(64.2395, abs=1e-4)
    assert kv.summary().startswith(f"KV cache: {TOKENS_70B:,} tokens (2 x A100-80GB: 79.15 GiB x 0.9 - 64.2 GiB")
    assert "320 KiB per token" in kv.summary()
    json.dumps(kv.describe(), allow_nan=False)
    assert resolve_cost(LLAMA3_8B).model_kv_memory().tokens == TOKENS_8B
    assert resolve_cost(LLAMA3_8B).model_kv_memory(0.5).tokens == kv_tokens_by_hand(PARAMS_8B, 1, 32, 8, 0.5)
    assert resolve_cost("analytic").model_kv_memory() is None


def test_a_utilisation_that_leaves_no_kv_cache_names_the_numbers():
    with pytest.raises(ValueError, match=r"nothing is left for the KV cache.*63\.32 GiB.*64\.24 GiB of weights"):
        resolve_cost(LLAMA2_70B).model_kv_memory(0.8)
    for value in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            resolve_cost(LLAMA2_70B).model_kv_memory(value)
    result = invoke(["simulate", "--cost", LLAMA2_70B, "--requests", "5", "--gpu-memory-utilization", "0.8"], 2)
    assert "--gpu-memory-utilization" in result.output and "nothing is left" in result.output
    assert (
        "--gpu-memory-utilization" in invoke(["simulate", "--gpu-memory-utilization", "0", "--requests", "5"], 2).output
    )


def profile_copy(tmp_path, **changes):
    """The 70B preset's folder with model.json changed (a value None: the key removed)."""
    folder = tmp_path / "profile"
    shutil.copytree(preset_folder(LLAMA2_70B), folder)
    model = json.loads((folder / "model.json").read_text())
    for key, value in changes.items():
        if value is None:
            model.pop(key, None)
        else:
            model[key] = value
    (folder / "model.json").write_text(json.dumps(model))
    return folder


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"gpu_memory_gib": None}, "parameters without gpu_memory_gib"),
        ({"parameters": None}, "gpu_memory_gib without parameters"),
        ({"parameters": None, "gpu_memory_gib": None}, "activation_reserve_gib, memory_notes given without"),
        ({"parameters": 6.9e10}, "parameters must be a whole number of parameters"),
        ({"parameters": "70B"}, "parameters must be"),
        ({"gpu_memory_gib": -80}, r"gpu_memory_gib \(per GPU\) must be a finite number of GiB > 0"),
        ({"gpu_memory_gib": True}, "gpu_memory_gib"),
        ({"activation_reserve_gib": -1}, "activation_reserve_gib"),
        ({"memory_notes": 3}, "memory_notes must be a string"),
        ({"device": 80}, "device must be a string"),
    ],
)
def test_bad_memory_fields_in_model_json_are_named(tmp_path, changes, message):
    with pytest.raises(ProfileError, match=message) as raised:
        load_profiles(profile_copy(tmp_path, **changes))
    assert "model.json" in str(raised.value)


def test_a_folder_without_memory_figures_runs_unlimited_and_says_so(tmp_path):
    folder = profile_copy(tmp_path, **dict.fromkeys(MEMORY_KEYS))
    assert resolve_cost(str(folder)).model_kv_memory() is None
    result = invoke(["simulate", "--cost", str(folder), "--requests", "5"])
    assert "KV cache: unlimited" in result.output and "model.json gives no parameters" in result.output
    printed = json.loads(result.stdout)
    assert printed["engine"]["kv_capacity_tokens"] is None and printed["engine"]["kv_memory"]["source"] == "unlimited"
    refused = invoke(["simulate", "--cost", str(folder), "--requests", "5", "--gpu-memory-utilization", "0.9"], 2)
    assert "no default KV capacity" in refused.output
    # the reserve defaults to 2 GiB when a folder gives only the weights and the GPU
    folder = profile_copy(tmp_path / "b", activation_reserve_gib=None)
    assert resolve_cost(str(folder)).model_kv_memory().tokens == TOKENS_70B


LONG_70B = ["simulate", "--cost", LLAMA2_70B, "--policy", "sloweave-multi", "--tpot-ms", "100", "--workload", "long"]
LONG_70B += ["--requests", "60"]


def simulated(*extra):
    result = invoke([*LONG_70B, *extra])
    return json.loads(result.stdout), result.output


def test_simulate_uses_the_models_kv_capacity_unless_told_otherwise(tmp_path):
    default, output = simulated("--out", str(tmp_path / "run"))
    assert default["engine"]["kv_capacity_tokens"] == TOKENS_70B == default["kv_capacity_tokens"]
    assert f"KV cache: {TOKENS_70B:,} tokens" in output
    recorded = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (
        recorded["engine"]["kv_memory"]["source"] == "model"
        and recorded["cost"]["kv_memory"]["kv_capacity_tokens"] == TOKENS_70B
    )
    given, output = simulated("--kv-capacity-tokens", str(TOKENS_70B))
    assert given["engine"]["kv_memory"]["source"] == "given" and "given: --kv-capacity-tokens" in output
    unlimited, output = simulated("--unlimited-kv")
    assert unlimited["engine"]["kv_capacity_tokens"] is None and "KV cache: unlimited (--unlimited-kv)" in output
    # the limit binds on this run: the same as the capacity given by hand, not as no limit
    assert default["p99_ttft_ms"] == given["p99_ttft_ms"] != unlimited["p99_ttft_ms"]
    smaller, _ = simulated("--kv-capacity-tokens", "20000")
    assert smaller["engine"]["kv_capacity_tokens"] == 20000
    by_gib, output = simulated("--kv-memory-gib", "8")
    assert by_gib["kv_capacity_tokens"] == 8 * 2**30 // (320 * 1024) and "given: --kv-memory-gib 8 GiB" in output
    both = invoke([*LONG_70B, "--unlimited-kv", "--kv-capacity-tokens", "20000"], 2)
    assert "--unlimited-kv or --kv-capacity-tokens, not both" in both.output
    for extra in (["--kv-capacity-tokens", "20000"], ["--unlimited-kv"]):
        assert "one of them" in invoke([*LONG_70B, *extra, "--kv-memory-gib", "8"], 2).output
        assert "--gpu-memory-utilization" in invoke([*LONG_70B, *extra, "--gpu-memory-utilization", "0.95"], 2).output


def test_the_analytic_cost_keeps_no_kv_limit_and_records_nothing_new():
    printed = json.loads(invoke(["simulate", "--requests", "50"]).stdout)
    assert printed["engine"] == DEFAULT_OPTIONS.describe() and "kv_memory" not in printed["engine"]
    assert list(DEFAULT_OPTIONS.describe()) == [
        "max_batch_size",
        "admission",
        "aging_ms",
        "aging_chunk_tokens",
        "kv_capacity_tokens",
        "deadline_form",
        "noise_sigma",
        "bias",
        "correction",
        "margin_form",
        "step_grid_tokens",
    ]
    assert "kv_memory" not in resolve_cost("analytic").description
    with pytest.raises(ValueError, match="kv_memory states"):
        EngineOptions(kv_memory=resolve_cost(LLAMA3_8B).model_kv_memory())


def test_capacity_applies_the_models_kv_capacity(tmp_path):
    args = ["capacity", "--cost", LLAMA2_70B, "--workload", "chat", "--requests", "30", "--seeds", "1"]
    args += ["--policy", "sloweave", "--tpot-ms", "100", "--steps-per-doubling", "2", "--max-scale", "2"]
    args += ["--no-curves", "--jobs", "1"]
    for extra, tokens, source in (
        ([], TOKENS_70B, "model"),
        (["--kv-capacity-tokens", "20000"], 20000, "given"),
        (["--unlimited-kv"], None, "unlimited"),
    ):
        out = tmp_path / source
        result = invoke([*args, *extra, "--out", str(out)])
        payload = json.loads((out / "capacity.json").read_text())
        assert payload["engine_options"]["kv_capacity_tokens"] == tokens
        assert payload["engine_options"]["kv_memory"]["source"] == source
        assert payload["cost"]["kv_memory"]["kv_capacity_tokens"] == tokens
        assert "KV cache: " + ("unlimited" if tokens is None else f"{tokens:,} tokens") in result.output


def test_ablate_sizes_its_kv_rows_from_the_model():
    configs = _chosen_configs(("kv", "kv-best"))
    rows, kv = kv_rows(configs, resolve_cost(LLAMA2_70B))
    by_name = {c.name: c for c in rows}
    assert kv.tokens == TOKENS_70B and by_name["kv"].kv_capacity_tokens == by_name["kv-best"].kv_capacity_tokens
    assert by_name["kv"].kv_capacity_tokens == TOKENS_70B and f"{TOKENS_70B:,} tokens" in by_name["kv"].what
    assert by_name["greedy"].kv_capacity_tokens is None
    rows, kv = kv_rows(configs, resolve_cost("analytic"))
    assert kv.tokens == KV_CAPACITY_TOKENS == {c.name: c for c in rows}["kv"].kv_capacity_tokens
    assert "fixed" in {c.name: c for c in rows}["kv"].what and "analytic" in kv.reason
    assert kv_rows(configs, resolve_cost(LLAMA3_8B), 0.5)[1].tokens == kv_tokens_by_hand(PARAMS_8B, 1, 32, 8, 0.5)
