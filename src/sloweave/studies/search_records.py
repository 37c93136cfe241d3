"""What a capacity search looks at and finds: the load lattice (``SearchLattice``), one seed's
capacity (``SeedCapacity``) and a policy's at one SLO, mean and spread over seeds (``Capacity``),
with, when requests carry SLO tiers (``sloweave.sim.tiers``), each tier's attainment at that
capacity and the tier that binds. ``sloweave.studies.search`` runs the search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sloweave.sim.tiers import Tier, describe_tier_mix

DEFAULT_ATTAINMENT = 0.90
# Attainment is a fraction of whole requests (e.g. 9/10); compare with a hair of slack so
# that exactly meeting the target is never lost to float rounding.
ATTAINMENT_TOLERANCE = 1e-12


@dataclass(frozen=True)
class SearchLattice:
    """Where a capacity search looks and what it asks: the attainment to keep, and the load
    lattice s_k = 2 ** (k / steps_per_doubling) from ``min_scale`` to ``max_scale`` (rounded
    outwards to whole steps), with ``curve_points_per_doubling`` points per doubling on the
    load curves. One value travels through ``CapacityStudy``, ``tune`` and the commands."""

    attainment_target: float = DEFAULT_ATTAINMENT
    steps_per_doubling: int = 16
    min_scale: float = 1.0 / 16.0
    max_scale: float = 256.0
    curve_points_per_doubling: int = 4

    def __post_init__(self) -> None:
        if not 0.0 < self.attainment_target <= 1.0:
            raise ValueError(f"attainment target must be in (0, 1], got {self.attainment_target!r}")
        if self.steps_per_doubling < 1:
            raise ValueError(f"steps_per_doubling must be >= 1, got {self.steps_per_doubling!r}")
        if not (0 < self.min_scale <= 1.0 <= self.max_scale and math.isfinite(self.max_scale)):
            raise ValueError(f"need 0 < min_scale <= 1 <= max_scale (got {self.min_scale!r}, {self.max_scale!r})")
        object.__setattr__(self, "attainment_target", float(self.attainment_target))
        object.__setattr__(self, "steps_per_doubling", int(self.steps_per_doubling))

    @property
    def min_k(self) -> int:
        return math.floor(math.log2(self.min_scale) * self.steps_per_doubling + 1e-9)

    @property
    def max_k(self) -> int:
        return math.ceil(math.log2(self.max_scale) * self.steps_per_doubling - 1e-9)

    def scale(self, k: int) -> float:
        return 2.0 ** (k / self.steps_per_doubling)

    def describe(self) -> dict:
        return {
            "steps_per_doubling": self.steps_per_doubling,
            "min_scale": self.scale(self.min_k),
            "max_scale": self.scale(self.max_k),
        }


DEFAULT_LATTICE = SearchLattice()


@dataclass(frozen=True)
class SeedCapacity:
    seed: int
    k: int | None  # highest passing lattice index (None: fails even at the lowest scale)
    scale: float  # capacity scale (0 when below the lowest scale searched)
    rps: float
    censored: str  # "", "below-min", "above-max", "too-short" (";"-joined where several hold)


# A run whose arrivals all fall inside one TTFT target does not build a queue: at that load
# the capacity measures the run's length, not the server (the search would report any rate).
TOO_SHORT = "too-short"


@dataclass(frozen=True)
class TierOutcome:
    """One seed's SLO tiers at its capacity: each tier's attainment there (nan where the seed
    fails even at the lowest load), and the tiers under the attainment target at the next
    load searched, in the mix's order, "+"-joined: the tier(s) that bind ("" where the capacity
    is the lattice's end, ``above-max``)."""

    attainment: tuple[float, ...]
    binding: str


@dataclass(frozen=True)
class Capacity:
    source: str
    policy: str
    tpot_ms: float
    ttft_ms: float
    attainment_target: float
    seeds: tuple[SeedCapacity, ...]
    step_ratio: float  # s_(k+1) / s_k: each per-seed capacity is exact to this factor
    tuned_to: str = ""  # a ``<rule>-tuned`` row: the budget the sweep chose for this cell
    # SLO tiers: every request judged against its own tier, capacity the highest load at which
    # every tier keeps the attainment target (then tpot_ms / ttft_ms mean nothing and show empty)
    tiers: tuple[Tier, ...] = ()
    tier_outcomes: tuple[TierOutcome, ...] = ()  # one per seed, in the order of ``seeds``

    @property
    def measurable(self) -> bool:
        return not any(TOO_SHORT in s.censored for s in self.seeds)

    @property
    def capacity_scale(self) -> float:
        return float(np.mean([s.scale for s in self.seeds])) if self.measurable else math.nan

    @property
    def capacity_rps(self) -> float:
        return float(np.mean([s.rps for s in self.seeds])) if self.measurable else math.nan

    def _spread(self, values: list[float]) -> float:
        return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0

    def row(self) -> dict:
        scales = [s.scale if self.measurable else math.nan for s in self.seeds]
        rps = [s.rps if self.measurable else math.nan for s in self.seeds]
        censored = sorted({flag for s in self.seeds for flag in s.censored.split(";") if flag})
        return {
            "source": self.source,
            "policy": self.policy,
            "tpot_ms": math.nan if self.tiers else self.tpot_ms,
            "ttft_ms": math.nan if self.tiers else self.ttft_ms,
            "attainment_target": self.attainment_target,
            "capacity_scale": self.capacity_scale,
            "capacity_rps": self.capacity_rps,
            "tuned_to": self.tuned_to,
            "capacity_scale_std": self._spread(scales),
            "capacity_scale_min": float(np.min(scales)),
            "capacity_scale_max": float(np.max(scales)),
            "capacity_rps_std": self._spread(rps),
            "capacity_rps_min": float(np.min(rps)),
            "capacity_rps_max": float(np.max(rps)),
            "seeds": len(self.seeds),
            "step_pct": 100.0 * (self.step_ratio - 1.0),
            "censored": ";".join(censored),
            **self.tier_columns(),
        }

    def tier_columns(self, seed_index: int | None = None) -> dict:
        """The tier mix, each tier's attainment at the capacity (``attainment_<tier>``: the mean
        over seeds, or one seed's) and the tier(s) that bind; nothing without tiers."""
        if not self.tiers:
            return {}
        outcomes = self.tier_outcomes if seed_index is None else self.tier_outcomes[seed_index : seed_index + 1]
        columns: dict = {"tier_mix": describe_tier_mix(self.tiers)}
        for index, tier in enumerate(self.tiers):
            known = [o.attainment[index] for o in outcomes if not math.isnan(o.attainment[index])]
            columns[f"attainment_{tier.name}"] = float(np.mean(known)) if known else math.nan
        columns["binding_tier"] = binding_summary([o.binding for o in outcomes])
        return columns


def tier_columns_of(tiers: tuple[Tier, ...]) -> list[str]:
    """The columns ``Capacity.tier_columns`` adds for this mix, in order."""
    return ["tier_mix", *(f"attainment_{t.name}" for t in tiers), "binding_tier"] if tiers else []


def binding_summary(bindings: list[str]) -> str:
    """The binding tier(s) over seeds: one name where every seed agrees, else each with its count
    (``interactive 2/3; batch 1/3``); a seed with none (``above-max``) counts as ``none``."""
    named = [b or "none" for b in bindings]
    if len(set(named)) == 1:
        return named[0] if named else ""
    counts = sorted({b: named.count(b) for b in named}.items(), key=lambda item: -item[1])
    return "; ".join(f"{b} {n}/{len(named)}" for b, n in counts)
