"""The paper's analytic iteration cost T(n, c) (the simulator's default)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sloweave.core.costs.protocols import CostModelError
from sloweave.core.validate import non_negative_number


@dataclass(frozen=True)
class AnalyticCost:
    """The paper's simulator default, in milliseconds:

    T(n, c) = base + 1[n>0] (decode_base + decode_per_req * n) + 1[c>0] (prefill_base + prefill_per_token * c)

    The indicator terms model kernels that are launched only when there is decode (or
    prefill) work in the iteration; the per-token terms are the memory- and compute-bound
    work that grows with the batch.
    """

    base_ms: float = 0.35
    decode_base_ms: float = 0.90
    decode_per_req_ms: float = 0.055
    prefill_base_ms: float = 0.40
    prefill_per_token_ms: float = 0.006

    def __post_init__(self) -> None:
        for name in ("base_ms", "decode_base_ms", "decode_per_req_ms", "prefill_base_ms", "prefill_per_token_ms"):
            try:  # the shared rule: a boolean is no number of ms (True read as 1 ms), nor a string
                non_negative_number(getattr(self, name), f"AnalyticCost.{name}")
            except ValueError as err:
                raise CostModelError(str(err)) from None

    def __call__(self, n_decodes: int, chunk_tokens: int) -> float:
        t = self.base_ms
        if n_decodes > 0:
            t += self.decode_base_ms + self.decode_per_req_ms * n_decodes
        if chunk_tokens > 0:
            t += self.prefill_base_ms + self.prefill_per_token_ms * chunk_tokens
        return t

    def chunk_estimate(self, n_decodes: int, budget_ms: float) -> int:
        """Closed-form guess of the largest c > 0 with T(n, c) <= budget (may be off by one).

        The policy checks the guess against T itself, so it only saves search steps.
        """
        if self.prefill_per_token_ms <= 0 or budget_ms == math.inf:
            return 1 << 62  # no finite deadline (e.g. decodes whose deadline is not tracked): any chunk fits
        room = budget_ms - self.base_ms - self.prefill_base_ms
        if n_decodes > 0:
            room -= self.decode_base_ms + self.decode_per_req_ms * n_decodes
        # The nudge turns 699.9999 (float for an exact 700) into 700; one too many is fine:
        # the policy checks the guess and its neighbour.
        return int(room / self.prefill_per_token_ms + 1e-6) if room > 0 else 0
