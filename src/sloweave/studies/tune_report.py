"""The report of ``sloweave tune``: the flag to set on each engine, the sweep's table, the
advice printed at the end, the figure and the result files (tune.csv, .md, .png, .json)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from sloweave.studies.markdown import significant
from sloweave.studies.outputs import write_result_json
from sloweave.sim.tiers import describe_tier_mix
from sloweave.studies.pictures import pyplot
from sloweave.studies.tune_tiers import at_capacity, mix_targets, sloweave_line, tier_cells, tier_headers, tier_settings

if TYPE_CHECKING:
    from sloweave.studies.tune import TuneResult

ENGINES = {
    # engine: (how the value is set, the rule that matches the engine's semantics)
    "vllm": ("--max-num-batched-tokens {n}", "sarathi"),
    "sglang": ("--chunked-prefill-size {n}", "fixed"),
    "trtllm": (
        "max_num_tokens: {n}  (LLM API / trtllm-serve config; --max_num_tokens {n} for trtllm-build)",
        "sarathi",
    ),
}


def flag_for(engine: str, budget_tokens: int) -> str:
    return ENGINES[engine][0].format(n=int(budget_tokens))


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else ""
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    if isinstance(value, float):
        return significant(value, digits)
    return str(value)


def tune_table(result: TuneResult) -> str:
    """The sweep as a markdown table; with SLO tiers, each tier's attainment at the capacity and the binding tier."""
    tiers = result.tiers
    columns = ["budget (tokens)", "capacity req/s", *tier_headers(tiers)]
    columns += ["goodput req/s", "attainment", "P99 TTFT ms", "P99 TPOT ms", "note"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    plan = result.sweep_plan
    added = {
        "extension": {b for ext in plan.get("extensions", ()) for b in ext["added_tokens"]},
        "refinement": set(plan.get("refinement_tokens", ())),
    }
    # with no budget meeting the targets there is no best to mark: every capacity is zero
    marks = {} if result.no_budget_meets_targets else {"best capacity": {result.best_capacity_tokens}}
    marks |= {} if result.no_budget_meets_targets else {"best goodput at load": {result.best_goodput_tokens}}
    marks |= {"edge extension": added["extension"], "refinement": added["refinement"]}
    for row in [*result.table.to_dict(orient="records"), result.sloweave]:
        notes = [note for note, budgets in marks.items() if row["budget_tokens"] in budgets]
        if row.get("rule_of_thumb"):
            notes.append("rule of thumb")
        if row["censored"]:
            notes.append(row["censored"])
        label = row["policy"] if row["budget_tokens"] is None else _fmt(row["budget_tokens"])
        per_tier = "".join(f" {cell} |" for cell in tier_cells(row, tiers))
        lines.append(
            f"| {label} | {_fmt(row['capacity_rps'])} ± {_fmt(row['capacity_rps_std'])} |{per_tier} {_fmt(row['goodput_rps'])} "
            f"| {100 * row['attainment']:.1f} % | {_fmt(row['p99_ttft_ms'])} | {_fmt(row['p99_tpot_ms'])} | {', '.join(notes)} |"
        )
    return "\n".join(lines) + "\n"


def comparisons(result: TuneResult) -> dict:
    """Best fixed budget against SLOWeave, and the rule of thumb against the best."""
    best = result.row(result.best_capacity_tokens)
    best_goodput = result.row(result.best_goodput_tokens)
    ours = result.sloweave

    def ratio(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    thumb = []
    for tokens in result.rule_of_thumb.budgets_tokens:
        row = result.row(tokens)
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
        "best_capacity": {"budget_tokens": result.best_capacity_tokens, "capacity_rps": best["capacity_rps"]},
        "best_goodput_at_load": {
            "budget_tokens": result.best_goodput_tokens,
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
            "mean_prompt_tokens": result.rule_of_thumb.mean_prompt_tokens,
            "rounding": "nearest power of two (log scale), at least 64",
            "budgets": thumb,
        },
    }


def _targets(result: TuneResult) -> str:
    if result.tiers:
        return mix_targets(result)
    return f"TPOT {result.tpot_ms:g} ms, TTFT {result.ttft_ms:g} ms, attainment >= {result.attainment_target:.0%}"


def sweep_lines(result: TuneResult) -> list[str]:
    """Where the budgets came from: the grid's ends and why, each extension, and an edge the best still sits on."""
    plan, swept = result.sweep_plan, result.table["budget_tokens"]
    grid = plan.get("grid")
    if grid is None:
        lines = [f"sweep: {len(swept)} budgets, {swept.min():,}-{swept.max():,} tokens, given (--budget)"]
    else:
        lines = [
            f"sweep: {grid['low_tokens']:,}-{grid['high_tokens']:,} tokens ({grid['ladder']}), from the cost model: "
            f"low end {grid['low_tokens']:,} ({grid['low_reason']}); high end {grid['high_tokens']:,} ({grid['high_reason']})"
        ]
        if "grid_targets" in plan:
            lines[0] += f"; {plan['grid_targets']}"
    for ext in plan.get("extensions", ()):
        lines.append(
            f"edge extension: the best budget ({ext['best_before_tokens']:,} tokens) was the {ext['side']} edge; "
            f"swept {', '.join(f'{b:,}' for b in ext['added_tokens'])}: best now {ext['best_after_tokens']:,}"
        )
    best = result.best_capacity_tokens
    if result.no_budget_meets_targets or best not in (swept.min(), swept.max()):
        return lines
    if grid is None:
        lines.append(
            f"NOTE: the best budget is at the edge of the sweep ({swept.min()}-{swept.max()}); extend it with --budget"
        )
    else:
        lines.append(f"NOTE: {plan['extension_stop']}")
    return lines


def no_budget_lines(result: TuneResult, engine: str) -> list[str]:
    """What is printed instead of a budget to set when no budget meets the targets at any load searched."""
    loads, swept, ours = result.loads_searched, result.table["budget_tokens"], result.sloweave
    lines = [
        f"NO BUDGET MEETS THE TARGETS: none of the {len(swept)} budgets swept ({swept.min():,}-{swept.max():,} tokens, "
        f"{result.rule} rule) reaches {_targets(result)} at any load searched (x{loads['min_scale']:.3g}-"
        f"x{loads['max_scale']:.3g} of the input's rate, {_fmt(loads['min_rps'])}-{_fmt(loads['max_rps'])} req/s): "
        f"no fixed budget to set on {engine}",
    ]
    if ours["capacity_rps"] > 0:
        lines.append(
            f"SLOWeave ({ours['policy']}) does, on the same input: capacity {_fmt(ours['capacity_rps'])} req/s"
        )
    else:
        lines.append(
            f"SLOWeave ({ours['policy']}) does not either (capacity 0 at every load searched): relax the targets, "
            "check them against the cost model, or lower --min-scale"
        )
    return lines


def recommendation(result: TuneResult, engine: str) -> list[str]:
    """The lines printed at the end: the sweep, the flag, the gap to SLOWeave, the rule of thumb."""
    lines = sweep_lines(result)
    if result.no_budget_meets_targets:
        return lines + no_budget_lines(result, engine)
    cmp = comparisons(result)
    best = cmp["best_capacity"]
    kind = "single budget for the tier mix" if result.tiers else "fixed budget"
    lines.append(
        f"best {kind}: {best['budget_tokens']} tokens ({result.rule} rule), capacity {_fmt(best['capacity_rps'])} "
        f"req/s at {_targets(result)}"
    )
    if result.tiers:
        lines.append(f"at that capacity: {at_capacity(result.row(best['budget_tokens']), result.tiers)}")
    lines.append(f"set: {flag_for(engine, best['budget_tokens'])}")
    if ENGINES[engine][1] != result.rule:
        lines.append(
            f"note: {engine}'s setting matches the {ENGINES[engine][1]!r} rule; this sweep used {result.rule!r} "
            f"(run with --rule {ENGINES[engine][1]} for the engine's own semantics)"
        )
    good = cmp["best_goodput_at_load"]
    lines.append(
        f"at load {_fmt(result.table['load_rps'].iloc[0])} req/s (x{result.load_scale:.3g}; {result.load_source}): "
        f"best goodput {_fmt(good['goodput_rps'])} req/s with {good['budget_tokens']} tokens"
    )
    ours = cmp["sloweave"]
    over_cap, over_good = cmp["sloweave_capacity_over_best"], cmp["sloweave_goodput_over_best"]
    if result.tiers:
        lines.append(sloweave_line(result, _ratio(over_cap), _ratio(over_good)))
    else:
        lines.append(
            f"SLOWeave ({ours['policy']}) on the same input: capacity {_fmt(ours['capacity_rps'])} req/s "
            f"({_ratio(over_cap)} the best fixed budget), goodput at load {_fmt(ours['goodput_rps'])} req/s ({_ratio(over_good)})"
        )
    thumb = cmp["rule_of_thumb"]
    parts = [
        f"{b['budget_tokens']} tokens: capacity {_fmt(b['capacity_rps'])} req/s ({_ratio(b['capacity_vs_best'])} the best)"
        for b in thumb["budgets"]
    ]
    lines.append(
        f"rule of thumb (1/4 to 1/2 of the mean prompt, {thumb['mean_prompt_tokens']:.0f} tokens, rounded to the nearest "
        f"power of two): " + "; ".join(parts)
    )
    lines.append(f"(capacities are exact to one lattice step, {result.step_pct:.1f} %; ± is the std over seeds)")
    return lines


def _ratio(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}x"


def plot(result: TuneResult, path: Path) -> None:
    """P99 TTFT, P99 TPOT (at the load) and capacity against the budget, SLOWeave as a line."""
    plt = pyplot()
    t = result.table
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.9))
    panels = [
        ("p99_ttft_ms", "P99 TTFT (ms)", _target_lines(result, "ttft_ms"), True),
        ("p99_tpot_ms", "P99 TPOT (ms)", _target_lines(result, "tpot_ms"), False),
        ("capacity_rps", "capacity (req/s)", {}, False),
    ]
    for ax, (column, label, targets, log_y) in zip(axes, panels):
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
        for target, name in targets.items():
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=name)
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
    slo = (
        f"tiers {describe_tier_mix(result.tiers)}"
        if result.tiers
        else f"TPOT {result.tpot_ms:g} ms, TTFT {result.ttft_ms:g} ms"
    )
    fig.suptitle(f"{result.source.get('name')}: {result.rule} rule, {slo}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _target_lines(result: TuneResult, target: str) -> dict[float, str]:
    """The target lines of a panel: the single target, or each tier's (tiers with one value share a line)."""
    if not result.tiers:
        return {getattr(result, target): "target"}
    lines: dict[float, str] = {}
    for tier in result.tiers:
        value = getattr(tier, target)
        lines[value] = f"{lines[value]}, {tier.name}" if value in lines else f"target: {tier.name}"
    return lines


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
        + tune_table(result)
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
        "flag": None if result.no_budget_meets_targets else flag_for(engine, result.best_capacity_tokens),
        "no_budget_meets_targets": result.no_budget_meets_targets,
        "loads_searched": result.loads_searched,
        "sloweave_capacity_rps": result.sloweave["capacity_rps"],
        "sweep_plan": result.sweep_plan,
        **tier_settings(result, None if result.no_budget_meets_targets else result.best_capacity_tokens),
        "tpot_ms": result.tpot_ms,
        "ttft_ms": result.ttft_ms,
        "attainment_target": result.attainment_target,
        "load_scale": result.load_scale,
        "load_source": result.load_source,
        "lattice_step_pct": result.step_pct,
        "simulations": result.simulations,
        "comparisons": comparisons(result),
        "sweep": result.table.to_dict(orient="records"),
        "sloweave_row": result.sloweave,
        "advice": advice,
    }
    write_result_json(out_dir / "tune.json", payload)
    return payload
