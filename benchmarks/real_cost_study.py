"""The capacity study on measured GPU costs: SLOWeave against densely tuned fixed budgets.

For each cost preset (operator profiles of Llama-3-8B on one A100 and Llama-2-70B on two)
and each input (the paper's workloads and the shared traces, the long-context Mooncake one
included), the capacity search of ``sloweave capacity`` (highest load with >= 90 % of
requests meeting both targets; per seed, then mean and spread) for, like for like:

- ``sloweave`` (one prompt per iteration) against the best of a dense sweep of ``fixed-C``
  (the paper's baseline, same engine);
- ``sloweave-multi`` (several prompts per iteration) against the best of a dense sweep of
  ``sarathi-B`` (vLLM's and Sarathi-Serve's token budget, same engine).

TPOT targets are set per model from its own decode-only step (not the analytic model's):
8B TP1 decodes in 12-21 ms, so 25 and 50 ms; 70B TP2 decodes in 57-110 ms, so 100 and
150 ms. TTFT targets: the workloads' own (chat 1 s, mixed and bursty 2 s, long 5 s), the
Azure conversation trace 1 s (a chat service), Mooncake 10 s on the 8B and 30 s on the 70B
(prompts of 12k tokens median, 38.6k at P90, up to 191k: a 70B TP2 prefills about 3k tokens
a second, so its P90 prompt alone takes 12 s).

KV memory is the model's on its GPUs (``ResolvedCost.model_kv_memory``: GPU memory x 0.9 minus
the weights and an activation reserve, over the KV bytes per token), with admission by memory
and preemption with recompute; ``--unlimited-kv`` gives the earlier, unlimited study. At each
pair's capacity (per seed) the runs of both policies are repeated to report their
preemptions, recomputed tokens and requests refused as too large for the KV cache.

Each (preset, input) is written as soon as it is done (``pairwise_<preset>_<input>.json``) and
reused by a later run unless ``--fresh``, so an interrupted study resumes.

    .venv/bin/python benchmarks/real_cost_study.py [--quick] [--out results/real_cost]

Writes per input and preset the capacity table (CSV), the pairwise ratios (CSV), one
summary (``summary.json``, strict JSON with the settings, the cost descriptions and the
version) and ``summary.md``; prints progress and the tables.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.admission import EXCEEDS_KV_CAPACITY
from sloweave.core.costs.resolve import resolve_cost
from sloweave.sim.options import EngineOptions
from sloweave.sim.traces import load_trace
from sloweave.sim.workloads import WORKLOADS
from sloweave.studies.capacity import capacity_frame
from sloweave.studies.search import CapacityStudy, SearchLattice
from sloweave.studies.sources import SpecSource, trace_source

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
FIXED = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096)
SARATHI = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096)
PRESETS = {"llama3-8b-tp1-a100": (25.0, 50.0), "llama2-70b-tp2-a100": (100.0, 150.0)}
INPUTS = {  # name -> (kind, TTFT ms)
    "chat": ("workload", 1000.0),
    "mixed": ("workload", 2000.0),
    "long": ("workload", 5000.0),
    "azure_conv": ("trace", 1000.0),
    "mooncake": ("trace", 10000.0),
}
TTFT_BY_PRESET = {("llama2-70b-tp2-a100", "mooncake"): 30000.0}
TRACE_FILES = {"azure_conv": "azure2023_conv.csv", "mooncake": "mooncake_synthetic.csv"}
PAIRS = (("sloweave", "fixed-"), ("sloweave-multi", "sarathi-"))


def source_for(name: str, seeds: int, requests: int):
    kind, _ = INPUTS[name]
    if kind == "workload":
        return SpecSource(WORKLOADS[name], requests, tuple(range(seeds)))
    trace = load_trace(TRACES / TRACE_FILES[name])
    return trace_source(trace, seeds, requests_per_seed=requests)


def pairwise(frame: pd.DataFrame, per_seed: dict) -> list[dict]:
    """Each deadline-aware policy against the best of its baseline family, per TPOT target."""
    rows = []
    for tpot, at in frame.groupby("tpot_ms"):
        for ours, family in PAIRS:
            baselines = at[
                at["policy"].str.startswith(family) | at["policy"].isin(["full" if family == "fixed-" else "orca"])
            ]
            best = baselines.loc[baselines["capacity_rps"].idxmax()]
            mine = at[at["policy"] == ours].iloc[0]
            seed_ratios = [a / b for a, b in zip(per_seed[(ours, tpot)], per_seed[(best["policy"], tpot)]) if b > 0]
            rows.append(
                {
                    "tpot_ms": tpot,
                    "policy": ours,
                    "capacity_rps": mine["capacity_rps"],
                    "std": mine["capacity_rps_std"],
                    "best_baseline": best["policy"],
                    "baseline_capacity_rps": best["capacity_rps"],
                    "baseline_std": best["capacity_rps_std"],
                    "ratio": mine["capacity_rps"] / best["capacity_rps"] if best["capacity_rps"] > 0 else None,
                    "ratio_seed_min": min(seed_ratios, default=None),
                    "ratio_seed_max": max(seed_ratios, default=None),
                    "censored": mine["censored"] or best["censored"],
                    "edge_of_sweep": best["policy"]
                    in (f"{family}{FIXED[0] if family == 'fixed-' else SARATHI[0]}", f"{family}4096"),
                }
            )
    return rows


def kv_memory(cost, args) -> dict | None:
    """The model's KV cache on its GPUs (None: unlimited, as asked)."""
    return None if args.unlimited_kv else cost.model_kv_memory(args.gpu_memory_utilization)


