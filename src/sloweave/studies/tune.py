"""``sloweave tune``: the best fixed token budget for engines that only have one.

Operators of vLLM (``--max-num-batched-tokens``), SGLang (``--chunked-prefill-size``) and
TensorRT-LLM (``max_num_tokens``) set one number, usually from a rule of thumb: a quarter
to a half of the mean prompt length. This module measures it instead. For every budget of
a sweep it simulates the engine's rule on the operator's workload or trace and cost model,
and reports:

- its capacity: the highest load at which SLO attainment stays at the target (the
  capacity search of ``sloweave.studies.search``, same lattice, same seeds for every budget);
- at one given load: goodput, attainment, P99 TTFT and P99 TPOT (the trade-off: small
  budgets protect TPOT and pay in TTFT, large ones the reverse);
- the budget with the highest capacity and the one with the highest goodput at that load,
  the flag that sets it, how far it stays from SLOWeave on the same input, and how the
  rule of thumb (rounded to a power of two) would have fared.

Engine rules (the simulator's static policies):
- ``sarathi``: a budget of B tokens per iteration shared by the decodes (one token each)
  and prompt chunks, several prompts per iteration: vLLM's ``max_num_batched_tokens`` and
  TensorRT-LLM's ``max_num_tokens`` (both count decode tokens);
- ``budget``: the same with at most one prompt per iteration;
- ``fixed``: one prompt chunk of at most C tokens next to all decodes, which do not count:
  SGLang's ``chunked_prefill_size`` limits the prefill tokens of a batch.
SLOWeave is compared in the matching form: ``sloweave-multi`` (several prompts, as the vLLM
plug-in runs) for ``sarathi``, ``sloweave`` (one prompt) otherwise.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pandas as pd

from sloweave.sim.options import DEFAULT_OPTIONS, EngineOptions, engine_options
from sloweave.studies.search import (
    DEFAULT_ATTAINMENT,
    DEFAULT_LATTICE,
    CapacityStudy,
    SearchLattice,
    best_of_rule,
    budget_of,
    refined_budgets,
    with_changes,
)
from sloweave.core.validate import ATTAINMENT, DURATION_MS, DURATION_S, MAX_TOKENS, REPEATS, SCALE, TOKENS, Range
from sloweave.studies.inputs import REQUESTS, max_model_len_option, model_len_or_default, once_each, parallel_options
from sloweave.studies.outputs import check_writable, command_settings, write_result_json
from sloweave.studies.parallel import SERIAL, Runner, local_cores
from sloweave.studies.result_folders import result_folder, result_folder_options
from sloweave.studies.sources import DEFAULT_WINDOW_S, LoadSource, SpecSource, trace_source
from sloweave.core.costs.analytic import AnalyticCost
from sloweave.core.costs.protocols import CostModel
from sloweave.core.costs.resolve import KIND_STEP_PROFILE, ResolvedCost, cost_option
from sloweave.core.policy import DEFAULT_MAX_CHUNK_TOKENS
from sloweave.studies.pictures import pyplot
from sloweave.studies.replay import DEFAULT_TRACE_TTFT_MS
from sloweave.sim.traces import FORMATS, TraceError, load_trace
from sloweave.sim.workloads import ALL_WORKLOADS, WorkloadError

RULES = ("sarathi", "budget", "fixed")
ENGINES = {
    # engine: (how the value is set, the rule that matches the engine's semantics)
    "vllm": ("--max-num-batched-tokens {n}", "sarathi"),
    "sglang": ("--chunked-prefill-size {n}", "fixed"),
    "trtllm": (
        "max_num_tokens: {n}  (LLM API / trtllm-serve config; --max_num_tokens {n} for trtllm-build)",
        "sarathi",
    ),
}
# Powers of two and the 1.5x points between them: every value a multiple of 64 tokens.
DEFAULT_BUDGETS_TOKENS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
QUICK_BUDGETS_TOKENS = (256, 512, 1024, 2048, 4096, 8192)
RESULT_COLUMNS = [
    "budget_tokens",
    "policy",
    "capacity_rps",
    "capacity_rps_std",
    "capacity_scale",
    "censored",
    "load_rps",
    "goodput_rps",
    "attainment",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "rule_of_thumb",
]


def policy_name(rule: str, budget_tokens: int) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: choose one of {', '.join(RULES)}")
    return f"{rule}-{int(budget_tokens)}"


def sloweave_variant(rule: str) -> str:
    return "sloweave-multi" if rule == "sarathi" else "sloweave"


def nearest_power_of_two(tokens: float) -> int:
    """Nearest power of two in log space (so 384 -> 512, 360 -> 256); at least 64 tokens."""
    return max(64, 2 ** int(round(math.log2(max(tokens, 1.0)))))


@dataclass(frozen=True)
class RuleOfThumb:
    """A quarter to a half of the mean prompt length, each end rounded to a power of two."""

    mean_prompt_tokens: float
    quarter_tokens: int
    half_tokens: int

    @classmethod
    def of(cls, mean_prompt_tokens: float) -> RuleOfThumb:
        return cls(
            float(mean_prompt_tokens),
            nearest_power_of_two(mean_prompt_tokens / 4),
            nearest_power_of_two(mean_prompt_tokens / 2),
        )

    @property
    def budgets_tokens(self) -> tuple[int, ...]:
        return tuple(sorted({self.quarter_tokens, self.half_tokens}))


def mean_prompt_tokens(source: LoadSource) -> float:
    """Mean prompt length over every seed's requests (at load 1; load does not change lengths)."""
    prompts = np.concatenate([source.workload(seed, 1.0).prompt_tokens for seed in range(source.num_seeds)])
    return float(prompts.mean())


