"""Admission control: reject or defer requests that cannot be served well (no engine imports).

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

from sloweave.core.validate import positive_fraction

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
            if value is not None:
                positive_fraction(value, f"admission {name}")
        if self.decode_headroom is None and self.ttft_slack is None:
            raise ValueError("admission control needs at least one check (decode_headroom or ttft_slack)")

    def decode_room(self, decode_only_ms: float, tpot_ms: float) -> bool:
        """Whether a decode-only iteration of the committed batch plus this request fits."""
        return self.decode_headroom is None or decode_only_ms <= self.decode_headroom * tpot_ms

    def ttft_reachable(self, predicted_ttft_ms: float, ttft_ms: float) -> bool:
        return self.ttft_slack is None or predicted_ttft_ms <= self.ttft_slack * ttft_ms

    def refusal(
        self,
        policy,
        predicted_ms,
        n_committed: int,
        tokens_ahead: int,
        prompt_tokens: int,
        waited_ms: float,
        tpot_ms: float,
        ttft_ms: float | None,
    ) -> str:
        """'' to admit a request, else the reason it is refused.

        ``n_committed`` counts the running requests plus the prompts queued ahead (each
        becomes a decode), ``tokens_ahead`` the prompt tokens still to prefill before it;
        ``predicted_ms(n, c)`` is the policy's prediction (with its margin).
        """
        if not self.decode_room(predicted_ms(n_committed + 1, 0), tpot_ms):
            return DECODE_SATURATED
        if self.ttft_slack is not None:
            # The chunk the policy would take per iteration at this load, if the budget were
            # the request's own target: the queue ahead drains at that pace (FCFS).
            tokens = tokens_ahead + prompt_tokens
            chunk = policy.decide(n_committed, tokens, tpot_ms).chunk_tokens
            if not self.ttft_reachable(
                predicted_ttft_ms(waited_ms, tokens, chunk, predicted_ms(n_committed, chunk)), ttft_ms
            ):
                return TTFT_UNREACHABLE
        return ""

    def expired(self, waited_ms: float, ttft_ms: float) -> bool:
        """A queued prompt that has not started and already waited past its TTFT target."""
        return self.ttft_slack is not None and waited_ms > ttft_ms * self.ttft_slack


def predicted_ttft_ms(waited_ms: float, tokens_ahead: int, chunk_per_iteration: int, iteration_ms: float) -> float:
    """Wait so far + the iterations needed to prefill ``tokens_ahead`` at a steady chunk."""
    if chunk_per_iteration <= 0:
        return math.inf
    return waited_ms + math.ceil(tokens_ahead / chunk_per_iteration) * iteration_ms
