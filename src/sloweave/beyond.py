"""Pieces of the options beyond the paper that are not the simulator loop itself.

- SLO tiers: requests carry their own TPOT and TTFT targets (e.g. a 10 ms interactive tier
  next to a 50 ms batch tier); ``assign_tiers`` labels a workload, ``tier_report`` judges
  every request against its own tier.
- ``ContextAnalyticCost``: the paper's analytic cost plus the KV context read by the decodes
  and by the prefix of a chunked prompt, through the ``set_context`` interface of
  ``sloweave.fit.ContextualCost`` (the simulator sets the context before each decision).
- ``evaluate_run``: the study's metrics plus what the options did, and the cumulative
  (QoServe) SLO judgement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from sloweave.cost import AnalyticCost
from sloweave.fit import ContextualCost
from sloweave.metrics import TIME_TOLERANCE_MS, RunMetrics, per_request_frame, run_duration_ms, slo_met, summarize
from sloweave.simulator import SimResult
from sloweave.workloads import Workload

# ----------------------------------------------------------------------------- tiers


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
        return Workload(wl.name, wl.arrival_s, wl.prompt_tokens, wl.output_tokens, params=dict(wl.params))


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
    labelled = Workload(
        workload.name, workload.arrival_s, workload.prompt_tokens, workload.output_tokens, tpot_ms=tpot, params=dict(workload.params)
    )
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


# ----------------------------------------------------------------------------- context-aware cost


@dataclass
class ContextAnalyticCost(ContextualCost):
    """T(n, c) of the analytic model plus what the KV context adds, in milliseconds:

    T = AnalyticCost(n, c) + kv_read * D / 1000 + 1[c>0] attention * c (P + (c + 1) / 2) / 1e6

    with D the KV tokens the decodes read and P the prefix already prefilled of the chunked
    prompt (its chunk attends to the prefix and, causally, to itself). The coefficients put
    an 8B Llama-shaped model (32 layers, width 4096, 8 KV heads of 128, bf16) on the
    analytic model's own scale, so nothing here is tuned to a result:
    - a KV token is 2 x 32 x 8 x 128 x 2 B = 131 kB against 16 GB of weights, 8.2e-6 of a
      weight read; the analytic model's fixed decode work (0.35 + 0.90 ms) stands for the
      weight read, so a KV token costs 1.25 ms x 8.2e-6 = 0.0103 ms per 1,000 tokens;
    - attention is 4 x 4096 x 32 = 0.52 MFLOP per (query, key) pair against 16 GFLOP per
      token of the linear layers, 3.3e-5 of the analytic 0.006 ms per prompt token:
      0.2 ms per million pairs.
    Monotone in c, so SLOWeave's binary search stays exact for a fixed context.
    """

    base: AnalyticCost = field(default_factory=AnalyticCost)
    kv_read_ms_per_1k_tokens: float = 0.0103
    attention_ms_per_m_pairs: float = 0.2
    decode_kv_tokens: int = 0
    prefill_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("kv_read_ms_per_1k_tokens", "attention_ms_per_m_pairs"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"ContextAnalyticCost.{name} must be a finite number >= 0, got {value!r}")

    def predict(self, n_decodes: int, chunk_tokens: int, decode_kv_tokens: int, prefill_prefix_tokens: int) -> float:
        t = self.base(n_decodes, chunk_tokens) + self.kv_read_ms_per_1k_tokens * decode_kv_tokens / 1e3
        if chunk_tokens > 0:
            t += self.attention_ms_per_m_pairs * chunk_tokens * (prefill_prefix_tokens + (chunk_tokens + 1) / 2) / 1e6
        return t


# ----------------------------------------------------------------------------- metrics


def cumulative_slo_met(result: SimResult, frame: pd.DataFrame, ttft_ms, tpot_ms: float) -> np.ndarray:
    """Per request: finished, TTFT within target and every token k out by t_first + k D.

    QoServe's SLO, the one cumulative deadlines are built for (the paper's judges the P99
    of per-token gaps instead). With a shared D, token k of request i comes out at the end
    of iteration j = first_i + k, so its lateness is h(j) - h(first_i) with
    h(j) = end_j - j D: a range maximum, answered for all requests at once with a sparse
    table (O(iterations log iterations)), not per token. Preempted requests are checked
    from their own token times.
    """
    finished = (frame["status"] == "finished").to_numpy()
    with np.errstate(invalid="ignore"):
        ok = finished & (frame["ttft_ms"].to_numpy() <= np.asarray(ttft_ms) + TIME_TOLERANCE_MS)
    n_iter = result.num_iterations
    if n_iter == 0:
        return ok
    h = result.iter_end_ms - np.arange(n_iter) * tpot_ms
    table = [h]
    while 2 ** len(table) <= n_iter:
        prev, half = table[-1], 2 ** (len(table) - 1)
        table.append(np.maximum(prev[:-half], prev[half:]))
    rows = np.flatnonzero(ok)
    first = result.first_token_iter[rows]
    last = first + result.workload.output_tokens[rows] - 1
    level = np.floor(np.log2(last - first + 1)).astype(int)
    worst = np.empty(rows.size)
    for k in np.unique(level):
        sel = level == k
        worst[sel] = np.maximum(table[k][first[sel]], table[k][last[sel] - 2**k + 1])
    late = worst - h[first] > TIME_TOLERANCE_MS
    ok[rows[late]] = False
    for request in result.token_segments:
        if ok[request]:
            times = result.token_times_ms(request)
            ok[request] = bool(np.all(times - times[0] - tpot_ms * np.arange(times.size) <= TIME_TOLERANCE_MS))
    return ok


def evaluate_run(result: SimResult, ttft_ms, tpot_ms=None) -> dict:
    """The study's metrics plus what the options did (rejections, exceptions, preemptions)."""
    if tpot_ms is None:
        tpot_ms = result.tpot_ms if result.workload.tpot_ms is None else result.workload.tpot_ms
    frame = per_request_frame(result)
    metrics: RunMetrics = summarize(frame, run_duration_ms(result), ttft_ms, tpot_ms)
    row = metrics.as_dict()
    row["num_deferred"] = 0 if result.deferred_reason is None else int((result.deferred_reason != "").sum())
    row["slo_exceptions"] = len(result.slo_exceptions)
    row["preemptions"] = result.preemptions
    row["recompute_tokens"] = result.recompute_tokens
    row["iterations"] = result.num_iterations
    if np.ndim(tpot_ms) == 0:
        met = cumulative_slo_met(result, frame, ttft_ms, float(tpot_ms))
        row["attainment_cumulative"] = float(met.mean())
        row["goodput_cumulative_rps"] = float(met.sum()) / metrics.duration_s
    return row