def memory_at_capacity(study: CapacityStudy, rows: list[dict], per_seed_k: dict) -> None:
    """Each pair row gets the mean preemptions, recomputed tokens and KV refusals per seed of
    its two policies, each at its own capacity (runs repeated: the search keeps only outcomes)."""
    for row in rows:
        for side, name in (("", row["policy"]), ("baseline_", row["best_baseline"])):
            stats = []
            for seed, k in per_seed_k[(name, row["tpot_ms"])]:
                if k is None:
                    continue
                workload = study.source.workload(seed, study.scale(k))
                result = study.options.simulate(
                    workload, study.policies[name], row["tpot_ms"], study.ttft_ms, study.cost, seed
                )
                reasons = result.rejected_reason
                refused = 0 if reasons is None else int(np.sum(reasons == EXCEEDS_KV_CAPACITY))
                stats.append((result.preemptions, result.recompute_tokens, refused))
            means = [float(v) for v in np.mean(stats, axis=0)] if stats else [None] * 3  # None: no capacity
            for key, value in zip(("preemptions", "recompute_tokens", "kv_refused"), means):
                row[f"{side}{key}_at_capacity"] = value


def run_one(preset: str, name: str, args, cost) -> tuple[pd.DataFrame, list[dict], dict]:
    tpots = PRESETS[preset]
    policies = (
        ["sloweave", "sloweave-multi", "full", "orca"]
        + [f"fixed-{c}" for c in FIXED]
        + [f"sarathi-{b}" for b in SARATHI]
    )
    source = source_for(name, args.seeds, args.requests)
    memory = kv_memory(cost, args)
    ttft_ms = TTFT_BY_PRESET.get((preset, name), INPUTS[name][1])
    study = CapacityStudy(
        source,
        policies,
        tpots,
        ttft_ms,
        SearchLattice(steps_per_doubling=8, min_scale=1 / 1024, max_scale=64.0),
        cost=cost.model,
        options=EngineOptions(kv_capacity_tokens=None if memory is None else memory.tokens),
    )
    started = time.perf_counter()
    capacities = study.capacities()
    frame = capacity_frame(capacities)
    per_seed = {(c.policy, c.tpot_ms): [s.rps for s in c.seeds] for c in capacities}
    rows = pairwise(frame, per_seed)
    memory_at_capacity(study, rows, {(c.policy, c.tpot_ms): [(s.seed, s.k) for s in c.seeds] for c in capacities})
    info = {
        "simulations": study.simulations,
        "seconds": round(time.perf_counter() - started, 1),
        "ttft_ms": ttft_ms,
        "kv_capacity_tokens": None if memory is None else memory.tokens,
        "source": source.describe(),
    }
    return frame, rows, info


def memory_cell(row: dict) -> str:
    def one(side: str) -> str:
        values = [row.get(f"{side}{key}_at_capacity") for key in ("preemptions", "recompute_tokens", "kv_refused")]
        if any(v is None for v in values):
            return "-"
        return f"{values[0]:.3g} / {values[1] / 1000:.3g} / {values[2]:.3g}"

    return f"{one('')}; {one('baseline_')}"


