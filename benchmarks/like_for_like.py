"""Like for like: SLOWeave against the best tuned baseline, every option for everyone.

Each condition is one capacity study (capacity = highest load with >= 90 % of requests
meeting both targets, per seed or trace window, on the project's lattice search), with
``fixed-tuned`` and ``sarathi-tuned`` (a refined sweep per cell) and the same engine
options for every policy. Conditions: exact prediction; admission control for all;
prediction error (lognormal sigma 0.1 / 0.2, bias 0.8x / 1.25x) with SLOWeave's online
correction and no hand-set margin, and sigma 0.1 without it; where adaptivity should win:
the drift scenario, two traces back to back, a TPOT target change mid-run, and the long
workload on a measured GPU cost (operator profiles, context-aware); last, the same three
scenarios on both measured A100 presets with each model's KV memory (``drift-8b``,
``target-change-8b``, ``azure+mooncake-8b`` and the ``-70b`` ones: 35 minutes of one core at
``--requests 400 --steps 8``, as docs/gpu-costs.md quotes them).

Resumable: a condition whose capacity.json exists is read back, not rerun. Writes
summary.csv, summary.json and summary.md under --out.

    python benchmarks/like_for_like.py [--only NAME ...] [--requests 1000] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.costs.resolve import resolve_cost
from sloweave.sim.options import EngineOptions
from sloweave.sim.traces import load_trace
from sloweave.sim.workloads import ALL_WORKLOADS
from sloweave.studies.capacity import run_capacity
from sloweave.studies.outputs import write_result_json
from sloweave.studies.parallel import Runner, local_cores
from sloweave.studies.search import CapacityStudy, SearchLattice
from sloweave.studies.sources import SpecSource, back_to_back, trace_source

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
POLICIES = ("sloweave", "sloweave-multi", "fixed-tuned", "sarathi-tuned")
ANALYTIC_TPOTS = (10.0, 25.0)


@dataclass(frozen=True)
class Condition:
    name: str
    source: str  # mixed, long, azure, drift, azure+mooncake
    options: EngineOptions = EngineOptions()
    tpots: tuple[float, ...] = ANALYTIC_TPOTS
    cost: str = "analytic"
    tpot_change_ms: float | None = None
    what: str = ""
    extra: dict = field(default_factory=dict)
    model_kv: bool = False  # the measured model's KV cache on its GPUs (admission by memory, preemption)
    ttft_ms: float | None = None  # instead of the input's own TTFT target


# Where adaptivity should win, on measured GPU costs with the model's KV memory: each preset's
# TPOT targets follow its own decode step (8B TP1 12-21 ms, 70B TP2 57-110 ms), the target
# change tightens the looser one to the tighter; Mooncake's prompts need 30 s TTFT on the 70B.
MEASURED = {
    "llama3-8b-tp1-a100": ("8b", (25.0, 50.0), 10000.0),
    "llama2-70b-tp2-a100": ("70b", (100.0, 150.0), 30000.0),
}


def measured_conditions() -> list[Condition]:
    out = []
    for preset, (short, tpots, long_ttft_ms) in MEASURED.items():
        memory = dict(cost=preset, model_kv=True)
        out += [
            Condition(f"drift-{short}", "drift", tpots=tpots, what=f"drift on {preset}, model KV memory", **memory),
            Condition(
                f"target-change-{short}",
                "mixed",
                tpots=(tpots[1],),
                tpot_change_ms=tpots[0],
                what=f"TPOT {tpots[1]:g} ms, then {tpots[0]:g} ms, on {preset}, model KV memory",
                **memory,
            ),
            Condition(
                f"azure+mooncake-{short}",
                "azure+mooncake",
                tpots=tpots,
                ttft_ms=long_ttft_ms,
                what=f"two traces back to back on {preset}, model KV memory",
                **memory,
            ),
        ]
    return out


def lattice_of(condition: Condition, args) -> SearchLattice:
    """The load lattice: down to 1/1024 of the input's rate with a measured model's memory (the
    70B serves the analytic model's loads at a hundredth of their rate), 1/64 otherwise."""
    min_scale = 1 / 1024 if condition.model_kv else 1 / 64
    return SearchLattice(steps_per_doubling=args.steps, min_scale=min_scale, max_scale=64.0)


def engine_of(condition: Condition, cost) -> EngineOptions:
    """The condition's engine options, with the model's KV capacity where it asks for it."""
    if not condition.model_kv:
        return condition.options
    return replace(condition.options, kv_capacity_tokens=cost.model_kv_memory(0.9).tokens)


def conditions() -> list[Condition]:
    """In priority order (the long workload's error modes last: its runs are the slowest)."""
    errors = (
        ("sigma0.1", dict(noise_sigma=0.1)),
        ("bias1.25", dict(bias=1.25)),
        ("sigma0.2", dict(noise_sigma=0.2)),
        ("bias0.8", dict(bias=0.8)),
    )

    def corrected(label, opts, s):
        return Condition(
            f"{label}-corrected-{s}",
            s,
            EngineOptions(correction=True, **opts),
            what=f"{label}, SLOWeave with online correction, no hand-set margin",
        )

    out = [Condition(f"exact-{s}", s, what="exact prediction") for s in ("mixed", "long", "azure")]
    out += [corrected(label, opts, s) for label, opts in errors for s in ("mixed", "azure")]
    out += [Condition("drift", "drift", what="scenario: chat, then long documents, then bursts")]
    out += [
        Condition(
            "target-change",
            "mixed",
            tpots=(25.0,),
            tpot_change_ms=10.0,
            what="TPOT target 25 ms, then 10 ms for the second half",
        )
    ]
    out += [
        Condition(
            "long-llama3-8b",
            "long",
            tpots=(25.0, 50.0),
            cost="llama3-8b-tp1-a100",
            what="long workload on measured A100 operator profiles (context-aware)",
        )
    ]
    out += [Condition("azure+mooncake", "azure+mooncake", what="two traces back to back")]
    out += [
        Condition(
            "sigma0.1-uncorrected-mixed",
            "mixed",
            EngineOptions(noise_sigma=0.1),
            what="sigma 0.1, no correction, no margin",
        )
    ]
    out += [
        Condition(
            f"admission-{s}", s, EngineOptions(admission="reject"), what="admission control (reject) for every policy"
        )
        for s in ("mixed", "azure")
    ]
    out += [corrected(label, opts, "long") for label, opts in errors]
    return out + measured_conditions()


def source_of(name: str, seeds: int, requests: int):
    """(load source, TTFT target ms)."""
    if name in ALL_WORKLOADS:
        spec = ALL_WORKLOADS[name]
        return SpecSource(spec, requests, tuple(range(seeds))), spec.ttft_ms
    windows = {"azure": ("azure2023_conv.csv", 300.0), "mooncake": ("mooncake_synthetic.csv", None)}
    parts = [trace_source(load_trace(TRACES / windows[p][0]), seeds, windows[p][1]) for p in name.split("+")]
    # Chat is judged at 1 s TTFT; with the long-prompt Mooncake trace in the mix, at its 10 s.
    return (parts[0], 1000.0) if len(parts) == 1 else (back_to_back(parts), 10000.0)


def run(condition: Condition, args) -> dict:
    out_dir = args.out / condition.name
    done = out_dir / "capacity.json"
    if done.exists():
        return json.loads(done.read_text())
    source, ttft_ms = source_of(condition.source, args.seeds, args.requests)
    ttft_ms = condition.ttft_ms or ttft_ms
    cost = resolve_cost(condition.cost)
    study = CapacityStudy(
        source,
        POLICIES,
        condition.tpots,
        ttft_ms,
        lattice_of(condition, args),
        cost=cost.model,
        options=engine_of(condition, cost),
        runner=Runner(jobs=args.jobs),
        tpot_change_ms=condition.tpot_change_ms,
        progress=True,
    )
    started = time.perf_counter()
    meta = {
        "command": "benchmarks/like_for_like.py",
        "condition": condition.name,
        "what": condition.what,
        "requests_per_seed": args.requests,
        "seeds": args.seeds,
        "tpot_change_ms": condition.tpot_change_ms,
        "kv_capacity_tokens": engine_of(condition, cost).kv_capacity_tokens,
    }
    payload = run_capacity(study, out_dir, meta, cost, curves=False)
    payload["seconds"] = round(time.perf_counter() - started, 1)
    payload["load_average_1min"] = os.getloadavg()[0]
    write_result_json(done, payload)
    return payload


def phased(condition: Condition) -> bool:
    return condition.source in ("drift", "azure+mooncake") or condition.tpot_change_ms is not None


def phase_of(condition: Condition, workload) -> np.ndarray:
    """Phase index per request: the parts of a scenario or of traces back to back, the
    halves of a target change; one phase otherwise."""
    if not phased(condition):
        return np.zeros(len(workload), dtype=int)
    sizes = workload.params.get("requests_per_part") or [len(workload) // 2, len(workload) - len(workload) // 2]
    return np.repeat(np.arange(len(sizes)), sizes)


def phase_breakdown(condition: Condition, args, payload: dict) -> list[dict]:
    """At each pair's load (SLOWeave's own capacity, per seed): which requests miss, on which
    target, and in which phase, for SLOWeave and its best baseline; and the per-request P99
    token gaps there (pooled over seeds: their median, P90 and P99 over requests)."""
    source, ttft_ms = source_of(condition.source, args.seeds, args.requests)
    ttft_ms = condition.ttft_ms or ttft_ms
    per_seed = pd.read_csv(args.out / condition.name / "capacity_seeds.csv")
    names = {name for r in payload["pairwise"] for name in (r["policy"], r["best_baseline"])}
    cost = resolve_cost(condition.cost)
    study = CapacityStudy(
        source,
        sorted(names),
        condition.tpots,
        ttft_ms,
        lattice_of(condition, args),
        cost=cost.model,
        options=engine_of(condition, cost),
        tpot_change_ms=condition.tpot_change_ms,
    )
    rows = []
    for r in payload["pairwise"]:
        ours = per_seed[(per_seed["policy"] == r["policy"]) & (per_seed["tpot_ms"] == r["tpot_ms"])]
        for seed, k in zip(ours["seed"], ours["k"]):
            if k != k:
                continue
            phases = phase_of(condition, source.workload(int(seed), study.scale(int(k))))
            for name in (r["policy"], r["best_baseline"]):
                run = study.run(name, int(seed), int(k), r["tpot_ms"]).requests
                targets = (
                    r["tpot_ms"]
                    if condition.tpot_change_ms is None
                    else study._targets(len(run), r["tpot_ms"])[run["request"]]
                )
                late_first = ~(run["ttft_ms"].to_numpy() <= ttft_ms + 1e-9)
                gaps = run["p99_tpot_ms"].to_numpy()
                slow_tokens = ~(gaps <= np.asarray(targets) + 1e-9)
                for phase in np.unique(phases):
                    sel = phases[run["request"].to_numpy()] == phase
                    rows.append(
                        {
                            "gaps": gaps[sel],
                            "condition": condition.name,
                            "pair": r["policy"],
                            "tpot_ms": r["tpot_ms"],
                            "seed": int(seed),
                            "load_scale": study.scale(int(k)),
                            "policy": name,
                            "phase": int(phase),
                            "requests": int(sel.sum()),
                            "missed_ttft": float(late_first[sel].mean()),
                            "missed_tpot": float(slow_tokens[sel].mean()),
                            "attainment": float((~late_first & ~slow_tokens)[sel].mean()),
                        }
                    )
    return rows


def at_capacity_table(rows: list[dict]) -> pd.DataFrame:
    """Per condition, pair, policy and phase: misses (mean over seeds) and the pooled gaps."""
    frame = pd.DataFrame(rows)
    out = []
    for key, group in frame.groupby(["condition", "pair", "tpot_ms", "policy", "phase"], sort=False):
        gaps = np.concatenate(group["gaps"].to_list())
        gaps = gaps[np.isfinite(gaps)]
        out.append(
            dict(
                zip(["condition", "pair", "tpot_ms", "policy", "phase"], key),
                load_scale=group["load_scale"].mean(),
                requests=int(group["requests"].sum()),
                missed_ttft=group["missed_ttft"].mean(),
                missed_tpot=group["missed_tpot"].mean(),
                attainment=group["attainment"].mean(),
                p50_gap_ms=float(np.percentile(gaps, 50)) if gaps.size else np.nan,
                p90_gap_ms=float(np.percentile(gaps, 90)) if gaps.size else np.nan,
                p99_gap_ms=float(np.percentile(gaps, 99)) if gaps.size else np.nan,
            )
        )
    return pd.DataFrame(out)


def summary_rows(condition: Condition, payload: dict) -> list[dict]:
    p99 = {(r["policy"], r["tpot_ms"]): r for r in payload["capacity"]}
    rows = []
    for r in payload["pairwise"]:
        rows.append(
            {
                "condition": condition.name,
                "what": condition.what,
                "input": condition.source,
                "cost": condition.cost,
                "options": condition.options.label(),
                "kv_capacity_tokens": payload.get("kv_capacity_tokens"),
                **{
                    k: r[k]
                    for k in (
                        "tpot_ms",
                        "policy",
                        "capacity_rps",
                        "capacity_rps_std",
                        "best_baseline",
                        "best_baseline_capacity_rps",
                        "best_baseline_capacity_rps_std",
                        "ratio",
                        "ratio_seed_min",
                        "ratio_seed_max",
                        "edge_of_sweep",
                        "note",
                    )
                },
                "censored": p99[(r["policy"], r["tpot_ms"])]["censored"],
                "seconds": payload.get("seconds"),
            }
        )
    return rows


def fmt(v, digits=3):
    return "-" if v is None or v != v else f"{v:.{digits}g}"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| condition | input | TPOT ms | policy | capacity req/s | best tuned baseline | its capacity | ratio (seeds min-max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        edge = " (edge of sweep)" if r["edge_of_sweep"] else ""
        ratio = (
            f"**{r['ratio']:.2f}x** ({r['ratio_seed_min']:.2f}-{r['ratio_seed_max']:.2f})"
            if r["ratio"] == r["ratio"] and r["ratio"] is not None
            else r["note"] or "-"
        )
        lines.append(
            f"| {r['condition']} | {r['input']} | {r['tpot_ms']:g} | {r['policy']} | {fmt(r['capacity_rps'])} ± {fmt(r['capacity_rps_std'], 2)} | "
            f"{r['best_baseline']}{edge} | {fmt(r['best_baseline_capacity_rps'])} ± {fmt(r['best_baseline_capacity_rps_std'], 2)} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / "like_for_like")
    parser.add_argument("--only", nargs="*", default=None, help="condition names (default: all, in priority order)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1000, help="requests per seed (synthetic workloads)")
    parser.add_argument("--steps", type=int, default=16, help="lattice steps per doubling")
    parser.add_argument("--jobs", type=int, default=local_cores())
    args = parser.parse_args()
    rows, phases = [], []
    for condition in conditions():
        if args.only and condition.name not in args.only:
            continue
        print(f"== {condition.name}: {condition.what}", flush=True)
        payload = run(condition, args)
        rows += summary_rows(condition, payload)
        print(markdown(summary_rows(condition, payload)), flush=True)
        phases += phase_breakdown(condition, args, payload)
    frame = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    if phases:
        at_capacity = at_capacity_table(phases)
        at_capacity.to_csv(args.out / "at_capacity.csv", index=False)
        print(at_capacity.round(3).to_string(index=False))
    frame.to_csv(args.out / "summary.csv", index=False)
    write_result_json(
        args.out / "summary.json",
        {"command": "benchmarks/like_for_like.py", "settings": vars(args) | {"out": str(args.out)}, "rows": rows},
    )
    (args.out / "summary.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