@dataclass
class TuneResult:
    source: dict
    rule: str
    tpot_ms: float
    ttft_ms: float
    attainment_target: float
    load_scale: float
    load_source: str  # how the load was chosen
    table: pd.DataFrame  # one row per budget, RESULT_COLUMNS
    sloweave: dict  # the same columns for SLOWeave
    rule_of_thumb: RuleOfThumb
    best_capacity_tokens: int
    best_goodput_tokens: int
    simulations: int
    step_pct: float

    def row(self, budget_tokens: int) -> dict:
        return self.table.set_index("budget_tokens").loc[budget_tokens].to_dict() | {"budget_tokens": budget_tokens}

    def comparisons(self) -> dict:
        """Best fixed budget against SLOWeave, and the rule of thumb against the best."""
        best = self.row(self.best_capacity_tokens)
        best_goodput = self.row(self.best_goodput_tokens)
        ours = self.sloweave

        def ratio(a: float, b: float) -> float | None:
            return a / b if b > 0 else None

        thumb = []
        for tokens in self.rule_of_thumb.budgets_tokens:
            row = self.row(tokens)
            thumb.append(
                {
                    "budget_tokens": tokens,
                    "capacity_rps": row["capacity_rps"],
                    "capacity_vs_best": ratio(row["capacity_rps"], best["capacity_rps"]),
                    "goodput_rps": row["goodput_rps"],
                    "goodput_vs_best": ratio(row["goodput_rps"], best_goodput["goodput_rps"]),
                    "p99_ttft_ms": row["p99_ttft_ms"],
                    "p99_tpot_ms": row["p99_tpot_ms"],
                }
            )
        return {
            "best_capacity": {"budget_tokens": self.best_capacity_tokens, "capacity_rps": best["capacity_rps"]},
            "best_goodput_at_load": {
                "budget_tokens": self.best_goodput_tokens,
                "goodput_rps": best_goodput["goodput_rps"],
            },
            "sloweave": {
                "policy": ours["policy"],
                "capacity_rps": ours["capacity_rps"],
                "goodput_rps": ours["goodput_rps"],
            },
            "sloweave_capacity_over_best": ratio(ours["capacity_rps"], best["capacity_rps"]),
            "sloweave_goodput_over_best": ratio(ours["goodput_rps"], best_goodput["goodput_rps"]),
            "rule_of_thumb": {
                "mean_prompt_tokens": self.rule_of_thumb.mean_prompt_tokens,
                "rounding": "nearest power of two (log scale), at least 64",
                "budgets": thumb,
            },
        }


