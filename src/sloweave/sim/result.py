"""What one simulated run produced (plain data the metrics read)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sloweave.core.slo import SLOException
from sloweave.sim.workloads import Workload

NOT_STARTED = -1


@dataclass(frozen=True)
class SimResult:
    """What one simulated run produced. Times are milliseconds from the workload's t = 0."""

    workload: Workload
    policy_name: str
    tpot_ms: float
    # per iteration
    iter_start_ms: np.ndarray
    iter_end_ms: np.ndarray
    iter_decodes: np.ndarray
    iter_chunk_tokens: np.ndarray
    iter_budget_ms: np.ndarray  # +inf when nothing was decoding
    iter_infeasible: np.ndarray
    # prefill pieces: in iteration prefill_iter[k], request prefill_request[k] got prefill_tokens[k]
    prefill_iter: np.ndarray
    prefill_request: np.ndarray
    prefill_tokens: np.ndarray
    # per request
    first_token_iter: np.ndarray  # iteration that completed the prefill, -1 if never
    finished: np.ndarray  # bool: emitted all its output tokens
    horizon_ms: float  # simulation stopped here (inf when it ran until every request finished)
    # ---- options beyond the paper (defaults: nothing happened) ----
    # per request: why admission refused it ("" = not rejected); deferred ones are served later
    rejected_reason: np.ndarray | None = None
    deferred_reason: np.ndarray | None = None
    slo_exceptions: tuple[SLOException, ...] = ()
    preemptions: int = 0
    recompute_tokens: int = 0  # prompt + generated tokens prefilled again after preemptions
    # preempted requests only: the (first, last) iterations of each run of tokens, in order
    token_segments: dict = field(default_factory=dict)
    deadline_form: str = "per-token"

    @property
    def num_iterations(self) -> int:
        return int(self.iter_end_ms.shape[0])

    @property
    def makespan_ms(self) -> float:
        return float(self.iter_end_ms[-1]) if self.num_iterations else 0.0

    def token_iterations(self, request: int) -> np.ndarray:
        """Iterations at whose end ``request`` emitted its tokens (first token first)."""
        segments = self.token_segments.get(request)
        if segments is not None:
            return (
                np.concatenate([np.arange(a, b + 1) for a, b in segments]) if segments else np.empty(0, dtype=np.int64)
            )
        first = int(self.first_token_iter[request])
        if first == NOT_STARTED:
            return np.empty(0, dtype=np.int64)
        out = int(self.workload.output_tokens[request])
        return np.arange(first, min(first + out, self.num_iterations))

    def token_times_ms(self, request: int) -> np.ndarray:
        """Emission times of the tokens request ``request`` emitted (first token first)."""
        return self.iter_end_ms[self.token_iterations(request)]

    def status(self) -> np.ndarray:
        """'finished', 'rejected' (by admission control) or 'pending' (queued or running at the horizon)."""
        status = np.where(self.finished, "finished", "pending")
        if self.rejected_reason is not None:
            status = np.where(self.rejected_reason != "", "rejected", status)
        return status
