"""SLO tiers in ``sloweave tune``: one fixed budget for a mix of requests with their own targets.

With a tier mix (``sloweave.sim.tiers``, e.g. 30 % of requests at 10 ms TPOT and 70 % at 50 ms)
every budget's capacity is the highest load at which *every* tier keeps the attainment target,
each request judged against its own tier's TPOT and TTFT (``CapacityStudy(tiers=...)``). A fixed
budget is one setting for the whole mix; SLOWeave serves each request to its own tier's TPOT.
The advice is the budget with the highest capacity for the mix. The default grid's low end is
priced at the tightest tier's TPOT and its high end at the loosest tier's TTFT
(``sloweave.studies.tune_grid.model_grid``), the widest range any tier calls for.

This module holds what tune does differently with a mix: the targets the sweep is priced at and
keyed by, the plan's note, and the report's columns, lines and settings
(``sloweave.studies.tune_report`` calls them; without tiers each adds nothing).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING

from sloweave.sim.tiers import Tier, check_tier_mix, describe_tier_mix
from sloweave.studies.markdown import significant
from sloweave.studies.search import CapacityStudy
from sloweave.studies.sources import LoadSource

if TYPE_CHECKING:
    from sloweave.studies.tune import TuneResult

# the single targets of a sweep without tiers, unless given
TUNE_DEFAULT_TPOT_MS = 25.0
TUNE_DEFAULT_TTFT_MS = 2000.0
TIER_RULE = (
    "a budget's capacity: the highest load at which every tier keeps the attainment target, each request "
    "judged against its own tier's TPOT and TTFT; the advice: the budget with the highest capacity for the mix"
)


def sweep_targets(tiers: tuple[Tier, ...], tpot_ms: float | None, ttft_ms: float | None) -> tuple[float, float]:
    """The TPOT and TTFT targets a sweep prices its default grid at and keys its searches by.

    Without tiers: the given targets (25 ms and 2000 ms where not given). With tiers: the tightest
    tier's TPOT and the loosest tier's TTFT (the search's single targets, ``CapacityStudy``); a
    target given beside a mix is refused, since each tier names its own."""
    if not tiers:
        tpot_ms = TUNE_DEFAULT_TPOT_MS if tpot_ms is None else tpot_ms
        return float(tpot_ms), float(TUNE_DEFAULT_TTFT_MS if ttft_ms is None else ttft_ms)
    given = [name for name, value in (("tpot_ms", tpot_ms), ("ttft_ms", ttft_ms)) if value is not None]
    if given:
        raise ValueError(f"{' and '.join(given)} cannot go with SLO tiers: each tier names its own targets")
    tiers = check_tier_mix(tiers)
    return min(t.tpot_ms for t in tiers), max(t.ttft_ms for t in tiers)


def check_every_tier_draws(source: LoadSource, tiers: tuple[Tier, ...]) -> None:
    """ValueError naming a tier that draws none of a seed's requests (before any simulation): the
    capacity study's own check, run by building one."""
    if tiers:
        CapacityStudy(source, ["full"], tiers=tiers)


def grid_ends_plan(tiers: tuple[Tier, ...]) -> dict:
    """The sweep plan's note of which tiers priced the default grid's ends (nothing without tiers)."""
    if not tiers:
        return {}
    tightest_tpot_ms = min(t.tpot_ms for t in tiers)
    loosest_ttft_ms = max(t.ttft_ms for t in tiers)
    tight = " and ".join(t.name for t in tiers if t.tpot_ms == tightest_tpot_ms)
    loose = " and ".join(t.name for t in tiers if t.ttft_ms == loosest_ttft_ms)
    return {
        "grid_targets": f"tier mix: low end at the tightest tier's TPOT ({tight}, {tightest_tpot_ms:g} ms), "
        f"high end at the loosest tier's TTFT ({loose}, {loosest_ttft_ms:g} ms)"
    }


def mix_targets(result: TuneResult) -> str:
    """The SLO of a tiered sweep in words (``tune_report`` prints the single targets otherwise)."""
    return (
        f"attainment >= {result.attainment_target:.0%} in every tier of {describe_tier_mix(result.tiers)} "
        "(each request against its own tier's TPOT and TTFT)"
    )


def mix_note(tiers: tuple[Tier, ...], attainment_target: float) -> list[str]:
    """The lines that head a tiered report: what capacity means for the mix."""
    if not tiers:
        return []
    return [
        f"tier mix {describe_tier_mix(tiers)}: a budget's capacity = the highest load at which every tier keeps "
        f"attainment >= {attainment_target:g}, each request judged against its own tier's TPOT and TTFT; "
        "SLOWeave serves each request to its own tier's TPOT"
    ]


def tier_headers(tiers: tuple[Tier, ...]) -> list[str]:
    """The table's extra columns with tiers: each tier's attainment at the capacity, the binding tier."""
    return [*(f"{t.name} at capacity" for t in tiers), "binding tier"] if tiers else []


def tier_cells(row: dict, tiers: tuple[Tier, ...]) -> list[str]:
    """One table row's cells under ``tier_headers``."""
    if not tiers:
        return []
    return [*(_percent(row[f"attainment_{t.name}"]) for t in tiers), row["binding_tier"] or "-"]


def _number(value: float) -> str:
    return "-" if value is None or not math.isfinite(value) else significant(value, 3)


def _percent(value: float) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{100 * value:.1f} %"


def at_capacity(row: dict, tiers: tuple[Tier, ...]) -> str:
    """Each tier's attainment at a row's capacity and the tier(s) that bind, in words."""
    each = ", ".join(f"{t.name} {_percent(row[f'attainment_{t.name}'])}" for t in tiers)
    return f"{each}; binding tier: {row['binding_tier'] or 'none (the lattice end)'}"


def sloweave_line(result: TuneResult, over_capacity: str, over_goodput: str) -> str:
    """The advice's line on SLOWeave with per-request targets against the best single budget for
    the mix (``over_capacity``, ``over_goodput``: the ratios, as printed)."""
    ours = result.sloweave
    return (
        f"SLOWeave ({ours['policy']}) with per-request targets (each request served to its own tier's TPOT) on the "
        f"same input: capacity {_number(ours['capacity_rps'])} req/s ({over_capacity} the best single budget for the mix; "
        f"{at_capacity(ours, result.tiers)}), goodput at load {_number(ours['goodput_rps'])} req/s ({over_goodput})"
    )


def tier_settings(result: TuneResult, best_tokens: int | None) -> dict:
    """What tune.json records about the mix: the mix, its rule, the best budget for it (None:
    no budget meets the targets) and SLOWeave with per-request targets; nothing without tiers."""
    if not result.tiers:
        return {}
    columns = ["capacity_rps", "capacity_rps_std", *(f"attainment_{t.name}" for t in result.tiers), "binding_tier"]
    ours = {"policy": result.sloweave["policy"], **{c: result.sloweave[c] for c in columns}}
    best = (
        None
        if best_tokens is None
        else {"budget_tokens": best_tokens, **{c: result.row(best_tokens)[c] for c in columns}}
    )
    ratio = None if best is None or not best["capacity_rps"] > 0 else ours["capacity_rps"] / best["capacity_rps"]
    return {
        "tier_mix": describe_tier_mix(result.tiers),
        "tiers": [asdict(t) for t in result.tiers],
        "tier_rule": TIER_RULE,
        "best_budget_for_mix": best,
        "sloweave_per_request_targets": {**ours, "capacity_over_best_budget": ratio},
    }