def tune(
    source: LoadSource,
    rule: str = "sarathi",
    budgets_tokens: tuple[int, ...] = DEFAULT_BUDGETS_TOKENS,
    tpot_ms: float = 25.0,
    ttft_ms: float = 2000.0,
    cost: CostModel | None = None,
    load_scale: float | None = None,
    refine: bool = True,
    lattice: SearchLattice = DEFAULT_LATTICE,
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
    options: EngineOptions = DEFAULT_OPTIONS,
    runner: Runner = SERIAL,
    progress: bool = False,
    store=None,
    **changes,
) -> TuneResult:
    """Sweep the engine's fixed budget on ``source``; see the module docstring.

    ``load_scale`` is the load (arrival-rate scale, rounded to the capacity lattice) at
    which goodput and latencies are compared; None picks the best budget's capacity (the
    median over seeds), the highest load that budget sustains. ``refine`` adds one round
    of budgets between the best one and its neighbours. ``lattice`` (the attainment target
    and load lattice), ``max_chunk_tokens``, ``options``, ``runner``, ``progress`` and
    ``store`` (``sloweave.studies.parallel.TaskStore``: --resume) go to every
    ``CapacityStudy``; ``changes``: a field of the lattice or the runner given on its own
    (``steps_per_doubling=8``, ``jobs=2``).
    """
    lattice, runner = with_changes(lattice, runner, changes, "tune")
    if not budgets_tokens or any(int(b) != b or b < 1 for b in budgets_tokens):
        raise ValueError(f"budgets must be whole numbers of tokens >= 1, got {budgets_tokens!r}")
    thumb = RuleOfThumb.of(mean_prompt_tokens(source))
    budgets = sorted({int(b) for b in budgets_tokens} | set(thumb.budgets_tokens))
    ours_name = sloweave_variant(rule)

    def study_of(names: list[str]) -> CapacityStudy:
        # Same seeds, lattice and targets for every budget, so capacities compare directly.
        return CapacityStudy(
            source,
            names,
            [tpot_ms],
            ttft_ms,
            lattice,
            cost=cost or AnalyticCost(),
            max_chunk_tokens=max_chunk_tokens,
            options=options,
            runner=runner,
            progress=progress,
            store=store,
        )

    def best_of(candidates: list[int]) -> int:
        # the capacity study's own ranking (ties to the smaller budget)
        return budget_of(best_of_rule([capacities[policy_name(rule, b)] for b in candidates], rule).policy, rule)

    study = study_of([policy_name(rule, b) for b in budgets] + [ours_name])
    study_by_policy = dict.fromkeys(study.policies, study)
    capacities = {c.policy: c for c in study.capacities()}
    best_capacity = best_of(budgets)
    if refine:
        extra = refined_budgets(best_capacity, budgets)
        if extra:
            refined = study_of([policy_name(rule, b) for b in extra])
            study_by_policy.update(dict.fromkeys(refined.policies, refined))
            capacities.update({c.policy: c for c in refined.capacities()})
            budgets = sorted(budgets + extra)
            best_capacity = best_of(budgets)
    names = [policy_name(rule, b) for b in budgets]
    if load_scale is None:
        ks = [s.k for s in capacities[policy_name(rule, best_capacity)].seeds if s.k is not None]
        k = int(np.median(ks)) if ks else study.min_k
        how = f"the capacity of the best budget ({best_capacity} tokens), median over seeds"
    else:
        k = min(max(round(math.log2(load_scale) * study.steps), study.min_k), study.max_k)
        how = "given"
    seeds = range(source.num_seeds)
    load_rps = float(np.mean([study.scale(k) * source.base_rate_rps(s) for s in seeds]))

    def describe(name: str) -> dict:
        cap = capacities[name].row()
        per_seed = [study_by_policy[name].metrics(name, s, k, tpot_ms) for s in seeds]
        return {
            "policy": name,
            "capacity_rps": cap["capacity_rps"],
            "capacity_rps_std": cap["capacity_rps_std"],
            "capacity_scale": cap["capacity_scale"],
            "censored": cap["censored"],
            "load_rps": load_rps,
            # mean over seeds of per-seed (per-request-first) numbers, as SPEC.md asks
            "goodput_rps": float(np.mean([m.goodput_rps for m in per_seed])),
            "attainment": float(np.mean([m.attainment for m in per_seed])),
            "p99_ttft_ms": float(np.mean([m.p99_ttft_ms for m in per_seed])),
            "p99_tpot_ms": float(np.mean([m.p99_tpot_ms for m in per_seed])),
        }

    rows = [
        {"budget_tokens": b, **describe(n), "rule_of_thumb": b in thumb.budgets_tokens} for b, n in zip(budgets, names)
    ]
    table = pd.DataFrame(rows)[RESULT_COLUMNS]
    best_goodput = int(
        table.sort_values(["goodput_rps", "budget_tokens"], ascending=[False, True]).iloc[0]["budget_tokens"]
    )
    return TuneResult(
        source=source.describe(),
        rule=rule,
        tpot_ms=float(tpot_ms),
        ttft_ms=float(ttft_ms),
        attainment_target=lattice.attainment_target,
        load_scale=study.scale(k),
        load_source=how,
        table=table,
        sloweave={"budget_tokens": None, **describe(ours_name)},
        rule_of_thumb=thumb,
        best_capacity_tokens=int(best_capacity),
        best_goodput_tokens=best_goodput,
        simulations=sum(s.simulations for s in set(study_by_policy.values())),
        step_pct=100.0 * (2.0 ** (1.0 / study.steps) - 1.0),
    )


