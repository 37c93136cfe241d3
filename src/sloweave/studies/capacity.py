"""``sloweave capacity``: the highest load at which each policy keeps SLO attainment at or above a target.

The study comes in three parts:
- ``sloweave.studies.sources``: the load sources (a workload per seed and load scale);
- ``sloweave.studies.search``: the capacity search on the load lattice (``CapacityStudy``);
- this module: the report (tables, like-for-like ratios, load curves, CDFs, JSON); the
  ``capacity`` command is ``sloweave.cli.capacity``.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd

from sloweave.core.costs.resolve import ResolvedCost, describe_cost
from sloweave.studies.outputs import write_result_json
from sloweave.studies.pictures import pyplot
from sloweave.studies.replay import plot_cdfs, policy_style
from sloweave.sim.tiers import describe_tier_mix
from sloweave.studies.search import TUNING_GRID_TOKENS, Capacity, CapacityStudy, best_of_rule, budget_of
from sloweave.studies.search_records import tier_columns_of

# Fixed chunks from 256 to C_max = 4096 bracket the best static chunk on every target we
# measured (Fixed-64 is never close and is the slowest to simulate; pass --policy fixed-64 to add it).
DEFAULT_POLICIES = ("sloweave", "full", "fixed-256", "fixed-512", "fixed-1024", "fixed-2048", "fixed-4096")
DEFAULT_TPOT_TARGETS_MS = (10.0, 25.0, 50.0)
CAPACITY_COLUMNS = [
    "source",
    "policy",
    "tpot_ms",
    "ttft_ms",
    "attainment_target",
    "capacity_scale",
    "capacity_rps",
    "tuned_to",
]

# The comparisons made like for like: SLOWeave with one prompt per iteration against the
# fixed chunk (and the one-prompt token budget); with several prompts, against vLLM's rule.
PAIRS = (("sloweave", "fixed"), ("sloweave", "budget"), ("sloweave-multi", "sarathi"))


def capacity_frame(capacities: list[Capacity]) -> pd.DataFrame:
    return pd.DataFrame([c.row() for c in capacities])


def seeds_frame(capacities: list[Capacity]) -> pd.DataFrame:
    rows = []
    for c in capacities:
        for i, s in enumerate(c.seeds):
            tpot_ms = math.nan if c.tiers else c.tpot_ms
            rows.append({"source": c.source, "policy": c.policy, "tpot_ms": tpot_ms, **asdict(s), **c.tier_columns(i)})
    return pd.DataFrame(rows)


def pairwise_ratios(capacities: list[Capacity]) -> pd.DataFrame:
    """Each SLOWeave variant over the best of its like-for-like rule, per TPOT target (``PAIRS``).

    The best budget of a rule is chosen per target by mean capacity in req/s (what a user
    who tunes the budget offline would do; a ``<rule>-tuned`` row is that choice already);
    ``ratio`` is the ratio of the two means. Its spread uses the per-seed ratios (same seeds
    or windows, so paired), skipping seeds where the baseline's capacity is 0; a per-seed
    ratio is only known to about one lattice step (``step_pct``). A cell whose run was too
    short to build queues has no ratio (empty), and says so in ``note``. With SLO tiers the
    cell is the tier mix: SLOWeave serves each request to its own tier's target, a budget is
    one for the whole mix, and each row names the tier(s) binding either capacity.
    """
    rows = []
    for tpot in sorted({c.tpot_ms for c in capacities}):
        at = {c.policy: c for c in capacities if c.tpot_ms == tpot}
        for ours_name, rule in PAIRS:
            best = best_of_rule(list(at.values()), rule)
            if ours_name not in at or best is None:
                continue
            swept = sum(budget_of(name, rule) is not None for name in at)
            rows.append(_pair_row(at[ours_name], best, rule, swept))
    return pd.DataFrame(rows)


def _pair_row(ours: Capacity, best: Capacity, rule: str, swept: int) -> dict:
    measurable = ours.measurable and best.measurable
    paired = [a.scale / b.scale for a, b in zip(ours.seeds, best.seeds) if b.scale > 0] if measurable else []
    mine, theirs = ours.row(), best.row()
    return {
        "source": ours.source,
        "tpot_ms": mine["tpot_ms"],
        "ttft_ms": mine["ttft_ms"],
        "policy": ours.policy,
        "capacity_rps": ours.capacity_rps,
        "capacity_rps_std": mine["capacity_rps_std"],
        "baseline_rule": rule,
        "budgets_swept": swept,
        "best_baseline": best.policy,
        "best_baseline_capacity_rps": best.capacity_rps,
        "best_baseline_capacity_rps_std": theirs["capacity_rps_std"],
        "ratio": ours.capacity_rps / best.capacity_rps if measurable and best.capacity_rps > 0 else math.nan,
        "ratio_seed_mean": float(np.mean(paired)) if paired else math.nan,
        "ratio_seed_min": float(np.min(paired)) if paired else math.nan,
        "ratio_seed_max": float(np.max(paired)) if paired else math.nan,
        "step_pct": 100.0 * (ours.step_ratio - 1.0),
        # the best budget at the grid's end: the true best may lie beyond what was swept
        "edge_of_sweep": budget_of(best.policy, rule) in (min(TUNING_GRID_TOKENS), max(TUNING_GRID_TOKENS)),
        "note": "" if measurable else "run too short to build queues: no capacity (lengthen the run)",
        **_tier_pair_columns(mine, theirs),
    }


def _tier_pair_columns(mine: dict, theirs: dict) -> dict:
    """With SLO tiers: the mix, and the tier(s) binding SLOWeave's and the best budget's capacity."""
    if "tier_mix" not in mine:
        return {}
    return {
        "tier_mix": mine["tier_mix"],
        "binding_tier": mine["binding_tier"],
        "best_baseline_binding_tier": theirs["binding_tier"],
    }


# --------------------------------------------------------------------------- plots


def plot_curves(
    curves: pd.DataFrame,
    column: str,
    ylabel: str,
    path: Path,
    target: float | None = None,
    upper_bound: float | None = None,
    titles: dict[float, str] | None = None,
) -> None:
    plt = pyplot()
    targets = sorted(curves["tpot_ms"].unique())
    fig, axes = plt.subplots(1, len(targets), figsize=(4.6 * len(targets), 3.8), squeeze=False)
    for ax, tpot in zip(axes[0], targets):
        at = curves[curves["tpot_ms"] == tpot]
        for index, (policy, rows) in enumerate(at.groupby("policy", sort=False)):
            mean, std = rows[column].to_numpy(), rows[f"{column}_std"].to_numpy()
            # +-1 std over seeds, clipped to the range the quantity can take.
            upper = np.minimum(std, upper_bound - mean) if upper_bound is not None else std
            lower = np.minimum(std, mean)
            ax.errorbar(
                rows["rate_rps"],
                mean,
                yerr=[lower, upper],
                marker="o",
                markersize=3,
                capsize=2,
                label=policy,
                **policy_style(policy, index),
            )
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_title((titles or {}).get(tpot) or f"TPOT {tpot:g} ms, TTFT {at['ttft_ms'].iloc[0]:g} ms", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(str(curves["source"].iloc[0]), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- command


def run_capacity(
    study: CapacityStudy, out_dir: Path, meta: dict, cost: ResolvedCost | None = None, curves: bool = True
) -> dict:
    """Search (and, unless ``curves`` is off, load curves and CDFs); write every output file
    under ``out_dir``; return the JSON payload.

    ``cost`` is what ``study.cost`` was resolved from; its description is read after the
    simulations (a profile cost's out-of-range counts). None: the study's analytic model.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    capacities = study.capacities()
    table = capacity_frame(capacities)
    table[CAPACITY_COLUMNS + tier_columns_of(study.tiers)].to_csv(out_dir / "capacity.csv", index=False)
    table.to_csv(out_dir / "capacity_detail.csv", index=False)
    seeds_frame(capacities).to_csv(out_dir / "capacity_seeds.csv", index=False)
    relative = pairwise_ratios(capacities)
    relative.to_csv(out_dir / "relative.csv", index=False)
    cdf_loads = _write_curves(study, capacities, out_dir) if curves else {}
    payload = {
        **meta,
        "source": study.source.describe(),
        "engine_options": study.options.describe(),
        **_slo_settings(study),
        "attainment_target": study.attainment_target,
        "lattice": study.lattice.describe(),
        "simulations": study.simulations,
        "parallel": study.runner.describe(),
        "cost": cost.description if cost is not None else describe_cost(study.cost),
        "cdf_rate_scale": {_cell_tag(study, t).removeprefix("tpot"): s for t, s in cdf_loads.items()},
        "capacity": table.to_dict(orient="records"),
        "pairwise": relative.to_dict(orient="records"),
        "null_means": "a capacity or ratio the run was too short to measure (see 'censored' and 'note')",
    }
    write_result_json(out_dir / "capacity.json", payload)
    return payload


def _slo_settings(study: CapacityStudy) -> dict:
    """The SLO of the study as the JSON records it: the targets, or the tier mix."""
    if not study.tiers:
        return {"ttft_ms": study.ttft_ms, "tpot_targets_ms": list(study.tpot_targets_ms)}
    return {
        "ttft_ms": None,
        "tpot_targets_ms": [],
        "tier_mix": describe_tier_mix(study.tiers),
        "tiers": [asdict(t) for t in study.tiers],
        "tier_rule": "capacity: the highest load at which every tier keeps the attainment target, each request "
        "judged against its own tier's TPOT and TTFT",
    }


def _cell_tag(study: CapacityStudy, tpot_ms: float) -> str:
    """A search cell in file names: ``tpot<T>`` for a TPOT target, ``tiers`` for the tier mix."""
    return "tiers" if study.tiers else f"tpot{tpot_ms:g}"


def _write_curves(study: CapacityStudy, capacities: list[Capacity], out_dir: Path) -> dict[float, float]:
    """Load curves of the searched policies (a tuned rule's grid only at its best budgets),
    and CDFs at SLOWeave's capacity per target; return the CDFs' load per target."""
    shown = [p for p in study.policies if not any(budget_of(p, r) is not None for r in study.tuned_rules)]
    shown += list(dict.fromkeys(c.tuned_to for c in capacities if c.tuned_to))
    curves = study.curves(study.curve_lattice(capacities), shown)
    mix = describe_tier_mix(study.tiers)
    titles = {t: f"tiers {mix}" for t in study.tpot_targets_ms} if study.tiers else None
    # a tiered cell's single TPOT is only the search's key: the files show the mix instead
    written = curves.assign(tpot_ms=math.nan, ttft_ms=math.nan, tier_mix=mix) if study.tiers else curves
    written.to_csv(out_dir / "curves.csv", index=False)
    plot_curves(
        curves,
        "attainment",
        "SLO attainment",
        out_dir / "attainment_vs_load.png",
        study.attainment_target,
        upper_bound=1.0,
        titles=titles,
    )
    plot_curves(curves, "goodput_rps", "goodput (req/s)", out_dir / "goodput_vs_load.png", titles=titles)
    # CDFs at SLOWeave's capacity for each target (or the middle of the curve without it):
    # the load where the comparison matters. Requests of all seeds are pooled for the plot.
    cdf_frames, cdf_loads = [], {}
    for tpot in study.tpot_targets_ms:
        ours = [c for c in capacities if c.tpot_ms == tpot and c.policy.startswith("sloweave")]
        ks = [s.k for s in ours[0].seeds if s.k is not None] if ours else []
        k = int(np.median(ks)) if ks else int(np.median(study.curve_lattice(capacities)))
        cdf_loads[tpot] = study.scale(k)
        study.prefetch([(p, k, tpot) for p in shown])
        per_policy = {}
        for policy in shown:
            frame = study.requests_at(policy, k, tpot)
            frame.insert(0, "policy", policy)
            frame.insert(1, "tpot_ms", math.nan if study.tiers else tpot)
            frame.insert(2, "rate_scale", study.scale(k))
            cdf_frames.append(frame)
            per_policy[policy] = frame
        slo = f"tiers {describe_tier_mix(study.tiers)}" if study.tiers else f"TPOT {tpot:g} ms"
        title = f"{study.source.name}, load x{study.scale(k):.3g}, {slo}"
        tag = _cell_tag(study, tpot)
        plot_cdfs(
            {p: f["ttft_ms"].to_numpy() for p, f in per_policy.items()},
            out_dir / f"cdf_ttft_{tag}.png",
            "TTFT (ms)",
            title,
            None if study.tiers else study.ttft_ms,
            log_x=True,
        )
        plot_cdfs(
            {p: f["p99_tpot_ms"].to_numpy() for p, f in per_policy.items()},
            out_dir / f"cdf_p99_tpot_{tag}.png",
            "per-request P99 inter-token gap (ms)",
            title,
            None if study.tiers else tpot,
        )
    pd.concat(cdf_frames, ignore_index=True).to_csv(out_dir / "cdf_requests.csv", index=False)
    return cdf_loads
