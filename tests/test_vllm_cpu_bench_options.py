"""benchmarks/vllm_cpu_bench.py's options that need no engine: the simulated columns' noise."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import vllm_cpu_bench  # noqa: E402


def test_noise_from_names_a_step_log_that_must_exist(tmp_path, capsys):
    assert vllm_cpu_bench.parse_args([]).noise_from is None
    log = tmp_path / "served.jsonl"
    log.write_text("{}\n")
    assert vllm_cpu_bench.parse_args(["--noise-from", str(log)]).noise_from == log
    with pytest.raises(SystemExit):
        vllm_cpu_bench.parse_args(["--noise-from", str(tmp_path / "gone.jsonl")])
    err = capsys.readouterr().err
    assert "--noise-from" in err and "gone.jsonl: no such step log" in err


def test_a_finished_bench_run_is_simulated_again_with_its_own_settings(tmp_path):
    import bench_with_noise

    log = tmp_path / "served.jsonl"
    log.write_text("{}\n")
    settings = vars(vllm_cpu_bench.parse_args(["--tpot-ms", "30", "--ttft-ms", "1500", "--workload", "long"]))
    summary = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
               "plugin_variants": {"sloweave": {"tpot_ms": 30.0, "cost": "p.csv"}}}  # fmt: skip
    args = bench_with_noise.bench_args(json.loads(json.dumps(summary)), log, tmp_path)
    assert (args.tpot_ms, args.ttft_ms, args.workload, args.noise_from) == (30.0, 1500.0, "long", log)
    assert args.profile_file == tmp_path / "profile.csv"  # the bench took its own profile there
    assert bench_with_noise.engine_of("vllm-tuned-256", summary) == (256, None)
    assert bench_with_noise.engine_of("vllm-default-2048", summary) == (2048, None)
    assert bench_with_noise.engine_of("sloweave", summary) == (
        vllm_cpu_bench.VLLM_CPU_DEFAULT_BUDGET,
        {"tpot_ms": 30.0, "cost": "p.csv"},
    )
    with pytest.raises(ValueError, match="'sloweave-largest' is neither a plug-in variant of this run"):
        bench_with_noise.engine_of("sloweave-largest", summary)


def test_the_simulated_plugin_shares_the_margin_form_and_size_grid_the_plugin_serves_with(monkeypatch):
    config = vllm_cpu_bench.default_plugin_config(60.0, Path("benchmarks/results-vllm-cpu/tight-epyc/profile.csv"))
    assert vllm_cpu_bench.plugin_sim_options(config)["step_grid_tokens"] == 32  # the plug-in's default
    assert vllm_cpu_bench.plugin_sim_options(config | {"budget_rule": "fixed"})["step_grid_tokens"] == 1
    variant = config | vllm_cpu_bench.PLUGIN_VARIANTS["sloweave-no-grid"]
    assert vllm_cpu_bench.plugin_sim_options(variant)["step_grid_tokens"] == 1
    monkeypatch.setenv("SLOWEAVE_MARGIN_FORM", "per-step")
    assert vllm_cpu_bench.plugin_sim_options(config)["margin_form"] == "per-step"  # as the plug-in reads it


def test_profile_prefixes_are_token_counts(capsys):
    assert vllm_cpu_bench.parse_args([]).profile_prefixes == (0, 512, 1536)
    assert vllm_cpu_bench.parse_args(["--profile-prefixes", "1536,0,512,0"]).profile_prefixes == (0, 512, 1536)
    for bad in ("0,-512", "0,half", ""):
        with pytest.raises(SystemExit):
            vllm_cpu_bench.parse_args(["--profile-prefixes", bad])
        assert "--profile-prefixes" in capsys.readouterr().err


def test_a_load_search_that_attained_at_every_rate_it_tried_stops_the_bench(capsys):
    """On a machine twice as fast the load search's fixed 8-128 req/s found 118 req/s where vLLM attained up
    to about 250: the capacity search around it censored 13 of 18 cells. The range's top is an option, and a
    search that never missed says so instead of going on."""
    assert vllm_cpu_bench.parse_args([]).search_max_rps == 128.0
    assert vllm_cpu_bench.parse_args(["--search-max-rps", "512"]).search_max_rps == 512.0
    for bad in ("8", "nan", "-1"):
        with pytest.raises(SystemExit):
            vllm_cpu_bench.parse_args(["--search-max-rps", bad])
    assert "--search-max-rps must be a rate above 8 req/s" in capsys.readouterr().err
    vllm_cpu_bench.check_load_point(100.0, 128.0)  # a rate missed below the top: a load point
    with pytest.raises(SystemExit, match="every rate tried up to 128 req/s attained the target"):
        vllm_cpu_bench.check_load_point(128.0, 128.0)


def test_profile_pieces_are_prompt_counts_of_at_least_one(capsys):
    assert vllm_cpu_bench.parse_args([]).profile_pieces == (1, 4)
    assert vllm_cpu_bench.parse_args(["--profile-pieces", "8,1"]).profile_pieces == (1, 8)
    for bad in ("0,4", "1,-4", "four"):
        with pytest.raises(SystemExit):
            vllm_cpu_bench.parse_args(["--profile-pieces", bad])
        assert "--profile-pieces" in capsys.readouterr().err


def test_interleaved_searches_try_every_engine_at_each_step_and_find_what_each_search_alone_finds(monkeypatch):
    """``--interleave``: the engines' tries alternate step by step (a slow minute falls on a try of
    each), each engine's search moving on its own results, so each finds the capacity its search
    alone finds. The engines here are names and the runs a rule (an engine attains below its capacity):
    what is tested is the search, not an engine."""
    capacity_of = {"vllm-tuned-1024": 300.0, "sloweave": 250.0}
    tried = []

    def workload_for(args, seed, rate):
        return rate  # the run's rate is all the rule reads

    def measure(engine, rate, args, vocab, seed):
        tried.append(engine)
        return {"attainment": 1.0 if rate <= capacity_of[engine] else 0.5}

    monkeypatch.setattr(vllm_cpu_bench, "measure", measure)
    monkeypatch.setattr(vllm_cpu_bench, "workload_for", workload_for)
    args = vllm_cpu_bench.parse_args(["--capacity-steps", "4", "--requests", "20"])
    engines = [(name, name) for name in capacity_of]
    found = vllm_cpu_bench.interleaved_capacities(engines, args, 1024, 0, 267.0)
    assert tried == [name for _ in range(4) for name in capacity_of]
    for name, engine in engines:
        tried.clear()
        alone = vllm_cpu_bench.capacity(engine, args, 1024, 0, 267.0)
        assert found[name] == alone and tried == [name] * 4
    assert found["sloweave"]["capacity_rps"] < found["vllm-tuned-1024"]["capacity_rps"] <= 300.0