# --------------------------------------------------------------------------- outputs


def flag_for(engine: str, budget_tokens: int) -> str:
    return ENGINES[engine][0].format(n=int(budget_tokens))


def _fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else ""
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(result: TuneResult) -> str:
    header = "| budget (tokens) | capacity req/s | goodput req/s | attainment | P99 TTFT ms | P99 TPOT ms | note |"
    lines = [header, "|" + "---|" * 7]
    for row in [*result.table.to_dict(orient="records"), result.sloweave]:
        notes = []
        if row["budget_tokens"] == result.best_capacity_tokens:
            notes.append("best capacity")
        if row["budget_tokens"] == result.best_goodput_tokens:
            notes.append("best goodput at load")
        if row.get("rule_of_thumb"):
            notes.append("rule of thumb")
        if row["censored"]:
            notes.append(row["censored"])
        label = row["policy"] if row["budget_tokens"] is None else _fmt(row["budget_tokens"])
        lines.append(
            f"| {label} | {_fmt(row['capacity_rps'])} ± {_fmt(row['capacity_rps_std'])} | {_fmt(row['goodput_rps'])} "
            f"| {100 * row['attainment']:.1f} % | {_fmt(row['p99_ttft_ms'], 0)} | {_fmt(row['p99_tpot_ms'])} | {', '.join(notes)} |"
        )
    return "\n".join(lines) + "\n"


