"""SLO tiers: requests that carry their own TPOT and TTFT targets.

E.g. a 10 ms interactive tier next to a 50 ms batch tier; ``parse_tier`` reads one from
``NAME:TPOT_MS:TTFT_MS:SHARE`` and ``check_tier_mix`` a whole mix, ``assign_tiers`` labels a
workload, ``tier_report`` (a run) and ``tier_attainment`` (any judged requests) judge every
request against its own tier.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from sloweave.core.validate import MAX_MS
from sloweave.sim.metrics import per_request_frame, run_duration_ms, slo_met
from sloweave.sim.result import SimResult
from sloweave.sim.workloads import Workload


# numpy's draw by share needs the shares to add up to 1 within about 1e-8
SHARE_TOLERANCE = 1e-9
TIER_SPEC = "NAME:TPOT_MS:TTFT_MS:SHARE"
# a tier's name heads result columns (attainment_<name>), so it is kept to plain characters
_TIER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class Tier:
    name: str
    tpot_ms: float
    ttft_ms: float
    share: float  # fraction of requests in this tier

    def __post_init__(self) -> None:
        for label in ("tpot_ms", "ttft_ms"):
            value = getattr(self, label)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and 0 < value <= MAX_MS):
                raise ValueError(f"tier {self.name!r}: {label} must be a number > 0 and <= {MAX_MS:g}, got {value!r}")
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


def tier_labels(num_requests: int, tiers: tuple[Tier, ...], seed: int) -> np.ndarray:
    """Each request's tier (an index into ``tiers``), drawn by share from ``seed`` alone: the
    same labels for every policy and load of a seed with that many requests."""
    if not tiers:
        raise ValueError("at least one tier is needed")
    shares = np.array([t.share for t in tiers], dtype=float)
    if abs(shares.sum() - 1.0) > SHARE_TOLERANCE:
        raise ValueError(f"tier shares must add up to 1, got {shares.sum():g}")
    rng = np.random.default_rng([seed, 0x7133])
    return rng.choice(len(tiers), size=num_requests, p=shares)


def assign_tiers(workload: Workload, tiers: tuple[Tier, ...], seed: int) -> TieredWorkload:
    """Label each request with a tier drawn by ``share`` (seeded, independent of the lengths)."""
    tier_of = tier_labels(len(workload), tiers, seed)
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


def parse_tier(spec: str) -> Tier:
    """One tier from ``NAME:TPOT_MS:TTFT_MS:SHARE``, e.g. ``interactive:10:2000:0.3`` (SHARE: the
    fraction of requests, in (0, 1]); ValueError naming the problem otherwise."""
    fields = str(spec).split(":")
    if len(fields) != 4:
        raise ValueError(f"tier {spec!r}: expected {TIER_SPEC} (4 fields separated by ':'), got {len(fields)} field(s)")
    name, *numbers = (f.strip() for f in fields)
    if not _TIER_NAME.fullmatch(name):
        raise ValueError(f"tier {spec!r}: NAME must start with a letter and hold only letters, digits, '_' or '-'")
    values = []
    for label, text in zip(("TPOT_MS", "TTFT_MS", "SHARE"), numbers):
        try:
            values.append(float(text))
        except ValueError:
            raise ValueError(f"tier {spec!r}: {label} must be a number, got {text!r}") from None
    return Tier(name, *values)


def check_tier_mix(tiers) -> tuple[Tier, ...]:
    """A whole mix: at least one tier, each name once, shares adding up to 1."""
    tiers = tuple(tiers)
    if not tiers:
        raise ValueError("a tier mix needs at least one tier")
    names = [t.name for t in tiers]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tier name(s) given twice: {', '.join(twice)} (each tier needs its own name)")
    total = sum(t.share for t in tiers)
    if abs(total - 1.0) > SHARE_TOLERANCE:
        raise ValueError(f"tier shares must add up to 1, got {total:g} ({' + '.join(f'{t.share:g}' for t in tiers)})")
    return tiers


def describe_tier_mix(tiers: tuple[Tier, ...]) -> str:
    """The mix in the form ``--tier`` takes, tiers separated by ``,``."""
    return ",".join(f"{t.name}:{t.tpot_ms:g}:{t.ttft_ms:g}:{t.share:g}" for t in tiers)


def tier_attainment(met: np.ndarray, tier_of: np.ndarray, num_tiers: int) -> np.ndarray:
    """Per tier, the share of its requests that met their own targets (``met``: one bool per
    request, judged against its tier's targets). A tier with no request is an error: its
    attainment would be undefined and a mix that cannot draw it is mislabelled."""
    counts = np.bincount(tier_of, minlength=num_tiers)
    if np.any(counts == 0):
        raise ValueError(
            f"tier(s) {np.flatnonzero(counts == 0).tolist()} drew no request: raise the share or the requests"
        )
    return np.bincount(tier_of, weights=np.asarray(met, dtype=float), minlength=num_tiers) / counts
