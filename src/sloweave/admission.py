"""Admission control for the simulator: reject or defer requests that cannot be served well.

SLOWeave alone admits everything: under overload the FCFS queue grows until every request
misses its TTFT, and the decode batch grows until even a decode-only iteration misses the
TPOT target. Two checks, both O(1) or one policy decision per request:

- decode pressure: a new request will become a decode, so it is refused while
  T(n_committed + 1, 0) > ``decode_headroom`` x its TPOT target, where n_committed counts
  the running requests plus the prompts already queued (each becomes a decode);
- TTFT: its predicted TTFT, the queued prompt tokens ahead of it plus its own, processed
  at the policy's current per-iteration chunk, exceeds its TTFT target x ``ttft_slack``;
  a queued prompt whose wait alone already passed its TTFT target is hopeless too
  (checked at the queue head, so each request is looked at O(1) times).

``action="reject"`` drops such a request with the reason recorded; ``"defer"`` moves it
to a best-effort lane that is served only when the normal queue is empty and decodes have
room (it is still served, usually outside its SLO). Every request ends finished, rejected
(with a reason) or pending.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ADMISSION_ACTIONS = ("reject", "defer")

# Reasons recorded per request (SimResult.rejected_reason / deferred_reason).
DECODE_SATURATED = "decode_saturated"
TTFT_UNREACHABLE = "ttft_unreachable"
TTFT_EXPIRED = "ttft_expired"
EXCEEDS_KV_CAPACITY = "exceeds_kv_capacity"


@dataclass(frozen=True)
class AdmissionControl:
    action: str = "reject"
    # Refuse while decode-only iterations would take more than this share of the TPOT target.
    decode_headroom: float | None = 0.9
    # Refuse when the predicted TTFT exceeds the target times this factor (None: no TTFT check).
    ttft_slack: float | None = 1.0

    def __post_init__(self) -> None:
        if self.action not in ADMISSION_ACTIONS:
            raise ValueError(f"admission action must be one of {', '.join(ADMISSION_ACTIONS)}, got {self.action!r}")
        for name in ("decode_headroom", "ttft_slack"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0)):
                raise ValueError(f"admission {name} must be a finite number > 0 or None, got {value!r}")
        if self.decode_headroom is None and self.ttft_slack is None:
            raise ValueError("admission control needs at least one check (decode_headroom or ttft_slack)")

    def decode_room(self, decode_only_ms: float, tpot_ms: float) -> bool:
        """Whether a decode-only iteration of the committed batch plus this request fits."""
        return self.decode_headroom is None or decode_only_ms <= self.decode_headroom * tpot_ms

    def ttft_reachable(self, predicted_ttft_ms: float, ttft_ms: float) -> bool:
        return self.ttft_slack is None or predicted_ttft_ms <= self.ttft_slack * ttft_ms


def predicted_ttft_ms(waited_ms: float, tokens_ahead: int, chunk_per_iteration: int, iteration_ms: float) -> float:
    """Wait so far + the iterations needed to prefill ``tokens_ahead`` at a steady chunk."""
    if chunk_per_iteration <= 0:
        return math.inf
    return waited_ms + math.ceil(tokens_ahead / chunk_per_iteration) * iteration_ms