def recommendation(result: TuneResult, engine: str) -> list[str]:
    """The lines printed at the end: the flag, the gap to SLOWeave, the rule of thumb."""
    cmp = result.comparisons()
    best = cmp["best_capacity"]
    lines = []
    if best["capacity_rps"] <= 0:
        lines.append(
            "WARNING: no budget meets the targets even at the lowest load searched; lower --min-scale, "
            "or check the SLO targets against the cost model"
        )
    swept = result.table["budget_tokens"]
    if best["capacity_rps"] > 0 and best["budget_tokens"] in (swept.min(), swept.max()):
        lines.append(
            f"NOTE: the best budget is at the edge of the sweep ({swept.min()}-{swept.max()}); extend it with --budget"
        )
    lines += [
        f"best fixed budget: {best['budget_tokens']} tokens ({result.rule} rule), capacity {best['capacity_rps']:.1f} req/s "
        f"at TPOT {result.tpot_ms:g} ms, TTFT {result.ttft_ms:g} ms, attainment >= {result.attainment_target:.0%}",
        f"set: {flag_for(engine, best['budget_tokens'])}",
    ]
    if ENGINES[engine][1] != result.rule:
        lines.append(
            f"note: {engine}'s setting matches the {ENGINES[engine][1]!r} rule; this sweep used {result.rule!r} "
            f"(run with --rule {ENGINES[engine][1]} for the engine's own semantics)"
        )
    good = cmp["best_goodput_at_load"]
    lines.append(
        f"at load {result.table['load_rps'].iloc[0]:.1f} req/s (x{result.load_scale:.3g}; {result.load_source}): "
        f"best goodput {good['goodput_rps']:.1f} req/s with {good['budget_tokens']} tokens"
    )
    ours = cmp["sloweave"]
    over_cap, over_good = cmp["sloweave_capacity_over_best"], cmp["sloweave_goodput_over_best"]
    lines.append(
        f"SLOWeave ({ours['policy']}) on the same input: capacity {ours['capacity_rps']:.1f} req/s "
        f"({_ratio(over_cap)} the best fixed budget), goodput at load {ours['goodput_rps']:.1f} req/s ({_ratio(over_good)})"
    )
    thumb = cmp["rule_of_thumb"]
    parts = [
        f"{b['budget_tokens']} tokens: capacity {b['capacity_rps']:.1f} req/s ({_ratio(b['capacity_vs_best'])} the best)"
        for b in thumb["budgets"]
    ]
    lines.append(
        f"rule of thumb (1/4 to 1/2 of the mean prompt, {thumb['mean_prompt_tokens']:.0f} tokens, rounded to the nearest "
        f"power of two): " + "; ".join(parts)
    )
    lines.append(f"(capacities are exact to one lattice step, {result.step_pct:.1f} %; ± is the std over seeds)")
    return lines


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def plot(result: TuneResult, path: Path) -> None:
    """P99 TTFT, P99 TPOT (at the load) and capacity against the budget, SLOWeave as a line."""
    plt = pyplot()
    t = result.table
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.9))
    panels = [
        ("p99_ttft_ms", "P99 TTFT (ms)", result.ttft_ms, True),
        ("p99_tpot_ms", "P99 TPOT (ms)", result.tpot_ms, False),
        ("capacity_rps", "capacity (req/s)", None, False),
    ]
    for ax, (column, label, target, log_y) in zip(axes, panels):
        ax.plot(t["budget_tokens"], t[column], marker="o", color="C0", label=f"{result.rule}-B")
        thumb = t[t["rule_of_thumb"]]
        ax.scatter(
            thumb["budget_tokens"],
            thumb[column],
            s=90,
            facecolors="none",
            edgecolors="C1",
            zorder=5,
            label="rule of thumb",
        )
        ax.axhline(result.sloweave[column], color="black", linewidth=2, label=result.sloweave["policy"])
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
        ax.axvline(result.best_capacity_tokens, color="C2", linestyle=":", label="best capacity")
        ax.set_xscale("log", base=2)
        ax.set_xticks(t["budget_tokens"], [str(b) for b in t["budget_tokens"]], rotation=60, fontsize=7)
        ax.minorticks_off()
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("fixed budget (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    axes[0].set_title(f"at load x{result.load_scale:.3g}", fontsize=9)
    axes[1].set_title(f"at load x{result.load_scale:.3g}", fontsize=9)
    axes[2].set_title(f"attainment >= {result.attainment_target:.0%}", fontsize=9)
    fig.suptitle(
        f"{result.source.get('name')}: {result.rule} rule, TPOT {result.tpot_ms:g} ms, TTFT {result.ttft_ms:g} ms",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    result: TuneResult, engine: str, out_dir: Path, meta: dict | None = None, notes: list[str] | tuple[str, ...] = ()
) -> dict:
    """tune.csv, tune.md (``notes`` under its title: e.g. the cost model's), tune.png and tune.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    full = pd.concat([result.table, pd.DataFrame([{**result.sloweave, "rule_of_thumb": False}])], ignore_index=True)
    full.to_csv(out_dir / "tune.csv", index=False)
    advice = recommendation(result, engine)
    (out_dir / "tune.md").write_text(
        f"# sloweave tune: {result.source.get('name')}\n\n"
        + "".join(f"{line}\n\n" for line in notes)
        + markdown_table(result)
        + "\n"
        + "\n".join(f"- {line}" for line in advice)
        + "\n"
    )
    plot(result, out_dir / "tune.png")
    payload = {
        **(meta or {}),
        "source": result.source,
        "rule": result.rule,
        "engine": engine,
        "flag": flag_for(engine, result.best_capacity_tokens),
        "tpot_ms": result.tpot_ms,
        "ttft_ms": result.ttft_ms,
        "attainment_target": result.attainment_target,
        "load_scale": result.load_scale,
        "load_source": result.load_source,
        "lattice_step_pct": result.step_pct,
        "simulations": result.simulations,
        "comparisons": result.comparisons(),
        "sweep": result.table.to_dict(orient="records"),
        "sloweave_row": result.sloweave,
        "advice": advice,
    }
    write_result_json(out_dir / "tune.json", payload)
    return payload


# --------------------------------------------------------------------------- command


def mean_context_tokens(source: LoadSource) -> float:
    """The workload's mean KV context per decode: its mean prompt plus half its mean output."""
    frames = [source.workload(seed, 1.0) for seed in range(source.num_seeds)]
    prompts = np.concatenate([w.prompt_tokens for w in frames])
    outputs = np.concatenate([w.output_tokens for w in frames])
    return float(prompts.mean() + outputs.mean() / 2)


def step_profile_cost(
    resolved: ResolvedCost, kind: str, context_tokens: float | None, source: LoadSource
) -> ResolvedCost:
    """A step-time profile as tune has always used it: the fitted ``kind`` at a fixed KV context
    per decode (by default the workload's mean context, the advice in sloweave.core.costs.fitted)."""
    return resolved.step_profile(kind, mean_context_tokens(source) if context_tokens is None else context_tokens)


def _cost_from_profile(
    path: Path, kind: str, context_tokens: float | None, source: LoadSource
) -> tuple[CostModel, dict]:
    from sloweave.core.costs.resolve import resolve_cost

    resolved = step_profile_cost(resolve_cost(str(path)), kind, context_tokens, source)
    return resolved.model, resolved.description


@click.command()
@click.option("--workload", type=click.Choice(list(ALL_WORKLOADS)), default=None, help="synthetic workload or scenario")
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="request trace file instead",
)
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True)
@click.option(
    "--engine", type=click.Choice(list(ENGINES)), default="vllm", show_default=True, help="whose flag to print"
)
@click.option(
    "--rule",
    type=click.Choice(RULES),
    default=None,
    help="the engine's budget rule [default: the engine's: vllm/trtllm sarathi, sglang fixed]",
)
@click.option("--tpot-ms", type=DURATION_MS.option(), default=25.0, show_default=True)
@click.option(
    "--ttft-ms",
    type=DURATION_MS.option(),
    default=None,
    help=f"TTFT target [default: the workload's; {DEFAULT_TRACE_TTFT_MS:g} for a trace]",
)
@click.option("--attainment", type=ATTAINMENT.option(), default=DEFAULT_ATTAINMENT, show_default=True)
@click.option(
    "--budget",
    "budgets",
    type=TOKENS.option(),
    multiple=True,
    callback=once_each,
    help="repeat for a custom sweep [default: 256 ... 8192, powers of two and 1.5x between]",
)
@click.option(
    "--load-scale",
    type=SCALE.option(),
    default=None,
    help="load for the goodput comparison, as a rate scale [default: the best budget's capacity]",
)
@cost_option()
@click.option(
    "--cost-kind",
    type=click.Choice(["regression", "table"]),
    default="regression",
    show_default=True,
    help="model fitted from a step-time profile file",
)
@click.option(
    "--context-tokens",
    type=Range(0, MAX_TOKENS, " of tokens", low_open=True).option(),
    default=None,
    help="KV context per decode for a step-time profile file [default: mean prompt + half the mean output]",
)
@click.option("--seeds", type=REPEATS.option(), default=None, help="seeds / trace windows [default: 5; --quick 3]")
@click.option(
    "--requests",
    "num_requests",
    type=REQUESTS,
    default=None,
    help="requests per seed of a workload [default: 2000; --quick 800]",
)
@click.option(
    "--window-s", type=DURATION_S.option(), default=DEFAULT_WINDOW_S, show_default=True, help="trace window length"
)
@click.option(
    "--min-scale",
    type=SCALE.option(),
    default=1.0 / 16.0,
    show_default=True,
    help="lowest load searched (rate scale); lower it for slow cost models",
)
@click.option(
    "--max-chunk", type=TOKENS.option(), default=DEFAULT_MAX_CHUNK_TOKENS, show_default=True, help="SLOWeave's C_max"
)
@click.option(
    "--refine/--no-refine",
    default=True,
    show_default=True,
    help="one more round between the best budget and its neighbours",
)
@click.option("--quick", is_flag=True, help="3 seeds, 800 requests, 6 budgets (powers of two), lattice step 9 %")
@parallel_options()
@max_model_len_option()
@engine_options(dest="engine_opts")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("results/tune"),
    show_default=True,
)
@result_folder_options(resumable=True)
def tune_command(
    workload,
    trace_path,
    fmt,
    engine,
    rule,
    tpot_ms,
    ttft_ms,
    attainment,
    budgets,
    load_scale,
    cost,
    cost_kind,
    context_tokens,
    seeds,
    num_requests,
    window_s,
    min_scale,
    max_chunk,
    refine,
    quick,
    jobs,
    ray_address,
    max_model_len_tokens,
    engine_opts,
    out_dir,
    force,
    resume,
) -> None:
    """Sweep the fixed token budget of an engine and print the value to set."""
    if (trace_path is None) == (workload is None):
        raise click.UsageError("give exactly one of --workload NAME or --trace PATH")
    if workload is not None and max_model_len_tokens is not None:
        raise click.UsageError("--max-model-len applies to --trace only")
    check_writable(out_dir, "--out")
    if cost.kind != KIND_STEP_PROFILE:
        given = click.get_current_context().get_parameter_source
        for name, label in (("cost_kind", "--cost-kind"), ("context_tokens", "--context-tokens")):
            if given(name) == click.core.ParameterSource.COMMANDLINE:
                raise click.BadParameter(
                    f"applies to a step-time profile file only, not --cost {cost.spec}", param_hint=label
                )
    rule = rule or ENGINES[engine][1]
    seeds = seeds or (3 if quick else 5)
    budgets = tuple(budgets) or (QUICK_BUDGETS_TOKENS if quick else DEFAULT_BUDGETS_TOKENS)
    try:
        if trace_path is not None:
            trace = load_trace(trace_path, fmt, model_len_or_default(max_model_len_tokens))
            source = trace_source(
                trace, seeds, window_s if trace.has_arrivals else None, requests_per_seed=num_requests
            )
            ttft_ms = ttft_ms or DEFAULT_TRACE_TTFT_MS
        else:
            spec = ALL_WORKLOADS[workload]
            source = SpecSource(spec, num_requests or (800 if quick else 2000), tuple(range(seeds)))
            ttft_ms = ttft_ms or spec.ttft_ms
        if cost.kind == KIND_STEP_PROFILE:
            cost = step_profile_cost(cost, cost_kind, context_tokens, source)
    except (TraceError, WorkloadError, ValueError) as err:
        raise click.UsageError(str(err)) from None
    with result_folder(out_dir, force, resume, resumable=True) as folder:
        try:
            result = tune(
                source,
                rule,
                budgets,
                tpot_ms,
                ttft_ms,
                cost.model,
                load_scale,
                refine,
                SearchLattice(attainment, 8 if quick else 16, min_scale),
                max_chunk_tokens=max_chunk,
                options=engine_opts,
                runner=Runner(jobs or local_cores(), ray_address),
                progress=True,
                store=folder.store,
            )
        except (TraceError, WorkloadError, ValueError) as err:
            raise click.UsageError(str(err)) from None
        options = command_settings()
        notes = [] if cost.is_analytic else cost.summary_lines()
        payload = write_outputs(
            result, engine, folder.path, {"command": "tune", "options": options, "cost": cost.description}, notes
        )
    for line in notes:
        click.echo(line)
    click.echo(markdown_table(result))
    for line in payload["advice"]:
        click.echo(line)
    click.echo(f"wrote {out_dir}/tune.csv, tune.md, tune.json, tune.png ({result.simulations} simulations)", err=True)
    sys.stdout.flush()
