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
from sloweave.studies.pictures import pyplot

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
            f"| {100 * row['attainment']:.1f} % | {_fmt(row['p99_ttft_ms'])} | {_fmt(row['p99_tpot_ms'])} | {', '.join(notes)} |"
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
