"""SLO tiers: requests that carry their own TPOT and TTFT targets.

E.g. a 10 ms interactive tier next to a 50 ms batch tier; ``assign_tiers`` labels a
workload, ``tier_report`` judges every request against its own tier.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from sloweave.sim.metrics import per_request_frame, run_duration_ms, slo_met
from sloweave.sim.result import SimResult
from sloweave.sim.workloads import Workload


@dataclass(frozen=True)
class Tier:
    name: str
    tpot_ms: float
    ttft_ms: float
    share: float  # fraction of requests in this tier

    def __post_init__(self) -> None:
        for label in ("tpot_ms", "ttft_ms"):
            value = getattr(self, label)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                raise ValueError(f"tier {self.name!r}: {label} must be a finite number > 0, got {value!r}")
        if not (isinstance(self.share, (int, float)) and 0 < self.share <= 1):
            raise ValueError(f"tier {self.name!r}: share must be in (0, 1], got {self.share!r}")


def default_tiers(ttft_ms: float) -> tuple[Tier, Tier]:
    """Half interactive (10 ms TPOT, the workload's TTFT), half batch (50 ms, 4x the TTFT)."""
    return (Tier("interactive", 10.0, ttft_ms, 0.5), Tier("batch", 50.0, 4.0 * ttft_ms, 0.5))


@dataclass(frozen=True)
class TieredWorkload:
    workload: Workload  # with per-request tpot_ms set
    tiers: tuple[Tier, ...]
    tier_of: np.ndarray  # index into tiers, per request
    ttft_ms: np.ndarray  # per-request TTFT target

    def untiered(self) -> Workload:
        """The same requests without their own TPOT targets (for a single-target policy)."""
        wl = self.workload
        return replace(wl, tpot_ms=None, params=dict(wl.params))


def assign_tiers(workload: Workload, tiers: tuple[Tier, ...], seed: int) -> TieredWorkload:
    """Label each request with a tier drawn by ``share`` (seeded, independent of the lengths)."""
    if not tiers:
        raise ValueError("at least one tier is needed")
    shares = np.array([t.share for t in tiers], dtype=float)
    if abs(shares.sum() - 1.0) > 1e-9:
        raise ValueError(f"tier shares must add up to 1, got {shares.sum():g}")
    rng = np.random.default_rng([seed, 0x7133])
    tier_of = rng.choice(len(tiers), size=len(workload), p=shares)
    tpot = np.array([t.tpot_ms for t in tiers])[tier_of]
    ttft = np.array([t.ttft_ms for t in tiers])[tier_of]
    labelled = replace(workload, tpot_ms=tpot, params=dict(workload.params))
    return TieredWorkload(labelled, tuple(tiers), tier_of, ttft)


def tier_report(result: SimResult, tiered: TieredWorkload) -> pd.DataFrame:
    """Attainment and goodput per tier, every request judged against its own tier's targets."""
    frame = per_request_frame(result)
    duration_s = max(run_duration_ms(result), 1e-9) / 1000.0
    tpot = np.array([t.tpot_ms for t in tiered.tiers])[tiered.tier_of]
    met = slo_met(frame, tiered.ttft_ms, tpot)
    rows = []
    for index, tier in enumerate(tiered.tiers):
        mine = tiered.tier_of == index
        rows.append(
            {
                "tier": tier.name,
                "tier_tpot_ms": tier.tpot_ms,
                "tier_ttft_ms": tier.ttft_ms,
                "requests": int(mine.sum()),
                "attainment": float(met[mine].mean()) if mine.any() else float("nan"),
                "goodput_rps": float(met[mine].sum()) / duration_s,
            }
        )
    return pd.DataFrame(rows)