def markdown(summary: list[dict]) -> str:
    lines = [
        "| cost | KV tokens | input | TPOT ms | policy | capacity req/s | best baseline | its capacity | ratio (seeds min-max) "
        "| preemptions / recomputed k-tokens / KV-refused per run at capacity (ours; baseline) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        edge = " (edge of sweep)" if r["edge_of_sweep"] else ""
        ratio = (
            "no policy reaches the target at any load searched"
            if r["ratio"] is None
            else (f"**{r['ratio']:.2f}x** ({r['ratio_seed_min']:.2f}-{r['ratio_seed_max']:.2f})")
        )
        kv = "unlimited" if r.get("kv_capacity_tokens") is None else f"{r['kv_capacity_tokens']:,}"
        lines.append(
            f"| {r['preset']} | {kv} | {r['input']} | {r['tpot_ms']:g} | {r['policy']} | {r['capacity_rps']:.3g} ± {r['std']:.2g} | "
            f"{r['best_baseline']}{edge} | {r['baseline_capacity_rps']:.3g} ± {r['baseline_std']:.2g} | {ratio} | {memory_cell(r)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / "real_cost")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400, help="requests per seed (window)")
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="default: both")
    parser.add_argument("--input", action="append", choices=sorted(INPUTS), help="default: all")
    parser.add_argument(
        "--unlimited-kv", action="store_true", help="no KV-memory limit (the study before the model's memory)"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="as vLLM's; default 0.9")
    parser.add_argument("--quick", action="store_true", help="2 seeds x 150 requests, chat and mixed only")
    parser.add_argument(
        "--fresh", action="store_true", help="recompute every (preset, input), ignoring earlier results in --out"
    )
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.requests, args.input = 2, 150, args.input or ["chat", "mixed"]
    args.out.mkdir(parents=True, exist_ok=True)
    summary, costs = [], {}
    for preset in args.preset or list(PRESETS):
        cost = resolve_cost(preset)
        for name in args.input or list(INPUTS):
            done = args.out / f"pairwise_{preset}_{name}.json"
            settings = {
                "seeds": args.seeds,
                "requests": args.requests,
                "unlimited_kv": args.unlimited_kv,
                "gpu_memory_utilization": args.gpu_memory_utilization,
            }
            if done.exists() and not args.fresh and json.loads(done.read_text())["settings"] == settings:
                summary.extend(json.loads(done.read_text())["rows"])
                print(f"{preset} x {name}: reusing {done.name}", flush=True)
                continue
            print(f"[{time.strftime('%H:%M:%S')}] {preset} x {name} ...", flush=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # extrapolation is counted in the cost's description
                frame, rows, info = run_one(preset, name, args, cost)
            frame.to_csv(args.out / f"capacity_{preset}_{name}.csv", index=False)
            mine = [
                {"preset": preset, "input": name, **row, **{k: v for k, v in info.items() if k != "source"}}
                for row in rows
            ]
            done.write_text(
                json.dumps(
                    {"settings": settings, "rows": mine, "source": info["source"], "cost": cost.description},
                    indent=1,
                    allow_nan=False,
                )
            )
            summary.extend(mine)
            print(markdown(mine), flush=True)
        memory = kv_memory(cost, args)
        costs[preset] = {**cost.description, "kv_memory": None if memory is None else memory.describe()}
    pd.DataFrame(summary).to_csv(args.out / "pairwise.csv", index=False)
    doc = {
        "sloweave_version": version("sloweave"),
        "settings": {
            "seeds": args.seeds,
            "requests_per_seed": args.requests,
            "tpot_ms": PRESETS,
            "inputs": INPUTS,
            "fixed_sweep": FIXED,
            "sarathi_sweep": SARATHI,
            "attainment_target": 0.9,
            "lattice_steps_per_doubling": 8,
            "unlimited_kv": args.unlimited_kv,
            "gpu_memory_utilization": args.gpu_memory_utilization,
        },
        "costs": costs,
        "pairwise": summary,
    }
    (args.out / "summary.json").write_text(json.dumps(doc, indent=1, allow_nan=False, default=float))
    (args.out / "summary.md").write_text(markdown(summary))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
